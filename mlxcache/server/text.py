"""A reply's content and reasoning as the client sees them while they stream.

A reasoning model's thinking section (`<think>...</think>`, opened by the reply or by the
prompt) is the reply's `reasoning`, stripped; the text after it is the content. A tool
reply's content is its text with the calls taken out, stripped. Streaming sends `safe()`
and `safe_reasoning()` as they grow, holding back trailing whitespace and anything that
may begin a tag; each is always a prefix of the finished reply's value, so the streamed
deltas join to exactly that. (Stop strings are cut by the engine before the text gets
here.)
"""

from __future__ import annotations

from mlxcache.modes.reasoning import Thinking, split_reply
from mlxcache.stops import held


class ReplyText:
    """Accumulates a reply's pieces.

    Args:
        call_tag: where tool calls start (text from it on is never streamed as content);
            None for a reply whose whole text is content.
        strip: the final content is stripped (tool replies), so stream it stripped too.
        thinking: the model's thinking section, its text streamed as reasoning.
    """

    def __init__(
        self, call_tag: str | None = None, strip: bool = False, thinking: Thinking | None = None
    ) -> None:
        self.call_tag = call_tag
        self.strip = strip
        self.thinking = thinking
        self.text = ""

    def add(self, piece: str) -> None:
        self.text += piece

    def safe_reasoning(self) -> str:
        """The reasoning that no later piece can change."""
        return split_reply(self.thinking, self.text, final=False)[0] or ""

    def safe(self) -> str:
        """The content that no later piece can change."""
        text = split_reply(self.thinking, self.text, final=False)[1]
        if self.call_tag is not None:
            cut = text.find(self.call_tag)
            text = text[:cut] if cut >= 0 else text[: len(text) - held(text, self.call_tag)]
        # Stripped content: leading whitespace never shows, trailing waits for more text.
        return text.strip() if self.strip else text
