"""Tool conversations: messages in, a prompt with the tools described, a parsed reply out.

A model whose chat template renders tools in the Hermes format gets them that way.
Otherwise (SmolLM2's template knows no tools) the tools are described in the system
message and calls and results become Hermes-tagged text, so any chat model can take
part. The system message (tools included) comes first and is the same on every turn,
so the prefix cache reuses it.

Messages are dicts: {"role": "system"|"user"|"assistant"|"tool", "content": str,
"tool_calls": [{"name", "arguments"}] (assistant), "name": str (tool)}. OpenAI's nested
{"type": "function", "function": {...}} calls and string arguments are accepted too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from mlxcache.constrain import processor_for
from mlxcache.encoder import next_turn_prefix
from mlxcache.errors import Setting, UserInputError, Worded
from mlxcache.events import Result
from mlxcache.modes.call_stream import CallStream
from mlxcache.modes.reasoning import Thinking, budget_processors, split_reply, thinking_for
from mlxcache.modes.repeats import describe_loop
from mlxcache.modes.tool_formats import HERMES, ToolFormat, format_for
from mlxcache.modes.tools import (
    CALL_END,
    CALL_START,
    Tool,
    ToolChoice,
    ToolReply,
    call_arguments,
    parse_reply,
    tool_grammar,
)
from mlxcache.sampling import SamplingParams

if TYPE_CHECKING:  # the engine imports mlx_lm: `tools --server` reads messages without it
    from mlxcache.engine import Engine, Request
    from mlxcache.sampling import LogitsProcessor

_RESULT = Setting("tool_result")

HERMES_TOOLS = """# Tools

You may call these functions:
<tools>
{tools}
</tools>
To call one, reply with:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""

_ROLES = ("system", "user", "assistant", "tool")


