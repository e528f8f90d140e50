"""An HTTP server in a child process (`mlxcache serve`, or another for comparison), always
stopped: used by the server tests and `mlxcache bench serve`."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

SERVING = re.compile(r"mlxcache: serving (\S+) on (http://\S+)")
"""The line `mlxcache serve` prints on stderr once it accepts connections."""

WAIT_LIMIT_S = 600.0
"""A bound on waiting for a line (model load, a drain), not a timing assumption."""


class ChildServer:
    """A child process whose stderr lines are collected as they come.

    Args:
        argv: the command.
        ready: a pattern of the stderr line that says the server accepts connections.
        env: the child's environment (default: ours).
    """

    def __init__(
        self, argv: Sequence[str], ready: re.Pattern[str], env: dict[str, str] | None = None
    ) -> None:
        self.proc = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.lines: list[str] = []
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        try:
            self.ready = self.wait_for(ready)
        except BaseException:
            self.stop()
            raise

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            with self._changed:
                self.lines.append(line.rstrip("\n"))
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    def wait_for(self, pattern: re.Pattern[str]) -> re.Match[str]:
        """The first stderr line matching `pattern`, waiting for it.

        Raises:
            RuntimeError: the process ended (or WAIT_LIMIT_S passed) without such a line.
        """
        with self._changed:
            while True:
                for line in self.lines:
                    match = pattern.search(line)
                    if match:
                        return match
                if not self._reader.is_alive():
                    raise RuntimeError("the server exited:\n" + "\n".join(self.lines[-20:]))
                if not self._changed.wait(WAIT_LIMIT_S):
                    raise RuntimeError(f"no line matching {pattern.pattern!r} on stderr")

    def stop(self) -> int:
        """SIGTERM (a server drains), wait, and return the exit code (killed if stuck)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(WAIT_LIMIT_S)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            self._reader.join()


class MlxcacheServer(ChildServer):
    """`mlxcache serve ARGS` on 127.0.0.1 and a free port; `url` and `model` once ready."""

    def __init__(self, args: Sequence[str], env: dict[str, str] | None = None) -> None:
        argv = [sys.executable, "-m", "mlxcache_cli", "serve", "--port", "0", *args]
        super().__init__(argv, SERVING, env)
        self.model, self.url = self.ready.group(1), self.ready.group(2)


@contextmanager
def running(
    model: Path | str, *args: str, env: dict[str, str] | None = None
) -> Iterator[MlxcacheServer]:
    """`mlxcache serve --model MODEL ARGS`, stopped when the block ends."""
    server = MlxcacheServer(["--model", str(model), *args], {**os.environ, **(env or {})})
    try:
        yield server
    finally:
        server.stop()


def free_port() -> int:
    """A port free on 127.0.0.1 now (for servers that cannot bind port 0 and report it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
