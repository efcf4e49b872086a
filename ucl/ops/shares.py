"""How a reshard shares its target out among worker processes: target datasets with the same
contents on several ranks (replicas) grouped to be built once (``replica_groups``), target files
large enough to be filled by several workers at once (``split_files``), and each file or dataset
given to one worker (``assign``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator, Sequence

import numpy as np

from ..dtypes import storage_dtype
from ..plan.ir import Plan

if TYPE_CHECKING:
    from ..layout.bind import Model


@dataclass(frozen=True)
class ReplicaGroup:
    """A target dataset with identical contents on ``ranks`` (replicas): built once, written to each."""

    key: str
    shape: tuple[int, ...]
    dtype: str
    ranks: tuple[int, ...]
    rows: np.ndarray  # copy rows that fill it (those of its first rank)
    tiles: bool = True  # tile digests: not where no layout reads it by columns (replica_groups)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * storage_dtype(self.dtype).itemsize


@dataclass(frozen=True)
class GroupTask:
    group: int  # index into the job's groups
    ranks: tuple[int, ...]  # the replicas this worker writes


@dataclass(frozen=True)
class WorkerTask:
    groups: tuple[GroupTask, ...]
    files: tuple[int, ...]  # target ranks whose files this worker creates (and finishes)


def replica_groups(plan: Plan, model: Model | None = None) -> list[ReplicaGroup]:
    """Target datasets with identical contents on several ranks (replicas) become one group.
    ``model``: the plan's; a dataset of one tensor no layout of it reads by columns then gets no
    tile digests (``Tensor.cuts_last_dim``: a hash pass and a copy to tile order saved per byte)."""
    c = plan.copies
    slot_keys = np.array([s.key for s in plan.slots], dtype=object)
    row_keys = slot_keys[c["dst_slot"]] if len(c["dst_slot"]) else np.zeros(0, dtype=object)
    rows_by = {}
    order = np.argsort(c["dst_rank"], kind="stable")
    bounds = np.searchsorted(c["dst_rank"][order], np.arange(plan.dst_mesh.size + 1))
    for r in range(plan.dst_mesh.size):
        rows = order[bounds[r]:bounds[r + 1]]
        for key in sorted(set(row_keys[rows].tolist())):  # (np.unique of objects imports numpy.ma: 7 ms)
            rows_by[(r, key)] = rows[row_keys[rows] == key]
    found: dict[tuple, tuple] = {}  # content signature -> (dataset, ranks, rows)
    stores = plan.first_holders  # a dataset several ranks hold is written to the first of them only
    for r, d in zip(stores["rank"], stores["dataset"]):
        ds = plan.datasets[d]
        rows = rows_by.get((int(r), ds["key"]), np.zeros(0, dtype=np.int64))
        sig_cols = np.stack([c[k][rows] for k in ("tensor", "src_rank", "src_slot", "dst_slot")], axis=1)
        sig = (ds["key"], ds["shape"], ds["dtype"], sig_cols.tobytes(), c["src_start"][rows].tobytes(),
               c["dst_start"][rows].tobytes(), c["size"][rows].tobytes())
        if sig in found:
            found[sig][1].append(int(r))
        else:
            found[sig] = (ds, [int(r)], rows)
    def tiles(rows: np.ndarray) -> bool:
        ids = set(c["tensor"][rows].tolist())
        if model is None or len(ids) != 1:
            return True
        t = plan.tensors[ids.pop()]
        try:
            return model.tensor(f"{t['kind']}/{t['name']}").cuts_last_dim
        except KeyError:  # (not one of the model's tensors: the writer's rule, as ever)
            return True

    return [ReplicaGroup(ds["key"], tuple(ds["shape"]), ds["dtype"], tuple(ranks), rows, tiles(rows))
            for ds, ranks, rows in found.values()]


def split_files(groups: Sequence[ReplicaGroup], workers: int) -> frozenset[int]:
    """Target rank files larger than one worker's fair share of the bytes: with ``workers`` > 1 they
    are laid out first and filled by several workers at once (a universal target is one file)."""
    if workers < 2:
        return frozenset()
    size: dict[int, int] = {}
    for g in groups:
        for r in g.ranks:
            size[r] = size.get(r, 0) + g.nbytes
    total = sum(size.values())
    return frozenset(r for r, n in size.items() if n * workers > total and n >= SPLIT_MIN_BYTES)


SPLIT_MIN_BYTES = 64 << 20  # smaller files are not worth laying out first for several writers


def datasets_on(groups: Sequence[ReplicaGroup], rank: int) -> dict[str, tuple[tuple[int, ...], str]]:
    """The datasets ``groups`` put in target rank ``rank``'s file: key -> (shape, dtype)."""
    return {g.key: (g.shape, g.dtype) for g in groups if rank in g.ranks}


def assign(groups: list[ReplicaGroup], plan: Plan, workers: int, files: Sequence[int] | None = None,
           shared: frozenset[int] = frozenset()) -> list[WorkerTask]:
    """Give each target rank file to one worker, and each dataset of the ``shared`` files (laid out
    beforehand, ``split_files``) to one worker: all of them largest first (a file's load is all its
    bytes) to the least loaded worker (LPT: within 4/3 of the best), or to a worker already writing a
    replica of the same data while that stays within 1.1x the fair share, so its source bytes are
    read once. ``files`` are the target ranks to share out (default: all; ``groups`` then name no others)."""
    load = [0] * workers
    total = sum(g.nbytes * len(g.ranks) for g in groups) or 1
    fair = 1.1 * total / workers
    least = lambda: min(range(workers), key=load.__getitem__)  # noqa: E731
    size: dict[int, int] = {}  # whole file -> its bytes
    groups_of: dict[int, list[int]] = {}  # whole file -> the groups it holds
    for gi, g in enumerate(groups):
        for r in g.ranks:
            if r not in shared:
                size[r] = size.get(r, 0) + g.nbytes
                groups_of.setdefault(r, []).append(gi)
    owner: dict[int, int] = {}  # whole file -> its worker
    piece: dict[tuple[int, int], int] = {}  # (group, shared file) -> the worker writing that dataset

    def near(gis: list[int]) -> Iterator[int]:
        """Workers already writing a replica of these groups (they read the same source bytes), lazily:
        the first that has room is taken, and a file may hold hundreds of groups."""
        return (w for gi in gis for x in groups[gi].ranks
                for w in [piece.get((gi, x)) if x in shared else owner.get(x)] if w is not None)
    # whole files and the datasets of shared files together, largest first (LPT)
    items = [(size[r], r, -1) for r in size] + [(g.nbytes, r, gi) for gi, g in enumerate(groups)
                                                for r in g.ranks if r in shared]
    for nbytes, r, gi in sorted(items, key=lambda it: (-it[0], it[2] >= 0, it[1], it[2])):
        w = next((x for x in near(groups_of[r] if gi < 0 else [gi]) if load[x] + nbytes <= fair), None)
        w = least() if w is None else w
        if gi < 0:
            owner[r] = w
        else:
            piece[gi, r] = w
        load[w] += nbytes
    for r in range(plan.dst_mesh.size) if files is None else files:
        if int(r) not in shared:
            owner.setdefault(int(r), least())
    tasks = []
    for w in range(workers):
        mine = [GroupTask(gi, tuple(r for r in g.ranks if (piece[gi, r] if r in shared else owner[r]) == w))
                for gi, g in enumerate(groups)]
        tasks.append(WorkerTask(tuple(t for t in mine if t.ranks), tuple(r for r in sorted(owner) if owner[r] == w)))
    return tasks
