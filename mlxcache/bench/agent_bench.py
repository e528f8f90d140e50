"""`mlxcache bench agent`: a coding agent's workload, through each API a server speaks.

Every agent sends a long system prompt and a tool list, then a conversation that grows by a
tool call and a tool result per turn, each request sent the moment the last reply ends,
several agents at once. The transcript is scripted (each turn appends the same call and
result whatever the model answered), so every route and server sees the same prompts. It
runs through `/v1/chat/completions`, `/v1/messages` and `/v1/responses` of `mlxcache serve`
(a fresh server and cache each), and through `mlx_lm.server`'s chat completions. Per turn:
latency (the prompt's prefill and a short forced tool call; mlx_lm.server gets the same
prompt, its reply not forced into a call), time to the first of the reply (text, or a
call begun: calls stream as they are written), the share of the prompt resumed, the tokens
prefilled against what the transcript added. Every request is streamed. Every reply must
be the same through the three routes and equal agent 0's solo runs on a cold engine.
"""

from __future__ import annotations

import functools
import json
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from mlxcache.bench.serve_bench import _together
from mlxcache.config import default_block_size
from mlxcache.engine import Engine
from mlxcache.model import load
from mlxcache.modes.tool_chat import hermes_messages, tool_style
from mlxcache.modes.tools import ToolChoice, parse_tools
from mlxcache.remote import chat_reply, chunk
from mlxcache.sampling import SamplingParams
from mlxcache.server.process import ChildServer, MlxcacheServer, free_port

ROUTES = ("chat", "messages", "responses")
GOAL_VS_MLX_LM = 0.5
WORDS = [
    "The",
    "repository",
    "follows",
    "strict",
    "conventions:",
    "every",
    "module",
    "has",
    "one",
    "responsibility,",
    "every",
    "public",
    "function",
    "has",
    "type",
    "hints",
    "and",
    "a",
    "docstring,",
    "tests",
    "assert",
    "exact",
    "behaviour,",
    "and",
    "no",
    "change",
    "lands",
    "without",
    "a",
    "passing",
    "suite.",
]


def system_prompt(tokens: int) -> str:
    """About `tokens` tokens of an agent's instructions (words of the conventions, numbered
    so that no two stretches are alike)."""
    words = [
        f"{WORDS[i % len(WORDS)]}" + (f" ({i // 30})" if i % 30 == 29 else "")
        for i in range(tokens)
    ]
    return "You are a coding agent. " + " ".join(words)


def tools(n: int) -> list[dict[str, Any]]:
    """n function tools, each taking a path (and the first few more)."""
    names = ["read_file", "write_file", "run_tests", "search", "list_dir", "apply_patch"]
    return [
        {
            "name": f"{names[i % len(names)]}_{i}",
            "description": f"Tool {i}: {names[i % len(names)].replace('_', ' ')} in the workspace.",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string", "maxLength": 12}},
                "required": ["path"],
            },
        }
        for i in range(n)
    ]


