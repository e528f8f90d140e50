"""Options shared by every command that runs a model, and the engine they open."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import os
import re
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer

from mlxcache import request_settings
from mlxcache.config import (
    CPU_BLOCK_SIZE,
    METAL_BLOCK_SIZE,
    CacheConfig,
    DraftConfig,
    SamplingParams,
    format_size,
    parse_size,
)
from mlxcache.errors import SettingError, UserInputError
from mlxcache.request_settings import RequestSetting
from mlxcache_cli import ui

if TYPE_CHECKING:  # the engine imports mlx_lm (seconds): only the commands that run one do
    from mlxcache.engine import Engine
    from mlxcache.events import Event, Stats

# Help panels: a command's own options stay under "Options"; the shared ones are grouped.
MODEL_PANEL, SAMPLING_PANEL, CACHE_PANEL = "Model", "Sampling", "Cache"
DRAFT_PANEL = "Drafting (speculative decoding: the reply stays the plain one, bit for bit)"

Model = Annotated[
    str | None,
    typer.Option(
        "--model",
        "-m",
        metavar="MODEL",
        help="A .gguf file, an mlx-lm folder, a Hub id or smollm2-135m (the default, unless "
        "`mlxcache models default` chose another).",
        rich_help_panel=MODEL_PANEL,
    ),
]
AdapterOpt = Annotated[
    Path | None,
    typer.Option(
        "--adapter",
        "--adapter-path",
        metavar="DIR",
        help="A LoRA/DoRA/full fine-tune folder `mlx_lm.lora` saved (adapter_config.json + "
        "adapters.safetensors), applied to the model; its own cache namespace.",
        rich_help_panel=MODEL_PANEL,
    ),
]
ChatTemplate = Annotated[
    str | None,
    typer.Option(
        "--chat-template",
        metavar="FILE|TEXT",
        help="A Jinja chat template (a file, or the text) used in place of the model's.",
        rich_help_panel=MODEL_PANEL,
    ),
]
ChatTemplateArgs = Annotated[
    str | None,
    typer.Option(
        "--chat-template-args",
        metavar="JSON",
        help="Arguments of every chat template rendering, e.g. '{\"enable_thinking\": false}'.",
        rich_help_panel=MODEL_PANEL,
    ),
]
Models = Annotated[
    list[str] | None,
    typer.Option(
        "--model",
        "-m",
        metavar="MODEL",
        help="A .gguf file, an mlx-lm folder, a Hub id or smollm2-135m (the default, unless "
        "`mlxcache models default` chose another); repeat it to serve several (the first "
        "is the default).",
        rich_help_panel=MODEL_PANEL,
    ),
]
Stop = Annotated[
    list[str] | None,
    typer.Option(
        "--stop",
        metavar="TEXT",
        help="End the reply before this text (repeatable; \\n, \\t, \\r and \\\\ in it "
        "are a newline, a tab, a carriage return and a backslash).",
        rich_help_panel=SAMPLING_PANEL,
    ),
]
CacheDir = Annotated[
    Path | None,
    typer.Option(
        "--cache-dir",
        envvar="MLXCACHE_CACHE_DIR",
        metavar="DIR",
        help="Cache directory: the disk tier and converted models (saved chats are kept in "
        "the data directory, $MLXCACHE_DATA_DIR).",
        rich_help_panel=CACHE_PANEL,
    ),
]
NoCacheFlag = Annotated[
    bool,
    typer.Option(
        "--no-cache", help="Prefill from token 0 and keep nothing.", rich_help_panel=CACHE_PANEL
    ),
]
CacheMem = Annotated[
    str,
    typer.Option(
        "--cache-mem",
        metavar="SIZE",
        help="Memory tier budget, e.g. 2G.",
        rich_help_panel=CACHE_PANEL,
    ),
]
CacheDisk = Annotated[
    str,
    typer.Option(
        "--cache-disk",
        metavar="SIZE",
        help="Disk tier budget, e.g. 20G; 0 disables it.",
        rich_help_panel=CACHE_PANEL,
    ),
]
BlockSize = Annotated[
    int | None,
    typer.Option(
        "--block-size",
        metavar="TOKENS",
        help=(
            "Cache block / prefill chunk length in tokens (default: $MLXCACHE_BLOCK_SIZE, "
            f"else {CPU_BLOCK_SIZE} on CPU, {METAL_BLOCK_SIZE} on Metal). Every command "
            "shares entries made with the same size."
        ),
        rich_help_panel=CACHE_PANEL,
    ),
]
KvBits = Annotated[
    int | None,
    typer.Option(
        "--kv-bits",
        metavar="4|8",
        help=(
            "Keep attention keys and values quantized to 4 or 8 bits, from the first token "
            "and in the prompt cache (2-6x more context and cached prefixes per byte; replies "
            "differ from full precision, but resumed == cold still holds, in its own cache "
            "namespace). Sliding-window and recurrent layers stay full precision."
        ),
        rich_help_panel=CACHE_PANEL,
    ),
]
KvGroupSize = Annotated[
    int,
    typer.Option(
        "--kv-group-size",
        metavar="N",
        help="With --kv-bits: values quantized together along a head (32, 64 or 128).",
        rich_help_panel=CACHE_PANEL,
    ),
]
MemLimit = Annotated[
    str | None,
    typer.Option(
        "--mem-limit",
        metavar="SIZE",
        help=(
            "Keep the process's memory under SIZE, e.g. 4G: the model, the memory tier "
            "(fitted inside it), running requests and MLX's buffers. A request that would "
            "pass it waits for room or is refused (serve: 429 with Retry-After)."
        ),
        rich_help_panel=CACHE_PANEL,
    ),
]
StateStride = Annotated[
    int | None,
    typer.Option(
        "--state-stride",
        metavar="BLOCKS",
        help=(
            "Models with recurrent layers (Qwen3-Next, LFM2, Mamba hybrids): keep their "
            "state after every N-th block (and at each prompt's end). Smaller resumes closer "
            "to where prompts part, at the cost of a state per N blocks (default: measured, "
            "stored states cost at most a quarter of the blocks' KV; in memory, states between "
            "strides are kept too, within an eighth of --cache-mem)."
        ),
        rich_help_panel=CACHE_PANEL,
    ),
]
WarmAhead = Annotated[
    bool,
    typer.Option(
        "--warm-ahead/--no-warm-ahead",
        help="After a reply, prefill the conversation as the next turn will start (in idle "
        "time; serve also prefills each reply block as it is generated).",
        rich_help_panel=CACHE_PANEL,
    ),
]
Split = Annotated[
    str | None,
    typer.Option(
        "--split",
        metavar="tensor|pipeline",
        help="Run under mlx.launch: shard the model across its processes by tensor "
        "(default, where the model has it) or by pipeline stage; rank 0 runs the command.",
        rich_help_panel=MODEL_PANEL,
    ),
]
Draft = Annotated[
    str,
    typer.Option(
        "--draft",
        metavar="auto|lookup|model|off",
        help="Draft the reply and verify the drafts in one forward: lookup copies from the "
        "prompt and reply so far, model uses --draft-model; auto drafts where this device "
        "verifies exactly and cheaply (measured: not on MLX's CPU backend).",
        rich_help_panel=DRAFT_PANEL,
    ),
]
DraftModelOpt = Annotated[
    str | None,
    typer.Option(
        "--draft-model",
        metavar="MODEL",
        help="A smaller model with the same vocabulary to draft with (as --model takes).",
        rich_help_panel=DRAFT_PANEL,
    ),
]
DraftTokens = Annotated[
    int | None,
    typer.Option(
        "--draft-tokens",
        metavar="K",
        help="Most tokens drafted per verify forward (default: the k this device's "
        "measured verify costs favour, with n).",
        rich_help_panel=DRAFT_PANEL,
    ),
]
DraftNgram = Annotated[
    int | None,
    typer.Option(
        "--draft-ngram",
        metavar="N",
        help="Lookup: the longest n-gram matched (then shorter ones; default: the n this "
        "device's measured verify costs favour, with k).",
        rich_help_panel=DRAFT_PANEL,
    ),
]
DraftInexact = Annotated[
    bool,
    typer.Option(
        "--draft-inexact",
        help="Draft even where this device's verify forward was not measured to be bitwise "
        "decode steps: replies may then differ from plain decoding (as mlx-lm's do).",
        rich_help_panel=DRAFT_PANEL,
    ),
]
Quiet = Annotated[
    bool,
    typer.Option(
        "--quiet",
        "-q",
        help="Print the reply alone: no progress, notes or stats line on stderr (errors and "
        "warnings still).",
        rich_help_panel=MODEL_PANEL,
    ),
]
PromptArg = Annotated[
    str | None,
    typer.Argument(
        metavar="PROMPT",
        help="The prompt; '-' or nothing reads stdin. Piped stdin and PROMPT together make "
        "one prompt, as llm joins them: stdin, a space, then PROMPT.",
    ),
]
PromptFile = Annotated[
    Path | None,
    typer.Option("--prompt-file", "-f", metavar="FILE", help="Read the prompt from a file."),
]
System = Annotated[
    str | None,
    typer.Option(
        "--system",
        "-s",
        metavar="TEXT|@FILE",
        help="System message: the text, or @FILE (or a file's path) to read it.",
    ),
]
Json = Annotated[bool, typer.Option("--json", help="Print one JSON object instead of plain text.")]
Think = Annotated[
    bool,
    typer.Option(
        "--think/--no-think",
        help="A reasoning model thinks first (apart in --json; see --think-budget), "
        "or not (the default).",
    ),
]
ThinkBudget = Annotated[
    int | None,
    typer.Option(
        "--think-budget",
        metavar="N",
        min=0,
        help="With --think: tokens spent thinking, then the section is closed and the "
        "answer follows \\[default: half of --max-tokens, less near the context's end].",
    ),
]


def text_or_file(value: str | None, what: str) -> str | None:
    """A text option's value: `@FILE` or the path of an existing file is read; else the text."""
    if value is None:
        return None
    path = Path(value[1:] if value.startswith("@") else value).expanduser()
    if not value.startswith("@") and not path.is_file():
        return utf8(value, f"--{what}")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise UserInputError(f"cannot read {what} file {path}: {reason}") from exc
    if not text.strip():
        raise UserInputError(f"{what} file {path} is empty")
    return text


