"""JSON Schema mode: replies that are one JSON document valid against a schema.

The prompt is [system: instructions + the schema, user: prompt]. Instructions and schema
come first and are the same for every request of a batch, so the prefix cache reuses
them; only the user turn is new. Without a schema (`ANY_OBJECT`) the system message only
asks for one JSON object: a small model shown `{"type": "object"}` copies it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

from mlxcache.constrain import processor_for
from mlxcache.engine import Engine, Request
from mlxcache.events import Event, Result
from mlxcache.modes.batch import (
    InputLine,
    Job,
    RecordWriter,
    read_output,
    run_description,
    run_jobs,
    substitute,
)
from mlxcache.modes.reasoning import Thinking, budget_processors, split_reply, thinking_for
from mlxcache.modes.schema import CompiledSchema, check_schema, read_document
from mlxcache.sampling import SamplingParams

SCHEMA_INTRO = "Reply with one JSON document that follows this JSON Schema:\n"
OBJECT_INTRO = "Reply with one JSON object."
ANY_OBJECT: dict[str, Any] = {"type": "object"}
"""The schema of JSON mode without one (`mlxcache json` with no --schema, the server's
`response_format: {"type": "json_object"}`): any JSON object."""


def json_intro(schema: Any) -> str:
    """What the system message asks for: the schema to follow, or one JSON object when the
    schema says no more than that (it is not shown: a small model copies it as its reply)."""
    if schema == ANY_OBJECT:
        return OBJECT_INTRO
    return SCHEMA_INTRO + json.dumps(schema, ensure_ascii=False)


@dataclass(frozen=True, slots=True)
class JsonTask:
    """What every request of a JSON run shares: the compiled schema and optional instructions.

    Build it with `JsonTask.create`, which checks the schema and compiles its grammar.
    """

    compiled: CompiledSchema
    instructions: str | None = None
    thinking: Thinking | None = None
    """The model's thinking section (`for_model`); None: the template's default, no split."""

    def __post_init__(self) -> None:
        if self.instructions is not None and not self.instructions.strip():
            raise ValueError("instructions must not be blank")

    def for_model(
        self, tokenizer: Any, think: bool | None, think_budget: int | None = None
    ) -> JsonTask:
        """This task on a model: think first (`think_budget` tokens, by default half of
        what the reply may have), or not (`think` False).

        Raises:
            UserInputError: `think` is True and the model's template has no thinking section.
        """
        return replace(self, thinking=thinking_for(tokenizer, think, think_budget))

    @property
    def grammar(self) -> str:
        """The grammar of a reply: the schema's, after the thinking section if any."""
        if self.thinking is not None and self.thinking.in_reply:
            return self.thinking.grammar(self.compiled.grammar)
        return self.compiled.grammar

    @property
    def template_kwargs(self) -> dict[str, Any]:
        """Chat template arguments (`enable_thinking`) of every request."""
        return self.thinking.template_kwargs if self.thinking is not None else {}

    @property
    def schema(self) -> dict[str, Any]:
        """The schema as given: what replies are validated against."""
        return self.compiled.schema

    @classmethod
    def create(
        cls,
        schema: Any = ANY_OBJECT,
        instructions: str | None = None,
        strict: bool = False,
        allow_extra_keys: bool = False,
        cap_numbers: bool | None = None,
    ) -> JsonTask:
        """Check `schema` (by default any JSON object) and build the task (see
        `schema.check_schema` for the options).

        Raises:
            GrammarError: one line, naming the location in the schema when known.
        """
        compiled = check_schema(
            schema, strict=strict, allow_extra_keys=allow_extra_keys, cap_numbers=cap_numbers
        )
        return cls(compiled, instructions)

    def messages(
        self, prompt: str, values: Mapping[str, str] | None = None, where: str = "prompt"
    ) -> list[dict[str, str]]:
        """The chat messages of one request.

        With `values` (batch lines, even empty), `{{var}}` placeholders in the prompt and
        instructions are filled from it; without, the text is taken as is.
        """
        system = json_intro(self.schema)
        instructions, user = self.instructions, prompt
        if values is not None:
            user = substitute(prompt, values, where)
            if instructions is not None:
                instructions = substitute(instructions, values, f"{where} (instructions)")
        if instructions is not None:
            system = f"{instructions}\n\n{system}"
        return [{"role": "system", "content": system}, {"role": "user", "content": user}]


@dataclass(frozen=True, slots=True)
class JsonReply:
    """A finished request: `output` is the parsed document, None when `error` says why."""

    output: Any
    text: str
    finish_reason: str
    stats: dict[str, Any]
    error: str | None = None
    reasoning: str | None = None
    """The thinking section, apart from the answer (None: none)."""

    def as_dict(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"output": self.output, "finish_reason": self.finish_reason}
        if self.reasoning is not None:
            doc["reasoning"] = self.reasoning
        if self.error is not None:
            doc.update(error=self.error, text=self.text)
        doc["stats"] = self.stats
        return doc


