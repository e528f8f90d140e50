"""Start-up: the commands that need no model import no model code (issue 22, item 1).

Times are the benchmark's (`mlxcache bench startup`); here, what is imported is checked,
in a fresh process per command, as a user runs it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import typer
from typer._click import Context

from mlxcache_cli import bench, coerce, startup_bench
from mlxcache_cli.main import app

MODEL_CODE = ("mlx", "mlx_lm", "transformers", "huggingface_hub", "numpy")
SCHEMA_CODE = ("jsonschema", "llguidance")
HEAVY = (
    *MODEL_CODE,
    *SCHEMA_CODE,
    "pydantic",  # Typer's coercion (coerce.py)
    "markdown_it",  # rich.markdown, which Typer's help renderer imports (richhelp.py)
    "pygments",  # rich.syntax, imported by rich.markdown
    "rich",  # drawn output only: help, an error line, a table
    "yaml",  # regress suites only (fileio.load_yaml)
)
NEEDS = {
    "--help": ("rich",),
    "typo": ("rich",),
    "json --check": SCHEMA_CODE,  # the metaschema check and the grammar compiler
    "cache ls": ("rich",),
    "models ls": ("rich",),
    "missing model": ("rich",),
}
"""Of HEAVY, what each fast command imports; the others import none of it."""

# Runs the CLI as the `mlxcache` script does, then lists the heavy packages it imported.
_CHILD = """
import json, sys
out, sys.argv = sys.argv[1], ["mlxcache", *sys.argv[2:]]
try:
    from mlxcache_cli.main import app
    app()
except SystemExit as exc:
    code = exc.code
heavy = sorted({m.split(".")[0] for m in sys.modules} & set(json.loads(out)[1]))
open(json.loads(out)[0], "w").write(json.dumps({"code": code, "heavy": heavy}))
"""


def _imports(tmp_path: Path, args: list[str]) -> dict[str, Any]:
    report = tmp_path / "imports.json"
    spec = json.dumps([str(report), list(HEAVY)])
    subprocess.run(
        [sys.executable, "-c", _CHILD, spec, *args],
        capture_output=True,
        check=False,
        timeout=120,
    )
    return dict(json.loads(report.read_text()))


def _python(code: str) -> str:
    """What `code` prints, run in a fresh interpreter (it must exit 0)."""
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    ).stdout


@pytest.mark.parametrize(
    "name",
    ["--help", "--version", "typo", "json --check", "cache ls", "models ls", "missing model"],
)
def test_fast_commands_import_no_model_code(tmp_path: Path, name: str) -> None:
    schema = tmp_path / "schema.json"
    schema.write_text('{"type": "object", "properties": {"a": {"type": "integer"}}}')
    argv = startup_bench.commands(schema, tmp_path / "cache")[name][3:]  # after `-m mlxcache_cli`
    result = _imports(tmp_path, argv)
    code = 2 if name in ("typo", "missing model") else 0
    assert result == {"code": code, "heavy": sorted(NEEDS.get(name, ()))}


def test_the_server_client_imports_no_model_or_schema_code() -> None:
    """`generate --server` loads `mlxcache.remote`: it must stay as light as the fast
    commands (the tools mode's calls are read with the schema code only when asked)."""
    heavy = json.dumps([*MODEL_CODE, *SCHEMA_CODE])
    code = (
        "import json, sys\nimport mlxcache.remote\n"
        f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({heavy})))\n"
    )
    assert _python(code) == "[]\n"


def test_help_renderer_defers_markdown_and_traceback() -> None:
    """Help is drawn without rich.markdown and rich.traceback; the renderer's names for
    them still give the real classes once used, and a later import is the real module."""
    code = (
        "import contextlib, io, sys\n"
        "sys.argv = ['mlxcache', '--help']\n"
        "from mlxcache_cli.main import app\n"
        "with contextlib.redirect_stdout(io.StringIO()) as help_text:\n"
        "    try:\n        app()\n    except SystemExit as exc:\n        code = exc.code\n"
        "print(code, 'Usage: mlxcache' in help_text.getvalue())\n"
        "print([m for m in ('rich.markdown', 'rich.traceback') if m in sys.modules])\n"
        "import rich.markdown, rich.traceback, typer.rich_utils as r\n"
        "print(isinstance(r.Markdown('# hi'), rich.markdown.Markdown))\n"
        "print(r.Traceback.from_exception == rich.traceback.Traceback.from_exception)\n"
    )
    assert _python(code) == "0 True\n[]\nTrue\nTrue\n"


