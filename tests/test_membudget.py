"""The memory budget (`--mem-limit`): a request's footprint is an upper bound of what its
caches hold, a request that would pass the budget makes room, waits for running ones, or
is refused in one line (429 with Retry-After on the server when others hold the room),
and the process's memory and budget are reported. The process's resident memory is the
test's own number here (`held`), so nothing depends on the machine."""

from __future__ import annotations

import http.server
import io
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from asgi import call

from mlxcache import membudget
from mlxcache.cache.base import NoCache
from mlxcache.config import CacheConfig
from mlxcache.engine import Engine, Request
from mlxcache.errors import MemoryLimitError
from mlxcache.events import Done, Token
from mlxcache.membudget import Footprint, MemoryBudget
from mlxcache.model import LoadedModel
from mlxcache.prefill import prefill
from mlxcache.runtime import make_cache
from mlxcache.sampling import SamplingParams
from mlxcache.server.app import Settings, create_app
from mlxcache.server.log import RequestLog
from mlxcache.types import new_layers
from mlxcache.worker import EngineWorker
from tests.cli_run import refused, run

MiB = 1 << 20
BASE = 100 * MiB
GREEDY = SamplingParams(max_tokens=6)


@pytest.fixture
def held(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The process's resident memory, as the test sets it (`held[0]`)."""
    value = [BASE]
    monkeypatch.setattr(membudget, "resident_bytes", lambda: value[0])
    monkeypatch.setattr("mlxcache.server.served.resident_bytes", lambda: value[0])
    return value


@pytest.fixture(autouse=True)
def _pool() -> Iterator[None]:
    """A budget bounds MLX's buffer pool for the process: given back after each test."""
    old = mx.set_cache_limit(0)
    mx.set_cache_limit(old)
    yield
    mx.set_cache_limit(old)


def allocated(layers: list[Any]) -> int:
    """The bytes the caches have allocated (a KV cache's capacity, not its length)."""
    total = 0
    for c in layers:
        keys = getattr(c, "keys", None)
        parts = c.state if keys is None else (keys, c.values)
        total += membudget._nbytes(parts)
    return total


@pytest.mark.parametrize("name", ["tiny", "sliding", "recurrent", "quantizable"])
def test_the_footprint_is_what_the_caches_hold(name: str, request: pytest.FixtureRequest) -> None:
    loaded: LoadedModel = request.getfixturevalue(name)
    footprint = Footprint.of(loaded.model, loaded.config)
    ids = np.asarray([(7 * i + 3) % 200 + 1 for i in range(250)], np.int32)
    for n in (1, 9, 40, 250):
        layers = new_layers(loaded.model)
        for _ in prefill(loaded.model, layers, ids[:n], 0, 16):
            pass
        mx.eval([c.state for c in layers])
        if name == "sliding":  # a window's ring: at most what is counted, never more
            assert allocated(layers) <= footprint.kv(n)
        else:
            assert footprint.kv(n) == allocated(layers), n


class Tier:
    """A memory tier holding `bytes` of what the process holds (`held[0]`): shedding gives
    them back."""

    def __init__(self, held: list[int], nbytes: int) -> None:
        self._held, self.nbytes = held, nbytes
        self.shed_calls: list[int] = []

    def held(self) -> int:
        return self.nbytes

    def shed(self, n: int) -> int:
        self.shed_calls.append(n)
        freed = min(n, self.nbytes)
        self.nbytes -= freed
        self._held[0] -= freed
        return freed


def budget(tiny: LoadedModel, limit: int, floor: int = BASE) -> MemoryBudget:
    return MemoryBudget(limit, floor, Footprint.of(tiny.model, tiny.config), 16)


def test_a_request_makes_room_waits_or_is_refused(tiny: LoadedModel, held: list[int]) -> None:
    b = budget(tiny, BASE + 3 * MiB)
    need = b.need(20, 10)
    assert 0 < need < MiB
    tier = Tier(held, 3 * MiB)
    assert b.admit(1, 20, 10, tier) and tier.shed_calls == []
    held[0] = BASE + 3 * MiB  # the memory tier filled the budget
    assert b.admit(2, 20, 10, tier)  # room made: exactly what it was over by
    assert tier.shed_calls == [need + need]
    held[0] = BASE + 3 * MiB
    assert not b.admit(3, 20, 10, Tier(held, 0))  # 1 and 2 hold the room: 3 waits
    b.release(1)
    b.release(2)
    with pytest.raises(MemoryLimitError) as refused:  # alone now, and still over
        b.admit(3, 20, 10, Tier(held, 0))
    message = str(refused.value)
    assert "\n" not in message and "the memory limit 103.0 MiB leaves 3.0 MiB" in message


def test_a_waiting_request_keeps_the_tier_when_shedding_cannot_make_room(
    tiny: LoadedModel, held: list[int]
) -> None:
    """While others run, shedding the memory tier is only worth it where that can make the
    room: a request that waits for them anyway polls without emptying the tier."""
    mx.clear_cache()  # MLX's pool (counted as freeable too) is empty: only the tier counts
    assert mx.get_cache_memory() == 0
    b = budget(tiny, BASE + 3 * MiB)
    need = b.need(20, 10)
    assert b.admit(1, 20, 10, Tier(held, 0))
    held[0] = BASE + 3 * MiB + 2 * need  # over by more than the tier (need) holds
    small = Tier(held, need)
    for _ in range(3):
        assert not b.admit(2, 20, 10, small)
    assert small.shed_calls == []
    held[0] = BASE + 3 * MiB  # over by 2 * need: within what this tier holds
    enough = Tier(held, 3 * need)
    assert b.admit(2, 20, 10, enough) and enough.shed_calls == [2 * need]


def test_what_never_fits_is_refused_at_once(tiny: LoadedModel, held: list[int]) -> None:
    b = budget(tiny, BASE + MiB)
    cache = NoCache(tiny.model, 16)
    b.check(Request(list(range(1, 20)), GREEDY), cache)  # fits
    with pytest.raises(MemoryLimitError, match="this request needs about"):
        b.check(Request(list(range(1, 200)), SamplingParams(max_tokens=50_000)), cache)


def test_a_request_waits_for_the_room_and_replies_as_alone(
    tiny: LoadedModel, held: list[int]
) -> None:
    prompts = [[5 + i, 9, 11, 3 * i + 1] * 5 for i in range(2)]
    alone = [Engine(tiny).complete(Request(p, GREEDY)).tokens for p in prompts]
    b = budget(tiny, BASE)
    b.limit = BASE + b.need(20, GREEDY.max_tokens) + 1  # room for one request at a time
    engine = Engine(tiny, budget=b)
    first, second = (engine.submit(Request(p, GREEDY)) for p in prompts)
    seen: list[tuple[int, str]] = []
    replies: dict[int, list[int]] = {}
    for event in engine.run():
        if isinstance(event, Token | Done):
            seen.append((event.request_id, type(event).__name__))
        if isinstance(event, Done):
            replies[event.request_id] = event.result.tokens
    assert seen.index((second, "Token")) > seen.index((first, "Done"))  # it waited
    assert [replies[first], replies[second]] == alone


def test_the_server_refuses_with_429_while_others_hold_the_room(
    tiny: LoadedModel, held: list[int]
) -> None:
    b = budget(tiny, BASE + MiB)
    engine = Engine(tiny, budget=b)
    body = {"model": tiny.name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    with EngineWorker(engine) as worker:
        app = create_app(engine, worker, Settings(tiny.name), RequestLog(stream=io.StringIO()))
        assert call(app, "POST", "/v1/chat/completions", body).status == 200
        b.reserved[(0, 99)] = b.limit  # a running request holds all the room
        busy = call(app, "POST", "/v1/chat/completions", body)
        assert busy.status == 429 and busy.headers["retry-after"] == "1"
        assert busy.json()["error"]["code"] == "memory_busy"
        del b.reserved[(0, 99)]
        huge = {**body, "max_tokens": 100_000}
        refused = call(app, "POST", "/v1/chat/completions", huge)
        assert refused.status == 400 and refused.json()["error"]["code"] == "memory_limit"
        report = call(app, "GET", "/v1/cache").json()
        assert report["resident_bytes"] == BASE and report["mem_limit_bytes"] == BASE + MiB
        metrics = call(app, "GET", "/metrics").body.decode()
        assert f"mlxcache_resident_bytes {BASE}" in metrics
        assert f"mlxcache_mem_limit_bytes {BASE + MiB}" in metrics


def test_a_limit_below_the_loaded_model_is_one_line(tiny_gguf: Path, tmp_path: Path) -> None:
    code, out, err = run(
        "generate", "-m", str(tiny_gguf), "--cache-dir", str(tmp_path), "--mem-limit", "1M", "hi"
    )
    assert code == 2 and out == ""
    assert err.startswith("error: --mem-limit 1.0 MiB is below what the process holds")
    assert err.count("\n") == 1


def test_a_budget_keeps_the_memory_tier_inside_it(tiny: LoadedModel, held: list[int]) -> None:
    config = CacheConfig(mem_bytes=1 << 30, mem_limit=BASE + 10 * MiB)
    fitted, b = membudget.budgeted(tiny, config)
    assert fitted.mem_bytes == 5 * MiB and b.floor == BASE and b.limit == BASE + 10 * MiB


class _Report(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = json.dumps(
            {"mem_bytes": 3 * MiB, "resident_bytes": 300 * MiB, "mem_limit_bytes": None}
        ).encode()
        self.send_response(200 if self.path == "/v1/cache" else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


def test_cache_stats_shows_a_servers_memory() -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Report)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        code, out, _ = run("cache", "stats", "--server", url)
        assert code == 0
        lines = {line.split()[0]: line.split(None, 1)[1].strip() for line in out.splitlines()}
        assert lines["resident_bytes"] == "300.0 MiB" and lines["mem_limit_bytes"] == "none"
        code, out, _ = run("cache", "stats", "--server", url, "--json")
        assert json.loads(out)["resident_bytes"] == 300 * MiB
        assert run("cache", "stats", "--server", url, "--check")[0] == 2
    finally:
        server.shutdown()
        server.server_close()


def test_warm_ahead_runs_only_where_the_budget_has_room_now(
    tiny: LoadedModel, held: list[int], tmp_path: Path
) -> None:
    ids = [(5 * i + 1) % 200 + 1 for i in range(40)]
    for room, kept in ((MiB, 32), (0, 0)):
        b = budget(tiny, BASE + room)
        cache = make_cache(tiny, CacheConfig(directory=tmp_path / str(room), block_size=16))
        engine = Engine(tiny, cache, budget=b)
        assert engine.warm(ids) is not None
        list(engine.run(warm=True))
        assert cache.cached_length(np.asarray(ids, np.int32), whole=True) == kept
        assert not b.reserved  # released when the lane ended


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["--only", "nonsense"], "--only takes soak,context,quality, got 'nonsense'"),
        (["--minutes", "0"], "--minutes, --hours and --interval must be > 0"),
        (["--mem-limit", "lots"], "not a size: 'lots' (try 512M or 2G)"),
        (["--cache-mem", "x"], "not a size: 'x' (try 512M or 2G)"),
    ],
)
def test_bench_memory_refuses_bad_options_in_one_line(args: list[str], line: str) -> None:
    assert run("bench", "memory", *args) == refused(line)


def test_a_loads_peak_counts_what_it_keeps_at_least() -> None:
    """`peak_during`: the load's result, and at least what it still holds at its end."""
    from mlxcache.membudget import peak_during

    kept, peak = peak_during(lambda: bytearray(b"\1" * (64 << 20)))
    assert len(kept) == 64 << 20
    assert peak >= 60 << 20
