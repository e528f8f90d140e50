"""`--server URL` / $MLXCACHE_SERVER: generate, json, tools, chat and regress sent to a
running `mlxcache serve`, printed exactly as in-process (`mlxcache.remote` checks first that the
server runs the model and cache settings the command would)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any

import typer

from mlxcache.config import ENV_API_KEY, ENV_SERVER
from mlxcache.errors import ServerMismatchError, UserInputError

if TYPE_CHECKING:  # the client (http.client, ssl) is imported by the commands that connect
    from mlxcache.events import Result
    from mlxcache.modes.json_mode import JsonReply
    from mlxcache.modes.tools import ToolReply
    from mlxcache.remote import Server, Wanted
    from mlxcache.request_spec import RequestSpec
    from mlxcache.sampling import SamplingParams
    from mlxcache_cli.options import RunOptions

ServerUrl = Annotated[
    str | None,
    typer.Option(
        "--server",
        envvar=ENV_SERVER,
        metavar="URL",
        help="Send the request to a running `mlxcache serve` at URL (e.g. "
        "http://127.0.0.1:8080): no model load, its memory tier; refused if it runs another "
        "model or block size.",
        rich_help_panel="Model",
    ),
]


def connect(url: str, run: RunOptions) -> tuple[Server, str]:
    """A client of the server at `url` and its model id, once its identity matches what
    `run` would load in-process.

    Raises:
        ServerMismatchError: it runs another model, block size, cache setting or version.
        ServerError: it cannot be reached.
    """
    server, card = connect_card(url, run)
    return server, str(card["id"])


def connect_card(url: str, run: RunOptions) -> tuple[Server, dict[str, Any]]:
    """`connect`, with the server's whole model card."""
    from mlxcache.model.loader import default_spec, tailoring_of
    from mlxcache.remote import Wanted
    from mlxcache.wire import kv_label

    def wanted(_found: dict[str, Any]) -> list[Wanted]:
        cache = run.cache()
        spec = run.model or default_spec()
        tailoring = tailoring_of(**run.tailoring())
        return [Wanted(spec, cache.block_size, cache.enabled, kv_label(cache), tailoring)]

    refuse_in_process_only()  # before connecting
    return checked(url, wanted)


def checked(
    url: str, wants: Callable[[dict[str, Any]], list[Wanted]]
) -> tuple[Server, dict[str, Any]]:
    """A client of the server at `url` and its model card, once its identity (given to
    `wants`) matches each of what the command would run in-process (`wants`' answer).

    Raises:
        ServerMismatchError: it runs another model, block size, cache setting or version.
        ServerError: it cannot be reached.
    """
    from mlxcache.remote import differences

    server = client(url)
    try:
        card = server.card()
        for wanted in wants(card["mlxcache"]):
            diffs = differences(card["mlxcache"], wanted)
            if diffs:
                raise ServerMismatchError(
                    f"the server at {server.url} does not reply as this command would: "
                    + "; ".join(diffs)
                )
    except BaseException:
        server.close()
        raise
    return server, card


def client(url: str) -> Server:
    """A client of the server at `url`, with $MLXCACHE_API_KEY as its key if set."""
    from mlxcache.remote import Server

    return Server(url, os.environ.get(ENV_API_KEY) or None)


def refuse_in_process_only() -> None:
    """Refuse the running command's options that no request carries
    (`request_spec.IN_PROCESS_ONLY`), each set to other than its default, by flag."""
    from typer._click.globals import get_current_context

    from mlxcache.request_spec import IN_PROCESS_ONLY

    ctx = get_current_context(silent=True)
    if ctx is None:  # not run as a command: no options
        return
    for param in ctx.command.params:
        flag = max(param.opts, key=len)
        if flag in IN_PROCESS_ONLY and ctx.params.get(param.name or "") != param.default:
            raise UserInputError(
                f"{flag} runs in-process only: drop --server (or unset ${ENV_SERVER})"
            )


def draft_of(run: RunOptions) -> str | None:
    """--draft as the request's `draft` (None: the server's own setting). A reply is the
    same drafted or not; the draft model and --draft-inexact are the server's to choose
    (`refuse_in_process_only`)."""
    from mlxcache.config import DraftConfig

    return None if run.draft == DraftConfig().mode else run.draft


def _to(run: RunOptions, request: RequestSpec, model: str) -> RequestSpec:
    """`request` to the server's `model`, drafted as `run` asks (`draft_of`)."""
    from dataclasses import replace

    return replace(request, model=model, draft=draft_of(run))


def send(server: Server, request: RequestSpec) -> dict[str, Any]:
    """The whole reply to `request` (streamed, put together: `Server.post`)."""
    from mlxcache.request_spec import to_wire

    return server.post(request.path, to_wire(request))


