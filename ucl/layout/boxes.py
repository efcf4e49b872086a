"""Boxes of row-major tensors: the one owner of flat ranges as boxes, strides, and a box of a
tensor that lives inside a (flat) dataset. Pure numpy, no I/O."""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from ..errors import PlanError


@dataclass(frozen=True)
class Slot:
    """A view of one dataset as a row-major tensor of ``shape`` starting at flat ``base``
    (``base`` may be negative: a flat partition can start inside a tensor)."""

    key: str
    base: int
    shape: tuple[int, ...]
    dataset_shape: tuple[int, ...]

    @property
    def is_whole(self) -> bool:
        """The slot is the whole dataset (not a tensor inside a flat buffer)."""
        return self.base == 0 and self.shape == self.dataset_shape


def strides(shape) -> list[int]:
    """Row-major element strides of ``shape``."""
    out = [1] * len(shape)
    for k in range(len(shape) - 2, -1, -1):
        out[k] = out[k + 1] * int(shape[k + 1])
    return out


def flat_boxes(shape: tuple[int, ...], start: int, stop: int) -> Iterator[tuple[int, tuple[int, ...], tuple[int, ...]]]:
    """Cover the row-major flat range ``[start, stop)`` of ``shape`` by N-d boxes.

    Yields ``(flat_offset_of_box, starts, sizes)`` in increasing flat order; at most
    ``2*ndim - 1`` boxes, each contiguous in the flattening, so memory stays exact.
    """
    if start >= stop:
        return
    if not shape:
        yield start, (), ()
        return
    if len(shape) == 1:
        yield start, (start,), (stop - start,)
        return
    inner = math.prod(shape[1:])
    r0, o0 = divmod(start, inner)
    r1, o1 = divmod(stop, inner)
    if r0 == r1:
        for off, s, z in flat_boxes(shape[1:], o0, o1):
            yield r0 * inner + off, (r0, *s), (1, *z)
        return
    if o0:
        for off, s, z in flat_boxes(shape[1:], o0, inner):
            yield r0 * inner + off, (r0, *s), (1, *z)
        r0 += 1
    if r1 > r0:
        yield r0 * inner, (r0,) + (0,) * (len(shape) - 1), (r1 - r0, *shape[1:])
    if o1:
        for off, s, z in flat_boxes(shape[1:], 0, o1):
            yield r1 * inner + off, (r1, *s), (1, *z)


def _tail(values, nd: int) -> tuple[int, ...]:
    """The last ``nd`` entries (plan boxes pad leading dims) as ints."""
    return tuple(int(x) for x in values[len(values) - nd:])


def slot_box(slot: Slot, start, size) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A plan box (leading dims padded) as (start, size) in the slot's own dims, as ints."""
    nd = len(slot.shape)
    return _tail(start, nd), _tail(size, nd)


def box_view(array: np.ndarray, slot: Slot, start, size) -> np.ndarray:
    """A view (no copy) of box ``start:start+size`` of the slot's tensor inside dataset ``array``:
    basic slicing when the slot is the whole dataset, else a strided view of the flat buffer."""
    nd = len(slot.shape)
    start, size = slot_box(slot, start, size)
    if slot.is_whole:
        return array[tuple(slice(a, a + n) for a, n in zip(start, size))] if nd else array[...]
    flat = array.reshape(-1)
    st = strides(slot.shape)
    offset = slot.base + sum(a * s for a, s in zip(start, st))
    if any(n == 0 for n in size):
        return np.zeros(size, dtype=array.dtype)
    last = offset + sum((n - 1) * s for n, s in zip(size, st))
    if offset < 0 or last >= flat.size:
        raise PlanError(f"box {start}+{size} of {slot.key} falls outside the dataset", code="UCL315")
    return np.lib.stride_tricks.as_strided(flat[offset:], size, [s * flat.itemsize for s in st])


def flat_runs(slot: Slot, start, size) -> list[tuple[int, int, int, int]]:
    """The box as regular runs ``(start, count, stride, block)`` of the dataset's flattening, in
    increasing order: for a flat slot, what one strided HDF5 selection reads."""
    nd = len(slot.shape)
    start, size = slot_box(slot, start, size)
    st = strides(slot.shape)
    if nd == 0:
        return [(slot.base, 1, 1, 1)]
    if 0 in size:
        return []
    # k: the first dim from which the box is contiguous (all later dims full)
    k = nd - 1
    while k > 0 and start[k] == 0 and size[k] == slot.shape[k]:
        k -= 1
    block = size[k] * st[k]
    if k == 0:
        return [(slot.base + start[0] * st[0], 1, block, block)]
    outer = [range(start[j], start[j] + size[j]) for j in range(k - 1)]
    runs = []
    for idx in itertools.product(*outer):
        off = slot.base + sum(i * st[j] for j, i in enumerate(idx)) + start[k - 1] * st[k - 1] + start[k] * st[k]
        runs.append((off, size[k - 1], st[k - 1], block))
    return runs


