"""A regress suite run on a running `mlxcache serve` (`regress record|check --server`).

The server runs the warm variant: one prompt cache (its own) for the whole suite, the cases
one request at a time. The other variants set the cache's state themselves (none, a new
process on the disk tier, lanes side by side), which a shared server cannot do: the CLI
refuses them by name. Standard library only, as `mlxcache.remote`: no model code loads.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mlxcache.modes.tools import ToolChoice, parse_tools
from mlxcache.regress.suite import Case, Messages, Output, Suite, turns
from mlxcache.remote import Server, tool_choice_field, usage_of
from mlxcache.request_spec import RequestSpec, conversation, to_wire

SERVER_VARIANTS = ("warm",)
"""The variants a server runs (see the module's docstring)."""


class ServerRunner:
    """Runs a suite's cases on `server` (whose identity the caller checked: every case's
    model is the one it serves, `model` is its id, `identity` its card's "mlxcache")."""

    def __init__(
        self,
        suite: Suite,
        server: Server,
        model: str,
        identity: dict[str, Any],
        progress: Callable[[str, str, str], None] | None = None,
    ) -> None:
        self.suite = suite
        self.server = server
        self.model = model
        self.identity = identity
        self.progress = progress or (lambda _v, _c, _w: None)
        self.cache_stats: dict[str, dict[str, int]] = {}

    def run(self, variant: str) -> dict[str, list[Output]]:
        if variant not in SERVER_VARIANTS:
            raise ValueError(f"variant {variant!r} does not run on a server")
        self.progress(variant, "", "start")
        seen = {"hits": 0, "cached_tokens": 0, "disk_hits": 0}
        out: dict[str, list[Output]] = {}
        for case in self.suite.cases:
            self.progress(variant, case.name, "start")
            conversation = turns(case)
            try:
                asked = next(conversation)
                while True:
                    replies = [self._reply(case, m, seen) for m in asked]
                    asked = conversation.send(replies)
            except StopIteration as stop:
                out[case.name] = stop.value
            self.progress(variant, case.name, "end")
        self.cache_stats[variant] = seen
        self.progress(variant, "", "end")
        return out

    def _reply(self, case: Case, messages: Messages, seen: dict[str, int]) -> Output:
        """One request of `case` on the server; its cache use counted in `seen`."""
        given: dict[str, Any] = {}
        system = None
        if case.kind == "json":
            system = case.data.get("instructions") or None
            given["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "reply", "schema": case.data["schema"]},
            }
        elif case.kind == "tools":
            system = case.data.get("system")
            tools = parse_tools(case.data["tools"], f"case {case.name!r} tools")
            given["tools"] = tuple(t.as_openai() for t in tools)
            given["tool_choice"] = tool_choice_field(
                ToolChoice.parse(str(case.data.get("tool_choice", "auto")), tools)
            )
            given["parallel_tool_calls"] = False
        request = RequestSpec(
            conversation(system, messages), sampling=case.sampling, model=self.model, **given
        )
        reply = self.server.post(request.path, to_wire(request))
        extra = usage_of(reply.get("usage"), self.server.url)
        stats = extra["stats"]
        seen["hits"] += stats["cached_tokens"] > 0
        seen["cached_tokens"] += stats["cached_tokens"]
        seen["disk_hits"] += stats.get("cached_from") == "disk"
        return {
            "text": extra["text"],
            "tokens": extra["tokens"],
            "finish_reason": extra["finish_reason"],
        }

    def models(self) -> dict[str, str]:
        return {c.name: str(self.identity["key"]) for c in self.suite.cases}

    def adapters(self) -> dict[str, dict[str, str] | None]:
        """The server's adapter (its card's), for every case (`golden.golden_adapter`)."""
        card = self.identity.get("adapter")
        served = {"name": str(card["name"]), "digest": str(card["digest"])} if card else None
        return {c.name: served for c in self.suite.cases}

    def versions(self) -> dict[str, str]:
        """The server's (published on its model card: `mlxcache.wire.identity`)."""
        found = self.identity
        return {"mlxcache": str(found["version"]), **{k: str(found[k]) for k in ("mlx", "mlx_lm")}}
