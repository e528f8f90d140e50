"""The guarantee on the embedded model: warm == cold, concurrent == solo, new process == cold."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from spy import spied

from mlxcache.cache.store import PromptCache
from mlxcache.config import CacheConfig
from mlxcache.engine import Engine, Request
from mlxcache.events import Done
from mlxcache.model import LoadedModel
from mlxcache.sampling import SamplingParams

pytestmark = pytest.mark.model
B = 16
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_warm_equals_cold_and_lanes_equal_solo(smol: LoadedModel, tmp_path: Path) -> None:
    config = CacheConfig(block_size=B, directory=tmp_path)
    loaded, spy = spied(smol)
    engine = Engine(loaded, PromptCache(loaded.model, loaded.key, config, root=tmp_path / "kv"))
    ids = engine.encoder.encode_chat(QUESTION)  # 37 tokens
    params = SamplingParams(max_tokens=8)
    cold = engine.complete(Request(ids, params))
    cold_calls, cold_logits = list(spy.calls), spy.last_logits[2]
    spy.reset()
    warm = engine.complete(Request(ids, params))  # the same prompt: resumed whole
    assert (cold.stats.cached_tokens, warm.stats.cached_tokens) == (0, 37)
    assert warm.text == cold.text == "The capital of France is Paris."
    assert warm.tokens == cold.tokens
    assert cold_calls[:3] == [(0, 16), (16, 16), (32, 5)]
    assert spy.calls == cold_calls[3:]  # its decode steps only
    with engine.cache.restore(np.asarray(ids, dtype=np.int32)) as resume:
        pass
    assert resume.length == 37 and mx.array_equal(resume.logits, cold_logits)

    # A longer prompt resumes at the last full block and makes the cold run's calls.
    longer = engine.encoder.encode_chat([*QUESTION, {"role": "assistant", "content": "Paris."}])
    cold_longer = Engine(smol, block_size=B).complete(Request(longer, params))
    spy.reset()
    resumed = engine.complete(Request(longer, params))
    assert resumed.stats.cached_tokens == 32 and resumed.tokens == cold_longer.tokens
    assert spy.calls[0] == (32, min(B, len(longer) - 32))

    # Two requests at once (sharing the cached prefix) each get their solo reply.
    other = engine.encoder.encode_chat(
        [{"role": "user", "content": "What is the capital of Italy?"}]
    )
    solo_other = Engine(smol, block_size=B).complete(Request(other, params))
    ids_a, ids_b = engine.submit(Request(ids, params)), engine.submit(Request(other, params))
    done = {e.request_id: e.result for e in engine.run() if isinstance(e, Done)}
    assert done[ids_a].tokens == cold.tokens and done[ids_b].tokens == solo_other.tokens
    assert done[ids_b].stats.cached_tokens == 16  # the shared system prompt

    # A new process resumes from the disk tier and prints the same bytes.
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "mlxcache_cli",
            "generate",
            "What is the capital of France?",
            "-n",
            "8",
            "--block-size",
            str(B),
            "--cache-dir",
            str(tmp_path),
            "--json",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    doc = json.loads(out.stdout)
    assert doc["stats"]["cached_tokens"] == 32
    assert doc["tokens"] == cold.tokens and doc["text"] == cold.text
