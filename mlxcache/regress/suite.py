"""Regression suites: a YAML (or JSON / JSONL) file of cases, parsed and checked up front.

```yaml
model: smollm2-135m            # default for every case (a spec as `--model` takes)
adapter: ./my-adapter          # optional: an mlx_lm.lora folder (`--adapter`); a case's own wins
defaults: {temperature: 0, max_tokens: 24, seed: 0}
cases:
  - {name: capital, kind: plain, prompt: "What is the capital of France?"}
  - {name: talk, kind: chat, turns: ["Hi!", "Name a color.", "Another one."], repeat_last: true}
  - {name: city, kind: json, schema: {...}, prompts: ["...", "..."]}   # prompts run at once
  - {name: call, kind: tools, tools: [...], tool_choice: required, prompt: "..."}
```

A JSONL suite has one case per line (suite-level keys then come from the defaults above).
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from mlxcache.errors import UserInputError
from mlxcache.fileio import load_yaml, loads_json
from mlxcache.modes.schema import check_schema
from mlxcache.modes.tools import ToolChoice, parse_tools
from mlxcache.sampling import SamplingParams

KINDS = ("plain", "chat", "json", "tools")
SAMPLING_KEYS = tuple(f.name for f in fields(SamplingParams))


@dataclass(frozen=True, slots=True)
class Case:
    """One case. `data` holds the kind's own fields (prompt, turns, schema, tools ...)."""

    name: str
    kind: str
    model: str | None
    sampling: SamplingParams
    data: dict[str, Any] = field(hash=False)
    adapter: str | None = None
    """The adapter folder its model runs with (`--adapter`), if any."""

    @property
    def runs_on(self) -> tuple[str | None, str | None]:
        """What it runs on: its model and adapter (cases sharing both share an engine)."""
        return self.model, self.adapter

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown case kind {self.kind!r}")


@dataclass(frozen=True, slots=True)
class Suite:
    cases: tuple[Case, ...]

    def __post_init__(self) -> None:
        names = [c.name for c in self.cases]
        if len(set(names)) != len(names):
            raise ValueError("case names must be unique")
        if not names:
            raise ValueError("a suite needs at least one case")


