"""`mlxcache generate`: one prompt in, one streamed reply out."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

import typer

from mlxcache.errors import UserInputError
from mlxcache_cli import options as o
from mlxcache_cli import remote, ui

if TYPE_CHECKING:
    from mlxcache.events import Result


@o.with_run_options()
def generate(
    prompt: o.PromptArg = None,
    prompt_file: o.PromptFile = None,
    system: o.System = None,
    raw: Annotated[
        bool, typer.Option("--raw", help="Send the prompt as is, without the chat template.")
    ] = False,
    as_json: o.Json = False,
    server: remote.ServerUrl = None,
    *,
    run: o.RunOptions,
) -> None:
    """Generate a reply to PROMPT, streamed to stdout; stats go to stderr."""
    text = o.read_prompt(prompt, prompt_file)
    system = o.text_or_file(system, "system")
    params, stops = run.sampling(), run.stop_strings()
    if raw and system is not None:
        raise UserInputError("--system needs the chat template; drop --raw")
    if server:
        remote.generate(server, run, text, system, raw, as_json)
        return
    from mlxcache.engine import Request
    from mlxcache.events import Done, Token

    engine = run.engine()
    if raw:
        ids = engine.encoder.encode(text)
    else:
        messages = [{"role": "system", "content": system}] if system is not None else []
        ids = engine.encoder.encode_chat([*messages, {"role": "user", "content": text}])
    events = engine.generate(Request(ids, params, stop_strings=stops))
    with o.watch(engine, ids, run.quiet, events) as seen:
        for event in events:
            seen(event)
            if isinstance(event, Token) and not as_json:
                ui.out_text(event.text)
            elif isinstance(event, Done):
                _done(event.result, seen.stats(event.result.stats), as_json)


def _done(result: Result | remote.Reply, stats: dict[str, Any], as_json: bool) -> None:
    if as_json:
        ui.out_json(
            {
                "text": result.text,
                "tokens": result.tokens,
                "finish_reason": result.finish_reason,
                "stats": stats,
            }
        )
    else:
        ui.out_text("\n")
    ui.stats_line(stats)
    if not as_json:
        ui.finish_note(result.finish_reason, len(result.tokens))
