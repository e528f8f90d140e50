"""Domain errors: the library raises these; only `cli/` turns them into exit codes.

A message that names a setting carries it as data (`Worded`), so each front end names it
its own way (the CLI by its flag, the server by its request field) without reading prose.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Setting:
    """A setting a message names: `key` (the library's API name), and the words the
    library's own message uses for it (default: the key)."""

    key: str
    said: str = ""

    def words(self, names: Mapping[str, str]) -> str:
        return names.get(self.key, self.said or self.key)


class Worded(str):
    """A message naming settings. As a str it reads as the library says it
    ("raise max_tokens"); `worded(names)` puts a front end's names for the settings
    (`Setting.key` -> words, e.g. "max_tokens" -> "--max-tokens") in their place."""

    parts: tuple[str | Setting, ...]

    def __new__(cls, *parts: str | Setting) -> Worded:
        flat = tuple(q for p in parts for q in (p.parts if isinstance(p, Worded) else (p,)))
        self = super().__new__(
            cls, "".join(p.words({}) if isinstance(p, Setting) else p for p in flat)
        )
        self.parts = flat
        return self

    @property
    def settings(self) -> tuple[str, ...]:
        """The keys of the settings named, in order."""
        return tuple(p.key for p in self.parts if isinstance(p, Setting))

    def worded(self, names: Mapping[str, str]) -> str:
        return "".join(p.words(names) if isinstance(p, Setting) else p for p in self.parts)

    def __add__(self, other: str) -> Worded:  # text added on either side keeps the settings
        return Worded(self, other)

    def __radd__(self, other: str) -> Worded:
        return Worded(other, self)


def worded(message: object, names: Mapping[str, str]) -> str:
    """`message` (an error or a message) with the settings it names in a front end's words."""
    text = message.args[0] if isinstance(message, BaseException) and message.args else message
    return text.worded(names) if isinstance(text, Worded) else str(message)


def settings_named(message: object) -> tuple[str, ...]:
    """The keys of the settings `message` (an error or a message) names, if any."""
    text = message.args[0] if isinstance(message, BaseException) and message.args else message
    return text.settings if isinstance(text, Worded) else ()


class MlxcacheError(Exception):
    """Base of every error the library raises on purpose (`cli/` maps each kind to an exit code)."""


class UserInputError(MlxcacheError):
    """The request itself is wrong (empty prompt, bad option value, bad schema, ...)."""


class SettingError(UserInputError, ValueError):
    """A setting's value out of its range (a ValueError too); the message names it (`Worded`)."""


class FieldError(UserInputError):
    """A request's field that cannot be honoured as given (a media part, a tool choice
    without tools, ...): `param` is its path in a chat completion's body (`messages.0`),
    `code` OpenAI's error code for it."""

    def __init__(self, message: str, param: str, code: str | None = "invalid_value") -> None:
        super().__init__(message)
        self.param = param
        self.code = code


class ModelNotFoundError(UserInputError):
    """A model path or name that does not exist or cannot be read."""


class UnsupportedModelError(UserInputError):
    """A model file whose architecture or tensor types we cannot run."""


class AdapterError(UserInputError):
    """A fine-tuned adapter folder that cannot be applied to the model (missing, damaged,
    made for another base model, of a kind mlx-lm does not read)."""


class ContextLengthError(UserInputError):
    """A prompt (plus the tokens asked for) longer than the model's context."""


class CacheStoreError(MlxcacheError):
    """The disk tier could not be used (read-only, full, corrupt index)."""


class DiskFullError(CacheStoreError):
    """The file system of the cache directory has no space left."""


class CorruptCacheFileError(CacheStoreError):
    """A cache block or checkpoint file that is missing or fails its checksum."""


class CorruptIndexError(CacheStoreError):
    """The disk tier's SQLite index is not a database or is damaged: `cache clear` resets it."""


class ModelConversionError(MlxcacheError):
    """A GGUF file could not be converted into the cache directory (full or read-only disk).

    Nothing half-converted is left behind.
    """


class OutputFileError(MlxcacheError):
    """A result file (session, golden, JSONL output) could not be written; nothing was lost."""


class OutputMismatchError(UserInputError):
    """A result file to continue that another run (other inputs, model or sampling) wrote."""


class GrammarError(UserInputError):
    """A JSON Schema or tool definition the constrained decoder cannot enforce."""


class GenerationError(MlxcacheError):
    """A request failed while decoding (e.g. the grammar matcher rejected every token)."""


class OutputError(GenerationError):
    """A constrained reply that cannot be used: cut off at the token limit, or invalid."""


class QueueFullError(MlxcacheError):
    """Too many requests are waiting for the engine; try again later."""


class MemoryBusyError(QueueFullError):
    """The memory budget (`--mem-limit`) is held by running requests; try again later."""


class MemoryLimitError(UserInputError):
    """A request that does not fit the memory budget (`--mem-limit`) even alone."""


class ModelNotServedError(UserInputError):
    """A request names a model the server does not serve (it never loads one it names)."""


class ModelLoadError(MlxcacheError):
    """A served model cannot be loaded (a damaged file): its requests get this; the
    server's other models go on serving."""


class EngineStoppedError(MlxcacheError):
    """The engine is shutting down or has stopped: it takes nothing more."""


class ServerError(MlxcacheError):
    """The server named by --server / $MLXCACHE_SERVER cannot be reached, or failed a request."""


class ServerMismatchError(UserInputError):
    """A server that runs another model, cache settings or version than the command would."""


class RankError(MlxcacheError):
    """A distributed run (`mlx.launch`) cannot go on: another rank stopped or cannot be
    reached."""
