"""Warm-ahead, the lane scheduler and the engine's API: exact forward calls, exact bits."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jinja2
import mlx.core as mx
import numpy as np
import pytest
from guarantees import Interrupt
from shapemodel import checkpointed
from spy import Spy, spied

from mlxcache.cache.store import PromptCache
from mlxcache.config import CacheConfig, default_block_size
from mlxcache.engine import Engine, Request
from mlxcache.errors import GenerationError
from mlxcache.events import CANCELLED, Done, Prefill, Result, Token
from mlxcache.lanes import NextTurn
from mlxcache.model import LoadedModel
from mlxcache.modes.chat import warm_next_turn
from mlxcache.prefill import schedule
from mlxcache.sampling import SamplingParams
from mlxcache.scheduler import LaneKind
from mlxcache.worker import EngineWorker

B = 4
GREEDY = SamplingParams(max_tokens=6)

# Drops the reasoning of assistant messages that a later message follows (as Qwen3's does).
REWRITING = (
    "{% for m in messages %}{% set c = m['content'] %}"
    "{% if m['role'] == 'assistant' and not loop.last %}{% set c = c.split('</think>')[-1] %}"
    "{% endif %}{{'<|im_start|>' + m['role'] + '\\n' + c + '<|im_end|>\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def pins(engine: Engine) -> tuple[int, int]:
    """Entries pinned and leases not released: (0, 0) once no lane runs."""
    report = engine.cache.report()
    return report["pinned_entries"], report["open_leases"]


def prompt(n: int, seed: int = 0) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, 250, size=n)]


def cached(loaded: LoadedModel, tmp_path: Path | None = None) -> tuple[Engine, Spy]:
    model, spy = spied(loaded)
    disk = tmp_path is not None
    config = CacheConfig(block_size=B, directory=tmp_path, disk_bytes=(1 << 30) if disk else 0)
    root = tmp_path / "kv" if tmp_path is not None else None
    return Engine(model, PromptCache(model.model, model.key, config, root=root)), spy


def cold(
    loaded: LoadedModel, tokens: list[int], params: SamplingParams = GREEDY
) -> tuple[Result, Spy]:
    model, spy = spied(loaded)
    return Engine(model, block_size=B).complete(Request(tokens, params)), spy


def same_as_cold(loaded: LoadedModel, warm: Result, spy: Spy, tokens: list[int]) -> None:
    """Same tokens and bytes, and the same last-prompt-token logits, bit for bit."""
    ref, ref_spy = cold(loaded, tokens)
    assert warm.tokens == ref.tokens and warm.text == ref.text
    final = next(i for i, (s, n) in enumerate(spy.calls) if s + n == len(tokens))
    final_ref = next(i for i, (s, n) in enumerate(ref_spy.calls) if s + n == len(tokens))
    assert mx.array_equal(spy.last_logits[final], ref_spy.last_logits[final_ref])


class Templated:
    """A tokenizer whose chat template is `template` (the tiny model's otherwise)."""

    def __init__(self, tokenizer: Any, template: str) -> None:
        self._tok = tokenizer
        self._template = jinja2.Template(template)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tok, name)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = False, **_: Any
    ) -> list[int]:
        text = self._template.render(messages=messages, add_generation_prompt=add_generation_prompt)
        return list(self._tok.encode(text, add_special_tokens=False))


def test_turn_two_starts_where_warm_ahead_ended(tiny: LoadedModel) -> None:
    engine, spy = cached(tiny)
    convo: list[dict[str, Any]] = [{"role": "user", "content": "hello there, model"}]
    first = engine.complete(Request(engine.encoder.encode_chat(convo), GREEDY))
    convo.append({"role": "assistant", "content": first.text})
    kept_before = len(engine.encoder.encode_chat(convo[:1])) // B * B
    ahead = engine.encoder.encode_next_turn(convo)
    target = len(ahead) // B * B
    assert target > kept_before  # the reply adds blocks to warm
    spy.reset()
    assert warm_next_turn(engine, convo) is not None
    assert list(engine.run()) == []  # run() serves requests only: warm-ahead waits
    assert spy.calls == []
    assert list(engine.run(warm=True)) == []  # warm lanes yield no events
    assert spy.calls == [(s, e - s) for s, e in schedule(kept_before, target, B)]
    assert not engine.warming

    nxt = engine.encoder.encode_chat([*convo, {"role": "user", "content": "and then?"}])
    assert nxt[: len(ahead)] == ahead  # what was warmed is what the next prompt starts with
    spy.reset()
    second = engine.complete(Request(nxt, GREEDY))
    assert second.stats.cached_tokens == target
    assert spy.calls[0] == (target, min(B, len(nxt) - target))
    same_as_cold(tiny, second, spy, nxt)


