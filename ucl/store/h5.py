"""The only module that imports h5py: opening rank files, creating datasets, hyperslab reads and
writes, streamed checksums and the refusal of anything that is not a plain dataset.

Layout (docs/format.md): one file per rank, dataset ``kind/name`` is HDF5 group ``kind``,
dataset ``name``; contiguous, uncompressed, little-endian storage dtype.
"""
from __future__ import annotations

import contextlib
import errno
import math
import os
import re
from collections import OrderedDict
from functools import lru_cache
from typing import Any, Sequence

import h5py
import numpy as np
import xxhash

from ..errors import StoreError
from ..layout.boxes import flat_boxes
from .checksum import chunk_count, chunk_size, format_checksum
from .tiles import TileGrid, tile_grid
from .digests import Digests, IncrementalChecksum
from .direct import BLOCK, MIN_DIRECT_BYTES


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


def checksum_dataset(dset: Any, shape: tuple[int, ...], dtype: np.dtype) -> Digests:
    """Every checksum of a dataset (whole, chunks, tiles), streamed in bounded memory."""
    total = math.prod(shape)
    h = IncrementalChecksum(shape, dtype)
    step = max(1, CHECKSUM_STREAM_BYTES // dtype.itemsize)
    buf = np.empty(min(step, total), dtype)
    for s in range(0, total, step):
        e = min(total, s + step)
        read_flat_into(dset, shape, s, e, buf[: e - s])
        h.advance(s, buf[: e - s])
    if total == 0:
        return Digests(format_checksum(xxhash.xxh3_64_hexdigest(b"")))
    return h.result(total)


# Files written without HDF5's sieve buffer: raw data reaches the file inside the write call, so a full
# disk fails that call (an OSError, UCL410) rather than a later dataset close in a destructor, where
# h5py can only print "Exception ignored" and HDF5 is left in a state that may crash the next call.
_UNBUFFERED = "ucl-unbuffered"
h5py.register_driver(_UNBUFFERED, lambda plist: plist.set_sieve_buf_size(0))


def open_h5(path: str, mode: str) -> Any:
    if mode == "r":
        return h5py.File(path, mode, locking=False)
    # large datasets start on a block boundary, so their bytes can be written directly (store.direct)
    return h5py.File(path, mode, locking=False, driver=_UNBUFFERED, alignment_threshold=MIN_DIRECT_BYTES,
                     alignment_interval=BLOCK)


def _as_oserror(e: Exception, what: str) -> OSError:
    """h5py reports a failed flush or close as RuntimeError; the writer's I/O errors are OSErrors."""
    m = re.search(r"errno = (\d+)", str(e))
    code = int(m.group(1)) if m else errno.EIO
    return OSError(code, f"{os.strerror(code)}: {what}: {e}")


def close_file(f: Any) -> None:
    """Flush and close a file written to. HDF5 writes its metadata now, so a full disk shows up here,
    as an OSError; the file is then still open, for ``Handles.discard``."""
    name = "a rank file"
    try:
        if f.id.valid:
            name = f.filename
            f.flush()
            f.close()
    except RuntimeError as e:
        raise _as_oserror(e, f"closing {name}") from e


# HDF5 objects of files whose close failed even after ``Handles.discard`` truncated them. HDF5 keeps
# such an object open, and h5py would retry the close -- and print "Exception ignored" -- whenever its
# last Python handle dies; an extra, locked handle kept here means that never happens.
_ABANDONED: list[Any] = []


def _abandon(f: Any) -> None:
    with contextlib.suppress(Exception):
        for oid in h5py.h5f.get_obj_ids(f.id, h5py.h5f.OBJ_ALL):  # each holds a reference of its own
            oid.locked = True
            _ABANDONED.append(oid)


def create_dataset(group: Any, name: str, shape: tuple[int, ...], dtype: np.dtype,
                    data: np.ndarray | None = None) -> Any:
    # contiguous + uncompressed: readers may compute byte offsets and use read_direct
    if data is not None:
        return group.create_dataset(name, data=data)
    return group.create_dataset(name, shape=shape, dtype=dtype)


# The property list, types and scalar space every lay-out reuses (HDF5 copies what it keeps): made
# once per process, not once per dataset (about a fifth of the HDF5 time of a reshard's lay-out)
@lru_cache(maxsize=1)
def _early_dcpl() -> Any:
    dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
    dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
    dcpl.set_obj_track_times(False)  # as h5py's create_dataset: equal content gives equal files
    return dcpl


@lru_cache(maxsize=64)
def _type_of(dtype: np.dtype) -> Any:
    return h5py.h5t.py_create(dtype)


@lru_cache(maxsize=1)
def _scalar_space() -> Any:
    return h5py.h5s.create(h5py.h5s.SCALAR)


def _space(shape: tuple[int, ...]) -> Any:
    return h5py.h5s.create_simple(shape) if shape else _scalar_space()


def create_allocated(group: Any, name: str, shape: tuple[int, ...], dtype: np.dtype) -> tuple[Any, int]:
    """A contiguous dataset whose storage HDF5 allocates now and never fills, and the byte offset of
    that storage in the file: its data is written there by the caller (store.direct), not by HDF5."""
    dsid = h5py.h5d.create(group.id, name.encode(), _type_of(np.dtype(dtype)), _space(tuple(shape)),
                           dcpl=_early_dcpl())
    return h5py.Dataset(dsid), int(dsid.get_offset())


def group_of(f: Any, opened: dict, kind: str) -> Any:
    """Group ``kind`` of the open file ``f`` (made if missing), kept in ``opened``, the dict
    ``Handles.get`` gives with the file: one lookup per file, not one per dataset."""
    g = opened.get((_GROUP, kind))
    if g is None:
        g = opened[(_GROUP, kind)] = f.require_group(kind)
    return g


_GROUP = "ucl:group"  # (a tuple key: never a dataset key)


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

    def shrink(self, budget: int) -> None:
        """Hold at most ``budget`` bytes from now on (the oldest dropped now where it holds more)."""
        self.budget = min(self.budget, max(0, int(budget)))
        while self.used > self.budget:
            self.used -= self.items.popitem(last=False)[1].nbytes

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
            close_file(next(iter(self._open.values()))[0])  # a failure keeps it here for discard()
            self._open.popitem(last=False)
        entry = (self._opener(rank), {})
        self._open[rank] = entry
        return entry

    def release(self, rank: int) -> None:
        """Close ``rank``'s file now if it is open (a failure raises, as an OSError)."""
        entry = self._open.get(rank)
        if entry is not None:
            close_file(entry[0])
            del self._open[rank]

    def close(self, strict: bool = False) -> None:
        """Close every file; ``strict`` (a writer committing) raises the first failure as an OSError and
        keeps the files not yet closed for ``discard()``."""
        while self._open:
            rank = next(reversed(self._open))
            if strict:
                close_file(self._open[rank][0])
            else:
                with contextlib.suppress(Exception):
                    self._open[rank][0].close()
            del self._open[rank]

    def discard(self) -> None:
        """Close files being thrown away (a failed write), without a word on stderr. Each is first
        truncated: that gives its blocks back even if the close fails, and on a full disk leaves room
        for the metadata HDF5 writes while closing. A file that still cannot be closed is abandoned."""
        files = [f for f, _ in self._open.values()]
        self._open.clear()
        for f in files:
            with contextlib.suppress(Exception):
                if f.id.valid:
                    os.truncate(f.filename, 0)
        for f in files:
            try:
                if f.id.valid:
                    f.close()
            except Exception:
                _abandon(f)


def _refusal(where: str, why: str) -> StoreError:
    return StoreError(f"{where} is {why}; ucl reads only plain datasets stored in the rank file itself",
                      code="UCL416")


def _link_problem(gid: Any, name: bytes) -> str:
    """What a link that is not a hard link is, for the error message."""
    kind = gid.links.get_info(name).type
    try:
        target = gid.links.get_val(name)
    except Exception:  # a dangling or malformed link: its kind is enough
        target = None
    if kind == h5py.h5l.TYPE_EXTERNAL:
        return "an external link" + (f" to {target[0].decode(errors='replace')}:{target[1].decode(errors='replace')}"
                                     if isinstance(target, tuple) else "")
    if kind == h5py.h5l.TYPE_SOFT:
        return "a soft link" + (f" to {target.decode(errors='replace')}" if isinstance(target, bytes) else "")
    return f"a link of HDF5 type {kind}"


def plain_dataset(f: Any, key: str, where: str) -> Any | None:
    """The dataset ``kind/name`` of an open rank file, or None when there is none. Anything but a
    plain dataset stored in this very file is refused with UCL416 naming ``where``: soft, external
    or extra hard links (on the dataset or its group), virtual datasets, external raw storage,
    chunked or filtered layouts (compression is a decompression bomb waiting to happen), and
    storage that lies beyond the end of the file. Reads metadata only, through the low-level API
    (no link is ever followed but hard ones)."""
    kind, _, name = key.partition("/")
    oid, info = f.id, None
    for part in (kind.encode(), name.encode()):
        if info is not None and info.type != h5py.h5o.TYPE_GROUP:
            return None
        if not oid.links.exists(part):
            return None
        if oid.links.get_info(part).type != h5py.h5l.TYPE_HARD:
            raise _refusal(where, _link_problem(oid, part))
        oid = h5py.h5o.open(oid, part)
        info = h5py.h5o.get_info(oid)
        if info.rc != 1:  # another name aliases the same object
            raise _refusal(where, f"reached through one of {info.rc} hard links to one object")
    if info.type != h5py.h5o.TYPE_DATASET:
        return None
    plist = oid.get_create_plist()
    layout = plist.get_layout()
    if layout == h5py.h5d.VIRTUAL:
        raise _refusal(where, "a virtual dataset (its bytes live in other files)")
    if plist.get_external_count():
        raise _refusal(where, "stored in external files")
    if layout not in (h5py.h5d.CONTIGUOUS, h5py.h5d.COMPACT) or plist.get_nfilters():
        raise _refusal(where, "a chunked or filtered dataset")
    nbytes = oid.get_storage_size()
    if layout == h5py.h5d.CONTIGUOUS and nbytes:
        offset = oid.get_offset()
        if offset is None or offset + nbytes > f.id.get_filesize():
            raise _refusal(where, "a dataset whose storage lies beyond the end of the file (truncated)")
    return h5py.Dataset(oid)


def storage_bytes(d: Any) -> int:
    """Bytes of data storage the dataset really has in its file."""
    return int(d.id.get_storage_size())


_ABSENT = object()


def _int_attr(dsid: Any, name: bytes, dims: tuple[int, ...], unsigned: bool) -> Any:
    """Integer attribute ``name`` of exactly ``dims``, read as int64 (``unsigned``: must be stored
    as uint64, read as such); ``_ABSENT`` when there is none, None when it has another shape or
    type. Low-level calls with an explicit memory type: h5py's conveniences cost more than the read."""
    if not h5py.h5a.exists(dsid, name):
        return _ABSENT
    a = h5py.h5a.open(dsid, name)
    ty = a.get_type()
    if ty.get_class() != h5py.h5t.INTEGER or ty.get_size() > 8 or a.get_space().get_simple_extent_dims() != dims:
        return None
    if unsigned and (ty.get_size() != 8 or ty.get_sign() != h5py.h5t.SGN_NONE):
        return None
    out = np.empty(dims, np.uint64 if unsigned else np.int64)
    a.read(out, mtype=h5py.h5t.NATIVE_UINT64 if unsigned else h5py.h5t.NATIVE_INT64)
    return out


def chunk_table(d: Any, nbytes: int, where: str) -> tuple[int, np.ndarray] | None:
    """The validated (chunk bytes, chunk digests) stored beside a dataset of ``nbytes``; None when
    it has none. Sizes and types are checked before anything is read: the chunk size must be the
    one the writer uses for ``nbytes`` and the table one uint64 per chunk (UCL406 otherwise)."""
    want, count = chunk_size(nbytes), chunk_count(nbytes)
    size = _int_attr(d.id, b"ucl_chunk_bytes", (), False)
    table = _int_attr(d.id, b"ucl_chunks", (count,), True)
    if size is _ABSENT and table is _ABSENT:
        return None
    if want is None or size is _ABSENT or size is None or int(size) != want or table is _ABSENT or table is None:
        got = "?" if size is _ABSENT or size is None else int(size)
        raise StoreError(f"{where} has chunk checksum attributes that do not fit a dataset of {nbytes} bytes "
                         f"(chunk size {got}; expected chunk size {want} and {count} uint64 digests)", code="UCL406")
    return want, table

class H5Dataset:
    """A dataset read through HDF5, with the reading interface of ``raw.RawDataset``: for datasets
    whose manifest entry records no byte offset (written by ucl before offsets existed)."""

    def __init__(self, d: Any, shape: tuple[int, ...]):
        self.d, self.shape = d, shape

    def read_flat_into(self, start: int, stop: int, out: np.ndarray) -> None:
        read_flat_into(self.d, self.shape, start, stop, out)

    def read_rows_into(self, rows: tuple[int, int], cols: tuple[int, int], out: np.ndarray,
                       at: tuple[int, int]) -> None:
        read_rows_into(self.d, self.shape, rows, cols, out, at)

    def read_box_into(self, starts: Sequence[int], sizes: Sequence[int], out: np.ndarray) -> None:
        read_box_into(self.d, starts, sizes, out)

    def read_runs_into(self, runs: Sequence[tuple[int, int, int, int]], out: np.ndarray) -> None:
        if len(self.shape) == 1:
            read_runs_into(self.d, runs, out)
            return
        # HDF5 selects runs of 1-D datasets only (flat buffers); an N-d one is read whole, then cut
        flat = np.empty(math.prod(self.shape), out.dtype)
        self.read_flat_into(0, flat.size, flat)
        pos = 0
        for s, c, t, b in runs:
            out[pos:pos + c * b].reshape(c, b)[...] = np.lib.stride_tricks.as_strided(
                flat[s:], (c, b), (t * flat.itemsize, flat.itemsize))
            pos += c * b


def data_offset(d: Any) -> int | None:
    """Byte offset of a contiguous dataset's allocated storage in its file; None if it has none."""
    dsid = d.id
    if dsid.get_create_plist().get_layout() != h5py.h5d.CONTIGUOUS or not dsid.get_storage_size():
        return None
    offset = dsid.get_offset()
    return None if offset is None else int(offset)


def create_table(f: Any, name: str, values: np.ndarray) -> int:
    """A contiguous uint64 dataset ``name`` at the top of rank file ``f`` holding ``values``; returns
    the byte offset of its storage."""
    d, offset = create_allocated(f, name, values.shape, np.dtype("<u8"))
    d.id.write(h5py.h5s.ALL, h5py.h5s.ALL, np.ascontiguousarray(values, "<u8"))
    return offset


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


def set_checksum_tables(d: Any, digests: Digests) -> None:
    """Per-chunk and per-tile checksums live beside the data, as attributes (docs/format.md)."""
    if digests.chunks is not None:
        _put_attr(d, b"ucl_chunk_bytes", np.array(digests.chunks[0], np.int64))
        _put_attr(d, b"ucl_chunks", np.ascontiguousarray(digests.chunks[1], np.uint64))
    if digests.tiles is not None:
        grid, table = digests.tiles
        _put_attr(d, b"ucl_tiles", np.ascontiguousarray(table, np.uint64).reshape(grid.nr, grid.nc))


_TEXT = h5py.string_dtype("utf-8")  # what ``d.attrs[name] = "text"`` stores: a variable-length UTF-8 string


def set_text_attrs(d: Any, **values: str) -> None:
    """String attributes, stored as ``d.attrs[name] = value`` stores them, through HDF5's own calls:
    h5py's attribute manager costs about as much again (per dataset written at every checkpoint)."""
    tid, space = _text_type(), _scalar_space()
    for name, value in values.items():
        h5py.h5a.create(d.id, name.encode(), tid, space).write(np.array(value, dtype=_TEXT))


@lru_cache(maxsize=1)
def _text_type() -> Any:
    return h5py.h5t.py_create(_TEXT, logical=True)


def _put_attr(d: Any, name: bytes, value: np.ndarray) -> None:
    # low-level: h5py's d.attrs[...] costs more than HDF5 itself, once per dataset written
    h5py.h5a.create(d.id, name, _type_of(value.dtype), _space(value.shape)).write(value)

def tile_table(d: Any, shape: tuple[int, ...], dtype: np.dtype, where: str) -> tuple[TileGrid, np.ndarray] | None:
    """The validated (grid, tile digests, grid row-major) stored beside a dataset; None when it has
    none. The table must be a uint64 array of exactly the grid the writer's rule gives for the
    dataset's shape and dtype (UCL406 otherwise), checked before it is read."""
    if not h5py.h5a.exists(d.id, b"ucl_tiles"):
        return None
    grid = tile_grid(tuple(shape), np.dtype(dtype).itemsize)
    table = None if grid is None else _int_attr(d.id, b"ucl_tiles", (grid.nr, grid.nc), True)
    if table is None:
        raise StoreError(f"{where} has tile checksum attributes that do not fit a dataset of shape {list(shape)} "
                         f"(expected {'none' if grid is None else f'a {grid.nr} x {grid.nc} uint64 table'})",
                         code="UCL406")
    return grid, table.reshape(-1)

def read_rows_into(d: Any, shape: tuple[int, ...], rows: tuple[int, int], cols: tuple[int, int],
                   out: np.ndarray, at: tuple[int, int]) -> None:
    """Rows ``rows`` x columns ``cols`` of an N-d dataset seen as (leading dims collapsed) x (last
    dim), into the 2-D C-contiguous ``out`` at row, column ``at``, with one HDF5 read."""
    (r0, r1), (c0, c1) = rows, cols
    if r1 <= r0 or c1 <= c0:
        return
    fspace = d.id.get_space()
    fspace.select_none()
    for _, starts, sizes in flat_boxes(tuple(shape[:-1]), r0, r1):
        fspace.select_hyperslab(tuple(starts) + (c0,), tuple(sizes) + (c1 - c0,), op=h5py.h5s.SELECT_OR)
    mspace = h5py.h5s.create_simple(out.shape)
    mspace.select_hyperslab(tuple(at), (r1 - r0, c1 - c0))
    d.id.read(mspace, fspace, out)


def list_entries(f: Any) -> set[str]:
    """Every ``kind/name`` (and bare top-level name) in a rank file, links listed, not followed."""
    out = set()
    for k in f.keys():
        link = f.get(k, getlink=True)
        if isinstance(link, h5py.HardLink) and isinstance(f[k], h5py.Group):
            out.update(f"{k}/{n}" for n in f[k].keys())
        else:
            out.add(k)
    return out
