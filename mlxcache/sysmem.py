"""Handing memory the process no longer uses back to the system.

MLX keeps freed buffers for reuse (its buffer cache), and glibc's malloc keeps freed heap
memory in its arenas (one per thread that allocated), so a server's resident size stays
at the largest working set it has seen (a batch's prefill, a burst of requests) long
after it is idle: gigabytes beside a model of a hundred megabytes.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable
from functools import cache

import mlx.core as mx


@cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's `malloc_trim`, or None (macOS, musl: no such call)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        trim: Callable[[int], int] = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    return trim


def release_unused() -> None:
    """Free MLX's buffer cache, then what the C heap holds free (every arena)."""
    mx.clear_cache()
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