def test_warm_ahead_of_a_cached_prefix_costs_no_call(tiny: LoadedModel) -> None:
    engine, spy = cached(tiny)
    p = prompt(16)
    engine.warm(p)
    list(engine.run(warm=True))
    spy.reset()
    engine.warm(p)  # all four blocks are cached: the lookup finds them all
    list(engine.run(warm=True))
    assert spy.calls == []
    assert engine.warm(p[:3]) is None  # shorter than a block: nothing to do


def test_request_arriving_mid_warm_ahead_makes_none_of_its_calls(tiny: LoadedModel) -> None:
    engine, spy = cached(tiny)
    p = prompt(30)
    engine.warm(p)
    assert engine.step() == [] and engine.step() == []  # two warm chunks: [0,4) and [4,8)
    assert spy.calls == [(0, B), (B, B)]
    spy.reset()
    result = engine.complete(Request(p + prompt(5, seed=1), GREEDY))
    assert not engine.warming  # the overlapping warm lane stopped, keeping its two blocks
    assert result.stats.cached_tokens == 2 * B
    assert spy.calls[0] == (2 * B, B)
    assert not {(0, B), (B, B)} & set(spy.calls)
    same_as_cold(tiny, result, spy, p + prompt(5, seed=1))


def test_a_request_goes_before_warm_ahead(tiny: LoadedModel) -> None:
    engine, spy = cached(tiny)
    engine.warm(prompt(20, seed=3))
    assert engine.step() == []  # one warm chunk in flight when the request arrives
    rid = engine.submit(Request(prompt(9, seed=4), GREEDY))  # shares no block: warm waits
    spy.reset()
    events = engine.step()
    assert [type(e) for e in events] == [Prefill] and events[0].request_id == rid
    assert spy.calls == [(0, B)] and engine.warming
    done = [e for e in engine.run() if isinstance(e, Done)]
    assert [d.request_id for d in done] == [rid] and engine.warming  # warm still queued
    assert spy.calls[:3] == [(0, B), (B, B), (2 * B, 1)]


def test_the_first_token_comes_with_the_last_chunk(tiny: LoadedModel) -> None:
    """A lane whose prompt is done samples its first token in the same step (sampling is no
    model call), instead of waiting a whole round of the other lanes; it is given before
    the next decode step is queued (on MLX's CPU backend queueing computes most of it),
    and that step comes with the lane's next turn, the one after it queued behind."""
    engine, spy = cached(tiny)
    a = engine.submit(Request(prompt(3, seed=1), GREEDY))  # one chunk
    b = engine.submit(Request(prompt(6, seed=2), GREEDY))  # two chunks
    spy.reset()
    first = engine.step()
    assert [(type(e), e.request_id) for e in first] == [(Prefill, a), (Token, a)]
    assert spy.calls == [(0, 3)]  # a's prompt only: no decode step before its first token
    second = engine.step()
    assert [(type(e), e.request_id) for e in second] == [(Prefill, b)]  # b's first chunk
    assert spy.calls == [(0, 3), (0, B)]
    third = engine.step()
    assert [(type(e), e.request_id) for e in third] == [(Token, a)]
    assert spy.calls[2:] == [(3, 1), (4, 1)]  # a's second token, its third queued


