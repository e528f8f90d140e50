"""`mlxcache bench …`: each benchmark prints one JSON line on stdout, ratios against its baseline."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from mlxcache.errors import UserInputError
from mlxcache_cli import options as o
from mlxcache_cli import ui

Rounds = Annotated[int, typer.Option("--rounds", help="Interleaved rounds.", metavar="N")]


def failed_goals(result: Any, path: str = "") -> list[str]:
    """Where `result` says a goal failed: every `pass` / `*_pass` key that is false, and
    every false entry of a `goals` object, as dotted paths."""
    if not isinstance(result, dict):
        return []
    failed = []
    for key, value in result.items():
        here = f"{path}{key}"
        if value is False and (key == "pass" or key.endswith("_pass") or path.endswith("goals.")):
            failed.append(here)
        failed += failed_goals(value, here + ".")
    return failed


def _report(result: dict[str, Any]) -> None:
    """The result as one JSON line on stdout; on stderr, one line saying whether every goal
    was met. Exit 1 when one was not, so a script or CI can tell."""
    ui.out_json(result)
    name = f"bench {result.get('bench', '')}".rstrip()
    failed = failed_goals(result)
    if failed:
        # A bench that says what failed (`failures`) is quoted; else the goals' paths.
        said = result.get("failures")
        ui.error(f"{name}: goal not met: {'; '.join(said) if said else ', '.join(failed)}")
        raise typer.Exit(1)
    ui.info(f"{name}: every goal met")


def decode(
    model: o.Model = None,
    tokens: Annotated[
        int, typer.Option("--tokens", help="Tokens generated per round.", metavar="N")
    ] = 32,
    rounds: Annotated[
        int, typer.Option("--rounds", help="Interleaved rounds of each loop.", metavar="N")
    ] = 3,
    adapter: o.AdapterOpt = None,
) -> None:
    """Decode tokens/s of mlxcache's loop vs mlx_lm.stream_generate (goal: ratio >= 0.97)."""
    from mlxcache.bench import decode_bench

    o.positive(tokens=tokens, rounds=rounds)
    _report(decode_bench.run(model, tokens, rounds, None if adapter is None else str(adapter)))


def adapter(
    model: o.Model = None,
    adapter: Annotated[
        Path | None,
        typer.Option(
            "--adapter",
            "--adapter-path",
            metavar="DIR",
            help="An mlx_lm.lora folder (default: a random LoRA with mlx_lm.lora's defaults).",
        ),
    ] = None,
    tokens: Annotated[
        int, typer.Option("--tokens", help="Tokens generated per round.", metavar="N")
    ] = 32,
    rounds: Annotated[
        int, typer.Option("--rounds", help="Interleaved rounds of each loop.", metavar="N")
    ] = 3,
) -> None:
    """Decode tokens/s with a LoRA adapter vs mlx-lm's adapter generate (goal: ratio >= 0.95,
    the same tokens), vs the base model and vs the adapter fused into the weights."""
    from mlxcache.bench import adapter_bench

    o.positive(tokens=tokens, rounds=rounds)
    _report(adapter_bench.run(model, adapter, tokens, rounds))


def index(
    slots: Annotated[int, typer.Option("--slots", help="Prompt index slots.", metavar="N")] = 200,
    runs: Annotated[
        int, typer.Option("--runs", help="Repetitions of the workload.", metavar="N")
    ] = 3,
    turns: Annotated[int, typer.Option("--turns", help="Conversation turns.", metavar="N")] = 220,
    scale_slots: Annotated[
        int,
        typer.Option(
            "--scale-slots", metavar="N", help="Also run at this many slots (victim p50 within 2x)."
        ),
    ] = 2000,
    block_size: o.BlockSize = None,
) -> None:
    """Prompt index lookup/keep/victim latency vs mlx-lm's LRUPromptCache on a forking chat."""
    from mlxcache.bench import index_bench

    o.positive(slots=slots, runs=runs, turns=turns)
    if block_size is not None:
        o.positive(block_size=block_size)
    _report(index_bench.run_scaled(slots, runs, turns, scale_slots, block_size))


def chunks(
    model: o.Model = None,
    tokens: Annotated[
        int, typer.Option("--tokens", help="Prompt tokens prefilled per size.", metavar="N")
    ] = 512,
    rounds: Rounds = 2,
) -> None:
    """Prefill tokens/s per chunk size (8...512) on this device, and the block size it suggests."""
    from mlxcache.bench import chunks_bench

    o.positive(tokens=tokens, rounds=rounds)
    _report(chunks_bench.run(model, tokens, rounds))


