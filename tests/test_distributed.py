"""A model sharded over local ranks (MLX's ring backend over loopback, as `mlx.launch -n N
--backend ring` runs it): tensor parallel over 2 ranks (the tiny llama's 2 KV heads) and
3 (SmolLM2's 3), pipeline over 2 stages (a tiny Qwen3-Next), with each rank's own cache.

Exact under the same topology: a resumed reply is the cold one, bit for bit, and so is a
reply that ran beside others; a lookup that finds another length on some rank resumes
nothing. A rank that dies stops the others with one error line. Every rank is started by
the `ranks` fixture, which kills whatever still runs when the test ends.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from mlxcache.bench.families import FAMILIES, build
from mlxcache.launch import local_ranks
from mlxcache.model import LoadedModel

pytestmark = pytest.mark.slow  # every test starts two or three model processes

TIMEOUT = 240  # generous: a hang (ranks out of step) fails the test instead of the suite
Ranks = Callable[..., list["subprocess.Popen[str]"]]
CLI = [sys.executable, "-m", "mlxcache_cli"]


@pytest.fixture
def ranks(tmp_path: Path) -> Iterator[Ranks]:
    """Start `size` ranks of an mlxcache command (stdout and stderr piped)."""
    started: list[subprocess.Popen[str]] = []

    def start(
        size: int, args: list[str], envs: list[dict[str, str]] | None = None
    ) -> list[subprocess.Popen[str]]:
        hostfile = tmp_path / f"hosts-{len(started)}.json"
        procs = local_ranks(
            [*CLI, *args],
            size,
            hostfile,
            envs,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        started.extend(procs)
        return procs

    try:
        yield start
    finally:
        for proc in started:
            proc.kill()  # no-op for one that has exited
            proc.communicate()


@pytest.fixture(scope="module")
def qwen3_next(tiny: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen3-Next (mlx-lm's class): pipeline stages, no tensor split."""
    return build(tmp_path_factory.mktemp("qnext") / "model", tiny.path, FAMILIES["qwen3_next"])


def _generate_args(model: Path, prompt: str, *extra: str) -> list[str]:
    return [
        "generate",
        "--model",
        str(model),
        "--raw",
        "--json",
        "--quiet",
        "--max-tokens",
        "6",
        "--temp",
        "1",
        "--seed",
        "3",
        "--block-size",
        "4",
        *extra,
        prompt,
    ]


def finish(procs: list[subprocess.Popen[str]]) -> list[tuple[int, str, str]]:
    """Wait for every rank: (exit code, stdout, stderr) each, rank 0 first."""
    outs = [p.communicate(timeout=TIMEOUT) for p in procs]
    return [(p.returncode, out, err) for p, (out, err) in zip(procs, outs, strict=True)]


def run(ranks: Ranks, size: int, args: list[str], envs: Any = None) -> dict[str, Any]:
    """Rank 0's JSON reply; every rank must exit 0 and the others print nothing."""
    done = finish(ranks(size, args, envs))
    assert [code for code, _, _ in done] == [0] * size, done
    assert [out for _, out, _ in done[1:]] == [""] * (size - 1)
    return dict(json.loads(done[0][1]))


PROMPT = "hello world this is a test"  # 25 tokens of the tiny byte tokenizer: 6 blocks of 4