def test_a_followed_reply_keeps_its_blocks_as_it_goes(tiny: LoadedModel) -> None:
    """A follow lane prefills each block of prompt + reply once the reply completes it, one
    chunk per step between the request's decode steps; the next turn resumes after them."""
    engine, spy = cached(tiny)
    p = prompt(9, seed=7)
    twelve = SamplingParams(max_tokens=12)
    rid = engine.submit(Request(p, twelve, stop_tokens=frozenset(), follow=True))
    spy.reset()
    done = [e for e in engine.run(warm=True) if isinstance(e, Done)]
    assert [d.request_id for d in done] == [rid] and not engine.warming
    reply = done[0].result.tokens
    assert len(reply) == 12  # 9 + 12 = 21 tokens: blocks [8, 12), [12, 16), [16, 20) follow
    lanes = list(dict.fromkeys(spy.lanes))
    assert len(lanes) == 2  # the request's layers and the follow lane's
    follow = [spy.calls[i] for i, lane in enumerate(spy.lanes) if lane == lanes[1]]
    assert follow == [(8, B), (12, B), (16, B)]
    # Each block is computed right after the decode step that completed it.
    order = [(spy.calls[i], lane == lanes[1]) for i, lane in enumerate(spy.lanes)]
    assert order.index(((8, B), True)) == order.index(((11, 1), False)) + 1
    nxt = [*p, *reply, *prompt(3, seed=8)]
    spy.reset()
    second = engine.complete(Request(nxt, GREEDY))
    assert second.stats.cached_tokens == 20 and spy.calls[0] == (20, 4)
    same_as_cold(tiny, second, spy, nxt)
    assert pins(engine) == (0, 0)
    # The same conversation again: its blocks are kept already, the follow lane skips them.
    spy.reset()
    engine.submit(Request(p, twelve, stop_tokens=frozenset(), follow=True))
    list(engine.run(warm=True))
    assert len(set(spy.lanes)) == 1 and all(n == 1 for _, n in spy.calls)  # decode steps only


def test_follow_lanes_wait_while_a_request_prefills(tiny: LoadedModel) -> None:
    """A follow lane's chunks never delay a request's first token; a request that shares
    only a prefix with it leaves it alone; cancelling the followed request ends it."""
    engine, spy = cached(tiny)
    shared = prompt(8, seed=1)
    long_reply = SamplingParams(max_tokens=40)
    a = engine.submit(Request([*shared, 5], long_reply, stop_tokens=frozenset(), follow=True))
    follower = next(r for r, kind in engine.lanes() if kind is LaneKind.FOLLOW)
    assert engine.lanes() == [(a, LaneKind.REQUEST), (follower, LaneKind.FOLLOW)]
    replies = 0
    while replies < 3:  # 9 + 3 tokens: the block [8, 12) is complete
        replies += sum(isinstance(e, Token) for e in engine.step())
    b = engine.submit(Request([*shared, *prompt(9, seed=2)], GREEDY))  # shares [0, 8) only
    assert (follower, LaneKind.FOLLOW) in engine.lanes()  # b needs nothing it would compute
    spy.reset()
    while not any(isinstance(e, Token) and e.request_id == b for e in engine.step()):
        assert (b, LaneKind.REQUEST) in engine.lanes()  # b is prefilling
    assert len(set(spy.lanes)) == 2  # a's decode steps and b's chunks: the follow waited
    # b's full chunks (it resumed [0, 8) from a's kept prompt); its last one is (16, 1).
    assert [c for c in spy.calls if c[1] > 1] == [(8, B), (12, B)] and (16, 1) in spy.calls
    spy.reset()
    for _ in range(3):  # a, the follow lane, b
        engine.step()
    assert (8, B) in spy.calls and len(set(spy.lanes)) == 3
    engine.cancel(a)
    assert engine.lanes() == [(b, LaneKind.REQUEST)] and not engine.warming  # all of a's gone
    list(engine.run())
    assert pins(engine) == (0, 0)


