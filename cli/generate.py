"""`mlxcache generate`: one prompt in, one streamed reply out."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Annotated

import typer

from mlxcache.errors import UserInputError
from mlxcache_cli import options as o
from mlxcache_cli import remote, ui


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
    from mlxcache.request_spec import RequestSpec, conversation

    params, stops = run.sampling(), run.stop_strings()
    if raw and system is not None:
        raise UserInputError("--system needs the chat template; drop --raw")
    if raw:
        request = RequestSpec(prompt=text, sampling=params, stops=stops)
    else:
        messages = conversation(system, [{"role": "user", "content": text}])
        request = RequestSpec(messages, sampling=params, stops=stops)
    if server:
        _print(remote.generate(server, run, request), as_json, run.quiet)
        return
    from mlxcache.events import Done, Token
    from mlxcache.prepare import prepare

    engine = run.engine()
    prepared = prepare(engine, request)
    events = engine.generate(prepared.request)
    with o.watch(engine, prepared.ids, run.quiet, events) as seen:

        def pieces() -> Iterator[str | remote.Finished]:
            for event in events:
                seen(event)
                if isinstance(event, Token):
                    yield event.text
                elif isinstance(event, Done):
                    yield remote.Finished(event.result, seen.stats(event.result.stats))

        _print(pieces(), as_json, run.quiet)


def _print(items: Iterable[str | remote.Finished], as_json: bool, quiet: bool) -> None:
    """A reply as it comes, in-process or from a server: its text (not with --json), then
    the JSON document (with --json), the stats line and a note on how it ended (neither
    `quiet`: -q prints the reply alone)."""
    for item in items:
        if isinstance(item, str):
            if not as_json:
                ui.out_text(item)
            continue
        result, stats = item.result, item.stats
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
        ui.stats_line(stats, quiet=quiet)
        if not (as_json or quiet):
            ui.finish_note(result.finish_reason, len(result.tokens), result.text)
