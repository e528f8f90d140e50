"""One block stream for every API: a reply's pieces as blocks (its reasoning, its content,
each tool call) opened, grown by text deltas and closed, then its end (outcome, answer,
each call begun and whether the answer has it whole), the final flush included (the rest
of reasoning and content past what was streamed, calls never begun). Each API renders
these events in its own shapes (`openai_format.ChatRenderer`, `anthropic_api.Renderer`,
`responses_api.Renderer`); `rendered` drives one and warms the next turn.

Blocks come one at a time: opening one closes the one open. A block's index is its place
among the reply's blocks, which is each API's output index for it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Literal, Protocol, cast

from mlxcache.modes.call_stream import CallDelta
from mlxcache.server import errors
from mlxcache.server.prepare import Answer
from mlxcache.server.stream import Ending, Outcome, Stream

Kind = Literal["reasoning", "content", "call"]


@dataclass(frozen=True, slots=True)
class Block:
    index: int
    kind: Kind
    call: int = -1
    """A call's index among the reply's calls."""
    name: str = ""
    """A call's function name."""


@dataclass(frozen=True, slots=True)
class Opened:
    block: Block


@dataclass(frozen=True, slots=True)
class Delta:
    """More text of a block (a call's: more of its arguments, possibly none on its first)."""

    block: Block
    text: str


@dataclass(frozen=True, slots=True)
class Closed:
    block: Block
    text: str
    """All the block's text."""


@dataclass(frozen=True, slots=True)
class CallEnd:
    """A call begun: its arguments as sent, and whether the answer has it (else it was
    cut off, or unreadable)."""

    block: Block
    arguments: str
    whole: bool


@dataclass(frozen=True, slots=True)
class End:
    """The reply's end (`ending.answer` None: it failed, its open block left open)."""

    ending: Ending
    calls: tuple[CallEnd, ...] = ()


BlockEvent = Opened | Delta | Closed | End


class _Blocks:
    """The blocks of one reply so far, and the events that grow them."""

    def __init__(self) -> None:
        self.texts: list[str] = []
        self.open: Block | None = None
        self.calls: dict[int, Block] = {}
        self.content_seen = False

    def _close(self) -> list[BlockEvent]:
        if self.open is None:
            return []
        block, self.open = self.open, None
        return [Closed(block, self.texts[block.index])]

    def _opened(self, kind: Kind, call: int = -1, name: str = "") -> list[BlockEvent]:
        if self.open is not None and self.open.kind == kind and kind != "call":
            return []
        out = self._close()
        self.open = Block(len(self.texts), kind, call, name)
        self.texts.append("")
        self.content_seen |= kind == "content"
        if kind == "call":
            self.calls[call] = self.open
        return [*out, Opened(self.open)]

    def _delta(self, block: Block, text: str) -> Delta:
        self.texts[block.index] += text
        return Delta(block, text)

    def text(self, kind: Kind, text: str) -> list[BlockEvent]:
        out = self._opened(kind)
        assert self.open is not None
        return [*out, self._delta(self.open, text)]

    def call(self, delta: CallDelta) -> list[BlockEvent]:
        out = [] if delta.name is None else self._opened("call", delta.index, delta.name)
        return [*out, self._delta(self.calls[delta.index], delta.arguments)]

    def end(self, end: Ending) -> list[BlockEvent]:
        """The flush: the rest of reasoning and content, the content block every answer
        with content or without calls has (empty, if need be), the rest of the calls."""
        answer = end.answer
        if answer is None:
            return [End(end)]
        out = self.text("reasoning", end.reasoning) if end.reasoning else []
        if end.content:
            out += self.text("content", end.content)
        elif not self.content_seen and (answer.content or not answer.calls):
            out += self._opened("content")
        for call in end.calls:
            out += self.call(call)
        out += self._close()
        calls = tuple(
            CallEnd(b, self.texts[b.index], i < len(answer.calls)) for i, b in self.calls.items()
        )
        return [*out, End(end, calls)]


async def block_events(
    stream: Stream, answer_of: Callable[[str, str], Answer]
) -> AsyncIterator[BlockEvent]:
    """The reply `stream` runs, as blocks; `answer_of` reads its answer (`Plan.answer`)."""
    blocks = _Blocks()
    async for piece in stream.deltas():
        if isinstance(piece, CallDelta):
            events = blocks.call(piece)
        else:
            events = blocks.text(cast(Kind, piece[0]), piece[1])  # "reasoning" or "content"
        for event in events:
            yield event
    for event in blocks.end(stream.ending(answer_of)):
        yield event


class Renderer(Protocol):
    """One API's stream: what it sends first (`head`), then for each block event."""

    async def head(self) -> list[str]: ...

    def __call__(self, event: BlockEvent, /) -> list[str]: ...


async def rendered(
    stream: Stream,
    answer_of: Callable[[str, str], Answer],
    render: Renderer,
    done: Callable[[Answer], Awaitable[None]],
    keep: Callable[[Answer], None] | None = None,
) -> AsyncIterator[str | Outcome]:
    """The text `render` makes of the reply's block events, with its outcome (for the
    request log) and `keep` of its answer (a stored response) before the text of its end:
    a client that has the end may leave at once, and the generator never resumes. Then
    `done` (the next turn warmed) with the answer. A fault of the server's own before the
    end ends the reply as a failed request does (an error, in the log and to the client)."""
    ended = False
    try:
        for line in await render.head():
            yield line
        async for event in block_events(stream, answer_of):
            lines = render(event)
            if isinstance(event, End):  # its text and the answer kept, or the fault said
                if keep is not None and event.ending.answer is not None:
                    keep(event.ending.answer)
                yield event.ending.outcome
            for line in lines:
                yield line
            if isinstance(event, End):
                ended = True
                if event.ending.answer is not None:
                    await done(event.ending.answer)
    except Exception as exc:
        if ended:  # the client has it all: only warming the next turn failed
            raise
        failure = stream.failed(errors.internal(exc))
        yield failure.outcome
        for line in render(End(failure)):
            yield line