def test_tensor_two_ranks_resume_exactly_and_apart_from_one_process(
    tiny: LoadedModel, tmp_path: Path, ranks: Ranks
) -> None:
    args = _generate_args(tiny.path, PROMPT, "--cache-dir", str(tmp_path / "c"))
    cold = run(ranks, 2, args)
    assert cold["stats"]["cached_tokens"] == 0 and len(cold["tokens"]) == 6
    resumed = run(ranks, 2, args)
    assert resumed["stats"]["cached_tokens"] == 24
    assert resumed["stats"]["cached_from"] == "disk"
    assert resumed["tokens"] == cold["tokens"]
    fresh = run(ranks, 2, _generate_args(tiny.path, PROMPT, "--no-cache"))
    assert fresh["tokens"] == cold["tokens"] and fresh["stats"]["miss_reason"] == "cache off"
    # One process on the same cache directory: the shards' entries are not its own ...
    assert _alone(args)["stats"]["cached_tokens"] == 0
    # ... nor its entries theirs (another prompt: one process first, then the shards).
    other = _generate_args(tiny.path, PROMPT.upper(), "--cache-dir", str(tmp_path / "c"))
    assert _alone(other)["stats"]["cached_tokens"] == 0
    assert run(ranks, 2, other)["stats"]["cached_tokens"] == 0
    listed = subprocess.run(
        [*CLI, "cache", "ls", "--json", "--cache-dir", str(tmp_path / "c")],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    models = sorted({row["model"] for row in json.loads(listed.stdout)})
    name = tiny.path.name
    assert models == [name, f"{name} (tensor2-rank0)", f"{name} (tensor2-rank1)"]


def test_two_ranks_draft_and_reply_as_plain(
    tiny: LoadedModel, tmp_path: Path, ranks: Ranks
) -> None:
    """Every rank drafts the same (lookup over the shared picks, or rank 0's draft model's
    drafts sent to the others) and verifies together; the reply is the plain one, cold and
    with the draft model's prompt resumed from its cache. A draft model of another
    vocabulary is one error line on every rank."""
    prompt = "ab ab ab ab ab ab ab"
    args = _generate_args(tiny.path, prompt, "--no-cache", "--max-tokens", "12")
    plain = run(ranks, 2, [*args, "--draft", "off"])
    drafted = run(ranks, 2, [*args, "--draft", "lookup"])
    assert drafted["tokens"] == plain["tokens"] and drafted["text"] == plain["text"]
    assert drafted["stats"]["draft"] == "lookup" and drafted["stats"]["verify_forwards"] > 0
    sampled = run(ranks, 2, [*args, "--draft", "model", "--draft-model", str(tiny.path)])
    assert sampled["tokens"] == plain["tokens"] and sampled["stats"]["verify_forwards"] > 0
    # Greedy, so that the tiny model drafting for itself has most drafts accepted.
    greedy = [*args, "--temp", "0"]
    plain = run(ranks, 2, [*greedy, "--draft", "off"])
    cached = [*greedy, "--cache-dir", str(tmp_path / "c"), "--draft", "model"]
    cached += ["--draft-model", str(tiny.path)]
    for _ in range(2):  # cold, then the draft model's prompt resumed from its cache
        by_model = run(ranks, 2, cached)
        assert by_model["tokens"] == plain["tokens"] and by_model["text"] == plain["text"]
        stats = by_model["stats"]
        assert stats["draft"] == "model" and stats["accepted_tokens"] > stats["drafted_tokens"] // 2
    other = build(tmp_path / "other", tiny.path, FAMILIES["qwen3"], vocab_size=300)
    tokenizer = other / "tokenizer.json"  # one token spelt otherwise: another vocabulary
    tokenizer.write_text(tokenizer.read_text().replace('"<|im_end|>"', '"<|im_stop|>"'))
    refused = finish(ranks(2, [*args, "--draft-model", str(other)]))
    assert [code for code, _, _ in refused] == [2, 2], refused
    assert all("does not share" in err and err.startswith("error: ") for _, _, err in refused)


def _alone(args: list[str]) -> dict[str, Any]:
    """The JSON reply of one process (no launcher)."""
    done = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 0, done.stderr
    return dict(json.loads(done.stdout))


def test_a_rank_missing_its_blocks_makes_every_rank_prefill(
    tiny: LoadedModel, tmp_path: Path, ranks: Ranks
) -> None:
    """Rank 1 loses its cache between two runs: rank 0 still has the prompt's blocks, and
    resuming them alone would put the ranks out of step (a partial resume): both prefill."""
    args = _generate_args(tiny.path, PROMPT)
    same = [
        {"MLXCACHE_CACHE_DIR": str(tmp_path / "r0")},
        {"MLXCACHE_CACHE_DIR": str(tmp_path / "r1")},
    ]
    cold = run(ranks, 2, args, same)
    lost = [same[0], {"MLXCACHE_CACHE_DIR": str(tmp_path / "empty")}]
    again = run(ranks, 2, args, lost)
    assert again["stats"]["cached_tokens"] == 0
    assert again["tokens"] == cold["tokens"]
    both = run(ranks, 2, args, same)  # rank 1 kept its blocks: both resume
    assert both["stats"]["cached_tokens"] == 24 and both["tokens"] == cold["tokens"]


def test_pipeline_two_stages_resume_exactly(qwen3_next: Path, tmp_path: Path, ranks: Ranks) -> None:
    args = _generate_args(qwen3_next, PROMPT, "--split", "pipeline", "--cache-dir", str(tmp_path))
    cold = run(ranks, 2, args)
    resumed = run(ranks, 2, args)
    assert cold["stats"]["cached_tokens"] == 0 and resumed["stats"]["cached_tokens"] == 24
    assert resumed["tokens"] == cold["tokens"] and len(cold["tokens"]) == 6


def test_a_split_the_model_cannot_take_is_one_error_line(
    tiny: LoadedModel, qwen3_next: Path, ranks: Ranks
) -> None:
    cases = [  # 3 ranks cannot share the tiny llama's 2 KV heads; Qwen3-Next has no tensor split
        (
            3,
            tiny.path,
            (),
            "num_attention_heads (4) divisible by 3: run fewer ranks or --split pipeline",
        ),
        (2, qwen3_next, ("--split", "tensor"), "cannot be split by tensor (--split)"),
    ]
    for size, model, extra, said in cases:
        for code, out, err in finish(ranks(size, _generate_args(model, PROMPT, *extra))):
            assert code == 2 and out == "", err
            assert err.count("\n") == 1 and err.startswith("error: ") and said in err, err


def test_a_request_refused_on_rank_0_is_one_error_line_and_the_others_end_quietly(
    tiny: LoadedModel, ranks: Ranks
) -> None:
    too_long = "x" * 300  # the tiny model's context is 256 tokens, one per byte
    (code, out, err), (code1, out1, err1) = finish(ranks(2, _generate_args(tiny.path, too_long)))
    assert code == 2 and out == "" and err.startswith("error: ") and err.count("\n") == 1, err
    assert "context" in err
    assert (code1, out1, err1) == (0, "", "")


def test_json_mode_over_two_ranks(tiny: LoadedModel, tmp_path: Path, ranks: Ranks) -> None:
    """The grammar runs on rank 0 only; the others still make their collectives in its
    order (a decode with processors picks later), and every reply is rank 0's."""
    schema = tmp_path / "schema.json"
    schema.write_text(
        '{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}'
    )
    args = ["json", "--model", str(tiny.path), "--schema", str(schema), "--max-tokens", "30"]
    args += ["--block-size", "4", "--cache-dir", str(tmp_path / "c"), "give a"]
    replies = []
    for _ in range(2):
        done = finish(ranks(2, args))
        assert [code for code, _, _ in done] == [0, 0], done
        assert done[1][1] == ""
        replies.append(done[0][1])
    assert replies[0] == replies[1] and isinstance(json.loads(replies[0])["a"], int)
    # The tiny model's greedy reply does not depend on the split's order of sums, and
    # rank 1 (no grammar) reproduces it only with rank 0's tokens: its KV must hold them.
    alone = subprocess.run(
        [*CLI, *args[:-3], "--no-cache", "give a"], capture_output=True, text=True, timeout=TIMEOUT
    )
    assert alone.returncode == 0 and alone.stdout == replies[0], alone.stderr


@pytest.mark.model
def test_smollm2_over_three_ranks(smol: LoadedModel, tmp_path: Path, ranks: Ranks) -> None:
    """SmolLM2's 3 KV heads, one per rank: the real model's reply, cold then resumed."""
    args = _generate_args(smol.path, "The capital of France is", "--cache-dir", str(tmp_path))
    args[args.index("--temp") + 1] = "0"
    args[args.index("--max-tokens") + 1] = "3"
    cold = run(ranks, 3, args)
    resumed = run(ranks, 3, args)
    assert resumed["stats"]["cached_tokens"] == 4
    assert resumed["tokens"] == cold["tokens"]
    assert cold["text"].startswith(" Paris")


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=TIMEOUT) as reply:
        return dict(json.loads(reply.read()))


