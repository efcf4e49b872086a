"""The layout algebra: how one dim of a global tensor lands in one rank's local tensor.

A dim is a tree: a leaf, a ``view`` (row-major factors) or a ``concat`` (named parts), after an
optional ``pad``. Splits attach to nodes. For one rank the answer is a :class:`DimLayout`: runs
``(global start, local start, length)`` of real data plus runs of padding in local coordinates.
Every transform is monotone, so runs are sorted both globally and locally. An N-d local tensor is
the product of its dims' runs; a contiguous flat range of it is at most ``2*ndim - 1`` boxes.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Mapping

import numpy as np

I64 = np.int64


class LayoutError(Exception):
    """Internal: a numeric problem found while lowering; callers add the parameter and rule.
    ``split`` says which split failed, when one did (so callers can say what to change)."""

    def __init__(self, code: str, message: str, hint: str | None = None, *, split: "SplitFailure | None" = None):
        super().__init__(message)
        self.code, self.hint, self.split = code, hint, split


@dataclass(frozen=True)
class SplitFailure:
    """A split that cannot cut what it is given: ``size`` elements of the node at ``path`` (dim
    index first, then view factors / concat parts) over ``axes`` (``parts`` pieces in all).
    ``whole``: ``size`` is the node's whole (padded) size, not what an earlier split left."""

    path: tuple
    axes: tuple[str, ...]
    mode: str
    size: int
    parts: int
    whole: bool


@dataclass(frozen=True)
class Node:
    kind: str  # "leaf" | "view" | "concat"
    size: int
    children: tuple["Node", ...] = ()
    splits: tuple[tuple[tuple[str, ...], str], ...] = ()  # ((axes...), "even"|"uneven"|"shared")
    post: tuple[tuple[tuple[str, ...], str], ...] = ()  # splits of a view/concat's rank-local extent
    path: tuple = ()  # where the node sits in its dim: (dim, factor or part, ...); for messages

    def axes(self) -> frozenset[str]:
        own = {a for axes, _ in self.splits + self.post for a in axes}
        for c in self.children:
            own |= c.axes()
        return frozenset(own)


@dataclass(frozen=True)
class DimSpec:
    size: int  # logical (unpadded)
    padded: int
    node: Node


@dataclass(frozen=True, eq=False)
class DimLayout:
    """One dim on one rank: ``segs`` (k,3) = global start, local start, length of real data;
    ``fills`` (f,2) = local start, length of padding; ``local`` = local extent."""

    local: int
    segs: np.ndarray
    fills: np.ndarray

    def __getattr__(self, name: str):
        # ``sig`` and ``_runs`` are made on first use and kept as plain
        # attributes: a cached_property takes a lock on every access in Python 3.11, and a
        # 131,072-rank plan reads them some 10^5 times
        make = _LAZY.get(name)
        if make is None:
            raise AttributeError(name)
        value = self.__dict__[name] = make(self)
        return value

    def restrict(self, lo: int, hi: int) -> "DimLayout":
        """Keep local positions [lo, hi) (coordinates stay those of the whole local dim)."""
        seg_runs, fill_runs = self._runs
        segs = [(g + a - l, a, b - a) for g, l, n in seg_runs
                for a, b in ((max(l, lo), min(l + n, hi)),) if a < b]
        fills = [(a, b - a) for l, n in fill_runs for a, b in ((max(l, lo), min(l + n, hi)),) if a < b]
        return DimLayout(hi - lo, np.array(segs, dtype=I64) if segs else _EMPTY3,
                         np.array(fills, dtype=I64) if fills else _EMPTY2)


_EMPTY3 = np.zeros((0, 3), dtype=I64)
_EMPTY2 = np.zeros((0, 2), dtype=I64)

_LAZY = {
    # hashable identity of the geometry (plans of equal geometry are computed once)
    "sig": lambda d: (d.local, d.segs.tobytes(), d.fills.tobytes()),
    # ``segs`` and ``fills`` as Python ints: a dim has a few runs, and restricting them in Python
    # is several times faster than a dozen numpy calls on tiny arrays
    "_runs": lambda d: (tuple(map(tuple, d.segs.tolist())), tuple(map(tuple, d.fills.tolist()))),
}


