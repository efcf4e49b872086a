"""Running a plan: the one copy loop. Bytes come from a :class:`Source` (in-memory shards here, a
ucl store in ``ucl.store.source``, later foreign formats) and land in target arrays."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Protocol

import numpy as np

from ..dtypes import storage_dtype  # bf16/fp8 as raw bits: the one table of storage types
from ..errors import PlanError
from ..layout.boxes import Slot, box_view, flat_runs
from .ir import Plan


class Source(Protocol):
    """Where a plan's source boxes come from (in-memory shards here, a checkpoint in
    ``ucl.store.source``)."""

    def read(self, rank: int, slot: Slot, start, size) -> np.ndarray:
        """Box ``start:start+size`` of the tensor in ``slot`` on source rank ``rank`` (storage dtype;
        may be a view valid until the next read)."""

    def read_into(self, rank: int, slot: Slot, start, size, out: np.ndarray) -> bool:
        """Read the same box straight into the destination view ``out`` (no bounce buffer) and
        return True; or return False, doing nothing, where it cannot (then ``read`` is used)."""


class MemorySource:
    """Source shards held in memory: ``{rank: {key: array}}`` (storage dtypes)."""

    def __init__(self, shards: Mapping[int, Mapping[str, np.ndarray]]):
        self.shards = shards

    def read(self, rank: int, slot: Slot, start, size) -> np.ndarray:
        try:
            array = self.shards[rank][slot.key]
        except KeyError:
            raise PlanError(f"source rank {rank} has no dataset {slot.key!r}", code="UCL315") from None
        return box_view(array, slot, start, size)

    def read_into(self, rank: int, slot: Slot, start, size, out: np.ndarray) -> bool:
        out[...] = self.read(rank, slot, start, size)
        return True


def rank_rows(plan: Plan, rank: int) -> np.ndarray:
    """Indices of the (expanded) copy rows that fill target rank ``rank``; on a plan of many
    ranks, cut it down first (``plan.for_ranks([rank])``) so only that rank's rows are expanded."""
    return np.flatnonzero(plan.copies["dst_rank"] == rank)


def run_copies(plan: Plan, rows, source: Source, targets: Mapping[str, np.ndarray]) -> int:
    """The one copy loop: copy ``rows`` of the plan from ``source`` into the arrays ``targets``
    (target dataset key -> array; rows whose key is absent are skipped). Returns bytes copied."""
    c = plan.copies
    moved = 0
    done = set()
    for key, mirror in _mirrors(plan, rows, targets).items():
        whole = Slot(mirror.src_key, 0, mirror.shape, mirror.shape)
        zeros = (0,) * len(mirror.shape)
        if source.read_into(mirror.src_rank, whole, zeros, mirror.shape, targets[key]):
            _zero_gaps(targets[key].reshape(-1), mirror.ranges)
            done.update(mirror.rows)
            moved += _volume(c, mirror.rows) * targets[key].itemsize
    rows = [i for i in rows if int(i) not in done] if done else rows
    for i in rows:
        dslot = plan.slots[c["dst_slot"][i]]
        out = targets.get(dslot.key)
        if out is None:
            continue
        dst = box_view(out, dslot, c["dst_start"][i], c["size"][i])
        src = (int(c["src_rank"][i]), plan.slots[c["src_slot"][i]], c["src_start"][i], c["size"][i])
        if not source.read_into(*src, dst):
            dst[...] = source.read(*src)
        moved += dst.nbytes
    return moved


@dataclass(frozen=True)
class Mirror:
    """A target dataset most of whose rows copy boxes from one source dataset of the same shape to
    the very same places (the usual case at the same layout, flat buffers included): one read of
    that dataset does those rows, the elements no row writes are zeroed, the other rows follow."""

    src_rank: int
    src_key: str
    shape: tuple[int, ...]
    rows: tuple[int, ...]  # the rows the whole read does
    ranges: tuple[tuple[int, int], ...]  # flat [start, stop) all the target's rows write, sorted


def _mirrors(plan: Plan, rows, targets: Mapping[str, np.ndarray]) -> dict[str, Mirror]:
    """Targets that one whole read of a same-shaped source dataset fills, at least half of them:
    the rows that copy from that dataset to the very same places. Other rows of the target (a
    replicated tensor the plan reads from another rank) still run after the whole read."""
    c = plan.copies
    by_key: dict[str, list[int]] = {}
    for i in rows:
        key = plan.slots[c["dst_slot"][i]].key
        if key in targets:
            by_key.setdefault(key, []).append(int(i))
    out = {}
    for key, rs in by_key.items():
        same: dict[tuple[int, str], list[int]] = {}  # source dataset -> rows copying to the same places
        for i in rs:
            s, d = plan.slots[c["src_slot"][i]], plan.slots[c["dst_slot"][i]]
            if (s.base, s.shape, s.dataset_shape) == (d.base, d.shape, d.dataset_shape) \
                    and tuple(s.dataset_shape) == tuple(targets[key].shape) \
                    and np.array_equal(c["src_start"][i], c["dst_start"][i]):
                same.setdefault((int(c["src_rank"][i]), s.key), []).append(i)
        if not same:
            continue
        (src_rank, src_key), mine = max(same.items(), key=lambda kv: _volume(c, kv[1]))
        if 2 * _volume(c, mine) < targets[key].size:
            continue
        ranges = []
        for i in rs:  # every row's flat ranges: the elements no row writes are zeroed after the read
            for start, count, stride, block in flat_runs(plan.slots[c["dst_slot"][i]], c["dst_start"][i], c["size"][i]):
                ranges += [(start + k * stride, start + k * stride + block) for k in range(count)]
        out[key] = Mirror(src_rank, src_key, tuple(targets[key].shape), tuple(mine), tuple(sorted(ranges)))
    return out


