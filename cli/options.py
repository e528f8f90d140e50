"""Options shared by every command that runs a model, and the engine they open."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from mlxcache.config import CacheConfig, parse_size
from mlxcache.engine import Engine
from mlxcache.errors import UserInputError
from mlxcache.runtime import open_engine
from mlxcache.sampling import SamplingParams
from mlxcache_cli import ui

Model = Annotated[
    str | None,
    typer.Option(
        "--model", "-m", help="smollm2-135m (default), a .gguf file, an mlx-lm folder or a Hub id."
    ),
]
MaxTokens = Annotated[int, typer.Option("--max-tokens", "-n", help="Most tokens to generate.")]
Temp = Annotated[float, typer.Option("--temp", "-t", help="Sampling temperature; 0 is greedy.")]
TopP = Annotated[float, typer.Option("--top-p", help="Nucleus sampling mass.")]
Seed = Annotated[int, typer.Option("--seed", help="Seed: the same seed gives the same reply.")]
CacheDir = Annotated[
    Path | None,
    typer.Option(
        "--cache-dir",
        envvar="MLXCACHE_CACHE_DIR",
        help="Cache directory (disk tier, converted models).",
    ),
]
NoCache = Annotated[bool, typer.Option("--no-cache", help="Prefill from token 0 and keep nothing.")]
CacheMem = Annotated[str, typer.Option("--cache-mem", help="Memory tier budget, e.g. 2G.")]
CacheDisk = Annotated[
    str, typer.Option("--cache-disk", help="Disk tier budget, e.g. 20G; 0 disables it.")
]
BlockSize = Annotated[
    int, typer.Option("--block-size", help="Cache block / prefill chunk length in tokens.")
]
Json = Annotated[bool, typer.Option("--json", help="Print one JSON object instead of plain text.")]


def sampling(max_tokens: int, temp: float, top_p: float, seed: int) -> SamplingParams:
    """Sampling settings from options; bad values become user errors."""
    try:
        return SamplingParams(temperature=temp, top_p=top_p, seed=seed, max_tokens=max_tokens)
    except ValueError as exc:
        raise UserInputError(str(exc).replace("max_tokens", "--max-tokens")) from exc


def cache_config(
    cache_dir: Path | None, no_cache: bool, mem: str, disk: str, block_size: int
) -> CacheConfig:
    try:
        return CacheConfig(
            enabled=not no_cache,
            directory=cache_dir,
            block_size=block_size,
            mem_bytes=parse_size(mem),
            disk_bytes=parse_size(disk),
        )
    except ValueError as exc:
        raise UserInputError(str(exc)) from exc


def engine(model: str | None, cache: CacheConfig) -> Engine:
    """Open the engine, with a progress bar on stderr if a GGUF needs converting."""
    with ui.progress_bar() as update:
        return open_engine(model, cache, progress=update, on_warning=ui.warn)


def read_prompt(prompt: str | None, prompt_file: Path | None) -> str:
    """The prompt from the argument, `-` (stdin) or --prompt-file; never empty."""
    if prompt is not None and prompt_file is not None:
        raise UserInputError("give the prompt as an argument or with --prompt-file, not both")
    if prompt_file is not None:
        try:
            text = prompt_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise UserInputError(f"cannot read prompt file {prompt_file}: {exc}") from exc
    elif prompt is None or prompt == "-":
        if prompt is None and sys.stdin.isatty():
            raise UserInputError(
                "no prompt: pass it as an argument, '-' for stdin, or --prompt-file"
            )
        text = sys.stdin.read()
    else:
        text = prompt
    if not text.strip():
        raise UserInputError("the prompt is empty")
    return text
