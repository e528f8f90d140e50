"""`mlxcache tools`: a reply that may call (or must call) functions from a tools file."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Annotated, Any

import typer

from mlxcache.errors import MlxcacheError, OutputError, UserInputError
from mlxcache_cli import options as o
from mlxcache_cli import remote, ui

if TYPE_CHECKING:  # imported by the command: `--help` loads no model code
    from mlxcache.engine import Engine
    from mlxcache.modes.tool_chat import ToolReply
    from mlxcache.modes.tools import Tool, ToolChoice
    from mlxcache.prepare import NextTurn
    from mlxcache.request_spec import RequestSpec
    from mlxcache.sampling import SamplingParams


def _results(specs: list[str]) -> list[tuple[str, str]]:
    """(name, content) of each --tool-result NAME=VALUE. A VALUE that is not JSON is sent
    as a JSON string (quoted and escaped), and a note says so."""
    from mlxcache.fileio import loads_json

    out = []
    for spec in specs:
        name, sep, value = spec.partition("=")
        if not sep or not name.strip():
            raise UserInputError(f"--tool-result expects NAME=VALUE, got {spec!r}")
        try:
            loads_json(value)
        except ValueError:
            value = json.dumps(value, ensure_ascii=False)
            ui.warn(f"--tool-result {name.strip()}: not JSON, sent as the JSON string {value}")
        out.append((name.strip(), value))
    return out


def _conversation(
    messages_file: str | None, system: str | None, results: list[str]
) -> tuple[list[dict[str, Any]], str | None]:
    """Prior messages (system message split off) with the tool results appended."""
    from mlxcache.modes.schema import read_json_arg
    from mlxcache.modes.tool_chat import add_tool_results, read_messages

    messages = read_messages(read_json_arg(messages_file, "messages")) if messages_file else []
    if messages and messages[0]["role"] == "system":
        if system is not None:
            raise UserInputError("--messages starts with a system message; drop --system")
        system, messages = messages[0]["content"], messages[1:]
    if results:
        messages = add_tool_results(messages, _results(results))
    return messages, system


def _spec(
    params: SamplingParams,
    stops: tuple[str, ...],
    tools: tuple[Tool, ...],
    choice: ToolChoice,
    parallel: bool,
    system: str | None,
    messages: list[dict[str, Any]],
) -> RequestSpec:
    """The request (in-process or sent): OpenAI's tools, choice and messages; `stops` end
    the reply wherever they appear, a call's text too (as the server's `stop` does)."""
    from mlxcache.remote import tool_choice_field
    from mlxcache.request_spec import RequestSpec, conversation

    return RequestSpec(
        conversation(system, [_openai_message(m) for m in messages]),
        sampling=params,
        stops=stops,
        tools=tuple(t.as_openai() for t in tools),
        tool_choice=tool_choice_field(choice),
        parallel_tool_calls=parallel,
    )


def _openai_message(message: dict[str, Any]) -> dict[str, Any]:
    """A message of the library's form with its calls in OpenAI's (a tool message keeps
    its function's name, which the prepare path reads)."""
    if not message.get("tool_calls"):
        return message
    calls = [{"type": "function", "function": c} for c in message["tool_calls"]]
    return {**message, "tool_calls": calls}


@o.with_run_options()
def tools_cmd(
    prompt: Annotated[
        str | None,
        typer.Argument(
            metavar="PROMPT",
            help="The user message; '-' reads stdin (optional with --messages). Piped stdin "
            "and PROMPT together make one message: stdin, a space, then PROMPT.",
        ),
    ] = None,
    *,
    tools_file: Annotated[
        str,
        typer.Option(
            "--tools",
            metavar="JSON|FILE",
            help="Function definitions (OpenAI style): inline JSON, a file or @FILE.",
        ),
    ],
    tool_choice: Annotated[
        str,
        typer.Option(
            "--tool-choice", metavar="CHOICE", help="auto | required | none | a function name."
        ),
    ] = "auto",
    prompt_file: o.PromptFile = None,
    system: o.System = None,
    messages_file: Annotated[
        str | None,
        typer.Option(
            "--messages",
            metavar="FILE",
            help='Prior conversation: the "messages" of a --json output.',
        ),
    ] = None,
    tool_result: Annotated[
        list[str] | None,
        typer.Option(
            "--tool-result",
            metavar="NAME=VALUE",
            help="A called function's result: JSON, or text (sent as a JSON string). Repeatable.",
        ),
    ] = None,
    parallel: Annotated[
        bool, typer.Option("--parallel", help="Allow several calls in one reply.")
    ] = False,
    think: o.Think = False,
    think_budget: o.ThinkBudget = None,
    as_json: o.Json = False,
    server: remote.ServerUrl = None,
    run: o.RunOptions,
) -> None:
    """Reply to PROMPT with text and/or calls to the functions in --tools."""
    from mlxcache.modes.reasoning import check_think_options
    from mlxcache.modes.schema import read_json_arg
    from mlxcache.modes.tool_chat import assistant_message, finish_reason
    from mlxcache.modes.tools import ToolChoice, parse_tools

    tools = parse_tools(read_json_arg(tools_file, "tools"), f"tools {tools_file}")
    choice = ToolChoice.parse(tool_choice, tools)
    messages, system = _conversation(
        messages_file, o.text_or_file(system, "system"), tool_result or []
    )
    if prompt is not None or prompt_file is not None or not messages:
        messages.append({"role": "user", "content": o.read_prompt(prompt, prompt_file)})
    if messages[-1]["role"] == "assistant":
        raise UserInputError(
            "the conversation ends with the assistant: add a prompt or --tool-result"
        )
    params = run.sampling()
    check_think_options(think, think_budget, params.max_tokens)  # before the model loads
    request = _spec(params, run.stop_strings(), tools, choice, parallel, system, messages)
    prepared = engine = None
    if server:
        reply, result, stats = remote.tools(server, run, request)
    else:
        from mlxcache.prepare import Local, prepare

        engine = run.engine()
        prepared = prepare(engine, request, think=think, local=Local(think_budget=think_budget))
        assert prepared.tools is not None  # a spec with tools is a tools task's
        with o.watch(engine, prepared.ids, run.quiet) as seen:
            done = engine.complete(prepared.request, seen)
        reply, result, stats = prepared.tools.read(done), done, seen.stats(done.stats)
    if as_json:
        doc: dict[str, Any] = {
            "content": reply.content,
            **({"reasoning": reply.reasoning} if reply.reasoning is not None else {}),
            "tool_calls": [c.as_dict() for c in reply.calls],
            # OpenAI's word for a reply that ends in calls (the stop token ended it).
            "finish_reason": finish_reason(reply, result.finish_reason),
        }
        if reply.error is not None:
            doc.update(error=reply.error, text=result.text)  # the raw reply, cut or not
        doc["stats"] = stats
        doc["messages"] = [*messages, assistant_message(reply)]
        if system is not None:
            doc["messages"].insert(0, {"role": "system", "content": system})
        ui.out_json(doc)
    else:
        ui.thought(reply.reasoning)
        if reply.error is None:
            _print_reply(reply)
    ui.stats_line(stats, quiet=run.quiet)
    if reply.error is not None:
        raise OutputError(reply.error)
    if not (as_json or run.quiet):
        ui.finish_note(result.finish_reason, len(result.tokens), result.text)
    if engine is not None and prepared is not None and run.cache().disk_bytes:
        _warm_ahead(engine, prepared.next_turn, reply)


def _print_reply(reply: ToolReply) -> None:
    """Plain output: the text, then one `name({arguments})` line per call."""
    if reply.content:
        ui.out_text(reply.content + "\n")
    for call in reply.calls:
        ui.out_text(f"{call.name}({json.dumps(call.arguments, ensure_ascii=False)})\n")


def _warm_ahead(engine: Engine, next_turn: NextTurn | None, reply: ToolReply) -> None:
    """Prefill the follow-up's prefix now (kept on disk): the `--tool-result` call resumes
    it (no `next_turn`: the engine does no warm-ahead)."""
    if next_turn is None:
        return
    try:
        engine.warm(next_turn(reply.content, reply.calls))
        for _ in engine.run(warm=True):
            pass
    except MlxcacheError:
        return  # e.g. the conversation fills the context: nothing to warm
    except KeyboardInterrupt:
        return  # the reply is out; the blocks computed so far are kept
