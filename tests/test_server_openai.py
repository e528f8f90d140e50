"""OpenAI's parameters over the ASGI app with the tiny model (issue 21, item 4): logprobs
(chat and completions, streamed or not; the same bits resumed or not), logit bias and
presence/frequency penalties, OpenAI's ranges, refusals naming the field, a model's card,
the bearer scheme in any case, CORS only when asked, and /metrics.

Every reply is checked against the library on the same prompt (an engine without a cache,
run on the worker's thread) or against what OpenAI's definition gives.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from asgi import Reply, call
from cli_run import unloadable
from shapemodel import shaped
from test_sampling import openai_penalties
from typer.testing import CliRunner

from mlxcache.cache.store import PromptCache
from mlxcache.config import CacheConfig
from mlxcache.engine import Engine, Request
from mlxcache.events import Token
from mlxcache.model import LoadedModel
from mlxcache.sampling import SamplingParams
from mlxcache.server.app import Settings, create_app
from mlxcache.server.log import RequestLog
from mlxcache.wire import identity
from mlxcache.worker import EngineWorker
from mlxcache_cli.main import app as cli

BLOCK = 4
PROMPT = "Once upon a time there was a cat"
MESSAGES = [{"role": "user", "content": "hello"}]


@pytest.fixture
def worker(tiny: LoadedModel) -> Iterator[EngineWorker]:
    with EngineWorker(Engine(tiny, block_size=BLOCK, warm_ahead=False)) as running:
        yield running


def app_of(worker: EngineWorker, **settings: Any) -> Any:
    name = settings.pop("model_id", worker.engine.loaded.name)
    return create_app(
        worker.engine, worker, Settings(name, **settings), RequestLog(stream=io.StringIO())
    )


def post(app: Any, path: str, **fields: Any) -> Reply:
    return call(app, "POST", path, fields)


def chat(app: Any, **fields: Any) -> Reply:
    return post(app, "/v1/chat/completions", model="tiny.gguf", messages=MESSAGES, **fields)


def library(worker: EngineWorker, request: Request) -> list[Token]:
    """The library's tokens for `request` (no cache: prefilled from token 0), on the
    worker's thread (the one that runs MLX)."""
    ref = Engine(worker.engine.loaded, block_size=BLOCK)

    def tokens(_: Engine) -> list[Token]:
        return [e for e in ref.generate(request) if isinstance(e, Token) and e.logprob is not None]

    result: list[Token] = worker.call(tokens)
    return result


def content(doc: dict[str, Any]) -> str:
    text: str = doc["choices"][0]["message"]["content"]
    return text


def chunks(reply: Reply) -> list[dict[str, Any]]:
    """The JSON chunks of a stream (it must end with [DONE])."""
    assert reply.status == 200 and reply.events()[-1] == "[DONE]", reply.body
    return [json.loads(e) for e in reply.events()[:-1]]


# -- logprobs -----------------------------------------------------------------------------


def check_entries(tokenizer: Any, entries: list[dict[str, Any]], expected: list[Token]) -> None:
    """Chat entries against the library's tokens: the same numbers, and bytes that are each
    token's (checked through the tokenizer's own decoding, not our byte table)."""
    assert [e["logprob"] for e in entries] == [t.logprob for t in expected]
    got_top = [[a["logprob"] for a in e["top_logprobs"]] for e in entries]
    assert got_top == [[v for _, v in t.top_logprobs] for t in expected]
    ids = [t.token for t in expected]
    joined = b"".join(bytes(e["bytes"]) for e in entries).decode("utf-8", "replace")
    assert joined == tokenizer.decode(ids, skip_special_tokens=False)
    for entry, token in zip(entries, expected, strict=True):
        pairs = [(entry, token.token)] + [
            (alt, tid)
            for alt, (tid, _) in zip(entry["top_logprobs"], token.top_logprobs, strict=True)
        ]
        for item, tid in pairs:
            raw = bytes(item["bytes"])
            assert raw.decode("utf-8", "replace") == tokenizer.decode([tid])
            assert item["token"] == raw.decode("utf-8", "backslashreplace")