def test_a_follow_lane_goes_on_while_its_reply_runs(tiny: LoadedModel) -> None:
    """Another request that needs blocks the follow lane has not done yet (here: one that
    starts with the reply so far) leaves it alone while the reply runs; both end."""
    engine, _spy = cached(tiny)
    p = prompt(9, seed=5)
    engine.submit(Request(p, SamplingParams(max_tokens=20), frozenset(), follow=True))
    follower = next(r for r, kind in engine.lanes() if kind is LaneKind.FOLLOW)
    replies: list[int] = []
    while len(replies) < 3:
        replies += [e.token for e in engine.step() if isinstance(e, Token)]
    engine.submit(Request([*p, *replies, 7, 7], GREEDY))  # shares 12 > the follow's 8
    assert (follower, LaneKind.FOLLOW) in engine.lanes()
    list(engine.run(warm=True))
    assert not engine.lanes() and pins(engine) == (0, 0)


def test_a_followed_request_that_fails_to_start_ends_its_follow_lane(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine, _spy = cached(tiny)
    restore = engine.cache.restore
    calls = iter([True])

    def failing(tokens: Any, count: bool = True) -> Any:
        if next(calls, False):
            raise MemoryError("no room for the KV")
        return restore(tokens, count)

    monkeypatch.setattr(engine.cache, "restore", failing)
    rid = engine.submit(Request(prompt(9), GREEDY, follow=True))
    done: list[Done] = []
    for _ in range(20):  # a follow lane left waiting would keep `warming` on for good
        done += [e for e in engine.step() if isinstance(e, Done)]
    assert [(d.request_id, d.result.finish_reason) for d in done] == [(rid, "error")]
    assert not engine.lanes() and not engine.warming


def test_template_rewriting_earlier_turns(tiny: LoadedModel) -> None:
    loaded = dataclasses.replace(tiny, tokenizer=Templated(tiny.tokenizer, REWRITING))
    engine, spy = cached(loaded)
    convo = [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "<think>two and two make four, surely</think>4"},
    ]
    naive = loaded.tokenizer.apply_chat_template(convo)
    ahead = engine.encoder.encode_next_turn(convo)
    nxt = engine.encoder.encode_chat([*convo, {"role": "user", "content": "and 3+3?"}])
    assert nxt[: len(ahead)] == ahead
    assert nxt[: len(naive)] != naive  # rendering the reply as last message would keep reasoning
    warm_next_turn(engine, convo)
    list(engine.run(warm=True))
    spy.reset()
    result = engine.complete(Request(nxt, GREEDY))
    assert result.stats.cached_tokens == len(ahead) // B * B
    same_as_cold(loaded, result, spy, nxt)


def test_interrupted_prefill_keeps_its_full_blocks(tiny: LoadedModel) -> None:
    engine, spy = cached(tiny)
    p = prompt(23)
    events = engine.generate(Request(p, GREEDY))
    assert [next(events), next(events)] == [Prefill(0, B, 23), Prefill(0, 2 * B, 23)]
    events.close()  # Ctrl-C after two chunks
    spy.reset()
    result = engine.complete(Request(p, GREEDY))
    assert result.stats.cached_tokens == 2 * B and spy.calls[0] == (2 * B, B)
    same_as_cold(tiny, result, spy, p)


def test_generate_leaves_other_lanes_alone(tiny: LoadedModel) -> None:
    engine, _spy = cached(tiny)
    a, b = prompt(9, seed=1), prompt(11, seed=2)
    rid = engine.submit(Request(a, GREEDY))
    got_b = engine.complete(Request(b, GREEDY))
    done = [e for e in engine.run() if isinstance(e, Done)]
    assert [d.request_id for d in done] == [rid]  # submitted before, not lost
    assert done[0].result.tokens == cold(tiny, a)[0].tokens
    assert got_b.tokens == cold(tiny, b)[0].tokens


def test_cancel_during_run_ends_only_that_lane(tiny: LoadedModel) -> None:
    engine, _spy = cached(tiny)
    a, b = (engine.submit(Request(prompt(9, seed=s), GREEDY)) for s in (1, 2))
    finished = []
    for event in engine.run():
        if isinstance(event, Token) and event.request_id == a:
            engine.cancel(a)
        if isinstance(event, Done):
            finished.append(event.request_id)
    assert finished == [b]
    assert engine.cache.report()["mem_entries"] >= 1