def split_range(n: int, parts: int, coord: int, mode: str) -> tuple[int, int]:
    """Offsets [lo, hi) of piece ``coord`` when ``n`` elements are split ``parts`` ways."""
    if parts == 1:
        return 0, n
    if mode == "uneven":  # torch.chunk: ceil-sized chunks, trailing ranks may be short or empty
        chunk = -(-n // parts)
        return min(coord * chunk, n), min((coord + 1) * chunk, n)
    if mode == "shared" and 0 < n < parts:
        if parts % n:
            raise LayoutError("UCL204", f"{n} elements cannot be shared evenly by {parts} ranks",
                              "the axis size must be a multiple of the dim size")
        idx = coord // (parts // n)
        return idx, idx + 1
    if n % parts:
        raise LayoutError("UCL204", f"{n} elements cannot be split evenly {parts} ways",
                          "add `uneven` for torch.chunk semantics, or pad the dim")
    chunk = n // parts
    return coord * chunk, (coord + 1) * chunk


def _coord(axes, coords) -> tuple[int, int]:
    coord, parts = 0, 1
    for a in axes:
        c, s = coords[a]
        coord, parts = coord * s + c, parts * s
    return coord, parts


def _held(node: Node, coords: Mapping[str, tuple[int, int]]):
    """Global indices (within the node) held by a rank, in local order.
    Returns (lo, hi) for a contiguous range, else an int64 array."""
    held = _held_structure(node, coords)
    for axes, mode in node.post:
        coord, parts = _coord(axes, coords)
        n = held[1] - held[0] if isinstance(held, tuple) else len(held)
        lo, hi = _split(node, axes, mode, n, parts, coord, whole=False)
        held = (held[0] + lo, held[0] + hi) if isinstance(held, tuple) else held[lo:hi]
    return held


def _split(node: Node, axes, mode, n, parts, coord, whole):
    """split_range, with a failure saying which split of which node it was."""
    try:
        return split_range(n, parts, coord, mode)
    except LayoutError as e:
        raise LayoutError(e.code, str(e), e.hint,
                          split=SplitFailure(node.path, tuple(axes), mode, n, parts, whole)) from None


def _held_structure(node: Node, coords):
    if node.kind == "leaf" or (node.kind == "view" and node.splits):
        lo, hi = 0, node.size
        for k, (axes, mode) in enumerate(node.splits):
            coord, parts = _coord(axes, coords)
            dlo, dhi = _split(node, axes, mode, hi - lo, parts, coord, whole=k == 0)
            lo, hi = lo + dlo, lo + dhi
        return lo, hi
    kids = [_held(c, coords) for c in node.children]
    if node.kind == "view":
        if all(isinstance(k, tuple) and k == (0, c.size) for k, c in zip(kids, node.children)):
            return 0, node.size
        idx = np.zeros(1, dtype=I64)
        for k, child in zip(kids, node.children):
            arr = np.arange(*k, dtype=I64) if isinstance(k, tuple) else k
            idx = (idx[:, None] * child.size + arr[None, :]).ravel()
        return idx
    # concat
    out, offset = [], 0
    for k, child in zip(kids, node.children):
        arr = np.arange(*k, dtype=I64) if isinstance(k, tuple) else k
        out.append(arr + offset)
        offset += child.size
    return np.concatenate(out) if out else np.zeros(0, dtype=I64)


def _runs(values: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Maximal runs where both values and positions step by one: (value start, position start, length)."""
    if len(values) == 0:
        return _EMPTY3
    brk = np.flatnonzero((np.diff(values) != 1) | (np.diff(positions) != 1)) + 1
    starts = np.concatenate([[0], brk])
    ends = np.concatenate([brk, [len(values)]])
    return np.stack([values[starts], positions[starts], ends - starts], axis=1).astype(I64)


@lru_cache(maxsize=1 << 16)
def dim_layout(dim: DimSpec, coords: tuple[tuple[str, int, int], ...]) -> DimLayout:
    """The layout of one dim on the rank with the given (axis, coord, size) coordinates."""
    held = _held(dim.node, {a: (c, s) for a, c, s in coords})
    if isinstance(held, tuple):
        lo, hi = held
        n = hi - lo
        real_hi = min(hi, dim.size)
        segs = np.array([[lo, 0, real_hi - lo]], dtype=I64) if real_hi > lo else _EMPTY3
        pad_lo = max(lo, dim.size)
        fills = np.array([[pad_lo - lo, hi - pad_lo]], dtype=I64) if hi > pad_lo else _EMPTY2
        return DimLayout(n, segs, fills)
    pos = np.arange(len(held), dtype=I64)
    real = held < dim.size
    segs = _runs(held[real], pos[real])
    fill_runs = _runs(pos[~real], pos[~real])
    return DimLayout(len(held), segs, fill_runs[:, 1:3] if len(fill_runs) else _EMPTY2)


def intersect(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Overlaps of two sorted run lists (k,3) in global coordinates:
    rows (global start, a local start, b local start, length)."""
    if len(a) == 0 or len(b) == 0:
        return np.zeros((0, 4), dtype=I64)
    b_end = b[:, 0] + b[:, 2]
    a_end = a[:, 0] + a[:, 2]
    i0 = np.searchsorted(b_end, a[:, 0], side="right")
    i1 = np.searchsorted(b[:, 0], a_end, side="left")
    counts = np.maximum(i1 - i0, 0)
    if counts.sum() == 0:
        return np.zeros((0, 4), dtype=I64)
    ai = np.repeat(np.arange(len(a)), counts)
    bi = np.concatenate([np.arange(s, e) for s, e in zip(i0, i1) if e > s]) if len(a) < 64 else \
        (np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts) + np.repeat(i0, counts))
    start = np.maximum(a[ai, 0], b[bi, 0])
    end = np.minimum(a_end[ai], b_end[bi])
    keep = start < end
    ai, bi, start, end = ai[keep], bi[keep], start[keep], end[keep]
    return np.stack([start, a[ai, 1] + start - a[ai, 0], b[bi, 1] + start - b[bi, 0], end - start], axis=1)


def product(per_dim: list[np.ndarray]) -> np.ndarray:
    """Cartesian product of per-dim row lists: returns (rows, ndim, ncols)."""
    if not per_dim:
        return np.zeros((1, 0, 4), dtype=I64)
    counts = [len(x) for x in per_dim]
    if 0 in counts:
        return np.zeros((0, len(per_dim), per_dim[0].shape[1]), dtype=I64)
    grids = np.meshgrid(*[np.arange(c) for c in counts], indexing="ij")
    return np.stack([x[g.ravel()] for x, g in zip(per_dim, grids)], axis=1)
