"""Reasoning models: a thinking section before the constrained answer, or none at all.

A chat template with a thinking section (`<think>...</think>`, what mlx-lm detects from
the vocabulary, or the tags in the template) is asked through `enable_thinking` to think
or not. Thinking on: the grammar lets the reply open with one thinking section, then the
constrained answer; `ThinkingBudget` closes the section once it has taken its budget of
tokens (by default half of what the reply may have), so the answer keeps the rest.
Thinking off: the answer comes first. A template that opens the section in the prompt
itself is followed inside it either way. `Thinking.split` sets the reasoning apart (json,
tools and the server's replies alike).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from mlxcache.constrain import apply_mask, regex_literal
from mlxcache.errors import Setting, UserInputError, Worded
from mlxcache.stops import partial_marker

THINK_TAGS = ("<think>", "</think>")
_THINK, _BUDGET = Setting("think"), Setting("think_budget")  # as `thinking_for` names them


@dataclass(frozen=True, slots=True)
class Thinking:
    """A template's thinking section and what one request does with it."""

    start: str
    end: str
    enabled: bool
    """The template is asked to think (`enable_thinking`)."""
    opened: bool = False
    """The rendered prompt itself ends inside the section."""
    budget: int | None = None
    """Reply tokens spent thinking before the end tag is forced (the start tag included);
    None: half of what the reply may have (`budget_processors`)."""

    def __post_init__(self) -> None:
        if self.budget is not None and self.budget < 0:
            raise UserInputError(Worded(_BUDGET, f" must be >= 0, got {self.budget}"))

    @property
    def in_reply(self) -> bool:
        """Whether the reply may hold a thinking section."""
        return self.enabled or self.opened

    @property
    def template_kwargs(self) -> dict[str, Any]:
        return {"enable_thinking": self.enabled}

    def grammar(self, answer: str) -> str:
        """`answer` (an llguidance grammar) preceded by the bounded thinking section."""
        try:
            doc = json.loads(answer)
            subs = doc["grammars"]
        except ValueError:  # a Lark text
            doc, subs = {}, [{"lark_grammar": answer}]
        subs = [dict(subs[0], name="answer"), *subs[1:]]
        thought = f"/(?s:.)*{regex_literal(self.end)}/"
        head = "thought" if self.opened else f"({json.dumps(self.start)} thought)?"
        lark = f"start: {head} SPACE @answer\nthought[lazy]: {thought}\nSPACE: /[ \\t\\n]*/\n"
        return json.dumps({**doc, "grammars": [{"name": "thinking", "lark_grammar": lark}, *subs]})

    def split(self, text: str, final: bool = True) -> tuple[str | None, str]:
        """(the reasoning, None: the reply has no section; the answer after it).

        A section cut off before its end tag is all reasoning. While the reply is still
        coming (`final` False): only what no later text can change, so a reply that may
        still be opening its section shows nothing yet.
        """
        if not self.opened:
            if not text.startswith(self.start):
                if not final and self.start.startswith(text):
                    return None, ""
                return None, text
            text = text[len(self.start) :]
        cut = text.find(self.end)
        if cut >= 0:
            return text[:cut].strip(), text[cut + len(self.end) :].lstrip()
        if not final:
            text = text[: len(text) - partial_marker(text, self.end)]
        return text.strip(), ""


def split_reply(thinking: Thinking | None, text: str, final: bool = True) -> tuple[str | None, str]:
    """`Thinking.split` of a reply that may hold a section; (None, `text`) when it cannot."""
    if thinking is None or not thinking.in_reply:
        return None, text
    return thinking.split(text, final)


