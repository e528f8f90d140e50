"""Speculative decoding: drafting off (said once) where the verify probe refuses it; the
drafters; every family; the options and their errors; real models. Drafted == plain on
every variant of the exactness matrix: `guarantees.check_drafted` (tests/test_exactness.py)."""

from __future__ import annotations

import dataclasses
import io
import json
import shutil
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import numpy as np
import pytest
from guarantees import (
    Oracle,
    OracleDrafting,
    Rig,
    Variant,
    check_drafted_stops,
    check_probes_apart,
    check_self_drafted,
    check_uneven_widths,
    prompt,
    run_together,
    scored,
)
from typer.testing import CliRunner

from mlxcache import invariance, lanes, request_lane
from mlxcache.bench.families import FAMILIES, build
from mlxcache.config import MAX_DRAFT, CacheConfig, DraftConfig, SamplingParams
from mlxcache.decode import Forward
from mlxcache.draft import Lookup, replay
from mlxcache.drafting import Drafting, Plan, Shared, choose, cost_of
from mlxcache.engine import Engine, Request
from mlxcache.errors import SettingError, UserInputError
from mlxcache.events import Done, Token
from mlxcache.invariance import PROBES, VERIFY_WIDTHS
from mlxcache.model import LoadedModel, load
from mlxcache.runtime import open_engine
from mlxcache.scheduler import TurnKind
from mlxcache_cli.main import app

runner = CliRunner()
B = 4


def test_probe_answers_are_per_model(variants: dict[str, Variant], tmp_path: Path) -> None:
    check_probes_apart(Rig(variants["shaped"], tmp_path))


@pytest.mark.parametrize("name", ["plain", "sliding", "recurrent"])
def test_drafting_uses_only_widths_that_passed(
    name: str, variants: dict[str, Variant], tmp_path: Path
) -> None:
    check_uneven_widths(Rig(variants[name], tmp_path))


@pytest.mark.parametrize("name", ["plain", "shaped"])
def test_a_draft_model_drafting_for_itself_has_every_draft_accepted(
    name: str, variants: dict[str, Variant], tmp_path: Path
) -> None:
    check_self_drafted(Rig(variants[name], tmp_path))


# -- the lookup drafter ---------------------------------------------------------------------


def ids(*tokens: int) -> np.ndarray:
    return np.asarray(tokens, dtype=np.int32)


def test_lookup_drafts_what_followed_the_longest_latest_ngram() -> None:
    lookup = Lookup(ngram=3)
    # "1 2 3" occurred before, followed by 4 5 6; "2 3" later, followed by 9.
    assert lookup.propose(ids(1, 2, 3, 4, 5, 6, 7, 2, 3, 9, 8, 1, 2, 3), 3) == [4, 5, 6]
    assert lookup.propose(ids(1, 2, 3, 4, 5, 6, 7, 2, 3, 9, 8, 1, 2, 3), 1) == [4]
    # "4 2 3" never occurred: "2 3" did (its latest occurrence counts).
    assert lookup.propose(ids(2, 3, 7, 2, 3, 8, 9, 4, 2, 3), 2) == [8, 9]
    # A lone token matches only where n = 1 is the longest asked for.
    assert lookup.propose(ids(3, 7, 5, 4, 3), 2) == []
    assert Lookup(ngram=1).propose(ids(3, 7, 5, 4, 3), 2) == [7, 5]
    assert lookup.propose(ids(1, 2, 3, 4), 3) == []  # the last token never occurred before
    assert lookup.propose(ids(5), 3) == [] and lookup.propose(ids(1, 1), 0) == []


def test_lookup_copies_a_run_through_its_own_end() -> None:
    """A copy that reaches the end of what is known repeats it (as LZ77 copies do)."""
    assert Lookup(ngram=2).propose(ids(9, 4, 4, 4), 5) == [4, 4, 4, 4, 4]
    assert Lookup(ngram=2).propose(ids(1, 2, 1, 2), 5) == [1, 2, 1, 2, 1]


# -- the policy ---------------------------------------------------------------------------


