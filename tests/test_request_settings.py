"""The table of request settings (`mlxcache.request_settings`) and every place derived from
it: `SamplingParams`' fields and ranges, the CLI's options and flags, each route's request
fields and error names, the `--server` client's fields. Then a row added to the table: it
shows on the CLI, on every route and in the client's body, with no other edit."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from mlxcache import request_settings, request_spec
from mlxcache.config import SamplingParams
from mlxcache.errors import SettingError, UserInputError, settings_named
from mlxcache.request_settings import (
    CHAT,
    MESSAGES,
    RESPONSES,
    ApiField,
    Bounds,
    Option,
    RequestSetting,
)
from mlxcache.wire import USAGE_FIELD
from mlxcache_cli import options as o
from mlxcache_cli import ui
from mlxcache_cli.main import app as cli

ROWS = request_settings.SAMPLING
runner = CliRunner()

# -- the table and what is derived from it agree ----------------------------------------


def test_sampling_params_fields_are_the_rows_and_repetition_context() -> None:
    found = {f.name: f for f in dataclasses.fields(SamplingParams)}
    assert set(found) == {row.name for row in ROWS} | {"repetition_context"}
    for row in ROWS:
        assert found[row.name].default == row.default and type(row.default) is row.kind
        assert found[row.name].type == row.kind.__name__


def outside(bounds: Bounds, kind: type) -> list[float]:
    """Values just outside `bounds` (and NaN for a number)."""
    step = 1 if kind is int else 0.5
    out: list[float] = [] if kind is int else [math.nan]
    if bounds.low is not None:
        out.append(bounds.low if bounds.low_open else bounds.low - step)
    if bounds.high is not None:
        out.append(bounds.high if bounds.high_open else bounds.high + step)
    if bounds.finite:
        out.append(math.inf)
    return [kind(v) if kind is int else v for v in out]


@pytest.mark.parametrize("row", ROWS, ids=lambda r: r.name)
def test_sampling_params_refuse_what_the_row_bounds_and_say_it_its_way(
    row: RequestSetting,
) -> None:
    for value in outside(row.bounds, row.kind):
        with pytest.raises(SettingError) as caught:
            SamplingParams(**{row.name: value})
        assert settings_named(caught.value) == (row.name,)
        assert str(caught.value) == row.name + row.why.format(value)
    bounds = row.bounds
    for edge, open_ in ((bounds.low, bounds.low_open), (bounds.high, bounds.high_open)):
        if edge is not None and not open_:
            SamplingParams(**{row.name: row.kind(edge)})  # a closed bound is in


def test_the_cli_options_are_the_rows() -> None:
    command = typer.main.get_command(cli).commands["generate"]  # type: ignore[attr-defined]
    params = {p.name: p for p in command.params}
    for row in ROWS:
        assert tuple(params[row.name].opts) == row.option.flags
        assert params[row.name].default == row.default
        assert ui.flags()[row.name] == row.flag


@pytest.mark.parametrize("route", [CHAT, MESSAGES, RESPONSES])
def test_every_route_declares_its_fields_in_the_row_bounds(route: str) -> None:
    from mlxcache.server.anthropic_api import MessagesRequest
    from mlxcache.server.responses_api import ResponsesRequest
    from mlxcache.server.schemas import ChatRequest, CompletionRequest

    models = {
        CHAT: [ChatRequest, CompletionRequest],
        MESSAGES: [MessagesRequest],
        RESPONSES: [ResponsesRequest],
    }[route]
    for model in models:
        declared = model.model_fields
        for name, row in request_settings.fields_of(route).items():
            if name not in declared:  # passed on to the chat request, checked there
                assert route != CHAT and row.field(CHAT) is not None
                continue
            kept = {
                k: getattr(m, k)
                for m in declared[name].metadata
                for k in ("ge", "gt", "le", "lt")
                if hasattr(m, k)
            }
            assert kept == row.api_bounds(route).pydantic(), (model, name)


def test_the_server_names_and_takes_each_row_s_field() -> None:
    from mlxcache.server.errors import FIELDS
    from mlxcache.server.prepare import spec_from
    from mlxcache.server.schemas import ChatRequest

    sent = SamplingParams(temperature=0.5, top_p=0.5, top_k=3, min_p=0.25, seed=7, max_tokens=9)
    sent = dataclasses.replace(
        sent, repetition_penalty=1.5, presence_penalty=1.0, frequency_penalty=-1.0
    )
    assert all(getattr(sent, row.name) != row.default for row in ROWS)  # each one shows
    fields = {row.field(CHAT): getattr(sent, row.name) for row in ROWS}
    body = ChatRequest.model_validate({"messages": [{"role": "user", "content": ""}], **fields})
    assert spec_from(body, SamplingParams()).sampling == sent
    for row in ROWS:
        assert FIELDS[row.name] == row.field(CHAT)


def test_the_client_sends_every_row() -> None:
    params = SamplingParams(temperature=0.5, top_k=3, frequency_penalty=1.0)
    sent = request_spec.sampling_fields(params)
    assert sent == {
        **{row.field(CHAT): getattr(params, row.name) for row in ROWS},
        USAGE_FIELD: True,
    }
    with pytest.raises(UserInputError) as caught:
        request_spec.sampling_fields(SamplingParams(repetition_context=5))
    assert settings_named(caught.value) == ("repetition_context",)


# -- a row added ------------------------------------------------------------------------

CONTEXT_ROW = RequestSetting(
    "repetition_context",
    int,
    20,
    Bounds(low=1),
    " must be >= 1, got {}",
    Option(("--repetition-context",), "N", "Tokens the repetition penalty looks back at."),
    {
        CHAT: ApiField("repetition_context"),
        MESSAGES: ApiField("repetition_context"),
        RESPONSES: ApiField("repetition_context"),
    },
)
"""`SamplingParams.repetition_context`, which no front end carries today, as a row."""


@pytest.fixture
def added(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(request_settings, "SAMPLING", (*ROWS, CONTEXT_ROW))


def test_a_row_added_is_a_cli_option(added: None) -> None:
    seen: list[SamplingParams] = []
    app = typer.Typer()

    @app.command()
    @o.with_run_options()
    def run(run: o.RunOptions) -> None:
        try:
            seen.append(run.sampling())
        except SettingError as exc:
            ui.error(exc)
            raise typer.Exit(2) from None

    assert "--repetition-context" in runner.invoke(app, ["--help"]).stdout
    result = runner.invoke(app, ["--repetition-context", "7", "--temp", "0.5"])
    assert result.exit_code == 0, result.output
    assert seen == [SamplingParams(repetition_context=7, temperature=0.5)]
    refused = runner.invoke(app, ["--repetition-context", "0"])
    assert refused.exit_code == 2
    assert refused.stderr == "error: --repetition-context must be >= 1, got 0\n"


def test_a_row_added_is_in_the_client_s_body(added: None) -> None:
    sent = request_spec.sampling_fields(SamplingParams(repetition_context=7))
    assert sent["repetition_context"] == 7 and set(sent) == {
        *(row.field(CHAT) for row in (*ROWS, CONTEXT_ROW)),
        USAGE_FIELD,
    }


ROUTES_SCRIPT = """
import dataclasses, io, json, sys
from mlxcache import request_settings
from mlxcache.request_settings import CHAT, MESSAGES, RESPONSES, ApiField, Bounds, Option, RequestSetting
row = RequestSetting(
    "repetition_context", int, 20, Bounds(low=1), " must be >= 1, got {}",
    Option(("--repetition-context",), "N", ""),
    {route: ApiField("repetition_context") for route in (CHAT, MESSAGES, RESPONSES)},
)
request_settings.SAMPLING = (*request_settings.SAMPLING, row)

