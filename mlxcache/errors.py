"""Domain errors: the library raises these; only `cli/` turns them into exit codes."""

from __future__ import annotations


class MlxcacheError(Exception):
    """Base of every error the library raises on purpose (`cli/` maps each kind to an exit code)."""


class UserInputError(MlxcacheError):
    """The request itself is wrong (empty prompt, bad option value, bad schema, ...)."""


class ModelNotFoundError(UserInputError):
    """A model path or name that does not exist or cannot be read."""


class UnsupportedModelError(UserInputError):
    """A model file whose architecture or tensor types we cannot run."""


class ContextLengthError(UserInputError):
    """A prompt (plus the tokens asked for) longer than the model's context."""


class CacheStoreError(MlxcacheError):
    """The disk tier could not be used (read-only, full, corrupt index)."""


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


class EngineStoppedError(MlxcacheError):
    """The engine is shutting down or has stopped: it takes nothing more."""


class ServerError(MlxcacheError):
    """The server named by --server / $MLXCACHE_SERVER cannot be reached, or failed a request."""


class ServerMismatchError(UserInputError):
    """A server that runs another model, cache settings or version than the command would."""