def test_chat_logprobs_streamed_and_plain_are_the_library_s(worker: EngineWorker) -> None:
    app = app_of(worker)
    fields = {"logprobs": True, "top_logprobs": 3, "max_tokens": 8, "temperature": 0.9, "seed": 4}
    plain = chat(app, **fields)
    assert plain.status == 200, plain.body
    choice = plain.json()["choices"][0]
    ids = worker.engine.encoder.encode_chat(MESSAGES)
    params = SamplingParams(max_tokens=8, temperature=0.9, seed=4)
    expected = library(worker, Request(ids, params, logprobs=3))
    assert choice["logprobs"]["refusal"] is None
    entries = choice["logprobs"]["content"]
    assert len(entries) == plain.json()["usage"]["completion_tokens"] == len(expected)
    assert all(len(e["top_logprobs"]) == 3 for e in entries)
    check_entries(worker.engine.loaded.tokenizer, entries, expected)

    streamed = chunks(chat(app, stream=True, **fields))
    parts = [c["choices"][0]["logprobs"] for c in streamed]
    assert parts[0] is None  # the role chunk comes before any token
    assert [e for p in parts if p for e in p["content"]] == entries
    assert (
        "".join(c["choices"][0]["delta"].get("content", "") for c in streamed)
        == (choice["message"]["content"])
    )
    # Without top_logprobs: each token's own, and empty alternatives.
    alone = chat(app, logprobs=True, max_tokens=4).json()["choices"][0]["logprobs"]["content"]
    assert [e["top_logprobs"] for e in alone] == [[]] * 4
    assert chat(app, max_tokens=2).json()["choices"][0]["logprobs"] is None


def test_completion_logprobs_streamed_and_plain_are_the_library_s(worker: EngineWorker) -> None:
    app = app_of(worker)
    fields = {"model": "tiny.gguf", "prompt": PROMPT, "max_tokens": 6, "logprobs": 2}
    plain = post(app, "/v1/completions", **fields).json()["choices"][0]
    expected = library(
        worker,
        Request(worker.engine.encoder.encode(PROMPT), SamplingParams(max_tokens=6), logprobs=2),
    )
    logprobs = plain["logprobs"]
    assert logprobs["token_logprobs"] == [t.logprob for t in expected]
    assert [list(top.values()) for top in logprobs["top_logprobs"]] == [
        [v for _, v in t.top_logprobs] for t in expected
    ]
    # This reply's bytes are ED ED ED ED 97 97: three broken characters, then U+D5D7.
    # A token that only starts a character has it at its offset when it completes.
    assert plain["text"] == "\ufffd" * 3 + "\ud5d7"
    assert logprobs["tokens"] == ["\\xed"] * 4 + ["\\x97"] * 2
    assert logprobs["text_offset"] == [0, 0, 1, 2, 3, 3]
    streamed = chunks(post(app, "/v1/completions", stream=True, **fields))
    parts = [c["choices"][0]["logprobs"] for c in streamed if c["choices"][0]["logprobs"]]
    merged = {k: [x for p in parts for x in p[k]] for k in logprobs}
    assert merged == logprobs


def memory_cache(loaded: LoadedModel, directory: Path) -> PromptCache:
    config = CacheConfig(block_size=BLOCK, directory=directory, disk_bytes=0)
    return PromptCache(loaded.model, loaded.key, config, root=None)


@pytest.fixture
def shaped_worker(tiny: LoadedModel, tmp_path: Path) -> Iterator[EngineWorker]:
    """A shape-sensitive model (other call shapes, other bits) behind a memory cache."""
    loaded = shaped(tiny)
    cache = memory_cache(loaded, tmp_path)
    with EngineWorker(Engine(loaded, cache, warm_ahead=False)) as running:
        yield running


