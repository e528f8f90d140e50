"""The models a server of several serves (`serve -m A -m B`, `--models FILE`): one
`ModelEntry` each, read from a YAML models file or made from a model spec, their names
checked to name one model each (`mlxcache.fleet` serves them)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from mlxcache.errors import UserInputError

LOAD = {"load": True}
"""Field metadata of a `ModelEntry` option passed to the model's load as a keyword."""


@dataclass(frozen=True, slots=True)
class ModelEntry:
    """One served model: a line of the models file, or one `serve -m SPEC`.

    A field whose metadata is `LOAD` is passed to the load call as a keyword argument of
    its own name (`load_options`): a new load option is one such field."""

    name: str
    model: str
    """The model spec (`mlxcache.model.load`)."""
    aliases: tuple[str, ...] = ()
    kv_bits: int | None = None
    """KV width: the memory and disk tiers' KV quantized to these bits (None: serve's own)."""
    adapter: str | None = field(default=None, metadata=LOAD)
    """A fine-tune folder `mlx_lm.lora` saved (`model.load`'s `adapter`)."""
    chat_template: str | None = field(default=None, metadata=LOAD)
    chat_template_args: dict[str, Any] | None = field(default=None, metadata=LOAD)

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)

    def load_options(self) -> dict[str, Any]:
        """The keyword arguments the model's load call takes from this entry."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.metadata.get("load")}


ENTRY_KEYS = {f.name for f in fields(ModelEntry)}


def entries_from(doc: Any, where: str) -> list[ModelEntry]:
    """The entries of a models file's document: a list of mappings (or `{models: [...]}`),
    each with `model` and optional `name` (default: the spec's name), `aliases`,
    `kv_bits`, `adapter`, `chat_template` and `chat_template_args`.

    Raises:
        UserInputError: a wrong shape, a missing spec, an unknown key, a repeated name.
    """
    items = doc.get("models") if isinstance(doc, dict) else doc
    if not isinstance(items, list) or not items:
        raise UserInputError(f"{where}: expected a non-empty list of models (name, model, ...)")
    out = []
    for i, item in enumerate(items):
        at = f"{where}: model {i + 1}"
        if not isinstance(item, dict):
            raise UserInputError(f"{at}: expected a mapping (name: ..., model: ...)")
        unknown = sorted(str(k) for k in item if k not in ENTRY_KEYS)
        if unknown:
            known = ", ".join(sorted(ENTRY_KEYS))
            raise UserInputError(f"{at}: unknown key {unknown[0]!r} (keys: {known})")
        spec = item.get("model")
        if not isinstance(spec, str) or not spec.strip():
            raise UserInputError(f"{at}: 'model' must be a model spec (a path, a name, a Hub id)")
        aliases = item.get("aliases", [])
        if isinstance(aliases, str):
            aliases = [aliases]
        if not isinstance(aliases, list) or not all(isinstance(a, str) and a for a in aliases):
            raise UserInputError(f"{at}: 'aliases' must be a list of names")
        bits = item.get("kv_bits")
        if bits is not None and (isinstance(bits, bool) or not isinstance(bits, int)):
            raise UserInputError(f"{at}: 'kv_bits' must be a whole number of bits")
        name = item.get("name", spec_name(spec))
        if not isinstance(name, str) or not name.strip():
            raise UserInputError(f"{at}: 'name' must be a non-empty name")
        for key in ("adapter", "chat_template"):
            if item.get(key) is not None and not isinstance(item[key], str):
                raise UserInputError(f"{at}: '{key}' must be text (a path)")
        if item.get("chat_template_args") is not None and not isinstance(
            item["chat_template_args"], dict
        ):
            raise UserInputError(f"{at}: 'chat_template_args' must be a mapping")
        extra = {k: v for k, v in item.items() if k not in ("name", "model", "aliases", "kv_bits")}
        out.append(ModelEntry(name, spec, tuple(aliases), bits, **extra))
    return out


def read_models_file(path: Path) -> list[ModelEntry]:
    """The entries of a YAML models file (see `entries_from`).

    Raises:
        UserInputError: the file cannot be read or is not such a list.
    """
    import yaml

    from mlxcache.fileio import load_yaml

    try:
        doc = load_yaml(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise UserInputError(f"cannot read models file {path}: {exc}") from exc
    except yaml.YAMLError as exc:
        raise UserInputError(
            f"models file {path} is not YAML: {' '.join(str(exc).split())}"
        ) from exc
    return [_beside(path.parent, e) for e in entries_from(doc, str(path))]


def _beside(folder: Path, entry: ModelEntry) -> ModelEntry:
    """`entry` with the files it names relative to its models file found beside that file,
    wherever serve runs: its adapter, and its chat template where such a file is there
    (else the template is Jinja text, or a path from the working directory)."""
    if entry.adapter is not None and not Path(entry.adapter).expanduser().is_absolute():
        entry = replace(entry, adapter=str(folder / entry.adapter))
    template = entry.chat_template
    if template is not None and "\n" not in template and not Path(template).is_absolute():
        with contextlib.suppress(OSError):  # text too long to be a path: Jinja
            if (folder / template).is_file():
                entry = replace(entry, chat_template=str(folder / template))
    return entry


def spec_name(spec: str) -> str:
    """The name a model spec is served as by default: its file or folder name for a path,
    else the spec itself (a packaged name, a Hub id) — what `load` names it."""
    from mlxcache.model.loader import spec_kind

    if spec_kind(spec) in ("gguf", "folder"):
        return Path(spec).expanduser().name
    return spec


def check_names(entries: list[ModelEntry]) -> None:
    """Every name and alias must name one model.

    Raises:
        UserInputError: a name given twice (say which models share it).
    """
    seen: dict[str, str] = {}
    for entry in entries:
        for name in entry.names:
            if not name.strip():
                raise UserInputError(f"model {entry.name!r}: an empty alias")
            if name in seen:
                raise UserInputError(
                    f"the name {name!r} is given to two models ({seen[name]!r} and "
                    f"{entry.name!r}): give one of them another name"
                )
            seen[name] = entry.name