def generate(url: str, run: RunOptions, request: RequestSpec) -> Iterator[str | Finished]:
    """`mlxcache generate`'s `request` through the server: the reply's text as it streams,
    then how it finished (printed by `generate`, as in-process)."""
    from mlxcache.remote import usage_of
    from mlxcache.request_spec import to_wire

    raw = request.prompt is not None
    server, model = connect(url, run)
    with server:
        request = _to(run, request, model)
        usage = None
        for event in server.stream(request.path, to_wire(request)):
            for choice in event.get("choices") or ():
                piece = choice.get("text") if raw else (choice.get("delta") or {}).get("content")
                if piece:
                    yield piece
            usage = event.get("usage") or usage
        extra = usage_of(usage, server.url)
    yield Finished(Reply(extra), extra["stats"])


@dataclass(frozen=True, slots=True)
class Finished:
    """How a generated reply ended, as `generate` prints it: its result and stats."""

    result: Result | Reply
    stats: dict[str, Any]


class Reply:
    """The parts of a `Result` that `generate` prints, from the server's usage."""

    def __init__(self, extra: dict[str, Any]) -> None:
        self.text: str = extra["text"]
        self.tokens: list[int] = extra["tokens"]
        self.finish_reason: str = extra["finish_reason"]


def json_single(url: str, run: RunOptions, request: RequestSpec, schema: Any) -> JsonReply:
    """`mlxcache json PROMPT`'s `request` through the server: the reply read as
    `read_reply` reads it in-process, against `schema` (printed by `json_cmd._show`)."""
    from mlxcache.modes.json_mode import JsonReply
    from mlxcache.modes.schema import read_document
    from mlxcache.remote import usage_of

    server, model = connect(url, run)
    with server:
        reply = send(server, _to(run, request, model))
        extra = usage_of(reply.get("usage"), server.url)
    message = reply["choices"][0]["message"]
    content = message.get("content") or ""
    generated = extra["stats"]["generated_tokens"]
    finish = extra["finish_reason"]
    output, error = read_document(content, extra["text"], finish, generated, schema)
    text = content if error is None else extra["text"]
    return JsonReply(output, text, finish, extra["stats"], error, message.get("reasoning"))


def tools(
    url: str, run: RunOptions, request: RequestSpec
) -> tuple[ToolReply, Reply, dict[str, Any]]:
    """`mlxcache tools`' `request` through the server: the reply read as `ToolsTask.read`
    reads it (a call cut off or unreadable is its `error`, from the usage), the raw
    result, its stats."""
    from mlxcache.modes.tools import ToolReply
    from mlxcache.remote import reply_calls, usage_of
    from mlxcache.wire import worded_from

    server, model = connect(url, run)
    with server:
        reply = send(server, _to(run, request, model))
        extra = usage_of(reply.get("usage"), server.url)
    message = reply["choices"][0]["message"]
    calls = reply_calls(message, extra, server.url)
    error = extra.get("tool_error")
    read = ToolReply(
        message.get("content") or "", calls, None if error is None else worded_from(error)
    )
    return read, Reply(extra), extra["stats"]


@dataclass(frozen=True, slots=True)
class ServedModel:
    """The server's model as a chat names it: its id and key (`chat_cmd.Model`)."""

    name: str
    key: str


class ChatServer:
    """`mlxcache chat` on a running server (`chat_cmd.Backend`): its turns streamed as
    chat completions, its model and cache the server's (warm-ahead too). Sessions stay
    local: every turn sends the whole conversation."""

    def __init__(self, server: Server, card: dict[str, Any], draft: str | None) -> None:
        from mlxcache.remote import ChatRunner

        self.server = server
        self.runner = ChatRunner(server, str(card["id"]), draft)
        self.model = ServedModel(str(card["id"]), str(card["mlxcache"]["key"]))

    def cache_report(self) -> dict[str, Any]:
        report: dict[str, Any] = self.server.get("/v1/cache")
        return report

    def prompt_kept(self) -> str:
        # The server keeps the full blocks a stopped prefill computed, but does not say
        # how many of this prompt's: no count rather than a guess.
        return "; the server keeps the blocks of its prompt it computed, for next time"

    def close(self) -> None:
        self.server.close()


def chat_server(url: str, run: RunOptions, sampling: SamplingParams) -> ChatServer:
    """The chat's backend on the server at `url`, once its identity matches `run` and
    `sampling` (the session's) is what a request can carry.

    Raises:
        UserInputError: a setting no request carries (the session's repetition_context).
        ServerMismatchError, ServerError: as `connect`.
    """
    from mlxcache.request_spec import sampling_fields

    sampling_fields(sampling)  # refused before connecting, as every other option
    return ChatServer(*connect_card(url, run), draft_of(run))
