"""Chat sessions: turns, retry / edit / undo as forks of the history, saved as JSON.

Every generation renders the whole conversation with the chat template; the prompt cache
makes the shared history cost nothing but a lookup. A retry or an edit is a fork: the
prompt shares a prefix with an earlier one and resumes from its blocks.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from mlxcache.errors import MlxcacheError, UserInputError
from mlxcache.events import CANCELLED, Done, Event, Token
from mlxcache.fileio import loads_json, write_atomic
from mlxcache.request_spec import RequestSpec, prompt_ids
from mlxcache.sampling import SamplingParams

if TYPE_CHECKING:  # the engine imports mlx_lm (seconds); listing sessions needs none of it
    from mlxcache.encoder import Encoder
    from mlxcache.engine import Request


class Runner(Protocol):
    """What a chat runs its turns on: the conversation and its settings in, the reply's
    events out (`InProcess`, or `mlxcache.remote.ChatRunner` on a running server)."""

    def reply(self, request: RequestSpec) -> Iterator[Event]:
        """The events of the reply to `request` (its messages' last one the user's),
        ending in `Done`."""
        ...


@runtime_checkable
class EngineLike(Protocol):
    """What runs requests of token ids: an `Engine`, or an `EngineWorker` driving one."""

    @property
    def encoder(self) -> Encoder: ...

    def generate(self, request: Request) -> Iterator[Event]: ...

    @property
    def warm_ahead(self) -> bool: ...

    def warm(self, tokens: Any) -> object: ...


def warm_next_turn(
    engine: EngineLike, messages: list[dict[str, Any]], **template_kwargs: Any
) -> object:
    """Queue warm-ahead for a conversation whose last message is the reply just given, if
    the engine warms ahead (its lane id, or None); `template_kwargs`: those the next turn
    is rendered with (e.g. its tools). The prefix is encoded on the caller's thread."""
    if not engine.warm_ahead:
        return None
    return engine.warm(engine.encoder.encode_next_turn(messages, **template_kwargs))


class InProcess:
    """A chat's turns on an engine of this process: the conversation encoded here, and
    after each reply warm-ahead of the next turn queued (run in idle time, if on)."""

    def __init__(self, engine: EngineLike) -> None:
        self.engine = engine
        self.prompt: list[int] = []
        """The last request's prompt ids: after Ctrl-C they tell what the cache kept."""

    def reply(self, request: RequestSpec) -> Iterator[Event]:
        from mlxcache.engine import Request

        self.prompt = prompt_ids(request, self.engine.encoder)  # now: a bad one raises here
        messages = [dict(m) for m in request.messages]
        asked = Request(self.prompt, request.sampling, stop_strings=request.stops)
        return self._events(messages, asked)

    def _events(self, messages: list[dict[str, str]], request: Request) -> Iterator[Event]:
        for event in self.engine.generate(request):
            if isinstance(event, Done) and event.result.finish_reason != CANCELLED:
                reply = {"role": "assistant", "content": event.result.text}
                warm_next_turn(self.engine, [*messages, reply])
            yield event


def as_runner(runner: Runner | EngineLike) -> Runner:
    """`runner` as a chat's `Runner` (an engine runs in this process: `InProcess`)."""
    return InProcess(runner) if isinstance(runner, EngineLike) else runner


_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
FORMAT = "mlxcache-chat-v1"


@dataclass(slots=True)
class Turn:
    """One exchange. `interrupted`: the reply was stopped (Ctrl-C) and is partial."""

    user: str
    reply: str
    interrupted: bool = False