def _volume(c, rows) -> int:
    return sum(int(np.prod(c["size"][i], dtype=object)) for i in rows)


def _zero_gaps(flat: np.ndarray, ranges) -> None:
    """Zero the elements of ``flat`` outside the sorted ``ranges``."""
    pos = 0
    for a, b in ranges:
        if a > pos:
            flat[pos:a] = 0
        pos = max(pos, b)
    if pos < flat.size:
        flat[pos:] = 0


def covered_elements(plan: Plan, rows) -> dict[str, int]:
    """Target dataset key -> how many of its elements ``rows`` write (a dataset written whole needs
    no zero-fill first; padding and flat-buffer gaps are what rows leave out)."""
    c = plan.copies
    rows = np.asarray(rows, dtype=np.int64)
    out: dict[str, int] = {}
    if not len(rows):
        return out
    keys = np.array([s.key for s in plan.slots], dtype=object)[c["dst_slot"][rows]]
    sizes = np.prod(c["size"][rows].astype(object), axis=1)  # Python ints: no int64 wrap
    for key, n in zip(keys, sizes):
        out[key] = out.get(key, 0) + int(n)
    return out


def rank_datasets(plan: Plan, rank: int) -> list[dict]:
    """The target datasets rank ``rank`` holds: ``{key, shape, dtype}`` each."""
    sel = np.isin(plan.stored_datasets["dst_set"], plan.rank_sets.containing(rank))
    return [plan.datasets[d] for d in plan.stored_datasets["dataset"][sel]]


def allocate(plan: Plan, ranks=None) -> dict[int, dict[str, np.ndarray]]:
    """Zeroed target datasets, per target rank (all ranks, or just ``ranks``). Fills (padding) are
    zeros, so a zeroed target needs only the copies."""
    out: dict[int, dict[str, np.ndarray]] = {}
    if ranks is not None:
        plan = plan.for_ranks(ranks)
    for r, d in zip(plan.dataset_ranks["rank"], plan.dataset_ranks["dataset"]):
        ds = plan.datasets[d]
        out.setdefault(int(r), {})[ds["key"]] = np.zeros(ds["shape"], dtype=storage_dtype(ds["dtype"]))
    return out


def execute_memory(plan: Plan, src: Mapping[int, Mapping[str, np.ndarray]], ranks=None) -> dict[int, dict[str, np.ndarray]]:
    """Run ``plan`` on in-memory source shards; returns the target shards (optionally only ``ranks``)."""
    if ranks is not None:
        plan = plan.for_ranks(ranks)  # expand only the rows of these ranks
    _check_sources(plan, src)
    dst = allocate(plan)
    source = MemorySource(src)
    order = np.argsort(plan.copies["dst_rank"], kind="stable")  # rows grouped by target rank, in plan order
    by_rank = plan.copies["dst_rank"][order]
    for r, targets in dst.items():
        lo, hi = np.searchsorted(by_rank, [r, r + 1])
        run_copies(plan, order[lo:hi], source, targets)
    return dst


def _check_sources(plan: Plan, src: Mapping[int, Mapping[str, np.ndarray]]) -> None:
    """UCL315 before anything is copied when a source array the plan reads is not the dataset it
    expects (shape, storage dtype): a larger array would be read in part and a float64 one cast down."""
    c = plan.copies
    if not len(c["src_rank"]):
        return
    pairs = np.unique(np.stack([c["src_rank"], c["src_slot"], c["tensor"]], axis=1), axis=0)
    problems = []
    for rank, slot_id, tensor in pairs.tolist():
        slot = plan.slots[slot_id]
        array = src.get(rank, {}).get(slot.key)
        if array is None:
            problems.append(f"source rank {rank} has no dataset {slot.key!r}")
            continue
        want = storage_dtype(plan.tensors[tensor]["dtype"])
        shape = tuple(getattr(array, "shape", ()))
        if shape != tuple(slot.dataset_shape) or getattr(array, "dtype", None) != want:
            problems.append(f"source rank {rank} {slot.key!r} is {getattr(array, 'dtype', type(array).__name__)} "
                            f"{list(shape)}; the plan reads it as {want} {list(slot.dataset_shape)}")
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise PlanError("the source shards do not fit the plan: " + "; ".join(dict.fromkeys(problems[:5])) + more,
                        code="UCL315")