def positive(**values: int) -> None:
    """Sizes and counts given as options must be >= 1."""
    for name, value in values.items():
        if value < 1:
            raise UserInputError(f"--{name.replace('_', '-')} must be >= 1, got {value}")


def sampling(**options: Any) -> SamplingParams:
    """Sampling settings from options (named as SamplingParams' fields); a bad value raises
    a `SettingError` naming its field, which `ui` prints as the option's flag."""
    return SamplingParams(**options)


def cache_config(
    cache_dir: Path | None,
    no_cache: bool,
    mem: str,
    disk: str,
    block_size: int | None,
    warm_ahead: bool,
    state_stride: int | None = None,
    kv_bits: int | None = None,
    kv_group_size: int | None = None,
    mem_limit: str | None = None,
) -> CacheConfig:
    """Cache settings from options; None keeps `CacheConfig`'s default (one home for it)."""
    try:
        size: dict[str, int] = {} if block_size is None else {"block_size": block_size}
        if kv_group_size is not None:
            size["kv_group_size"] = kv_group_size
        return CacheConfig(
            enabled=not no_cache,
            directory=cache_dir,
            mem_bytes=parse_size(mem),
            disk_bytes=parse_size(disk),
            warm_ahead=warm_ahead,
            state_stride=state_stride,
            kv_bits=kv_bits,
            mem_limit=mem_limit_bytes(mem_limit) or 0,
            **size,
        )
    except SettingError:
        raise  # names its setting: `ui` prints it as the flag
    except ValueError as exc:  # not a size
        raise UserInputError(str(exc)) from exc


