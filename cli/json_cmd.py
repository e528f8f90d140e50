"""`mlxcache json`: replies constrained to a JSON Schema, one prompt or a JSONL batch."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from mlxcache.errors import OutputError, OutputMismatchError, UserInputError
from mlxcache_cli import options as o
from mlxcache_cli import remote, ui

if TYPE_CHECKING:  # imported by the command: `--help` and `--check` load no model code
    from mlxcache.engine import Engine
    from mlxcache.modes import json_mode
    from mlxcache.modes.schema import CompiledSchema
    from mlxcache.prepare import Local
    from mlxcache.request_spec import RequestSpec
    from mlxcache.sampling import SamplingParams


@o.with_run_options()
def json_cmd(
    prompt: o.PromptArg = None,
    *,
    schema: Annotated[
        str | None,
        typer.Option(
            "--schema",
            metavar="JSON|FILE",
            help="JSON Schema: inline JSON, a file or @FILE (default: any JSON object).",
        ),
    ] = None,
    prompt_file: o.PromptFile = None,
    instructions: Annotated[
        str | None,
        typer.Option(
            "--instructions",
            metavar="TEXT|@FILE",
            help="Instructions put before every prompt (cached): the text, @FILE or a file's path.",
        ),
    ] = None,
    input_path: Annotated[
        Path | None,
        typer.Option(
            "--input",
            metavar="FILE",
            help='JSONL batch: {"prompt": ..., "vars": {...}, "id": ...}.',
        ),
    ] = None,
    output: Annotated[
        Path | None,
        typer.Option(
            "--output",
            "-o",
            metavar="FILE",
            help="JSONL results of --input; a rerun skips lines done.",
        ),
    ] = None,
    concurrency: Annotated[
        int,
        typer.Option(
            "--concurrency",
            "--lanes",  # its first name, kept
            metavar="N",
            help="Batch requests run together.",
        ),
    ] = 1,
    strict: Annotated[
        bool,
        typer.Option(
            "--strict",
            help="Refuse schema features the grammar cannot enforce, and decode numbers as "
            "the schema bounds them, without the digit cap (default: enforce what it can, "
            "validate the rest after decoding; numbers the schema leaves unbounded get at "
            "most 16 digits, 10 after the point).",
        ),
    ] = False,
    allow_extra_keys: Annotated[
        bool,
        typer.Option(
            "--allow-extra-keys",
            help="Let the model add keys to objects that do not say additionalProperties "
            "(default: only the listed properties).",
        ),
    ] = False,
    check: Annotated[
        bool,
        typer.Option("--check", help="Only check and compile --schema (exit 0 or 2); no model."),
    ] = False,
    force: Annotated[
        bool,
        typer.Option(
            "--force", help="Redo the lines already in --output, even those of another run."
        ),
    ] = False,
    think: o.Think = False,
    think_budget: o.ThinkBudget = None,
    as_json: o.Json = False,
    server: remote.ServerUrl = None,
    run: o.RunOptions,
) -> None:
    """Reply with one JSON document valid against --schema, or one JSON object without it
    (printed on stdout)."""
    from mlxcache.modes.schema import check_schema, read_json_arg

    if schema is None:
        from mlxcache.modes.json_mode import ANY_OBJECT

        given = ANY_OBJECT
    else:
        given = read_json_arg(schema, "schema")
    compiled = check_schema(given, strict=strict, allow_extra_keys=allow_extra_keys)
    if run.stop:
        raise UserInputError("--stop does not apply to json: a reply ends with its JSON document")
    if check:
        _report_check(compiled, as_json)
        return
    system = o.text_or_file(instructions, "instructions")
    if server:
        remote.refuse_in_process_only()  # before the prompt is read
        o.positive(concurrency=concurrency)
        request = _spec(run.sampling(), given, system, o.read_prompt(prompt, prompt_file))
        _show(remote.json_single(server, run, request, compiled.schema), as_json, run.quiet)
        return
    from mlxcache.fileio import check_output_dir
    from mlxcache.modes import json_mode
    from mlxcache.modes.batch import claim_output, read_input
    from mlxcache.modes.reasoning import check_think_options

    params = run.sampling()
    check_think_options(think, think_budget, params.max_tokens)  # before the model loads
    o.positive(concurrency=concurrency)
    if input_path is None:
        if output is not None:
            raise UserInputError("--output goes with --input (a JSONL batch)")
        from mlxcache.prepare import Local

        request = _spec(params, given, system, o.read_prompt(prompt, prompt_file))
        local = Local(strict, allow_extra_keys, think_budget)
        _single(run.engine(), request, local, think, as_json, run.quiet)
        return
    task = json_mode.JsonTask(compiled, system)
    if prompt is not None or prompt_file is not None:
        raise UserInputError("give prompts in the --input file or as an argument, not both")
    if output is None:
        raise UserInputError("--input needs --output FILE (the file a rerun resumes)")
    check_output_dir(output, "--output")
    lines = read_input(input_path)
    with claim_output(output):  # before the model loads: a second run is refused at once
        engine = run.engine()
        task = task.for_model(engine.loaded.tokenizer, think, think_budget)
        try:
            plan = json_mode.plan_batch(engine, task, lines, input_path, output, params, force)
        except OutputMismatchError as exc:
            raise OutputMismatchError(
                f"{exc}: pass --force to redo its lines, or choose another --output"
            ) from exc
        _batch(engine, task, plan, concurrency, run.quiet)


def _report_check(compiled: CompiledSchema, as_json: bool) -> None:
    if as_json:
        ui.out_json({"ok": True, "unenforced": list(compiled.unenforced)})
        return
    ui.out_text("ok\n")
    for rule in compiled.unenforced:
        ui.warn(f"checked after decoding, not while: {rule}")


def _spec(params: SamplingParams, given: Any, system: str | None, text: str) -> RequestSpec:
    """The request of one prompt (in-process or sent): the schema as `response_format`,
    the instructions as the system message."""
    from mlxcache.request_spec import RequestSpec, conversation

    return RequestSpec(
        conversation(system, [{"role": "user", "content": text}]),
        sampling=params,
        response_format={"type": "json_schema", "json_schema": {"name": "reply", "schema": given}},
    )


def _single(
    engine: Engine, request: RequestSpec, local: Local, think: bool, as_json: bool, quiet: bool
) -> None:
    from mlxcache.modes import json_mode
    from mlxcache.prepare import prepare

    # The prompt's ids first: they tell what Ctrl-C left in the cache.
    prepared = prepare(engine, request, think=think, local=local)
    assert prepared.json is not None  # a spec with a response_format is JSON mode's
    with o.watch(engine, prepared.ids, quiet) as seen:
        result = engine.complete(prepared.request, seen)
    reply = replace(json_mode.read_reply(prepared.json, result), stats=seen.stats(result.stats))
    _show(reply, as_json, quiet)


def _show(reply: json_mode.JsonReply, as_json: bool, quiet: bool) -> None:
    """One reply, in-process or from a server: `JsonReply.as_dict` with --json; else its
    reasoning on stderr and the document on stdout; then the stats line (not `quiet`)."""
    if as_json:
        ui.out_json(reply.as_dict())
    else:
        ui.thought(reply.reasoning)
        if reply.error is None:
            ui.out_text(reply.text + "\n")
    ui.stats_line(reply.stats, quiet=quiet)
    if reply.error is not None:
        raise OutputError(reply.error)


def _batch(
    engine: Engine,
    task: json_mode.JsonTask,
    plan: json_mode.BatchPlan,
    concurrency: int,
    quiet: bool = False,
) -> None:
    """Run a JSONL batch into its output file: a progress bar and a summary line on stderr
    (neither `quiet`), a warning per failed line."""
    from mlxcache.modes import json_mode

    if plan.torn:
        ui.warn(f"{plan.output}: dropping a partly written last line (interrupted run)")

    def on_record(rec: dict[str, Any]) -> None:
        if rec.get("error"):
            ui.warn(f"line {rec['line']}: {rec['error']}")

    with ui.progress_bar(transient=False) as update:
        summary = json_mode.run_batch(
            engine,
            task,
            plan,
            concurrency,
            progress=None if quiet else lambda done, total: update("json", done, total),
            on_record=on_record,
        )
    if not quiet:
        ui.batch_line(
            ran=summary.ran,
            skipped=summary.skipped,
            failed=summary.failed,
            cached=summary.cached_tokens,
            prompt=summary.prompt_tokens,
            seconds=summary.seconds,
            output=str(plan.output),
        )
    if summary.failed:
        raise OutputError(
            f'{summary.failed} of {summary.ran} lines failed; see "error" in their records '
            f"in {plan.output}"
        )
