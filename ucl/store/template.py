"""A rank file's HDF5 structure, built once and replayed for every checkpoint of the same layout.

Why: a training run writes the same datasets (keys, shapes, dtypes) at every checkpoint, and
creating them through HDF5 (object headers, attributes, groups) cost as much CPU as hashing the data.
A :class:`RankTemplate` lays the file out once with HDF5 (every dataset allocated, never filled, plus
an allocated ``ucl_tables``), keeps every byte of it that is not the data of a large dataset (the
"image": HDF5's metadata, with the small datasets' storage in between), and a checkpoint's rank file
is then that image with the small datasets' bytes put in place, the large ones written at their
offsets (store.direct) and the digest tables at theirs: no HDF5 call per checkpoint. The file is
the one HDF5 would give, less the per-dataset checksum attributes: the digests live in ``ucl_tables``
only, where the manifest's ``tables`` point (docs/format.md).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Sequence

import numpy as np

from .. import dtypes as _dt
from ..errors import StoreError
from . import h5
from .checksum import chunk_count
from .tiles import tile_grid
from .digests import Digests, checksums
from .direct import MIN_DIRECT_BYTES, pwrite_all
from .manifest import FORMAT_NAME, FORMAT_VERSION, TABLES_NAME, split_key


@dataclass(frozen=True)
class TemplateDataset:
    """Where one dataset lives in the template's file. ``offset`` None: no storage (empty);
    ``piece`` >= 0: its bytes are inside image piece ``piece`` at ``at`` (a small dataset),
    -1: written at ``offset`` on its own (a large one). ``table_at``: index of its first digest
    in ``ucl_tables`` (None when it has no table)."""

    key: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    offset: int | None
    piece: int
    at: int
    table_at: int | None
    table_len: int


@dataclass(frozen=True)
class Placed:
    """A dataset written from a template: its checksums, and where its digest table went (byte
    offset in the file; None when it has none)."""

    digests: Digests
    tables: int | None


class RankTemplate:
    """One rank file's layout for a fixed set of datasets (``build``), filled by ``write``."""

    def __init__(self, rank: int, size: int, datasets: dict[str, TemplateDataset],
                 pieces: list[tuple[int, np.ndarray]], tables: TemplateDataset | None, tiles: bool = True):
        self.rank, self.size, self.datasets, self.pieces, self.tables = rank, size, datasets, pieces, tables
        self.tiles = tiles

    @classmethod
    def build(cls, scratch: str, rank: int, datasets: Mapping[str, tuple[Sequence[int], str]], *,
              tiles: bool = True) -> "RankTemplate":
        """Lay out ``datasets`` (key -> (shape, logical dtype)) in the new file ``scratch`` with
        HDF5, read back what the template keeps, and remove the file. ``tiles=False``: the datasets
        carry no tile checksums (flat chunks only)."""
        specs = {k: (tuple(int(x) for x in shape), dtype) for k, (shape, dtype) in datasets.items()}
        table_at, n_table = {}, 0
        for key, (shape, dtype) in specs.items():
            if any(x < 0 for x in shape):
                raise StoreError(f"negative shape {list(shape)} for {key!r}", code="UCL409")
            item = _dt.storage_dtype(dtype).itemsize
            grid = tile_grid(shape, item) if tiles else None
            count = chunk_count(math.prod(shape) * item) + (grid.count if grid is not None else 0)
            if count:
                table_at[key], n_table = (n_table, count), n_table + count
        try:
            f = h5.open_h5(scratch, "w-")
            try:
                f.attrs["ucl_format"], f.attrs["ucl_version"], f.attrs["ucl_rank"] = FORMAT_NAME, FORMAT_VERSION, rank
                offsets = allocate(f, specs)
                tables_offset = h5.create_allocated(f, TABLES_NAME, (n_table,), np.dtype("<u8"))[1] if n_table else None
            finally:
                h5.close_file(f)
            size = os.path.getsize(scratch)
            large = sorted((offsets[k], offsets[k] + _nbytes(*specs[k])) for k in specs
                           if offsets[k] is not None and _nbytes(*specs[k]) >= MIN_DIRECT_BYTES)
            if tables_offset is not None and 8 * n_table >= MIN_DIRECT_BYTES:
                large = sorted(large + [(tables_offset, tables_offset + 8 * n_table)])
            pieces, pos = [], 0
            fd = os.open(scratch, os.O_RDONLY | os.O_CLOEXEC)
            try:
                for lo, hi in large + [(size, size)]:
                    if lo > pos:
                        buf = np.empty(lo - pos, np.uint8)
                        if os.preadv(fd, [buf], pos) != buf.size:
                            raise OSError(f"short read of the template {scratch}")
                        pieces.append((pos, buf))
                    pos = max(pos, hi)
            finally:
                os.close(fd)
        finally:
            if os.path.exists(scratch):
                os.unlink(scratch)

        def place(key: str, offset: int | None, nbytes: int, at_len: tuple[int, int] | None) -> TemplateDataset:
            piece, at = -1, 0
            if offset is not None and nbytes:
                for i, (start, buf) in enumerate(pieces):
                    if start <= offset and offset + nbytes <= start + buf.size:
                        piece, at = i, offset - start
                        break
            t_at, t_len = at_len if at_len is not None else (None, 0)
            shape, dtype = specs[key] if key in specs else ((nbytes // 8,), "uint64")
            return TemplateDataset(key, shape, dtype, nbytes, offset, piece, at, t_at, t_len)

        placed = {k: place(k, offsets[k], _nbytes(*specs[k]), table_at.get(k)) for k in specs}
        tables = place(TABLES_NAME, tables_offset, 8 * n_table, None) if n_table else None
        return cls(rank, size, placed, pieces, tables, tiles)

    def write(self, path: str, arrays: Mapping[str, np.ndarray], write_large,
              digests: Mapping[str, Digests] | None = None) -> dict[str, Placed]:
        """Create rank file ``path`` (it must not exist) from the template and ``arrays`` (key ->
        C-contiguous storage array, every dataset of the template, see ``check``). Large datasets
        go to ``write_large(path, offset, raw)`` (hashing overlaps a write still in flight).
        ``digests``: checksums of some arrays already computed (``checksums(arrays[key])``), not
        hashed again. The small datasets' bytes are staged in the template's own image, so one
        template serves one writer at a time."""
        known = digests or {}
        fd = self.begin(path)
        try:
            found: dict[str, Digests] = {}
            for key in self.datasets:
                arr = arrays[key]
                self.put(path, key, 0, arr.reshape(-1).view(np.uint8), write_large)
                found[key] = known.get(key) or checksums(arr, tiles=self.tiles)
            return self.finish(fd, path, found, write_large)
        finally:
            os.close(fd)

    def stream(self, path: str, pieces: Iterable[tuple[str, int, np.ndarray]],
               digests: Callable[[], Mapping[str, Digests]], write_large) -> dict[str, Placed]:
        """Create rank file ``path`` as ``write`` does, from ``pieces``: (key, byte offset in the
        dataset, flat uint8 bytes), each ``put`` before the next is drawn. ``digests()``, called after
        the last piece, gives every dataset's checksums; each dataset must have got all its bytes
        (UCL409 otherwise)."""
        fd = self.begin(path)
        try:
            got = dict.fromkeys(self.datasets, 0)
            for key, start, raw in pieces:
                self.put(path, key, start, raw, write_large)
                got[key] += raw.size
            found = digests()
            short = [k for k, t in self.datasets.items() if got[k] != t.nbytes or k not in found]
            if short:
                raise StoreError(f"rank {self.rank}: {len(short)} datasets were not streamed whole (e.g. "
                                 f"{short[0]!r}: {got[short[0]]} of {self.datasets[short[0]].nbytes} bytes)",
                                 code="UCL409")
            return self.finish(fd, path, found, write_large)
        finally:
            os.close(fd)

    def begin(self, path: str) -> int:
        """Create rank file ``path`` (it must not exist) at its full size; its open descriptor, for
        ``finish`` (the caller closes it). Between the two, ``put`` each dataset's bytes."""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
        try:
            os.ftruncate(fd, self.size)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def put(self, path: str, key: str, start: int, raw: np.ndarray, write_large) -> None:
        """Bytes ``raw`` of dataset ``key`` from byte ``start`` of it: a small dataset's into the
        image, a large one's to ``write_large(path, offset, raw)``."""
        t = self.datasets[key]
        if start < 0 or start + raw.size > t.nbytes:
            raise StoreError(f"rank {self.rank} dataset {key!r}: bytes {start}..{start + raw.size} are outside "
                             f"its {t.nbytes}", code="UCL409")
        if t.offset is None or not raw.size:
            return
        if t.piece >= 0:
            self.pieces[t.piece][1][t.at + start:t.at + start + raw.size] = raw
        else:
            write_large(path, t.offset + start, raw)

    def finish(self, fd: int, path: str, digests: Mapping[str, Digests], write_large) -> dict[str, Placed]:
        """The digest tables of ``digests`` (one per dataset) and the image, into the file ``begin``
        made: after this the file is complete."""
        table = np.zeros(self.tables.nbytes // 8 if self.tables is not None else 0, "<u8")
        placed: dict[str, Placed] = {}
        for key, t in self.datasets.items():
            d = digests[key]
            values, at = d.table(), None
            if (0 if values is None else values.size) != t.table_len:
                raise StoreError(f"rank {self.rank} dataset {key!r}: its checksums have "
                                 f"{0 if values is None else values.size} table values, the template "
                                 f"{'with' if self.tiles else 'without'} tiles lays out {t.table_len}",
                                 code="UCL409")
            if t.table_at is not None:
                table[t.table_at:t.table_at + t.table_len] = values
                at = self.tables.offset + 8 * t.table_at
            placed[key] = Placed(d, at)
        if self.tables is not None:
            if self.tables.piece >= 0:
                self.pieces[self.tables.piece][1][self.tables.at:self.tables.at + table.nbytes] = table.view(np.uint8)
            else:
                write_large(path, self.tables.offset, table.view(np.uint8))
        for start, buf in self.pieces:
            pwrite_all(fd, buf, start)
        return placed

    def check(self, arrays: Mapping[str, np.ndarray]) -> None:
        """Every dataset of the template, each of its shape and storage dtype (UCL409 otherwise)."""
        if set(arrays) != set(self.datasets):
            missing, extra = sorted(set(self.datasets) - set(arrays)), sorted(set(arrays) - set(self.datasets))
            raise StoreError(f"rank {self.rank}: the arrays do not match the template's datasets (missing "
                             f"{missing[:5]}, not in it {extra[:5]})", code="UCL409")
        for key, t in self.datasets.items():
            a = arrays[key]
            if tuple(a.shape) != t.shape or a.dtype != _dt.storage_dtype(t.dtype) or not a.flags.c_contiguous:
                raise StoreError(f"rank {self.rank} dataset {key!r}: the template has {t.dtype} {list(t.shape)}, "
                                 f"the array is {a.dtype} {list(a.shape)}", code="UCL409")


def allocate(f, datasets: Mapping[str, tuple[tuple[int, ...], str]]) -> dict[str, int | None]:
    """Create ``datasets`` (key -> (shape, logical dtype)) in the open HDF5 file ``f``, storage
    allocated now and never filled by HDF5, each with its ``ucl_dtype``; returns their byte
    offsets (None: empty, no storage)."""
    offsets: dict[str, int | None] = {}
    groups: dict = {}
    for key, (shape, dtype) in datasets.items():
        kind, name = split_key(key)
        group = groups.get(kind) or groups.setdefault(kind, f.require_group(kind))
        store = _dt.storage_dtype(dtype)
        if math.prod(shape):
            d, offsets[key] = h5.create_allocated(group, name, shape, store)
        else:
            d, offsets[key] = h5.create_dataset(group, name, shape, store), None
        h5.set_text_attrs(d, ucl_dtype=dtype)
    return offsets


def _nbytes(shape: tuple[int, ...], dtype: str) -> int:
    return math.prod(shape) * _dt.storage_dtype(dtype).itemsize