def check_given(given: dict[str, Any]) -> None:
    """A command's arguments that name models (-m, --draft-model, --adapter) or the memory
    limit, checked before it does anything: a path that names nothing is one line at once,
    not after the heavy imports or a whole bench's run.

    Raises:
        ModelNotFoundError: a model spec names nothing (`loader.check_spec`).
        AdapterError: an adapter folder that is missing or damaged (`check_adapter`).
        UserInputError: --mem-limit is not a size above 0.
    """
    mem_limit_bytes(given.get("mem_limit"))
    if given.get("check"):  # `json --check` compiles a schema and loads no model
        return
    if given.get("adapter") is not None:
        from mlxcache.model.adapter import check_adapter

        check_adapter(given["adapter"])
    # Through a server, --draft-model is refused as such (`remote.refuse_in_process_only`).
    for name in ("model",) if given.get("server") else ("model", "draft_model"):
        specs = given.get(name)  # serve's -m may be given more than once: a list
        for spec in [specs] if isinstance(specs, str) else specs or ():
            from mlxcache.model.loader import check_spec

            check_spec(spec, given.get("cache_dir"))


def mem_limit_bytes(text: str | None) -> int | None:
    """--mem-limit in bytes (None: not given, no limit).

    Raises:
        UserInputError: not a size, or 0 (which would silently mean no limit).
    """
    if text is None:
        return None
    try:
        limit = parse_size(text)
    except ValueError as exc:
        raise UserInputError(str(exc)) from exc
    if limit == 0:
        raise UserInputError("--mem-limit must be above 0 (leave it out for no limit)")
    return limit