def _call(raw: Any, where: str) -> dict[str, Any]:
    fn = raw.get("function", raw) if isinstance(raw, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise UserInputError(f'{where}: a tool call must be {{"name": ..., "arguments": {{...}}}}')
    args = call_arguments(fn.get("arguments", {}))
    if isinstance(args, str):
        raise UserInputError(f"{where}: {args}")
    return {"name": fn["name"], "arguments": args}


def read_messages(doc: Any, origin: str = "messages") -> list[dict[str, Any]]:
    """Check and normalize a prior conversation (a JSON list of messages).

    Raises:
        UserInputError: naming the first bad message.
    """
    if not isinstance(doc, list):
        raise UserInputError(f"{origin} must be a JSON list of messages")
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(doc):
        where = f"{origin} message {i}"
        if not isinstance(msg, dict) or msg.get("role") not in _ROLES:
            raise UserInputError(f"{where}: expected an object with role {'|'.join(_ROLES)}")
        if i and msg["role"] == "system":
            raise UserInputError(f"{where}: only the first message may be a system message")
        content = msg.get("content") or ""
        if not isinstance(content, str):
            raise UserInputError(f"{where}: content must be a string")
        norm: dict[str, Any] = {"role": msg["role"], "content": content}
        if msg["role"] == "assistant" and msg.get("tool_calls"):
            calls = msg["tool_calls"]
            if not isinstance(calls, list):
                raise UserInputError(f"{where}: tool_calls must be a list")
            norm["tool_calls"] = [_call(c, where) for c in calls]
        if msg["role"] == "tool":
            if not isinstance(msg.get("name"), str):
                raise UserInputError(f"{where}: a tool message needs the tool's name")
            norm["name"] = msg["name"]
        out.append(norm)
    return out


def add_tool_results(
    messages: list[dict[str, Any]], results: list[tuple[str, str]]
) -> list[dict[str, Any]]:
    """`messages` followed by one tool message per (name, result) answering the last calls.

    Raises:
        UserInputError: a result for a function the last assistant message did not call.
    """
    last = messages[-1] if messages else None
    called = [c["name"] for c in last.get("tool_calls", [])] if last else []
    if last is None or last["role"] != "assistant" or not called:
        raise UserInputError(
            Worded(
                "a ",
                _RESULT,
                " answers a tool call, but the conversation does not end with one (pass ",
                Setting("messages", "the earlier messages"),
                ': the "messages" of the ',
                Setting("json_output", "previous JSON output"),
                ")",
            )
        )
    for name, _ in results:
        if name not in called:
            raise UserInputError(
                Worded(
                    _RESULT,
                    f" {name}: the last assistant message made no call to {name} "
                    f"(it called: {', '.join(called)})",
                )
            )
    return [*messages, *({"role": "tool", "name": n, "content": r} for n, r in results)]


def native_tools(tokenizer: Any) -> ToolFormat | None:
    """The model's own call format when its chat template renders tools, else None."""
    fmt = format_for(tokenizer)
    if fmt is None:
        return None
    probe = [{"role": "user", "content": "x"}]
    tool = Tool("probe_fn", {"type": "object", "properties": {}}).as_openai()
    try:
        plain = tokenizer.apply_chat_template(probe, tokenize=False)
        with_tools = tokenizer.apply_chat_template(probe, tools=[tool], tokenize=False)
    except Exception:  # a template that chokes on tools= cannot render them
        return None
    return fmt if plain != with_tools else None


@dataclass(frozen=True, slots=True)
class ToolStyle:
    """How one model takes part in a tool conversation.

    `native`: its template renders tools and calls, and calls are written in `fmt`, the
    model's own format. Otherwise the tools are described in the system message and calls
    are Hermes-tagged text (any chat model; also a native model asked to force a format
    we cannot force).
    """

    fmt: ToolFormat
    native: bool
    grammar: str | None
    thinking: Thinking | None = None

    @property
    def template_kwargs(self) -> dict[str, Any]:
        return self.thinking.template_kwargs if self.thinking is not None else {}


def tool_style(
    tokenizer: Any,
    tools: tuple[Tool, ...],
    choice: ToolChoice,
    parallel: bool = False,
    think: bool | None = None,
    think_budget: int | None = None,
) -> ToolStyle:
    """The style and grammar (None: a free reply) of a conversation on this tokenizer;
    `think` and `think_budget` as in `reasoning.thinking_for`.

    Raises:
        UserInputError: `think` is True and the template has no thinking section.
    """
    thinking = thinking_for(tokenizer, think, think_budget)
    fmt = native_tools(tokenizer)
    forced = choice.mode in ("required", "function")
    if fmt is None or (fmt.call is None and forced):
        fmt, native, grammar = HERMES, False, tool_grammar(tools, choice, parallel)
    else:
        native = True
        grammar = tool_grammar(tools, choice, parallel, fmt) if fmt.call is not None else None
    if grammar is not None and thinking is not None and thinking.in_reply:
        grammar = thinking.grammar(grammar)
    return ToolStyle(fmt, native, grammar, thinking)


def _call_text(call: dict[str, Any]) -> str:
    body = json.dumps({"name": call["name"], "arguments": call["arguments"]}, ensure_ascii=False)
    return f"{CALL_START}\n{body}\n{CALL_END}"


def hermes_messages(
    messages: list[dict[str, Any]], tools: tuple[Tool, ...], system: str | None
) -> list[dict[str, str]]:
    """Plain chat messages: tools in the system message, calls and results as tagged text."""
    listing = "\n".join(json.dumps(t.as_openai(), ensure_ascii=False) for t in tools)
    block = HERMES_TOOLS.format(tools=listing)
    out = [{"role": "system", "content": f"{system}\n\n{block}" if system else block}]
    for msg in messages:
        if msg["role"] == "assistant" and msg.get("tool_calls"):
            parts = [msg["content"]] if msg["content"] else []
            parts += [_call_text(c) for c in msg["tool_calls"]]
            out.append({"role": "assistant", "content": "\n".join(parts)})
        elif msg["role"] == "tool":
            text = f"<tool_response>\n{msg['content']}\n</tool_response>"
            if out[-1]["role"] == "user" and out[-1]["content"].startswith("<tool_response>"):
                out[-1] = {"role": "user", "content": out[-1]["content"] + "\n" + text}
            else:
                out.append({"role": "user", "content": text})
        else:
            out.append({"role": msg["role"], "content": msg["content"]})
    return out


def _openai(msg: dict[str, Any]) -> dict[str, Any]:
    if msg.get("tool_calls"):
        calls = [{"type": "function", "function": c} for c in msg["tool_calls"]]
        return {**msg, "tool_calls": calls}
    return msg


@dataclass(slots=True)
class ToolsTask:
    """What the turns of a tool conversation share.

    `encode` fixes the style for the engine's model (its own call format, or Hermes in
    the system message); `request` and `read` then use it.
    """

    tools: tuple[Tool, ...]
    choice: ToolChoice
    system: str | None = None
    parallel: bool = False
    think: bool | None = False
    """Think first (True), not at all (False, the default), or as the template does (None)."""
    think_budget: int | None = None
    """Reply tokens spent thinking (see `Thinking.budget`); None: half of the reply's room."""
    style: ToolStyle | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.tools:
            raise ValueError("a tools task needs at least one tool")

    def style_for(self, engine: Engine) -> ToolStyle:
        """The style on `engine`'s model (worked out once, the grammar compiled then)."""
        if self.style is None:
            self.style = tool_style(
                engine.loaded.tokenizer,
                self.tools,
                self.choice,
                self.parallel,
                self.think,
                self.think_budget,
            )
        return self.style

    @property
    def call_start(self) -> str:
        """The text that opens a call in replies (after `encode`; Hermes before)."""
        return (self.style.fmt if self.style else HERMES).start

    @property
    def thinking(self) -> Thinking | None:
        """The replies' thinking section (after `encode`; None: none)."""
        return self.style.thinking if self.style else None

    def call_stream(self) -> CallStream | None:
        """Reads a reply's calls as it is written (after `encode`), where the grammar holds
        them to a format `CallStream` reads as it comes; None: they are read once it ends."""
        style = self.style
        tools = [t.as_openai() for t in self.tools]
        if style is None or style.grammar is None or not CallStream.supports(style.fmt, tools):
            return None
        return CallStream(style.fmt, tools)

    def encode(self, engine: Engine, messages: list[dict[str, Any]]) -> list[int]:
        """Token ids of the conversation with the tools described, ready for the reply."""
        if messages and messages[0]["role"] == "system":
            raise ValueError("pass the system message as ToolsTask.system")
        style = self.style_for(engine)
        if style.native:
            head = [{"role": "system", "content": self.system}] if self.system else []
            tools = [t.as_openai() for t in self.tools]
            chat = [*head, *map(_openai, messages)]
            ids = engine.encoder.encode_chat(chat, tools=tools, **style.template_kwargs)
        else:
            chat = hermes_messages(messages, self.tools, self.system)
            ids = engine.encoder.encode_chat(chat, **style.template_kwargs)
        engine.encoder.check_fits(ids, "the conversation")
        return ids

    def request(self, engine: Engine, ids: list[int], params: SamplingParams) -> Request:
        """A request for the reply (a fresh grammar matcher each time)."""
        from mlxcache.engine import Request

        style = self.style_for(engine)
        processors: list[LogitsProcessor] = []
        if style.grammar is not None:
            processors.append(processor_for(engine.loaded, style.grammar))
        room = engine.encoder.reply_room(ids, params.max_tokens)
        processors += budget_processors(style.thinking, engine.loaded.tokenizer, room)
        return Request(ids, params, processors)

    def read(self, result: Result) -> ToolReply:
        """The reply's content and checked calls (`none`: all text, no calls parsed).

        A call cut off at the token limit (or a forced call never begun) is an error
        saying so; the complete calls before it are kept.
        """
        reasoning, text = split_reply(self.thinking, result.text)
        reply = self._parse(text)
        reply = replace(reply, reasoning=reasoning)
        if self.choice.mode == "none":
            return reply
        forced = self.choice.mode != "auto"  # `required` / a name: the reply must be a call
        unfinished = reply.error is not None or (forced and not reply.calls)
        if result.finish_reason == "length" and unfinished:
            error = Worded(
                "the reply reached the token limit before the tool call was complete "
                '(finish_reason "length"); raise ',
                Setting("max_tokens"),
                describe_loop(result.text),
            )
            return ToolReply(reply.content, reply.calls, error, reasoning)
        return reply

    def _parse(self, text: str) -> ToolReply:
        if self.choice.mode == "none":
            return ToolReply(text.strip(), ())
        return parse_reply(text, self.tools, self.style.fmt if self.style else HERMES)


def finish_reason(reply: ToolReply, finish: str) -> str:
    """OpenAI's word for how a tool reply ended: `tool_calls` when it ends in calls, else
    the engine's own (`length` when the token limit cut a call, complete calls before it
    or not)."""
    cut = finish == "length" and reply.error is not None
    return "tool_calls" if reply.calls and not cut else finish


def next_turn(
    task: ToolsTask, engine: Engine, messages: list[dict[str, Any]], reply: ToolReply
) -> list[int]:
    """What the next prompt after `reply` starts with, for warm-ahead (`Engine.warm`): a
    tool result follows a call, a user message follows text (see `next_turn_prefix`)."""
    convo = [*messages, assistant_message(reply)]
    if reply.calls:
        return next_turn_prefix(
            lambda m: task.encode(engine, m), convo, "tool", name=reply.calls[0].name
        )
    return next_turn_prefix(lambda m: task.encode(engine, m), convo)


def assistant_message(reply: ToolReply) -> dict[str, Any]:
    """The reply as a message, to continue the conversation with --messages."""
    msg: dict[str, Any] = {"role": "assistant", "content": reply.content}
    if reply.calls:
        msg["tool_calls"] = [c.as_dict() for c in reply.calls]
    return msg
