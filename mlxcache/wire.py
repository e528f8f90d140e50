"""What a running `mlxcache serve` and its clients (`mlxcache.remote`, `--server`) share:
the identity a server publishes on its model card, the request field that asks for a
request's own stats, and messages that name settings. Both ends import this module; the
server never imports the client.

Only the standard library is imported at module level: a command sent to a server must
start fast.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mlxcache.errors import ModelNotFoundError, Setting, Worded

if TYPE_CHECKING:
    from mlxcache.config import CacheConfig
    from mlxcache.engine import Engine
    from mlxcache.model import LoadedModel

USAGE_FIELD = "mlxcache_usage"
"""A request field (ours, not OpenAI's): true adds the request's stats, token ids and raw
text to its usage, as "mlxcache" (what `mlxcache.remote` shows as a command would)."""
_KEY_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def model_source(spec: str) -> dict[str, str]:
    """What `spec` loads, without loading or hashing it: the file or folder it names
    ("source") and a stamp of its files' sizes and modification times ("stamp"; a model
    file changed since a server loaded it gives another). A Hub id is its own source with
    no stamp (resolving it needs the network).

    Raises:
        ModelNotFoundError: a path that does not exist.
    """
    from mlxcache.model.loader import DEFAULT_MODEL, default_model_path

    path = default_model_path() if spec == DEFAULT_MODEL else Path(spec).expanduser()
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise ModelNotFoundError(f"model file not found: {path}")
        files = [path]
    elif path.is_dir():
        files = [path / n for n in _KEY_FILES if (path / n).exists()]
        files += sorted(path.glob("*.safetensors"))
    else:
        return {"source": spec, "stamp": ""}  # a Hub id (or not a model: the server says)
    stamp = hashlib.sha256()
    for file in files:
        st = file.stat()
        stamp.update(f"{file.name}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return {"source": str(path.resolve()), "stamp": stamp.hexdigest()[:16]}


def published(spec: str) -> dict[str, str]:
    """What a server says of the model `spec` loads, without a local path (any client that
    reaches the port reads it): its name, a digest of the file or folder it names (a
    client computes the same from its own spec) and the files' stamp (`model_source`).

    Raises:
        ModelNotFoundError: a path that does not exist.
    """
    from mlxcache.model.loader import DEFAULT_MODEL

    found = model_source(spec)
    source = found["source"]
    name = spec if spec == DEFAULT_MODEL or not Path(source).is_absolute() else Path(source).name
    digest = hashlib.sha256(source.encode()).hexdigest()[:16]
    return {"model": name, "digest": digest, "stamp": found["stamp"]}


def identity(spec: str, engine: Engine, cache: CacheConfig, exact: bool) -> dict[str, Any]:
    """What a server publishes about itself (see the module's docstring); `exact`: False
    when its replies depend on the requests beside them (`serve --batch-inexact`)."""
    import mlx.core as mx
    import mlx_lm

    from mlxcache import __version__

    return {
        **published(spec),
        "family": str(engine.loaded.config.get("model_type", "")),
        "key": engine.loaded.key,
        "block_size": cache.block_size,
        "cache": cache.enabled,
        "kv": kv_label(cache),
        "tailoring": tailoring(engine.loaded),
        "adapter": None if engine.loaded.adapter is None else adapter_card(engine.loaded),
        "exact": exact,
        "version": __version__,
        # What a regress golden records beside the version (`regress.remote`).
        "mlx": getattr(mx, "__version__", "?"),
        "mlx_lm": mlx_lm.__version__,
    }


def tailoring(loaded: LoadedModel) -> str:
    """What an adapter and a chat template add to a model (`model.loader.tailoring_key`;
    "" for neither): a client computes the same from its own options (`tailoring_of`)."""
    from mlxcache.model.loader import tailoring_key

    return tailoring_key(loaded.adapter, loaded.chat_template, loaded.template_args)


def adapter_card(loaded: LoadedModel) -> dict[str, str]:
    """The served adapter as `/v1/models` shows it: its folder's name, kind and digest
    (no local path: any client that reaches the port reads it)."""
    assert loaded.adapter is not None
    return {
        "name": loaded.adapter.path.name,
        "type": loaded.adapter.fine_tune_type,
        "digest": loaded.adapter.digest,
    }


def worded_doc(message: str) -> list[str | dict[str, str]]:
    """A message as JSON, the settings it names kept as such (`Worded`), so the client
    words them as its front end does ("raise --max-tokens")."""
    parts = message.parts if isinstance(message, Worded) else (message,)
    return [p if isinstance(p, str) else {"setting": p.key, "said": p.said} for p in parts]


def worded_from(doc: Any) -> Worded:
    """The message `worded_doc` made."""
    items = doc if isinstance(doc, list) else [str(doc)]
    return Worded(
        *(
            Setting(str(p["setting"]), str(p.get("said", ""))) if isinstance(p, dict) else str(p)
            for p in items
        )
    )


def kv_label(cache: CacheConfig) -> str:
    """The KV quantization as the identity names it ("8-bit, groups of 64"): a server
    quantizing otherwise does not reply as the command would."""
    if cache.kv_bits is None:
        return "full precision"
    return f"{cache.kv_bits}-bit, groups of {cache.kv_group_size}"