def chat(
    model: o.Model = None,
    max_tokens: Annotated[
        int, typer.Option("--max-tokens", "-n", help="Reply length cap.", metavar="N")
    ] = 100,
    block_size: o.BlockSize = None,
    turns: Annotated[
        int, typer.Option("--turns", help="Turns of the conversation (2 to 5).", metavar="N")
    ] = 5,
) -> None:
    """A chat of up to 5 turns: warm-ahead (waited for, and not) and no warm-ahead vs
    mlx-lm's kept KV; fails unless turns 2+ are as fast as mlx-lm's, in every way."""
    from mlxcache.bench import chat_bench

    o.positive(max_tokens=max_tokens, turns=turns)
    if block_size is not None:
        o.positive(block_size=block_size)
    _report(chat_bench.run(model, max_tokens, block_size, turns))


def json(
    model: o.Model = None,
    tokens: Annotated[int, typer.Option("--tokens", help="Tokens per round.", metavar="N")] = 32,
    rounds: Rounds = 3,
    lines: Annotated[
        int,
        typer.Option(
            "--lines", metavar="N", help="Batch lines sharing the instructions (50 on Metal)."
        ),
    ] = 6,
    block_size: o.BlockSize = 64,
) -> None:
    """JSON-mode tok/s vs plain generation; batch time per request with vs without the cache."""
    from mlxcache.bench import json_bench

    o.positive(tokens=tokens, rounds=rounds, lines=lines, block_size=block_size)
    _report(json_bench.run(model, tokens, rounds, lines, block_size))


def resume(
    model: o.Model = None,
    turns: Annotated[
        int, typer.Option("--turns", metavar="N", help="Chat turns (~25 tokens each).")
    ] = 4,
    block_size: o.BlockSize = 16,
    prefix_tokens: Annotated[
        int,
        typer.Option(
            "--prefix-tokens", help="Shared prefix the second process reuses.", metavar="N"
        ),
    ] = 1500,
) -> None:
    """TTFT with the prompt cache vs without: warm turns, disk tier, second process, fork bytes."""
    from mlxcache.bench import resume_bench

    o.positive(turns=turns, block_size=block_size, prefix_tokens=prefix_tokens)
    _report(resume_bench.run(model, turns, block_size, prefix_tokens))


def schemas(
    folder: Annotated[
        Path, typer.Argument(metavar="DIR", help="Folder of JSON Schemas (*.json, recursively).")
    ],
    generate: Annotated[
        int, typer.Option("--generate", metavar="N", help="Also run the first N compiled ones.")
    ] = 0,
    model: o.Model = None,
    max_tokens: Annotated[
        int,
        typer.Option(
            "--max-tokens", "-n", help="Token limit of each --generate reply.", metavar="N"
        ),
    ] = 256,
    peer: Annotated[
        str | None,
        typer.Option(
            "--peer",
            metavar="NAME",
            help="Also run the --generate schemas through llguidance in mlx-lm's own loop.",
        ),
    ] = None,
) -> None:
    """JSON Schema coverage: compiled, refused by kind, crashes, compile time (lenient vs --strict)."""
    from mlxcache.bench import schemas_bench

    if not folder.is_dir():
        raise UserInputError(f"{folder} is not a folder of JSON Schemas")
    o.positive(max_tokens=max_tokens)
    if generate < 0:
        raise UserInputError(f"--generate must be >= 0, got {generate}")
    if peer is not None and peer not in schemas_bench.PEERS:
        raise UserInputError(
            f"--peer must be one of: {', '.join(schemas_bench.PEERS)}; got {peer!r}"
        )
    if peer is not None and not generate:
        raise UserInputError("--peer compares generated replies: give --generate N too")
    _report(schemas_bench.run(folder, generate, model, max_tokens, peer, on_reply=ui.info))


