"""Naming the loop a reply was stuck in when it ran into the token limit."""

from __future__ import annotations

from mlxcache.events import Result, Stats
from mlxcache.modes.json_mode import JsonTask, read_reply
from mlxcache.modes.repeats import describe_loop, repeating


def test_the_shortest_repeated_piece_and_its_count() -> None:
    names = '{"participants": [' + '"John Smith", "Jane Smith", ' * 9 + '"John Sm'
    assert repeating(names) == ('"John Smith", "Jane Smith", ', 9)
    assert repeating('{"name": "John Do!' + "[X][Y][Z]" * 30 + "[X") == ("[X][Y][Z]", 30)


def test_no_loop_without_enough_repeats() -> None:
    assert repeating("") is None
    assert repeating('{"a": 1, "b": 2, "c": 3}') is None
    assert repeating("abcabcabc") is None  # 3 times, 9 characters: too little to call a loop
    counting = "".join(f'{{"value": {i}.0}}, ' for i in range(40))  # changes every item
    assert repeating(counting) is None


def test_the_length_error_names_the_loop() -> None:
    text = '["' + "ab" * 60
    assert describe_loop(text) == '; it was repeating "ab" (60 times)'
    long_piece = "".join(chr(65 + i % 26) for i in range(100))
    assert describe_loop(long_piece * 5) == (f'; it was repeating "{long_piece[:57]}..." (5 times)')
    assert describe_loop("no loop here") == ""


def test_a_json_reply_cut_in_a_loop_says_what_it_repeated() -> None:
    task = JsonTask.create({"type": "array", "items": {"type": "string"}})
    text = '["x", ' + '"John", "Jane", ' * 10 + '"Jo'
    reply = read_reply(task, Result(text, [1] * 256, "length", Stats(generated_tokens=256)))
    assert reply.output is None and reply.text == text
    assert reply.error is not None
    # The loop starts with what came before it that repeats too: the end of "x".
    assert reply.error.endswith('; it was repeating "\\", \\"John\\", \\"Jane" (10 times)')