@pytest.mark.parametrize("ngram", [1, 2, 3])
def test_replay_counts_a_drafted_run_s_forwards_without_the_model(
    ngram: int, tiny: LoadedModel, tmp_path: Path
) -> None:
    """`draft.replay` over a plain reply gives exactly the verify forwards, drafts and
    accepted drafts a drafted run makes (what `bench spec --sweep` relies on), for
    replies cut by the budget and ended by an end token."""
    tokens = prompt(8, seed=5) * 3
    greedy = SamplingParams(max_tokens=24)
    reply = Engine(tiny, block_size=B).complete(Request(tokens, greedy)).tokens
    cases = [(frozenset[int](), 24), (frozenset({reply[14]}), 24), (frozenset(), 5)]
    seen = 0
    for stop, budget in cases:
        for k in (1, 2, 4, 8):
            config = DraftConfig(mode="lookup", tokens=k, ngram=ngram)
            engine = Engine(tiny, block_size=B, drafting=Drafting(tiny, config, B, tmp_path))
            params = SamplingParams(max_tokens=budget)
            got = engine.complete(Request(tokens, params, stop_tokens=stop or None))
            ended = got.stop_token is not None
            rounds = replay(Lookup(ngram), tokens, got.tokens, ended, k, budget)
            stats = got.stats
            assert (len(rounds), sum(d for d, _ in rounds), sum(a for _, a in rounds)) == (
                stats.verify_forwards,
                stats.drafted_tokens,
                stats.accepted_tokens,
            )
            seen += stats.accepted_tokens
    assert seen > 0


def test_auto_is_off_on_the_cpu_without_a_probe(tiny: LoadedModel, tmp_path: Path) -> None:
    drafting = Drafting(tiny, DraftConfig(), B, tmp_path)
    assert mx.default_device() == mx.cpu
    assert drafting.plan() is None and drafting.plan("auto") is None
    assert not (tmp_path / PROBES).exists()  # no probe ran
    assert drafting.plan("off") is None
    with pytest.raises(UserInputError, match="needs a draft model"):
        drafting.plan("model")
    with pytest.raises(UserInputError, match="draft must be one of"):
        drafting.plan("sometimes")


def test_lookup_plans_the_probed_width_and_records_it(tiny: LoadedModel, tmp_path: Path) -> None:
    asked = DraftConfig(mode="lookup", tokens=6, ngram=2)
    assert Drafting(tiny, asked, B, tmp_path).plan() == Plan("lookup", 6, ngram=2)
    record = json.loads((tmp_path / PROBES).read_text())
    ((key, found),) = record.items()
    assert found["verify"] == {"2": True, "3": True, "5": True, "9": True}
    assert sorted(found["verify_costs"], key=int) == ["2", "3", "5", "9"]
    assert all(c > 0 for c in found["verify_costs"].values())

    def planned(width: int, costs: list[float], **config: Any) -> Plan | None:
        """The plan read back from a record (no forward is made)."""
        times = dict(zip(("2", "3", "5", "9"), costs, strict=True))
        passed = {str(w): w <= width for w in VERIFY_WIDTHS}
        (tmp_path / PROBES).write_text(
            json.dumps({key: {**found, "verify": passed, "verify_costs": times}})
        )
        return Drafting(tiny, DraftConfig(mode="lookup", **config), B, tmp_path).plan()

    # Unasked, n and k are the profiled pair the recorded costs make cheapest per token.
    free, per_row = [1.0, 1.0, 1.0, 1.0], [2.0, 3.0, 5.0, 9.0]
    for width, costs in [(9, free), (3, free), (9, per_row), (9, [1.1, 1.2, 1.5, 9.0])]:
        times = dict(zip(VERIFY_WIDTHS, costs, strict=True))
        n, k, _ = choose(times, width)
        assert planned(width, costs) == Plan("lookup", k, ngram=n)
    assert cast(Plan, planned(9, free)).k == MAX_DRAFT  # rows are free: the most drafts
    assert cast(Plan, planned(3, free)).k == 2  # within the width
    assert cast(Plan, planned(9, per_row)).k == 1  # a row costs a row: the fewest
    assert planned(9, per_row, tokens=6, ngram=1) == Plan("lookup", 6, ngram=1)  # asked for
    assert cast(Plan, planned(3, free, tokens=6)).k == 2
    # A damaged record is measured again, not read.
    for damaged in ({"2": "fast"}, {"2": 1.0}, {"2": -1.0, "3": 1, "5": 1, "9": 1}):
        (tmp_path / PROBES).write_text(json.dumps({key: {**found, "verify_costs": damaged}}))
        again = Drafting(tiny, asked, B, tmp_path).verify()
        assert again.width == 9 and sorted(again.costs) == list(VERIFY_WIDTHS)
    for verdicts in (9, {"2": True}, {"2": 1, "3": True, "5": True, "9": True}):
        (tmp_path / PROBES).write_text(json.dumps({key: {**found, "verify": verdicts}}))
        assert Drafting(tiny, asked, B, tmp_path).verify().passed == dict.fromkeys(
            VERIFY_WIDTHS, True
        )


