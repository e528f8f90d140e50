"""`mlxcache generate`: one prompt in, one streamed reply out."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from mlxcache.engine import Request
from mlxcache.errors import UserInputError
from mlxcache.events import Done, Token
from mlxcache_cli import options as o
from mlxcache_cli import ui


def generate(
    prompt: Annotated[
        str | None, typer.Argument(help="The prompt; '-' or nothing reads stdin.")
    ] = None,
    prompt_file: Annotated[
        Path | None, typer.Option("--prompt-file", "-f", help="Read the prompt from a file.")
    ] = None,
    system: Annotated[str | None, typer.Option("--system", "-s", help="System message.")] = None,
    raw: Annotated[
        bool, typer.Option("--raw", help="Send the prompt as is, without the chat template.")
    ] = False,
    model: o.Model = None,
    max_tokens: o.MaxTokens = 256,
    temp: o.Temp = 0.0,
    top_p: o.TopP = 1.0,
    seed: o.Seed = 0,
    as_json: o.Json = False,
    cache_dir: o.CacheDir = None,
    no_cache: o.NoCache = False,
    cache_mem: o.CacheMem = "2G",
    cache_disk: o.CacheDisk = "20G",
    block_size: o.BlockSize = 256,
) -> None:
    """Generate a reply to PROMPT, streamed to stdout; stats go to stderr."""
    text = o.read_prompt(prompt, prompt_file)
    params = o.sampling(max_tokens, temp, top_p, seed)
    cache = o.cache_config(cache_dir, no_cache, cache_mem, cache_disk, block_size)
    if raw and system is not None:
        raise UserInputError("--system needs the chat template; drop --raw")
    engine = o.engine(model, cache)
    if raw:
        ids = engine.encode(text)
    else:
        messages = [{"role": "system", "content": system}] if system is not None else []
        ids = engine.encode_chat([*messages, {"role": "user", "content": text}])
    for event in engine.generate(Request(ids, params)):
        if isinstance(event, Token) and not as_json:
            ui.out_text(event.text)
        elif isinstance(event, Done):
            result = event.result
            if as_json:
                ui.out_json(
                    {
                        "text": result.text,
                        "tokens": result.tokens,
                        "finish_reason": result.finish_reason,
                        "stats": result.stats.as_dict(),
                    }
                )
            else:
                ui.out_text("\n")
            ui.stats_line(result.stats.as_dict())
