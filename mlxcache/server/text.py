"""The reply text as the client sees it: cut at stop strings, tool calls held back.

Streaming sends `safe()` as it grows; the finished reply's content is computed from the
whole text. `safe()` is always a prefix of that content, so the streamed deltas join to
exactly the non-streamed content.
"""

from __future__ import annotations


def _held(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


class ReplyText:
    """Accumulates a reply's pieces.

    Args:
        stops: strings that end the reply (not included in it).
        call_tag: where tool calls start (text from it on is never streamed as content);
            None for replies without tools.
        strip: the final content is stripped (tool replies), so stream it stripped too.
    """

    def __init__(self, stops: list[str], call_tag: str | None = None, strip: bool = False) -> None:
        self.stops = stops
        self.call_tag = call_tag
        self.strip = strip
        self.text = ""
        self.stopped = False

    def add(self, piece: str) -> bool:
        """Append a piece; True when it completed a stop string (the text is then final)."""
        if self.stopped:
            return True
        self.text += piece
        # A stop string may straddle pieces: search the tail that could contain a new one.
        start = max(0, len(self.text) - len(piece) - max(map(len, self.stops), default=0))
        hits = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True
        return self.stopped

    def safe(self) -> str:
        """The content that no later piece can change."""
        text = self.text
        if not self.stopped:
            text = text[: len(text) - max((_held(text, s) for s in self.stops), default=0)]
        if self.call_tag is not None:
            cut = text.find(self.call_tag)
            text = text[:cut] if cut >= 0 else text[: len(text) - _held(text, self.call_tag)]
        if self.strip:
            text = text.lstrip()
            # Trailing whitespace may be stripped from the final content, so it waits.
            text = text.rstrip()
        return text
