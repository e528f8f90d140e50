"""How a model's layer caches are stored block by block, whatever their kind.

A block is a dict of arrays for B tokens of every layer, keyed by the chained hash of the
tokens up to its end (`blocks.chain_hashes`), so a prompt can resume at any block boundary
of a prefix it shares with a kept one:

- plain KV layers (`KVCache`): the block's keys and values; all of them, when the model
  has only such layers and keys and values of one shape, stacked into one array "kv" (one
  tensor per block in memory and on disk; MLA models' keys and values differ in width);
- sliding-window layers (`RotatingKVCache`): the block's keys and values too, cut right
  after the chunk that computed them (the ring buffer drops them later). Restored at
  block k, the ring holds exactly what a cold canonical prefill leaves there: the same
  positions, in the same order, at the same size (`_ring_start`);
- quantized KV layers (`QuantizedKVCache`, `--kv-bits`): the block's packed keys and values
  with their scales and biases, as they were quantized (each position on its own);
- recurrent layers (`ArraysCache`: SSM, gated delta, conv states): their state after the
  block, which cannot be rebuilt from anything else. The store keeps it apart from the
  block (`split`), at some block boundaries only: a resume needs just the state where it
  starts.

A model with any other cache kind has no layout: the store keeps whole-state checkpoints.
"""

from __future__ import annotations

from typing import Any, cast

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache, QuantizedKVCache, RotatingKVCache

from mlxcache.cache import blocks as kv
from mlxcache.ring import TimeRing
from mlxcache.types import KVLayer, LayerCache, Layers

Block = dict[str, mx.array]
_QPARTS = ("", ".s", ".b")
"""A quantized layer's arrays in a block: packed values, scales, biases (keys, values)."""


def _kind(cache: Any) -> str | None:
    if type(cache) is KVCache:
        return "kv"
    if type(cache) in (RotatingKVCache, TimeRing):
        return "ring"
    if type(cache) is QuantizedKVCache:
        return "qkv"
    if isinstance(cache, ArraysCache):
        return "state"
    return None


def _ring_start(stop: int, block: int, max_size: int, keep: int) -> tuple[int, int]:
    """Which positions a ring buffer holds after canonical chunks of `block` up to `stop`:
    the first `keep` ones, then [start, stop). Each chunk keeps the last max_size - 1
    positions before it (besides `keep`) and appends itself, so the window before the last
    chunk is max_size - 1 long."""
    start = max(keep, stop - block - (max_size - 1 - keep))
    return (keep if start > keep else 0), (start if start > keep else 0)