def engine(
    model: str | None,
    config: CacheConfig,
    invariant: bool | None = None,
    split: str | None = None,
    draft: DraftConfig | None = None,
    quiet: bool = False,
    tailoring: dict[str, Any] | None = None,
) -> Engine:
    """Open the engine (no `model`: the one `mlxcache models default` chose), with a
    progress bar on stderr if a GGUF needs converting and the device's probes shown as
    they measure (`ui.ProbeNotes`; neither `quiet`); `invariant`, `split` and `draft`: see
    `open_engine` (chat and serve ask for `invariant`: measured where not recorded; the
    one-shot commands use the recorded answer, the canonical path where none is);
    `tailoring`: its adapter and chat template arguments (`RunOptions.tailoring`)."""
    from mlxcache.distributed import SPLITS
    from mlxcache.model.loader import default_spec
    from mlxcache.runtime import open_engine

    if split is not None and split not in SPLITS:
        raise UserInputError(f"--split must be one of {', '.join(SPLITS)}, got {split!r}")
    spec = model or default_spec()
    notes = None if quiet else ui.ProbeNotes()
    with ui.progress_bar(piped="converting the model (once)") as update, _closed(notes):
        return open_engine(
            spec,
            config,
            progress=None if quiet else update,
            on_warning=ui.warn,
            on_note=notes,
            invariant=invariant,
            split=split,
            on_rank_lost=_rank_lost,
            draft=draft,
            **(tailoring or {}),
        )


@contextmanager
def _closed(notes: ui.ProbeNotes | None) -> Iterator[None]:
    """`notes`' bar stopped however the block ends (a probe that raised sends no end)."""
    try:
        yield
    finally:
        if notes is not None:
            notes.close()


def _rank_lost(message: str | None) -> None:
    """Another rank of the run ended (`Ranks.watch`): this one may be waiting for it in a
    collective that never completes, so the process ends here (`message`: its one line;
    None when the loss was raised here already, and is being reported)."""
    if message is not None:
        ui.error(message)
    sys.stderr.flush()
    os._exit(1)


@contextmanager
def keep_note(bar: ui.PrefillBar, prompt_tokens: int, kept: Callable[[], int]) -> Iterator[None]:
    """Ctrl-C before the first token: say how much of the prompt the cache kept for next
    time (the engine keeps the full blocks it computed), then let the interrupt go on."""
    try:
        yield
    except KeyboardInterrupt:
        if not bar.replying:
            # Best effort while unwinding: a failed lookup must not replace the interrupt.
            with contextlib.suppress(Exception):
                n = kept()
                ui.info(f"prefill stopped: {n} of {prompt_tokens} prompt tokens kept for next time")
        raise


class Watch:
    """One request of a one-shot command, seen through its events: the prefill bar."""

    def __init__(self, engine: Engine, quiet: bool) -> None:
        self.engine = engine
        self.bar = ui.PrefillBar(quiet)

    def __call__(self, event: object) -> None:
        self.bar(event)

    def stats(self, stats: Stats) -> dict[str, Any]:
        """The request's stats as JSON (`cached_from` says which tier its prefix came from)."""
        return stats.as_dict()


@contextmanager
def watch(
    engine: Engine, ids: Sequence[int], quiet: bool, events: Iterator[Event] | None = None
) -> Iterator[Watch]:
    """Watch one request of `ids`; Ctrl-C during its prefill says what the cache kept.

    `events`: the request's event stream, when the caller iterates it; it is closed on the
    way out, so a prefill interrupted between two events keeps its blocks before the note.
    """
    import numpy as np

    seen = Watch(engine, quiet)

    def kept() -> int:
        return engine.cache.cached_length(np.asarray(ids, dtype=np.int32))

    with seen.bar, keep_note(seen.bar, len(ids), kept):
        try:
            yield seen
        finally:
            close = getattr(events, "close", None)
            if close is not None:
                close()


