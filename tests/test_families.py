"""The architecture matrix: every mlx-lm family kind resumes block by block, exactly.

Tiny random instances of mlx-lm's own model classes (mlxcache/bench/families.py) run the exactness
checks of tests/guarantees.py: each reply equal to a cold run's, bit for bit (logits
included), resumed where the cache geometry says, from memory, disk and after a fork.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import cast

import mlx.core as mx
import numpy as np
import pytest
from guarantees import (
    GREEDY,
    B,
    Rig,
    Variant,
    check_cancelled_decode,
    check_chat,
    check_disk,
    check_follow,
    check_fork,
    check_restore_repeatedly,
    check_warm,
    prompt,
)

from mlxcache.bench.families import FAMILIES, build
from mlxcache.cache.base import Lease, NoCache
from mlxcache.cache.layout import nbytes as block_nbytes
from mlxcache.cache.memory import MemoryTier
from mlxcache.cache.store import PromptCache
from mlxcache.config import CacheConfig
from mlxcache.engine import Engine, Request
from mlxcache.events import Event, Token
from mlxcache.model import LoadedModel, load

CHECKS: list[Callable[[Rig], None]] = [
    check_warm,
    check_fork,
    check_chat,
    check_disk,
    check_restore_repeatedly,
    check_follow,
    check_cancelled_decode,
]


@pytest.fixture(scope="module")
def family_models(
    tiny: LoadedModel, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Variant]:
    root = tmp_path_factory.mktemp("families")
    return {
        name: Variant.of(name, load(str(build(root / name, tiny.path, config))), False)
        for name, config in FAMILIES.items()
    }


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__.removeprefix("check_"))
# lfm2 is the exactness matrix's recurrent variant (tests/test_exactness.py): not run twice.
@pytest.mark.parametrize("family", sorted(set(FAMILIES) - {"lfm2"}))
def test_family(
    family: str,
    check: Callable[[Rig], None],
    family_models: dict[str, Variant],
    tmp_path: Path,
) -> None:
    variant = family_models[family]
    assert variant.trimmable, f"{family} has no block layout"
    check(Rig(variant, tmp_path))


def _states(directory: Path) -> list[Path]:
    return sorted((directory / "kv" / "files").glob("*.s.safetensors"))


def _cached_engine(variant: Variant, directory: Path, stride: int | None) -> Engine:
    loaded = variant.loaded
    config = CacheConfig(block_size=B, directory=directory, state_stride=stride)
    return Engine(loaded, PromptCache(loaded.model, loaded.key, config, root=directory / "kv"))


def test_recurrent_state_every_other_block(
    family_models: dict[str, Variant], tmp_path: Path
) -> None:
    """With a state stride of 2, a gated-delta hybrid keeps its state after blocks 2, 4, 6
    and after the prompt's last block (7) on disk, and after every block in memory (the
    states between strides fit their share of the budget); a fork resumes at the last
    state it shares, and keeps the state where it left the prompt on disk too, so the next
    fork there resumes there in another process."""
    variant = family_models["qwen3_next"]
    engine = _cached_engine(variant, tmp_path, 2)
    cold = Engine(variant.loaded, NoCache(variant.loaded.model, B))
    p = prompt(30)
    engine.complete(Request(p, GREEDY))
    assert len(_states(tmp_path)) == 4
    for tokens, resumed in [
        (p[:23] + prompt(5, seed=3), 20),  # shares 5 blocks: block 5's state is in memory
        (p[:29] + prompt(4, seed=4), 28),  # shares all 7: the last has its state
        (p, 30),  # the same prompt: its tail
    ]:
        got = engine.complete(Request(tokens, GREEDY))
        assert got.stats.cached_tokens == resumed
        assert got.tokens == cold.complete(Request(tokens, GREEDY)).tokens
    # A new process (a new cache on the directory) resumes there from disk; a fork that
    # shares block 6 but not 7 backs off to 24 (block 6's state was never written).
    reopened = _cached_engine(variant, tmp_path, 2)
    for tokens, resumed in [(p[:23] + prompt(6, seed=5), 20), (p[:27] + prompt(3, seed=6), 24)]:
        got = reopened.complete(Request(tokens, GREEDY))
        assert got.stats.cached_tokens == resumed
        assert got.tokens == cold.complete(Request(tokens, GREEDY)).tokens


def test_measured_state_stride(family_models: dict[str, Variant], tmp_path: Path) -> None:
    """By default a hybrid's stored states cost at most a quarter of what its blocks' KV
    costs: the stride is ceil(4 * state bytes / block KV bytes), and the last block always
    keeps its state."""
    variant = family_models["qwen3_next"]
    engine = _cached_engine(variant, tmp_path, None)
    engine.complete(Request(prompt(30), GREEDY))
    files = sorted((tmp_path / "kv" / "files").glob("*.safetensors"))
    states = _states(tmp_path)
    blocks = [f for f in files if f not in states]

    def size(path: Path) -> int:
        arrays = mx.load(str(path))
        assert isinstance(arrays, dict)
        return sum(int(a.nbytes) for a in arrays.values())

    stride = -(-4 * size(states[0]) // size(blocks[0]))
    assert stride > 1  # a gated-delta state outweighs a block of 4 tokens' KV
    assert len(blocks) == 7
    assert len(states) == len({j for j in range(7) if (j + 1) % stride == 0} | {6})


def test_prefill_stages_states_between_strides_within_their_budget(
    family_models: dict[str, Variant], tmp_path: Path
) -> None:
    """A prefill stages each block's recurrent state as its chunk ends (the layers do not
    hold it later). States between strides are extras: kept in memory only, within their
    share of the budget; past it the oldest staged extra lets go of its state as the next
    is staged (one state per block of a long prompt would be gigabytes on a real hybrid).
    Stride 2 keeps blocks 2, 4, 6 and the last (7); extras: 1, 3, 5."""
    variant = family_models["qwen3_next"]
    cold = Engine(variant.loaded, NoCache(variant.loaded.model, B))

    def staged_states(directory: Path, budget_states: int | None) -> list[list[int]]:
        engine = _cached_engine(variant, directory, 2)
        mem = cast(PromptCache, engine.cache).mem
        layout = mem.layout
        assert layout is not None
        capture, seen = mem.capture, []

        def counting(tokens: np.ndarray, lease: Lease) -> None:
            capture(tokens, lease)
            staged = lease.staged
            if budget_states is not None and len(staged) == 1:  # one state's size, learned
                mem.extra_budget = budget_states * block_nbytes(layout.split(staged[0])[1])
            seen.append(sorted(j for j, piece in staged.items() if layout.split(piece)[1]))

        mem.capture = counting  # type: ignore[method-assign]
        got = engine.complete(Request(prompt(30), GREEDY))
        assert got.tokens == cold.complete(Request(prompt(30), GREEDY)).tokens
        assert len(_states(directory)) == 4  # on disk: blocks 2, 4, 6 (stride), 7 (the last)
        return seen

    assert staged_states(tmp_path / "roomy", None) == [list(range(k + 1)) for k in range(7)]
    assert staged_states(tmp_path / "one", 1) == [
        [0],
        [0, 1],
        [0, 1, 2],
        [1, 2, 3],
        [1, 2, 3, 4],
        [1, 3, 4, 5],
        [1, 3, 4, 5, 6],
    ]


def _kept_with_stride_2(
    variant: Variant, directory: Path
) -> tuple[Engine, Engine, MemoryTier, list[int]]:
    """A cached engine (state stride 2) that has kept a 30-token prompt, a cold engine,
    the memory tier and the prompt."""
    engine = _cached_engine(variant, directory, 2)
    p = prompt(30)
    engine.complete(Request(p, GREEDY))
    cold = Engine(variant.loaded, NoCache(variant.loaded.model, B))
    return engine, cold, cast(PromptCache, engine.cache).mem, p


def test_states_between_strides_go_before_entries(
    family_models: dict[str, Variant], tmp_path: Path
) -> None:
    """Under memory pressure the extras are dropped (oldest first) before any entry is
    evicted; their entries then resume at the kept state before, bit for bit as cold."""
    engine, cold, mem, p = _kept_with_stride_2(family_models["qwen3_next"], tmp_path)
    extras = list(mem._extra)
    assert len(extras) == 3 and len(mem) == 1  # blocks 1, 3, 5's states; one entry
    tails = mem._tails.nbytes  # remembered tails go first
    mem.reserve(mem.budget - mem.nbytes + tails + 1)  # a byte more: the oldest extra goes
    assert list(mem._extra) == extras[1:] and len(mem) == 1
    fork = p[:7] + prompt(9, seed=2)  # shares block 1 only: its state is gone, back to 0
    got = engine.complete(Request(fork, GREEDY))
    assert got.stats.cached_tokens == 0
    assert got.tokens == cold.complete(Request(fork, GREEDY)).tokens


def test_state_stride_option(family_models: dict[str, Variant], tmp_path: Path) -> None:
    """`--state-stride 1` keeps a hybrid's state after every block of the prompt; by
    default (measured) fewer; 0 is refused with one line naming the flag."""
    from typer.testing import CliRunner

    from mlxcache_cli.main import app

    folder = str(family_models["qwen3_next"].loaded.path)
    text = "the quick brown fox jumps over the lazy dog " * 3

    def kept(*stride: str) -> tuple[int, int]:
        where = tmp_path / f"cache{len(stride)}"
        args = ["generate", "--raw", text, "-m", folder, "-n", "1", "--block-size", str(B)]
        result = CliRunner().invoke(app, [*args, "--cache-dir", str(where), *stride])
        assert result.exit_code == 0, result.output
        files = sorted((where / "kv" / "files").glob("*.safetensors"))
        states = [f for f in files if f.name.endswith(".s.safetensors")]
        return len(files) - len(states), len(states)

    blocks, states = kept("--state-stride", "1")
    assert blocks >= 6 and states == blocks
    default = kept()
    assert default[0] == blocks and 1 <= default[1] < blocks // 4  # a state outweighs 4 tokens' KV
    refused = CliRunner().invoke(app, ["generate", "hi", "--state-stride", "0"])
    assert refused.exit_code == 2
    assert refused.output.splitlines()[-1] == "error: --state-stride must be >= 1, got 0"


def test_a_resume_from_a_state_between_strides_survives_the_room_it_makes(
    family_models: dict[str, Variant], tmp_path: Path
) -> None:
    """A fork resumes from a state between strides (block 5) in a full memory tier: the
    room its prefill needs drops every extra, that one included, after its layers hold it."""
    engine, cold, mem, p = _kept_with_stride_2(family_models["qwen3_next"], tmp_path)
    extras = sum(mem._blocks[name].nbytes for name in mem._extra)
    tails = mem._tails.nbytes
    # No room but theirs: a prefill's room takes every tail and every extra, and no entry
    # (the only one is the one it resumes from).
    mem.budget = mem.nbytes - tails - extras
    fork = Request(p[:23] + prompt(5, seed=3), GREEDY, logprobs=4)

    def scored(engine: Engine) -> tuple[int, list[tuple[int, float | None, object]]]:
        events: list[Event] = []
        result = engine.complete(fork, on_event=events.append)
        drawn = [(e.token, e.logprob, e.top_logprobs) for e in events if isinstance(e, Token)]
        return result.stats.cached_tokens, drawn

    # Log-probabilities, bit for bit: the tiny model draws the same tokens from a wrong
    # recurrent state too.
    assert scored(engine) == (20, scored(cold)[1])
    assert not mem._extra
