"""`mlxcache regress record | check`: byte-identical regression runs against a golden file."""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from mlxcache.errors import UserInputError
from mlxcache.regress import VARIANTS
from mlxcache_cli import options as o
from mlxcache_cli import remote, ui

if TYPE_CHECKING:  # the runner imports mlx_lm (seconds): imported by the commands
    from mlxcache.regress import golden
    from mlxcache.regress import suite as suite_mod
    from mlxcache.regress.runner import Runner

Variants = Annotated[
    str,
    typer.Option(
        "--variants",
        metavar="LIST",
        help="Comma-separated execution variants: cold,warm,disk,lanes.",
    ),
]
ALL_VARIANTS = ",".join(VARIANTS)
RegressBlock = Annotated[
    int | None,
    typer.Option(
        "--block-size",
        metavar="TOKENS",
        help="Cache block size for the cached variants (default: the device's, as every "
        "command). The golden does not depend on it.",
    ),
]


def _variants(text: str) -> tuple[str, ...]:
    chosen = tuple(v.strip() for v in text.split(",") if v.strip())
    unknown = [v for v in chosen if v not in VARIANTS]
    if unknown or not chosen:
        raise UserInputError(
            f"unknown variant {', '.join(unknown) or '(none)'}: choose from {', '.join(VARIANTS)}"
        )
    if "disk" in chosen and ("warm" not in chosen or chosen.index("warm") > chosen.index("disk")):
        raise UserInputError(
            "the disk variant reads the cache the warm variant fills: list warm before disk"
        )
    return chosen


def _show(report: golden.Report, as_json: bool) -> None:
    if as_json:
        ui.out_json(report.as_dict())
    else:
        for name, case in report.cases.items():
            ui.out_text(f"{case['status']:<22} {name}\n")
            for label, diff in {
                **case.get("disagreements", {}),
                **({"golden vs run": case["diff"]} if "diff" in case else {}),
            }.items():
                ui.out_text(_describe(label, diff))
        for note in report.notes:
            ui.warn(note)
    if not report.ok:
        raise typer.Exit(1)


def _describe(label: str, diff: dict[str, Any]) -> str:
    if "token" not in diff:
        return f"    {label}: {diff['expected_outputs']} outputs expected, {diff['actual_outputs']} produced\n"
    if diff["token"] is None:  # the same tokens: what differs is the text or the ending
        where = "text" if diff["expected_text"] != diff["actual_text"] else "finish reason"
        what = f"same tokens, different {where}"
    else:
        # None: that token list ended there (the other goes on)
        want, got = (
            "end" if t is None else t for t in (diff["expected_token"], diff["actual_token"])
        )
        what = f"first different token #{diff['token']} ({want} -> {got})"
    return (
        f"    {label}: output {diff['output']}, {what}\n"
        f"      expected: {diff['expected_text']!r} [{diff['expected_finish']}]\n"
        f"      actual:   {diff['actual_text']!r} [{diff['actual_finish']}]\n"
    )


def _load(
    suite: Path, variants: str, block_size: int | None
) -> tuple[suite_mod.Suite, tuple[str, ...]]:
    """Check the options and load the suite (before any model loads)."""
    from mlxcache.regress import suite as suite_mod

    if block_size is not None:
        o.positive(block_size=block_size)
    return suite_mod.load(suite), _variants(variants)


def _run(
    cases: suite_mod.Suite,
    chosen: tuple[str, ...],
    block_size: int | None,
    quiet: bool,
    act: Callable[[Runner, tuple[str, ...]], golden.Report],
) -> tuple[int, golden.Report]:
    """`act` on the suite in a scratch cache directory."""
    from mlxcache.regress.runner import Runner

    remote.runs_in_process("regress", "its variants set the cache's state")

    progress = ui.regress_progress(quiet)
    with tempfile.TemporaryDirectory(prefix="mlxcache-regress-") as work:
        runner = Runner(cases, Path(work), block_size, progress)
        return len(cases.cases), act(runner, chosen)


def record(
    suite: Annotated[
        Path, typer.Argument(metavar="SUITE", help="Suite file (YAML, JSON or JSONL).")
    ],
    output: Annotated[
        Path, typer.Option("--output", "-o", metavar="FILE", help="Golden file to write.")
    ],
    variants: Variants = ALL_VARIANTS,
    block_size: RegressBlock = None,
    as_json: o.Json = False,
    quiet: o.Quiet = False,
) -> None:
    """Run SUITE under every variant and write the golden file (only if all variants agree)."""
    from mlxcache.regress import golden

    cases, chosen = _load(suite, variants, block_size)
    n, report = _run(cases, chosen, block_size, quiet, lambda r, v: golden.record(r, output, v))
    if report.ok and not as_json:
        ui.info(f"recorded {n} cases to {output}")
    _show(report, as_json)


def check(
    suite: Annotated[
        Path, typer.Argument(metavar="SUITE", help="Suite file (YAML, JSON or JSONL).")
    ],
    golden_file: Annotated[
        Path, typer.Argument(metavar="GOLDEN", help="Golden file from `regress record`.")
    ],
    variants: Variants = ALL_VARIANTS,
    block_size: RegressBlock = None,
    as_json: o.Json = False,
    quiet: o.Quiet = False,
) -> None:
    """Run SUITE again and compare every variant with GOLDEN byte for byte (exit 1 on a difference)."""
    from mlxcache.regress import golden

    cases, chosen = _load(suite, variants, block_size)
    doc = golden.load_golden(golden_file)  # a damaged golden is refused before any work
    _, report = _run(cases, chosen, block_size, quiet, lambda r, v: golden.check(r, doc, v))
    _show(report, as_json)
