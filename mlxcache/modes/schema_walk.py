"""Walking a JSON Schema as a schema: subschema positions, local `$ref`s, cycles, closing.

Only keyword positions count (the values of `properties` are schemas, its keys are names;
`enum` and `default` are data), so a property named "not" is never taken for a keyword.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any
from urllib.parse import unquote

Parts = tuple[Any, ...]

# Keywords whose value is a schema, a list of schemas, or a map of name -> schema.
_ONE = (
    "additionalItems",
    "additionalProperties",
    "contains",
    "contentSchema",
    "else",
    "if",
    "items",
    "not",
    "propertyNames",
    "then",
    "unevaluatedItems",
    "unevaluatedProperties",
)
_LIST = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
# Not `definitions`/`$defs`: decoding reaches those only through a `$ref`.
_MAP = ("properties", "patternProperties", "dependentSchemas", "dependencies")
# Keywords applying their subschemas to the same value (no token is written in between),
# so a `$ref` loop through them never ends.
_IN_PLACE = ("allOf", "anyOf", "oneOf", "not", "if", "then", "else")
# Keywords next to `properties` that let other keys in (closing the object would break them).
_OPENERS = (
    "additionalProperties",
    "patternProperties",
    "unevaluatedProperties",
    "allOf",
    "anyOf",
    "oneOf",
    "$ref",
    "if",
    "dependentSchemas",
    "dependencies",
)

_OBJECT_KEYS = (
    "properties",
    "required",
    "patternProperties",
    "additionalProperties",
    "$ref",
    "allOf",
)


def pointer(parts: Parts) -> str:
    """A JSON pointer ("/properties/age") from path parts; "/" for the root."""
    items = [str(p).replace("~", "~0").replace("/", "~1") for p in parts]
    return "/" + "/".join(items) if items else "/"


def children(node: Any, parts: Parts = ()) -> Iterator[tuple[str, Parts, Any]]:
    """The direct subschemas of `node`: (keyword, path, subschema)."""
    if not isinstance(node, dict):
        return
    for key in _ONE:
        if isinstance(node.get(key), dict):
            yield key, (*parts, key), node[key]
    for key in _LIST:
        if isinstance(node.get(key), list):
            for i, sub in enumerate(node[key]):
                yield key, (*parts, key, i), sub
    for key in _MAP:
        if isinstance(node.get(key), dict):
            for name, sub in node[key].items():
                if isinstance(sub, dict):  # `dependencies` may also map to a list of names
                    yield key, (*parts, key, name), sub


def resolve(root: Any, ref: Any) -> tuple[Parts, Any] | None:
    """The path and subschema a local `$ref` ("#", "#/definitions/a") names, or None."""
    if not isinstance(ref, str) or not ref.startswith("#") or (len(ref) > 1 and ref[1] != "/"):
        return None
    node: Any = root
    parts: Parts = ()
    for raw in ref[2:].split("/") if len(ref) > 1 else []:
        part = unquote(raw).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node, parts = node[part], (*parts, part)
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node, parts = node[int(part)], (*parts, int(part))
        else:
            return None
    return parts, node


def reachable(root: Any) -> Iterator[tuple[Parts, dict[str, Any]]]:
    """Every subschema decoding can reach from the root, local `$ref`s followed, once each."""
    seen: set[int] = set()
    stack: list[tuple[Parts, Any]] = [((), root)]
    while stack:
        parts, node = stack.pop()
        if not isinstance(node, dict) or id(node) in seen:
            continue
        seen.add(id(node))
        yield parts, node
        target = resolve(root, node.get("$ref"))
        if target is not None:
            stack.append(target)
        stack.extend((p, sub) for _, p, sub in reversed(list(children(node, parts))))


def ref_cycle(root: Any) -> Parts | None:
    """The path of a `$ref` that loops back to the same value without writing anything
    (through `$ref`, allOf/anyOf/oneOf, not, if/then/else), or None.

    Such a schema has no finite grammar and sends a validator into endless recursion.
    """
    for start_parts, start in reachable(root):
        stack: list[tuple[Parts, Any]] = [(start_parts, start)]
        seen: set[int] = set()
        while stack:
            parts, node = stack.pop()
            if not isinstance(node, dict) or id(node) in seen:
                continue
            seen.add(id(node))
            target = resolve(root, node.get("$ref"))
            if target is not None:
                if target[1] is start:
                    return (*parts, "$ref")
                stack.append(target)
            stack.extend((p, sub) for key, p, sub in children(node, parts) if key in _IN_PLACE)
    return None


def _merged(parent: dict[str, Any], key: str) -> bool:
    """Whether the `key` subschemas of `parent` apply together with other object keywords."""
    if key in ("allOf", "if", "then", "else", "dependentSchemas", "dependencies"):
        return True
    return key in ("anyOf", "oneOf") and any(k in parent for k in _OBJECT_KEYS)


def close_objects(root: dict[str, Any]) -> None:
    """Forbid extra keys (in place) in every object schema with `properties` that leaves
    them open by omission, so a model cannot ramble on with keys of its own.

    Left open: objects whose keys other keywords extend (allOf branches and what they
    `$ref`, siblings of allOf/anyOf/$ref/patternProperties...), and objects requiring a
    key they do not list. Closing only narrows the schema: every output stays valid.
    """
    shared: set[int] = set()  # merged with other schemas' keys (allOf, then, a parent's)
    stack: list[Any] = [
        sub for _, node in reachable(root) for key, _, sub in children(node) if _merged(node, key)
    ]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict) or id(node) in shared:
            continue
        shared.add(id(node))
        target = resolve(root, node.get("$ref"))
        stack += [target[1]] if target else []
        stack += [sub for key, _, sub in children(node) if key in _IN_PLACE]
    for _, node in reachable(root):
        props = node.get("properties")
        if not isinstance(props, dict) or id(node) in shared:
            continue
        if any(key in node for key in _OPENERS):
            continue
        required = node.get("required", [])
        if isinstance(required, list) and all(name in props for name in required):
            node["additionalProperties"] = False


_REF_KEEP = frozenset(
    ("$ref", "definitions", "$defs", "$schema", "$id", "id", "title", "description", "$comment")
)


def strip_ref_siblings(root: dict[str, Any]) -> list[str]:
    """Drop (in place) the validation keywords next to each reachable `$ref`; say where.

    Drafts 4 to 7 ignore them anyway; llguidance cannot intersect them with a recursive
    reference, so lenient decoding leaves them to the validation after decoding.
    """
    dropped = []
    for parts, node in list(reachable(root)):
        extra = [key for key in node if key not in _REF_KEEP] if "$ref" in node else []
        for key in extra:
            del node[key]
        if extra:
            dropped.append(f"keywords next to $ref at {pointer(parts)}")
    return dropped


def narrow_recursive_allof(root: dict[str, Any], ref: str) -> list[str]:
    """Reduce (in place) each reachable allOf holding a `$ref` to `ref` (a recursive
    definition llguidance cannot intersect) to that one branch; say where."""
    target = resolve(root, ref)
    narrowed = []
    for parts, node in list(reachable(root)):
        branches = node.get("allOf")
        if target is None or not isinstance(branches, list) or len(branches) < 2:
            continue
        hit = next(
            (b for b in branches if isinstance(b, dict) and _targets(root, b, target[1])), None
        )
        if hit is not None:
            node["allOf"] = [hit]
            narrowed.append(
                f"allOf at {pointer((*parts, 'allOf'))} (only its {ref} branch decoded)"
            )
    return narrowed


def _targets(root: dict[str, Any], branch: dict[str, Any], node: Any) -> bool:
    found = resolve(root, branch.get("$ref"))
    return found is not None and found[1] is node


def keyword_at(root: Any, keywords: set[str]) -> str | None:
    """Where the first reachable subschema using one of `keywords` uses it, or None."""
    for parts, node in reachable(root):
        hit = next((k for k in node if k in keywords), None)
        if hit is not None:
            return pointer((*parts, hit))
    return None


def value_at(root: Any, keyword: str, value: str) -> str | None:
    """Where the first reachable subschema has `keyword` equal to `value`, or None."""
    for parts, node in reachable(root):
        if node.get(keyword) == value:
            return pointer((*parts, keyword))
        if keyword == "pattern" and value in node.get("patternProperties", {}):
            return pointer((*parts, "patternProperties", value))
    return None