def test_logprobs_are_the_same_bits_resumed_or_not(shaped_worker: EngineWorker) -> None:
    app = app_of(shaped_worker)
    other = PROMPT[:20] + " and a dog ran off"

    def ask(prompt: str) -> tuple[list[float], list[list[float]], int]:
        body = {"model": "tiny.gguf", "prompt": prompt, "max_tokens": 5, "logprobs": 4}
        doc = post(app, "/v1/completions", **body).json()
        lp = doc["choices"][0]["logprobs"]
        tops = [list(top.values()) for top in lp["top_logprobs"]]
        return lp["token_logprobs"], tops, doc["usage"]["prompt_tokens_details"]["cached_tokens"]

    first = shaped_worker.engine.encoder.encode(PROMPT)
    assert ask(PROMPT)[2] == 0
    resumed = ask(other)  # from the blocks the first prompt kept
    again = ask(other)  # the whole prompt, with its remembered last logits
    ids = shaped_worker.engine.encoder.encode(other)
    cold = library(shaped_worker, Request(ids, SamplingParams(max_tokens=5), logprobs=4))
    shared = next(i for i, (a, b) in enumerate(zip(first, ids, strict=False)) if a != b)
    assert (resumed[2], again[2]) == (shared // BLOCK * BLOCK, len(ids))
    for got in (resumed, again):
        assert got[0] == [t.logprob for t in cold]
        assert got[1] == [[v for _, v in t.top_logprobs] for t in cold]


# -- logit bias and penalties ---------------------------------------------------------------


def test_logit_bias_moves_the_draw(worker: EngineWorker) -> None:
    app = app_of(worker)
    # +100 on "a" (100) and " a" (261): the reply is only those; their offsets add up.
    body = {"model": "tiny.gguf", "prompt": PROMPT, "max_tokens": 6, "logprobs": 1}
    doc = post(app, "/v1/completions", logit_bias={"100": 100, "261": 100}, **body).json()
    logprobs = doc["choices"][0]["logprobs"]
    assert set(logprobs["tokens"]) <= {"a", " a"} and len(logprobs["tokens"]) == 6
    assert doc["choices"][0]["text"] == "".join(logprobs["tokens"])
    # Read after the bias: the two biased tokens hold almost all the mass.
    assert all(lp > -1 for lp in logprobs["token_logprobs"])
    lengths = [len(t) for t in logprobs["tokens"]]
    assert logprobs["text_offset"] == [sum(lengths[:i]) for i in range(6)]
    # -100 on the greedy reply's first token: another first token.
    greedy = chat(app, max_tokens=1, logprobs=True).json()["choices"][0]["logprobs"]["content"]
    first = greedy[0]
    ids = worker.engine.encoder.encode_chat(MESSAGES)
    (token,) = [
        t.token for t in library(worker, Request(ids, SamplingParams(max_tokens=1), logprobs=0))
    ]
    banned = chat(app, max_tokens=1, logprobs=True, logit_bias={str(token): -100}).json()
    assert banned["choices"][0]["logprobs"]["content"][0]["bytes"] != first["bytes"]


@pytest.mark.parametrize(("presence", "frequency"), [(2.0, 0.0), (0.0, 1.5), (-1.0, 2.0)])
def test_presence_and_frequency_penalties_are_openai_s(
    worker: EngineWorker, presence: float, frequency: float
) -> None:
    app = app_of(worker)
    fields = {"max_tokens": 12, "presence_penalty": presence, "frequency_penalty": frequency}
    got = chat(app, **fields).json()["choices"][0]["message"]["content"]
    ids = worker.engine.encoder.encode_chat(MESSAGES)
    params = SamplingParams(max_tokens=12)
    request = Request(ids, params, [openai_penalties(len(ids), presence, frequency)])
    expected = worker.call(
        lambda _: Engine(worker.engine.loaded, block_size=BLOCK).complete(request)
    )
    plain = chat(app, max_tokens=12).json()["choices"][0]["message"]["content"]
    assert got == expected.text != plain
    # The library's own: the same penalties as SamplingParams fields give the same tokens.
    params = SamplingParams(max_tokens=12, presence_penalty=presence, frequency_penalty=frequency)
    own = worker.call(
        lambda _: Engine(worker.engine.loaded, block_size=BLOCK).complete(Request(ids, params))
    )
    assert own.tokens == expected.tokens


def test_server_default_penalties_apply_unless_the_request_sets_its_own(
    worker: EngineWorker,
) -> None:
    served = app_of(worker, defaults=SamplingParams(frequency_penalty=1.5))
    plain = app_of(worker)

    def text(app: Any, **fields: Any) -> str:
        reply: str = chat(app, max_tokens=12, **fields).json()["choices"][0]["message"]["content"]
        return reply

    assert text(served) == text(plain, frequency_penalty=1.5) != text(plain)
    assert text(served, frequency_penalty=0) == text(plain)


# -- what is refused, and how -------------------------------------------------------------


def invalid(message: str, param: str | None, code: str = "invalid_value") -> dict[str, Any]:
    error = {"message": message, "type": "invalid_request_error", "param": param, "code": code}
    return {"error": error}


def unsupported(param: str, why: str) -> dict[str, Any]:
    return invalid(f"{param}: {why}", param, "unsupported_parameter")


@pytest.mark.parametrize(
    ("path", "fields", "error"),
    [
        (
            "chat",
            {"temperature": 2.5},
            invalid("temperature: Input should be less than or equal to 2", "temperature"),
        ),
        (
            "chat",
            {"top_p": 1.01},
            invalid("top_p: Input should be less than or equal to 1", "top_p"),
        ),
        (
            "chat",
            {"top_p": -0.1},
            invalid("top_p: Input should be greater than or equal to 0", "top_p"),
        ),
        (
            "chat",
            {"presence_penalty": 2.5},
            invalid(
                "presence_penalty: Input should be less than or equal to 2", "presence_penalty"
            ),
        ),
        (
            "text",
            {"frequency_penalty": -3},
            invalid(
                "frequency_penalty: Input should be greater than or equal to -2",
                "frequency_penalty",
            ),
        ),
        (
            "chat",
            {"logit_bias": {"5": 101}},
            invalid("logit_bias.5: Input should be less than or equal to 100", "logit_bias.5"),
        ),
        (
            "chat",
            {"logit_bias": {"262": 1}},
            invalid("logit_bias: '262' is not a token id of this model (0 to 261)", "logit_bias"),
        ),
        (
            "text",
            {"logit_bias": {"a": 1}},
            invalid("logit_bias: 'a' is not a token id of this model (0 to 261)", "logit_bias"),
        ),
        (
            "chat",
            {"logit_bias": {"5": "1"}},
            invalid("logit_bias.5: Input should be a valid number", "logit_bias.5"),
        ),
        ("chat", {"top_logprobs": 2}, invalid("top_logprobs needs logprobs: true", "top_logprobs")),
        (
            "chat",
            {"logprobs": True, "top_logprobs": 21},
            invalid("top_logprobs: Input should be less than or equal to 20", "top_logprobs"),
        ),
        ("chat", {"logprobs": 1}, invalid("logprobs: Input should be a valid boolean", "logprobs")),
        (
            "text",
            {"logprobs": 6},
            invalid("logprobs: Input should be less than or equal to 5", "logprobs"),
        ),
        (
            "text",
            {"logprobs": True},
            invalid("logprobs: Input should be a valid integer", "logprobs"),
        ),
        ("chat", {"n": 2}, invalid("n must be 1 (one choice per request)", "n")),
        (
            "chat",
            {"audio": {"voice": "alloy", "format": "wav"}},
            unsupported("audio", "audio output is not supported"),
        ),
        (
            "chat",
            {"modalities": ["text", "audio"]},
            unsupported("modalities", "only text output is supported"),
        ),
        (
            "chat",
            {"functions": [{"name": "f"}]},
            unsupported("functions", "functions is not supported (send tools)"),
        ),
        (
            "chat",
            {"function_call": "auto"},
            unsupported("function_call", "function_call is not supported (send tool_choice)"),
        ),
        (
            "chat",
            {"web_search_options": {"search_context_size": "low"}},
            unsupported("web_search_options", "web search is not supported"),
        ),
        (
            "chat",
            {"reasoning_effort": "extreme"},
            invalid(
                "reasoning_effort: Input should be 'none', 'minimal', 'low', 'medium', 'high' "
                "or 'xhigh'",
                "reasoning_effort",
            ),
        ),
        (
            "chat",
            {"verbosity": 2},
            invalid("verbosity: Input should be 'low', 'medium' or 'high'", "verbosity"),
        ),
        ("text", {"echo": True}, unsupported("echo", "echo is not supported")),
        ("text", {"best_of": 3}, unsupported("best_of", "best_of must be 1")),
        ("text", {"suffix": "!"}, unsupported("suffix", "suffix is not supported")),
        # Neutral values of what is not implemented, and bookkeeping fields: accepted.
        ("text", {"echo": False, "best_of": 1, "suffix": None, "user": "u", "store": True}, None),
        ("chat", {"modalities": ["text"], "audio": None, "web_search_options": {}}, None),
        (
            "chat",
            {"prediction": {"type": "content", "content": "hi"}, "service_tier": "auto"},
            None,
        ),
    ],
)
def test_openai_ranges_and_unsupported_fields_are_400s_naming_the_field(
    worker: EngineWorker, path: str, fields: dict[str, Any], error: dict[str, Any] | None
) -> None:
    app = app_of(worker)
    if path == "chat":
        reply = chat(app, max_tokens=1, **fields)
    else:
        reply = post(app, "/v1/completions", model="tiny.gguf", prompt="x", max_tokens=1, **fields)
    if error is None:
        assert reply.status == 200, reply.body
    else:
        assert (reply.status, reply.json()) == (400, error)


def test_top_p_zero_is_the_most_likely_token(worker: EngineWorker) -> None:
    app = app_of(worker)
    drawn = chat(app, max_tokens=8, temperature=1.5, seed=3, top_p=0).json()
    greedy = chat(app, max_tokens=8).json()
    hot = chat(app, max_tokens=8, temperature=1.5, seed=3).json()
    assert content(drawn) == content(greedy) != content(hot)


@pytest.mark.parametrize(
    ("part", "what"),
    [
        ({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}, "images are"),
        ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}, "audio is"),
        ({"type": "file", "file": {"file_id": "f"}}, "files are"),
    ],
)
def test_media_parts_are_refused_by_name(
    worker: EngineWorker, part: dict[str, Any], what: str
) -> None:
    content = [{"type": "text", "text": "What is this?"}, part]
    messages = [{"role": "system", "content": "hi"}, {"role": "user", "content": content}]
    reply = post(app_of(worker), "/v1/chat/completions", model="tiny.gguf", messages=messages)
    message = f"messages.1.content.1: {what} not supported by this model ({part['type']})"
    assert (reply.status, reply.json()) == (
        400,
        invalid(message, "messages.1.content.1", "unsupported_value"),
    )