class ThinkingBudget:
    """Logits processor: once the reply has spent `budget` tokens inside its thinking
    section, only the end tag stays allowed (its token when it is one, as Qwen3's
    `</think>`; else its text's tokens, one per step), then the answer follows.

    Placed after the grammar's processor, it forces nothing the grammar forbids, and
    never inside a half-written character. Until the budget is spent it reads nothing;
    then it reads the reply decoded until the section closes (or turns out not to exist).
    """

    def __init__(self, thinking: Thinking, tokenizer: Any, budget: int) -> None:
        self._thinking = thinking
        self._tokenizer = tokenizer
        self.budget = budget
        tag = tokenizer.encode(thinking.end, add_special_tokens=False)
        self._tag_token: int | None = int(tag[0]) if len(tag) == 1 else None
        # The first token of each rest of the tag, encoded here, on the front end's thread:
        # the engine thread only decodes (see `encoder` on tokenizers and threads).
        end = thinking.end
        rests = range(len(end)) if self._tag_token is None else ()
        self._rest_token = [
            int(tokenizer.encode(end[n:], add_special_tokens=False)[0]) for n in rests
        ]
        self._prompt_len: int | None = None
        self._done = False
        self.forced = 0
        """End-tag tokens forced so far."""

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        if self._prompt_len is None:
            self._prompt_len = int(tokens.shape[-1])
        spent = int(tokens.shape[-1]) - self._prompt_len
        if self._done or spent < self.budget:
            return logits
        reply: list[int] = np.asarray(tokens).reshape(-1)[self._prompt_len :].tolist()
        token = self._next_tag_token(self._tokenizer.decode(reply))
        if token is None:
            return logits
        width = int(logits.shape[-1])
        if token >= width or not np.isfinite(np.asarray(logits.reshape(-1)[token].item())):
            return logits  # the grammar has the last word
        allowed = np.zeros(width, dtype=bool)
        allowed[token] = True
        self.forced += 1
        return apply_mask(logits, allowed)

    def _next_tag_token(self, text: str) -> int | None:
        """The end tag's next token, or None: nothing to force (yet, or ever again)."""
        end = self._thinking.end
        reasoning, answer = self._thinking.split(text, final=False)
        if reasoning is None:
            self._done = answer != ""  # no section; "": the reply may still open one
            return None
        if end in text:
            self._done = True
            return None
        if text.endswith("\ufffd"):
            return None  # a character half-written: let it complete first
        if self._tag_token is not None:
            return self._tag_token
        return self._rest_token[partial_marker(text, end)]


def budget_processors(thinking: Thinking | None, tokenizer: Any, room: int) -> list[ThinkingBudget]:
    """The processor holding a request's thinking to its budget (none: no section);
    `room`: the tokens the reply may have (`Encoder.reply_room`), halved by default."""
    if thinking is None or not thinking.in_reply:
        return []
    budget = thinking.budget if thinking.budget is not None else room // 2
    return [ThinkingBudget(thinking, tokenizer, budget)]


def check_think_options(think: bool | None, budget: int | None, max_tokens: int | None) -> None:
    """Refuse a thinking budget without thinking, or one that leaves the answer nothing.

    Raises:
        UserInputError: naming the option.
    """
    if budget is not None and not think:
        raise UserInputError(Worded(_BUDGET, " goes with ", _THINK))
    if budget is not None and max_tokens is not None and budget >= max_tokens:
        room = f" {budget} leaves no room for the answer in "
        raise UserInputError(Worded(_BUDGET, room, Setting("max_tokens"), f" {max_tokens}"))


def _tags(tokenizer: Any) -> tuple[str, str] | None:
    start, end = getattr(tokenizer, "think_start", None), getattr(tokenizer, "think_end", None)
    if isinstance(start, str) and isinstance(end, str):
        return start, end
    template = getattr(getattr(tokenizer, "_tokenizer", tokenizer), "chat_template", None)
    if isinstance(template, str) and all(tag in template for tag in THINK_TAGS):
        return THINK_TAGS
    return None


def has_thinking(tokenizer: Any) -> bool:
    """Whether the model's chat template has a thinking section (can be asked to think)."""
    return _tags(tokenizer) is not None


def reply_thinking(tokenizer: Any, prompt: str) -> Thinking | None:
    """The thinking section a reply may open, or continue when `prompt` (the rendered
    prompt's end) leaves it open, with the template left to its default (the server's
    plain chat); None: the template has no thinking section."""
    tags = _tags(tokenizer)
    if tags is None:
        return None
    return Thinking(tags[0], tags[1], enabled=True, opened=_left_open(prompt, tags))


def _left_open(prompt: str, tags: tuple[str, str]) -> bool:
    """Whether a rendered prompt ends by opening a thinking section (whitespace aside)."""
    tail = prompt.rstrip()
    return tail.endswith(tags[0]) and not tail.endswith(tags[1])


def thinking_for(tokenizer: Any, think: bool | None, budget: int | None = None) -> Thinking | None:
    """How a request on this tokenizer thinks; None when its template has no thinking
    section (or `think` is None: leave the template's default and the reply as is).
    `budget`: see `Thinking.budget`.

    Raises:
        UserInputError: `think` is True and the template has no thinking section, or a
            budget is given without `think`.
    """
    check_think_options(think, budget, None)
    tags = _tags(tokenizer)
    if tags is None:
        if think:
            raise UserInputError(
                Worded(_THINK, ": this model's chat template has no thinking section")
            )
        return None
    if think is None:
        return None
    probe = [{"role": "user", "content": "x"}]
    prompt = tokenizer.apply_chat_template(
        probe, add_generation_prompt=True, tokenize=False, enable_thinking=think
    )
    return Thinking(tags[0], tags[1], think, _left_open(str(prompt), tags), budget)
