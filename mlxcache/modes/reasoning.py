"""Reasoning models: a thinking section before the constrained answer, or none at all.

A chat template with a thinking section (`<think>...</think>`, what mlx-lm detects from
the vocabulary, or the tags in the template) is asked through `enable_thinking` to think
or not. Thinking on: the grammar lets the reply open with one thinking section of at most
`max_chars` characters, then the constrained answer. Thinking off: the answer comes first.
A template that opens the section in the prompt itself is followed inside it either way.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from mlxcache.constrain import regex_literal
from mlxcache.errors import UserInputError

THINK_TAGS = ("<think>", "</think>")
MAX_THINKING_CHARS = 4000
"""Longest thinking section the grammar allows (then it must close; ~1k tokens)."""


@dataclass(frozen=True, slots=True)
class Thinking:
    """A template's thinking section and what one request does with it."""

    start: str
    end: str
    enabled: bool
    """The template is asked to think (`enable_thinking`)."""
    opened: bool = False
    """The rendered prompt itself ends inside the section."""
    max_chars: int = MAX_THINKING_CHARS

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
        thought = f"/(?s:.){{0,{self.max_chars}}}{regex_literal(self.end)}/"
        head = "thought" if self.opened else f"({json.dumps(self.start)} thought)?"
        lark = f"start: {head} SPACE @answer\nthought[lazy]: {thought}\nSPACE: /[ \\t\\n]*/\n"
        return json.dumps({**doc, "grammars": [{"name": "thinking", "lark_grammar": lark}, *subs]})

    def split(self, text: str) -> tuple[str | None, str]:
        """(the reasoning or None, the answer) of a reply."""
        body = (
            text
            if self.opened
            else text.removeprefix(self.start)
            if text.startswith(self.start)
            else None
        )
        if body is None or self.end not in body:
            return None, text
        reasoning, _, answer = body.partition(self.end)
        return reasoning.strip(), answer.lstrip()


def _tags(tokenizer: Any) -> tuple[str, str] | None:
    start, end = getattr(tokenizer, "think_start", None), getattr(tokenizer, "think_end", None)
    if isinstance(start, str) and isinstance(end, str):
        return start, end
    template = getattr(getattr(tokenizer, "_tokenizer", tokenizer), "chat_template", None)
    if isinstance(template, str) and all(tag in template for tag in THINK_TAGS):
        return THINK_TAGS
    return None


def thinking_for(tokenizer: Any, think: bool | None) -> Thinking | None:
    """How a request on this tokenizer thinks; None when its template has no thinking
    section (or `think` is None: leave the template's default and the reply as is).

    Raises:
        UserInputError: `think` is True and the template has no thinking section.
    """
    tags = _tags(tokenizer)
    if tags is None:
        if think:
            raise UserInputError("--think: this model's chat template has no thinking section")
        return None
    if think is None:
        return None
    probe = [{"role": "user", "content": "x"}]
    prompt = tokenizer.apply_chat_template(
        probe, add_generation_prompt=True, tokenize=False, enable_thinking=think
    )
    tail = str(prompt).rstrip()
    opened = tail.endswith(tags[0]) and not tail.endswith(tags[1])
    return Thinking(tags[0], tags[1], think, opened)