# -- models, the key, CORS ----------------------------------------------------------------


def test_a_model_s_card_by_id(worker: EngineWorker) -> None:
    app = app_of(worker, model_id="org/tiny")  # ids may hold slashes
    card = {"id": "org/tiny", "object": "model", "created": 0, "owned_by": "mlxcache"}
    assert call(app, "GET", "/v1/models/org/tiny").json() == card
    assert call(app, "GET", "/v1/models").json()["data"] == [card]
    reply = call(app, "GET", "/v1/models/gpt-4o")
    message = "model 'gpt-4o' is not served here (it answers to 'org/tiny'; serve --alias NAME adds a name)"
    assert (reply.status, reply.json()) == (404, invalid(message, "model", "model_not_found"))


def test_the_model_card_shows_no_local_path(
    worker: EngineWorker, tiny_gguf: Path, cache_root: Path
) -> None:
    """Any client that reaches the port reads the card: it names the model, its family
    and digest, never where the model file, the cache or the user's home are."""
    engine = worker.engine
    config = CacheConfig(block_size=BLOCK, directory=cache_root)
    app = app_of(worker, identity=identity(str(tiny_gguf), engine, config, True))
    cards = [
        call(app, "GET", "/v1/models").json(),
        call(app, "GET", f"/v1/models/{engine.loaded.name}").json(),
    ]
    found = cards[1]["mlxcache"]
    assert (found["model"], found["family"], found["key"]) == (
        "tiny.gguf",
        "llama",
        engine.loaded.key,
    )
    assert found["block_size"] == BLOCK and len(found["digest"]) == 16
    places = {str(tiny_gguf.parent), str(cache_root), str(Path.home()), str(engine.loaded.path)}
    for card in cards:
        text = json.dumps(card)
        assert not [place for place in places if place in text], text