def _wait_for(url: str, procs: list[subprocess.Popen[str]]) -> None:
    while True:  # bounded by the ranks: a rank that fails ends the wait
        try:
            with urllib.request.urlopen(url, timeout=5):
                return
        except OSError:
            if any(p.poll() is not None for p in procs):
                raise AssertionError(finish(procs)) from None
            time.sleep(0.2)


def _serve(
    ranks: Ranks, model: Path, cache: Path, size: int, split: str
) -> tuple[str, list[subprocess.Popen[str]]]:
    port = _free_port()
    args = ["serve", "--model", str(model), "--port", str(port), "--block-size", "4"]
    # Two lanes: requests wait while follow lanes have work, so steps are told with
    # `background` False (a keyword the others must get too).
    args += ["--max-lanes", "2", "--split", split, "--cache-dir", str(cache)]
    procs = ranks(size, args)
    base = f"http://127.0.0.1:{port}"
    _wait_for(f"{base}/health", procs)
    return base, procs


def _one_error_line(err: str) -> str:
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in err, err
    return errors[0]


@pytest.mark.parametrize(("split", "size"), [("tensor", 2), ("pipeline", 3)])
def test_serve_concurrent_equals_solo_and_a_lost_rank_stops_it(
    split: str,
    size: int,
    tiny: LoadedModel,
    qwen3_next: Path,
    tmp_path: Path,
    ranks: Ranks,
) -> None:
    model = tiny.path if split == "tensor" else qwen3_next  # 2 KV heads; 4 layers
    base, procs = _serve(ranks, model, tmp_path, size, split)

    def body(i: int, tokens: int = 8, stream: bool = False) -> dict[str, Any]:
        return {
            "model": model.name,
            "messages": [{"role": "user", "content": f"request {i}: say something"}],
            "max_tokens": tokens,
            "temperature": 0.8,
            "seed": i,
            "stream": stream,
        }

    def ask(i: int) -> tuple[str, int]:
        reply = _post(f"{base}/v1/chat/completions", body(i))
        usage = reply["usage"]
        uncached = usage["prompt_tokens"] - usage["prompt_tokens_details"]["cached_tokens"]
        return reply["choices"][0]["message"]["content"], uncached

    solo = [ask(i) for i in range(5)]
    assert all(uncached > 0 for _, uncached in solo)
    with ThreadPoolExecutor(5) as pool:
        together = list(pool.map(ask, range(5)))
    assert [text for text, _ in together] == [text for text, _ in solo]
    assert [uncached for _, uncached in together] == [0] * 5  # each resumed its whole prompt
    report = json.loads(urllib.request.urlopen(f"{base}/v1/cache", timeout=TIMEOUT).read())
    assert report["topology"] == f"{split}{size}-rank0"

    # Rank 1 dies while a reply streams: rank 0 stops, in one error line.
    request = urllib.request.Request(
        f"{base}/v1/chat/completions",
        json.dumps(body(4, 200, stream=True)).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=TIMEOUT) as stream:
        while b'"content"' not in stream.readline():  # the reply has begun
            pass
        procs[1].kill()
        with contextlib.suppress(OSError):
            stream.read()  # its end: an error event, or the connection closed
    code, _, err = finish(procs)[0]
    assert code == 1
    assert "rank" in _one_error_line(err)

    # Nothing that run kept is wrong: the same requests again, resumed, as before.
    base, procs = _serve(ranks, model, tmp_path, size, split)
    assert [ask(i)[0] for i in (0, 4)] == [solo[0][0], solo[4][0]]
    procs[0].kill()  # rank 0 dies: the others stop too
    for code, out, err in finish(procs)[1:]:
        assert code == 1 and out == ""
        assert "stopped" in _one_error_line(err)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_distributed_bench_reports_each_size_and_skips_one_the_model_cannot_take(
    tiny: LoadedModel,
) -> None:
    from mlxcache.bench import distributed_bench

    result = distributed_bench.run(str(tiny.path), (1, 2, 3), block_size=4, tokens=3)
    runs = result["ranks"]
    assert "divisible by 3" in runs["3"]["skipped"]  # the tiny llama's 2 KV heads
    assert runs["2"]["resumed_equals_cold"] and runs["2"]["ranks_agree"]
    assert len(runs["2"]["cache_per_rank"]) == 2 and runs["2"]["cache_per_rank"][0]["hits"] == 2
    assert runs["1"]["vs_one_process"] == {
        "ttft_cold_s": 1.0,
        "ttft_resumed_s": 1.0,
        "decode_tps": 1.0,
    }
    assert set(runs["2"]["vs_one_process"]) == {"ttft_cold_s", "ttft_resumed_s", "decode_tps"}
    assert result["goals"] == {"resumed_equals_cold": True, "ranks_agree": True, "some_run": True}