class Layout:
    """The block layout of one model (see the module docstring)."""

    def __init__(self, fresh: Layers, kinds: list[str]) -> None:
        self.kinds = kinds
        self.n_layers = len(kinds)
        self.plain = all(k == "kv" for k in kinds)
        self.attention_only = all(k in ("kv", "qkv") for k in kinds)
        """Plain or quantized KV only: blocks stay in the layers as computed, so they may be
        cut when kept (the others are captured right after their chunk or decode step:
        `needs_capture`)."""
        quantized = {i: cast(QuantizedKVCache, c) for i, c in enumerate(fresh) if kinds[i] == "qkv"}
        self._quant = {i: (int(c.group_size), int(c.bits)) for i, c in quantized.items()}
        rings = {i: cast(RotatingKVCache, c) for i, c in enumerate(fresh) if kinds[i] == "ring"}
        self._rings = {i: (int(c.max_size), int(c.keep)) for i, c in rings.items()}
        slots = {i: cast(ArraysCache, c) for i, c in enumerate(fresh) if kinds[i] == "state"}
        self._slots = {i: len(c.cache) for i, c in slots.items()}

    @classmethod
    def of(cls, fresh: Layers, block_size: int) -> Layout | None:
        """The layout of a model whose fresh caches are `fresh`; None when some layer's
        cache kind cannot be stored block by block (a ring buffer fed chunks of one token
        takes another path, whose layout this does not rebuild)."""
        kinds = [_kind(c) for c in fresh]
        if not kinds or any(k is None for k in kinds) or ("ring" in kinds and block_size < 2):
            return None
        return cls(fresh, [str(k) for k in kinds])

    @property
    def name(self) -> str:
        """How blocks are laid out, for the cache namespace: "" for plain stacked KV, else
        "layout-v1", with the KV quantization when some layer has one ("layout-v1-q8g64")."""
        if self.plain:
            return ""
        quant = "".join(sorted({_quant_name(bits, group) for group, bits in self._quant.values()}))
        return "layout-v1" + (f"-{quant}" if quant else "")

    @property
    def windows(self) -> list[int]:
        """The sliding windows' sizes (none: no sliding layer)."""
        return [size for size, _ in self._rings.values()]

    @property
    def has_state(self) -> bool:
        """Whether some layer is recurrent (its state is kept apart from the blocks)."""
        return bool(self._slots)

    def split(self, block: Block) -> tuple[Block, Block]:
        """A cut block's attention arrays, and its recurrent states (empty: no such layer)."""
        state = {k: v for k, v in block.items() if k.startswith("s.")}
        return {k: v for k, v in block.items() if not k.startswith("s.")}, state

    @property
    def needs_capture(self) -> bool:
        """Whether a block must be cut right after the chunk that computed it (sliding and
        recurrent layers do not hold it, or its state, later); plain KV is cut at keep time."""
        return not self.attention_only

    def cut(self, layers: Layers, start: int, stop: int) -> Block:
        """Positions [start, stop) of every attention layer, and every recurrent layer's
        state, from `layers` that hold them (a ring still holds them: right after the
        chunk or step that computed them, or while it has dropped no position; a recurrent
        state holds exactly `stop` tokens). A copy: never aliases `layers`."""
        if self.plain and self._uniform(layers):
            return {"kv": kv.cut_block(cast("list[KVLayer]", layers), start, stop)}
        out: Block = {}
        for i, (kind, c) in enumerate(zip(self.kinds, layers, strict=True)):
            if kind == "state":
                for j, value in enumerate(cast(ArraysCache, c).cache):
                    if value is not None:
                        out[f"s.{i}.{j}"] = mx.array(value)
                continue
            if kind == "qkv":
                q = cast(Any, c)
                for p, parts in (("k", q.keys), ("v", q.values)):
                    for suffix, part in zip(_QPARTS, parts, strict=True):
                        out[f"{p}.{i}{suffix}"] = mx.array(part[0, :, start:stop, :])
                continue
            keys, values = cast(KVLayer, c).keys, cast(KVLayer, c).values
            if kind == "ring":  # the ring in time order ends at its offset
                ring = cast(RotatingKVCache, c)
                keys, values = ring._temporal_order(keys), ring._temporal_order(values)
                first = ring.offset - keys.shape[2]
            else:
                first = 0
            out[f"k.{i}"] = mx.array(keys[0, :, start - first : stop - first, :])
            out[f"v.{i}"] = mx.array(values[0, :, start - first : stop - first, :])
        mx.eval(list(out.values()))
        return out

    @staticmethod
    def _uniform(layers: Layers) -> bool:
        """Whether keys and values have one shape (plain KV; not MLA's latent layout)."""
        first = cast(KVLayer, layers[0])
        return bool(first.keys.shape == first.values.shape)

    def check(self, block: Block) -> bool:
        """Whether a block read back from disk has every attention array this layout needs."""
        if self.plain and set(block) == {"kv"}:
            return True
        return self._names() <= set(block)

    def _names(self) -> set[str]:
        """Every attention array name a block of this layout holds."""
        return {
            f"{p}.{i}{suffix}"
            for i, k in enumerate(self.kinds)
            if k != "state"
            for p in "kv"
            for suffix in (_QPARTS if k == "qkv" else ("",))
        }

    def check_state(self, state: Block) -> bool:
        """Whether a state read back from disk has a state for every recurrent layer."""
        return all(any(n.startswith(f"s.{i}.") for n in state) for i in self._slots)

    def join(
        self, blocks: list[Block], block_size: int, state: Block | None = None
    ) -> list[LayerCache]:
        """Fresh caches holding `blocks` (consecutive from token 0) and the recurrent
        `state` after the last one: exactly what a cold canonical prefill leaves there.
        Without a state, recurrent layers are empty (a tail's state follows)."""
        if "kv" in blocks[0]:
            return kv.join_blocks([b["kv"] for b in blocks], self.n_layers)
        layers = [
            self._state(i, state or {})
            if kind == "state"
            else self._attention(i, blocks, block_size)
            for i, kind in enumerate(self.kinds)
        ]
        mx.eval([c.state for c in layers])
        return layers

    def _state(self, i: int, state: Block) -> ArraysCache:
        c = ArraysCache(self._slots[i])
        self._set_state(i, c, state)
        return c

    def _set_state(self, i: int, c: ArraysCache, state: Block) -> None:
        """Layer i's slots from `state`, as new arrays (empty where it has none)."""
        for j in range(self._slots[i]):
            name = f"s.{i}.{j}"
            c[j] = mx.array(state[name]) if name in state else None

    def _attention(self, i: int, blocks: list[Block], block_size: int) -> Any:
        stop = len(blocks) * block_size

        def positions(first: int, last: int, suffix: str = "") -> list[mx.array]:
            parts = blocks[first // block_size : -(-last // block_size)]
            at = first // block_size * block_size
            return [
                mx.concatenate([b[f"{p}.{i}{suffix}"] for b in parts], axis=1)[None][
                    ..., first - at : last - at, :
                ]
                for p in "kv"
            ]

        if self.kinds[i] == "qkv":
            group, bits = self._quant[i]
            q: Any = QuantizedKVCache(group_size=group, bits=bits)
            parts = [positions(0, stop, suffix) for suffix in _QPARTS]
            # New array objects: a live cache's in-place updates never reach a stored block.
            q.keys = tuple(mx.array(p[0]) for p in parts)
            q.values = tuple(mx.array(p[1]) for p in parts)
            q.offset = stop
            return q
        if self.kinds[i] == "kv":
            c: Any = KVCache()
            keys, values = positions(0, stop)
        else:
            max_size, keep = self._rings[i]
            c = TimeRing(max_size=max_size, keep=keep)
            kept, first = _ring_start(stop, block_size, max_size, keep)
            keys, values = positions(first, stop)
            if kept:  # the `keep` first positions stay in front
                head = positions(0, kept)
                keys = mx.concatenate([head[0], keys], axis=2)
                values = mx.concatenate([head[1], values], axis=2)
        # New array objects: a live cache's in-place updates never reach a stored block.
        c.keys, c.values = mx.array(keys), mx.array(values)
        c.offset = stop
        if self.kinds[i] == "ring":
            c._idx = int(c.keys.shape[2])
        return c

    def head(self, block: Block, k: int) -> Block:
        """The first `k` positions of a block or tail of attention layers (as `cut` cuts
        them: positions on the second-to-last axis, quantized parts too)."""
        assert not self.has_state  # a recurrent state cannot be cut inside a block
        return {name: a[..., :k, :] for name, a in block.items()}

    def append(self, layers: Layers, tail: Block) -> None:
        """Continue `layers` with a tail cut past their end (`cut`), as its prefill chunk
        did: attention layers take its positions, recurrent layers its state."""
        if "kv" in tail:
            kv.append(cast("list[KVLayer]", layers), tail["kv"])
            return
        for i, (kind, c) in enumerate(zip(self.kinds, layers, strict=True)):
            if kind == "state":
                self._set_state(i, cast(ArraysCache, c), tail)
            elif kind == "qkv":
                _extend(c, [tail[f"{p}.{i}{s}"] for p in "kv" for s in _QPARTS])
            elif tail[f"k.{i}"].shape[1]:
                cast(KVLayer, c).update_and_fetch(tail[f"k.{i}"][None], tail[f"v.{i}"][None])
        mx.eval([c.state for c in layers])


def nbytes(block: Block) -> int:
    """Bytes of a block's arrays."""
    return sum(int(v.nbytes) for v in block.values())


def _extend(q: Any, parts: list[mx.array]) -> None:
    """Append positions already quantized (keys' packed, scales, biases, then values') to
    `q` (a `QuantizedKVCache`), as a prefill chunk's `update_and_fetch` would store them."""
    n = int(parts[0].shape[1])
    if n == 0:
        return
    if q.keys is None:
        joined = [p[None] for p in parts]
    else:
        held = [x[..., : q.offset, :] for x in (*q.keys, *q.values)]
        joined = [mx.concatenate([h, p[None]], axis=2) for h, p in zip(held, parts, strict=True)]
    q.keys, q.values = tuple(joined[:3]), tuple(joined[3:])
    q.offset += n


def kv_tag(layers: Layers) -> str:
    """What quantized KV `layers` hold, as cache namespaces and probe records name it
    ("q8g64"); "" for full precision."""
    tags = {_quant_name(c.bits, c.group_size) for c in layers if isinstance(c, QuantizedKVCache)}
    return "".join(sorted(tags))


def _quant_name(bits: int, group_size: int) -> str:
    return f"q{bits}g{group_size}"
