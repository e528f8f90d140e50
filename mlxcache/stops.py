"""Stop strings over streamed text: hold back what may begin a stop, cut at the first one."""

from __future__ import annotations

from collections.abc import Sequence


def partial_marker(text: str, marker: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `marker`: what more
    text may still turn into `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


class StopScanner:
    """Filters streamed text pieces so that no stop string (nor the text after it) is emitted.

    Text that could be the start of a stop string is held back until the next piece
    decides it; `flush()` releases it at the end of the reply.
    """

    __slots__ = ("_sent", "_stops", "_text", "matched", "stopped")

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = [s for s in stops if s]
        self._text = ""
        self._sent = 0  # characters of _text already emitted
        self.stopped = False
        self.matched: str | None = None
        """The stop string that ended the reply."""

    def _held(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop."""
        return max((partial_marker(self._text, stop) for stop in self._stops), default=0)

    def feed(self, piece: str) -> str:
        """Add a piece of reply text; return the text that is safe to emit now."""
        if self.stopped:
            return ""
        if not self._stops:
            return piece
        # A stop may begin in text held back earlier, never before it.
        start = self._sent
        self._text += piece
        # The first stop to appear ends the reply (what one more token at a time would
        # see): the earliest end, then the longest stop ending there.
        hits = [(i + len(s), i, s) for s in self._stops if (i := self._text.find(s, start)) >= 0]
        if hits:
            _, end, self.matched = min(hits)
            self.stopped = True
        else:
            end = max(self._sent, len(self._text) - self._held())
        out = self._text[self._sent : end]
        self._sent = end
        return out

    def flush(self) -> str:
        """The text still held back (none after a stop)."""
        if self.stopped:
            return ""
        out = self._text[self._sent :]
        self._sent = len(self._text)
        return out