def serve(
    model: o.Model = None,
    clients: Annotated[
        int, typer.Option("--clients", help="Concurrent chat clients.", metavar="N")
    ] = 4,
    turns: Annotated[int, typer.Option("--turns", help="Turns per conversation.", metavar="N")] = 4,
    tokens: Annotated[int, typer.Option("--tokens", help="Tokens per reply.", metavar="N")] = 60,
    load_requests: Annotated[
        int, typer.Option("--load-requests", help="Short requests of the load test.", metavar="N")
    ] = 64,
    load_clients: Annotated[
        int,
        typer.Option("--load-clients", help="Concurrent clients of the load test.", metavar="N"),
    ] = 16,
    baseline: Annotated[
        bool, typer.Option("--baseline/--no-baseline", help="Also run mlx_lm.server.")
    ] = True,
    block_size: o.BlockSize = None,
    many_clients: Annotated[
        int,
        typer.Option(
            "--many-clients",
            help="Also a load profile on both servers: N streaming clients at once (0: off).",
            metavar="N",
        ),
    ] = 0,
    many_requests: Annotated[
        int, typer.Option("--many-requests", help="Requests per client of it.", metavar="N")
    ] = 2,
    many_tokens: Annotated[
        int, typer.Option("--many-tokens", help="Tokens per reply of it.", metavar="N")
    ] = 16,
) -> None:
    """mlxcache serve vs mlx_lm.server (openai client, loopback): TTFT, cache, exactness, load."""
    from mlxcache.bench import serve_bench

    o.positive(
        clients=clients,
        turns=turns,
        tokens=tokens,
        load_requests=load_requests,
        load_clients=load_clients,
        block_size=block_size or 1,
        many_requests=many_requests,
        many_tokens=many_tokens,
    )
    if many_clients < 0:
        raise UserInputError(f"--many-clients must be >= 0, got {many_clients}")
    _report(
        serve_bench.run(
            model,
            clients,
            turns,
            tokens,
            load_requests,
            load_clients,
            baseline=baseline,
            block_size=block_size,
            many_clients=many_clients,
            many_requests=many_requests,
            many_tokens=many_tokens,
        )
    )


def reuse(
    model: Annotated[
        str | None,
        typer.Option(
            "--model", "-m", help="Also a real model (a .gguf, an mlx-lm folder).", metavar="MODEL"
        ),
    ] = None,
    block_size: o.BlockSize = 16,
) -> None:
    """Share of a shared prefix each model family resumes (one JSON line each), vs full
    attention; bytes kept per token vs the model's KV; replies vs --no-cache. Exit 1 when a
    goal fails."""
    from mlxcache.bench import reuse_bench

    o.positive(block_size=block_size)
    *rows, summary = reuse_bench.run(model, block_size)
    for row in rows:
        ui.out_json(row)
    _report(summary)


def startup(
    rounds: Annotated[int, typer.Option("--rounds", help="Interleaved rounds.", metavar="N")] = 5,
    cache_dir: o.CacheDir = None,
    server: Annotated[
        str | None,
        typer.Option(
            "--server",
            metavar="URL",
            help="Also time a short generate through the `mlxcache serve` at URL (goal: <= 1 s).",
        ),
    ] = None,
    model: Annotated[
        str | None,
        typer.Option(
            "--model",
            "-m",
            help="The model the --server runs and --one-shot times (default: the embedded one).",
            metavar="MODEL",
        ),
    ] = None,
    one_shot: Annotated[
        int,
        typer.Option(
            "--one-shot",
            metavar="N",
            help="Also time N rounds of a cached one-shot generate and json on a ~500-token "
            "prompt vs mlx_lm.generate on it (goal: <= 0.5x each).",
        ),
    ] = 0,
) -> None:
    """Wall time of --help, --version, a typo, json --check, cache ls and models ls vs
    `python -c pass`, each in a new process (goal: <= 0.5 s each, fastest round); with
    --server, of a repeated short generate through a running server too (goal: <= 1 s)."""
    from mlxcache_cli import startup_bench

    o.positive(rounds=rounds)
    if one_shot < 0:
        raise UserInputError(f"--one-shot must be >= 0, got {one_shot}")
    _report(startup_bench.run(rounds, cache_dir, server, model, one_shot))


def distributed(
    model: o.Model = None,
    ranks: Annotated[
        str, typer.Option("--ranks", help="Numbers of local ranks, comma-separated.", metavar="N,N")
    ] = "1,2,3",
    block_size: o.BlockSize = 16,
    tokens: Annotated[
        int, typer.Option("--tokens", help="Tokens generated per request.", metavar="N")
    ] = 8,
) -> None:
    """The model sharded over 1, 2 and 3 local ranks (ring over loopback): TTFT cold and
    resumed and decode tokens/s vs one process, every rank's cache counters; goals:
    resumed == cold in every run, every rank's counters equal rank 0's."""
    from mlxcache.bench import distributed_bench

    try:
        sizes = tuple(int(n) for n in ranks.split(","))
    except ValueError:
        raise UserInputError(
            f"--ranks must be numbers separated by commas, got {ranks!r}"
        ) from None
    block_size = 16 if block_size is None else block_size
    o.positive(ranks=min(sizes), block_size=block_size, tokens=tokens)
    _report(distributed_bench.run(model, sizes, block_size, tokens))


