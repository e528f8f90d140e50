"""Launched ranks: whether a launcher (`mlx.launch`, `mpirun`) started this process (read
from the environment without importing MLX: the CLI asks as it registers its
commands), and local ranks started as `mlx.launch` would (tests and `bench distributed`)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import subprocess

_RANK_VARS = ("MLX_RANK", "OMPI_COMM_WORLD_RANK")  # set by mlx.launch (ring, jaccl) and mpirun


def launched_rank() -> int | None:
    """This process's rank when a launcher started it, else None."""
    for name in _RANK_VARS:
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return None


def following() -> bool:
    """A rank other than 0 of a launched run (rank 0 runs the command; this rank follows)."""
    return launched_rank() not in (None, 0)


def local_ranks(
    argv: list[str],
    size: int,
    hostfile: Path,
    envs: list[dict[str, str]] | None = None,
    **popen: Any,
) -> list[subprocess.Popen[str]]:
    """Start `argv` as `size` ranks on this machine, joined by MLX's ring backend over
    loopback (what `mlx.launch -n size --backend ring` does), and return them, rank 0
    first. `hostfile` is written with free ports; `envs[r]` is added to rank r's
    environment. The caller waits for (or kills) every process."""
    # Here: every command imports this module (`following`), and `--help` needs none of it.
    import json
    import socket
    import subprocess

    ports = []
    for _ in range(size):  # each bound apart, so the ports differ; freed for the ranks
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            ports.append(sock.getsockname()[1])
    hostfile.write_text(json.dumps([[f"127.0.0.1:{port}"] for port in ports]))
    procs: list[subprocess.Popen[str]] = []
    for rank in range(size):
        extra = envs[rank] if envs else {}
        env = {**os.environ, **extra, "MLX_RANK": str(rank), "MLX_HOSTFILE": str(hostfile)}
        procs.append(subprocess.Popen(argv, env=env, text=True, **popen))
    return procs
