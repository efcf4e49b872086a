"""Rank sets: the target ranks a compact plan row is for (docs/ir.md, plan version 2).

Replicas of a target dataset receive the very same rows; a compact plan stores such rows once,
with the id of the set of target ranks that receive them. Sets are a CSR table: set ``i`` is
``ranks[offsets[i]:offsets[i + 1]]``, ascending and without repeats.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

I64 = np.int64


def sorted_distinct(ranks) -> np.ndarray:
    """``ranks`` ascending without repeats: ``np.unique`` without its first call's import of
    ``numpy.ma`` (10 ms, a tenth of planning one rank's load)."""
    a = np.sort(np.asarray(ranks, dtype=I64).ravel())
    return a[np.concatenate([[True], a[1:] != a[:-1]])] if len(a) else a


@dataclass(frozen=True, eq=False)
class RankSets:
    offsets: np.ndarray  # (sets + 1,), offsets[0] == 0, non-decreasing
    ranks: np.ndarray  # (offsets[-1],) the members of every set, set after set
    _inverse: dict = field(default_factory=dict, repr=False, compare=False)  # lazily built indexes

    @classmethod
    def of(cls, sets: list[np.ndarray]) -> "RankSets":
        sizes = np.array([len(s) for s in sets], dtype=I64)
        offsets = np.concatenate([np.zeros(1, dtype=I64), np.cumsum(sizes, dtype=I64)])
        ranks = np.concatenate(sets).astype(I64, copy=False) if sets else np.zeros(0, dtype=I64)
        return cls(offsets, ranks)

    @classmethod
    def singletons(cls, ranks: np.ndarray) -> "RankSets":
        ranks = np.asarray(ranks, dtype=I64)
        return cls(np.arange(len(ranks) + 1, dtype=I64), ranks.copy())

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def sizes(self) -> np.ndarray:
        return np.diff(self.offsets)

    def members(self, i: int) -> np.ndarray:
        return self.ranks[self.offsets[i]:self.offsets[i + 1]]

    @property
    def owner(self) -> np.ndarray:
        """The set each entry of ``ranks`` belongs to."""
        if "owner" not in self._inverse:
            self._inverse["owner"] = np.repeat(np.arange(len(self), dtype=I64), self.sizes)
        return self._inverse["owner"]

    def containing(self, rank: int) -> np.ndarray:
        """Ids of the sets that hold ``rank``, ascending: O(log n + answer) after a one-time sort."""
        if "by_rank" not in self._inverse:
            order = np.argsort(self.ranks, kind="stable")
            self._inverse["by_rank"] = (self.ranks[order], self.owner[order])
        sorted_ranks, owners = self._inverse["by_rank"]
        lo, hi = np.searchsorted(sorted_ranks, [rank, rank + 1])
        return owners[lo:hi]

    def restrict(self, ranks) -> tuple["RankSets", np.ndarray]:
        """These sets cut down to ``ranks``: (new sets, new id of each old set, -1 where it is empty)."""
        keep = np.isin(self.ranks, np.asarray(list(ranks), dtype=I64))
        sizes = np.bincount(self.owner[keep], minlength=len(self)).astype(I64)
        new_id = np.where(sizes > 0, np.cumsum(sizes > 0) - 1, -1).astype(I64)
        kept = sizes[sizes > 0]
        offsets = np.concatenate([np.zeros(1, dtype=I64), np.cumsum(kept, dtype=I64)])
        return RankSets(offsets, self.ranks[keep]), new_id

    def validate(self, n_ranks: int) -> None:
        """Raises ValueError unless the table is well formed for a mesh of ``n_ranks`` ranks."""
        o, r = self.offsets, self.ranks
        if o.ndim != 1 or r.ndim != 1 or not len(o) or o[0] != 0 or o[-1] != len(r) or np.any(np.diff(o) < 0):
            raise ValueError("rank_sets offsets must start at 0, never decrease and end at the number of ranks")
        if len(r) and (r.min() < 0 or r.max() >= n_ranks):
            raise ValueError(f"a rank set names a rank outside 0..{n_ranks - 1}")
        inner = np.diff(r) > 0
        boundary = np.zeros(len(r), dtype=bool)
        boundary[o[1:-1][o[1:-1] < len(r)]] = True
        if len(r) > 1 and not np.all(inner | boundary[1:]):
            raise ValueError("each rank set must list its ranks ascending, without repeats")

    def expand(self, set_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For rows with these set ids: (row index repeated once per member, the member ranks)."""
        sizes = self.sizes[set_ids]
        row = np.repeat(np.arange(len(set_ids), dtype=I64), sizes)
        total = int(sizes.sum())
        if not total:
            return row, np.zeros(0, dtype=I64)
        # position of each output within its set: a running index reset at each row's first member
        first = np.cumsum(sizes) - sizes
        within = np.arange(total, dtype=I64) - np.repeat(first, sizes)
        return row, self.ranks[np.repeat(self.offsets[set_ids], sizes) + within]


class RankSetBuilder:
    """Rank sets numbered in order of first use, each distinct set once. One-rank sets (a ZeRO
    partition's: 131,072 of them on a 131,072-rank mesh) are kept in an array, by rank, and can be
    added many at a time (:meth:`singles`)."""

    def __init__(self, n_ranks: int):
        self.n_ranks = max(n_ranks, 1)
        # rank -> id of its one-rank set: a dict until :meth:`singles` needs the array (a plan for one
        # rank of a 131,072-rank mesh would fault in 1 MiB for a few entries)
        self.single: np.ndarray | None = None
        self.single_of: dict[int, int] = {}
        self.by_bytes: dict[bytes, int] = {}  # a set of several ranks -> its id
        self.chunks: list[np.ndarray] = []  # the sets' ranks, in order, set after set
        self.sizes: list[np.ndarray] = []  # the sets' sizes, chunk after chunk
        self.count = 0
        self.pending: list[int] = []  # one-rank sets added by :meth:`one`, not yet in ``chunks``

    def one(self, rank: int) -> int:
        """The id of the set of ``rank`` alone (:meth:`singles` of one rank, without numpy calls)."""
        i = self.single_of.get(rank, -1) if self.single is None else int(self.single[rank])
        if i < 0:
            i = self.count
            if self.single is None:
                self.single_of[rank] = i
            else:
                self.single[rank] = i
            self.pending.append(rank)
            self.count += 1
        return i

    def add(self, ranks: np.ndarray) -> int:
        """The id of the set ``ranks`` (ascending, without repeats, not empty)."""
        if len(ranks) == 1:
            return self.one(int(ranks[0]))
        key = ranks.tobytes()
        i = self.by_bytes.get(key)
        if i is None:
            i = self.by_bytes[key] = self.count
            self._append(ranks, np.array([len(ranks)], dtype=I64))
        return i

    def singles(self, ranks: np.ndarray) -> np.ndarray:
        """The ids of the one-rank sets of ``ranks`` (in order; repeats allowed): new ones are
        numbered in order of first appearance."""
        if self.single is None:
            self.single = np.full(self.n_ranks, -1, dtype=I64)
            if self.single_of:
                self.single[list(self.single_of)] = list(self.single_of.values())
        ids = self.single[ranks]
        new = ids < 0
        if new.any():
            fresh = ranks[new]
            _, first = np.unique(fresh, return_index=True)
            fresh = fresh[np.sort(first)]  # each new rank once, in order of first appearance
            self.single[fresh] = self.count + np.arange(len(fresh), dtype=I64)
            self._append(fresh, np.ones(len(fresh), dtype=I64))
            ids = self.single[ranks]
        return ids

    def _flush(self) -> None:
        if self.pending:
            self.chunks.append(np.array(self.pending, dtype=I64))
            self.sizes.append(np.ones(len(self.pending), dtype=I64))
            self.pending = []

    def _append(self, ranks: np.ndarray, sizes: np.ndarray) -> None:
        self._flush()
        self.chunks.append(np.asarray(ranks, dtype=I64))
        self.sizes.append(sizes)
        self.count += len(sizes)

    def build(self) -> RankSets:
        self._flush()
        sizes = np.concatenate(self.sizes) if self.sizes else np.zeros(0, dtype=I64)
        offsets = np.concatenate([np.zeros(1, dtype=I64), np.cumsum(sizes, dtype=I64)])
        ranks = np.concatenate(self.chunks) if self.chunks else np.zeros(0, dtype=I64)
        return RankSets(offsets, ranks)
