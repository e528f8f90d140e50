"""Golden files: record a suite's outputs, check a new run against them, explain differences."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from mlxcache.errors import UserInputError
from mlxcache.fileio import loads_json, write_atomic
from mlxcache.regress import VARIANTS
from mlxcache.regress.suite import Case, Output, Suite
from mlxcache.sampling import SamplingParams

if TYPE_CHECKING:
    from mlxcache.model.adapter import Adapter

FORMAT = "mlxcache-golden-v1"
_CONTEXT = 30  # characters of text shown on each side of a difference
CLIPPED = "…"
"""Marks a side where a difference's excerpt of a text stops short of the text's end."""


class SuiteRunner(Protocol):
    """What runs a suite's variants: `runner.LocalRunner` in this process, or
    `regress.remote.ServerRunner` through a running server (this module imports neither:
    a check through a server loads no model code)."""

    suite: Suite
    cache_stats: dict[str, dict[str, int]]

    def run(self, variant: str) -> dict[str, list[Output]]: ...

    def models(self) -> dict[str, str]:
        """Model key of every case's model."""
        ...

    def versions(self) -> dict[str, str]:
        """The versions the outputs depend on (mlxcache, mlx, mlx_lm)."""
        ...

    def adapters(self) -> dict[str, dict[str, str] | None]:
        """The adapter of every case's model (`golden_adapter`), None for none."""
        ...


def golden_adapter(adapter: Adapter | None) -> dict[str, str] | None:
    """An adapter as a golden records it: its folder's name and content digest."""
    return None if adapter is None else {"name": adapter.path.name, "digest": adapter.digest}


def _adapter_text(adapter: Any) -> str:
    if not isinstance(adapter, dict):
        return "no adapter"
    return f"adapter {adapter.get('name')} ({str(adapter.get('digest'))[:12]})"


