"""A reply's content and reasoning as the client sees them while they stream.

A reasoning model's thinking section (`<think>...</think>`, opened by the reply or by the
prompt) is the reply's `reasoning`, stripped; the text after it is the content. A tool
reply's content is its text with the calls taken out, stripped. Streaming sends what
`ReplyText.add` says became final with each piece, holding back trailing whitespace and
anything that may begin a tag; what was sent is always a prefix of the finished reply's
value, so the streamed deltas join to exactly that. (Stop strings are cut by the engine before the text gets
here.)
"""

from __future__ import annotations

from mlxcache.modes.call_stream import CallDelta, CallStream
from mlxcache.modes.reasoning import Thinking
from mlxcache.stops import partial_marker


class _Strip:
    """Streams `str.strip()` of a text that arrives in pieces: leading whitespace dropped
    (`lead`), trailing whitespace held back until more text follows it (`trail`). Each
    character is looked at a bounded number of times, however long the text grows."""

    def __init__(self, lead: bool, trail: bool) -> None:
        self._lead = lead
        self._trail = trail
        self._spaces: list[str] = []  # trailing whitespace held back

    def __call__(self, piece: str) -> str:
        if self._lead:
            piece = piece.lstrip()
            if not piece:
                return ""
            self._lead = False
        if not self._trail:
            return piece
        body = piece.rstrip()
        if not body:
            self._spaces.append(piece)
            return ""
        out = "".join(self._spaces) + body
        self._spaces = [piece[len(body) :]]
        return out


class _Until:
    """Streams a text up to the first `tag`, holding back a tail that may begin it: only
    that tail (shorter than the tag) is looked at again with the next piece."""

    def __init__(self, tag: str) -> None:
        self.tag = tag
        self.found = False
        self._tail = ""

    def __call__(self, piece: str) -> tuple[str, str | None]:
        """(the text before the tag that is now final; the text after the tag when this
        piece completes it, else None)."""
        text = self._tail + piece
        cut = text.find(self.tag)
        if cut >= 0:
            self.found, self._tail = True, ""
            return text[:cut], text[cut + len(self.tag) :]
        keep = partial_marker(text, self.tag)
        self._tail = text[len(text) - keep :]
        return text[: len(text) - keep], None


class ReplyText:
    """Accumulates a reply's pieces and says, piece by piece, what became final.

    The work per piece is bounded by the piece and the tags' lengths, not by the reply so
    far (re-splitting the whole text on every token made a long reply quadratic).

    Args:
        call_tag: where tool calls start (text from it on is never streamed as content);
            None for a reply whose whole text is content.
        strip: the final content is stripped (tool replies), so stream it stripped too.
        thinking: the model's thinking section, its text streamed as reasoning.
        calls: reads the calls from the call tag on as they come (`new_calls`); None:
            the calls are known once the reply ends.
    """

    def __init__(
        self,
        call_tag: str | None = None,
        strip: bool = False,
        thinking: Thinking | None = None,
        calls: CallStream | None = None,
    ) -> None:
        self.call_tag = call_tag
        self.strip = strip
        self.thinking = thinking
        self._pieces: list[str] = []
        self._reasoning: list[str] = []
        self._content: list[str] = []
        section = thinking is not None and thinking.in_reply
        # What may still open the thinking section (None: decided, or no section).
        self._head: str | None = "" if section and thinking and not thinking.opened else None
        self._section = _Until(thinking.end) if section and thinking and thinking.opened else None
        self._tidy_reasoning = _Strip(lead=True, trail=True)
        self._after_section: _Strip | None = None  # the answer after a section is lstripped
        self._calls = _Until(call_tag) if call_tag is not None else None
        self._call_stream = calls
        self._new_calls: list[CallDelta] = []
        self._tidy = _Strip(lead=strip, trail=strip)

    @property
    def text(self) -> str:
        """The whole reply so far."""
        return "".join(self._pieces)

    def add(self, piece: str) -> tuple[str, str]:
        """Take the next piece; returns (reasoning, content) that became final with it."""
        self._pieces.append(piece)
        reasoning, content = self._split(piece)
        reasoning = self._tidy_reasoning(reasoning) if reasoning else ""
        content = self._answer(content) if content else ""
        if reasoning:
            self._reasoning.append(reasoning)
        if content:
            self._content.append(content)
        return reasoning, content

    def new_calls(self) -> list[CallDelta]:
        """The calls' deltas that became final since the last call."""
        new, self._new_calls = self._new_calls, []
        return new

    def safe_reasoning(self) -> str:
        """The reasoning that no later piece can change."""
        return "".join(self._reasoning)

    def safe(self) -> str:
        """The content that no later piece can change."""
        return "".join(self._content)

    def _split(self, piece: str) -> tuple[str, str]:
        """The piece's raw reasoning and content (as `Thinking.split` cuts the reply)."""
        if self._head is not None and self.thinking is not None:
            text, start = self._head + piece, self.thinking.start
            if text.startswith(start):
                self._head = None
                self._section = _Until(self.thinking.end)
                piece = text[len(start) :]
            elif start.startswith(text):
                self._head = text
                return "", ""
            else:
                self._head = None  # no section: the whole reply is content
                return "", text
        if self._section is not None and not self._section.found:
            before, after = self._section(piece)
            if after is None:
                return before, ""
            self._after_section = _Strip(lead=True, trail=False)
            return before, after
        return "", piece

    def _answer(self, content: str) -> str:
        """Content made final: past a section's end lstripped, cut at the calls, tidied."""
        if self._after_section is not None:
            content = self._after_section(content)
        if self._calls is not None:
            if self._calls.found:
                self._read_calls(content)
                return ""
            content, after = self._calls(content)
            if after is not None:
                self._read_calls(after)
        return self._tidy(content) if content else ""

    def _read_calls(self, text: str) -> None:
        if self._call_stream is not None:
            self._new_calls += self._call_stream.feed(text)
