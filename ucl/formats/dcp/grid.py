"""How a DCP tensor's saved chunks map onto splits over mesh axes: the ways each tensor's chunks
are ``split D over AX uneven`` (``torch.chunk`` semantics), nested up to ``MAX_LEVELS`` deep
(:func:`split_options`), and the smallest mesh every parameter fits, with the axis of each split
(:func:`choose_mesh`). Pure: it reads chunk boxes, not files."""
from __future__ import annotations

import itertools
import math
from collections import Counter
from dataclasses import dataclass

from ...errors import ForeignFormatError
from .metadata import TensorMeta

MAX_LEVELS = 3  # nested splits of one dim
MAX_EMPTY = 64  # empty pieces a dim may have beyond its saved ones


@dataclass(frozen=True)
class SplitOption:
    """One way to split a tensor that gives exactly its saved chunks: the nested splits of each
    split dim and how many cells (saved chunks and empty ones) they make."""

    levels: tuple[tuple[int, tuple[int, ...]], ...]  # per split dim: (dim, sizes of its nested splits, outer first)
    cells: int

    @property
    def sizes(self) -> Counter:
        return Counter(s for _, f in self.levels for s in f)

    @property
    def depth(self) -> int:
        return sum(len(f) for _, f in self.levels)


def saved_boxes(t: TensorMeta) -> set[tuple]:
    return {(c.offsets, c.sizes) for c in t.chunks if not c.empty}


def shown_offsets(t: TensorMeta) -> str:
    shown = [list(c.offsets) for c in t.chunks[:8]]
    return f"{shown}{' ...' if len(t.chunks) > 8 else ''}"


def _pieces(n: int, factors: tuple[int, ...]) -> list[int]:
    """The piece sizes of nested ``split ... uneven`` over ``factors`` (outer first), in order."""
    sizes = [n]
    for p in factors:
        out = []
        for m in sizes:
            c = -(-m // p)
            out += [max(0, min(m, (i + 1) * c) - min(m, i * c)) for i in range(p)]
        sizes = out
    return sizes


def _factorizations(p: int, depth: int) -> list[tuple[int, ...]]:
    """``p`` as ordered products of at most ``depth`` factors > 1 (``()`` for 1)."""
    if p == 1:
        return [()]
    out = [(p,)]
    if depth > 1:
        small = [a for a in range(2, math.isqrt(p) + 1) if p % a == 0]
        for a in sorted(set(small) | {p // a for a in small}):
            out += [(a,) + rest for rest in _factorizations(p // a, depth - 1) if rest]
    return out


def split_options(t: TensorMeta) -> list[SplitOption]:
    """The ways to split ``t`` that give exactly its saved (non-empty) chunks."""
    if math.prod(t.shape) == 0 or not t.chunks:
        if not t.chunks:
            raise ForeignFormatError(f"{t.key!r} has no saved chunks")
        return [SplitOption((), 1)]
    boxes = saved_boxes(t)
    empties = len({(c.offsets, c.sizes) for c in t.chunks if c.empty})
    per_dim: list[list[tuple[tuple[int, ...], int]]] = []
    grid = 1
    for d, n in enumerate(t.shape):
        proj = sorted({(o[d], s[d]) for o, s in boxes})
        pos = 0
        for o, s in proj:
            if o != pos:
                raise ForeignFormatError(f"{t.key!r}: its chunks at offsets {shown_offsets(t)} do not tile dim {d} "
                             f"(a piece starts at {o}, expected {pos}); not a grid ucl can describe")
            pos += s
        if pos != n:
            raise ForeignFormatError(f"{t.key!r}: its chunks at offsets {shown_offsets(t)} cover {pos} of {n} along dim {d}")
        grid *= len(proj)
        seen = [s for _, s in proj]
        opts = []
        for p in range(len(seen), len(seen) + min(empties, MAX_EMPTY) + 1):
            for f in _factorizations(p, MAX_LEVELS):
                if [s for s in _pieces(n, f) if s] == seen:
                    opts.append((f, p))
        if not opts:
            raise ForeignFormatError(f"{t.key!r} {list(t.shape)}: its chunks at offsets {shown_offsets(t)} cut dim {d} into pieces "
                         f"{seen}, which no split over a mesh axis gives (torch.chunk semantics, 'split {d} over AX "
                         f"uneven', nested up to {MAX_LEVELS} deep)")
        per_dim.append(opts)
    if grid != len(boxes):
        raise ForeignFormatError(f"{t.key!r}: its chunks at offsets {shown_offsets(t)} are not a grid of boxes; ucl describes "
                     "chunks that split each dim independently")
    out = []
    for combo in itertools.islice(itertools.product(*per_dim), 4096):
        levels = tuple((d, f) for d, (f, _) in enumerate(combo) if f)
        out.append(SplitOption(levels, math.prod(p for _, p in combo)))
    return out


def _union(m: Counter, o: Counter) -> Counter:
    return Counter({s: max(m[s], o[s]) for s in set(m) | set(o)})


def choose_mesh(params: dict[str, TensorMeta], layouts: dict[str, list[SplitOption]]
                 ) -> tuple[dict[str, dict[tuple[int, int], int]], list[tuple[str, int]]]:
    """One option per parameter, a mesh they all fit (the smallest this greedy finds) and, per
    parameter, the axis of each level: ``{name: {(dim, level): axis index}}`` and ``[(axis, size)]``."""
    pick: dict[str, SplitOption] = {}
    need: Counter = Counter()
    order = sorted(params, key=lambda n: (len(layouts[n]), -max(o.depth for o in layouts[n])))
    for n in order:
        pick[n] = min(layouts[n], key=lambda o: (math.prod(s ** c for s, c in _union(need, o.sizes).items()),
                                                 o.cells != len({(c.offsets, c.sizes) for c in params[n].chunks}),
                                                 o.depth))
        need = _union(need, pick[n].sizes)
    axes = [[size, 0, 0] for size in sorted(need, reverse=True) for _ in range(need[size])]  # size, inner0, other
    assign: dict[str, dict[tuple[int, int], int]] = {}
    for n in params:
        levels = [(d, i, s, d == 0 and i == len(f) - 1) for d, f in pick[n].levels for i, s in enumerate(f)]
        levels.sort(key=lambda x: not x[3])  # the innermost split of dim 0 (FSDP's) chooses first
        used: dict[tuple[int, int], int] = {}
        for d, i, s, inner0 in levels:
            free = [a for a in range(len(axes)) if axes[a][0] == s and a not in used.values()]
            score = (lambda a: axes[a][1] - axes[a][2]) if inner0 else (lambda a: axes[a][2] - axes[a][1])
            a = max(free, key=lambda a: (score(a), -a))
            used[(d, i)] = a
            axes[a][1 if inner0 else 2] += 1
        assign[n] = used
    names: list[str] = []
    counts = Counter()
    for size, inner0, other in axes:
        base = "dp" if other == 0 else "tp"
        counts[base] += 1
        names.append(base if counts[base] == 1 else f"{base}{counts[base]}")
    order_axes = sorted(range(len(axes)), key=lambda a: (not names[a].startswith("dp"), a))
    final = {a: k for k, a in enumerate(order_axes)}
    return ({n: {lv: final[a] for lv, a in used.items()} for n, used in assign.items()},
            [(names[a], axes[a][0]) for a in order_axes])
