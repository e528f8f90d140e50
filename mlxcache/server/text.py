"""The content of a tool reply as the client sees it while it streams.

A tool reply's content is its text with the calls taken out, stripped. Streaming sends
`safe()` as it grows: text before the call tag, without leading whitespace, holding back
trailing whitespace and anything that may begin the tag. `safe()` is always a prefix of
the finished reply's content, so the streamed deltas join to exactly that content.
(Stop strings are cut by the engine before the text gets here.)
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
        call_tag: where tool calls start (text from it on is never streamed as content);
            None for a reply whose whole text is content.
        strip: the final content is stripped (tool replies), so stream it stripped too.
    """

    def __init__(self, call_tag: str | None = None, strip: bool = False) -> None:
        self.call_tag = call_tag
        self.strip = strip
        self.text = ""

    def add(self, piece: str) -> None:
        self.text += piece

    def safe(self) -> str:
        """The content that no later piece can change."""
        text = self.text
        if self.call_tag is not None:
            cut = text.find(self.call_tag)
            text = text[:cut] if cut >= 0 else text[: len(text) - _held(text, self.call_tag)]
        # Stripped content: leading whitespace never shows, trailing waits for more text.
        return text.strip() if self.strip else text
