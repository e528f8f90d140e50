"""`python -m mlxcache.bench.child MODEL CACHE_DIR BLOCK_SIZE MESSAGES_JSON`: one request in a
process of its own (benchmarks measure a second process resuming from the disk tier).
Prints the request's stats as one JSON line."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from mlxcache.config import CacheConfig
from mlxcache.engine import Request
from mlxcache.runtime import open_engine
from mlxcache.sampling import SamplingParams


def main(argv: list[str]) -> None:
    model, directory, block_size, messages = argv
    config = CacheConfig(block_size=int(block_size), directory=Path(directory))
    engine = open_engine(model or None, config)
    ids = engine.encoder.encode_chat(json.loads(Path(messages).read_text()))
    result = engine.complete(Request(ids, SamplingParams(max_tokens=4)))
    sys.stdout.write(json.dumps(result.stats.as_dict()) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