def test_the_bearer_scheme_is_case_insensitive(worker: EngineWorker) -> None:
    app = app_of(worker, api_key="sekret")
    for header in ("Bearer sekret", "bearer sekret", "BEARER  sekret"):
        assert call(app, "GET", "/v1/models", headers={"Authorization": header}).status == 200
    for header in ("Basic sekret", "Bearersekret", "bearer Sekret", "sekret", "bearer"):
        reply = call(app, "GET", "/v1/models", headers={"Authorization": header})
        assert reply.json()["error"]["code"] == "invalid_api_key", header


PAGE = "http://localhost:3000"


def test_cors_is_off_unless_origins_are_given(worker: EngineWorker) -> None:
    preflight = {
        "Origin": PAGE,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    }
    closed = app_of(worker, api_key="k")
    assert call(closed, "OPTIONS", "/v1/chat/completions", headers=preflight).status == 401
    reply = call(closed, "GET", "/v1/models", headers={"Origin": PAGE, "Authorization": "Bearer k"})
    assert reply.status == 200 and not any(h.startswith("access-control") for h in reply.headers)

    app = app_of(worker, api_key="k", cors_origins=(PAGE,))
    reply = call(app, "OPTIONS", "/v1/chat/completions", headers=preflight)
    assert reply.status == 200
    assert reply.headers["access-control-allow-origin"] == PAGE
    assert reply.headers["access-control-allow-headers"] == "authorization, content-type"
    assert "POST" in reply.headers["access-control-allow-methods"]
    # A refusal carries the header too, so the page can read why.
    reply = call(app, "GET", "/v1/models", headers={"Origin": PAGE})
    assert (reply.status, reply.headers["access-control-allow-origin"]) == (401, PAGE)
    reply = call(app, "GET", "/v1/models", headers={"Origin": "http://evil.example"})
    assert "access-control-allow-origin" not in reply.headers
    reply = call(
        app,
        "POST",
        "/v1/chat/completions",
        {"model": "tiny.gguf", "messages": MESSAGES, "max_tokens": 2, "stream": True},
        {"Origin": PAGE, "Authorization": "Bearer k"},
    )
    assert reply.headers["access-control-allow-origin"] == PAGE and reply.events()[-1] == "[DONE]"
    anyone = app_of(worker, cors_origins=("*",))
    reply = call(anyone, "GET", "/v1/models", headers={"Origin": "http://evil.example"})
    assert reply.headers["access-control-allow-origin"] == "*"


