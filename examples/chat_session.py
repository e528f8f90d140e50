"""A two-turn chat session; each turn resumes the conversation from the prompt cache.

Run: .venv/bin/python examples/chat_session.py
"""

import tempfile
from pathlib import Path

from mlxcache import CacheConfig, SamplingParams, open_engine
from mlxcache.events import Done
from mlxcache.modes import chat

engine = open_engine(cache_config=CacheConfig(block_size=16, disk_bytes=0))
session = chat.ChatSession(
    system="Answer in one short sentence.", sampling=SamplingParams(max_tokens=16)
)

for question in ("What is the capital of France?", "And of Spain?"):
    for event in session.ask(engine, question):
        if isinstance(event, Done):
            s = event.result.stats
            print(f"user: {question}\nassistant: {event.result.text}")
            print(f"  ({s.cached_tokens}/{s.prompt_tokens} prompt tokens from the cache)")

# Sessions save atomically and reopen with `mlxcache chat --resume NAME`.
with tempfile.TemporaryDirectory() as d:
    chat.save(session, Path(d), "demo")
    print(f"saved and reloaded {len(chat.load(Path(d), 'demo').turns)} turns")