sys.path.insert(0, sys.argv[2])
from asgi import call
from mlxcache.engine import Engine
from mlxcache.model import load
from mlxcache.server import prepare
from mlxcache.server.app import Settings, create_app
from mlxcache.server.log import RequestLog
from mlxcache.worker import EngineWorker

seen = []
spec_from = prepare.spec_from
def spy(*args, **kwargs):
    spec = spec_from(*args, **kwargs)
    seen.append(spec.sampling.repetition_context)
    return spec
prepare.spec_from = spy

routes = {
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    "messages": ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}]}),
    "responses": ("/v1/responses", {"input": "hi"}),
}
out = {}
with EngineWorker(Engine(load(sys.argv[1]), block_size=4, warm_ahead=False)) as worker:
    app = create_app(worker.engine, worker, Settings("tiny"), RequestLog(stream=io.StringIO()))
    for route, (path, body) in routes.items():
        limit = "max_output_tokens" if route == "responses" else "max_tokens"
        good = call(app, "POST", path, {**body, limit: 2, "repetition_context": 7})
        bad = call(app, "POST", path, {**body, limit: 2, "repetition_context": 0})
        out[route] = [good.status, seen[-1] if seen else None, bad.status, bad.json()]
        seen.clear()
print(json.dumps(out))
"""


@pytest.mark.slow  # a child process: the table is read as the server's modules import
def test_a_row_added_is_taken_by_every_route_and_named_when_out_of_range(
    tiny_gguf: Path, tmp_path: Path
) -> None:
    """(The row is `CONTEXT_ROW`, built again in the child, before the server's modules
    are imported: their request models are built from the table then.)"""
    script = ROUTES_SCRIPT
    env_dir = Path(__file__).parent
    done = subprocess.run(
        [sys.executable, "-c", script, str(tiny_gguf), str(env_dir)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    out: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    why = "repetition_context: Input should be greater than or equal to 1"
    assert out["chat"][:3] == [200, 7, 400]
    assert out["chat"][3]["error"]["param"] == "repetition_context"
    assert out["chat"][3]["error"]["message"] == why
    assert out["responses"][:3] == [200, 7, 400]
    assert out["responses"][3]["error"]["param"] == "repetition_context"
    assert out["responses"][3]["error"]["message"] == why
    assert out["messages"][:3] == [200, 7, 400]
    assert out["messages"][3]["error"]["message"] == why