def result_text(agent: int, turn: int, tokens: int) -> str:
    return " ".join(f"line {agent}.{turn}.{i}: ok" for i in range(max(tokens // 6, 1)))


class Transcript:
    """One agent's conversation, written for each API from the same scripted turns."""

    def __init__(
        self, agent: int, system: str, tool_list: list[dict[str, Any]], result_tokens: int
    ) -> None:
        self.agent, self.system, self.tools, self.result_tokens = (
            agent,
            system,
            tool_list,
            result_tokens,
        )
        self.task = f"Task {agent}: find and fix the failing test in package p{agent}."
        self.turns: list[tuple[str, str, str]] = []  # (call id, tool name, result)

    def advance(self, turn: int) -> None:
        tool = self.tools[turn % len(self.tools)]["name"]
        self.turns.append(
            (f"call_{self.agent}_{turn}", tool, result_text(self.agent, turn, self.result_tokens))
        )

    def _args(self, i: int) -> dict[str, str]:
        return {"path": f"p{self.agent}/m{i}.py"}

    def baseline_body(self, model: str, tokens: int, native: bool) -> dict[str, Any]:
        """The chat completion sent to mlx_lm.server: the same prompt as ours. A model
        without a tool format of its own gets the tools and calls as mlxcache writes them
        for it (`hermes_messages`), since mlx_lm.server's template would leave them out;
        its reply is not forced into a call."""
        body = self.body("chat", model, tokens)
        if native:
            return {k: v for k, v in body.items() if k != "tool_choice"}
        msgs: list[dict[str, Any]] = [{"role": "user", "content": self.task}]
        for i, (_, name, result) in enumerate(self.turns):
            call = {"name": name, "arguments": self._args(i)}
            msgs += [
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "name": name, "content": result},
            ]
        rendered = hermes_messages(msgs, parse_tools(self.tools), self.system)
        return {"model": model, "messages": rendered, "max_tokens": tokens, "temperature": 0}

    def body(self, route: str, model: str, tokens: int) -> dict[str, Any]:
        if route == "messages":
            msgs: list[dict[str, Any]] = [{"role": "user", "content": self.task}]
            for i, (cid, name, result) in enumerate(self.turns):
                msgs.append(
                    {
                        "role": "assistant",
                        "content": [
                            {"type": "tool_use", "id": cid, "name": name, "input": self._args(i)}
                        ],
                    }
                )
                msgs.append(
                    {
                        "role": "user",
                        "content": [{"type": "tool_result", "tool_use_id": cid, "content": result}],
                    }
                )
            defs = [
                {
                    "name": t["name"],
                    "description": t["description"],
                    "input_schema": t["parameters"],
                }
                for t in self.tools
            ]
            return {
                "model": model,
                "system": self.system,
                "messages": msgs,
                "tools": defs,
                "tool_choice": {"type": "any"},
                "max_tokens": tokens,
                "temperature": 0,
            }
        if route == "responses":
            items: list[dict[str, Any]] = [{"role": "user", "content": self.task}]
            for i, (cid, name, result) in enumerate(self.turns):
                items.append(
                    {
                        "type": "function_call",
                        "call_id": cid,
                        "name": name,
                        "arguments": json.dumps(self._args(i)),
                    }
                )
                items.append({"type": "function_call_output", "call_id": cid, "output": result})
            return {
                "model": model,
                "instructions": self.system,
                "input": items,
                "tools": [{"type": "function", **t} for t in self.tools],
                "tool_choice": "required",
                "max_output_tokens": tokens,
                "temperature": 0,
                "store": False,
            }
        chat: list[dict[str, Any]] = [
            {"role": "system", "content": self.system},
            {"role": "user", "content": self.task},
        ]
        for i, (cid, name, result) in enumerate(self.turns):
            call = {
                "id": cid,
                "type": "function",
                "function": {"name": name, "arguments": json.dumps(self._args(i))},
            }
            chat.append({"role": "assistant", "content": "", "tool_calls": [call]})
            chat.append({"role": "tool", "tool_call_id": cid, "content": result})
        return {
            "model": model,
            "messages": chat,
            "tools": [{"type": "function", "function": t} for t in self.tools],
            "tool_choice": "required",
            "max_tokens": tokens,
            "temperature": 0,
        }


def _events(url: str, path: str, body: dict[str, Any]) -> Iterator[tuple[float, dict[str, Any]]]:
    """The streamed reply's events as they come, each with the time it came."""
    import urllib.request

    req = urllib.request.Request(
        url + path,
        json.dumps(body).encode(),
        {"Content-Type": "application/json", "x-api-key": "bench", "Authorization": "Bearer bench"},
    )
    with urllib.request.urlopen(req, timeout=3600) as resp:
        for line in resp:
            data = line.decode().strip().removeprefix("data:").strip()
            if line.startswith(b"data:") and data != "[DONE]":
                yield time.perf_counter(), json.loads(data)


PATHS = {"chat": "/v1/chat/completions", "messages": "/v1/messages", "responses": "/v1/responses"}


def streamed(url: str, route: str, body: dict[str, Any]) -> tuple[float | None, dict[str, Any]]:
    """Send `body` streamed; (when the first of the reply came: text or a call begun, from
    the request's start; the reply as the route's non-streamed document has it)."""
    start, first = time.perf_counter(), None
    chunks: list[dict[str, Any]] = []
    blocks: list[dict[str, Any]] = []
    doc: dict[str, Any] = {}
    usage = {"stream_options": {"include_usage": True}} if route == "chat" else {}
    for at, event in _events(url, PATHS[route], {**body, "stream": True, **usage}):
        kind = event.get("type")
        if route == "chat":
            chunks.append(chunk(event, url))  # checked once, as `Server.stream` does
            deltas = [c["delta"] for c in event.get("choices") or ()]
            if any(d.get("content") or d.get("tool_calls") for d in deltas):
                first = first or at
        elif route == "messages":
            if kind == "content_block_start":
                blocks.append({**event["content_block"], "partial": ""})
                first = first or (at if blocks[-1]["type"] == "tool_use" else None)
            elif kind == "content_block_delta":
                text = event["delta"].get("text") or event["delta"].get("partial_json") or ""
                blocks[-1]["partial"] += text
                first = first or (at if text else None)
            elif kind == "message_delta":
                doc["usage"], doc["stop"] = event["usage"], event["delta"]["stop_reason"]
        elif kind in ("response.output_text.delta", "response.output_item.added"):
            if kind.endswith("delta") or event["item"]["type"] == "function_call":
                first = first or at
        elif kind in ("response.completed", "response.incomplete"):
            doc = event["response"]
    # Calls streamed before the token limit cut the reply off were begun, not made: the
    # reply (as the non-streamed one has it) has none.
    if route == "chat":
        doc = chat_reply(chunks, url)
        [choice] = doc["choices"]
        if choice["finish_reason"] == "length":
            choice["message"].pop("tool_calls", None)
    elif route == "messages":
        doc["content"] = [
            {"type": "text", "text": b["partial"]}
            if b["type"] == "text"
            else {**b, "input": json.loads(b["partial"] or "{}")}
            for b in blocks
            if b["type"] == "text" or doc.get("stop") != "max_tokens"
        ]
    return (None if first is None else first - start), doc


def reply_of(route: str, doc: dict[str, Any]) -> list[tuple[str, Any]]:
    """The reply's text and calls (name, arguments), whatever the API's shape."""
    if route == "messages":
        blocks = doc["content"]
        text = "".join(b["text"] for b in blocks if b["type"] == "text")
        calls = [(b["name"], b["input"]) for b in blocks if b["type"] == "tool_use"]
    elif route == "responses":
        items = doc["output"]
        text = "".join(c["text"] for i in items if i["type"] == "message" for c in i["content"])
        calls = [
            (i["name"], json.loads(i["arguments"])) for i in items if i["type"] == "function_call"
        ]
    else:
        message = doc["choices"][0]["message"]
        text = message.get("content") or ""
        calls = [
            (c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in message.get("tool_calls") or ()
        ]
    return normal(text, calls)


def normal(text: str, calls: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """A reply as the routes are compared: its text (when there is any, or no call), then
    its calls."""
    return [*([("text", text)] if text or not calls else []), *calls]


def prompt_numbers(route: str, doc: dict[str, Any]) -> tuple[int, int]:
    """(prompt tokens, of which resumed from the cache)."""
    u = doc.get("usage") or {}
    if route == "messages":
        cached = int(u.get("cache_read_input_tokens") or 0)
        return int(u.get("input_tokens", 0)) + cached, cached
    if route == "responses":
        return int(u.get("input_tokens", 0)), int(
            (u.get("input_tokens_details") or {}).get("cached_tokens") or 0
        )
    return int(u.get("prompt_tokens", 0)), int(
        (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    )


def _agents(
    url: str,
    route: str,
    transcripts: list[Transcript],
    turns: int,
    make: Callable[[Transcript], dict[str, Any]],
) -> list[list[dict[str, Any]]]:
    """Every agent's turns (each request's body made by `make`), the agents at once; per
    turn: time to the first of the reply, latency, prompt, resumed, reply."""

    def agent(t: Transcript) -> list[dict[str, Any]]:
        rows = []
        for turn in range(turns):
            start = time.perf_counter()
            ttft, doc = streamed(url, route, make(t))
            latency = time.perf_counter() - start
            prompt, cached = prompt_numbers(route, doc)
            rows.append(
                {
                    "latency_s": latency,
                    "ttft_s": latency if ttft is None else ttft,
                    "prompt": prompt,
                    "cached": cached,
                    "reply": reply_of(route, doc),
                }
            )
            t.advance(turn)
        return rows

    fresh = [Transcript(t.agent, t.system, t.tools, t.result_tokens) for t in transcripts]
    results, _ = _together([functools.partial(agent, t) for t in fresh])
    return results


def _summary(runs: list[list[dict[str, Any]]], turns: int) -> dict[str, Any]:
    per_turn = []
    for turn in range(turns):
        rows = [agent[turn] for agent in runs]
        lat = [r["latency_s"] for r in rows]
        ttft = [r["ttft_s"] for r in rows]
        per_turn.append(
            {
                "turn": turn + 1,
                "ttft_p50_s": round(statistics.median(ttft), 3),
                "ttft_p95_s": _p95(ttft),
                "latency_p50_s": round(statistics.median(lat), 3),
                "latency_p95_s": _p95(lat),
                "resumed": round(
                    sum(r["cached"] for r in rows) / max(sum(r["prompt"] for r in rows), 1), 3
                ),
                "prefilled": sum(r["prompt"] - r["cached"] for r in rows),
                # What the transcript added since the last turn (the last call, its result).
                "new": None
                if turn == 0
                else sum(a[turn]["prompt"] - a[turn - 1]["prompt"] for a in runs),
            }
        )
    later = [r for agent in runs for r in agent[1:]]
    return {
        "per_turn": per_turn,
        "ttft_p50_after_turn_1_s": _p50(r["ttft_s"] for r in later),
        "latency_p50_after_turn_1_s": _p50(r["latency_s"] for r in later),
    }


def _p50(values: Iterable[float]) -> float | None:
    got = list(values)
    return round(statistics.median(got), 3) if got else None


def _p95(values: list[float]) -> float:
    return round(max(values) if len(values) < 20 else sorted(values)[int(0.95 * len(values))], 3)


def run(
    model: str | None = None,
    agents: int = 4,
    turns: int = 8,
    system_tokens: int = 4000,
    tool_count: int = 12,
    result_tokens: int = 300,
    tokens: int = 24,
    block_size: int | None = None,
    baseline: bool = True,
) -> dict[str, Any]:
    """Each route on a fresh server, then mlx_lm.server (never two at once)."""
    loaded = load(model)
    system, tool_list = system_prompt(system_tokens), tools(tool_count)
    transcripts = [Transcript(a, system, tool_list, result_tokens) for a in range(agents)]
    result: dict[str, Any] = {"bench": "agent", "agents": agents, "turns": turns, "tokens": tokens}
    replies: dict[str, list[list[Any]]] = {}
    for route in ROUTES:
        with tempfile.TemporaryDirectory(prefix="mlxcache-bench-agent-") as tmp:
            args = ["--model", str(loaded.path), "--cache-dir", tmp, "--max-tokens", str(tokens)]
            args += [] if block_size is None else ["--block-size", str(block_size)]
            server = MlxcacheServer(args)
            try:
                runs = _agents(
                    server.url,
                    route,
                    transcripts,
                    turns,
                    functools.partial(
                        Transcript.body, route=route, model=server.model, tokens=tokens
                    ),
                )
            finally:
                server.stop()
        replies[route] = [[r["reply"] for r in agent] for agent in runs]
        result[route] = _summary(runs, turns)
    result["routes_same_bytes"] = replies["chat"] == replies["messages"] == replies["responses"]
    result["agent_0_equals_solo_cold"] = (
        _solo(loaded, transcripts[0], turns, tokens) == replies["chat"][0]
    )
    if baseline:
        port = free_port()
        argv = [sys.executable, "-m", "mlx_lm.server", "--model", str(loaded.path)]
        argv += ["--host", "127.0.0.1", "--port", str(port), "--max-tokens", str(tokens)]
        theirs = ChildServer(argv, re.compile(r"Starting httpd"))
        try:
            native = tool_style(
                loaded.tokenizer, parse_tools(tool_list), ToolChoice("required")
            ).native
            make = functools.partial(
                Transcript.baseline_body, model="default_model", tokens=tokens, native=native
            )
            runs = _agents(f"http://127.0.0.1:{port}", "chat", transcripts, turns, make)
        finally:
            theirs.stop()
        result["mlx_lm_chat"] = _summary(runs, turns)
    return _goals(result, baseline, block_size or default_block_size())


def _solo(loaded: Any, transcript: Transcript, turns: int, tokens: int) -> list[Any]:
    """Agent 0's replies, each request alone on a cold engine through the same preparation."""
    from mlxcache.server.prepare import chat
    from mlxcache.server.schemas import ChatRequest

    engine = Engine(loaded)
    t = Transcript(transcript.agent, transcript.system, transcript.tools, transcript.result_tokens)
    out = []
    for turn in range(turns):
        body = ChatRequest.model_validate(t.body("chat", loaded.name, tokens))
        plan = chat(engine, body, SamplingParams(max_tokens=tokens))
        result = engine.complete(plan.request)
        answer = plan.answer(result.text, result.finish_reason)
        out.append(normal(answer.content, [(c.name, c.arguments) for c in answer.calls]))
        t.advance(turn)
    return out


def _goals(result: dict[str, Any], baseline: bool, block: int) -> dict[str, Any]:
    """From turn 2 on, only what the transcript added is prefilled (and what is left of the
    last partial block, per agent); the routes and the solo cold runs agree; latency
    against mlx_lm.server's. The share resumed follows from the sizes (the issue's 95%
    needs its 4k-token system prompt)."""
    later = [row for route in ROUTES for row in result[route]["per_turn"][1:]]
    agents = result["agents"]
    goals: dict[str, Any] = {
        "only_new_tokens_prefilled": all(
            row["prefilled"] <= row["new"] + agents * block for row in later
        ),
        "routes_same_bytes": result["routes_same_bytes"],
        "equals_solo_cold": result["agent_0_equals_solo_cold"],
    }
    if baseline and result["chat"]["ttft_p50_after_turn_1_s"] is not None:
        for what in ("ttft", "latency"):
            ratio = result["chat"][f"{what}_p50_after_turn_1_s"] / max(
                result["mlx_lm_chat"][f"{what}_p50_after_turn_1_s"], 1e-9
            )
            result[f"{what}_vs_mlx_lm"] = round(ratio, 3)
        goals["ttft_vs_mlx_lm"] = result["ttft_vs_mlx_lm"] <= GOAL_VS_MLX_LM
    result["goals"] = goals
    return result
