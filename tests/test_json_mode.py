"""JSON mode library: schema checks, prompts, replies, JSONL batches (tiny model, no SmolLM)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from mlxcache.engine import Engine
from mlxcache.errors import UserInputError
from mlxcache.events import Result, Stats
from mlxcache.model import LoadedModel
from mlxcache.modes.batch import (
    InputLine,
    RecordWriter,
    read_input,
    read_output,
    substitute,
)
from mlxcache.modes.json_mode import JsonTask, plan_batch, read_reply, run_batch
from mlxcache.modes.schema import read_json_arg
from mlxcache.sampling import SamplingParams

CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}},
    "required": ["city"],
    "additionalProperties": False,
}


def test_read_json_arg(tmp_path: Path) -> None:
    assert read_json_arg('{"type": "object"}', "schema") == {"type": "object"}
    (tmp_path / "s.json").write_text('{"type": "string"}')
    assert read_json_arg(str(tmp_path / "s.json"), "schema") == {"type": "string"}
    (tmp_path / "bad.json").write_text('{\n  "type": }')
    with pytest.raises(UserInputError, match=r"schema file .*bad.json is not JSON: .* line 2"):
        read_json_arg(str(tmp_path / "bad.json"), "schema")
    with pytest.raises(UserInputError, match=r"cannot read schema file /no/such\.json"):
        read_json_arg("/no/such.json", "schema")


def test_messages_put_instructions_and_schema_first() -> None:
    task = JsonTask.create(CITY, "Answer for {{who}}.")
    system, user = task.messages("Capital of {{country}}?", {"who": "kids", "country": "Peru"})
    assert system["role"] == "system" and user == {"role": "user", "content": "Capital of Peru?"}
    assert system["content"].startswith("Answer for kids.\n\nReply with one JSON document")
    assert system["content"].endswith(json.dumps(CITY))
    with pytest.raises(UserInputError, match=r"line 4 \(instructions\): no value for \{\{who\}\}"):
        task.messages("hi", {"x": "1"}, "line 4")
    assert task.messages("{{as is}}")[1]["content"] == "{{as is}}"  # one prompt: no templating


def test_without_a_schema_the_prompt_asks_for_an_object_and_shows_none() -> None:
    for task in (JsonTask.create(), JsonTask.create({"type": "object"})):
        assert task.schema == {"type": "object"}
        assert task.messages("hi")[0] == {
            "role": "system",
            "content": "Reply with one JSON object.",
        }
    briefed = JsonTask.create(instructions="Be brief.")
    assert briefed.messages("hi")[0]["content"] == "Be brief.\n\nReply with one JSON object."
    listed = {"type": "object", "properties": {"a": {"type": "string"}}}
    assert JsonTask.create(listed).messages("hi")[0]["content"] == (
        'Reply with one JSON document that follows this JSON Schema:\n{"type": "object", '
        '"properties": {"a": {"type": "string"}}}'
    )


def result(text: str, finish: str = "stop") -> Result:
    return Result(text, [], finish, Stats(generated_tokens=7))


def test_read_reply() -> None:
    task = JsonTask.create(CITY)
    ok = read_reply(task, result('{"city": "Paris"}'))
    assert ok.output == {"city": "Paris"} and ok.error is None
    cut = read_reply(task, result('{"city": "Par', "length"))
    assert cut.output is None and cut.finish_reason == "length"
    assert cut.error is not None and "raise max_tokens" in cut.error
    assert cut.as_dict()["text"] == '{"city": "Par'
    bad = read_reply(task, result('{"city": 1}'))
    assert (
        bad.error
        == "the reply does not satisfy the schema: type at /city: 1 is not of type 'string'"
    )
    twice = read_reply(task, result('{"city": "A", "city": "B"}'))
    assert twice.error == "not JSON: key 'city' appears twice in an object"
    assert twice.as_dict()["text"] == '{"city": "A", "city": "B"}'


def test_lenient_reply_breaking_an_unenforced_rule_is_an_error() -> None:
    tags = {"type": "array", "items": {"type": "string"}, "uniqueItems": True}
    task = JsonTask.create(tags)
    assert read_reply(task, result('["a", "b"]')).output == ["a", "b"]
    bad = read_reply(task, result('["a", "a"]'))
    assert bad.output is None
    assert bad.error == (
        "the reply does not satisfy the schema: uniqueItems at /: ['a', 'a'] has non-unique elements"
    )


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("nope", "line 2: not JSON"),
        ("[1]", 'line 2: expected an object like {"prompt": "..."}'),
        ('{"promt": "x"}', "line 2: unknown field 'promt' (fields: id, prompt, vars)"),
        ('{"prompt": " "}', 'line 2: "prompt" must be a non-empty string'),
        ('{"prompt": "x", "vars": [1]}', 'line 2: "vars" must be an object'),
        ('{"prompt": "x", "vars": {"a": null}}', 'line 2: var "a" must be a string'),
    ],
)
def test_bad_input_lines(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "in.jsonl"
    path.write_text('{"prompt": "ok"}\n' + line + "\n")
    with pytest.raises(UserInputError, match=re.escape(message)):
        read_input(path)


def test_read_input_skips_blank_lines_and_keeps_numbers(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    path.write_text('{"prompt": "a", "id": 7}\n\n{"prompt": "b", "vars": {"n": 2}}\n')
    assert read_input(path) == [InputLine(1, "a", {}, 7), InputLine(3, "b", {"n": "2"})]
    path.write_text("\n\n")
    with pytest.raises(UserInputError, match="has no request"):
        read_input(path)


def test_substitute() -> None:
    assert substitute("{{ a }}+{{b}}={c}", {"a": "1", "b": "2"}, "x") == "1+2={c}"


def test_output_state_and_torn_last_line(tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    assert read_output(out).done == frozenset()
    good = '{"line": 1, "output": 1}\n{"line": 3, "output": 2}\n'
    out.write_text(good + '{"line": 4, "outp')
    state = read_output(out)
    assert state.done == {1, 3} and state.torn and state.keep_bytes == len(good)
    with RecordWriter(out, state.keep_bytes) as writer:
        writer.write({"line": 4, "output": "é"})
    assert out.read_text(encoding="utf-8") == good + '{"line": 4, "output": "é"}\n'
    out.write_text('{"line": 1}\nnot json\n{"line": 2}\n')
    with pytest.raises(UserInputError, match=r"out\.jsonl line 2 is not a record of this command"):
        read_output(out)


# -- batches on the tiny random model (fast); the grammar makes its output valid anyway --

SHORT = {"type": "string", "maxLength": 6}


def run(engine: Engine, folder: Path, out: str, lanes: int) -> list[dict[str, Any]]:
    task = JsonTask.create(SHORT)
    lines = read_input(folder / "in.jsonl")
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=20)
    plan = plan_batch(engine, task, lines, folder / "in.jsonl", folder / out, params)
    run_batch(engine, task, plan, lanes)
    return [json.loads(x) for x in (folder / out).read_text().splitlines()]


def without_stats(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in r.items() if k != "stats"} for r in records]


def test_batch_lanes_order_rerun_and_torn_line(tiny: LoadedModel, tmp_path: Path) -> None:
    engine = Engine(tiny)
    prompts = ["a", "bb", "ccc", "dddd"]
    (tmp_path / "in.jsonl").write_text(
        "".join(json.dumps({"prompt": p, "id": i}) + "\n" for i, p in enumerate(prompts))
    )
    one = run(engine, tmp_path, "one.jsonl", lanes=1)
    assert [r["line"] for r in one] == [1, 2, 3, 4] and [r["id"] for r in one] == [0, 1, 2, 3]
    assert all(r["finish_reason"] == "stop" and isinstance(r["output"], str) for r in one)
    assert len({r["output"] for r in one}) > 1  # sampled: lines really differ
    three = run(engine, tmp_path, "three.jsonl", lanes=3)
    assert without_stats(three) == without_stats(one)
    # A rerun skips everything; a torn last line is dropped and its line redone.
    before = (tmp_path / "one.jsonl").read_bytes()
    assert run(engine, tmp_path, "one.jsonl", lanes=2) == one
    assert (tmp_path / "one.jsonl").read_bytes() == before
    torn = before[: before.rindex(b"\n", 0, len(before) - 1) + 1] + b'{"line": 4, "out'
    (tmp_path / "one.jsonl").write_bytes(torn)
    again = run(engine, tmp_path, "one.jsonl", lanes=2)
    assert without_stats(again) == without_stats(one)
    assert again[:3] == one[:3]  # untouched records keep their bytes


def test_plan_refuses_missing_vars_before_writing(tiny: LoadedModel, tmp_path: Path) -> None:
    (tmp_path / "in.jsonl").write_text('{"prompt": "a"}\n{"prompt": "{{x}}"}\n')
    task = JsonTask.create(SHORT)
    lines = read_input(tmp_path / "in.jsonl")
    with pytest.raises(UserInputError, match=r"in.jsonl line 2: no value for \{\{x\}\}"):
        plan_batch(
            Engine(tiny),
            task,
            lines,
            tmp_path / "in.jsonl",
            tmp_path / "out.jsonl",
            SamplingParams(),
        )
    assert not (tmp_path / "out.jsonl").exists()
