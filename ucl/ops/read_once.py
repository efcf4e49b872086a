"""Read once, broadcast: a ``load_rank(read_once=True)`` under ``torch.distributed`` where the
processes holding identical copies of a target dataset (data-parallel replicas of weights, norms
replicated over tp, a tied embedding on the first and the last stage) share the reading of it out
among themselves and send each other what they read, over a gloo group. Storage reads of the job
drop from one copy per replica to one copy in all.

Which ranks hold identical bytes is derived from the target layout (the ShardMap's boxes), never by
comparing data: two datasets with the same key, shape, dtype and the same boxes of the same tensors
at the same places (padding and flat-buffer gaps included) are byte-identical by construction."""
from __future__ import annotations

import json
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import numpy as np
import xxhash

from ..dtypes import itemsize
from ..errors import StoreError, UclError, code_agrees
from ..layout.bind import Model
from ..layout.lower import lower
from ..layout.mesh import Mesh
from ..store.like import CheckpointLike
from .dist import allgather_json, gloo_group, initialized_dist

READ_ONCE_TIMEOUT_S = 300.0  # how long the group made by load_rank waits for a process that stopped answering


@dataclass(frozen=True)
class ReplicaSet:
    """Ranks that hold one dataset with identical bytes; ``reader`` reads it, the others receive it.
    ``tag`` (its index among the job's shared datasets) tells its messages apart."""

    key: str
    nbytes: int
    ranks: tuple[int, ...]
    reader: int
    tag: int


@dataclass(frozen=True)
class Share:
    """One rank's part of a read-once load: the datasets it reads from storage (its own unreplicated
    ones and the replicated ones it was given), those it sends on and those it receives."""

    reads: frozenset[str]
    sends: tuple[ReplicaSet, ...]
    receives: tuple[ReplicaSet, ...]


@dataclass(frozen=True)
class Replicas:
    """Every replicated dataset of a model on a mesh, who reads each, and the per-rank index."""

    sets: tuple[ReplicaSet, ...]
    by_rank: dict  # rank -> indices into ``sets``


def replica_sets(model: Model, mesh: Mesh) -> Replicas:
    """The replica sets of ``model`` on ``mesh`` and their readers (pure; cached on the model).
    Readers are chosen greedily, largest datasets first, each by the member with the fewest bytes
    to read so far (its unreplicated datasets included), so each process reads about 1/DP."""
    cache = model.derived.of(_ReplicaCache).by_mesh
    if mesh in cache:
        return cache[mesh]
    sm = lower(model, mesh)
    parts: dict[tuple, list] = {}  # (key, coordinates) -> what fills that dataset, in layout order
    for tid, holdings in enumerate(sm.holdings):
        for h in holdings:
            pieces = tuple(tuple(d.sig for d in p) for p in h.pieces)
            parts.setdefault((h.slot.key, _coords(h.fixed)), []).append((tid, h.slot.base, h.slot.shape, pieces))
    for f in sm.flat_fills:
        parts.setdefault((f.slot.key, _coords(f.fixed)), []).append((-1, f.start, f.length))
    found: dict[tuple, tuple[str, int, list[int]]] = {}  # content signature -> (key, bytes, ranks)
    for d in sm.datasets:
        sig = (d.key, tuple(d.shape), d.dtype, tuple(parts.get((d.key, _coords(d.fixed)), ())))
        entry = found.setdefault(sig, (d.key, int(np.prod(d.shape, dtype=object)) * itemsize(d.dtype), []))
        entry[2].extend(int(r) for r in sm.ranks(d.fixed))
    load = np.zeros(max(mesh.size, 1), dtype=np.float64)
    shared = []
    for key, nbytes, ranks in found.values():
        if len(ranks) == 1:
            load[ranks[0]] += nbytes
        else:
            shared.append((key, nbytes, tuple(sorted(ranks))))
    sets, by_rank = [], {}
    for key, nbytes, ranks in sorted(shared, key=lambda s: (-s[1], s[0], s[2])):
        reader = min(ranks, key=lambda r: (load[r], r))
        load[reader] += nbytes
        for r in ranks:
            by_rank.setdefault(r, []).append(len(sets))
        sets.append(ReplicaSet(key, nbytes, ranks, reader, len(sets)))
    replicas = cache[mesh] = Replicas(tuple(sets), by_rank)
    return replicas