_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\"}
_ESCAPE = re.compile(r"\\([ntr\\])")


def unescape(text: str) -> str:
    """`\\n`, `\\t`, `\\r` and `\\\\` as the characters they name; any other backslash stays."""
    return _ESCAPE.sub(lambda m: _ESCAPES[m.group(1)], text)


def utf8(value: str | bytes, what: str) -> str:
    """`value` as text, refusing bytes that are not UTF-8.

    Stdin and argv may carry any bytes; Python keeps undecodable ones as lone surrogates,
    which no tokenizer takes.
    """
    try:
        data = value if isinstance(value, bytes) else value.encode("utf-8", "surrogateescape")
        return data.decode("utf-8")
    except UnicodeError as exc:
        raise UserInputError(f"{what} is not valid UTF-8") from exc


def piped() -> str | None:
    """What stdin carries when it is not a terminal (a pipe or a file); None on a terminal
    or with stdin closed."""
    if sys.stdin is None or sys.stdin.isatty():
        return None
    return utf8(sys.stdin.buffer.read(), "stdin")


def joined(stdin: str | None, prompt: str) -> str:
    """Piped text and an argument prompt as one prompt, as `llm` and Ollama join them:
    stdin first, a space, then the argument (`git diff | mlxcache generate "Review this"`).
    Stdin with nothing but whitespace adds nothing."""
    return prompt if stdin is None or not stdin.strip() else f"{stdin} {prompt}"


def read_prompt(prompt: str | None, prompt_file: Path | None) -> str:
    """The prompt from the argument (after piped stdin, if any: `joined`), `-` (stdin alone)
    or --prompt-file; never empty."""
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
        text = utf8(sys.stdin.buffer.read(), "stdin")
    else:
        text = joined(piped(), utf8(prompt, "the prompt"))
    if not text.strip():
        raise UserInputError("the prompt is empty")
    return text


@dataclass(frozen=True, slots=True)
class RunOptions:
    """The model, sampling and cache options every model-running command takes."""

    model: str | None
    adapter: Path | None
    chat_template: str | None
    chat_template_args: str | None
    settings: Mapping[str, Any]
    """The request settings' values, by name (`request_settings.SAMPLING`)."""
    stop: list[str] | None
    cache_dir: Path | None
    no_cache: bool
    cache_mem: str
    cache_disk: str
    block_size: int | None
    state_stride: int | None
    kv_bits: int | None
    kv_group_size: int
    mem_limit: str | None
    warm_ahead: bool
    split: str | None
    draft: str
    draft_model: str | None
    draft_tokens: int | None
    draft_ngram: int | None
    draft_inexact: bool
    quiet: bool
    models: tuple[str, ...] = ()
    """Every --model given, where a command takes several (`with_run_options(models=True)`);
    `model` is the first."""

    def sampling(self) -> SamplingParams:
        return sampling(**self.settings)

    def stop_strings(self) -> tuple[str, ...]:
        """--stop values, escapes read (`\\n` is a newline: a shell passes `"\\n"` as a
        backslash and an n); an empty one would end every reply at once."""
        stops = tuple(unescape(s) for s in self.stop or ())
        if any(not s for s in stops):
            raise UserInputError("--stop needs a non-empty text")
        return stops

    def cache(self) -> CacheConfig:
        return cache_config(
            self.cache_dir,
            self.no_cache,
            self.cache_mem,
            self.cache_disk,
            self.block_size,
            self.warm_ahead,
            self.state_stride,
            self.kv_bits,
            self.kv_group_size,
            self.mem_limit,
        )

    def drafting(self) -> DraftConfig:
        """--draft and its options; a --draft-model alone drafts with it (where auto does)."""
        return DraftConfig(
            mode=self.draft,
            model=self.draft_model,
            tokens=self.draft_tokens,
            ngram=self.draft_ngram,
            inexact=self.draft_inexact,
        )

    def tailoring(self) -> dict[str, Any]:
        """The adapter and chat template, as `open_engine` and `model.load` take them."""
        return {
            "adapter": self.adapter,
            "chat_template": self.chat_template,
            "chat_template_args": self.chat_template_args,
        }

    def engine(self, invariant: bool | None = None) -> Engine:
        return engine(
            self.model,
            self.cache(),
            invariant,
            self.split,
            self.drafting(),
            self.quiet,
            self.tailoring(),
        )


