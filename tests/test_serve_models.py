"""Several models behind one server (`mlxcache.fleet`): two tiny models of other weights and
architectures, routed by name, alias or default, loaded when first asked, unloaded least
recently used under a memory budget or after the keep-alive time (a clock of the test's
own), a damaged model refused alone, and each reply equal to its model's solo reply."""

from __future__ import annotations

import asyncio
import shutil
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from asgi import Reply, acall, call
from typer.testing import CliRunner

from mlxcache.bench.families import FAMILIES, build
from mlxcache.config import CacheConfig
from mlxcache.engine import Engine, Request
from mlxcache.errors import MemoryBusyError
from mlxcache.fleet import Fleet, folder_size, opener, weights_bytes
from mlxcache.model import LoadedModel, load
from mlxcache.model_entries import ModelEntry, entries_from
from mlxcache.prefill import MERGED_BLOCKS
from mlxcache.sampling import SamplingParams
from mlxcache.server.app import Settings, create_app
from mlxcache.server.log import RequestLog
from mlxcache.server.served import Many
from mlxcache.wire import USAGE_FIELD
from mlxcache.worker import EngineWorker
from mlxcache_cli.main import app as cli

BLOCK = 4
PARAMS = SamplingParams(max_tokens=6)
PROMPT = "The cache keeps"


