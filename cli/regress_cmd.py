"""`mlxcache regress record | check`: byte-identical regression runs against a golden file."""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
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

Variants = Annotated[
    str | None,
    typer.Option(
        "--variants",
        metavar="LIST",
        help="Comma-separated execution variants: cold,warm,disk,lanes,drafted (default: all; "
        "through --server: warm, on the server's cache).",
        show_default=False,
    ),
]
RegressBlock = Annotated[
    int | None,
    typer.Option(
        "--block-size",
        metavar="TOKENS",
        help="Cache block size for the cached variants (default: the device's, as every "
        "command). The golden does not depend on it.",
    ),
]

RegressQuiet = Annotated[
    bool, typer.Option("--quiet", "-q", help="No progress lines on stderr (the verdict still).")
]


def _variants(text: str | None, server: str | None) -> tuple[str, ...]:
    from mlxcache.regress.remote import SERVER_VARIANTS

    if text is None:
        return SERVER_VARIANTS if server else VARIANTS
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
    local = [v for v in chosen if v not in SERVER_VARIANTS]
    if server and local:
        # They set the cache's state themselves (none, a new process, lanes side by side).
        raise UserInputError(
            f"--variants {','.join(local)} run in-process only: drop --server (or unset "
            f"${remote.ENV_SERVER}), or run --variants {','.join(SERVER_VARIANTS)}"
        )
    return chosen


def _show(report: golden.Report, as_json: bool) -> None:
    if as_json:
        ui.out_json(report.as_dict())
    else:
        for name, case in report.cases.items():
            ui.out_text(f"{case['status']:<22} {name}\n")
            for setting, values in case.get("settings_changed", {}).items():
                ui.out_text(
                    f"    {setting} changed: {values['golden']} in the golden, {values['now']} "
                    "in the suite (record it again)\n"
                )
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
    suite: Path,
    variants: str | None,
    block_size: int | None,
    server: str | None,
    only: list[str] | None = None,
) -> tuple[suite_mod.Suite, tuple[str, ...]]:
    """Check the options and load the suite (before any model loads); `only`: the cases
    named by --case."""
    import dataclasses

    from mlxcache.regress import suite as suite_mod

    if block_size is not None:
        o.positive(block_size=block_size)
    loaded = suite_mod.load(suite)
    if only:
        names = [c.name for c in loaded.cases]
        unknown = [n for n in only if n not in names]
        if unknown:
            raise UserInputError(
                f"no case {unknown[0]!r} in {suite} (its cases: {', '.join(names)})"
            )
        loaded = dataclasses.replace(loaded, cases=tuple(c for c in loaded.cases if c.name in only))
    return loaded, _variants(variants, server)


def _run(
    cases: suite_mod.Suite,
    chosen: tuple[str, ...],
    block_size: int | None,
    quiet: bool,
    act: Callable[[golden.SuiteRunner, tuple[str, ...]], golden.Report],
    server: str | None,
) -> tuple[int, golden.Report]:
    """`act` on the suite in a scratch cache directory, or on the server at `server`."""
    progress = ui.regress_progress(quiet)
    if server:
        with _on_server(server, cases, block_size, progress) as runner:
            return len(cases.cases), act(runner, chosen)

    from mlxcache.regress.runner import LocalRunner

    with tempfile.TemporaryDirectory(prefix="mlxcache-regress-") as work:
        return len(cases.cases), act(LocalRunner(cases, Path(work), block_size, progress), chosen)


@contextmanager
def _on_server(
    url: str,
    cases: suite_mod.Suite,
    block_size: int | None,
    progress: Callable[[str, str, str], None] | None,
) -> Iterator[golden.SuiteRunner]:
    """A runner of `cases` on the server at `url`, once it runs every case's model (and
    the block size, when given: the golden does not depend on it)."""
    from mlxcache.model.loader import DEFAULT_MODEL
    from mlxcache.regress.remote import ServerRunner
    from mlxcache.remote import Wanted

    def wanted(found: dict[str, Any]) -> list[remote.Wanted]:
        block = found.get("block_size") if block_size is None else block_size
        block = int(block or 0)
        runs = dict.fromkeys((c.model or DEFAULT_MODEL, c.adapter) for c in cases.cases)
        return [Wanted(spec, block, True, tailoring=_tailoring(a)) for spec, a in runs]

    server, card = remote.checked(url, wanted)
    with server:
        yield ServerRunner(cases, server, str(card["id"]), card["mlxcache"], progress)


def _tailoring(adapter: str | None) -> str:
    """What a case's adapter adds to its model's identity (`remote.Wanted.tailoring`)."""
    if adapter is None:
        return ""
    from mlxcache.model.loader import tailoring_of

    return tailoring_of(adapter, None, None)


def record(
    suite: Annotated[
        Path, typer.Argument(metavar="SUITE", help="Suite file (YAML, JSON or JSONL).")
    ],
    output: Annotated[
        Path, typer.Option("--output", "-o", metavar="FILE", help="Golden file to write.")
    ],
    variants: Variants = None,
    block_size: RegressBlock = None,
    as_json: o.Json = False,
    quiet: RegressQuiet = False,
    server: remote.ServerUrl = None,
    force: Annotated[
        bool, typer.Option("--force", help="Overwrite FILE if it exists (a golden others check).")
    ] = False,
) -> None:
    """Run SUITE under every variant and write the golden file (only if all variants agree)."""
    from mlxcache.regress import golden

    if output.exists() and not force:  # before any model loads
        raise UserInputError(f"{output} exists: --force overwrites it, or write a new file with -o")
    cases, chosen = _load(suite, variants, block_size, server)
    start = time.perf_counter()
    n, report = _run(
        cases, chosen, block_size, quiet, lambda r, v: golden.record(r, output, v), server
    )
    if report.ok and not as_json:
        took = ui.seconds(time.perf_counter() - start)
        ui.info(f"recorded {ui.plural(n, 'case')} to {output} ({took})")
    _show(report, as_json)


def check(
    suite: Annotated[
        Path, typer.Argument(metavar="SUITE", help="Suite file (YAML, JSON or JSONL).")
    ],
    golden_file: Annotated[
        Path, typer.Argument(metavar="GOLDEN", help="Golden file from `regress record`.")
    ],
    variants: Variants = None,
    block_size: RegressBlock = None,
    as_json: o.Json = False,
    quiet: RegressQuiet = False,
    server: remote.ServerUrl = None,
    case: Annotated[
        list[str] | None,
        typer.Option("--case", metavar="NAME", help="Check only this case (repeatable)."),
    ] = None,
) -> None:
    """Run SUITE again and compare every variant with GOLDEN byte for byte (exit 1 on a difference)."""
    from mlxcache.regress import golden

    cases, chosen = _load(suite, variants, block_size, server, case)
    doc = golden.load_golden(golden_file)  # a damaged golden is refused before any work
    start = time.perf_counter()
    _, report = _run(cases, chosen, block_size, quiet, lambda r, v: golden.check(r, doc, v), server)
    failed = sum(c["status"] != "ok" for c in report.cases.values())
    verdict = (
        f"{ui.plural(len(report.cases), 'case')} under {ui.plural(len(chosen), 'variant')}: "
        f"{len(report.cases) - failed} passed, {failed} failed "
        f"({ui.seconds(time.perf_counter() - start)})"
    )
    try:
        _show(report, as_json)
    finally:  # the last line, whether every case passed or not
        if not as_json:  # stdout is the report's: `check ... > report.txt` keeps the verdict
            ui.out_text(verdict + "\n")
        if as_json or not ui.stdout_is_terminal():  # else the terminal shows it already
            ui.info(verdict)