def test_choose_takes_the_pair_cheapest_per_token() -> None:
    """`choose` by hand: (tokens per forward, share of forwards with drafts) per (n, k)."""
    profile = {(1, 1): (1.5, 0.8), (3, 1): (1.3, 0.4), (1, 8): (2.5, 0.8), (3, 8): (1.8, 0.4)}
    free = {2: 1.0, 9: 1.0}
    per_row = {2: 2.0, 9: 9.0}
    assert choose(free, 9, profile=profile) == (1, 8, 0.4)
    assert choose(per_row, 9, profile=profile) == (3, 1, 1.077)  # (0.4 * 2 + 0.6) / 1.3
    assert choose(free, 2, profile=profile) == (1, 1, 0.667)  # within the width
    assert choose(free, 9, ngram=3, profile=profile) == (3, 8, 0.556)
    assert choose(per_row, 9, k=8, profile=profile) == (3, 8, 2.333)
    assert choose(free, 9, k=6, profile=profile) == (1, 6, 0.4)  # unprofiled: the best n
    assert choose(free, 5, k=8, profile=profile)[:2] == (1, 4)  # at most the width
    assert choose({2: 1.0}, 9, profile=profile) == (1, 1, 0.667)  # only timed widths


def test_a_verify_forward_s_cost_between_the_probed_widths() -> None:
    costs = {2: 1.2, 3: 1.5, 5: 2.5, 9: 4.5}
    assert [cost_of(costs, w) for w in (1, 2, 4, 7, 9, 10)] == [1.0, 1.2, 2.0, 3.5, 4.5, None]


def test_auto_drafts_where_the_recorded_costs_say_it_pays(
    tiny: LoadedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Off the CPU, `auto` reads the verify probe: it drafts with the cheapest pair where
    its forwards cost less per token than plain decoding's, and not where none does."""
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.gpu))
    key = invariance._key(tiny, B)

    def auto(costs: list[float], width: int = 9) -> Plan | None:
        times = dict(zip(("2", "3", "5", "9"), costs, strict=True))
        passed = {str(w): w <= width for w in VERIFY_WIDTHS}
        record = {key: {"verify": passed, "verify_costs": times}}
        (tmp_path / PROBES).write_text(json.dumps(record))
        return Drafting(tiny, DraftConfig(), B, tmp_path).plan()

    n, k, ratio = choose(dict(zip(VERIFY_WIDTHS, [1.0] * 4, strict=True)), 9)
    assert ratio < 1 and auto([1.0, 1.0, 1.0, 1.0]) == Plan("lookup", k, ngram=n)
    assert auto([2.0, 3.0, 5.0, 9.0]) is None  # a row costs a row: never pays
    assert auto([1.0, 1.0, 1.0, 1.0], width=1) is None  # not exact: off, said nowhere


