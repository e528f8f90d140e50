"""The docs' examples: every shell and Python block of README.md and docs/ runs as written
(the tests marked model, on the embedded SmolLM2 with short replies), or is marked with what
this machine lacks and checked for syntax; the CLI reference covers every command.

A block is marked by an HTML comment on the line before its fence:
`<!-- example: not run (REASON) -->` (syntax only), or `<!-- example: server -->` (each line
starts a server, which must answer /health and stop cleanly on Ctrl-C).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from tinymodel import write_tiny_gguf

from mlxcache_cli.reference import render

ROOT = Path(__file__).resolve().parent.parent
# The README first (as a reader starts); the cache page clears the cache (converted models
# too), so it runs last.
PAGES = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("*.md"), key=lambda p: (p.name == "cache.md", p.name)),
]
FENCE = re.compile(
    r"^(?:<!-- example: (?P<mark>.*?) -->\n)?```(?P<lang>[\w-]*)\n(?P<body>.*?)^```[ \t]*$",
    re.MULTILINE | re.DOTALL,
)
NOT_RUN = re.compile(r"not run \((?P<reason>.+)\)")
RUN_LANGS = {"sh", "python"}
OTHER_NAMES = {"bash", "shell", "console", "zsh", "py", "python3", "pycon"}
"""Language names of shell or Python blocks spelled otherwise: refused, so none escapes."""
GGUF = re.compile(r"(?<![\w/.~-])((?:~/|\./)?[\w./-]*\.gguf)\b")
OUTPUT = re.compile(r"^# (\{.*\}|\w+\(.*\))$", re.MULTILINE)
"""A comment that shows a command's output: a JSON object or a call (without `...`)."""
PORT = "8080"

# Replies are kept short: generate and chat get -n 4, json and tools -n 32 (enough for the
# examples' bounded schemas), given after the block's own options so that they win. A script
# (not a shell function) so that `mlxcache serve &` and `kill %1` reach the server itself.
WRAPPER = """#!/usr/bin/env bash
case "${{1-}}" in
  generate|chat) exec {real} "$@" -n 4 ;;
  json|tools) exec {real} "$@" -n 32 ;;
  *) exec {real} "$@" ;;
esac
"""


@dataclass(frozen=True)
class Block:
    page: Path
    line: int
    lang: str
    body: str
    mark: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    @property
    def runs(self) -> bool:
        return self.lang in RUN_LANGS and not self.mark.startswith("not run")


def blocks(page: Path) -> list[Block]:
    text = page.read_text()
    return [
        Block(
            page,
            text.count("\n", 0, match.start("body")),
            match["lang"],
            match["body"],
            match["mark"] or "",
        )
        for match in FENCE.finditer(text)
    ]


def every_block() -> list[Block]:
    return [block for page in PAGES for block in blocks(page)]


# --- without a model: every block is run or marked, and parses --------------------------


def test_every_shell_or_python_block_is_seen() -> None:
    for block in every_block():
        assert block.lang not in OTHER_NAMES, f"{block.where}: write ```sh or ```python"
        if not block.lang:
            commands = [line for line in block.body.splitlines() if line.startswith("mlxcache ")]
            assert not commands, f"{block.where}: a command in a block without a language"


def test_marks_are_known_and_give_a_reason() -> None:
    for block in every_block():
        if block.mark:
            assert block.lang in RUN_LANGS, f"{block.where}: a mark on a {block.lang!r} block"
            reason = NOT_RUN.fullmatch(block.mark)
            assert block.mark == "server" or reason, f"{block.where}: unknown mark {block.mark!r}"


def test_every_block_parses() -> None:
    for block in every_block():
        if block.lang == "sh":
            out = subprocess.run(["bash", "-n"], input=block.body, capture_output=True, text=True)
            assert out.returncode == 0, f"{block.where}: {out.stderr}"
        elif block.lang == "python":
            compile(block.body, block.where, "exec")


def test_example_files_ship_and_goldens_stay() -> None:
    """Every examples/ file a block names is in the repository, and no block writes there."""
    for block in every_block():
        for name in re.findall(r"examples/[\w./-]+", block.body):
            assert (ROOT / name).exists(), f"{block.where}: {name} is not shipped"
        assert not re.search(r"(-o|--output|>)\s*examples/", block.body), block.where


def test_the_marking_is_read() -> None:
    """The parser sees a marked block, an unmarked one and the languages as written."""
    page = ROOT / "README.md"
    found = blocks(page)
    assert any(b.mark.startswith("not run (") for b in found)
    assert any(b.lang == "python" and b.runs for b in found)
    assert all(b.body.endswith("\n") for b in found)


def test_cli_reference_covers_every_command() -> None:
    import typer.main

    from mlxcache_cli.main import app

    reference = render()
    root = typer.main.get_command(app)
    ctx = root.make_context("mlxcache", [], resilient_parsing=True)
    for name in root.list_commands(ctx):
        assert f"\n### `mlxcache {name}`\n" in reference
        group = root.get_command(ctx, name)
        for sub in getattr(group, "commands", {}):
            assert f"\n#### `mlxcache {name} {sub}`\n" in reference
    # options as -h shows them, defaults included
    assert "| `-n, --max-tokens N` | Most tokens to generate. [default: 256] |" in reference
    assert "mlxcache regress record examples/quick.yaml -o quick.golden.json" in reference