def test_a_split_outside_mlx_launch_is_a_warning(tiny: LoadedModel) -> None:
    args = _generate_args(tiny.path, PROMPT, "--split", "tensor", "--no-cache")
    alone = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=TIMEOUT)
    assert alone.returncode == 0
    warning = "warning: a split (--split) is for runs under mlx.launch: ignored"
    assert alone.stderr.splitlines()[0] == warning
    assert len(json.loads(alone.stdout)["tokens"]) == 6


def test_every_call_rank_0_tells_is_one_the_engine_marks_and_followers_replay() -> None:
    """The table of told calls and the engine agree: a renamed engine method fails here,
    not in a follower at run time; a follower refuses any other call in one error."""
    from mlxcache.engine import Engine
    from mlxcache.errors import RankError
    from mlxcache.peers import TOLD, replay

    for op in TOLD:
        assert callable(getattr(Engine, op, None)) and hasattr(getattr(Engine, op), "__wrapped__")
    told = {name for name, f in vars(Engine).items() if hasattr(f, "__wrapped__")}
    assert told == TOLD
    engine = object.__new__(Engine)
    assert replay(engine, "cancel_warm").__func__ is Engine.cancel_warm  # type: ignore[attr-defined]
    with pytest.raises(RankError, match="rank 0 asked for engine call 'complete', which no rank"):
        replay(engine, "complete")