def spec(
    model: o.Model = None,
    draft_model: Annotated[
        str | None,
        typer.Option(
            "--draft-model",
            metavar="MODEL",
            help="The draft model to compare (default: the model itself, which measures the "
            "mechanics only).",
        ),
    ] = None,
    lines: Annotated[
        int, typer.Option("--lines", help="Lines of the code file to rewrite.", metavar="N")
    ] = 60,
    tokens: Annotated[
        int,
        typer.Option(
            "--tokens",
            help="Most tokens per reply (a JSON reply: at least 160, room for its document).",
            metavar="N",
        ),
    ] = 160,
    draft_tokens: Annotated[
        int, typer.Option("--draft-tokens", help="Tokens drafted per verify.", metavar="K")
    ] = 4,
    suite: Annotated[
        Path | None,
        typer.Option(
            "--suite",
            metavar="FILE",
            help="A regress suite to run as a workload (default: examples/smoke.yaml, if here).",
        ),
    ] = None,
    rounds: Rounds = 2,
    cache_dir: o.CacheDir = None,
    sweep: Annotated[
        bool,
        typer.Option(
            "--sweep",
            help="Measure the drafting defaults instead: every lookup n-gram size and k "
            "replayed over the workloads' plain replies, with the decode time this device's "
            "verify costs predict.",
        ),
    ] = False,
) -> None:
    """Speculative decoding (lookup, a draft model, auto) against plain decoding, per workload:
    forwards per token, acceptance, decode time, mlx_lm with the same draft model, bytes."""
    from mlxcache.bench import spec_bench

    o.positive(lines=lines, tokens=tokens, draft_tokens=draft_tokens, rounds=rounds)
    _check_suite(suite)
    if sweep:
        for row in spec_bench.sweep(model, lines, tokens, suite, cache_dir):
            ui.out_json(row)
        return
    rows = list(
        spec_bench.run(model, draft_model, lines, tokens, draft_tokens, suite, cache_dir, rounds)
    )
    for row in rows[:-1]:
        ui.out_json(row)
    _report(rows[-1])


def agent(
    model: o.Model = None,
    agents: Annotated[int, typer.Option("--agents", help="Agents at once.", metavar="N")] = 4,
    turns: Annotated[int, typer.Option("--turns", help="Turns per agent.", metavar="N")] = 8,
    system_tokens: Annotated[
        int, typer.Option("--system-tokens", help="The system prompt's length.", metavar="N")
    ] = 4000,
    tools: Annotated[int, typer.Option("--tools", help="Tools defined.", metavar="N")] = 12,
    result_tokens: Annotated[
        int, typer.Option("--result-tokens", help="Each tool result's length.", metavar="N")
    ] = 300,
    tokens: Annotated[
        int, typer.Option("--tokens", help="Most tokens per reply.", metavar="N")
    ] = 24,
    block_size: o.BlockSize = None,
    no_baseline: Annotated[bool, typer.Option("--no-baseline", help="Skip mlx_lm.server.")] = False,
) -> None:
    """An agent's workload through /v1/chat/completions, /v1/messages and /v1/responses, and
    mlx_lm.server: time to the first of the reply, latency, prompt resumed and prefilled per
    turn, same bytes everywhere."""
    from mlxcache.bench import agent_bench

    o.positive(agents=agents, turns=turns, system_tokens=system_tokens, tools=tools)
    o.positive(result_tokens=result_tokens, tokens=tokens)
    _report(
        agent_bench.run(
            model,
            agents,
            turns,
            system_tokens,
            tools,
            result_tokens,
            tokens,
            block_size,
            not no_baseline,
        )
    )