def first_difference(expected: list[Output], actual: list[Output]) -> dict[str, Any] | None:
    """Where two output lists first differ: output index, token index, text around it
    (`excerpt`: clipped sides marked `CLIPPED`).

    `token` is None when the token lists are equal (the text or the finish reason differ);
    an `expected_token` or `actual_token` of None means that list ended there.
    """
    for i, (want, got) in enumerate(zip(expected, actual, strict=False)):
        if want == got:
            continue
        a, b = want["tokens"], got["tokens"]
        tok = next(
            (j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
        )
        ta, tb = want["text"], got["text"]
        ch = next(
            (j for j, (x, y) in enumerate(zip(ta, tb, strict=False)) if x != y),
            min(len(ta), len(tb)),
        )
        return {
            "output": i,
            "token": None if a == b else tok,
            "expected_token": a[tok] if tok < len(a) else None,
            "actual_token": b[tok] if tok < len(b) else None,
            "expected_text": excerpt(ta, ch),
            "actual_text": excerpt(tb, ch),
            "expected_finish": want["finish_reason"],
            "actual_finish": got["finish_reason"],
        }
    if len(expected) != len(actual):
        return {
            "output": min(len(expected), len(actual)),
            "expected_outputs": len(expected),
            "actual_outputs": len(actual),
        }
    return None


def excerpt(text: str, at: int) -> str:
    """`text` within `_CONTEXT` characters of `at`, each side it clips marked `CLIPPED`."""
    start, end = max(0, at - _CONTEXT), at + _CONTEXT
    head = CLIPPED if start > 0 else ""
    tail = CLIPPED if end < len(text) else ""
    return f"{head}{text[start:end]}{tail}"


def settings(case: Case) -> dict[str, Any]:
    """A case's sampling settings as its golden records them."""
    return dataclasses.asdict(case.sampling)


def changed_settings(recorded: Any, case: Case) -> dict[str, dict[str, Any]]:
    """The settings `case` runs with that differ from those its golden `recorded` (a golden
    from before they were recorded: none), as {setting: {"golden": ..., "now": ...}}."""
    if not isinstance(recorded, dict):
        return {}
    now = settings(case)
    # A setting added since the golden was recorded ran at its default then.
    then = {**dataclasses.asdict(SamplingParams()), **recorded}
    return {
        k: {"golden": then.get(k), "now": now.get(k)}
        for k in sorted(now.keys() | then.keys())
        if then.get(k) != now.get(k)
    }


@dataclass(slots=True)
class Report:
    """The outcome of a record or check; `ok` decides the exit code."""

    cases: dict[str, dict[str, Any]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    variants: dict[str, dict[str, int]] = field(default_factory=dict)
    """Per variant: how much it resumed from the prompt cache."""

    @property
    def ok(self) -> bool:
        return all(c["status"] == "ok" for c in self.cases.values())

    def as_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "notes": self.notes, "variants": self.variants, "cases": self.cases}


def run_variants(
    runner: SuiteRunner, variants: tuple[str, ...]
) -> tuple[dict[str, dict[str, list[Output]]], Report]:
    """Run every variant; a case whose variants disagree is an mlxcache bug, reported so."""
    results = {v: runner.run(v) for v in variants}
    report = Report(variants=runner.cache_stats)
    base = variants[0]
    for case in runner.suite.cases:
        entry: dict[str, Any] = {"status": "ok"}
        for v in variants[1:]:
            diff = first_difference(results[base][case.name], results[v][case.name])
            if diff is not None:
                entry["status"] = "variant-disagreement"
                entry.setdefault("disagreements", {})[f"{base} vs {v}"] = diff
        report.cases[case.name] = entry
    if not report.ok:
        report.notes.append(
            "execution variants disagree: this is a bug in mlxcache, not in the model"
        )
    return results, report


def record(runner: SuiteRunner, out: Path, variants: tuple[str, ...] = VARIANTS) -> Report:
    """Run the suite and write the golden file (only when every variant agrees)."""
    results, report = run_variants(runner, variants)
    if not report.ok:
        return report
    keys, adapters = runner.models(), runner.adapters()
    doc = {
        "format": FORMAT,
        "versions": runner.versions(),
        "cases": {
            c.name: {
                "model": c.model,
                "model_key": keys[c.name],
                "sampling": settings(c),
                "adapter": adapters[c.name],
                "outputs": results[variants[0]][c.name],
            }
            for c in runner.suite.cases
        },
    }
    write_atomic(out, json.dumps(doc, ensure_ascii=False, indent=1) + "\n")
    return report


def load_golden(path: Path) -> dict[str, Any]:
    """Read and check a golden file whole (every field `check` reads has its type), so a
    damaged one is refused before any case runs.

    Raises:
        UserInputError: unreadable, or not a golden file (one line saying what is wrong).
    """
    try:
        doc = loads_json(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UserInputError(f"cannot read golden file {path}: {exc}") from exc
    if (
        not isinstance(doc, dict)
        or doc.get("format") != FORMAT
        or not isinstance(doc.get("cases"), dict)
    ):
        raise UserInputError(f"{path} is not a golden file ({FORMAT})")
    versions = doc.get("versions", {})
    if not isinstance(versions, dict) or not all(isinstance(v, str) for v in versions.values()):
        raise UserInputError(f"{path}: 'versions' must be an object of version strings")
    for name, case in doc["cases"].items():
        outputs = case.get("outputs") if isinstance(case, dict) else None
        if not isinstance(outputs, list) or not all(_is_output(o) for o in outputs):
            raise UserInputError(
                f"{path}: case {name!r} has no valid 'outputs' (text, tokens, finish_reason)"
            )
        if not isinstance(case.get("model_key", ""), str):
            raise UserInputError(f"{path}: case {name!r}: 'model_key' must be a string")
        if not isinstance(case.get("sampling", {}), dict):
            raise UserInputError(f"{path}: case {name!r}: 'sampling' must be an object")
        adapter = case.get("adapter")
        if adapter is not None and not (
            isinstance(adapter, dict) and isinstance(adapter.get("digest"), str)
        ):
            raise UserInputError(f"{path}: case {name!r}: 'adapter' must have a 'digest'")
    return doc


def _is_output(o: Any) -> bool:
    return (
        isinstance(o, dict)
        and isinstance(o.get("text"), str)
        and isinstance(o.get("tokens"), list)
        and all(isinstance(t, int) and not isinstance(t, bool) for t in o["tokens"])
        and isinstance(o.get("finish_reason"), str)
    )


def check(
    runner: SuiteRunner, golden: Path | dict[str, Any], variants: tuple[str, ...] = VARIANTS
) -> Report:
    """Run the suite and compare every variant with the golden, byte for byte.

    Args:
        golden: the golden file, or what `load_golden` read from it (checked before the
            runner loads its models).
    """
    if isinstance(golden, Path):
        golden = load_golden(golden)
    results, report = run_variants(runner, variants)
    now = runner.versions()
    for name, then in golden.get("versions", {}).items():
        if now.get(name) != then:
            report.notes.append(f"version changed: {name} {then} -> {now.get(name)}")
    keys, adapters = runner.models(), runner.adapters()
    for case in runner.suite.cases:
        entry = report.cases[case.name]
        want = golden["cases"].get(case.name)
        if want is None:
            entry["status"] = "missing-from-golden"
            continue
        if _adapter_changed(case.name, want.get("adapter"), adapters[case.name], entry, report):
            continue
        if want.get("model_key") != keys[case.name]:
            entry["model_key_changed"] = {"golden": want.get("model_key"), "now": keys[case.name]}
            report.notes.append(
                f"model key changed for {case.name!r}: {want.get('model_key')} -> {keys[case.name]}"
            )
        if entry["status"] != "ok":  # the variants disagree: that bug comes first
            continue
        changed = changed_settings(want.get("sampling"), case)
        if changed:  # the suite was edited since: the cause of any difference, named first
            entry.update(status="settings-changed", settings_changed=changed)
        diff = first_difference(want["outputs"], results[variants[0]][case.name])
        if diff is not None:
            entry["status"] = "settings-changed" if changed else "mismatch"
            entry["diff"] = diff
    return report


def _adapter_changed(
    name: str, then: Any, now: dict[str, str] | None, entry: dict[str, Any], report: Report
) -> bool:
    """Whether case `name` runs with another adapter (or none) than its golden recorded:
    then that is its status, and the first note, as the cause of any difference (its
    outputs are not compared: they are another model's)."""
    digest = then.get("digest") if isinstance(then, dict) else None
    if digest == (now or {}).get("digest"):
        return False
    if entry["status"] == "ok":  # variants that disagree: that bug comes first
        entry["status"] = "adapter-changed"
    entry["adapter_changed"] = {"golden": then, "now": now}
    report.notes.insert(
        0,
        f"case {name!r} was recorded with {_adapter_text(then)} and now runs with "
        f"{_adapter_text(now)}: its outputs are another model's, not compared",
    )
    return True
