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
from dataclasses import dataclass, field
from typing import Any

from mlxcache.constrain import processor_for
from mlxcache.engine import Engine, LogitsProcessor, Request
from mlxcache.errors import UserInputError
from mlxcache.events import Result
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
            "--tool-result answers a tool call, but the conversation does not end with one "
            '(pass --messages FILE: the "messages" of the previous --json output)'
        )
    for name, _ in results:
        if name not in called:
            raise UserInputError(
                f"--tool-result {name}: the last assistant message made no call to {name} "
                f"(it called: {', '.join(called)})"
            )
    return [*messages, *({"role": "tool", "name": n, "content": r} for n, r in results)]


def native_tools(tokenizer: Any) -> bool:
    """True when the model's chat template renders tools and calls in the Hermes format."""
    if getattr(tokenizer, "tool_call_start", None) != CALL_START:
        return False
    if getattr(tokenizer, "tool_call_end", None) != CALL_END:
        return False
    probe = [{"role": "user", "content": "x"}]
    tool = Tool("probe_fn", {"type": "object", "properties": {}}).as_openai()
    try:
        plain = tokenizer.apply_chat_template(probe, tokenize=False)
        with_tools = tokenizer.apply_chat_template(probe, tools=[tool], tokenize=False)
    except Exception:  # a template that chokes on tools= cannot render them
        return False
    return bool(plain != with_tools)


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


@dataclass(frozen=True, slots=True)
class ToolsTask:
    """What the turns of a tool conversation share."""

    tools: tuple[Tool, ...]
    choice: ToolChoice
    system: str | None = None
    parallel: bool = False
    grammar: str | None = field(init=False, repr=False)
    """Compiled once from the above (None: `none`, a free reply)."""

    def __post_init__(self) -> None:
        if not self.tools:
            raise ValueError("a tools task needs at least one tool")
        object.__setattr__(self, "grammar", tool_grammar(self.tools, self.choice, self.parallel))

    def encode(self, engine: Engine, messages: list[dict[str, Any]]) -> list[int]:
        """Token ids of the conversation with the tools described, ready for the reply."""
        if messages and messages[0]["role"] == "system":
            raise ValueError("pass the system message as ToolsTask.system")
        if native_tools(engine.loaded.tokenizer):
            head = [{"role": "system", "content": self.system}] if self.system else []
            tools = [t.as_openai() for t in self.tools]
            ids = engine.encode_chat([*head, *map(_openai, messages)], tools=tools)
        else:
            ids = engine.encode_chat(hermes_messages(messages, self.tools, self.system))
        engine.check_fits(ids, "the conversation")
        return ids

    def request(self, engine: Engine, ids: list[int], params: SamplingParams) -> Request:
        """A request for the reply (a fresh grammar matcher each time)."""
        processors: list[LogitsProcessor] = []
        if self.grammar is not None:
            processors.append(processor_for(engine.loaded, self.grammar))
        return Request(ids, params, processors)

    def read(self, result: Result) -> ToolReply:
        """The reply's content and checked calls (`none`: all text, no calls parsed)."""
        if self.choice.mode == "none":
            return ToolReply(result.text.strip(), ())
        reply = parse_reply(result.text, self.tools)
        forced = self.choice.mode != "auto"  # `required` / a name: the reply must be a call
        if forced and reply.error is None and not reply.calls and result.finish_reason == "length":
            error = (
                "the reply reached the token limit before the tool call was complete "
                '(finish_reason "length"); raise --max-tokens'
            )
            return ToolReply(reply.content, (), error)
        return reply


def assistant_message(reply: ToolReply) -> dict[str, Any]:
    """The reply as a message, to continue the conversation with --messages."""
    msg: dict[str, Any] = {"role": "assistant", "content": reply.content}
    if reply.calls:
        msg["tool_calls"] = [c.as_dict() for c in reply.calls]
    return msg
