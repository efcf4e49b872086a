"""A plan ``Source`` whose boxes pass through memory of its own in pieces of at most a given size:
a box larger than that (a whole embedding, a column block of one) is read as sub-boxes, each
straight into its place where it can be, else through a bounce buffer of at most ``piece`` bytes.
It keeps a load's or a reshard's working memory under its ``max_memory`` share (docs/memory.md);
the bytes read and the checks made are those of the source it wraps."""
from __future__ import annotations

import math
from typing import Iterator

import numpy as np

from ..layout.boxes import Slot


class BoundedSource:
    """``source`` (a ``store.StoreSource``) read in boxes of at most ``piece`` bytes."""

    def __init__(self, source, piece: int):
        self.source, self.piece = source, max(1, int(piece))

    @property
    def bytes_read(self) -> int:
        return self.source.bytes_read

    def read(self, rank: int, slot: Slot, start, size) -> np.ndarray:
        if self._small(rank, slot, size):
            return self.source.read(rank, slot, start, size)
        out = np.empty(tuple(int(x) for x in size[len(size) - len(slot.shape):]), dtype=self._dtype(rank, slot))
        self.read_into(rank, slot, start, size, out)
        return out

    def read_into(self, rank: int, slot: Slot, start, size, out: np.ndarray) -> bool:
        if self._small(rank, slot, size):
            return self.source.read_into(rank, slot, start, size, out)
        start, size = [int(x) for x in start], [int(x) for x in size]
        lead = len(size) - out.ndim  # plan boxes pad leading dims of size 1; ``out`` has the slot's own
        for a, k, n in _cuts(size, max(lead, len(size) - len(slot.shape)), out.itemsize, self.piece):
            sub_start, sub_size = list(start), list(size)
            for axis, i in enumerate(a):
                sub_start[axis], sub_size[axis] = start[axis] + i, 1
            sub_start[len(a)], sub_size[len(a)] = start[len(a)] + k, n
            view = out[tuple(slice(i, i + 1) for i in a[lead:]) + (slice(k, k + n),)]
            if not self.source.read_into(rank, slot, sub_start, sub_size, view):
                view[...] = self.source.read(rank, slot, sub_start, sub_size).reshape(view.shape)
        return True

    def _small(self, rank: int, slot: Slot, size) -> bool:
        n = math.prod(int(x) for x in size)
        return n * 16 <= self.piece or n * self._dtype(rank, slot).itemsize <= self.piece

    def _dtype(self, rank: int, slot: Slot) -> np.dtype:
        return self.source.ckpt.info(rank, slot.key).storage_dtype


def _cuts(size: list[int], first: int, itemsize: int, piece: int) -> Iterator[tuple[tuple[int, ...], int, int]]:
    """Sub-boxes of a box of ``size`` covering it in row-major order, each at most ``piece`` bytes
    where one index of the innermost dim allows: ``(a, k, n)`` = indices ``a`` of the dims before the
    cut dim (each sub-box one deep there), and rows ``[k, k + n)`` of the cut dim ``len(a)``. Dims
    before ``first`` (padding) are never cut."""
    for axis in range(first, len(size)):
        inner = math.prod(size[axis + 1:]) * itemsize
        if inner <= piece or axis == len(size) - 1:
            rows = max(1, piece // max(1, inner))
            for a in np.ndindex(*size[:axis]):
                for k in range(0, size[axis], rows):
                    yield tuple(int(i) for i in a), k, min(rows, size[axis] - k)
            return
