"""Options shared by every command that runs a model, and the engine they open."""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, TypeVar

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
PromptArg = Annotated[str | None, typer.Argument(help="The prompt; '-' or nothing reads stdin.")]
PromptFile = Annotated[
    Path | None, typer.Option("--prompt-file", "-f", help="Read the prompt from a file.")
]
System = Annotated[str | None, typer.Option("--system", "-s", help="System message.")]
Json = Annotated[bool, typer.Option("--json", help="Print one JSON object instead of plain text.")]


def positive(**values: int) -> None:
    """Sizes and counts given as options must be >= 1."""
    for name, value in values.items():
        if value < 1:
            raise UserInputError(f"--{name.replace('_', '-')} must be >= 1, got {value}")


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


@dataclass(frozen=True, slots=True)
class RunOptions:
    """The model, sampling and cache options every model-running command takes."""

    model: str | None
    max_tokens: int
    temp: float
    top_p: float
    seed: int
    cache_dir: Path | None
    no_cache: bool
    cache_mem: str
    cache_disk: str
    block_size: int

    def sampling(self) -> SamplingParams:
        return sampling(self.max_tokens, self.temp, self.top_p, self.seed)

    def cache(self) -> CacheConfig:
        return cache_config(
            self.cache_dir, self.no_cache, self.cache_mem, self.cache_disk, self.block_size
        )

    def engine(self) -> Engine:
        return engine(self.model, self.cache())


_RUN_OPTIONS: list[tuple[str, Any, Any]] = [
    ("model", Model, None),
    ("max_tokens", MaxTokens, 256),
    ("temp", Temp, 0.0),
    ("top_p", TopP, 1.0),
    ("seed", Seed, 0),
    ("cache_dir", CacheDir, None),
    ("no_cache", NoCache, False),
    ("cache_mem", CacheMem, "2G"),
    ("cache_disk", CacheDisk, "20G"),
    ("block_size", BlockSize, 256),
]
F = TypeVar("F", bound=Callable[..., None])


def with_run_options(max_tokens: int = 256, block_size: int = 256) -> Callable[[F], F]:
    """Give a command the shared options; it receives them as `run: RunOptions`.

    Typer reads a command's options from its signature, so the wrapper's signature is the
    command's own parameters (minus `run`) followed by the shared ones.
    """
    defaults = {"max_tokens": max_tokens, "block_size": block_size}

    def decorate(fn: F) -> F:
        own = [
            p for p in inspect.signature(fn, eval_str=True).parameters.values() if p.name != "run"
        ]
        shared = [
            inspect.Parameter(
                name,
                inspect.Parameter.KEYWORD_ONLY,
                default=defaults.get(name, default),
                annotation=kind,
            )
            for name, kind, default in _RUN_OPTIONS
        ]

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> None:
            run = RunOptions(**{name: kwargs.pop(name) for name, _, _ in _RUN_OPTIONS})
            fn(*args, run=run, **kwargs)

        params = [*own, *shared]
        wrapper.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
        wrapper.__annotations__ = {p.name: p.annotation for p in params}
        return wrapper  # type: ignore[return-value]

    return decorate
