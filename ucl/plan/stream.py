"""A target dataset assembled block by block in flat order, so each block is hashed and written while
it is still in cache (the reshard's streamed path): plan rows as strided copies between flat offsets,
and the parts of them that land in one block of the target."""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np

from ..layout.boxes import Slot, flat_boxes, slot_box, strides
from .ir import Plan


@dataclass(frozen=True)
class StridedCopy:
    """Element ``i`` (row-major over ``sizes``) of a box goes from source flat offset
    ``src + sum(i_k * src_strides_k)`` to target flat offset ``dst + sum(i_k * dst_strides_k)``.
    Both stride tuples are row-major strides of a shape the box fits in, so the box's elements
    are in increasing flat order on both sides."""

    src_rank: int
    src_key: str
    src: int
    src_strides: tuple[int, ...]
    dst: int
    dst_strides: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def count(self) -> int:
        return math.prod(self.sizes)

    @property
    def dst_stop(self) -> int:
        """One past the last target offset the copy writes."""
        return self.dst + sum((n - 1) * s for n, s in zip(self.sizes, self.dst_strides)) + 1

    @property
    def src_stop(self) -> int:
        """One past the last source offset the copy reads."""
        return self.src + sum((n - 1) * s for n, s in zip(self.sizes, self.src_strides)) + 1

    def src_runs(self) -> list[tuple[int, int, int, int]]:
        """The source elements, in box order, as regular runs ``(start, count, stride, block)`` of
        the source's flattening (``Checkpoint.read_runs``): the box's contiguous inner dims make the
        block, the next dim the count and stride, the dims outside it one run each."""
        sizes, st = self.sizes, self.src_strides
        k, block = len(sizes), 1
        while k > 0 and (sizes[k - 1] == 1 or st[k - 1] == block):  # dims contiguous with those inside
            k -= 1
            block *= sizes[k]
        if k == 0:
            return [(self.src, 1, block, block)]
        outer = itertools.product(*(range(n) for n in sizes[:k - 1]))
        return [(self.src + sum(i * s for i, s in zip(idx, st)), sizes[k - 1], st[k - 1], block) for idx in outer]

    def part(self, first: int, stop: int) -> Iterator["StridedCopy"]:
        """The copy of box elements ``[first, stop)`` (row-major order) as at most ``2 * ndim - 1``
        sub-boxes."""
        for _, starts, sizes in flat_boxes(self.sizes, first, stop):
            yield StridedCopy(self.src_rank, self.src_key,
                              self.src + sum(a * s for a, s in zip(starts, self.src_strides)), self.src_strides,
                              self.dst + sum(a * s for a, s in zip(starts, self.dst_strides)), self.dst_strides,
                              tuple(sizes))


def _on_slot(slot: Slot, start, size) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
    """A plan box on a slot as (flat offset of its first element, strides, sizes) in the slot's dims."""
    start, size = slot_box(slot, start, size)
    st = tuple(strides(slot.shape))
    return slot.base + sum(a * s for a, s in zip(start, st)), st, size


def strided_copies(plan: Plan, rows: Sequence[int]) -> list[StridedCopy] | None:
    """The copy ``rows`` (all into one target dataset) as strided copies in target order; None when
    a row's box is not laid out alike on both sides (another number of dims after trimming)."""
    c = plan.copies
    out = []
    for i in rows:
        s, d = plan.slots[c["src_slot"][i]], plan.slots[c["dst_slot"][i]]
        src, src_st, size = _on_slot(s, c["src_start"][i], c["size"][i])
        dst, dst_st, dsize = _on_slot(d, c["dst_start"][i], c["size"][i])
        if size != dsize:
            return None
        if 0 in size:
            continue
        out.append(StridedCopy(int(c["src_rank"][i]), s.key, src, src_st, dst, dst_st, size))
    return sorted(out, key=lambda x: x.dst)


def box_rank(sizes: Sequence[int], strides_: Sequence[int], x: int) -> int:
    """How many elements of a box (``sizes``, row-major ``strides_`` of a shape it fits in, first
    element at offset 0) lie at flat offsets below ``x``."""
    if x <= 0:
        return 0
    if not sizes:
        return 1
    inner = math.prod(sizes[1:])
    i = min(x // strides_[0], sizes[0])
    if i >= sizes[0]:
        return sizes[0] * inner
    return i * inner + box_rank(sizes[1:], strides_[1:], x - i * strides_[0])


def parts_in(copies: Sequence[StridedCopy], lo: int, hi: int) -> Iterator[StridedCopy]:
    """The parts of ``copies`` (sorted by ``dst``, as ``strided_copies`` gives them) whose target
    offsets lie in ``[lo, hi)``, as sub-copies."""
    for cp in copies:
        if cp.dst >= hi:  # so do all later ones: a block does not scan the copies of the blocks after it
            break
        if cp.dst_stop <= lo:
            continue
        first = box_rank(cp.sizes, cp.dst_strides, lo - cp.dst)
        stop = box_rank(cp.sizes, cp.dst_strides, hi - cp.dst)
        if stop > first:
            yield from cp.part(first, stop)


def strided(flat: np.ndarray, offset: int, sizes: Sequence[int], strides_: Sequence[int], writeable: bool) -> np.ndarray:
    """The box view of the 1-D ``flat`` at element ``offset`` (bounds are the caller's: checked spans)."""
    item = flat.itemsize
    return np.lib.stride_tricks.as_strided(flat[offset:], tuple(sizes), tuple(s * item for s in strides_),
                                           writeable=writeable)


def fill_block(copies: Sequence[StridedCopy], lo: int, out: np.ndarray,
               read: Callable[[StridedCopy, np.ndarray], None]) -> int:
    """Fill, in the 1-D ``out`` holding target elements ``[lo, lo + out.size)``, every part of
    ``copies`` (sorted by ``dst``) landing there: ``read(part, view)`` puts the part's source elements into ``view``,
    the part's (strided) box view of ``out``. Elements no copy writes are left as they are.
    Returns the elements filled."""
    return fill_parts(parts_in(copies, lo, lo + out.size), lo, out, read)


def fill_parts(parts: Iterable[StridedCopy], lo: int, out: np.ndarray,
               read: Callable[[StridedCopy, np.ndarray], None]) -> int:
    """``fill_block`` from the block's ``parts`` (``parts_in``), listed beforehand by a caller that
    needs them first (to tell whether they cover the block). Returns the elements filled."""
    done = 0
    for p in parts:
        read(p, strided(out, p.dst - lo, p.sizes, p.dst_strides, True))
        done += p.count
    return done
