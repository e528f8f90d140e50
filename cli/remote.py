"""`--server URL` / $MLXCACHE_SERVER: generate, json, tools and regress sent to a running
`mlxcache serve`, printed exactly as in-process (`mlxcache.remote` checks first that the
server runs the model and cache settings the command would)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Any

import typer

from mlxcache.errors import OutputError, ServerMismatchError, UserInputError
from mlxcache.remote import (
    ENV_API_KEY,
    ENV_SERVER,
    Server,
    Wanted,
    differences,
    sampling_fields,
    tool_choice_field,
    usage_of,
    worded_from,
)
from mlxcache_cli import ui

if TYPE_CHECKING:
    from mlxcache.modes.tools import Tool, ToolChoice, ToolReply
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
    from mlxcache.model.loader import default_spec

    def wanted(_found: dict[str, Any]) -> list[Wanted]:
        cache = run.cache()
        return [Wanted(run.model or default_spec(), cache.block_size, cache.enabled)]

    server, card = checked(url, wanted)
    return server, str(card["id"])


def checked(
    url: str, wants: Callable[[dict[str, Any]], list[Wanted]]
) -> tuple[Server, dict[str, Any]]:
    """A client of the server at `url` and its model card, once its identity (given to
    `wants`) matches each of what the command would run in-process (`wants`' answer).

    Raises:
        ServerMismatchError: it runs another model, block size, cache setting or version.
        ServerError: it cannot be reached.
    """
    server = Server(url, os.environ.get(ENV_API_KEY) or None)
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


def runs_in_process(command: str, why: str) -> None:
    """One note when $MLXCACHE_SERVER is set for a command that does not use it: a
    server is never skipped silently."""
    if os.environ.get(ENV_SERVER):
        ui.info(f"note: {command} runs in-process ({why}); ${ENV_SERVER} is not used")


def in_process_only(**given: object) -> None:
    """Refuse the options a server cannot honour as the command would (named as flags)."""
    for name, value in given.items():
        if value:
            flag = f"--{name.replace('_', '-')}"
            raise UserInputError(
                f"{flag} runs in-process only: drop --server (or unset ${ENV_SERVER})"
            )


def sampling_body(run: RunOptions) -> dict[str, Any]:
    """Every sampling field, so the server's own defaults (penalties included) play no part."""
    return sampling_fields(run.sampling())


def generate(
    url: str,
    run: RunOptions,
    text: str,
    system: str | None,
    raw: bool,
    as_json: bool,
) -> None:
    """`mlxcache generate` through the server: the reply streamed to stdout as it comes."""
    from mlxcache_cli.generate import _done

    stops = run.stop_strings()
    server, model = connect(url, run)
    with server:
        body: dict[str, Any] = {"model": model, **sampling_body(run), "stop": list(stops)}
        body["stream_options"] = {"include_usage": True}
        if raw:
            path, body["prompt"] = "/v1/completions", text
        else:
            messages = [{"role": "system", "content": system}] if system is not None else []
            path, body["messages"] = (
                "/v1/chat/completions",
                [
                    *messages,
                    {"role": "user", "content": text},
                ],
            )
        usage = None
        for event in server.stream(path, body):
            for choice in event.get("choices") or ():
                piece = choice.get("text") if raw else (choice.get("delta") or {}).get("content")
                if piece and not as_json:
                    ui.out_text(piece)
            usage = event.get("usage") or usage
        extra = usage_of(usage, server.url)
    _done(Reply(extra), extra["stats"], as_json)


class Reply:
    """The parts of a `Result` that `generate._done` reads, from the server's usage."""

    def __init__(self, extra: dict[str, Any]) -> None:
        self.text: str = extra["text"]
        self.tokens: list[int] = extra["tokens"]
        self.finish_reason: str = extra["finish_reason"]


def json_single(
    url: str,
    run: RunOptions,
    given: Any,
    schema: Any,
    instructions: str | None,
    text: str,
    as_json: bool,
) -> None:
    """`mlxcache json PROMPT` through the server, printed as `json_cmd._single` does (the
    document in the form of `JsonReply.as_dict` with --json)."""
    from mlxcache.modes.schema import read_document

    server, model = connect(url, run)
    with server:
        system = [{"role": "system", "content": instructions}] if instructions is not None else []
        body = {
            "model": model,
            **sampling_body(run),
            "messages": [*system, {"role": "user", "content": text}],
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "reply", "schema": given},
            },
        }
        reply = server.post("/v1/chat/completions", body)
        extra = usage_of(reply.get("usage"), server.url)
    message = reply["choices"][0]["message"]
    content = message.get("content") or ""
    generated = extra["stats"]["generated_tokens"]
    output, error = read_document(content, extra["text"], extra["finish_reason"], generated, schema)
    doc: dict[str, Any] = {"output": output, "finish_reason": extra["finish_reason"]}
    if message.get("reasoning") is not None:
        doc["reasoning"] = message["reasoning"]
    if error is not None:
        doc.update(error=error, text=extra["text"])
    doc["stats"] = extra["stats"]
    if as_json:
        ui.out_json(doc)
    else:
        ui.thought(doc.get("reasoning"))
        if error is None:
            ui.out_text(content + "\n")
    ui.stats_line(doc["stats"])
    if doc.get("error") is not None:
        raise OutputError(doc["error"])


def tools(
    url: str,
    run: RunOptions,
    tool_defs: tuple[Tool, ...],
    choice: ToolChoice,
    parallel: bool,
    system: str | None,
    messages: list[dict[str, Any]],
) -> tuple[ToolReply, Reply, dict[str, Any]]:
    """`mlxcache tools` through the server: the reply read as `ToolsTask.read` reads it (a
    call cut off or unreadable is its `error`, from the usage), the raw result, its stats."""
    from mlxcache.modes.tools import ToolCall, ToolReply

    head = [{"role": "system", "content": system}] if system is not None else []
    server, model = connect(url, run)
    with server:
        body = {
            "model": model,
            **sampling_body(run),
            "messages": [*head, *(_openai_message(m) for m in messages)],
            "tools": [t.as_openai() for t in tool_defs],
            "tool_choice": tool_choice_field(choice),
            "parallel_tool_calls": parallel,
        }
        reply = server.post("/v1/chat/completions", body)
        extra = usage_of(reply.get("usage"), server.url)
    message = reply["choices"][0]["message"]
    calls = tuple(
        ToolCall(c["function"]["name"], json.loads(c["function"]["arguments"]))
        for c in message.get("tool_calls") or ()
    )
    error = extra.get("tool_error")
    read = ToolReply(
        message.get("content") or "", calls, None if error is None else worded_from(error)
    )
    return read, Reply(extra), extra["stats"]


def _openai_message(message: dict[str, Any]) -> dict[str, Any]:
    """A message of the library's form with its calls in OpenAI's (a tool message keeps
    its function's name, which the server reads)."""
    if not message.get("tool_calls"):
        return message
    calls = [{"type": "function", "function": c} for c in message["tool_calls"]]
    return {**message, "tool_calls": calls}