def read_reply(task: JsonTask, result: Result) -> JsonReply:
    """Parse and validate a reply (its thinking section set apart); a failure is recorded in
    `error`, never raised."""
    stats = result.stats.as_dict()
    reasoning, text = split_reply(task.thinking, result.text)

    def reply(output: Any, error: str | None = None) -> JsonReply:
        raw = result.text if error is not None else text
        return JsonReply(output, raw, result.finish_reason, stats, error, reasoning)

    if result.error is not None:
        return reply(None, result.error)
    generated = result.stats.generated_tokens
    return reply(*read_document(text, result.text, result.finish_reason, generated, task.schema))


def request(engine: Engine, ids: list[int], task: JsonTask, params: SamplingParams) -> Request:
    """A constrained request (a fresh grammar matcher each time)."""
    room = engine.encoder.reply_room(ids, params.max_tokens)
    budget = budget_processors(task.thinking, engine.loaded.tokenizer, room)
    return Request(ids, params, [processor_for(engine.loaded, task.grammar), *budget])


def encode(
    engine: Engine,
    messages: list[dict[str, str]],
    where: str = "the prompt",
    **template_kwargs: Any,
) -> list[int]:
    """Token ids of `messages`, refused early when they leave no room for a reply."""
    ids = engine.encoder.encode_chat(messages, **template_kwargs)
    engine.encoder.check_fits(ids, where)
    return ids


def run_one(
    engine: Engine,
    task: JsonTask,
    prompt: str,
    params: SamplingParams,
    on_event: Callable[[Event], None] | None = None,
) -> JsonReply:
    """One prompt in, one checked reply out (failures in `reply.error`); `on_event` sees
    the request's events (e.g. prefill progress)."""
    ids = encode(engine, task.messages(prompt), **task.template_kwargs)
    return read_reply(task, engine.complete(request(engine, ids, task, params), on_event))


@dataclass(frozen=True, slots=True)
class BatchPlan:
    """A checked batch: every line encoded, the output file scanned. Nothing written yet."""

    lines: list[InputLine]
    ids: dict[int, list[int]]
    """Token ids of the lines still to run, by line number."""
    skipped: int
    keep_bytes: int
    torn: bool
    output: Path
    params: SamplingParams
    run: dict[str, Any]
    """What produces the records (`batch.run_description`), stored in each one."""


@dataclass(slots=True)
class BatchSummary:
    ran: int = 0
    skipped: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    seconds: float = 0.0


def plan_batch(
    engine: Engine,
    task: JsonTask,
    lines: list[InputLine],
    input_path: Path,
    output: Path,
    params: SamplingParams,
    redo: bool = False,
) -> BatchPlan:
    """Check the whole batch (from `read_input`) before anything runs or is written.

    With `redo`, records already in `output` (of this run or another) are replaced.

    Raises:
        UserInputError: a missing var, a prompt too long, or an output file that is not ours.
        OutputMismatchError: `output` holds records of another run (and not `redo`).
    """
    thinking = None if task.thinking is None else asdict(task.thinking)
    run = run_description(
        engine.loaded.key,
        params,
        schema=task.schema,
        instructions=task.instructions,
        thinking=thinking,
    )
    state = read_output(output, run, redo)
    ids: dict[int, list[int]] = {}
    for item in lines:
        where = f"{input_path} line {item.line}"
        messages = task.messages(item.prompt, item.vars, where)
        if item.line not in state.done:
            ids[item.line] = encode(engine, messages, where, **task.template_kwargs)
    return BatchPlan(
        lines, ids, len(lines) - len(ids), state.keep_bytes, state.torn, output, params, run
    )


def record(item: InputLine, reply: JsonReply, run: dict[str, Any]) -> dict[str, Any]:
    """The output line of one input line."""
    return {"line": item.line, "id": item.id, **reply.as_dict(), "run": run}


def run_batch(
    engine: Engine,
    task: JsonTask,
    plan: BatchPlan,
    concurrency: int = 1,
    progress: Callable[[int, int], None] | None = None,
    on_record: Callable[[dict[str, Any]], None] | None = None,
) -> BatchSummary:
    """Run the lines `plan` still has to do, up to `concurrency` at once, appending their
    records in input order."""
    todo = [item for item in plan.lines if item.line in plan.ids]
    by_line = {item.line: item for item in todo}
    summary = BatchSummary(skipped=plan.skipped)
    jobs = [
        Job(i.line, partial(request, engine, plan.ids[i.line], task, plan.params)) for i in todo
    ]
    start = time.perf_counter()
    if progress and todo:
        progress(0, len(todo))
    with RecordWriter(plan.output, plan.keep_bytes) as writer:
        for line, result in run_jobs(engine, jobs, concurrency):
            reply = read_reply(task, result)
            rec = record(by_line[line], reply, plan.run)
            writer.write(rec)
            summary.ran += 1
            summary.failed += reply.error is not None
            summary.prompt_tokens += result.stats.prompt_tokens
            summary.cached_tokens += result.stats.cached_tokens
            if on_record:
                on_record(rec)
            if progress:
                progress(summary.ran, len(todo))
    summary.seconds = time.perf_counter() - start
    return summary