def models(
    minutes: Annotated[
        float, typer.Option("--minutes", help="How long requests alternate.", metavar="M")
    ] = 3.0,
    tokens: Annotated[
        int, typer.Option("--tokens", help="Most tokens per reply.", metavar="N")
    ] = 8,
    mem_limit: Annotated[
        str | None,
        typer.Option(
            "--mem-limit",
            metavar="SIZE",
            help="The served pair's budget \\[default: the idle server, the larger model and "
            "half the smaller, as measured].",
        ),
    ] = None,
) -> None:
    """SmolLM2 and Gemma 3 270M behind one server under a memory limit that holds one of
    them: switches, reload time vs each model's own load, peak memory, replies vs solo."""
    from mlxcache.bench import models_bench

    o.positive(tokens=tokens)
    if minutes <= 0:
        raise UserInputError("--minutes must be > 0")
    _report(models_bench.run(minutes, tokens, o.mem_limit_bytes(mem_limit)))


def memory(
    model: o.Model = None,
    only: Annotated[
        str,
        typer.Option(
            "--only", metavar="PARTS", help="Parts to run, comma-separated: soak,context,quality."
        ),
    ] = "soak,context,quality",
    minutes: Annotated[
        float, typer.Option("--minutes", help="The soak's length.", metavar="M")
    ] = 20.0,
    hours: Annotated[
        float | None,
        typer.Option("--hours", help="A real soak's length (instead of --minutes).", metavar="H"),
    ] = None,
    conversations: Annotated[
        int, typer.Option("--conversations", help="Growing conversations.", metavar="N")
    ] = 12,
    concurrency: Annotated[
        int, typer.Option("--concurrency", help="Conversations at once.", metavar="N")
    ] = 4,
    turns: Annotated[
        int, typer.Option("--turns", help="Turns before a conversation starts over.", metavar="N")
    ] = 6,
    tokens: Annotated[
        int, typer.Option("--tokens", help="Most tokens per reply.", metavar="N")
    ] = 16,
    mem_limit: Annotated[
        str | None,
        typer.Option(
            "--mem-limit",
            metavar="SIZE",
            help="The soak server's budget \\[default: the idle server plus a third of the "
            "conversations' KV, at least 96 MiB].",
        ),
    ] = None,
    interval: Annotated[
        float, typer.Option("--interval", help="Seconds between memory samples.", metavar="S")
    ] = 10.0,
    context_tokens: Annotated[
        int, typer.Option("--context-tokens", help="The context part's prompt.", metavar="N")
    ] = 512,
    cache_mem: Annotated[
        str, typer.Option("--cache-mem", help="The context part's memory tier.", metavar="SIZE")
    ] = "256M",
    document_tokens: Annotated[
        int, typer.Option("--document-tokens", help="The quality part's document.", metavar="N")
    ] = 2000,
    suite: Annotated[
        Path | None,
        typer.Option(
            "--suite",
            metavar="FILE",
            help="A regress suite whose replies the quality part compares "
            "(default: examples/smoke.yaml, if here).",
        ),
    ] = None,
) -> None:
    """Memory over a soak against `serve --mem-limit`, the longest context and tokens per MB
    at each --kv-bits, and what quantized KV costs in log-probabilities."""
    from mlxcache.bench import memory_bench
    from mlxcache.config import parse_size

    parts = tuple(p.strip() for p in only.split(",") if p.strip())
    unknown = [p for p in parts if p not in memory_bench.PARTS]
    if unknown or not parts:
        raise UserInputError(f"--only takes {','.join(memory_bench.PARTS)}, got {only!r}")
    o.positive(conversations=conversations, concurrency=concurrency, turns=turns, tokens=tokens)
    o.positive(context_tokens=context_tokens, document_tokens=document_tokens)
    _check_suite(suite)
    length = 60 * hours if hours is not None else minutes
    if length <= 0 or interval <= 0:
        raise UserInputError("--minutes, --hours and --interval must be > 0")
    limit = o.mem_limit_bytes(mem_limit)
    try:
        mem = parse_size(cache_mem)
    except ValueError as exc:
        raise UserInputError(str(exc)) from exc
    settings = memory_bench.SoakSettings(
        length, conversations, concurrency, turns, tokens, limit, interval
    )
    _report(
        memory_bench.run(
            model,
            parts,
            settings,
            context_tokens=context_tokens,
            cache_mem=mem,
            document_tokens=document_tokens,
            suite=suite,
        )
    )


def _check_suite(suite: Path | None) -> None:
    """A --suite read and checked before the bench does any work (a bad one is one line at
    once, not after minutes of the bench's other workloads).

    Raises:
        UserInputError: the file cannot be read or is not a suite.
    """
    if suite is not None:
        from mlxcache.regress.suite import load

        load(suite)