def test_stop_strings_cut_the_reply(tiny: LoadedModel) -> None:
    engine, _spy = cached(tiny)
    p = prompt(9, seed=7)
    full = engine.complete(Request(p, SamplingParams(max_tokens=12), stop_tokens=frozenset()))
    at = next(i for i in range(1, len(full.text) - 1) if full.text.find(full.text[i : i + 2]) == i)
    stop = full.text[at : at + 2]
    cut = engine.complete(
        Request(p, SamplingParams(max_tokens=12), stop_tokens=frozenset(), stop_strings=(stop,))
    )
    assert cut.text == full.text[:at] and cut.finish_reason == "stop"
    assert cut.tokens == full.tokens[: len(cut.tokens)]


def test_miss_reasons(tiny: LoadedModel) -> None:
    engine, _spy = cached(tiny)
    assert engine.complete(Request(prompt(3), GREEDY)).stats.miss_reason.startswith("shorter")
    assert engine.complete(Request(prompt(9), GREEDY)).stats.miss_reason == "no cached prefix"
    assert engine.complete(Request(prompt(9), GREEDY)).stats.miss_reason == ""
    nocache = Engine(tiny, block_size=B)
    assert nocache.complete(Request(prompt(9), GREEDY)).stats.miss_reason == "cache off"


def test_worker_serves_bitwise_and_cancels(tiny: LoadedModel) -> None:
    engine, _spy = cached(tiny)
    p = prompt(14, seed=5)
    ref = cold(tiny, p)[0]
    with EngineWorker(engine) as worker:
        assert worker.complete(Request(p, GREEDY)).tokens == ref.tokens
        convo = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
        warm_next_turn(worker, convo)
        again = worker.complete(Request(p, GREEDY))
        assert again.tokens == ref.tokens and again.stats.cached_tokens == 14  # resumed whole
        stream = worker.generate(Request(prompt(40, seed=6), SamplingParams(max_tokens=50)))
        next(stream)
        stream.close()  # cancels: the lane's pin goes
        pinned = worker.call(lambda e: e.cache.report()["pinned_entries"])
        assert pinned == 0
        got: list[Any] = []
        handle = worker.submit(Request(prompt(40, seed=8), GREEDY), got.append)
        handle.cancel()
        worker.call(lambda e: None)  # both messages handled in order
    assert isinstance(got[-1], Done) and got[-1].result.finish_reason in (
        CANCELLED,
        "length",
        "stop",
    )


def test_worker_refuses_beyond_its_queue(tiny: LoadedModel) -> None:
    from mlxcache.errors import QueueFullError

    engine, _spy = cached(tiny)
    worker = EngineWorker(engine, max_lanes=1, max_queue=1)  # not started: nothing is admitted
    worker.submit(Request(prompt(9), GREEDY), lambda e: None)  # will take the free lane
    worker.submit(Request(prompt(9), GREEDY), lambda e: None)  # waits: the queue is full
    with pytest.raises(QueueFullError, match="1 requests are already waiting"):
        worker.submit(Request(prompt(9), GREEDY), lambda e: None)
    worker.start()
    worker.close(cancel=True)


def test_no_warm_ahead_queues_nothing(tiny: LoadedModel) -> None:
    from mlxcache.runtime import make_cache
    from mlxcache_cli import options

    config = options.cache_config(None, False, "1G", "0", B, warm_ahead=False)
    assert config.warm_ahead is False  # what --no-warm-ahead sets
    engine = Engine(tiny, make_cache(tiny, config), warm_ahead=config.warm_ahead)
    convo = [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "hi!"}]
    assert warm_next_turn(engine, convo) is None and not engine.warming
    assert engine.warm(prompt(9)) is not None  # an explicit warm still works


