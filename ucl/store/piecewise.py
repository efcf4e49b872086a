"""Datasets preallocated in a rank file (``CheckpointWriter.create``) and written piece by piece
(``write_flat``, ``write_box``), in any order: the HDF5 writes of the pieces, and each dataset's
checksums, kept while its pieces arrive in flat order (a writer reads the dataset back to hash it
otherwise). The writer does the locking, the I/O guard and the manifest entries around it."""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from .. import dtypes as _dt
from ..errors import StoreError
from ..layout.boxes import flat_boxes
from . import h5
from .digests import IncrementalChecksum
from .manifest import split_key


class Piecewise:
    """One writer's preallocated datasets, by (rank, key): each one's running checksums."""

    def __init__(self) -> None:
        self._pending: dict[tuple[int, str], IncrementalChecksum] = {}

    def create(self, f: Any, rank: int, key: str, shape: tuple[int, ...], dtype: str) -> Any:
        """Preallocate dataset ``key`` (logical ``dtype``; unwritten elements read as 0) in the open
        rank file ``f``; the HDF5 dataset."""
        kind, name = split_key(key)
        sdtype = _dt.storage_dtype(dtype)
        d = h5.create_dataset(f.require_group(kind), name, shape, sdtype)
        d.attrs["ucl_dtype"] = dtype
        self._pending[(rank, key)] = IncrementalChecksum(shape, sdtype)
        return d

    def checksum(self, rank: int, key: str) -> IncrementalChecksum:
        """The running checksums of a dataset ``create`` made (UCL411 for any other)."""
        p = self._pending.get((rank, key))
        if p is None:
            raise StoreError(f"rank {rank} dataset {key!r} was not made by create()", code="UCL411")
        return p

    def pending(self) -> list[tuple[tuple[int, str], IncrementalChecksum]]:
        """Every preallocated dataset's running checksums, sorted by (rank, key), to finish."""
        return sorted(self._pending.items())

    def clear(self) -> None:
        """Forget them: they are finished."""
        self._pending.clear()


def storage(data: Any, dtype: str, where: str) -> np.ndarray:
    """``data`` as a storage array of a dataset of logical ``dtype``: raw storage bits taken as they
    are, anything else converted and checked against ``dtype`` (UCL409)."""
    if isinstance(data, np.ndarray) and data.dtype == _dt.storage_dtype(dtype):
        return _dt.contiguous(data)  # raw storage bits
    arr, got = _dt.to_numpy(data)
    if got != dtype:
        raise StoreError(f"{where} is {dtype}, data is {got}", code="UCL409")
    return arr


def write_flat(d: Any, shape: tuple[int, ...], p: IncrementalChecksum, start: int, arr: np.ndarray,
               where: str) -> None:
    """``arr`` (flattened) at row-major flat offset ``start`` of dataset ``d`` (of ``shape``), as
    boxes; ``p`` advances over it."""
    flat = arr.reshape(-1)
    if start < 0 or start + flat.size > math.prod(shape):
        raise StoreError(f"flat range [{start}, {start + flat.size}) out of bounds for {where} of "
                         f"{math.prod(shape)} elements", code="UCL409")
    for off, starts, sizes in flat_boxes(shape, start, start + flat.size):
        n = math.prod(sizes)
        h5.write_box(d, starts, sizes, flat[off - start: off - start + n].reshape(sizes))
    p.advance(start, flat)


def write_box(d: Any, shape: tuple[int, ...], p: IncrementalChecksum, starts: tuple[int, ...],
              arr: np.ndarray, where: str) -> None:
    """``arr`` into the box at ``starts`` (sizes: ``arr.shape``) of dataset ``d``; a box short of the
    whole dataset leaves ``p`` to be finished from the file."""
    h5.check_box(starts, arr.shape, shape, where)
    h5.write_box(d, starts, arr.shape, arr)
    if arr.shape == shape:
        p.advance(0, arr.reshape(-1))
    elif arr.size:
        p.in_order = False
