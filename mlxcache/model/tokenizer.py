"""A model folder's tokenizer, loaded by mlx-lm's `load_tokenizer` with less memory.

mlx-lm parses all of `tokenizer.json` into Python objects only to read its `decoder`
(which streaming detokenizer fits), and holds them while the tokenizers library reads the
file again: for Gemma 3's (262k tokens, 515k merges) that is ~170 MB held across the
library's own peak, the largest part of loading the model (measured: the load's peak
~720 MB above the process before it, ~560 MB with this; docs/serving-models.md). Here
its parse keeps the `decoder` alone: the same tokenizer, the same detokenizer.
"""

from __future__ import annotations

import contextlib
import json
import threading
import types
from collections.abc import Iterator
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from mlxcache.errors import UnsupportedModelError

if TYPE_CHECKING:
    from mlxcache.types import Tokenizer

_PATCH = threading.Lock()


def _decoder_only(fid: IO[str]) -> dict[str, Any]:
    """`json.load` of a tokenizer.json, keeping only what mlx-lm's load reads of it."""
    doc = json.load(fid)
    return {"decoder": doc["decoder"]} if isinstance(doc, dict) and "decoder" in doc else {}


_JSON = types.SimpleNamespace(load=_decoder_only, JSONDecodeError=json.JSONDecodeError)


@contextlib.contextmanager
def _lighter_parse() -> Iterator[None]:
    """mlx-lm's tokenizer module parses with `_decoder_only` while the block runs (its one
    use of `json`; one thread at a time)."""
    import mlx_lm.tokenizer_utils as utils

    with _PATCH:
        utils.json = _JSON  # type: ignore[assignment]
        try:
            yield
        finally:
            utils.json = json


def load_tokenizer(path: Path, extra: dict[str, Any], eos_token_ids: Any) -> Tokenizer:
    """mlx-lm's `load_tokenizer(path, extra, eos_token_ids=)`, its parse kept small, and the
    memory its load freed handed back (`sysmem.release_unused`) before the weights load.

    Raises:
        UnsupportedModelError: the tokenizer files cannot be read.
    """
    from mlx_lm.utils import load_tokenizer as mlx_load_tokenizer

    from mlxcache.sysmem import release_unused

    try:
        with _lighter_parse():
            tokenizer: Tokenizer = mlx_load_tokenizer(path, extra, eos_token_ids=eos_token_ids)
    except Exception as exc:  # the tokenizers library raises a plain Exception
        raise UnsupportedModelError(f"cannot load the tokenizer of model {path}: {exc}") from exc
    release_unused()
    return tokenizer
