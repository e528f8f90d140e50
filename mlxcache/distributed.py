"""One model over several processes (`mlx.launch`): the model sharded, rank 0 in charge.

Every rank loads the model and takes its shard: tensor parallel through the model's own
`shard()` (mlx-lm's), or pipeline stages through `model.model.pipeline()`. Rank 0 runs
the command (reads the prompt, tokenizes, serves HTTP, schedules) and tells the others
each engine call it makes (`Ranks.tell`: `submit`, `step`, `cancel`, ...), with its
arguments, before making it; the others replay the calls in the same order on their
own engine (`follow`), so every rank makes the same forward calls with the same shapes,
which the collectives inside each forward need. Nothing that decides a forward is
re-derived on a rank: sampled tokens are rank 0's (`Ranks.token`), and so is every cache
lookup (`AgreedCache`).

Each rank keeps its own prompt cache (its shard's KV), under a model key that names the
split, the world size and the rank (`Topology.tag`): an entry of a single process is
never served to a sharded run, nor one of another split.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import pickle
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import numpy as np

from mlxcache.cache.base import Lease, PrefixCache
from mlxcache.decode import FAILED
from mlxcache.errors import MlxcacheError, RankError, Setting, UnsupportedModelError, Worded
from mlxcache.peers import replay
from mlxcache.types import new_layers

if TYPE_CHECKING:
    from mlxcache.engine import Engine
    from mlxcache.model import LoadedModel
    from mlxcache.sampling import LogitsProcessor

SPLITS = ("tensor", "pipeline")


@dataclass(frozen=True, slots=True)
class Topology:
    """How the model is split: `size` processes, this one `rank`, by `split`."""

    size: int
    rank: int
    split: str

    @property
    def leader(self) -> bool:
        return self.rank == 0

    @property
    def tag(self) -> str:
        """Names this rank's shard in its cache entries' model key."""
        return f"{self.split}{self.size}-rank{self.rank}"


def _group() -> mx.distributed.Group:
    try:
        return mx.distributed.init()
    except RuntimeError as exc:  # a hostfile or peer the backend cannot reach
        raise RankError(f"cannot join the distributed run: {exc}") from exc


def sync(what: str) -> None:
    """Wait until every rank reaches this point."""
    _all_sum(np.zeros(1, np.int32), what)


def _all_sum(values: np.ndarray, what: str) -> np.ndarray:
    try:
        out = mx.distributed.all_sum(mx.array(values), stream=mx.cpu)
        mx.eval(out)
    except RuntimeError as exc:  # the ring backend's "connection to a peer was lost"
        raise RankError(f"another rank stopped ({what}): {exc}") from exc
    return np.array(out)


def can_split(model: Any, split: str) -> bool:
    if split == "tensor":
        return hasattr(model, "shard")
    return hasattr(getattr(model, "model", None), "pipeline")


def topology(model: Any, config: dict[str, Any], split: str | None) -> Topology | None:
    """The topology this process was launched into (None: alone), `split` defaulting to
    tensor parallel where `model` (of `config`) supports it, else pipeline.

    Raises:
        UnsupportedModelError: the model supports neither split, or not the one asked for,
            or cannot be split in as many parts as there are ranks.
        RankError: the launcher's group cannot be joined.
    """
    group = _group()
    if group.size() == 1:
        return None
    if split is None:
        split = next((s for s in SPLITS if can_split(model, s)), None)
        if split is None:
            raise UnsupportedModelError(
                f"{type(model).__module__} can be split neither by tensor nor by pipeline"
            )
    elif not can_split(model, split):
        raise UnsupportedModelError(
            Worded(f"this model cannot be split by {split} (", Setting("split"), ")")
        )
    topo = Topology(group.size(), group.rank(), split)
    _check_fits(config, topo)
    return topo


def _check_fits(config: dict[str, Any], topo: Topology) -> None:
    """Each rank must get whole heads (tensor) or at least one layer (pipeline): mlx-lm's
    own split would build empty projections and fail at the first forward."""
    if topo.split == "pipeline":
        layers = int(config.get("num_hidden_layers") or 0)
        if layers and topo.size > layers:
            raise UnsupportedModelError(
                f"{topo.size} pipeline stages need at least as many layers; the model has {layers}"
            )
        return
    for name in ("num_attention_heads", "num_key_value_heads"):
        heads = config.get(name)
        if isinstance(heads, int) and heads % topo.size:
            raise UnsupportedModelError(
                Worded(
                    f"tensor parallel over {topo.size} ranks needs {name} ({heads}) divisible "
                    f"by {topo.size}: run fewer ranks or ",
                    Setting("split", "split by"),
                    " pipeline",
                )
            )


def shard(loaded: LoadedModel, topo: Topology) -> LoadedModel:
    """`loaded` (loaded lazily) cut down to this rank's shard, its weights read, under a
    model key that names the shard."""
    group = _group()
    model: Any = loaded.model
    if topo.split == "tensor":
        model.shard(group)
    else:
        model.model.pipeline(group)
    mx.eval(model.parameters())
    sync("loading the model")
    return replace(loaded, key=f"{loaded.key}-{topo.tag}", shard=topo.tag)


class Ranks:
    """An engine's link to the other ranks (see the module's doc).

    Once a collective has failed, the group is broken for good (MLX's ring backend then
    leaves later collectives waiting forever): every later one raises at once.
    """

    def __init__(self, topo: Topology) -> None:
        self.topology = topo
        self._closed = False  # this rank's part is over: another rank's end is expected
        self._lost: RankError | None = None
        self.stepping = False
        """Inside an engine call every rank makes (`step`): only there may a rank wait for
        the others (a front end's own lookups, e.g. chat's "kept" note, are its rank's)."""

    @property
    def leader(self) -> bool:
        return self.topology.leader

    def lost(self, exc: Exception) -> RankError:
        """The run cannot go on (`exc` broke it, or left the ranks out of step): no
        collective is tried again. Returns the error to raise."""
        if self._lost is None:
            self._lost = (
                exc
                if isinstance(exc, RankError)
                else RankError(f"rank {self.topology.rank}: {exc}")
            )
        return self._lost

    def _sum(self, values: np.ndarray, what: str) -> np.ndarray:
        if self._lost is not None:
            raise self._lost
        try:
            return _all_sum(values, what)
        except RankError as exc:
            raise self.lost(exc) from exc.__cause__

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """An engine call every rank makes (`engine._told`)."""
        self.stepping = True
        try:
            yield
        finally:
            self.stepping = False

    def tell(self, engine: Engine, op: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Rank 0: the others are to make engine call `op(*args, **kwargs)` now (with the
        engine's own settings as they are at this call)."""
        args = tuple(_portable(a) for a in args)
        kwargs = {k: _portable(v) for k, v in kwargs.items()}
        self._send((op, args, kwargs, _settings(engine)))

    def _send(self, obj: Any) -> None:
        """Rank 0's Python object to every rank, through `all_sum` (the others add zeros)."""
        data = np.frombuffer(pickle.dumps(obj), np.uint8)
        self._sum(np.array([data.size], np.int64), "telling the others")
        self._sum(data, "telling the others")

    def _recv(self) -> Any:
        size = int(self._sum(np.zeros(1, np.int64), "waiting for rank 0")[0])
        data = self._sum(np.zeros(size, np.uint8), "waiting for rank 0")
        return pickle.loads(data.tobytes())

    def token(self, token: mx.array) -> mx.array:
        """Rank 0's sampled token, on every rank (`decode.Share`): the others' own picks
        count for nothing, but the sum waits for them, so the ranks stay in step. (Its
        failure surfaces where the token is read: the engine calls `lost`.)"""
        token = token.astype(mx.uint32)  # as `fail` sends it
        return mx.distributed.all_sum(token if self.leader else token * 0, stream=mx.cpu)

    def fail(self) -> None:
        """Rank 0's pick failed: the others' token reads `decode.FAILED`."""
        self._sum(np.array([FAILED], np.uint32), "failing a request")

    def from_leader(self, values: np.ndarray, what: str) -> np.ndarray:
        """Rank 0's `values` on every rank (the others' own, of the same shape, count for
        nothing)."""
        return self._sum(values if self.leader else np.zeros_like(values), what)

    def agree(self, values: tuple[int, ...], what: str) -> tuple[int, ...] | None:
        """Rank 0's `values`, if every rank has the same; else None on every rank."""
        mine = np.asarray(values, np.int64)
        lead = self.from_leader(mine, what)
        differ = self._sum(np.array([int(not np.array_equal(mine, lead))], np.int64), what)
        return None if differ[0] else tuple(int(v) for v in lead)

    def close(self) -> None:
        """Rank 0: the others stop following (their command ends). Idempotent; a rank
        already gone is no error here (its loss was reported where it was seen)."""
        if self.leader and not self._closed:
            self._closed = True
            with contextlib.suppress(RankError):
                self._send(None)

    def commands(
        self,
    ) -> Iterator[tuple[str, tuple[Any, ...], dict[str, Any], dict[str, Any]]]:
        """The others: rank 0's engine calls, until it closes."""
        while (msg := self._recv()) is not None:
            yield msg
        self._closed = True

    def watch(self, on_lost: Callable[[str | None], None]) -> None:
        """Call `on_lost` (on a thread of its own) when another rank's process ends before
        the run does: the caller ends this process then, since this rank may be waiting in
        a collective that never completes (MLX's ring backend fails only the first one
        after a peer is gone). It gets the one line to report, or None when this rank
        already raised the loss as a `RankError` (`lost`), which its caller reports.

        The ranks hold plain TCP connections for this, rank 0 to each other rank: a closed
        one is an ended process. Only for a run whose launcher names rank 0's address
        (`mlx.launch`: ring and JACCL).
        """
        host = _leader_host()
        if host is None:
            return
        try:
            if self.leader:
                with _listen(host) as server:
                    port = np.array([server.getsockname()[1]], np.int64)
                    self.from_leader(port, "joining the run")
                    server.settimeout(_CONNECT_S)
                    for _ in range(self.topology.size - 1):
                        conn, _ = server.accept()
                        rank = int.from_bytes(conn.recv(4), "big")
                        self._watch(conn, f"rank {rank} stopped", on_lost)
            else:
                port = self.from_leader(np.zeros(1, np.int64), "joining the run")
                conn = socket.create_connection((host, int(port[0])), timeout=_CONNECT_S)
                conn.sendall(self.topology.rank.to_bytes(4, "big"))
                self._watch(conn, "rank 0 stopped", on_lost)
        except OSError as exc:  # a rank that never connects, an address not reachable
            raise self.lost(RankError(f"cannot watch the other ranks: {exc}")) from exc

    def _watch(self, conn: socket.socket, said: str, on_lost: Callable[[str | None], None]) -> None:
        def wait() -> None:
            conn.settimeout(None)
            with contextlib.suppress(OSError):
                while conn.recv(1):
                    pass
            if self._closed:
                return
            time.sleep(_GRACE_S)  # a loss this rank saw itself: its caller may be reporting it
            on_lost(None if self._lost else f"{said}: the distributed run cannot go on")

        threading.Thread(target=wait, name="mlxcache-rank-watch", daemon=True).start()


_CONNECT_S = 60.0  # every rank joins within this after rank 0 (they load the model first)
_GRACE_S = 3.0


def _listen(host: str) -> socket.socket:
    """A listening socket on rank 0's address as the others know it (else on every
    address: a name the launcher resolves elsewhere)."""
    try:
        return socket.create_server((host, 0))
    except OSError:
        return socket.create_server(("", 0))


def _leader_host() -> str | None:
    """Rank 0's address as `mlx.launch` tells it: JACCL's coordinator, or the first entry
    of the ring backend's hostfile (a JSON list, one list of "ip:port" per rank); None
    for another launcher."""
    coordinator = os.environ.get("MLX_JACCL_COORDINATOR")
    if coordinator:
        return coordinator.rsplit(":", 1)[0]
    try:
        with open(os.environ["MLX_HOSTFILE"], encoding="utf-8") as f:
            first = json.load(f)[0]
        return str(first[0]).rsplit(":", 1)[0]
    except (KeyError, OSError, ValueError, IndexError, TypeError):
        return None


_SETTINGS = ("decode_matches_prefill", "batch_decode")


def _settings(engine: Engine) -> dict[str, Any]:
    """The engine settings a caller may change after it was opened (`batch_anyway`)."""
    return {name: getattr(engine, name) for name in _SETTINGS}


def _portable(arg: Any) -> Any:
    """A request as the other ranks need it: their picks count for nothing (`Ranks.token`),
    so neither its logits processors (a grammar matcher cannot be pickled) nor log-probs.
    But a decode with processors picks each token after the forward that follows it, and
    one without, before: the others get a processor that changes nothing, so that they
    make their collectives in rank 0's order."""
    from mlxcache.engine import Request

    if isinstance(arg, Request):
        procs: list[LogitsProcessor] = [unchanged] if arg.processors else []
        return replace(arg, processors=procs, logprobs=None, tokens=np.asarray(arg.tokens))
    return arg


def unchanged(tokens: mx.array, logits: mx.array) -> mx.array:
    """A logits processor that keeps the logits (see `_portable`)."""
    return logits


def follow(engine: Engine) -> None:
    """Ranks other than 0: make rank 0's engine calls until it closes.

    Raises:
        RankError: rank 0 stopped without closing (the connection was lost).
    """
    ranks = engine.ranks
    if not isinstance(ranks, Ranks) or ranks.leader:
        raise ValueError("follow() is for the ranks other than 0")
    for op, args, kwargs, settings in ranks.commands():
        for name, value in settings.items():
            setattr(engine, name, value)
        # A call refused on rank 0 (a prompt too long for the context) is refused here
        # alike, before any forward: rank 0's caller reports it; the run goes on.
        call = replay(engine, op)  # outside the suppress: an unknown call is a RankError
        with contextlib.suppress(MlxcacheError):
            call(*args, **kwargs)
        engine.release_memory()


def lead(ranks: Ranks) -> None:
    """Rank 0: close the run when this process exits, however the command ended."""
    atexit.register(ranks.close)


class AgreedCache:
    """A prompt cache whose lookups agree across ranks (rank 0 decides): a lookup that
    finds another length on some rank resumes nothing on every rank, never a partial
    resume. Everything else is the rank's own cache."""

    def __init__(self, inner: PrefixCache, ranks: Ranks, model: Any) -> None:
        self.inner = inner
        self._ranks = ranks
        self._model = model
        self.block_size = inner.block_size
        self.trimmable = inner.trimmable

    def restore(
        self,
        tokens: np.ndarray,
        count: bool = True,
        decode_matches_prefill: bool = False,
        whole: bool = False,
    ) -> Lease:
        lease = self.inner.restore(tokens, count, decode_matches_prefill, whole)
        mine = (lease.length, lease.logits is not None)
        if self._ranks.agree(mine, "looking up the prompt") is not None:
            return lease
        lease.release()
        return Lease(lease.keeper, new_layers(self._model), 0)  # kept by the rank's own

    def cached_length(
        self, tokens: np.ndarray, whole: bool = False, decode_matches_prefill: bool = False
    ) -> int:
        mine = self.inner.cached_length(tokens, whole, decode_matches_prefill)
        if not self._ranks.stepping:  # a front end asking rank 0's cache
            return mine
        agreed = self._ranks.agree((mine,), "looking up the prompt")
        return 0 if agreed is None else agreed[0]

    def report(self) -> dict[str, Any]:
        return self.inner.report() | {"topology": self._ranks.topology.tag}

    def held(self) -> int:
        return self.inner.held()

    def shed(self, n_bytes: int) -> int:
        return self.inner.shed(n_bytes)