# -- metrics ------------------------------------------------------------------------------


@pytest.fixture
def cached_worker(tiny: LoadedModel, tmp_path: Path) -> Iterator[EngineWorker]:
    cache = memory_cache(tiny, tmp_path)
    with EngineWorker(Engine(tiny, cache, warm_ahead=False)) as running:
        yield running


def test_metrics_count_requests_tokens_and_the_cache(
    cached_worker: EngineWorker, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("mlxcache.server.served.resident_bytes", lambda: 123_456_789)
    app = app_of(cached_worker, api_key="k")
    key = {"Authorization": "Bearer k"}
    body = {"model": "tiny.gguf", "messages": MESSAGES, "max_tokens": 3}
    chats = [call(app, "POST", "/v1/chat/completions", body, key).json() for _ in range(2)]
    usages = [c["usage"] for c in chats]
    text = {"model": "tiny.gguf", "prompt": PROMPT, "max_tokens": 2, "stream": True}
    stream_opts = {"stream_options": {"include_usage": True}}
    streamed = call(app, "POST", "/v1/completions", {**text, **stream_opts}, key)
    usages.append(json.loads(streamed.events()[-2])["usage"])
    finishes = [c["choices"][0]["finish_reason"] for c in chats]
    finishes.append(json.loads(streamed.events()[-3])["choices"][0]["finish_reason"])
    ended = "".join(
        f'mlxcache_completions_total{{finish_reason="{f}"}} {finishes.count(f)}\n'
        for f in sorted(set(finishes))
    )
    assert call(app, "POST", "/v1/chat/completions", {**body, "n": 2}, key).status == 400
    assert call(app, "GET", "/v1/nothing", headers=key).status == 404
    assert call(app, "GET", "/metrics").status == 401  # the key guards it as every route
    report = call(app, "GET", "/v1/cache", headers=key).json()
    reply = call(app, "GET", "/metrics", headers=key)
    assert reply.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    prompt = sum(u["prompt_tokens"] for u in usages)
    generated = sum(u["completion_tokens"] for u in usages)
    assert report["hits"] == 1 and report["cached_tokens"] > 0  # the second chat resumed
    assert reply.body.decode() == EXPECTED_METRICS.format(
        prompt=prompt, generated=generated, ended=ended, **report
    )


EXPECTED_METRICS = """\
# HELP mlxcache_requests_total HTTP requests answered, by route (other: none matched) and status.
# TYPE mlxcache_requests_total counter
mlxcache_requests_total{{path="/v1/cache",status="200"}} 1
mlxcache_requests_total{{path="/v1/chat/completions",status="200"}} 2
mlxcache_requests_total{{path="/v1/chat/completions",status="400"}} 1
mlxcache_requests_total{{path="/v1/completions",status="200"}} 1
mlxcache_requests_total{{path="other",status="401"}} 1
mlxcache_requests_total{{path="other",status="404"}} 1
# HELP mlxcache_prompt_tokens_total Prompt tokens of finished completions.
# TYPE mlxcache_prompt_tokens_total counter
mlxcache_prompt_tokens_total {prompt}
# HELP mlxcache_generated_tokens_total Tokens generated by finished completions.
# TYPE mlxcache_generated_tokens_total counter
mlxcache_generated_tokens_total {generated}
# HELP mlxcache_completions_total Completions ended, by finish reason (error: the request failed; \
disconnected: the client left before it had the reply).
# TYPE mlxcache_completions_total counter
{ended}# HELP mlxcache_cache_hits_total Prompt cache lookups that resumed a prefix.
# TYPE mlxcache_cache_hits_total counter
mlxcache_cache_hits_total {hits}
# HELP mlxcache_cache_misses_total Prompt cache lookups that resumed nothing.
# TYPE mlxcache_cache_misses_total counter
mlxcache_cache_misses_total {misses}
# HELP mlxcache_cache_cached_tokens_total Prompt tokens resumed from the cache instead of prefilled.
# TYPE mlxcache_cache_cached_tokens_total counter
mlxcache_cache_cached_tokens_total {cached_tokens}
# HELP mlxcache_cache_disk_hits_total Lookups resumed from the disk tier.
# TYPE mlxcache_cache_disk_hits_total counter
mlxcache_cache_disk_hits_total {disk_hits}
# HELP mlxcache_cache_evictions_total Entries evicted from a tier of the prompt cache.
# TYPE mlxcache_cache_evictions_total counter
mlxcache_cache_evictions_total{{tier="memory"}} {evictions_mem}
mlxcache_cache_evictions_total{{tier="disk"}} {evictions_disk}
# HELP mlxcache_cache_entries Prompts kept per tier.
# TYPE mlxcache_cache_entries gauge
mlxcache_cache_entries{{tier="memory"}} {mem_entries}
mlxcache_cache_entries{{tier="disk"}} {disk_entries}
# HELP mlxcache_cache_bytes Bytes kept per tier.
# TYPE mlxcache_cache_bytes gauge
mlxcache_cache_bytes{{tier="memory"}} {mem_bytes}
mlxcache_cache_bytes{{tier="disk"}} {disk_bytes}
# HELP mlxcache_requests_waiting Requests queued and not yet started (the queue depth).
# TYPE mlxcache_requests_waiting gauge
mlxcache_requests_waiting 0
# HELP mlxcache_busy 1 while a request is queued or running.
# TYPE mlxcache_busy gauge
mlxcache_busy 0
# HELP mlxcache_resident_bytes The process's resident memory.
# TYPE mlxcache_resident_bytes gauge
mlxcache_resident_bytes 123456789
"""


# -- serve's options ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["--presence-penalty", "2.5"], "--presence-penalty must be in [-2, 2], got 2.5"),
        (["--frequency-penalty", "nan"], "--frequency-penalty must be in [-2, 2], got nan"),
        (
            ["--cors-origin", "http://localhost:3000/"],
            "--cors-origin must be * or scheme://host[:port], got 'http://localhost:3000/'",
        ),
        (
            ["--cors-origin", "localhost"],
            "--cors-origin must be * or scheme://host[:port], got 'localhost'",
        ),
        (["--max-lanes", "0"], "--max-lanes must be >= 1, got 0"),
    ],
)
def test_serve_refuses_bad_penalties_and_origins_before_loading(
    args: list[str], line: str, tmp_path: Path
) -> None:
    model = str(unloadable(tmp_path))
    result = CliRunner().invoke(cli, ["serve", "--model", model, *args])
    assert (result.exit_code, result.stdout, result.stderr) == (2, "", f"error: {line}\n")


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_effort_and_verbosity_are_accepted_and_named_as_ignored(
    worker: EngineWorker, stream: bool
) -> None:
    """Agents send both on every request: on a model without a thinking section they
    change nothing (the same bytes as without them), and the reply's header says so."""
    app = app_of(worker)
    plain = chat(app, max_tokens=6, stream=stream)
    cases = {
        "reasoning_effort, verbosity": {"reasoning_effort": "high", "verbosity": "low"},
        "reasoning_effort": {"reasoning_effort": "none"},
        "verbosity": {"verbosity": "medium"},
    }
    for named, fields in cases.items():
        reply = chat(app, max_tokens=6, stream=stream, **fields)
        assert reply.status == 200 and reply.headers["x-mlxcache-ignored"] == named
        texts = [r.body if stream else content(r.json()) for r in (reply, plain)]
        if stream:  # ids and times differ: the content of the chunks
            texts = [json.dumps([c["choices"] for c in chunks(r)[1:-1]]) for r in (reply, plain)]
        assert texts[0] == texts[1]
    assert "x-mlxcache-ignored" not in plain.headers


def test_a_user_message_without_content_is_400(worker: EngineWorker) -> None:
    reply = post(
        app_of(worker),
        "/v1/chat/completions",
        model="tiny.gguf",
        messages=[{"role": "user", "content": None}],
    )
    assert reply.status == 400
    assert reply.json()["error"]["message"] == "messages.0.content: a user message needs content"