def test_a_batching_engine_s_plan_drafts_in_the_batch_where_the_probe_allows(
    tiny: LoadedModel, recurrent: LoadedModel, tmp_path: Path
) -> None:
    six = DraftConfig(mode="lookup", tokens=6, ngram=3)
    drafting = Drafting(tiny, six, B, tmp_path)
    assert drafting.plan(batch=True) == Plan("lookup", 6, batched=True)
    assert drafting.plan() == Plan("lookup", 6)  # no batch: its own forwards
    (found,) = json.loads((tmp_path / PROBES).read_text()).values()
    assert found["batch_verify"] == MAX_DRAFT + 1
    # A narrower width passed in a batch: k at most what it passed.
    key = next(iter(json.loads((tmp_path / PROBES).read_text())))
    (tmp_path / PROBES).write_text(json.dumps({key: {**found, "batch_verify": 3}}))
    narrower = Drafting(tiny, six, B, tmp_path)
    assert narrower.plan(batch=True) == Plan("lookup", 2, batched=True)
    # Recurrent state too (rows restored and fed again), where its probe passes.
    rows = Drafting(recurrent, six, B, tmp_path)
    assert rows.plan(batch=True) == Plan("lookup", 6, batched=True)
    # Where no width passed in a batch, drafted rows keep their own forwards.
    records = json.loads((tmp_path / PROBES).read_text())
    (tmp_path / PROBES).write_text(
        json.dumps({k: {**v, "batch_verify": 1} for k, v in records.items()})
    )
    own = Drafting(recurrent, DraftConfig(mode="lookup"), B, tmp_path).plan(batch=True)
    assert own is not None and not own.batched


def test_a_refused_model_decodes_plainly_and_says_so_once(
    variants: dict[str, Variant], tmp_path: Path
) -> None:
    shaped = variants["shaped"].loaded
    said: list[str] = []
    drafting = Drafting(shaped, DraftConfig(mode="lookup"), B, tmp_path, on_warning=said.append)
    assert drafting.plan() is None and drafting.plan("lookup") is None
    assert len(said) == 1 and said[0].startswith("drafting off:")
    assert "--draft-inexact" in said[0]


def test_inexact_drafting_differs_on_the_shape_sensitive_model(
    variants: dict[str, Variant], tmp_path: Path
) -> None:
    """Where the probe refuses drafting, --draft-inexact drafts anyway and the reply then
    differs from plain decoding: the exactness checks can fail."""
    shaped = variants["shaped"].loaded
    said: list[str] = []
    config = DraftConfig(mode="lookup", inexact=True)
    drafting = Drafting(shaped, config, B, tmp_path, on_warning=said.append)
    tokens = [*prompt(8, seed=1)] * 3  # lookup finds the prompt's repeats
    request = Request(tokens, SamplingParams(max_tokens=16), logprobs=1)
    plain = scored(list(Engine(shaped, block_size=B).generate(request)))
    inexact = Engine(shaped, block_size=B, drafting=drafting)
    got = list(inexact.generate(request))
    assert said and said[0].startswith("drafting inexact:")
    done = next(e for e in got if isinstance(e, Done)).result
    assert done.stats.draft == "lookup" and done.stats.verify_forwards > 0
    assert scored(got) != plain


# -- every family -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def families(tiny: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("draft-families")
    return {name: load(str(build(root / name, tiny.path, c))) for name, c in FAMILIES.items()}


EXACT_FAMILIES = {"qwen3", "qwen3_moe", "qwen3_next", "lfm2", "gemma3_text", "gpt_oss"}
"""The families whose verify forwards this CPU computes as decode steps (measured here:
MLA's multi-row path is another computation than its one-row one, Mamba 2's scan differs
by length; sliding windows pass since decode keeps them in time order, `ring.TimeRing`)."""


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_drafts_exactly_or_not_at_all(
    family: str, families: dict[str, LoadedModel], tmp_path: Path
) -> None:
    loaded = families[family]
    drafting = Drafting(loaded, DraftConfig(mode="lookup"), B, tmp_path)
    plan = drafting.plan()
    assert (plan is not None) == (family in EXACT_FAMILIES), drafting.verify()
    tokens = prompt(10, seed=2) * 2
    for params in (SamplingParams(max_tokens=20), SamplingParams(max_tokens=20, temperature=1.0)):
        request = Request(tokens, params, logprobs=2)
        plain = scored(list(Engine(loaded, block_size=B).generate(request)))
        cache = CacheConfig(block_size=B, directory=tmp_path, disk_bytes=0)
        engine = Engine(loaded, _cache(loaded, cache), drafting=drafting)
        for _ in range(2):  # cold, then resumed from the cache
            assert scored(list(engine.generate(request))) == plain
    # Beside a plain request in the decode batch: its verify forwards are rows of it
    # (drafts of the plain reply, every third one wrong: accepted and rejected rows).
    in_batch = None if plan is None else dataclasses.replace(plan, batched=True)
    assert drafting.plan(batch=True) == in_batch
    other = Request(prompt(7, seed=3), SamplingParams(max_tokens=20), logprobs=2)
    alone = [plain, scored(list(Engine(loaded, block_size=B).generate(other)))]
    oracle = Oracle(len(tokens), [t for t, _, _ in plain], len(loaded.tokenizer))
    batched = Engine(loaded, block_size=B, drafting=OracleDrafting(loaded, tmp_path, oracle))
    batched.batch_decode = True
    replies, widths = run_together(batched, [request, other])
    assert replies == alone
    assert (max(widths) > 1) == (plan is not None)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_drafts_to_a_stop_string_as_plain_decoding(
    family: str, families: dict[str, LoadedModel], tmp_path: Path
) -> None:
    check_drafted_stops(Rig(Variant.of(family, families[family], False), tmp_path))