def test_a_rank_that_found_another_length_makes_every_rank_resume_nothing(
    tiny: LoadedModel, tmp_path: Path
) -> None:
    """`AgreedCache` over collectives played here: rank 0's lookup against a peer's. The
    same length resumes; another makes this rank resume nothing (its lease released, no
    entry pinned), at once, with no wait for a peer."""
    import numpy as np

    from mlxcache.cache.store import PromptCache
    from mlxcache.config import CacheConfig
    from mlxcache.distributed import AgreedCache, Ranks
    from mlxcache.engine import Engine, Request
    from mlxcache.sampling import SamplingParams

    config = CacheConfig(block_size=4, directory=tmp_path, disk_bytes=0)
    inner = PromptCache(tiny.model, tiny.key, config)
    tokens = np.arange(3, 21, dtype=np.int32)
    Engine(tiny, inner).complete(Request(tokens, SamplingParams(max_tokens=1)))

    def ranks(peer_offset: int) -> Ranks:
        fake = object.__new__(Ranks)
        fake.stepping = True
        # Rank 0 sends its values; the sum counts the ranks whose values differ from them.
        fake.from_leader = lambda mine, what: mine  # type: ignore[method-assign]
        fake._sum = lambda differ, what: differ + np.array([int(peer_offset != 0)])  # type: ignore[method-assign]
        return fake

    longer = np.concatenate([tokens, [50, 51]]).astype(np.int32)  # its 4 full blocks kept
    agreed = AgreedCache(inner, ranks(0), tiny.model)
    with agreed.restore(longer) as lease:
        assert lease.length == 16
    assert agreed.cached_length(longer) == 16
    apart = AgreedCache(inner, ranks(4), tiny.model)
    with apart.restore(longer) as lease:
        assert lease.length == 0
        assert inner.report()["open_leases"] == 0  # the lease on what it found: released
    assert apart.cached_length(longer) == 0
    assert inner.report()["open_leases"] == 0