@pytest.fixture(scope="module")
def folders(tiny: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Three model folders: the tiny llama, a tiny qwen3 and a tiny gemma3 (other weights
    and layers, the same tokenizer), and a copy of the llama whose weights are cut short."""
    root = tmp_path_factory.mktemp("fleet")
    damaged = root / "damaged"
    shutil.copytree(tiny.path, damaged)
    weights = next(damaged.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:1000])
    return {
        "alpha": tiny.path,
        "beta": build(root / "beta", tiny.path, FAMILIES["qwen3"], seed=3),
        "gamma": build(root / "gamma", tiny.path, FAMILIES["gemma3_text"], seed=5),
        "damaged": damaged,
    }


def entries(folders: dict[str, Path], *names: str) -> list[ModelEntry]:
    aliases = {"alpha": ("a1", "gpt-4o-mini"), "beta": ("b1",)}
    return [ModelEntry(n, str(folders[n]), aliases.get(n, ())) for n in names]


class Clock:
    """A clock the test moves (never the wall clock: no timing assumptions)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def make_fleet(tmp_path: Path) -> Iterator[Callable[..., Fleet]]:
    """Fleets of a started worker each (stopped when the test ends)."""
    workers: list[EngineWorker] = []
    config = CacheConfig(block_size=BLOCK, directory=tmp_path / "cache", mem_bytes=1 << 20)

    def make(models: list[ModelEntry], **kwargs: Any) -> Fleet:
        worker = EngineWorker(None, max_lanes=4).start()
        workers.append(worker)
        kwargs.setdefault("size_of", folder_size(config.directory))
        if "meter" in kwargs:  # the test's own account: a load adds to it what it keeps
            kwargs.setdefault("load_peak", no_peak)
        open_entry = kwargs.pop("wrap", lambda o: o)(opener(config))
        return Fleet(models, worker, open_entry, tier_bytes=config.mem_bytes, **kwargs)

    yield make
    for worker in workers:
        worker.close(cancel=True)


def no_peak(load: Callable[[], Any]) -> tuple[Any, int]:
    """A load measured to pass nothing beyond what it keeps."""
    return load(), 0


def app_of(fleet: Fleet) -> Any:
    settings = Settings(fleet.default.name, PARAMS)
    return create_app(None, fleet.worker, settings, RequestLog(None), Many(fleet))


def solo(folder: Path, prompt: str = PROMPT) -> list[int]:
    """The model's reply alone: its own engine, no cache, nothing beside it."""
    engine = Engine(load(str(folder)), block_size=BLOCK)
    return engine.complete(Request(engine.encoder.encode(prompt), PARAMS)).tokens


def completion(model: str | None, prompt: str = PROMPT, stream: bool = False) -> dict[str, Any]:
    doc: dict[str, Any] = {"prompt": prompt, "max_tokens": 6, USAGE_FIELD: True}
    if model is not None:
        doc["model"] = model
    if stream:
        doc.update(stream=True, stream_options={"include_usage": True})
    return doc


def tokens_of(reply: Reply) -> tuple[str, list[int]]:
    """The model name a reply gives and its token ids (streamed or not)."""
    assert reply.status == 200, reply.body
    if reply.headers["content-type"].startswith("text/event-stream"):
        import json

        chunks = [json.loads(e) for e in reply.events() if e != "[DONE]"]
        return chunks[0]["model"], chunks[-1]["usage"]["mlxcache"]["tokens"]
    doc = reply.json()
    return doc["model"], doc["usage"]["mlxcache"]["tokens"]


def test_requests_pick_a_model_by_name_alias_or_default(
    make_fleet: Callable[..., Fleet], folders: dict[str, Path]
) -> None:
    fleet = make_fleet(entries(folders, "alpha", "beta"))
    app = app_of(fleet)
    loaded = {c["id"]: c["loaded"] for c in call(app, "GET", "/v1/models").json()["data"]}
    assert loaded == {"alpha": False, "a1": False, "gpt-4o-mini": False, "beta": False, "b1": False}
    alpha, beta = solo(folders["alpha"]), solo(folders["beta"])
    assert alpha != beta  # other weights: a reply tells which model ran
    for model, expected in (
        (None, ("alpha", alpha)),  # no model: the default, named as such
        ("a1", ("a1", alpha)),  # an alias is echoed as the request gave it
        ("beta", ("beta", beta)),
        ("b1", ("b1", beta)),
        ("alpha", ("alpha", alpha)),
    ):
        assert tokens_of(call(app, "POST", "/v1/completions", completion(model))) == expected
    cards = call(app, "GET", "/v1/models").json()["data"]
    assert [(c["id"], c["loaded"], c.get("alias_of")) for c in cards] == [
        ("alpha", True, None),
        ("a1", True, "alpha"),
        ("gpt-4o-mini", True, "alpha"),
        ("beta", True, None),
        ("b1", True, "beta"),
    ]
    assert cards[0]["mlxcache"]["key"] == load(str(folders["alpha"])).key
    assert fleet.loads == {"alpha": 1, "beta": 1}  # each loaded once, when first asked for


def test_a_model_not_served_is_a_404_naming_what_is(
    make_fleet: Callable[..., Fleet], folders: dict[str, Path]
) -> None:
    fleet = make_fleet(entries(folders, "alpha", "beta"))
    app = app_of(fleet)
    for path, doc in (
        ("/v1/completions", completion(str(folders["gamma"]))),  # a path is never loaded
        (
            "/v1/chat/completions",
            {"model": "gpt-5", "messages": [{"role": "user", "content": "x"}]},
        ),
    ):
        reply = call(app, "POST", path, doc)
        name = doc["model"]
        message = (
            f"model {name!r} is not served here (it serves 'alpha' (aliases 'a1', "
            "'gpt-4o-mini'), 'beta' (aliases 'b1'); a request never loads a model it names)"
        )
        assert (reply.status, reply.json()["error"]) == (
            404,
            {
                "message": message,
                "type": "invalid_request_error",
                "param": "model",
                "code": "model_not_found",
            },
        )
    assert call(app, "GET", "/v1/models/gpt-5").status == 404
    assert fleet.loads == {}  # nothing loaded for any of it


def test_models_are_unloaded_least_recently_used_first(
    make_fleet: Callable[..., Fleet], folders: dict[str, Path]
) -> None:
    """A budget that holds two of the three models: each load unloads the one used least
    recently (the fleet's own account of its models' bytes stands in for the process's)."""
    notes: list[str] = []
    clock = Clock()
    sizes = {n: weights_bytes(folders[n]) for n in ("alpha", "beta", "gamma")}
    account: list[Fleet] = []

    def held() -> int:
        return sum(r.size for r in account[0].resident.values()) if account else 0

    two = sorted(sizes.values())[1] + sorted(sizes.values())[2]
    fleet = make_fleet(
        entries(folders, "alpha", "beta", "gamma"),
        limit=two + 1,
        clock=clock,
        meter=held,
        on_note=notes.append,
    )
    account.append(fleet)
    for name in ("alpha", "beta", "gamma", "beta", "alpha", "gamma", "gamma", "beta"):
        clock.now += 1
        with fleet.lease(name):
            pass
    unloads = [n for n in notes if n.startswith("unloaded")]
    assert unloads == [
        "unloaded alpha (least recently used, for gamma)",
        "unloaded gamma (least recently used, for alpha)",
        "unloaded beta (least recently used, for gamma)",
        "unloaded alpha (least recently used, for beta)",
    ]
    assert sorted(fleet.resident) == ["beta", "gamma"]
    assert fleet.loads == {"alpha": 2, "beta": 2, "gamma": 2}


def test_a_model_in_use_is_never_unloaded_for_another(
    make_fleet: Callable[..., Fleet], folders: dict[str, Path]
) -> None:
    """Room held by a model in use: the request for another is refused (429, retry),
    and the model in use stays loaded."""
    account: list[Fleet] = []

    def held() -> int:
        return sum(r.size for r in account[0].resident.values()) if account else 0

    size = max(weights_bytes(folders[n]) for n in ("alpha", "beta"))
    fleet = make_fleet(entries(folders, "alpha", "beta"), limit=size + 1, meter=held)
    account.append(fleet)
    app = app_of(fleet)
    with fleet.lease("alpha"):
        with pytest.raises(MemoryBusyError):
            fleet.acquire("beta")
        reply = call(app, "POST", "/v1/completions", completion("beta"))
        assert (reply.status, reply.headers["retry-after"]) == (429, "1")
        assert reply.json()["error"]["code"] == "memory_busy"
        assert "held now by models in use (alpha)" in reply.json()["error"]["message"]
    with fleet.lease("beta"):  # alpha idle now: unloaded for it
        assert sorted(fleet.resident) == ["beta"]


def test_keep_alive_unloads_an_idle_model(
    make_fleet: Callable[..., Fleet], folders: dict[str, Path]
) -> None:
    clock = Clock()
    fleet = make_fleet(entries(folders, "alpha", "beta"), keep_alive=60.0, clock=clock)
    app = app_of(fleet)
    assert call(app, "POST", "/v1/completions", completion("alpha")).status == 200
    clock.now = 30.0
    assert call(app, "POST", "/v1/completions", completion("beta")).status == 200
    engines = fleet.worker.run(
        lambda: {n: weakref.ref(r.engine) for n, r in fleet.resident.items()}
    )
    clock.now = 59.0
    assert fleet.worker.run(fleet.expire) == []
    rows = {r["name"]: r for r in call(app, "GET", "/v1/ps").json()["models"]}
    assert (rows["alpha"]["idle_s"], rows["beta"]["idle_s"]) == (59.0, 29.0)
    clock.now = 60.0
    assert fleet.worker.run(fleet.expire) == ["alpha"]
    clock.now = 89.0
    assert fleet.worker.run(fleet.expire) == []
    clock.now = 90.0
    assert fleet.worker.run(fleet.expire) == ["beta"]
    assert fleet.resident == {}
    # Nothing keeps an unloaded model (its memory is given back): not the worker's loop,
    # not a finished request's objects.
    assert {n: ref() for n, ref in engines.items()} == {"alpha": None, "beta": None}
    # Asked for again, it loads again and answers as before.
    assert tokens_of(call(app, "POST", "/v1/completions", completion("alpha")))[1] == solo(
        folders["alpha"]
    )
    assert fleet.loads == {"alpha": 2, "beta": 1}


def test_a_damaged_model_fails_alone(
    make_fleet: Callable[..., Fleet], folders: dict[str, Path]
) -> None:
    fleet = make_fleet(entries(folders, "alpha", "damaged"))
    app = app_of(fleet)
    replies = [call(app, "POST", "/v1/completions", completion("damaged")) for _ in range(2)]
    for reply in replies:
        error = reply.json()["error"]
        assert (reply.status, error["code"], error["type"]) == (
            500,
            "model_load_failed",
            "server_error",
        )
        assert error["message"].startswith("model 'damaged' cannot be loaded: ")
        assert "\n" not in error["message"]
    assert replies[0].json() == replies[1].json()  # the one error, not a second load
    assert tokens_of(call(app, "POST", "/v1/completions", completion(None)))[1] == solo(
        folders["alpha"]
    )
    rows = {r["name"]: r for r in call(app, "GET", "/v1/ps").json()["models"]}
    assert (rows["alpha"]["loaded"], rows["damaged"]["loaded"]) == (True, False)
    assert rows["damaged"]["error"] == replies[0].json()["error"]["message"]


def test_concurrent_requests_of_two_models_equal_their_solo_replies(
    make_fleet: Callable[..., Fleet], folders: dict[str, Path]
) -> None:
    fleet = make_fleet(entries(folders, "alpha", "beta"))
    app = app_of(fleet)
    prompts = ["The cache keeps", "A reply equals", "Two models run", "One thread owns"]
    expected = {(m, p): solo(folders[m], p) for m in ("alpha", "beta") for p in prompts}

    async def both() -> list[Reply]:
        import json

        calls = [
            acall(app, "POST", "/v1/completions", [json.dumps(completion(m, p, s)).encode()])
            for m in ("alpha", "beta")
            for p in prompts
            for s in (False, True)
        ]
        return list(await asyncio.gather(*calls))

    replies = asyncio.run(both())
    keys = [(m, p) for m in ("alpha", "beta") for p in prompts for _ in (False, True)]
    assert [tokens_of(r) for r in replies] == [(m, expected[(m, p)]) for m, p in keys]


def test_metrics_and_ps_show_each_model(
    make_fleet: Callable[..., Fleet], folders: dict[str, Path]
) -> None:
    fleet = make_fleet(entries(folders, "alpha", "beta"))
    app = app_of(fleet)
    assert call(app, "POST", "/v1/completions", completion("a1")).status == 200
    text = call(app, "GET", "/metrics").body.decode()
    assert fleet.resident["alpha"].size >= weights_bytes(folders["alpha"])
    for line in (
        'mlxcache_model_loaded{model="alpha"} 1',
        'mlxcache_model_loaded{model="beta"} 0',
        # what it holds: its weights' files, or more where its load was measured to add more
        f'mlxcache_model_bytes{{model="alpha"}} {fleet.resident["alpha"].size}',
        'mlxcache_model_loads_total{model="alpha"} 1',
        'mlxcache_model_completions_total{model="a1"} 1',
        'mlxcache_model_generated_tokens_total{model="a1"} 6',
    ):
        assert line in text.splitlines(), line
    cache = call(app, "GET", "/v1/cache").json()
    assert sorted(cache["models"]) == ["alpha"]


def test_models_files_are_checked_before_anything_runs(
    tmp_path: Path, folders: dict[str, Path]
) -> None:
    assert entries_from([{"model": "smollm2-135m", "aliases": "small"}], "f") == [
        ModelEntry("smollm2-135m", "smollm2-135m", ("small",))
    ]
    cases = [
        ("- name: a\n  model: x\n  colour: red\n", "model 1: unknown key 'colour'"),
        ("- name: a\n", "model 1: 'model' must be a model spec"),
        (
            "- {name: a, model: x}\n- {name: b, model: y, aliases: [a]}\n",
            "the name 'a' is given to two models ('a' and 'b')",
        ),
        ("- {name: a, model: x, kv_bits: eight}\n", "model 1: 'kv_bits' must be a whole number"),
        ("- {name: a, model: x, kv_bits: 5}\n", "model 'a': kv_bits: KV bits must be one of 4, 8"),
        ("models: 3\n", "expected a non-empty list of models"),
        ("[unclosed\n", "is not YAML"),
        (f"- {{name: a, model: {folders['alpha']}, adapter: 3}}\n", "'adapter' must be text"),
        (
            f"- {{name: a, model: {folders['alpha']}, chat_template_args: x}}\n",
            "'chat_template_args' must be a mapping",
        ),
        (f"- {{name: a, model: {folders['alpha']}, adapter: empty}}\n", "model 'a': "),
        (f"- {{name: a, model: {folders['alpha']}, adapter: nope}}\n", "model 'a': "),
    ]
    (tmp_path / "empty").mkdir()
    for text, said in cases:
        path = tmp_path / "models.yaml"
        path.write_text(text)
        result = CliRunner().invoke(cli, ["serve", "--models", str(path)])
        assert result.exit_code == 2, (text, result.output)
        assert said in result.stderr and "Traceback" not in result.stderr, (text, result.stderr)
        assert len(result.stderr.splitlines()) == 1, result.stderr
    result = CliRunner().invoke(cli, ["serve", "--keep-alive", "5m"])
    assert result.exit_code == 2 and "--keep-alive and --load-all are for several" in result.stderr
    two = ["-m", str(folders["alpha"]), "-m", str(folders["beta"])]
    result = CliRunner().invoke(cli, ["serve", *two, "--chat-template", "x"])
    assert result.exit_code == 2 and "tailor one model" in result.stderr


def test_an_adapter_is_a_model_of_its_own(
    make_fleet: Callable[..., Fleet], folders: dict[str, Path], tmp_path: Path
) -> None:
    """A models file may serve one base twice, plain and with an adapter (named relative to
    the file): each name replies as its own model alone, in a namespace of its own."""
    from adapters import write_adapter

    from mlxcache.model_entries import read_models_file

    write_adapter(folders["alpha"], tmp_path / "tuned", seed=5)
    models = tmp_path / "models.yaml"
    models.write_text(f"- {{name: base, model: {folders['alpha']}}}\n")
    models.write_text(
        models.read_text() + f"- {{name: tuned, model: {folders['alpha']}, adapter: tuned}}\n"
    )
    read = read_models_file(models)
    assert read[1].adapter == str(tmp_path / "tuned")
    assert read[1].load_options()["adapter"] == str(tmp_path / "tuned")
    app = app_of(make_fleet(read))
    base = solo(folders["alpha"])
    tuned_model = load(str(folders["alpha"]), adapter=tmp_path / "tuned")
    engine = Engine(tuned_model, block_size=BLOCK)
    tuned = engine.complete(Request(engine.encoder.encode(PROMPT), PARAMS)).tokens
    assert tuned != base  # the adapter changes the reply: the test can tell them apart
    for _ in range(2):  # the second round resumes from each model's own cache entries
        for name, expected in (("tuned", tuned), ("base", base)):
            got = tokens_of(call(app, "POST", "/v1/completions", completion(name)))
            assert got == (name, expected)
    keys = {c["id"]: c["mlxcache"]["key"] for c in call(app, "GET", "/v1/models").json()["data"]}
    assert keys == {"base": load(str(folders["alpha"])).key, "tuned": tuned_model.key}
    assert keys["base"] != keys["tuned"]


def test_a_card_of_no_served_name_is_a_404_that_loads_nothing(
    make_fleet: Callable[..., Fleet], folders: dict[str, Path]
) -> None:
    fleet = make_fleet(entries(folders, "alpha", "beta"))
    app = app_of(fleet)
    for path, said in (
        ("/v1/models/", "no model named: GET /v1/models lists what is served"),
        ("/v1/models/gpt-4o", "model 'gpt-4o' is not served here (it serves 'alpha' (aliases"),
    ):
        reply = call(app, "GET", path)
        assert reply.status == 404, reply.body
        assert reply.json()["error"]["message"].startswith(said), reply.body
    assert fleet.loads == {} and not fleet.resident


def test_a_models_file_finds_its_chat_template_beside_it(tmp_path: Path) -> None:
    """A template file named relative to the models file is read beside it; Jinja text
    stays text."""
    from mlxcache.model_entries import read_models_file

    (tmp_path / "t.jinja").write_text("{{ messages }}")
    models = tmp_path / "models.yaml"
    models.write_text(
        "- {name: a, model: x, chat_template: t.jinja}\n"
        "- {name: b, model: y, chat_template: '{{ messages }}'}\n"
    )
    a, b = read_models_file(models)
    assert a.chat_template == str(tmp_path / "t.jinja")
    assert b.chat_template == "{{ messages }}"


def test_room_is_made_for_a_loads_peak_estimated_then_measured(
    make_fleet: Callable[..., Fleet], folders: dict[str, Path]
) -> None:
    """A budget that holds both models once loaded: beta's first load is estimated to pass
    that (its tokenizer's parse), so alpha is unloaded for it; measured smaller, its next
    load leaves alpha loaded."""
    notes: list[str] = []
    sizes = {n: weights_bytes(folders[n]) for n in ("alpha", "beta")}
    account: list[Fleet] = []

    def held() -> int:
        return sum(r.size for r in account[0].resident.values()) if account else 0

    def measured(load: Callable[[], Any]) -> tuple[Any, int]:
        return load(), 7  # less than each model keeps

    both = sizes["alpha"] + sizes["beta"]
    fleet = make_fleet(
        entries(folders, "alpha", "beta"),
        limit=both,
        meter=held,
        peak_of=lambda e: both if e.name == "beta" else 0,
        load_peak=measured,
        on_note=notes.append,
    )
    account.append(fleet)
    for name in ("alpha", "beta", "alpha"):
        with fleet.lease(name):
            pass
    assert [n for n in notes if n.startswith("unloaded")] == [
        "unloaded alpha (least recently used, for beta)"
    ]
    with fleet.lease("beta"):  # measured: it fits beside alpha now
        pass
    assert sorted(fleet.resident) == ["alpha", "beta"]
    assert fleet.loads == {"alpha": 2, "beta": 1}
    rows = {r["name"]: r for r in fleet.worker.run(fleet.report)}
    assert rows["beta"]["load_peak_bytes"] == 7


def test_a_load_that_failed_for_a_passing_reason_is_tried_again(
    make_fleet: Callable[..., Fleet], folders: dict[str, Path]
) -> None:
    """Out of memory once: its requests get that error until `RETRY_S` have passed, then
    one loads it and gets its solo reply. A damaged file's error stays, loaded once."""
    from mlxcache.fleet import RETRY_S, Opener

    clock = Clock()
    calls: list[str] = []

    def flaky(open_entry: Opener) -> Opener:
        def opened(entry: ModelEntry, tier: int, shared: Any) -> Any:
            calls.append(entry.name)
            if entry.name == "alpha" and calls.count("alpha") == 1:
                raise MemoryError("no memory for now")
            return open_entry(entry, tier, shared)

        return opened

    fleet = make_fleet(entries(folders, "alpha", "damaged"), clock=clock, wrap=flaky)
    app = app_of(fleet)
    for _ in range(2):
        reply = call(app, "POST", "/v1/completions", completion("alpha"))
        assert (reply.status, reply.json()["error"]["message"]) == (
            500,
            "model 'alpha' cannot be loaded: no memory for now",
        )
        assert call(app, "POST", "/v1/completions", completion("damaged")).status == 500
    clock.now = RETRY_S - 0.5
    assert call(app, "POST", "/v1/completions", completion("alpha")).status == 500
    clock.now = RETRY_S
    reply = call(app, "POST", "/v1/completions", completion("alpha"))
    assert tokens_of(reply) == ("alpha", solo(folders["alpha"]))
    clock.now = 100 * RETRY_S
    assert call(app, "POST", "/v1/completions", completion("damaged")).status == 500
    assert calls == ["alpha", "damaged", "alpha"]
    rows = {r["name"]: r for r in call(app, "GET", "/v1/ps").json()["models"]}
    assert "error" not in rows["alpha"] and "error" in rows["damaged"]


def metric(text: str, name: str) -> int:
    found = [line.split()[1] for line in text.splitlines() if line.startswith(name + " ")]
    assert len(found) == 1, name
    return int(found[0])


def test_metrics_totals_keep_the_counts_of_unloaded_models(
    make_fleet: Callable[..., Fleet], folders: dict[str, Path]
) -> None:
    clock = Clock()
    fleet = make_fleet(entries(folders, "alpha", "beta"), keep_alive=60.0, clock=clock)
    app = app_of(fleet)
    names = [f"mlxcache_cache_{n}_total" for n in ("hits", "misses", "cached_tokens")]

    def totals() -> list[int]:
        text = call(app, "GET", "/metrics").body.decode()
        return [metric(text, n) for n in names]

    prompt = "The cache keeps what it was given, block by block"
    for _ in range(2):  # a miss, then a hit
        assert call(app, "POST", "/v1/completions", completion("alpha", prompt)).status == 200
    before = totals()
    assert before[0] == 1 and before[1] == 1 and before[2] > 0
    clock.now = 60.0
    assert fleet.worker.run(fleet.expire) == ["alpha"]
    assert totals() == before  # alpha unloaded: its counts stay
    assert call(app, "POST", "/v1/completions", completion("beta", prompt)).status == 200
    assert totals() == [before[0], before[1] + 1, before[2]]


def test_one_models_idle_time_counts_from_its_last_requests_end(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`serve -m MODEL`'s `ps`: idle since the last request ended, not since it started."""
    import types

    from mlxcache.events import Done
    from mlxcache.server import served
    from mlxcache.server.served import One

    clock = Clock()
    monkeypatch.setattr(served, "time", types.SimpleNamespace(monotonic=clock))
    sinks: list[Callable[[Any], None]] = []

    class Worker:
        waiting = 0

        def submit(self, request: Any, sink: Callable[[Any], None]) -> Any:
            sinks.append(sink)

    engine: Any = types.SimpleNamespace(busy=False, loaded=types.SimpleNamespace(path=None))
    monkeypatch.setattr(served, "weights_bytes", lambda _path: 0)
    one = One(engine, Worker(), ("m",), {})  # type: ignore[arg-type]
    clock.now = 5.0
    target = one.acquire(None)
    target.worker.submit(None, lambda _event: None)  # type: ignore[arg-type]
    clock.now = 50.0
    sinks[0](Done(0, None))  # type: ignore[arg-type]
    clock.now = 60.0
    assert one.rows()[0]["idle_s"] == 10.0


def test_serves_probe_bars_are_stopped_when_a_load_fails() -> None:
    from mlxcache_cli import ui
    from mlxcache_cli.serve_cmd import closing_notes

    closed: list[bool] = []

    class Notes(ui.ProbeNotes):
        def close(self) -> None:
            closed.append(True)
            super().close()

    def failing(entry: ModelEntry, tier: int, shared: Any) -> Any:
        raise RuntimeError("a probe failed")

    with pytest.raises(RuntimeError):
        closing_notes(failing, Notes())(ModelEntry("m", "m"), 0, None)
    assert closed == [True]


def test_adapters_of_one_base_share_its_weights(
    make_fleet: Callable[..., Fleet], folders: dict[str, Path], tmp_path: Path
) -> None:
    """Two adapters (a LoRA and a DoRA) and the plain base behind one server: the base's
    weights are loaded once, each adapter's layers over those same arrays, and each reply
    is mlx-lm's own for its adapter, and its solo reply. A full fine-tune, loaded first,
    replaced some of its weights: it lends none."""
    from adapters import mlx_lm_reply, write_adapter

    write_adapter(folders["alpha"], tmp_path / "one", seed=5)
    write_adapter(folders["alpha"], tmp_path / "two", "dora", seed=6, scale=40.0)
    write_adapter(folders["alpha"], tmp_path / "full", "full", seed=7)
    spec = str(folders["alpha"])
    served = [
        ModelEntry("full", spec, adapter=str(tmp_path / "full")),
        ModelEntry("one", spec, adapter=str(tmp_path / "one")),
        ModelEntry("two", spec, adapter=str(tmp_path / "two")),
        ModelEntry("base", spec),
    ]
    fleet = make_fleet(served)
    app = app_of(fleet)
    replies = {}
    for name in ("full", "one", "two", "base"):
        replies[name] = tokens_of(call(app, "POST", "/v1/completions", completion(name)))[1]
    for name, adapter in [(n, tmp_path / n) for n in ("full", "one", "two")] + [("base", None)]:
        alone = load(spec, adapter=adapter)
        engine = Engine(alone, block_size=BLOCK)
        prompt = engine.encoder.encode(PROMPT)
        assert replies[name] == engine.complete(Request(prompt, PARAMS)).tokens, name
        assert replies[name] == mlx_lm_reply(folders["alpha"], adapter, prompt, PARAMS), name
    assert len({tuple(r) for r in replies.values()}) == 4, replies  # told apart
    assert fleet.resident["full"].engine.loaded.base_weights is None
    weights = [fleet.resident[n].engine.loaded.base_weights for n in ("one", "two", "base")]
    assert weights[0] is not None and weights[1] is not None and weights[2] is not None
    assert all(
        weights[1][k] is weights[0][k] and weights[2][k] is weights[0][k] for k in weights[0]
    )


def test_a_load_that_took_more_than_its_room_unloads_others_after(
    make_fleet: Callable[..., Fleet], folders: dict[str, Path]
) -> None:
    """A first load sized from its files, then measured to hold more: the models no
    request holds are unloaded until the process is under the limit again."""
    notes: list[str] = []
    sizes = {n: weights_bytes(folders[n]) for n in ("alpha", "beta")}
    account: list[Fleet] = []
    extra = {"beta": sizes["alpha"]}  # what beta's load holds beyond its files

    def held() -> int:
        fleet = account[0] if account else None
        if fleet is None:
            return 0
        return sum(r.size + extra.get(n, 0) for n, r in fleet.resident.items())

    fleet = make_fleet(
        entries(folders, "alpha", "beta"),
        limit=sizes["alpha"] + sizes["beta"] + 1,
        meter=held,
        on_note=notes.append,
    )
    account.append(fleet)
    with fleet.lease("alpha"):
        pass
    with fleet.lease("beta"):
        assert sorted(fleet.resident) == ["beta"]
    assert [n for n in notes if n.startswith("unloaded")] == [
        "unloaded alpha (least recently used, for beta)"
    ]


def test_a_served_models_budget_holds_the_widest_prefill_chunk(
    make_fleet: Callable[..., Fleet], folders: dict[str, Path]
) -> None:
    """A request's room holds a merged prefill chunk (`MERGED_BLOCKS` blocks), as in a
    server of one model (`membudget.budgeted`)."""
    fleet = make_fleet(entries(folders, "alpha"), limit=1 << 40, meter=lambda: 0)
    with fleet.lease("alpha") as resident:
        budget = resident.engine.budget
        assert budget is not None
        assert budget.chunk == MERGED_BLOCKS * resident.engine.cache.block_size
