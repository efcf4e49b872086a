"""Executors: run a Plan. ``execute_memory`` works on dicts of numpy arrays (rank -> key -> array)."""
from __future__ import annotations

from typing import Mapping

import numpy as np

from .errors import PlanError
from .lower import Slot
from .store.dtypes import storage_dtype  # bf16/fp8 as raw bits: the one table of storage types


def box_view(array: np.ndarray, slot: Slot, start, size) -> np.ndarray:
    """A view (no copy) of box ``start:start+size`` of the slot's tensor inside dataset ``array``:
    basic slicing when the slot is the whole dataset, else a strided view of the flat buffer."""
    nd = len(slot.shape)
    start, size = tuple(int(x) for x in start[len(start) - nd:]), tuple(int(x) for x in size[len(size) - nd:])
    if slot.base == 0 and slot.shape == slot.dataset_shape:
        return array[tuple(slice(a, a + n) for a, n in zip(start, size))] if nd else array[...]
    flat = array.reshape(-1)
    strides = [1] * nd
    for k in range(nd - 2, -1, -1):
        strides[k] = strides[k + 1] * slot.shape[k + 1]
    offset = slot.base + sum(a * s for a, s in zip(start, strides))
    if any(n == 0 for n in size):
        return np.zeros(size, dtype=array.dtype)
    last = offset + sum((n - 1) * s for n, s in zip(size, strides))
    if offset < 0 or last >= flat.size:
        raise PlanError(f"box {start}+{size} of {slot.key} falls outside the dataset", code="UCL315")
    return np.lib.stride_tricks.as_strided(flat[offset:], size, [s * flat.itemsize for s in strides])


def flat_runs(slot: Slot, start, size) -> list[tuple[int, int, int, int]]:
    """The box as regular runs ``(start, count, stride, block)`` of the dataset's flattening, in
    increasing order: for a flat slot, what one strided HDF5 selection reads."""
    nd = len(slot.shape)
    start, size = [int(x) for x in start[len(start) - nd:]], [int(x) for x in size[len(size) - nd:]]
    strides = [1] * nd
    for k in range(nd - 2, -1, -1):
        strides[k] = strides[k + 1] * slot.shape[k + 1]
    if nd == 0:
        return [(slot.base, 1, 1, 1)]
    if 0 in size:
        return []
    # k: the first dim from which the box is contiguous (all later dims full)
    k = nd - 1
    while k > 0 and start[k] == 0 and size[k] == slot.shape[k]:
        k -= 1
    block = size[k] * strides[k]
    if k == 0:
        return [(slot.base + start[0] * strides[0], 1, block, block)]
    outer = [range(start[j], start[j] + size[j]) for j in range(k - 1)]
    runs = []
    import itertools
    for idx in itertools.product(*outer):
        off = slot.base + sum(i * strides[j] for j, i in enumerate(idx)) + start[k - 1] * strides[k - 1] + start[k] * strides[k]
        runs.append((off, size[k - 1], strides[k - 1], block))
    return runs


def read_box(array: np.ndarray, slot: Slot, start, size) -> np.ndarray:
    return box_view(array, slot, start, size)


def write_box(array: np.ndarray, slot: Slot, start, size, values) -> None:
    box_view(array, slot, start, size)[...] = values


def allocate(plan, ranks=None) -> dict[int, dict[str, np.ndarray]]:
    """Zeroed target datasets, per target rank (all ranks, or just ``ranks``)."""
    out: dict[int, dict[str, np.ndarray]] = {}
    want = None if ranks is None else set(int(r) for r in ranks)
    for r, d in zip(plan.dataset_ranks["rank"], plan.dataset_ranks["dataset"]):
        if want is not None and int(r) not in want:
            continue
        ds = plan.datasets[d]
        out.setdefault(int(r), {})[ds["key"]] = np.zeros(ds["shape"], dtype=storage_dtype(ds["dtype"]))
    return out


def execute_memory(plan, src: Mapping[int, Mapping[str, np.ndarray]], ranks=None) -> dict[int, dict[str, np.ndarray]]:
    """Run ``plan`` on in-memory source shards; returns the target shards (optionally only ``ranks``)."""
    dst = allocate(plan, ranks)
    c = plan.copies
    for i in range(len(c["tensor"])):
        r = int(c["dst_rank"][i])
        if r not in dst:
            continue
        s_rank = int(c["src_rank"][i])
        sslot, dslot = plan.slots[c["src_slot"][i]], plan.slots[c["dst_slot"][i]]
        try:
            source = src[s_rank][sslot.key]
        except KeyError:
            raise PlanError(f"source rank {s_rank} has no dataset {sslot.key!r}", code="UCL315") from None
        values = read_box(source, sslot, c["src_start"][i], c["size"][i])
        write_box(dst[r][dslot.key], dslot, c["dst_start"][i], c["size"][i], values)
    # fills are zeros and allocate() already zeroed every dataset
    return dst