@dataclass(frozen=True, eq=False)
class _ReplicaCache:
    """:func:`replica_sets` of one model, by mesh."""

    by_mesh: dict[Mesh, Replicas] = field(default_factory=dict)


def share_of(model: Model, mesh: Mesh, rank: int, keys) -> Share:
    """Rank ``rank``'s share of a read-once load of its datasets ``keys``."""
    replicas = replica_sets(model, mesh)
    mine = [replicas.sets[i] for i in replicas.by_rank.get(rank, ())]
    receives = tuple(s for s in mine if s.reader != rank)
    taken = {s.key for s in receives}
    return Share(frozenset(k for k in keys if k not in taken), tuple(s for s in mine if s.reader == rank), receives)


def _coords(fixed: Mapping[str, int]) -> tuple:
    return tuple(sorted(fixed.items()))


def identity(ckpt: CheckpointLike, target: Model, mesh: Mesh) -> str:
    """A digest of what a process loads (checkpoint, target model, mesh): all must agree."""
    m = ckpt.manifest
    return xxhash.xxh3_64_hexdigest(json.dumps(
        [str(mesh), target.spec.text, target.fingerprint(), m.created, m.mesh, m.files, m.spec, m.dims],
        sort_keys=True, default=str).encode())


class Link:
    """The gloo group of a read-once load and each mesh rank's place in it."""

    def __init__(self, group: Any, owned: bool):
        self.group, self.owned = group, owned
        self.peers: dict[int, int] = {}  # mesh rank -> global rank

    def check_size(self, mesh: Mesh) -> None:
        """One process per mesh rank (UCL422): a mesh of another size than the group is refused."""
        size = initialized_dist().get_world_size(self.group)
        if size != mesh.size:
            raise StoreError(f"load_rank(read_once=True) on {mesh} ({mesh.size} ranks) needs one process per mesh "
                             f"rank, but the job has {size} processes", code="UCL422")

    def settle(self, rank: int, ident: str | None, error: BaseException | None) -> None:
        """Before any byte is read: every process's mesh rank, identity and error, exchanged. When any
        process failed to prepare, every one raises (see :meth:`_raise_if_failed`); then the
        processes must load the same checkpoint, model and mesh, with each mesh rank once."""
        every = self._gather({"rank": int(rank) if isinstance(rank, (int, np.integer)) else -1, "id": ident}, error)
        ranks = [g["rank"] for g in every]
        if sorted(ranks) != list(range(len(every))):
            dup = sorted({r for r in ranks if ranks.count(r) > 1})
            raise StoreError(f"load_rank(read_once=True): the processes ask for mesh ranks {sorted(ranks)[:16]}; each "
                             f"rank of the mesh must be loaded by exactly one process (repeated: {dup[:8]})",
                             code="UCL425")
        if len({g["id"] for g in every}) != 1:
            odd = [i for i, g in enumerate(every) if g["id"] != every[0]["id"]]
            raise StoreError(f"load_rank(read_once=True): processes {odd[:8]} load another checkpoint, model or mesh "
                             "than process 0; every process must pass the same path, mesh and model", code="UCL425")
        dist = initialized_dist()
        self.peers = {g["rank"]: dist.get_global_rank(self.group, i) for i, g in enumerate(every)}

    def transfer(self, share: Share, targets: Mapping[str, np.ndarray], read: Callable[[str], None]) -> tuple[int, int]:
        """Read this process's share and swap replicas: every receive is posted first, each dataset
        this process reads for others is sent as soon as it is read (the sends overlap the next
        reads), then its own datasets are read. A failed read stops the reading, not the sending
        (the others must not wait for bytes that never come); after all transfers every process
        learns of it and raises. Returns (bytes sent, bytes received)."""
        dist = initialized_dist()
        works, sent, received, error = [], 0, 0, None

        def attempt(key: str) -> None:
            nonlocal error
            if error is None:
                try:
                    read(key)
                except Exception as e:  # reported to every process after the transfers
                    error = e

        try:
            for s in share.receives:
                if s.nbytes:
                    works.append(dist.irecv(_wire(targets[s.key]), src=self.peers[s.reader], group=self.group,
                                            tag=s.tag))
                    received += s.nbytes
            for s in share.sends:
                attempt(s.key)
                for r in s.ranks:
                    if r != s.reader and s.nbytes:
                        works.append(dist.isend(_wire(targets[s.key]), dst=self.peers[r], group=self.group, tag=s.tag))
                        sent += s.nbytes
            sending = {s.key for s in share.sends}
            for key in targets:
                if key in share.reads and key not in sending:
                    attempt(key)
            for w in works:
                w.wait()
        except RuntimeError as e:
            self.drop()
            raise StoreError(f"load_rank(read_once=True): a process of the job stopped answering while the replicas "
                             f"were sent (killed, or hung past the group's timeout): {e}", code="UCL424") from None
        self._gather({}, error)
        return sent, received

    def _gather(self, mine: dict, error: BaseException | None) -> list[dict]:
        """Every process's ``mine`` and error; raises on every process when one failed: the failing
        one its own error, the others the first failure's code where it is a store error (so a
        checksum mismatch is UCL407 everywhere), UCL425 otherwise."""
        code = getattr(error, "code", None) if isinstance(error, UclError) else None
        mine = dict(mine, code=code, error=None if error is None else str(error) or type(error).__name__)
        try:
            every = allgather_json(mine, group=self.group)
        except RuntimeError as e:
            self.drop()
            raise StoreError(f"load_rank(read_once=True): a process of the job stopped answering (killed, or hung "
                             f"past the group's timeout): {e}", code="UCL424") from None
        if error is not None:
            raise error
        failed = [(i, g) for i, g in enumerate(every) if g["error"] is not None]
        if failed:
            i, g = failed[0]
            code = g["code"] if g["code"] and code_agrees(StoreError, g["code"]) else "UCL425"
            raise StoreError(f"load_rank(read_once=True) failed on process {i}, so on every process (replicas are "
                             f"read by one of them): {g['error']}", code=code)
        return every

    def drop(self) -> None:
        """Forget a group a failure may have left with messages in flight (made afresh next time)."""
        if self.owned and _CACHE and _CACHE[-1]() is self.group:
            _CACHE.clear()


