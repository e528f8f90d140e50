"""Stream one reply from the embedded model, then ask again: the second run resumes.

Run: .venv/bin/python examples/generate.py
"""

from mlxcache import CacheConfig, Request, SamplingParams, open_engine
from mlxcache.events import Done, Token

# Block size 16 (the CPU default; 256 on Metal) lets a short prompt resume. Asked again, the
# same prompt resumes whole: its tail past the last full block is remembered in memory.
engine = open_engine(cache_config=CacheConfig(block_size=16, disk_bytes=0))
ids = engine.encoder.encode_chat([{"role": "user", "content": "What is the capital of France?"}])

for attempt in ("cold", "warm"):
    for event in engine.generate(Request(ids, SamplingParams(max_tokens=12))):
        if isinstance(event, Token):
            print(event.text, end="", flush=True)
        elif isinstance(event, Done):
            stats = event.result.stats
            print(
                f"\n[{attempt}] {stats.cached_tokens}/{stats.prompt_tokens} prompt tokens from the cache"
            )