def _config_default(name: str) -> Any:
    """A `CacheConfig` field's declared default, read without building one: building one
    reads $MLXCACHE_BLOCK_SIZE, and a bad value must fail the command that needs it as one
    error line, not the import of every command (`mlxcache --version` included)."""
    return next(f.default for f in dataclasses.fields(CacheConfig) if f.name == name)


_SAMPLING = SamplingParams()
_DRAFT = DraftConfig()


def setting_option(row: RequestSetting) -> Any:
    """A request setting's option (`request_settings.SAMPLING`)."""
    text = row.option.help.format(repetition_context=_SAMPLING.repetition_context)
    option = typer.Option(
        *row.option.flags,
        metavar=row.option.metavar,
        help=text,
        rich_help_panel=SAMPLING_PANEL,
    )
    return Annotated[row.kind, option]


def _run_options() -> list[tuple[str, Any, Any]]:
    """The shared options: name, annotated type, default; the request settings' from
    their table, as it is when a command is declared."""
    settings = [(row.name, setting_option(row), row.default) for row in request_settings.SAMPLING]
    return [*_RUN_OPTIONS[:4], *settings, *_RUN_OPTIONS[4:]]


_RUN_OPTIONS: list[tuple[str, Any, Any]] = [
    ("model", Model, None),
    ("adapter", AdapterOpt, None),
    ("chat_template", ChatTemplate, None),
    ("chat_template_args", ChatTemplateArgs, None),
    # (the request settings: `_run_options`)
    ("stop", Stop, None),
    ("cache_dir", CacheDir, None),
    ("no_cache", NoCacheFlag, False),
    # Defaults come from CacheConfig, their one home, in the form the options take.
    ("cache_mem", CacheMem, format_size(_config_default("mem_bytes"))),
    ("cache_disk", CacheDisk, format_size(_config_default("disk_bytes"))),
    ("block_size", BlockSize, None),
    ("state_stride", StateStride, None),
    ("kv_bits", KvBits, _config_default("kv_bits")),
    ("kv_group_size", KvGroupSize, _config_default("kv_group_size")),
    ("mem_limit", MemLimit, None),
    ("warm_ahead", WarmAhead, _config_default("warm_ahead")),
    ("split", Split, None),
    # Defaults come from DraftConfig, their one home.
    ("draft", Draft, _DRAFT.mode),
    ("draft_model", DraftModelOpt, _DRAFT.model),
    ("draft_tokens", DraftTokens, _DRAFT.tokens),
    ("draft_ngram", DraftNgram, _DRAFT.ngram),
    ("draft_inexact", DraftInexact, _DRAFT.inexact),
    ("quiet", Quiet, False),
]
F = TypeVar("F", bound=Callable[..., None])


def run_options(kwargs: dict[str, Any]) -> RunOptions:
    """The shared options taken out of a command's keyword arguments (a repeated --model
    as `models`, its first as `model`)."""
    given = {name: kwargs.pop(name) for name, _, _ in _RUN_OPTIONS}
    given["settings"] = {row.name: kwargs.pop(row.name) for row in request_settings.SAMPLING}
    if isinstance(given["model"], list):
        given["models"] = tuple(given["model"])
        given["model"] = given["models"][0] if given["models"] else None
    return RunOptions(**given)


def with_run_options(max_tokens: int | None = None, models: bool = False) -> Callable[[F], F]:
    """Give a command the shared options; it receives them as `run: RunOptions`
    (`models`: --model may be repeated, `RunOptions.models`).

    Typer reads a command's options from its signature, so the wrapper's signature is the
    command's own parameters (minus `run`) followed by the shared ones.
    """
    defaults = {} if max_tokens is None else {"max_tokens": max_tokens}

    def decorate(fn: F) -> F:
        own = [
            p for p in inspect.signature(fn, eval_str=True).parameters.values() if p.name != "run"
        ]
        shared = [
            inspect.Parameter(
                name,
                inspect.Parameter.KEYWORD_ONLY,
                default=defaults.get(name, default),
                annotation=Models if models and name == "model" else kind,
            )
            for name, kind, default in _run_options()
        ]

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> None:
            fn(*args, run=run_options(kwargs), **kwargs)

        params = [*own, *shared]
        wrapper.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
        wrapper.__annotations__ = {p.name: p.annotation for p in params}
        wrapper.runs_model = True  # type: ignore[attr-defined]
        return wrapper  # type: ignore[return-value]

    return decorate
