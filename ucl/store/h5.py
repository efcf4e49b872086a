"""The only module that imports h5py: opening rank files, creating datasets, hyperslab reads and
writes, streamed checksums and the refusal of anything that is not a plain dataset.

Layout (docs/format.md): one file per rank, dataset ``kind/name`` is HDF5 group ``kind``,
dataset ``name``; contiguous, uncompressed, little-endian storage dtype.
"""
from __future__ import annotations

import contextlib
import math
from collections import OrderedDict
from typing import Any, Sequence

import h5py
import numpy as np
import xxhash

from ..errors import StoreError
from ..layout.boxes import flat_boxes
from .checksum import IncrementalChecksum, format_checksum


def box_sel(starts: Sequence[int], sizes: Sequence[int]) -> tuple[slice, ...]:
    return tuple(slice(s, s + z) for s, z in zip(starts, sizes))


def check_box(starts: tuple[int, ...], sizes: tuple[int, ...], shape: tuple[int, ...], where: str) -> None:
    """Raise UCL409 unless the box lies inside ``shape``."""
    if len(starts) != len(shape) or len(sizes) != len(shape) or any(
            s < 0 or z < 0 or s + z > n for s, z, n in zip(starts, sizes, shape)):
        raise StoreError(f"box starts={list(starts)} sizes={list(sizes)} does not fit {where} of shape "
                         f"{list(shape)}", code="UCL409")


def check_out(out: np.ndarray | None, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """``out`` if it is a usable destination (or a new array when None), else raise UCL409."""
    if out is None:
        return np.empty(shape, dtype)
    if out.shape != shape or out.dtype != dtype or not out.flags.c_contiguous or not out.flags.writeable:
        raise StoreError(f"out must be a writable C-contiguous {dtype} array of shape {shape}, got "
                         f"{out.dtype} {out.shape}", code="UCL409")
    return out


CHECKSUM_STREAM_BYTES = 64 << 20  # bound on memory when checksumming a dataset piecewise


def read_box_into(dset: Any, starts: Sequence[int], sizes: Sequence[int], out: np.ndarray) -> None:
    if not sizes:
        out[()] = dset[()]
    elif all(sizes):  # HDF5 may reject empty selections; nothing to read anyway
        dset.read_direct(out, source_sel=box_sel(starts, sizes))


def read_flat_into(dset: Any, shape: tuple[int, ...], start: int, stop: int, out: np.ndarray) -> None:
    for off, starts, sizes in flat_boxes(shape, start, stop):
        n = math.prod(sizes)
        read_box_into(dset, starts, sizes, out[off - start: off - start + n].reshape(sizes))


def checksum_dataset(dset: Any, shape: tuple[int, ...], dtype: np.dtype) -> tuple[str, list[str] | None]:
    """(checksum, chunk checksums) of a dataset, streamed in bounded memory."""
    total = math.prod(shape)
    h = IncrementalChecksum(total * dtype.itemsize)
    step = max(1, CHECKSUM_STREAM_BYTES // dtype.itemsize)
    buf = np.empty(min(step, total), dtype)
    for s in range(0, total, step):
        e = min(total, s + step)
        read_flat_into(dset, shape, s, e, buf[: e - s])
        h.advance(s, buf[: e - s])
    if total == 0:
        return format_checksum(xxhash.xxh3_64_hexdigest(b"")), None
    return h.result(total)


def open_h5(path: str, mode: str) -> Any:
    return h5py.File(path, mode, locking=False)


def create_dataset(group: Any, name: str, shape: tuple[int, ...], dtype: np.dtype,
                    data: np.ndarray | None = None) -> Any:
    # contiguous + uncompressed: readers may compute byte offsets and use read_direct
    if data is not None:
        return group.create_dataset(name, data=data)
    return group.create_dataset(name, shape=shape, dtype=dtype)


class ChunkCache:
    """Verified checksum chunks, least recently used dropped first beyond a byte budget."""

    def __init__(self, budget: int):
        self.budget, self.used = budget, 0
        self.items: OrderedDict[tuple, np.ndarray] = OrderedDict()

    def get(self, key: tuple) -> np.ndarray | None:
        v = self.items.get(key)
        if v is not None:
            self.items.move_to_end(key)
        return v

    def put(self, key: tuple, value: np.ndarray) -> None:
        if value.nbytes > self.budget:
            return
        self.items[key] = value
        self.used += value.nbytes
        while self.used > self.budget:
            self.used -= self.items.popitem(last=False)[1].nbytes


class Handles:
    """LRU of open h5py files, one per rank, with their opened datasets."""

    def __init__(self, opener: Any, max_open: int):
        self._opener, self._max = opener, max(1, max_open)
        self._open: OrderedDict[int, tuple[Any, dict[str, Any]]] = OrderedDict()

    def get(self, rank: int) -> tuple[Any, dict[str, Any]]:
        if rank in self._open:
            self._open.move_to_end(rank)
            return self._open[rank]
        while len(self._open) >= self._max:
            self._open.popitem(last=False)[1][0].close()
        entry = (self._opener(rank), {})
        self._open[rank] = entry
        return entry

    def close(self) -> None:
        while self._open:
            with contextlib.suppress(Exception):
                self._open.popitem()[1][0].close()


def get_dataset(f: Any, key: str) -> Any | None:
    """The plain dataset ``key`` of an open file, or None when there is none."""
    d = f.get(key)
    return d if isinstance(d, h5py.Dataset) else None


def read_runs_into(d: Any, runs: Sequence[tuple[int, int, int, int]], out: np.ndarray) -> None:
    """Elements of a 1-D dataset selected by regular runs ``(start, count, stride, block)``, with
    one HDF5 read."""
    fspace = d.id.get_space()
    fspace.select_none()
    for start, count, stride, block in runs:
        fspace.select_hyperslab((start,), (count,), (max(stride, block),), (block,), op=h5py.h5s.SELECT_OR)
    mspace = h5py.h5s.create_simple((out.size,))
    d.id.read(mspace, fspace, out)


def write_box(dset: Any, starts: Sequence[int], sizes: Sequence[int], src: np.ndarray) -> None:
    if not sizes:
        dset[()] = src
    elif all(sizes):
        dset.write_direct(src, dest_sel=box_sel(starts, sizes))


def set_chunk_checksums(d: Any, chunks: tuple[int, np.ndarray] | None) -> None:
    """Per-chunk checksums live beside the data, as attributes (docs/format.md)."""
    if chunks is not None:
        d.attrs["ucl_chunk_bytes"] = np.int64(chunks[0])
        d.attrs["ucl_chunks"] = chunks[1]


def chunk_checksums(d: Any) -> tuple[Any, Any]:
    """(chunk bytes, chunk digests) stored beside a dataset, or (None, None)."""
    return d.attrs.get("ucl_chunk_bytes"), d.attrs.get("ucl_chunks")


def list_datasets(f: Any) -> set[str]:
    return {f"{k}/{n}" for k, g in f.items() if isinstance(g, h5py.Group) for n in g}
