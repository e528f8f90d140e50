"""JSON mode without a schema: the server's `response_format: json_object` and `mlxcache json`
with no --schema share one prompt, which asks for a JSON object and shows no schema to copy;
the server's `strict` keeps the digit cap."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from typer.testing import CliRunner

from mlxcache.constrain import GrammarProcessor
from mlxcache.engine import Engine
from mlxcache.model import LoadedModel
from mlxcache.modes.json_mode import JsonTask
from mlxcache.sampling import SamplingParams
from mlxcache.server import prepare
from mlxcache.server.schemas import ChatRequest
from mlxcache_cli.main import app

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "A cat?"}]


def plan_for(engine: Engine, fmt: dict[str, Any]) -> prepare.Plan:
    body = ChatRequest.model_validate({"model": "m", "messages": MESSAGES, "response_format": fmt})
    return prepare.chat(engine, body, SamplingParams(max_tokens=8))


def test_json_object_is_json_mode_without_a_schema(tiny: LoadedModel) -> None:
    engine = Engine(tiny)
    plan = plan_for(engine, {"type": "json_object"})
    task = JsonTask.create(instructions="Be brief.").for_model(tiny.tokenizer, False)
    assert plan.ids == engine.encoder.encode_chat(task.messages("A cat?"), **task.template_kwargs)
    prompt = tiny.tokenizer.decode(plan.ids)
    assert "Be brief.\n\nReply with one JSON object." in prompt
    assert '"type"' not in prompt


def test_server_strict_keeps_the_digit_cap(tiny: LoadedModel) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema, "strict": True}}
    grammar = plan_for(Engine(tiny), fmt).request.processors[0]
    assert isinstance(grammar, GrammarProcessor)
    text = '{"n": ' + "1" * 16
    assert grammar.matcher.consume_tokens(tiny.tokenizer.encode(text, add_special_tokens=False))
    allowed = grammar.allowed(tiny.tokenizer.vocab_size)
    digits = [tiny.tokenizer.encode(d, add_special_tokens=False)[0] for d in "0123456789"]
    assert not allowed[digits].any()


def test_cli_json_without_a_schema(tiny_gguf: Path) -> None:
    runner = CliRunner()
    check = runner.invoke(app, ["json", "--check"])
    assert (check.exit_code, check.stdout, check.stderr) == (0, "ok\n", "")
    args = ["json", "A cat?", "-m", str(tiny_gguf), "-n", "40", "--temp", "1", "--seed", "3"]
    run = runner.invoke(app, [*args, "--no-cache"])
    assert (run.exit_code, run.stdout) == (0, "{}\n"), run.stderr  # the random model's object
    assert "0/62 prompt tokens cached" in run.stderr
