"""A chat template given in place of the model's (`--chat-template`, as mlx-lm's server takes
it), and default arguments for every rendering of it (`--chat-template-args`)."""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import xxhash

from mlxcache.errors import UserInputError
from mlxcache.fileio import loads_json

_MAX_PATH = 4096  # longer text is never a file name


def template_text(value: str | None) -> str | None:
    """The template `value` names: a file's text when it names an existing file, else
    `value` itself (Jinja text).

    Raises:
        UserInputError: an unreadable file, or an empty template.
    """
    if value is None:
        return None
    path = Path(value).expanduser() if len(value) < _MAX_PATH and "\n" not in value else None
    if path is not None and _is_file(path):
        try:
            value = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise UserInputError(f"cannot read chat template file {path}: {exc}") from exc
    if not value.strip():
        raise UserInputError("the chat template is empty")
    if "{" not in value:  # neither Jinja nor a file that exists: a mistyped path
        raise UserInputError(f"chat template: no such file, and not a Jinja template: {value}")
    return value


def template_args(value: str | Mapping[str, Any] | None) -> dict[str, Any]:
    """Arguments for every rendering of the template, from JSON text (or a mapping).

    Raises:
        UserInputError: not a JSON object.
    """
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = loads_json(value)
        except ValueError as exc:
            raise UserInputError(f"--chat-template-args is not JSON: {exc}") from exc
    if not isinstance(value, Mapping):
        raise UserInputError("--chat-template-args must be a JSON object")
    return dict(value)


def identity(template: str | None, args: Mapping[str, Any]) -> str:
    """What the template and its arguments add to a model's key ("" when neither is given,
    so a model's key without them stays what it was)."""
    if template is None and not args:
        return ""
    spelled = json.dumps([template, dict(args)], sort_keys=True, ensure_ascii=False)
    return str(xxhash.xxh3_128(spelled.encode()).hexdigest())


@functools.cache
def _with_args_class() -> type:
    """mlx-lm's tokenizer wrapper whose every template rendering gets default arguments; a
    call's own arguments win (as a request's `chat_template_kwargs` do in mlx-lm's server).
    Made on first use: mlx-lm's tokenizer module imports transformers (seconds)."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    class WithArgs(TokenizerWrapper):
        _template_args: dict[str, Any]

        def apply_chat_template(self, *args: Any, **kwargs: Any) -> Any:
            return super().apply_chat_template(*args, **{**self._template_args, **kwargs})

    return WithArgs


def with_args(tokenizer: Any, args: Mapping[str, Any]) -> Any:
    """`tokenizer` rendering its template with `args` by default (itself when there are none)."""
    if not args:
        return tokenizer
    out: Any = object.__new__(_with_args_class())
    out.__dict__.update(tokenizer.__dict__)
    out._template_args = dict(args)
    return out


def _is_file(path: Path) -> bool:
    """Whether `path` is a file; False for text the OS cannot take as a path (a name part
    longer than it allows: a one-line template is Jinja text, not a file)."""
    try:
        return path.is_file()
    except OSError:
        return False
