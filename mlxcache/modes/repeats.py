"""Spotting a reply stuck in a loop, to say so when it runs into the token limit."""

from __future__ import annotations

import json

MAX_UNIT = 120
"""Longest repeated piece looked for, in characters."""
MIN_TIMES = 4
MIN_SPAN = 40


def repeating(text: str) -> tuple[str, int] | None:
    """The piece `text` ends by repeating (at least 4 times over 40 characters) and how
    many whole times, the shortest such piece; None when its end is not a loop.

    A cut-off reply stops inside the piece, so the loop may end with part of it.
    """
    n = len(text)
    for period in range(1, min(MAX_UNIT, n // MIN_TIMES) + 1):
        j = n - 1
        while j >= period and text[j] == text[j - period]:
            j -= 1
        span = n - 1 - j + period  # the characters that repeat with this period, at the end
        times = span // period
        if times >= MIN_TIMES and span >= MIN_SPAN:
            start = n - span
            return text[start : start + period], times
    return None


def describe_loop(text: str) -> str:
    """`; it was repeating "..." (N times)` for a reply that ends in a loop, else ''."""
    found = repeating(text)
    if found is None:
        return ""
    piece, times = found
    shown = json.dumps(piece if len(piece) <= 60 else piece[:57] + "...", ensure_ascii=False)
    return f"; it was repeating {shown} ({times} times)"