def _cache(loaded: LoadedModel, config: CacheConfig) -> Any:
    from mlxcache.runtime import make_cache

    return make_cache(loaded, config)


# -- a draft model ------------------------------------------------------------------------


def test_a_draft_model_drafts_exactly_and_resumes_its_own_prompt(
    tiny_gguf: Path, families: dict[str, LoadedModel], tmp_path: Path
) -> None:
    """A draft model of the same vocabulary (another family, other weights) drafts; the
    reply is the plain one; its own prompt resumes from the prompt cache next turn."""
    helper = str(families["qwen3"].path)
    config = CacheConfig(block_size=B, directory=tmp_path)
    draft = DraftConfig(mode="model", model=helper)
    engine = open_engine(str(tiny_gguf), config, draft=draft)
    assert engine.drafting.draft_model is not None
    tokens = prompt(12, seed=5) * 2
    plain = scored(list(open_engine(str(tiny_gguf), config).generate(Request(tokens, logprobs=1))))
    got = list(engine.generate(Request(tokens, logprobs=1)))
    assert scored(got) == plain
    stats = next(e for e in got if isinstance(e, Done)).result.stats
    assert stats.draft == "model" and stats.drafted_tokens > 0
    # The draft model kept its prompt's full blocks (its own namespace): a next turn's
    # drafts resume from them.
    small = engine.drafting.draft_model.cache
    seen = np.asarray([*tokens, *(t for t, _, _ in plain)], dtype=np.int32)
    assert small.cached_length(seen) == len(tokens) // B * B
    assert engine.cache.cached_length(seen) == len(tokens) // B * B  # the target's own


def test_a_draft_model_must_share_the_vocabulary(
    tiny_gguf: Path, tiny: LoadedModel, tmp_path: Path
) -> None:
    other = build(tmp_path / "other", tiny.path, FAMILIES["qwen3"], vocab_size=300)
    (other / "tokenizer.json").write_text(
        (other / "tokenizer.json").read_text().replace('"<|im_end|>"', '"<|im_stop|>"')
    )
    config = CacheConfig(block_size=B, directory=tmp_path)
    with pytest.raises(UserInputError, match="vocabulary"):
        open_engine(str(tiny_gguf), config, draft=DraftConfig(mode="model", model=str(other)))
    recurrent = build(tmp_path / "lfm2", tiny.path, FAMILIES["lfm2"])
    with pytest.raises(UserInputError, match="plain transformer"):
        open_engine(str(tiny_gguf), config, draft=DraftConfig(model=str(recurrent)))


def test_draft_settings_are_checked() -> None:
    for bad in ({"mode": "always"}, {"tokens": 0}, {"tokens": 9}, {"ngram": 0}, {"mode": "model"}):
        with pytest.raises(SettingError):
            DraftConfig(**bad)


# -- the CLI ------------------------------------------------------------------------------


def _generate(tiny_gguf: Path, *extra: str) -> Any:
    args = ["generate", "--raw", "ab ab ab ab ab", "-m", str(tiny_gguf), "-n", "10"]
    return runner.invoke(app, [*args, "--block-size", "4", "--json", *extra])