def _need(raw: dict[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    value = raw.get(key)
    if not isinstance(value, kind):
        raise UserInputError(
            f"{where}: {key!r} is missing or not {getattr(kind, '__name__', kind)}"
        )
    return value


def _check_json(raw: dict[str, Any], where: str) -> None:
    """A json case: a schema the grammar can enforce, prompts, optional instructions."""
    prompts = raw.get("prompts", [raw.get("prompt")])
    if (
        not isinstance(prompts, list)
        or not prompts
        or not all(isinstance(p, str) and p.strip() for p in prompts)
    ):
        raise UserInputError(f"{where}: needs 'prompt' or a non-empty 'prompts' list of strings")
    instructions = raw.get("instructions")
    if instructions is not None and (not isinstance(instructions, str) or not instructions.strip()):
        raise UserInputError(f"{where}: 'instructions' must be non-empty text")
    check_schema(_need(raw, "schema", dict, where), f"{where} schema")


def _case(
    raw: Any, i: int, model: str | None, defaults: dict[str, Any], adapter: str | None = None
) -> Case:
    where = f"case {i + 1}"
    if not isinstance(raw, dict):
        raise UserInputError(f"{where}: expected a mapping")
    name = str(_need(raw, "name", str, where))
    where = f"case {name!r}"
    kind = raw.get("kind")
    if kind not in KINDS:
        raise UserInputError(f"{where}: kind must be one of {', '.join(KINDS)}, got {kind!r}")
    if kind == "plain":
        _need(raw, "prompt", str, where)
    elif kind == "chat":
        turns = _need(raw, "turns", list, where)
        if not turns or not all(isinstance(t, str) and t.strip() for t in turns):
            raise UserInputError(f"{where}: 'turns' must be a list of non-empty strings")
    elif kind == "json":
        _check_json(raw, where)
    else:
        _need(raw, "prompt", str, where)
        tools = parse_tools(_need(raw, "tools", list, where), f"{where} tools")
        ToolChoice.parse(str(raw.get("tool_choice", "auto")), tools)
    if not isinstance(raw.get("model", model), str | None):
        raise UserInputError(f"{where}: 'model' must be a model spec string")
    if not isinstance(raw.get("adapter", adapter), str | None):
        raise UserInputError(f"{where}: 'adapter' must be an adapter folder's path")
    settings = {**defaults, **{k: raw[k] for k in SAMPLING_KEYS if k in raw}}
    try:
        sampling = SamplingParams(**settings)
    except (TypeError, ValueError) as exc:
        raise UserInputError(f"{where}: {exc}") from exc
    own = (*SAMPLING_KEYS, "name", "kind", "model", "adapter")
    data = {k: v for k, v in raw.items() if k not in own}
    return Case(name, kind, raw.get("model", model), sampling, data, raw.get("adapter", adapter))


def parse(doc: Any, origin: str = "suite") -> Suite:
    """A suite from its parsed document: a mapping with `cases`, or a list of cases.

    Raises:
        UserInputError: what is wrong, naming the case.
    """
    if isinstance(doc, list):
        doc = {"cases": doc}
    if not isinstance(doc, dict) or not isinstance(doc.get("cases"), list):
        raise UserInputError(f"{origin}: expected a mapping with a 'cases' list")
    defaults = doc.get("defaults") or {}
    if not isinstance(defaults, dict) or set(defaults) - set(SAMPLING_KEYS):
        raise UserInputError(f"{origin}: 'defaults' may set only {', '.join(SAMPLING_KEYS)}")
    model, adapter = doc.get("model"), doc.get("adapter")
    cases = tuple(_case(c, i, model, defaults, adapter) for i, c in enumerate(doc["cases"]))
    try:
        return Suite(cases)
    except ValueError as exc:
        raise UserInputError(f"{origin}: {exc}") from exc


def load(path: Path) -> Suite:
    """Read a suite file (.yaml/.yml/.json, or .jsonl with one case per line)."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UserInputError(f"cannot read suite {path}: {exc}") from exc
    try:
        if path.suffix == ".jsonl":
            doc: Any = [loads_json(line) for line in text.splitlines() if line.strip()]
        else:
            doc = load_yaml(text)
    except (ValueError, yaml.YAMLError) as exc:
        raise UserInputError(
            f"suite {path} is not valid {path.suffix[1:] or 'YAML'}: {exc}".replace("\n", " ")
        ) from exc
    return parse(doc, str(path))


Output = dict[str, Any]
"""One reply: its text, token ids and finish reason."""
Messages = list[dict[str, Any]]
Turns = Generator[list[Messages], list[Output], list[Output]]


def turns(case: Case) -> Turns:
    """The messages of each step's requests (sent together), step by step: a step's outputs
    come back in, as later chat turns depend on the replies. A json case's messages are its
    prompt alone (its task adds schema and instructions), a tools case's too (its system
    goes with the tools); the run's outputs are the return value.

    The one description of a case's conversation, for the in-process runner and a server's.
    """
    system = case.data.get("system") if case.kind in ("plain", "chat") else None
    head = [{"role": "system", "content": str(system)}] if system is not None else []
    if case.kind == "chat":
        messages: Messages = head
        outputs: list[Output] = []
        asked = list(case.data["turns"])
        if case.data.get("repeat_last"):
            asked.append(asked[-1])
        for i, turn in enumerate(asked):
            if i == len(case.data["turns"]):  # the repeat: ask the last turn again
                messages = messages[:-2]
            (output,) = yield [[*messages, {"role": "user", "content": turn}]]
            outputs.append(output)
            messages = [
                *messages,
                {"role": "user", "content": turn},
                {"role": "assistant", "content": output["text"]},
            ]
        return outputs
    prompts = (case.data.get("prompts") if case.kind == "json" else None) or [case.data["prompt"]]
    return (yield [[*head, {"role": "user", "content": str(q)}] for q in prompts])