def test_cache_ls_with_entries_imports_no_model_code(tmp_path: Path) -> None:
    """The preview of each entry's prompt reads the tokenizer without transformers, and
    the listing reads the entries' tokens without numpy or MLX."""
    import numpy as np

    from mlxcache.cache.disk import DiskTier

    folder = tmp_path / "model"
    folder.mkdir()
    _word_tokenizer(folder / "tokenizer.json")
    disk = DiskTier(tmp_path / "cache" / "kv")
    disk.name_namespace("ns", "wordy", str(folder), 4)
    tokens = np.array([2, 0, 1, 2], dtype=np.int32)
    disk.add_entry("ns", tokens, True, {"b1": lambda path: path.write_bytes(b"kv")}, 2)
    disk.close()
    from mlxcache.cache import manage

    [row] = manage.entries(tmp_path / "cache", preview_tokens=3)
    assert (row["model"], row["tokens"], row["preview"]) == ("wordy", 4, "hello big world")
    result = _imports(tmp_path, ["cache", "ls", "--cache-dir", str(tmp_path / "cache")])
    assert result == {"code": 0, "heavy": sorted(NEEDS["cache ls"])}


def _word_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"hello": 0, "big": 1, "world": 2, "[UNK]": 3}, "[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece()
    tok.save(str(path))


def test_library_api_is_imported_on_first_use(tmp_path: Path) -> None:
    code = (
        "import sys, mlxcache\n"
        "assert 'mlxcache.engine' not in sys.modules and 'mlx_lm' not in sys.modules\n"
        "from mlxcache import CacheConfig, Engine, Request, SamplingParams, open_engine\n"
        "import mlxcache.engine, mlxcache.runtime\n"
        "assert Request is mlxcache.engine.Request and open_engine is mlxcache.runtime.open_engine\n"
        "assert 'open_engine' in dir(mlxcache)\n"
        "try:\n    mlxcache.nothing\nexcept AttributeError as exc:\n    print(exc)\n"
    )
    assert _python(code) == "module 'mlxcache' has no attribute 'nothing'\n"


def _params() -> list[tuple[str, Any, Any]]:
    """(command path, click command, parameter) of every parameter of the app."""
    out = []

    def walk(cmd: Any, path: str) -> None:
        out.extend((path, cmd, p) for p in cmd.params)
        for name, sub in getattr(cmd, "commands", {}).items():
            walk(sub, f"{path} {name}")

    walk(typer.main.get_command(app), "mlxcache")
    return out


TEXTS = [None, "", "5", "-3", "0.5", "x", "a/b", "~/x", "1e3"]
TEXTS += ["+4", "007", "-0", "1.", ".5", "-.5e-2", "1E+2", "\u0663", "1_000", " 4", "4 "]
TEXTS += ["inf", "nan", "0x10", "1e999", "9" * 30, "1.5.2", "--3", "+"]
SAMPLES = [*TEXTS, ["a", "b"], (), ("c",), 7, 2.5, True]


def _outcome(runtime: Any, value: Any, param: Any, ctx: Context) -> Any:
    try:
        return ("ok", type(runtime.coerce(value, param=param, ctx=ctx)).__name__, repr(value))
    except Exception as exc:
        return ("error", type(exc).__name__, str(exc))


def test_coercion_fast_path_gives_what_typer_gives() -> None:
    """Every parameter of every command, over values of every kind: the fast path returns
    what Typer's own (pydantic) coercion returns, and fails where it fails, with its words."""
    from typer._coercion import build_runtime_param

    checked = 0
    for _path, cmd, param in _params():
        ctx = Context(cmd)
        holder = SimpleNamespace(_runtime_param=None, type_descriptor=param.type_descriptor)
        fast = coerce._runtime_param(holder)
        slow = build_runtime_param(param.type_descriptor)
        for value in [param.default, *SAMPLES]:
            want, got = _outcome(slow, value, param, ctx), _outcome(fast, value, param, ctx)
            if want[0] == "ok":
                # repr: nan is not equal to itself
                got_value, want_value = (
                    fast.coerce(value, param, ctx),
                    slow.coerce(value, param, ctx),
                )
                assert repr(got_value) == repr(want_value), (param.name, value)
            assert got == want, (param.name, value)
            checked += 1
    assert checked > 500


def test_failed_goals_reads_every_benchmark_shape() -> None:
    assert bench.failed_goals({"pass": True, "goals": {"a": True}}) == []
    assert bench.failed_goals(
        {"pass": False, "goals": {"a": True, "b": False}, "decode": {"ratio_pass": False}}
    ) == ["pass", "goals.b", "decode.ratio_pass"]
    assert bench.failed_goals({"goals_pass": False, "n": 0}) == ["goals_pass"]