def _wire(arr: np.ndarray):
    """A uint8 tensor sharing ``arr``'s memory (any storage dtype, bf16 bits included)."""
    import torch
    return torch.from_numpy(arr.reshape(-1).view(np.uint8))


# [default group, our gloo group over it], as weak references: made once per initialised world and
# gone with it. A strong reference kept both alive past destroy_process_group() until interpreter
# exit, where tearing down gloo's threads then could abort the process.
_CACHE: list[weakref.ref] = []


def connect(group: Any = None) -> Link:
    """The group a read-once load runs on: ``group`` (a gloo group), or a gloo group over the whole
    world made on first use and kept while the world lives. Raises UCL422 outside torch.distributed
    or for a group of another backend, UCL424 if a process never joins."""
    dist = initialized_dist()
    if dist is None:
        raise StoreError("load_rank(read_once=True) needs an initialised torch.distributed job: every process calls "
                         "it with its own rank (under torchrun: dist.init_process_group() first), or drop "
                         "read_once for a plain load", code="UCL422")
    if group is not None:
        if dist.get_backend(group) != "gloo":
            raise StoreError(f"load_rank(read_once=True) sends host memory: group must be a gloo group, not "
                             f"{dist.get_backend(group)}", code="UCL422")
        return Link(group, owned=False)
    world = dist.group.WORLD
    made = _CACHE[1]() if _CACHE and _CACHE[0]() is world else None
    if made is None:
        try:
            made = gloo_group(READ_ONCE_TIMEOUT_S)  # torch holds it (and the world) until destroy_process_group
        except RuntimeError as e:
            raise StoreError(f"load_rank(read_once=True): a process of the job did not join within "
                             f"{READ_ONCE_TIMEOUT_S:g} s: {e}", code="UCL424") from None
        _CACHE[:] = [weakref.ref(world), weakref.ref(made)]
    return Link(made, owned=True)