@dataclass(slots=True)
class ChatSession:
    """A conversation and the settings its replies are generated with."""

    system: str | None = None
    turns: list[Turn] = field(default_factory=list)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    """Stop strings: a reply ends before the first one."""
    generations: int = 0
    """Replies generated so far (retries included): seeds each one differently."""
    model: str | None = None
    """The name of the model the replies come from (None: not recorded, an older file)."""
    model_key: str | None = None
    """Its key (`LoadedModel.key`): what tells whether another model would continue it."""

    def other_model(self, key: str) -> bool:
        """Whether the session was made with a model other than the one of `key`."""
        return self.model_key is not None and self.model_key != key

    def messages(self, upto: int | None = None) -> list[dict[str, str]]:
        """Chat-template messages of the first `upto` turns (all by default)."""
        out = [{"role": "system", "content": self.system}] if self.system is not None else []
        for turn in self.turns[:upto]:
            out += [
                {"role": "user", "content": turn.user},
                {"role": "assistant", "content": turn.reply},
            ]
        return out

    def ask(self, engine: Runner | EngineLike, text: str) -> Iterator[Event]:
        """Generate the reply to `text` as a new turn; yields the runner's events.

        In-process, when the reply is done, warm-ahead of the next turn is queued (the
        engine runs it in idle time, if warm-ahead is on; a server warms its own).

        If the consumer stops early (Ctrl-C), the partial reply is kept, marked interrupted
        (a turn stopped before its first token is dropped: there is nothing to continue);
        if the request fails (an `MlxcacheError`), the conversation is left as it was.
        """
        if not text.strip():
            raise UserInputError("the message is empty")
        messages = [*self.messages(), {"role": "user", "content": text}]
        params = replace(self.sampling, seed=(self.sampling.seed + self.generations) % 2**63)
        request = RequestSpec(tuple(messages), sampling=params, stops=self.stop)
        events = as_runner(engine).reply(request)
        self.generations += 1
        pieces: list[str] = []
        done = failed = False
        try:
            for event in events:
                if isinstance(event, Token):
                    pieces.append(event.text)
                elif isinstance(event, Done) and event.result.finish_reason != CANCELLED:
                    done = True
                    self.turns.append(Turn(text, event.result.text))
                yield event
        except MlxcacheError:
            failed = True
            raise
        finally:
            if not done and not failed and "".join(pieces):
                self.turns.append(Turn(text, "".join(pieces), interrupted=True))

    def retry(self, engine: Runner | EngineLike) -> Iterator[Event]:
        """Regenerate the last reply (a fork from the last user message)."""
        if not self.turns:
            raise UserInputError("nothing to retry: the conversation is empty")
        return self._fork(engine, len(self.turns), self.turns[-1].user)

    def edit(self, engine: Runner | EngineLike, number: int, text: str) -> Iterator[Event]:
        """Rewrite turn `number` (1-based), drop the turns after it, and answer it."""
        self._check_turn(number)
        return self._fork(engine, number, text)

    def _fork(self, engine: Runner | EngineLike, number: int, text: str) -> Iterator[Event]:
        """Answer `text` as turn `number`, replacing it and the turns after it.

        A failed request puts the replaced turns back: a retry never loses a good reply.
        """
        removed = self.turns[number - 1 :]
        del self.turns[number - 1 :]
        try:
            yield from self.ask(engine, text)
        except MlxcacheError:
            self.turns[number - 1 :] = removed
            raise

    def undo(self) -> Turn:
        """Remove the last turn and return it."""
        if not self.turns:
            raise UserInputError("nothing to undo: the conversation is empty")
        return self.turns.pop()

    def clear(self) -> None:
        self.turns.clear()

    def _check_turn(self, number: int) -> None:
        if not 1 <= number <= len(self.turns):
            raise UserInputError(f"no turn {number}: the conversation has {len(self.turns)} turns")

    # -- persistence ------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "system": self.system,
            "turns": [asdict(t) for t in self.turns],
            "sampling": asdict(self.sampling),
            "stop": list(self.stop),
            "generations": self.generations,
            "model": self.model,
            "model_key": self.model_key,
        }

    @classmethod
    def from_json(cls, doc: Any) -> ChatSession:
        """Parse a saved session, every field's type checked (nothing is coerced, so a bad
        value is refused here, before any work, not deep inside a generation).

        Raises:
            UserInputError: not a session file of this format.
        """
        try:
            if not isinstance(doc, dict) or doc.get("format") != FORMAT:
                found = doc.get("format") if isinstance(doc, dict) else None
                raise ValueError(f"format {found!r}, expected {FORMAT!r}")
            turns = [
                Turn(
                    _typed(t, "user", str),
                    _typed(t, "reply", str),
                    _typed(t, "interrupted", bool, False),
                )
                for t in _typed(doc, "turns", list)
            ]
            sampling = _typed(doc, "sampling", dict)
            stop = _typed(doc, "stop", list, [])
            if not all(isinstance(s, str) and s for s in stop):
                raise ValueError("'stop' must be a list of non-empty strings")
            return cls(
                system=_typed(doc, "system", str | None),
                turns=turns,
                sampling=SamplingParams(**sampling),
                stop=tuple(stop),
                generations=_typed(doc, "generations", int),
                model=_typed(doc, "model", str | None, None),
                model_key=_typed(doc, "model_key", str | None, None),
            )
        except (TypeError, ValueError) as exc:
            raise UserInputError(f"not a saved chat session: {exc}") from exc


_REQUIRED: Any = object()


def _typed(doc: Any, key: str, kind: Any, default: Any = _REQUIRED) -> Any:
    """`doc[key]`, which must be an instance of `kind` (a bool is not an int here).

    Raises:
        ValueError: `doc` is not an object, the key is missing (and has no default), or
            its value has another type.
    """
    if not isinstance(doc, dict):
        raise ValueError(f"expected an object with {key!r}, got {type(doc).__name__}")
    if key not in doc:
        if default is _REQUIRED:
            raise ValueError(f"no {key!r}")
        return default
    value = doc[key]
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
        raise ValueError(f"{key!r} has the wrong type ({type(value).__name__}): {value!r}"[:200])
    return value


def session_path(directory: Path, name: str) -> Path:
    """Where session `name` is saved.

    Raises:
        UserInputError: the name has characters other than letters, digits, `_ . -`.
    """
    if not _NAME.fullmatch(name):
        raise UserInputError(f"bad session name {name!r}: use letters, digits, '_', '.', '-'")
    return directory / f"{name}.json"


def save(session: ChatSession, directory: Path, name: str) -> Path:
    """Write the session atomically (temp file, then rename): a crash never leaves half a file.

    Raises:
        UserInputError: bad name.
        OutputFileError: the file cannot be written (the old one, if any, is untouched).
    """
    path = session_path(directory, name)
    write_atomic(path, json.dumps(session.to_json(), ensure_ascii=False, indent=1))
    return path


def find(directories: Sequence[Path], name: str) -> Path | None:
    """The file of session `name` in the first of `directories` that has one (None: none).

    Raises:
        UserInputError: bad name.
    """
    return next((p for d in directories if (p := session_path(d, name)).exists()), None)


def load(directory: Path | Sequence[Path], name: str) -> ChatSession:
    """Read a saved session; given several directories, from the first that has it (where
    sessions are saved, then where older versions saved them).

    Raises:
        UserInputError: no such session, or the file is not a session.
    """
    dirs = [directory] if isinstance(directory, Path) else list(directory)
    path = find(dirs, name) or session_path(dirs[0], name)
    try:
        doc = loads_json(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        where = " or ".join(str(d) for d in dirs)
        raise UserInputError(f"no saved session {name!r} in {where}") from None
    except (OSError, ValueError) as exc:
        raise UserInputError(f"cannot read session {name!r}: {exc}") from exc
    try:
        return ChatSession.from_json(doc)
    except UserInputError as exc:
        raise UserInputError(f"session {name!r}: {exc}") from exc