def test_generate_drafted_prints_the_plain_reply(cache_root: Path, tiny_gguf: Path) -> None:
    plain = _generate(tiny_gguf, "--draft", "off")
    drafted = _generate(tiny_gguf, "--draft", "lookup", "--draft-tokens", "3")
    assert plain.exit_code == 0 and drafted.exit_code == 0, drafted.stderr
    a, b = json.loads(plain.stdout), json.loads(drafted.stdout)
    assert (a["text"], a["tokens"]) == (b["text"], b["tokens"])
    assert a["stats"]["draft"] == "" and b["stats"]["draft"] == "lookup"
    assert b["stats"]["verify_forwards"] < len(b["tokens"])


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--draft", "sometimes"], "--draft must be one of auto, lookup, model, off"),
        (["--draft-tokens", "0"], "--draft-tokens must be in 1..8, got 0"),
        (["--draft-ngram", "0"], "--draft-ngram must be >= 1, got 0"),
        (["--draft", "model"], "--draft model needs a draft model (--draft-model)"),
        (["--draft-model", "/nowhere/model.gguf"], "/nowhere/model.gguf"),
    ],
)
def test_bad_draft_options_are_one_line(
    cache_root: Path, tiny_gguf: Path, extra: list[str], message: str
) -> None:
    result = _generate(tiny_gguf, *extra)
    assert result.exit_code != 0 and "Traceback" not in result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr


# -- serve --------------------------------------------------------------------------------


@pytest.mark.parametrize("batch", [False, True])
def test_serve_takes_a_draft_field_and_replies_as_without(
    tiny: LoadedModel, batch: bool, tmp_path: Path
) -> None:
    """Through the server, whether its drafted rows verify in the decode batch or not."""
    from asgi import call

    from mlxcache.server.app import Settings, create_app
    from mlxcache.server.log import RequestLog
    from mlxcache.worker import EngineWorker

    drafting = Drafting(tiny, DraftConfig(mode="off"), B, tmp_path)
    engine = Engine(tiny, block_size=B, warm_ahead=False, batch_decode=batch, drafting=drafting)
    with EngineWorker(engine) as worker:
        app = create_app(engine, worker, Settings(tiny.name), RequestLog(stream=io.StringIO()))
        body = {
            "model": tiny.name,
            "messages": [{"role": "user", "content": "ab ab ab ab"}],
            "max_tokens": 12,
            "temperature": 0.8,
            "seed": 1,
            "mlxcache_usage": True,
        }
        plain = call(app, "POST", "/v1/chat/completions", body).json()
        drafted = call(app, "POST", "/v1/chat/completions", {**body, "draft": "lookup"}).json()
        assert drafted["choices"] == plain["choices"]
        stats = drafted["usage"]["mlxcache"]["stats"]
        assert stats["draft"] == "lookup" and stats["verify_forwards"] > 0
        assert plain["usage"]["mlxcache"]["stats"]["draft"] == ""  # the server's: off
        refused = call(app, "POST", "/v1/chat/completions", {**body, "draft": "model"})
        assert refused.status == 400 and refused.json()["error"]["param"] == "draft"
        assert "--draft-model" in refused.json()["error"]["message"]
        bad = call(app, "POST", "/v1/chat/completions", {**body, "draft": "always"})
        assert bad.status == 400 and bad.json()["error"]["param"] == "draft"


