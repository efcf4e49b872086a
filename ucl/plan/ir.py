"""The plan: struct-of-arrays tables of box-to-box copies and fills between the datasets of a
source and a target layout (docs/ir.md), its statistics, explanation and JSON form."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import numpy as np

from ..dtypes import itemsize
from ..errors import PlanError, did_you_mean
from ..files import parse_json
from ..layout.algebra import I64
from ..layout.boxes import Slot
from ..layout.mesh import Mesh
from .ranksets import RankSets

PLAN_VERSION = 2
COPY_COLUMNS = ("tensor", "src_rank", "src_slot", "dst_set", "dst_slot")
BOX_COLUMNS = ("src_start", "dst_start", "global_start", "size")
FILL_COLUMNS = ("tensor", "dst_set", "dst_slot")
FILL_BOX_COLUMNS = ("dst_start", "size")
DATASET_COLUMNS = ("dst_set", "dataset")
_I32 = np.iinfo(np.int32)


def int_dtype(lo: int, hi: int) -> np.dtype:
    """int32 if every integer in ``[lo, hi]`` fits in it, else int64."""
    return np.dtype(np.int32) if _I32.min <= lo and hi <= _I32.max else np.dtype(I64)


def column_dtype(*sources: np.ndarray) -> np.dtype:
    """The dtype of a stored copy column whose values are taken from the int arrays ``sources``:
    int32 where every value there fits (a 131,072-rank plan's table is half as large), else int64.
    Bounding the sources bounds the column: its values are a selection of theirs."""
    narrow = int_dtype(0, 0)
    # arrays of a type the narrow one holds need no scan (a plan for one rank joins some 400 small ones)
    full = [a for a in sources if a.size and not np.can_cast(a.dtype, narrow)]
    if not full:
        return narrow
    return int_dtype(min([int(a.min()) for a in full]), max([int(a.max()) for a in full]))


def sorted_distinct(cols) -> tuple[np.ndarray, np.ndarray]:
    """The order that sorts the rows of the equal-length columns ``cols`` (the first most
    significant), and which sorted positions start a distinct row (a bool mask); at least one row."""
    order = np.lexsort(cols[::-1])
    first = np.zeros(len(order), dtype=bool)
    first[0] = True
    for col in cols:
        ranked = col[order]
        first[1:] |= ranked[1:] != ranked[:-1]
    return order, first


@dataclass
class Plan:
    """Struct-of-arrays tables (see docs/ir.md), stored compactly: each row names a set of target
    ranks (``dst_set``, an id into ``rank_sets``) that all receive it, so rows that differ only by
    the target replica are stored once. ``copies``, ``fills`` and ``dataset_ranks`` are the same
    tables expanded to one row per target rank (``dst_rank``), built on first use; executors
    read those, on a plan cut down to the ranks they run (:meth:`for_ranks`). Boxes have ``ndim``
    columns, leading dims padded with start 0, size 1. ``tensor`` -1 in fills marks padding of a
    flat buffer. Stored copy columns are int32 where their values fit (:func:`column_dtype`);
    expanded views are int64."""

    src_mesh: Mesh
    dst_mesh: Mesh
    ndim: int
    tensors: list[dict]  # {name, kind, shape, dtype}
    slots: list[Slot]
    rank_sets: RankSets
    stored_copies: dict[str, np.ndarray]  # COPY_COLUMNS + BOX_COLUMNS
    stored_fills: dict[str, np.ndarray]  # FILL_COLUMNS + FILL_BOX_COLUMNS
    datasets: list[dict]  # target datasets to create: {key, shape, dtype}
    stored_datasets: dict[str, np.ndarray]  # DATASET_COLUMNS: which rank set creates which dataset
    itemsize: np.ndarray = field(init=False)
    _expanded: dict = field(init=False, repr=False, default_factory=dict)

    def __post_init__(self):
        self.itemsize = np.array([itemsize(t["dtype"]) for t in self.tensors] or [0], dtype=I64)

    # -- expanded (one row per target rank) views ----------------------------------------------
    @property
    def copies(self) -> dict[str, np.ndarray]:
        """The copy rows, one per target rank (``dst_rank`` in place of ``dst_set``)."""
        return self._expand("copies", self.stored_copies)

    @property
    def fills(self) -> dict[str, np.ndarray]:
        return self._expand("fills", self.stored_fills)

    @property
    def dataset_ranks(self) -> dict[str, np.ndarray]:
        """``rank`` and ``dataset`` columns: which target rank creates which dataset."""
        if "dataset_ranks" not in self._expanded:
            row, ranks = self.rank_sets.expand(self.stored_datasets["dst_set"])
            self._expanded["dataset_ranks"] = {"rank": ranks, "dataset": self.stored_datasets["dataset"][row]}
        return self._expanded["dataset_ranks"]

    @property
    def first_holders(self) -> dict[str, np.ndarray]:
        """``dataset_ranks`` with only the first (lowest) rank of each dataset's rank set: in a whole
        plan, the rank that stores a dataset several ranks hold alike (checkpoint format 2)."""
        sets = self.stored_datasets["dst_set"]
        return {"rank": self.rank_sets.ranks[self.rank_sets.offsets[sets]], "dataset": self.stored_datasets["dataset"]}

    def _expand(self, name: str, table: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if name not in self._expanded:
            row, ranks = self.rank_sets.expand(table["dst_set"])
            self._expanded[name] = {("dst_rank" if k == "dst_set" else k): (ranks if k == "dst_set" else _wide(v[row]))
                                    for k, v in table.items()}
        return self._expanded[name]

    def stored_rows_for(self, rank: int) -> np.ndarray:
        """Indices of the stored copy rows target rank ``rank`` receives, ascending (plan order)."""
        sets = self.rank_sets.containing(rank)
        if "rows_by_set" not in self._expanded:
            order = np.argsort(self.stored_copies["dst_set"], kind="stable")
            bounds = np.searchsorted(self.stored_copies["dst_set"][order], np.arange(len(self.rank_sets) + 1))
            self._expanded["rows_by_set"] = (order, bounds)
        order, bounds = self._expanded["rows_by_set"]
        parts = [order[bounds[s]:bounds[s + 1]] for s in sets]
        return np.sort(np.concatenate(parts)) if parts else np.zeros(0, dtype=I64)

    def for_ranks(self, ranks) -> "Plan":
        """This plan cut down to the target ``ranks``: what executors for those ranks expand."""
        sets, new_id = self.rank_sets.restrict(ranks)

        def cut(table):
            ids = new_id[table["dst_set"]]
            keep = ids >= 0
            return {k: (ids[keep] if k == "dst_set" else v[keep]) for k, v in table.items()}

        return Plan(self.src_mesh, self.dst_mesh, self.ndim, self.tensors, self.slots, sets,
                    cut(self.stored_copies), cut(self.stored_fills), self.datasets, cut(self.stored_datasets))

    # -- statistics ---------------------------------------------------------------------------
    @property
    def rows(self) -> int:
        """Rows expanded to one per target rank (copies and fills)."""
        return self.copy_count + int(self.rank_sets.sizes[self.stored_fills["dst_set"]].sum())

    @property
    def copy_count(self) -> int:
        return int(self.rank_sets.sizes[self.stored_copies["dst_set"]].sum())

    @property
    def stored_rows(self) -> int:
        return len(self.stored_copies["tensor"]) + len(self.stored_fills["tensor"])

    def _copy_bytes(self) -> np.ndarray:
        """Bytes of each stored copy row: int64 is exact here, since binding bounds every tensor to
        2**62 bytes; sums of rows are not, and are taken with :func:`_exact_sums`."""
        c = self.stored_copies
        vol = np.prod(c["size"], axis=1, dtype=I64)
        return vol * self.itemsize[c["tensor"]]

    def _set_sums(self) -> tuple[np.ndarray, np.ndarray]:
        """Per rank set: the high and low halves of the bytes its rows copy, summed in int64."""
        b, n = self._copy_bytes(), len(self.rank_sets)
        hi, lo = np.zeros(n, dtype=I64), np.zeros(n, dtype=I64)
        np.add.at(hi, self.stored_copies["dst_set"], b >> _HALF)
        np.add.at(lo, self.stored_copies["dst_set"], b & _LOW)
        return hi, lo

    def bytes_read_per_rank(self) -> np.ndarray:
        """Bytes each target rank reads from the source (index = target rank): int64, or Python
        ints (an object array) where a rank reads 2**63 bytes or more."""
        hi, lo = self._set_sums()
        owner, n = self.rank_sets.owner, self.dst_mesh.size
        rank_hi, rank_lo = np.zeros(n, dtype=I64), np.zeros(n, dtype=I64)
        np.add.at(rank_hi, self.rank_sets.ranks, hi[owner])
        np.add.at(rank_lo, self.rank_sets.ranks, lo[owner])
        return _join(rank_hi, rank_lo)

    @property
    def bytes_read(self) -> int:
        hi, lo = self._set_sums()
        sizes = self.rank_sets.sizes
        return (int((hi.astype(object) * sizes).sum()) << _HALF) + int((lo.astype(object) * sizes).sum())

    @property
    def bytes_unique(self) -> int:
        """Distinct source bytes the plan touches (each replica-deduplicated source box once)."""
        c = self.stored_copies
        if not len(c["tensor"]):
            return 0
        # rows sorted by their source box, a column at a time (np.unique over the rows would copy
        # the table several times: 400 MB for the 1.5 million rows of a 131,072-rank plan)
        cols = [c["tensor"], c["src_rank"], c["src_slot"]] + \
            [c[k][:, j] for k in ("src_start", "size") for j in range(self.ndim)]
        order, first = sorted_distinct(cols)
        return _exact_sum(self._copy_bytes()[order[first]])

    @property
    def read_amplification(self) -> float:
        """Bytes read over distinct bytes read (1.0 = every byte once; >1 when replicas reread)."""
        u = self.bytes_unique
        return self.bytes_read / u if u else 1.0

    def peak_memory_bound(self) -> int:
        """Bytes the executors hold at once: one target dataset plus its largest source box."""
        if not self.datasets:
            return 0
        ds_bytes = max(math.prod(int(x) for x in d["shape"]) * itemsize(d["dtype"]) for d in self.datasets)
        box = int(self._copy_bytes().max()) if len(self.stored_copies["tensor"]) else 0
        return ds_bytes + box

    def nbytes(self) -> int:
        """Bytes of the stored tables (not of expanded views built since)."""
        tables = (self.stored_copies, self.stored_fills, self.stored_datasets)
        return sum(a.nbytes for t in tables for a in t.values()) + self.rank_sets.offsets.nbytes + \
            self.rank_sets.ranks.nbytes

    def summary(self) -> str:
        return (f"plan {self.src_mesh} -> {self.dst_mesh}: {self.copy_count} copies, "
                f"{self.rows - self.copy_count} fills ({self.stored_rows} rows stored), "
                f"{len(self.datasets)} target datasets; "
                f"reads {self.bytes_read:,} B ({self.read_amplification:.2f}x of {self.bytes_unique:,} distinct); "
                f"peak memory bound {self.peak_memory_bound():,} B")

    # -- explanation ----------------------------------------------------------------------------
    def explain(self, name: str) -> str:
        """A per-target-rank table of where each box of parameter ``name`` (all kinds) comes from."""
        ids = [i for i, t in enumerate(self.tensors) if t["name"] == name]
        if not ids:
            hint = did_you_mean(name, {t["name"] for t in self.tensors})
            raise PlanError(f"no parameter {name!r} in this plan" + (f"; {hint}" if hint else ""), code="UCL311")
        lines = []
        for i in ids:
            t = self.tensors[i]
            lines.append(f"{t['name']} ({t['kind']}, {t['dtype']}, global {list(t['shape'])})")
            lines.append(f"  {'dst rank':>8}  {'dst dataset':<40} {'dst box':<22} <- {'src rank':>8}  "
                         f"{'src dataset':<40} {'src box':<22} global box")
            c = self._rows_of(self.stored_copies, i)
            order = np.lexsort((c["src_rank"], c["dst_rank"]))
            nd = len(t["shape"])
            for r in order:
                size = c["size"][r][self.ndim - nd:]
                lines.append(f"  {c['dst_rank'][r]:>8}  {self.slots[c['dst_slot'][r]].key:<40} "
                             f"{_box(c['dst_start'][r][self.ndim - nd:], size):<22} <- {c['src_rank'][r]:>8}  "
                             f"{self.slots[c['src_slot'][r]].key:<40} {_box(c['src_start'][r][self.ndim - nd:], size):<22} "
                             f"{_box(c['global_start'][r][self.ndim - nd:], size)}")
            f = self._rows_of(self.stored_fills, i)
            for r in range(len(f["tensor"])):
                lines.append(f"  {f['dst_rank'][r]:>8}  {self.slots[f['dst_slot'][r]].key:<40} "
                             f"{_box(f['dst_start'][r][self.ndim - nd:], f['size'][r][self.ndim - nd:]):<22}"
                             " <- zeros (padding)")
        return "\n".join(lines)

    def _rows_of(self, table: dict[str, np.ndarray], tensor: int) -> dict[str, np.ndarray]:
        """The stored rows of one tensor, expanded to one per target rank."""
        sel = np.flatnonzero(table["tensor"] == tensor)
        row, ranks = self.rank_sets.expand(table["dst_set"][sel])
        return {("dst_rank" if k == "dst_set" else k): (ranks if k == "dst_set" else _wide(v[sel][row]))
                for k, v in table.items()}

    # -- serialisation ------------------------------------------------------------------------------
    def to_json(self) -> str:
        return json.dumps({
            "format": "ucl-plan", "version": PLAN_VERSION, "ndim": self.ndim,
            "src_mesh": self.src_mesh.to_json(), "dst_mesh": self.dst_mesh.to_json(),
            "tensors": [dict(t, shape=list(t["shape"])) for t in self.tensors],
            "slots": [[s.key, s.base, list(s.shape), list(s.dataset_shape)] for s in self.slots],
            "datasets": [dict(d, shape=list(d["shape"])) for d in self.datasets],
            "rank_sets": {"offsets": self.rank_sets.offsets.tolist(), "ranks": self.rank_sets.ranks.tolist()},
            "copies": {k: v.tolist() for k, v in self.stored_copies.items()},
            "fills": {k: v.tolist() for k, v in self.stored_fills.items()},
            "dataset_ranks": {k: v.tolist() for k, v in self.stored_datasets.items()},
        })

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        """A plan from :meth:`to_json` text: version 2, or version 1 (one row per target rank),
        whose rows become rows of one-rank sets."""
        d = parse_json(text, "the plan", lambda m: PlanError(m, code="UCL312"))
        if not isinstance(d, dict) or d.get("format") != "ucl-plan":
            raise PlanError("not a ucl plan", code="UCL312")
        version = d.get("version")
        if not isinstance(version, int) or isinstance(version, bool) or not 1 <= version <= PLAN_VERSION:
            raise PlanError(f"plan version {version!r}: this ucl reads versions 1 to {PLAN_VERSION}; a newer "
                            "ucl wrote it, or it is not a plan", code="UCL312")
        try:
            return cls._from_dict(d, version)
        except (KeyError, TypeError, ValueError, OverflowError, AttributeError, IndexError) as e:
            raise PlanError(f"malformed plan (version {version}): {type(e).__name__}: {e}", code="UCL312") from None

    @classmethod
    def _from_dict(cls, d: dict, version: int) -> "Plan":
        K = d["ndim"]
        if not isinstance(K, int) or K < 1:
            raise ValueError(f"ndim {K!r}")
        src, dst = Mesh.from_json(d["src_mesh"]), Mesh.from_json(d["dst_mesh"])

        def arrays(table, cols1d, cols2d):
            if set(table) != set(cols1d) | set(cols2d):
                raise KeyError(f"columns {sorted(table)}, expected {sorted([*cols1d, *cols2d])}")
            out = {k: np.asarray(table[k], dtype=I64).reshape((-1,)) for k in cols1d}
            out.update({k: np.asarray(table[k], dtype=I64).reshape((-1, K)) for k in cols2d})
            if len({len(v) for v in out.values()}) > 1:
                raise ValueError("columns of different lengths")
            return out

        rank_col = "dst_set" if version >= 2 else "dst_rank"
        copies = arrays(d["copies"], [rank_col if k == "dst_set" else k for k in COPY_COLUMNS], BOX_COLUMNS)
        fills = arrays(d["fills"], [rank_col if k == "dst_set" else k for k in FILL_COLUMNS], FILL_BOX_COLUMNS)
        ds = arrays(d["dataset_ranks"], ["dst_set", "dataset"] if version >= 2 else ["rank", "dataset"], ())
        if version >= 2:
            sets = RankSets(np.asarray(d["rank_sets"]["offsets"], dtype=I64),
                            np.asarray(d["rank_sets"]["ranks"], dtype=I64))
        else:  # version 1: every row names one rank; each distinct rank becomes a one-rank set
            ranks = np.unique(np.concatenate([copies["dst_rank"], fills["dst_rank"], ds["rank"]]))
            sets = RankSets.singletons(ranks)
            for t, col in ((copies, "dst_rank"), (fills, "dst_rank"), (ds, "rank")):
                t["dst_set"] = np.searchsorted(ranks, t.pop(col))
            copies = {k: copies[k] for k in COPY_COLUMNS + BOX_COLUMNS}
            fills = {k: fills[k] for k in FILL_COLUMNS + FILL_BOX_COLUMNS}
        sets.validate(dst.size)
        for t in (copies, fills, ds):
            if len(t["dst_set"]) and (t["dst_set"].min() < 0 or t["dst_set"].max() >= len(sets)):
                raise ValueError("a row names a rank set that does not exist")
        return cls(src, dst, K, [dict(t, shape=tuple(t["shape"])) for t in d["tensors"]],
                   [Slot(k, b, tuple(s), tuple(dss)) for k, b, s, dss in d["slots"]],
                   sets, copies, fills, [dict(x, shape=tuple(x["shape"])) for x in d["datasets"]], ds)


_HALF = 31  # byte counts below 2**62 split into two halves of at most 31 bits, summed exactly in int64
_LOW = (1 << _HALF) - 1


def _join(hi: np.ndarray, lo: np.ndarray) -> np.ndarray:
    """Per-key sums kept as high and low halves (each summed in int64 without wrapping around,
    which holds for up to 2**32 rows a key; ``np.bincount`` would sum in float64 and round), put
    together: int64 where every sum fits, else Python ints."""
    total = hi.astype(object) * (1 << _HALF) + lo.astype(object)
    return total.astype(I64) if not len(total) or max(total) < (1 << 63) else total


def _exact_sum(values: np.ndarray) -> int:
    """The sum of non-negative int64 ``values`` (each below 2**62), as an exact Python int."""
    return (int((values >> _HALF).sum()) << _HALF) + int((values & _LOW).sum())


def _wide(a: np.ndarray) -> np.ndarray:
    """An expanded column as int64 (stored ones may be int32): executors compute offsets with it."""
    return a.astype(I64, copy=False)


def _box(start, size) -> str:
    return "[" + ", ".join(f"{a}:{a + b}" for a, b in zip(start, size)) + "]"
