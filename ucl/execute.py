"""Executors: run a Plan. ``execute_memory`` works on dicts of numpy arrays (rank -> key -> array)."""
from __future__ import annotations

from typing import Mapping

import numpy as np

from .errors import PlanError
from .lower import Slot

STORAGE = {"bfloat16": np.uint16, "float8_e4m3fn": np.uint8, "float8_e5m2": np.uint8}


def storage_dtype(logical: str) -> np.dtype:
    """numpy dtype that stores a logical dtype bit-exactly (bf16/fp8 as raw bits)."""
    return np.dtype(STORAGE.get(logical, logical))


def box_index(slot: Slot, start, size) -> tuple | np.ndarray:
    """Index into a dataset array selecting box ``start:start+size`` of the slot's tensor.
    A basic slice when the slot is the whole dataset, else flat positions (row-major)."""
    nd = len(slot.shape)
    start, size = tuple(int(x) for x in start[len(start) - nd:]), tuple(int(x) for x in size[len(size) - nd:])
    if slot.base == 0 and slot.shape == slot.dataset_shape:
        return tuple(slice(a, a + n) for a, n in zip(start, size))
    grids = np.meshgrid(*[np.arange(a, a + n) for a, n in zip(start, size)], indexing="ij")
    flat = np.ravel_multi_index(grids, slot.shape) if nd else np.zeros((), dtype=np.int64)
    return slot.base + flat


def read_box(array: np.ndarray, slot: Slot, start, size) -> np.ndarray:
    idx = box_index(slot, start, size)
    return array[idx] if isinstance(idx, tuple) else array.reshape(-1)[idx]


def write_box(array: np.ndarray, slot: Slot, start, size, values) -> None:
    idx = box_index(slot, start, size)
    if isinstance(idx, tuple):
        array[idx] = values
    else:
        array.reshape(-1)[idx] = values


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
