"""`mlxcache serve` in a child process on 127.0.0.1 and a free port, always stopped."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

READY = re.compile(r"mlxcache: serving (\S+) on (http://\S+)")
START_LIMIT_S = 300  # a bound on startup (model load), not a timing assumption


class ServerProcess:
    """A running server; `lines` collects its stderr (one line per request)."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlxcache_cli", "serve", "--port", "0", *args],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.lines: list[str] = []
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        match = self.wait_for(READY)
        self.model, self.url = match.group(1), match.group(2)

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            with self._changed:
                self.lines.append(line.rstrip("\n"))
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    def wait_for(self, pattern: re.Pattern[str]) -> re.Match[str]:
        """The first stderr line matching `pattern` (waits for it; fails if the server exits)."""
        with self._changed:
            while True:
                for line in self.lines:
                    match = pattern.search(line)
                    if match:
                        return match
                if self.proc.poll() is not None and not self._reader.is_alive():
                    raise AssertionError("server exited:\n" + "\n".join(self.lines))
                if not self._changed.wait(START_LIMIT_S):
                    raise AssertionError("no such line:\n" + "\n".join(self.lines))

    def stop(self) -> int:
        """SIGTERM (drain), then the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(START_LIMIT_S)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            self._reader.join()


@contextmanager
def running(model: Path, *args: str, env: dict[str, str] | None = None) -> Iterator[ServerProcess]:
    server = ServerProcess(["--model", str(model), *args], {**os.environ, **(env or {})})
    try:
        yield server
    finally:
        server.stop()