def test_bench_report_is_json_and_exits_1_on_a_failed_goal(
    capsys: pytest.CaptureFixture[str],
) -> None:
    bench._report({"bench": "x", "ratio": 1.5, "pass": True})
    out, err = capsys.readouterr()
    assert (out, err) == (
        '{"bench": "x", "ratio": 1.5, "pass": true}\n',
        "bench x: every goal met\n",
    )
    with pytest.raises(typer.Exit) as stop:
        bench._report({"bench": "x", "goals": {"fast": False}, "pass": False})
    out, err = capsys.readouterr()
    assert stop.value.exit_code == 1
    assert out == '{"bench": "x", "goals": {"fast": false}, "pass": false}\n'
    assert err == "error: bench x: goal not met: goals.fast, pass\n"
    with pytest.raises(typer.Exit):  # a bench that says what failed is quoted
        bench._report({"bench": "x", "failures": ["a: 0.3 < 0.5", "b differs"], "pass": False})
    assert capsys.readouterr().err == "error: bench x: goal not met: a: 0.3 < 0.5; b differs\n"


def test_startup_bench_reports_ratios_and_goals(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The benchmark's shape (no time is asserted): commands swapped for trivial ones."""
    fast = [sys.executable, "-c", "pass"]
    slow = [sys.executable, "-c", "import time; time.sleep(0.6)"]
    monkeypatch.setattr(startup_bench, "commands", lambda _s, _c: {"a": fast, "b": slow})
    result = startup_bench.run(1, tmp_path)
    assert set(result) == {"bench", "rounds", "python_s", "commands", "goals", "pass"}
    assert set(result["commands"]) == {"a", "b"}
    assert set(result["commands"]["a"]) == {"min_s", "median_s", "cpu_s", "ratio"}
    assert result["goals"]["b_le_0.5s"] is False and result["pass"] is False


MODEL_COMMANDS = [
    ["generate", "hi"],
    ["json", "hi"],
    ["tools", "--tools", "[]", "hi"],
    ["chat"],
    ["serve"],
    ["models", "info"],
    *(
        ["bench", name]
        for name in (
            *("decode", "chunks", "chat", "json", "resume", "serve", "reuse"),
            *("distributed", "spec", "agent", "memory", "startup"),
        )
    ),
]


DRAFTING = [c for c in MODEL_COMMANDS if c[0] not in ("models", "bench") or c[1] == "spec"]
"""The commands that take --draft-model."""


@pytest.mark.parametrize(
    ("command", "flag"),
    [*((c, "-m") for c in MODEL_COMMANDS), *((c, "--draft-model") for c in DRAFTING)],
    ids=lambda v: " ".join(v) if isinstance(v, list) else v,
)
def test_a_missing_model_is_refused_before_any_work(
    tmp_path: Path, command: list[str], flag: str
) -> None:
    """A model path that names nothing is refused before the command imports model code
    or runs anything: at once, in one line (issue 53, item 16; issue 55, item 3)."""
    for missing in (tmp_path / "nope.gguf", tmp_path / "nope"):
        result = _imports(tmp_path, [*command, flag, str(missing)])
        assert result == {"code": 2, "heavy": ["rich"]}


@pytest.mark.parametrize("command", [["generate", "hi"], ["json", "hi"], ["serve"]], ids=" ".join)
def test_a_missing_adapter_is_refused_before_any_work(tmp_path: Path, command: list[str]) -> None:
    """An adapter folder that is missing or has no config is one line before any model code."""
    (tmp_path / "empty").mkdir()
    for missing in (tmp_path / "nope", tmp_path / "empty"):
        assert _imports(tmp_path, [*command, "--adapter", str(missing)]) == {
            "code": 2,
            "heavy": ["rich"],
        }


@pytest.mark.parametrize(
    "command", [["generate", "hi"], ["serve"], ["bench", "memory"]], ids=" ".join
)
def test_a_memory_limit_of_0_is_refused_before_any_work(tmp_path: Path, command: list[str]) -> None:
    """--mem-limit 0 would mean no limit: refused in one line (issue 53, item 16)."""
    assert _imports(tmp_path, [*command, "--mem-limit", "0"]) == {"code": 2, "heavy": ["rich"]}
    done = subprocess.run(
        [sys.executable, "-m", "mlxcache_cli", *command, "--mem-limit", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == "error: --mem-limit must be above 0 (leave it out for no limit)\n"


# Runs the CLI as the `mlxcache` script does, noting whose parameters Typer read (the
# commands it built); then prints those, the packages outside the standard library and
# the modules of mlxcache and the CLI it imported, and the standard modules among WATCHED.
_GRAPH_CHILD = """
import json, sys, contextlib, io
import typer.main
read, get = [], typer.main.get_params_from_function
def spy(fn):
    read.append(fn.__name__)
    return get(fn)
typer.main.get_params_from_function = spy
out, sys.argv = sys.argv[1], ["mlxcache", *sys.argv[2:]]
from mlxcache_cli.main import app
with contextlib.redirect_stdout(io.StringIO()):
    try:
        app()
    except SystemExit as exc:
        code = exc.code
top = {m.split(".")[0] for m in sys.modules}
packages = sorted(top - set(sys.stdlib_module_names) - {"__main__"})
ours = sorted(m for m in sys.modules if m.startswith("mlxcache"))
watched = sorted(top & set(json.loads(out)[1]))
open(json.loads(out)[0], "w").write(json.dumps([code, read, packages, ours, watched]))
"""
WATCHED = ("socket", "ssl", "http", "asyncio", "sqlite3", "multiprocessing", "email", "xml")
"""Standard modules a command that needs no network, cache or server must not import."""
INSTALL = {"_distutils_hack", "__editable___mlxcache_0_1_0_finder"}
"""What an editable install's .pth files import in every process (not the CLI's doing)."""
HELP_LIBRARY = ["mlxcache", "mlxcache.config", "mlxcache.errors", "mlxcache.launch"]
HELP_LIBRARY += ["mlxcache.paths", "mlxcache.regress", "mlxcache.request_settings"]
APP_ITSELF = {"main", "_version", "install_callback", "show_callback"}
"""The functions whose parameters the app's own options come from (--debug, --version,
Typer's completion options)."""
CLI_MODULES = sorted(
    f"mlxcache_cli.{p.stem}"
    for p in Path(startup_bench.__file__).parent.glob("*.py")
    # startup_bench: run by `bench startup`; reference: the docs' CLI reference, not the app's
    if p.stem not in ("__init__", "__main__", "startup_bench", "reference")
)


def _graph(tmp_path: Path, args: list[str]) -> list[Any]:
    report = tmp_path / "graph.json"
    spec = json.dumps([str(report), list(WATCHED)])
    subprocess.run(
        [sys.executable, "-c", _GRAPH_CHILD, spec, *args],
        capture_output=True,
        check=False,
        timeout=120,
    )
    found: list[Any] = json.loads(report.read_text())
    found[2] = [p for p in found[2] if p not in INSTALL]
    return found


def test_help_imports_and_builds_only_what_it_draws(tmp_path: Path) -> None:
    """The whole import graph of `mlxcache --help`, so that it cannot creep: the packages
    (Typer and Rich only), the library's modules (errors, settings and paths), the CLI's
    modules (every command's, for their names and help), no network or database module;
    and Typer reads no command's parameters (each command is built when used: `lazycmd`)."""
    code, read, packages, ours, watched = _graph(tmp_path, ["--help"])
    assert (code, set(read), watched) == (0, APP_ITSELF, [])
    assert packages == ["annotated_doc", "mlxcache", "mlxcache_cli", "rich", "shellingham", "typer"]
    assert ours == sorted([*HELP_LIBRARY, "mlxcache_cli", *CLI_MODULES])


def test_a_command_builds_only_itself(tmp_path: Path) -> None:
    schema = tmp_path / "schema.json"
    schema.write_text('{"type": "object"}')
    code, read, *_ = _graph(tmp_path, ["json", "--check", "--schema", str(schema)])
    assert (code, set(read)) == (0, {*APP_ITSELF, "json_cmd"})


def test_one_shot_times_cached_commands_against_mlx_lm(
    wide_gguf: Path, cache_root: Path, tmp_path: Path
) -> None:
    """`bench startup --one-shot`: generate and json, each after an untimed first run that
    cached the prompt, and mlx_lm.generate on the same prompt, each command completing."""
    from mlxcache.model.loader import model_folder

    folder = model_folder(str(wide_gguf), cache_root)
    result = startup_bench.one_shot(1, folder, tmp_path)
    assert result["prompt_tokens"] == 2294  # the tiny model's tokens are characters
    walls = result["min_s"]
    assert sorted(walls) == ["generate", "json", "mlx_lm.generate"]
    ratios = {name: walls[name] / walls["mlx_lm.generate"] for name in ("generate", "json")}
    assert result["ratio_to_mlx_lm"] == pytest.approx(ratios, abs=0.01)  # of rounded times
    assert sorted(result["goals"]) == ["generate_le_0.5x", "json_le_0.5x"]


@pytest.mark.parametrize("bench", ["spec", "memory"])
def test_a_bad_bench_suite_is_refused_before_any_work(tmp_path: Path, bench: str) -> None:
    """A --suite that is missing or not a suite is one line at once: the bench runs none
    of its workloads first (issue 53, item 16)."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("cases: 3\n")
    for suite, said in ((tmp_path / "nope.yaml", "cannot read suite"), (bad, str(bad))):
        done = subprocess.run(
            [sys.executable, "-m", "mlxcache_cli", "bench", bench, "--suite", str(suite)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert (done.returncode, done.stdout) == (2, ""), done.stderr
        assert len(done.stderr.splitlines()) == 1 and said in done.stderr, done.stderr