# --- with the model: the blocks run ------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Sandbox:
    """A clone's root as a reader has it: examples/ and the venv's commands, its own cache,
    data and home directories, and a tiny model wherever a block names a .gguf file."""

    root: Path
    env: dict[str, str]
    logs: Path

    def run(
        self, args: list[str], script: str, timeout: float = 900
    ) -> subprocess.CompletedProcess[str]:
        """`script` run by `args`; its output read from files, so that a server it left
        running (ended here, with its group) cannot hold the test up."""
        out, err = self.logs / "stdout", self.logs / "stderr"
        with out.open("w") as stdout, err.open("w") as stderr:
            proc = subprocess.Popen(
                [*args, script],
                cwd=self.root,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=stdout,
                stderr=stderr,
                text=True,
                start_new_session=True,
            )
            try:
                proc.wait(timeout=timeout)
            finally:
                stop_group(proc)
        return subprocess.CompletedProcess(args, proc.returncode, out.read_text(), err.read_text())


def stop_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):  # already gone
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory: pytest.TempPathFactory) -> Sandbox:
    root = tmp_path_factory.mktemp("clone")
    shutil.copytree(ROOT / "examples", root / "examples")
    home = root / "home"
    home.mkdir()
    for block in every_block():
        if block.runs:
            for name in GGUF.findall(block.body):
                path = home / name[2:] if name.startswith("~/") else root / name
                if not path.exists():
                    path.parent.mkdir(parents=True, exist_ok=True)
                    write_tiny_gguf(path)
    bin_dir = tmp_path_factory.mktemp("bin")
    wrapper = bin_dir / "mlxcache"
    wrapper.write_text(WRAPPER.format(real=Path(sys.executable).parent / "mlxcache"))
    wrapper.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLXCACHE_")}
    env |= {
        "HOME": str(home),
        "MLXCACHE_CACHE_DIR": str(root / "cache"),
        "MLXCACHE_DATA_DIR": str(root / "data"),
        "PATH": os.pathsep.join([str(bin_dir), str(Path(sys.executable).parent), env["PATH"]]),
    }
    return Sandbox(root, env, tmp_path_factory.mktemp("logs"))


def wait_healthy(port: int, proc: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[1]
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
                return
        except OSError:
            time.sleep(0.5)
    raise AssertionError(f"no server on port {port} after {timeout} s")


def serve(sandbox: Sandbox, command: str, port: int) -> subprocess.Popen:
    """`command` (a `mlxcache serve` line) on `port`, as a process of its own group."""
    if "--port" in command:
        command = re.sub(r"--port \d+", f"--port {port}", command)
    else:
        command = command.split("#")[0].rstrip() + f" --port {port}"
    proc = subprocess.Popen(
        ["bash", "-c", f"exec {command}"],
        cwd=sandbox.root,
        env=sandbox.env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        wait_healthy(port, proc)
    except BaseException:
        stop_group(proc)
        raise
    return proc


@pytest.fixture(scope="module")
def shared_server(sandbox: Sandbox) -> Iterator[int]:
    """The server that blocks reaching 127.0.0.1:8080 without starting one talk to."""
    port = free_port()
    proc = serve(sandbox, "mlxcache serve", port)
    try:
        yield port
    finally:
        stop_group(proc)


def run_servers(sandbox: Sandbox, block: Block) -> None:
    for line in block.body.splitlines():
        if line.strip() and not line.startswith("#"):
            proc = serve(sandbox, line, free_port())
            try:
                proc.send_signal(signal.SIGINT)  # as Ctrl-C: drains and exits 0
                _, err = proc.communicate(timeout=60)
                assert proc.returncode == 0, f"{block.where}: {line}\n{err}"
            finally:
                stop_group(proc)


def run_block(sandbox: Sandbox, block: Block, request: pytest.FixtureRequest) -> None:
    body = block.body
    if PORT in body:  # a block starting its own server gets a free port, others the shared one
        own = re.search(r"^mlxcache serve\b", body, re.MULTILINE) is not None
        port = free_port() if own else request.getfixturevalue("shared_server")
        body = body.replace(PORT, str(port))
    if block.lang == "sh":
        out = sandbox.run(["bash", "-c"], "set -euo pipefail\n" + body)
    else:
        out = sandbox.run([sys.executable, "-c"], body)
    assert out.returncode == 0, f"{block.where}: exit {out.returncode}\n{out.stdout}\n{out.stderr}"
    for shown in OUTPUT.findall(body):
        if "..." not in shown and "…" not in shown:
            assert shown in out.stdout, f"{block.where}: {shown!r} not in\n{out.stdout}"


@pytest.mark.model
def test_examples_run(sandbox: Sandbox, request: pytest.FixtureRequest) -> None:
    """Every page's blocks in order, in one clone (a later block may use an earlier one's
    files); a block written twice (the README repeats a guide's) runs once."""
    seen: set[tuple[str, str]] = set()
    for page in PAGES:
        for block in blocks(page):
            if (block.lang, block.body) in seen:
                continue
            seen.add((block.lang, block.body))
            if block.mark == "server":
                run_servers(sandbox, block)
            elif block.runs:
                run_block(sandbox, block, request)
