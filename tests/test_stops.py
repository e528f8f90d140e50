"""Stop strings over streamed pieces: the emitted text is the text before the first stop."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from mlxcache.stops import StopScanner


def stream(pieces: list[str], stops: list[str]) -> tuple[list[str], bool]:
    scan = StopScanner(stops)
    out = [scan.feed(p) for p in pieces]
    return [*out, scan.flush()], scan.stopped


def test_a_stop_split_across_pieces_is_held_then_cut() -> None:
    out, stopped = stream(["ab", "c<", "/s", ">tail"], ["</s>"])
    assert out == ["ab", "c", "", "", ""] and stopped


def test_held_text_is_released_when_it_is_not_a_stop() -> None:
    out, stopped = stream(["x<", "/t", "y"], ["</s>"])
    assert out == ["x", "</t", "y", ""] and not stopped


def test_the_stop_that_appears_first_wins_whatever_the_pieces() -> None:
    for pieces in (["<b>", "<"], ["<b><"], list("<b><")):
        out, stopped = stream(pieces, [">", "b><"])
        assert "".join(out) == "<b" and stopped


def test_no_stops_passes_pieces_through() -> None:
    assert stream(["a", "", "b"], []) == (["a", "", "b", ""], False)


@given(
    text=st.text(alphabet="ab<>/", max_size=40),
    cuts=st.lists(st.integers(0, 40), max_size=8),
    stops=st.lists(st.text(alphabet="ab<>/", min_size=1, max_size=4), max_size=3),
)
def test_emitted_text_is_the_text_before_the_first_stop(
    text: str, cuts: list[int], stops: list[str]
) -> None:
    bounds = sorted({0, len(text), *(min(c, len(text)) for c in cuts)})
    pieces = [text[a:b] for a, b in itertools.pairwise(bounds)]
    out, stopped = stream(pieces, stops)
    # The first stop to appear (earliest end; the longest of those ending there) cuts the
    # reply, whatever the pieces: what generating one character at a time would give.
    hits = [(i + len(s), i) for s in stops if (i := text.find(s)) >= 0]
    assert "".join(out) == (text[: min(hits)[1]] if hits else text)
    assert stopped == bool(hits)