def test_json_batch_drafted_writes_the_plain_records(
    cache_root: Path, tiny_gguf: Path, tmp_path: Path
) -> None:
    lines = [{"prompt": p} for p in ("ab ab ab", "cd cd", "ab ab ab cd")]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    schema = '{"type": "object", "properties": {"w": {"type": "string", "maxLength": 12}}}'

    def batch(out: str, *extra: str) -> tuple[int, list[dict[str, Any]]]:
        args = ["json", "--schema", schema, "-m", str(tiny_gguf), "-n", "24", "--temp", "0.9"]
        args += ["--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / out)]
        result = runner.invoke(app, [*args, "--lanes", "2", "--block-size", "4", *extra])
        records = [json.loads(x) for x in (tmp_path / out).read_text().splitlines()]
        kept = [{k: v for k, v in r.items() if k not in ("stats", "run")} for r in records]
        return result.exit_code, kept

    drafted = batch("drafted.jsonl", "--draft", "lookup")
    assert drafted == batch("plain.jsonl", "--draft", "off")
    assert len(drafted[1]) == 3 and any(r["output"] for r in drafted[1])
    stats = [json.loads(x)["stats"] for x in (tmp_path / "drafted.jsonl").read_text().splitlines()]
    assert {s["draft"] for s in stats} == {"lookup"} and sum(s["verify_forwards"] for s in stats)


def test_chat_drafted_replies_as_plain_retry_included(cache_root: Path, tiny_gguf: Path) -> None:
    turns = "ab ab ab\n/retry\ncd cd cd cd\n"

    def chat(tmp: Path, *extra: str) -> str:
        args = ["chat", "-m", str(tiny_gguf), "--cache-dir", str(tmp), "--cache-disk", "0"]
        result = runner.invoke(app, [*args, "-n", "10", "-t", "0.7", *extra], input=turns)
        assert result.exit_code == 0, result.stderr
        return result.stdout

    plain = chat(cache_root / "chat-plain", "--draft", "off")
    assert chat(cache_root / "chat-drafted", "--draft", "lookup") == plain


# -- real models --------------------------------------------------------------------------


@pytest.mark.model
def test_smollm2_drafted_is_plain_cold_and_resumed(smol: LoadedModel, tmp_path: Path) -> None:
    """SmolLM2: the probe passes on this CPU; a reply that copies its prompt drafts by
    lookup (most drafts accepted), a draft model (SmolLM2 itself) drafts too, and both
    replies are the plain one, token for token and log-probability for log-probability,
    cold and resumed from the prompt cache, alone and in the decode batch."""
    text = "Repeat exactly: the quick brown fox jumps over the lazy dog."
    config = CacheConfig(directory=tmp_path, disk_bytes=0)
    params = SamplingParams(max_tokens=14, temperature=0.5, seed=1)
    engine = Engine(smol, _cache(smol, config))
    ids = engine.encoder.encode_chat([{"role": "user", "content": text}])
    plain = scored(list(engine.generate(Request(ids, params, logprobs=1))))
    lookup = Drafting(smol, DraftConfig(mode="lookup"), config.block_size, tmp_path)
    assert lookup.verify().width == 9
    engine.drafting = lookup
    for _ in range(2):  # the prompt resumed whole the second time
        got = list(engine.generate(Request(ids, params, logprobs=1)))
        assert scored(got) == plain
        stats = next(e for e in got if isinstance(e, Done)).result.stats
        assert stats.accepted_tokens >= stats.drafted_tokens // 2 > 0
    # Beside another request, its verify forwards are rows of the decode batch.
    color = engine.encoder.encode_chat([{"role": "user", "content": "Name a color."}])
    other = Request(color, SamplingParams(max_tokens=6), logprobs=1)
    alone = scored(list(Engine(smol, _cache(smol, config)).generate(other)))
    batched = Engine(smol, _cache(smol, config), drafting=lookup, batch_decode=True)
    drafted = Request(ids, params, logprobs=1, draft="lookup")
    replies, widths = run_together(batched, [drafted, other])
    assert replies == [plain, alone] and max(widths) > 1
    from mlxcache.drafting import DraftModel

    helper = DraftModel(smol, _cache(smol, config))
    engine.drafting = Drafting(
        smol, DraftConfig(mode="model", model=smol.name), config.block_size, tmp_path, helper
    )
    got = list(engine.generate(Request(ids, params, logprobs=1)))
    assert scored(got) == plain
    assert next(e for e in got if isinstance(e, Done)).result.stats.draft == "model"


def test_shared_drafts_are_rank_0s_on_every_rank() -> None:
    """In a sharded run a draft model's drafts go out with the picks' collective: rank 0's
    drafter proposes, the others propose nothing of their own and get rank 0's tokens (a
    count, then up to MAX_DRAFT tokens), so every rank verifies the same rows."""

    class Fixed:
        def __init__(self, drafts: list[int]) -> None:
            self.drafts, self.closed = drafts, False

        def propose(self, tokens: np.ndarray, k: int) -> list[int]:
            return self.drafts[:k]

        def close(self) -> None:
            self.closed = True

    class Collective:
        """Rank 0's array, whatever this rank sends (as `Ranks.token` sums them)."""

        def __init__(self) -> None:
            self.sent: list[mx.array] = []

        def token(self, token: mx.array) -> mx.array:
            self.sent.append(token)
            return self.sent[0]

        def fail(self) -> None:
            raise AssertionError("no pick fails here")

    wire = Collective()
    own = Fixed([7, 261, 0, 5])
    leader, follower = Shared(own, wire), Shared(None, wire)
    assert leader.propose(np.arange(3), 3) == [7, 261, 0]
    assert follower.propose(np.arange(3), 3) == [7, 261, 0]
    assert np.array(wire.sent[0]).tolist() == [3, 7, 261, 0, 0, 0, 0, 0, 0]
    assert np.array(wire.sent[1]).tolist() == [0] * (MAX_DRAFT + 1)  # the follower's own: none
    wire.sent.clear()
    assert leader.propose(np.arange(3), 0) == [] and follower.propose(np.arange(3), 0) == []
    leader.close()
    follower.close()
    assert own.closed


@pytest.mark.parametrize("role", ["-m", "--draft-model"])
@pytest.mark.parametrize("content", ["{oops", '{"model": {"type": "Nope"}}', ""])
def test_a_tokenizer_that_does_not_load_is_one_line(
    cache_root: Path, tiny: LoadedModel, tmp_path: Path, role: str, content: str
) -> None:
    """The tokenizers library raises a plain Exception for a tokenizer.json it cannot read:
    one error line, as the main model and as the draft model (issue 53, item 15)."""
    folder = tmp_path / "broken"
    shutil.copytree(tiny.path, folder)
    (folder / "tokenizer.json").write_text(content)
    model = ["-m", str(folder)] if role == "-m" else ["-m", str(tiny.path), role, str(folder)]
    args = ["generate", "--raw", "ab", *model, "-n", "2", "--cache-dir", str(tmp_path)]
    result = runner.invoke(app, args)
    assert (result.exit_code, result.stdout, result.exception.__class__) == (2, "", SystemExit)
    assert result.stderr.startswith(f"error: cannot load the tokenizer of model {folder}: ")
    assert len(result.stderr.splitlines()) == 1, result.stderr


def test_a_drafted_lane_says_when_its_next_forward_is_a_verify(
    tiny: LoadedModel, tmp_path: Path
) -> None:
    """The scheduler labels a drafted request's own turn a verify from the lane's state
    (`Lane.verifies`): driven as the engine drives it, before every step that is not given
    a forward's logits the lane says whether that step asks for a verify forward; steps
    that read accepted rows ask for none."""
    drafting = Drafting(tiny, DraftConfig(mode="lookup", tokens=3, ngram=2), B, tmp_path)
    engine = Engine(tiny, block_size=B, drafting=drafting)
    tokens = ids(*([5, 6, 7, 8, 9] * 4))
    req = Request(tokens, SamplingParams(max_tokens=24, temperature=0.0))
    lane = request_lane.request(lanes.Work.of(engine), 0, tokens, req, None, drafting.plan())
    logits: mx.array | None = None
    said = lane.verifies
    pairs: list[tuple[bool, bool]] = []  # (said before a step, that step asked for a verify)
    reads = 0  # steps that read an accepted row, no forward asked
    while True:
        got = lane.step(logits)
        if logits is None:
            pairs.append((said, isinstance(got, Forward) and got.kind is TurnKind.VERIFY))
            reads += isinstance(got, Token) and lane.reply is not None and lane.reply.row > 0
        logits = lanes.own_forward(lane, got, engine.model) if isinstance(got, Forward) else None
        if isinstance(got, Done):
            break
        said = lane.verifies
    assert got.result.error is None and all(s == a for s, a in pairs)
    stats = got.result.stats
    verifies = sum(a for _, a in pairs)
    assert verifies == stats.verify_forwards > 0 and stats.accepted_tokens > 0 and reads > 0
