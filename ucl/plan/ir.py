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

PLAN_VERSION = 1
COPY_COLUMNS = ("tensor", "src_rank", "src_slot", "dst_rank", "dst_slot")
BOX_COLUMNS = ("src_start", "dst_start", "global_start", "size")
FILL_COLUMNS = ("tensor", "dst_rank", "dst_slot")


@dataclass
class Plan:
    """Struct-of-arrays tables (see docs/ir.md). Boxes have ``ndim`` columns, leading dims padded
    with start 0, size 1. ``tensor`` -1 in fills marks padding of a flat buffer."""

    src_mesh: Mesh
    dst_mesh: Mesh
    ndim: int
    tensors: list[dict]  # {name, kind, shape, dtype}
    slots: list[Slot]
    copies: dict[str, np.ndarray]
    fills: dict[str, np.ndarray]
    datasets: list[dict]  # target datasets to create: {key, shape, dtype}
    dataset_ranks: dict[str, np.ndarray]  # "rank", "dataset": which rank creates which dataset
    itemsize: np.ndarray = field(init=False)

    def __post_init__(self):
        self.itemsize = np.array([itemsize(t["dtype"]) for t in self.tensors] or [0], dtype=I64)

    # -- statistics ---------------------------------------------------------------------------
    @property
    def rows(self) -> int:
        return len(self.copies["tensor"]) + len(self.fills["dst_rank"])

    def _copy_bytes(self) -> np.ndarray:
        """Bytes of each copy row: int64 is exact here, since binding bounds every tensor to 2**62
        bytes; sums of rows are not, and are taken with :func:`_exact_sums`."""
        vol = np.prod(self.copies["size"], axis=1, dtype=I64)
        return vol * self.itemsize[self.copies["tensor"]]

    def bytes_read_per_rank(self) -> np.ndarray:
        """Bytes each target rank reads from the source (index = target rank): int64, or Python
        ints (an object array) where a rank reads 2**63 bytes or more."""
        return _exact_sums(self.copies["dst_rank"], self._copy_bytes(), self.dst_mesh.size)

    @property
    def bytes_read(self) -> int:
        return _exact_sum(self._copy_bytes())

    @property
    def bytes_unique(self) -> int:
        """Distinct source bytes the plan touches (each replica-deduplicated source box once)."""
        if not len(self.copies["tensor"]):
            return 0
        keys = np.concatenate([self.copies[c][:, None] for c in ("tensor", "src_rank", "src_slot")]
                              + [self.copies["src_start"], self.copies["size"]], axis=1)
        _, first = np.unique(keys, axis=0, return_index=True)
        return _exact_sum(self._copy_bytes()[first])

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
        box = int(self._copy_bytes().max()) if len(self.copies["tensor"]) else 0
        return ds_bytes + box

    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.copies.values()) + sum(a.nbytes for a in self.fills.values()) + \
            sum(a.nbytes for a in self.dataset_ranks.values())

    def summary(self) -> str:
        return (f"plan {self.src_mesh} -> {self.dst_mesh}: {len(self.copies['tensor'])} copies, "
                f"{len(self.fills['dst_rank'])} fills, {len(self.datasets)} target datasets; "
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
            sel = np.flatnonzero(self.copies["tensor"] == i)
            sel = sel[np.lexsort((self.copies["src_rank"][sel], self.copies["dst_rank"][sel]))]
            nd = len(t["shape"])
            for r in sel:
                c = {k: v[r] for k, v in self.copies.items()}
                size = c["size"][self.ndim - nd:]
                lines.append(f"  {c['dst_rank']:>8}  {self.slots[c['dst_slot']].key:<40} "
                             f"{_box(c['dst_start'][self.ndim - nd:], size):<22} <- {c['src_rank']:>8}  "
                             f"{self.slots[c['src_slot']].key:<40} {_box(c['src_start'][self.ndim - nd:], size):<22} "
                             f"{_box(c['global_start'][self.ndim - nd:], size)}")
            fsel = np.flatnonzero(self.fills["tensor"] == i)
            for r in fsel:
                lines.append(f"  {self.fills['dst_rank'][r]:>8}  {self.slots[self.fills['dst_slot'][r]].key:<40} "
                             f"{_box(self.fills['dst_start'][r][self.ndim - nd:], self.fills['size'][r][self.ndim - nd:]):<22}"
                             " <- zeros (padding)")
        return "\n".join(lines)

    # -- serialisation ------------------------------------------------------------------------------
    def to_json(self) -> str:
        return json.dumps({
            "format": "ucl-plan", "version": PLAN_VERSION, "ndim": self.ndim,
            "src_mesh": self.src_mesh.to_json(), "dst_mesh": self.dst_mesh.to_json(),
            "tensors": [dict(t, shape=list(t["shape"])) for t in self.tensors],
            "slots": [[s.key, s.base, list(s.shape), list(s.dataset_shape)] for s in self.slots],
            "datasets": [dict(d, shape=list(d["shape"])) for d in self.datasets],
            "copies": {k: v.tolist() for k, v in self.copies.items()},
            "fills": {k: v.tolist() for k, v in self.fills.items()},
            "dataset_ranks": {k: v.tolist() for k, v in self.dataset_ranks.items()},
        })

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        d = parse_json(text, "the plan", lambda m: PlanError(m, code="UCL312"))
        if not isinstance(d, dict) or d.get("format") != "ucl-plan" or not isinstance(d.get("version", 0), int) \
                or d.get("version", 0) > PLAN_VERSION:
            raise PlanError("not a ucl plan, or one from a newer ucl", code="UCL312")
        try:
            return cls._from_dict(d)
        except (KeyError, TypeError, ValueError, OverflowError, AttributeError) as e:
            raise PlanError(f"malformed plan: {type(e).__name__}: {e}", code="UCL312") from None

    @classmethod
    def _from_dict(cls, d: dict) -> "Plan":
        K = d["ndim"]

        def arrays(table, cols2d):
            return {k: np.asarray(v, dtype=I64).reshape((-1, K) if k in cols2d else (-1,)) for k, v in table.items()}

        return cls(Mesh.from_json(d["src_mesh"]), Mesh.from_json(d["dst_mesh"]), K,
                   [dict(t, shape=tuple(t["shape"])) for t in d["tensors"]],
                   [Slot(k, b, tuple(s), tuple(ds)) for k, b, s, ds in d["slots"]],
                   arrays(d["copies"], BOX_COLUMNS), arrays(d["fills"], ("dst_start", "size")),
                   [dict(x, shape=tuple(x["shape"])) for x in d["datasets"]],
                   {k: np.asarray(v, dtype=I64) for k, v in d["dataset_ranks"].items()})


_HALF = 31  # byte counts below 2**62 split into two halves of at most 31 bits, summed exactly in int64


def _exact_sums(keys: np.ndarray, values: np.ndarray, n: int) -> np.ndarray:
    """Per-key sums of non-negative int64 ``values`` (each below 2**62) without wrapping around or
    rounding (``np.bincount`` sums in float64): the high and low halves are summed apart in int64,
    which holds for up to 2**32 rows, and put together as Python ints."""
    hi, lo = np.zeros(n, dtype=I64), np.zeros(n, dtype=I64)
    np.add.at(hi, keys, values >> _HALF)
    np.add.at(lo, keys, values & ((1 << _HALF) - 1))
    total = hi.astype(object) * (1 << _HALF) + lo.astype(object)
    return total.astype(I64) if not len(total) or max(total) < (1 << 63) else total


def _exact_sum(values: np.ndarray) -> int:
    """The sum of non-negative int64 ``values`` (each below 2**62), as an exact Python int."""
    return (int((values >> _HALF).sum()) << _HALF) + int((values & ((1 << _HALF) - 1)).sum())


def _box(start, size) -> str:
    return "[" + ", ".join(f"{a}:{a + b}" for a, b in zip(start, size)) + "]"