def test_a_chat_resumes_in_generate(tiny_gguf: Path, tmp_path: Path) -> None:
    """One block size for every command: generate resumes what chat kept (same rendering)."""
    from typer.testing import CliRunner

    from mlxcache_cli.main import app

    text = "hello there my friend, how are you doing today?"
    common = ["-m", str(tiny_gguf), "--cache-dir", str(tmp_path), "-n", "3"]
    runner = CliRunner()
    chat = runner.invoke(app, ["chat", *common], input=text + "\n")
    assert chat.exit_code == 0, chat.stderr
    assert "prompt tokens cached (no cached prefix)" in chat.stderr
    again = runner.invoke(app, ["generate", *common, text])
    assert again.exit_code == 0, again.stderr
    cached, total = again.stderr.split(" prompt tokens cached")[0].split("/")
    block = default_block_size()
    assert int(cached) == (int(total) - 1) // block * block > 0


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_crashed_worker_fails_its_requests_instead_of_hanging(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine, _spy = cached(tiny)

    def broken(background: bool = True) -> list[Any]:
        raise RuntimeError("boom")

    monkeypatch.setattr(engine, "step", broken)
    got: list[Any] = []
    worker = EngineWorker(engine).start()
    worker.submit(Request(prompt(9), GREEDY), got.append)
    worker._thread.join(timeout=60)
    assert not worker._thread.is_alive()
    assert isinstance(got[-1], Done) and got[-1].result.finish_reason == "error"
    assert "boom" in (got[-1].result.error or "")
    from mlxcache.errors import EngineStoppedError

    with pytest.raises(EngineStoppedError, match=r"stopped|shutting down"):
        worker.submit(Request(prompt(9), GREEDY), got.append)
    with pytest.raises(EngineStoppedError, match=r"stopped|shutting down"):
        worker.call(lambda e: None)


def test_warm_ahead_of_another_conversation_goes_on_after_a_request(tiny: LoadedModel) -> None:
    engine, spy = cached(tiny)
    system = prompt(8, seed=1)  # two blocks both conversations share
    other = system + prompt(20, seed=2)
    engine.warm(other)
    engine.step()  # [0, 4) of the other conversation
    engine.complete(Request(system + prompt(6, seed=3), GREEDY))
    assert engine.warming  # stopped for the request, queued again from what it kept
    list(engine.run(warm=True))
    spy.reset()
    result = engine.complete(Request(other + prompt(3, seed=4), GREEDY))
    assert result.stats.cached_tokens == 28 and spy.calls[0] == (28, 3)


def test_warm_lanes_run_one_at_a_time(tiny: LoadedModel) -> None:
    engine, spy = cached(tiny)
    engine.warm(prompt(12, seed=1))
    engine.warm(prompt(12, seed=2))
    while engine.warming:
        engine.step()
    lanes = spy.lanes  # one cache list per lane: three chunks of one, then of the other
    assert len(set(lanes)) == 2 and lanes == sorted(lanes, key=lanes.index)


def test_units_closed_early_leave_nothing_behind(tiny: LoadedModel) -> None:
    from mlxcache.units import one_request, run_units

    engine, _spy = cached(tiny)
    units = [
        (i, lambda i=i: one_request(lambda: Request(prompt(9, seed=i), GREEDY))) for i in range(3)
    ]
    results = run_units(engine, units, 2)
    next(results)
    results.close()
    assert not engine.busy
    assert pins(engine) == (0, 0)


def test_a_failing_keep_while_cancelling_spares_the_worker(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine, _spy = cached(tiny)
    with EngineWorker(engine) as worker:
        stream = worker.generate(Request(prompt(40, seed=1), GREEDY))
        assert isinstance(next(stream), Prefill)
        keep = engine.cache.keep

        def fail_once(*args: Any) -> None:
            monkeypatch.setattr(engine.cache, "keep", keep)
            raise OSError("disk full")

        monkeypatch.setattr(engine.cache, "keep", fail_once)
        stream.close()  # the cancel's keep fails: best effort, the worker goes on
        assert worker.complete(Request(prompt(9, seed=2), GREEDY)).finish_reason != "error"
    from mlxcache.errors import EngineStoppedError

    with pytest.raises(EngineStoppedError, match=r"stopped|shutting down"):
        worker.submit(Request(prompt(9), GREEDY), lambda e: None)
    with pytest.raises(EngineStoppedError, match=r"stopped|shutting down"):
        worker.call(lambda e: None)


def test_a_failing_warm_lane_warns_once_and_ends_alone(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, _spy = spied(tiny)
    warnings: list[str] = []
    config = CacheConfig(block_size=B, disk_bytes=0)
    engine = Engine(model, PromptCache(model.model, model.key, config), on_warning=warnings.append)
    keep, calls = engine.cache.keep, iter([True])

    def fail_once(*args: Any, **kwargs: Any) -> Any:
        if next(calls, False):
            raise MemoryError("no room for the KV")
        return keep(*args, **kwargs)

    monkeypatch.setattr(engine.cache, "keep", fail_once)
    engine.warm(prompt(12))
    assert list(engine.run(warm=True)) == []
    assert warnings == ["warm-ahead stopped early: MemoryError: no room for the KV"]
    assert not engine.lanes() and pins(engine) == (0, 0)
    result = engine.complete(Request(prompt(12), GREEDY))  # the engine goes on
    assert result.finish_reason == "length" and result.stats.cached_tokens == 0


def test_warm_work_is_not_counted_as_hits_or_misses(tiny: LoadedModel) -> None:
    engine, _spy = cached(tiny)
    convo = prompt(12)
    engine.warm(convo)  # a miss and a keep, as warm work
    list(engine.run(warm=True))

    def counts() -> tuple[int, int, int]:
        report = engine.cache.report()
        return report["hits"], report["misses"], report["cached_tokens"]

    assert counts() == (0, 0, 0)
    engine.complete(Request([*convo, 9], GREEDY))  # a request resuming what warm kept
    assert counts() == (1, 0, 12)
    engine.complete(Request(prompt(6, seed=4), GREEDY))
    assert counts()[:2] == (1, 1)


def test_background_lanes_wait_while_requests_wait(tiny: LoadedModel) -> None:
    """step(background=False), as the worker steps while requests wait for a lane: the
    follow lane of a reply that has completed a block and a warm-ahead lane get no turn;
    given turns again, they run."""
    engine, spy = cached(tiny)
    long_reply = SamplingParams(max_tokens=40)
    a = engine.submit(Request(prompt(9, seed=1), long_reply, stop_tokens=frozenset(), follow=True))
    engine.warm(prompt(12, seed=3))
    replies = 0
    while replies < 3:  # 9 + 3 tokens: the block [8, 12) is complete
        replies += sum(isinstance(e, Token) for e in engine.step(background=False))
    spy.reset()
    for _ in range(6):
        engine.step(background=False)
    assert spy.calls == [(12 + i, 1) for i in range(6)]  # a's decode steps alone
    spy.reset()
    for _ in range(2):
        engine.step()
    assert (8, B) in spy.calls  # the follow lane's block, now that nothing waits
    engine.cancel(a)
    list(engine.run(warm=True))
    assert engine.cache.cached_length([*prompt(12, seed=3), 0]) == 12  # the warm lane ran


def test_next_turn_is_one_rule_and_a_followed_request_gets_its_lane_only_under_follow(
    tiny: LoadedModel, recurrent: LoadedModel
) -> None:
    """The engine picks how a next turn finds the reply (`NextTurn`) from its cache and
    settings; front ends only say a request may be followed."""

    def engine(loaded: LoadedModel, **settings: bool) -> Engine:
        config = CacheConfig(block_size=B, disk_bytes=0)
        return Engine(loaded, PromptCache(loaded.model, loaded.key, config), **settings)

    assert Engine(tiny, block_size=B).next_turn is NextTurn.OFF  # no cache: nothing kept
    assert engine(tiny, warm_ahead=False).next_turn is NextTurn.OFF
    assert engine(tiny).next_turn is NextTurn.FOLLOW
    # A reply's decode KV kept needs no more work, warm-ahead on or off.
    assert engine(tiny, decode_matches_prefill=True).next_turn is NextTurn.KEPT
    assert engine(tiny, decode_matches_prefill=True, warm_ahead=False).next_turn is NextTurn.KEPT
    assert engine(recurrent).next_turn is NextTurn.FOLLOW  # its states kept block by block
    # A cache kind kept only as whole-state checkpoints cannot be rewound between blocks.
    assert engine(checkpointed(recurrent)).next_turn is NextTurn.WARM
    followed = Request(prompt(9), GREEDY, stop_tokens=frozenset(), follow=True)
    for e, lane_kinds in [
        (engine(tiny), [LaneKind.REQUEST, LaneKind.FOLLOW]),
        (engine(tiny, decode_matches_prefill=True), [LaneKind.REQUEST]),
        (engine(tiny, warm_ahead=False), [LaneKind.REQUEST]),
        (engine(checkpointed(recurrent)), [LaneKind.REQUEST]),
    ]:
        e.submit(followed)
        assert [kind for _rid, kind in e.lanes()] == lane_kinds
        list(e.run(warm=True))
        assert pins(e) == (0, 0)


def test_prompts_prefill_one_after_another(tiny: LoadedModel) -> None:
    """Three requests of three chunks each, at once: each looks its prompt up (its first
    chunk), then the first goes on to its first token before the second goes on, and so
    on; a request decoding takes its turns in the round. Side by side (a chunk each in
    turn) the first tokens would come at steps 7, 8 and 9."""
    engine, spy = cached(tiny)
    rids = [engine.submit(Request(prompt(12, seed=s), GREEDY)) for s in (1, 2, 3)]
    firsts: dict[int, int] = {}
    step = 0
    while len(firsts) < 3:
        step += 1
        for e in engine.step():
            if isinstance(e, Token):
                firsts.setdefault(e.request_id, step)
    assert [firsts[r] for r in rids] == [5, 7, 11]
    first, second, third = (0, B), (B, B), (2 * B, B)  # a prompt's chunks
    assert spy.calls[:9] == [first] * 3 + [second, third] * 2 + [second, (3 * B, 1)]


class _FailsOnCall:
    """A logits processor that fails on its call number `at` (a grammar allowing nothing)."""

    def __init__(self, at: int) -> None:
        self.left = at

    def __call__(self, history: mx.array, logits: mx.array) -> mx.array:
        self.left -= 1
        if not self.left:
            raise GenerationError("the grammar allows no token here")
        return logits


def test_a_request_failing_as_a_row_of_the_decode_batch_fails_alone(tiny: LoadedModel) -> None:
    """A request whose step fails after it joined the decode batch (its third pick, made
    after a batch forward) ends with its error and leaves the batch; the request beside it
    decodes on to the reply it gets alone, and the engine goes on."""
    engine = Engine(tiny, block_size=B, batch_decode=True)
    failing = engine.submit(Request(prompt(9), GREEDY, [_FailsOnCall(at=3)]))
    other = engine.submit(Request(prompt(7, seed=1), GREEDY))
    done = {e.request_id: e.result for e in engine.run() if isinstance(e, Done)}
    assert done[failing].error == "the grammar allows no token here"
    assert done[failing].tokens == [] and done[failing].finish_reason == "error"
    assert done[other].error is None
    assert done[other].tokens == cold(tiny, prompt(7, seed=1))[0].tokens
    assert engine.lanes() == [] and len(engine._batch) == 0


def test_a_lane_interrupted_inside_its_own_forward_stops_there(tiny: LoadedModel) -> None:
    """Ctrl-C inside a request's third prefill chunk made by `Engine.step` (no `generate`
    to cancel it): the lane stops then and there, out of the queue, its lease released and
    the two chunks before it kept; the same prompt then resumes them and replies as cold."""
    engine, _spy = cached(tiny)
    loaded = engine.loaded
    engine.loaded = dataclasses.replace(loaded, model=Interrupt(loaded.model, at=3))
    p = prompt(23)
    engine.submit(Request(p, GREEDY))
    with pytest.raises(KeyboardInterrupt):
        for _ in range(5):
            engine.step()
    assert engine.lanes() == [] and pins(engine) == (0, 0)
    engine.loaded = loaded
    again = engine.complete(Request(p, GREEDY))
    assert again.stats.cached_tokens == 2 * B
    assert again.tokens == cold(tiny, p)[0].tokens
