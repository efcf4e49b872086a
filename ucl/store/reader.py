"""Reading a committed checkpoint: whole datasets, boxes, flat ranges and strided runs, each
verified against the manifest's checksums where asked. h5py is reached only through ``h5``."""
from __future__ import annotations

import contextlib
import os
from dataclasses import replace
import stat
import threading
from collections import OrderedDict
from typing import Any, Iterator, Sequence

import numpy as np

from .. import dtypes as _dt
from ..errors import StoreError
from ..files import check_inside, read_bounded
from ..plan.buffers import Arena
from . import h5
from .atomic import is_tmp_name
from . import raw
from .checksum import checksum_of, chunk_count, chunk_size, chunk_table_digest, tile_table_digest
from .tiles import TileGrid, tile_grid
from .digests import Digests, checksums
from .codec import units_of
from .like import ManifestBacked
from .manifest import MANIFEST_NAME, TABLES_NAME, DatasetInfo, Manifest
from .packed import PackedDataset, ReadCount, open_packed
from .raw import RawFile
from .verified import Verifiable, VerifiedRuns

MAX_MANIFEST_BYTES = 1 << 30  # ~16k ranks of a large model's datasets; a bigger manifest is hostile
_MANIFESTS: OrderedDict[tuple, Manifest] = OrderedDict()  # parsed manifests by file identity
_MAX_MANIFESTS = 8


def _manifest_of(path: str, mpath: str) -> Manifest:
    """The parsed manifest of checkpoint ``path``. A committed checkpoint never changes, so a
    manifest file with the same identity (device, inode, size, mtime) as one parsed before is not
    parsed again: repeated ``load_rank`` calls skip the JSON. Readers must not modify it."""
    error = lambda msg: StoreError(msg, code="UCL401")  # noqa: E731
    check_inside(mpath, path, "manifest", error)  # checked here, once, for cached and fresh reads alike
    try:
        st = os.stat(mpath)
    except OSError as e:
        raise error(f"cannot read manifest {mpath}: {e.strerror or e}") from None
    key = (os.path.realpath(mpath), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    manifest = _MANIFESTS.get(key) if stat.S_ISREG(st.st_mode) else None
    if manifest is None:
        manifest = Manifest.from_json(read_bounded(mpath, limit=MAX_MANIFEST_BYTES, what="manifest", error=error))
        _MANIFESTS[key] = manifest
        while len(_MANIFESTS) > _MAX_MANIFESTS:
            _MANIFESTS.popitem(last=False)
    _MANIFESTS.move_to_end(key)
    return manifest


class Checkpoint(ManifestBacked):
    """Read access to a committed checkpoint directory. Thread-safe; files open lazily."""

    def __init__(self, path: str, manifest: Manifest, max_open_files: int = 128):
        self.path, self.manifest = path, manifest
        self._lock = threading.RLock()
        self._handles = h5.Handles(self._open_rank, max_open_files)
        self._verified = h5.ChunkCache(64 << 20)  # chunks already checked, for verified partial reads
        self.bytes_last_read = 0  # bytes the last read_runs took from disk
        self._runs = VerifiedRuns(self._verified, Arena())  # warm memory for verified partial reads
        self._tables: dict[tuple[int, str, str], Any] = {}  # chunk/tile tables already bound to the manifest
        self._raw_files: dict[int, RawFile] = {}  # rank files opened for reads at manifest offsets
        self._decoded = h5.ChunkCache(32 << 20)  # decoded units of compressed datasets
        self.stored_read = ReadCount()  # stored bytes compressed reads took from disk, in all

    @classmethod
    def open(cls, path: str | os.PathLike[str], *, max_open_files: int = 128) -> "Checkpoint":
        path = os.path.abspath(os.fspath(path))
        if not os.path.isdir(path):
            what = "is not a folder (give the checkpoint folder, the one holding manifest.json)" \
                if os.path.lexists(path) else "does not exist"
            raise StoreError(f"checkpoint {path} {what}", code="UCL404")
        if is_tmp_name(os.path.basename(path)):
            raise StoreError(f"{path} is an uncommitted temp directory, not a checkpoint", code="UCL404")
        mpath = os.path.join(path, MANIFEST_NAME)
        if not os.path.lexists(mpath):
            raise StoreError(f"{path} is not a ucl checkpoint: no {MANIFEST_NAME}", code="UCL401")
        return cls(path, _manifest_of(path, mpath), max_open_files)

    def limit_caches(self, nbytes: int) -> None:
        """Keep at most ``nbytes`` of verified chunks and as many of decoded units for later reads
        (default 64 MiB and 32 MiB): an operation under a ``max_memory`` cap shrinks them to its share."""
        with self._lock:
            self._verified.shrink(nbytes)
            self._decoded.shrink(nbytes)

    def __repr__(self) -> str:
        return f"Checkpoint({self.path!r}, nranks={self.nranks})"

    def close(self) -> None:
        with self._lock:
            self._handles.close()
            for f in self._raw_files.values():
                f.close()
            self._raw_files.clear()

    def keys(self, rank: int) -> list[str]:
        return sorted(self._entries(rank))

    def info(self, rank: int, key: str) -> DatasetInfo:
        e = self._entries(rank).get(key)
        if e is None:
            stored = next((r for r, entries in enumerate(self.manifest.datasets) if key in entries), None)
            hint = "" if stored is None else (
                f"; rank {stored}'s file stores it (a replica is stored once, by the first rank holding it: read it "
                f"there, or load rank {rank}'s tensors with ucl.load_rank)")
            raise StoreError(f"rank {rank} has no dataset {key!r} in {self.path}{hint}", code="UCL408")
        return DatasetInfo.of_entry(e)

    def _entries(self, rank: int) -> dict[str, Any]:
        if not isinstance(rank, (int, np.integer)) or not 0 <= rank < self.nranks:
            raise StoreError(f"no rank {rank} in {self.path} ({self.nranks} ranks)", code="UCL408")
        return self.manifest.datasets[rank]

    def _where(self, rank: int, key: str | None = None) -> str:
        s = f"rank {rank} file {os.path.join(self.path, self.manifest.files[rank])}"
        return s + (f" dataset {key!r}" if key else "")

    def _rank_file(self, rank: int) -> tuple[str, int]:
        """(path, size in bytes) of a rank's file: a regular file resolving inside the checkpoint."""
        p = os.path.join(self.path, self.manifest.files[rank])
        if not os.path.lexists(p):
            raise StoreError(f"{self._where(rank)} is missing", code="UCL404")
        check_inside(p, self.path, f"rank {rank} file", lambda msg: StoreError(msg, code="UCL416"))
        st = os.stat(p)
        if not stat.S_ISREG(st.st_mode):
            raise StoreError(f"{self._where(rank)} is not a regular file", code="UCL416")
        return p, st.st_size

    def check_files(self, ranks: Sequence[int]) -> None:
        """Before anything is allocated for them: each rank's file is a regular file inside the
        checkpoint and at least as large as the bytes the manifest says it holds (UCL406)."""
        for rank in ranks:
            _, size = self._rank_file(rank)
            claimed = sum(self.info(rank, k).file_bytes for k in self._entries(rank))
            if claimed > size:
                raise StoreError(f"{self._where(rank)} is {size:,} bytes but the manifest says it holds "
                                 f"{claimed:,} bytes of data (truncated, or a manifest that lies)", code="UCL406")

    def _open_rank(self, rank: int) -> Any:
        p, _ = self._rank_file(rank)
        try:
            return h5.open_h5(p, "r")
        except (OSError, RuntimeError, ValueError) as e:
            raise StoreError(f"{self._where(rank)} is not a readable HDF5 file (truncated or "
                             f"corrupt): {e}", code="UCL406") from None

    @contextlib.contextmanager
    def _guard(self, rank: int, key: str) -> Iterator[None]:
        # h5py reports damaged files with assorted exception types; name the culprit instead
        try:
            yield
        except StoreError:
            raise
        except (OSError, RuntimeError, KeyError, ValueError) as e:
            raise StoreError(f"{self._where(rank, key)} cannot be read (corrupt): {e}", code="UCL406") from None

    def _dataset(self, rank: int, key: str) -> tuple[Any, DatasetInfo]:
        info = self.info(rank, key)
        f, cache = self._handles.get(rank)
        d = cache.get(key)
        if d is None:
            d = h5.plain_dataset(f, key, self._where(rank, key))
            if d is None:
                raise StoreError(f"{self._where(rank, key)} is listed in the manifest but missing "
                                 "from the file", code="UCL406")
            shape, sdtype = ((info.stored,), np.dtype(np.uint8)) if info.encoding else (info.shape, info.storage_dtype)
            if d.shape != shape or d.dtype != sdtype:
                raise StoreError(f"{self._where(rank, key)} has shape {d.shape} dtype {d.dtype} but the "
                                 f"manifest says {info.shape} {info.dtype} (stored as {sdtype} {shape})",
                                 code="UCL406")
            if h5.storage_bytes(d) < info.file_bytes and info.file_bytes:
                raise StoreError(f"{self._where(rank, key)} stores {h5.storage_bytes(d):,} bytes, not the "
                                 f"{info.file_bytes:,} its shape needs", code="UCL406")
            cache[key] = d
        return d, info

    def _raw_file(self, rank: int) -> RawFile:
        f = self._raw_files.get(rank)
        if f is None:
            p, _ = self._rank_file(rank)  # checked to resolve inside the checkpoint: open what it resolves to
            f = self._raw_files[rank] = RawFile(os.path.realpath(p), self._where(rank))
        return f

    def _located(self, rank: int, key: str) -> tuple[Any, DatasetInfo]:
        """(where to read the dataset's bytes, its entry): straight from the rank file at the offset
        the manifest records (no HDF5 call), else through HDF5 (entries written before offsets)."""
        info = self.info(rank, key)
        if info.encoding is not None:
            return self._packed(rank, key, info), info
        if info.offset is not None:
            return raw.locate(self._raw_file(rank), info.offset, info.shape, info.storage_dtype, info.nbytes), info
        d, info = self._dataset(rank, key)
        return h5.H5Dataset(d, info.shape), info

    def _packed(self, rank: int, key: str, info: DatasetInfo) -> PackedDataset:
        """A compressed dataset's reader (store.packed), its frame table bound to the manifest once."""
        got = self._tables.get((rank, key, "packed"))
        if got is None:
            self._stored_tables(rank, key, info)  # the chunk and tile tables' shapes are checked first
            got = self._tables[(rank, key, "packed")] = open_packed(
                self._raw_file(rank), info, self._tables[(rank, key, "stored")][-2 * units_of(
                    info.shape, info.storage_dtype.itemsize, info.group or 1).count:], self._decoded, (rank, key), self.stored_read,
                self._where(rank, key), self.manifest.version)
        return got

    def read(self, rank: int, key: str, *, verify: bool = True, out: np.ndarray | None = None) -> np.ndarray:
        """The whole dataset as a storage-typed array; checksum verified unless ``verify=False``."""
        with self._lock, self._guard(rank, key):
            src, info = self._located(rank, key)
            out = h5.check_out(out, info.shape, info.storage_dtype)
            if info.size:
                src.read_flat_into(0, info.size, out.reshape(-1))
        if verify:
            got = checksum_of(out)
            if got != info.checksum:
                raise StoreError(f"checksum mismatch in {self._where(rank, key)}: manifest has "
                                 f"{info.checksum}, data hashes to {got}", code="UCL407")
        return out

    def to_torch(self, rank: int, key: str, *, verify: bool = True) -> Any:
        return _dt.to_torch(self.read(rank, key, verify=verify), self.info(rank, key).dtype)

    def read_flat(self, rank: int, key: str, start: int, stop: int, *, out: np.ndarray | None = None) -> np.ndarray:
        """Elements ``[start, stop)`` of the row-major flattening, as a 1-D storage array (no checksum)."""
        with self._lock, self._guard(rank, key):
            src, info = self._located(rank, key)
            if not 0 <= start <= stop <= info.size:
                raise StoreError(f"flat range [{start}, {stop}) out of bounds for {self._where(rank, key)} "
                                 f"of {info.size} elements", code="UCL409")
            out = h5.check_out(out, (stop - start,), info.storage_dtype)
            src.read_flat_into(start, stop, out)
            return out

    def read_box(self, rank: int, key: str, starts: Sequence[int], sizes: Sequence[int], *,
                 out: np.ndarray | None = None) -> np.ndarray:
        """The N-d box ``[starts, starts+sizes)`` read with ``read_direct`` (no checksum)."""
        starts, sizes = tuple(int(s) for s in starts), tuple(int(z) for z in sizes)
        with self._lock, self._guard(rank, key):
            src, info = self._located(rank, key)
            h5.check_box(starts, sizes, info.shape, self._where(rank, key))
            out = h5.check_out(out, sizes, info.storage_dtype)
            src.read_box_into(starts, sizes, out)
            return out

    def read_runs(self, rank: int, key: str, runs: Sequence[tuple[int, int, int, int]], *,
                  out: np.ndarray | None = None, verify: bool = False) -> np.ndarray:
        """Elements of the row-major flattening selected by regular runs ``(start, count, stride,
        block)`` (``count`` blocks of ``block`` elements, ``stride`` apart), in increasing order and
        non-overlapping, as one 1-D array read with a single HDF5 call (no checksum)."""
        with self._lock, self._guard(rank, key):
            src, info = self._located(rank, key)
            total = sum(c * b for _, c, _, b in runs)
            out = h5.check_out(out, (total,), info.storage_dtype)
            if total == 0:
                return out
            size = info.size
            for start, count, stride, block in runs:
                if start < 0 or start + (count - 1) * stride + block > size:
                    raise StoreError(f"run ({start}, {count}, {stride}, {block}) out of bounds for "
                                     f"{self._where(rank, key)} of {size} elements", code="UCL409")
            if verify:
                ds = Verifiable(src, info, self._where(rank, key), (rank, key),
                                lambda: self._bound_chunk_table(rank, key, info),
                                lambda: self._bound_tile_table(rank, key, info))
                self.bytes_last_read = self._runs.read(ds, runs, out)
                return out
            self.bytes_last_read = out.nbytes
            src.read_runs_into(runs, out)
            return out

    def digests(self, rank: int, key: str) -> Digests | None:
        """The dataset's checksums as its manifest entry binds them (the whole checksum, the chunk
        table, the tile table where the entry records one), for a writer copying the dataset whole
        to reuse once every byte copied was verified against them (docs/format.md, "Digests carried
        over"); None where the entry binds no chunk table (written before ``chunks`` existed)."""
        with self._lock, self._guard(rank, key):
            info = self.info(rank, key)
            if chunk_count(info.nbytes) and info.chunks is None:
                return None
            chunks = self._bound_chunk_table(rank, key, info)
            tiles = self._bound_tile_table(rank, key, info)
            return Digests(info.checksum, None if chunks is None else (int(chunks[0]), np.asarray(chunks[1], np.uint64)),
                           None if tiles is None else (tiles[0], np.asarray(tiles[1], np.uint64)))

    def _stored_tables(self, rank: int, key: str, info: DatasetInfo) -> tuple[Any, Any]:
        """(chunk table, tile table) as the rank file stores them, validated against the writer's rules
        (UCL406), not yet bound to the manifest: read at the entry's ``tables`` offset when it has one,
        else from the dataset's HDF5 attributes (a table the entry records no digest of is not read)."""
        nchunks, grid = chunk_count(info.nbytes), tile_grid(info.shape, info.storage_dtype.itemsize)
        where = self._where(rank, key)
        if info.tables is None and info.offset is not None and not nchunks and info.tiles is None:
            return None, None  # verified whole: no table to find
        if info.tables is None:
            d, _ = self._dataset(rank, key)
            return h5.chunk_table(d, info.nbytes, where), \
                h5.tile_table(d, info.shape, info.storage_dtype, where) if info.tiles is not None else None
        if info.tiles is not None and grid is None:
            raise StoreError(f"{where}: the manifest records tile checksums for a dataset of shape "
                             f"{list(info.shape)}, which has none", code="UCL406")
        if nchunks and info.chunks is None:
            raise StoreError(f"{where}: the manifest locates chunk checksums but records no digest of them",
                             code="UCL406")
        ntiles = grid.nr * grid.nc if info.tiles is not None else 0
        nframes = 2 * units_of(info.shape, info.storage_dtype.itemsize, info.group or 1).count if info.encoding else 0
        values = self._tables.get((rank, key, "stored"))
        if values is None:  # every table at once: chunks, tiles (and a compressed dataset's frames) together
            values = self._tables[(rank, key, "stored")] = raw.read_table(self._raw_file(rank), info.tables,
                                                                          nchunks + ntiles + nframes)
        return (chunk_size(info.nbytes), values[:nchunks]) if nchunks else None, \
            (grid, values[nchunks:nchunks + ntiles]) if ntiles else None

    def _bound_chunk_table(self, rank: int, key: str, info: DatasetInfo) -> tuple[int, Any] | None:
        """The chunk table of a dataset, trusted only once bound to the manifest: its digest must
        equal the entry's ``chunks`` (a file swapped in from another rank or checkpoint fails
        here, UCL407). Entries written before ``chunks`` existed are bound by hashing the whole
        dataset once against the manifest's checksum. Checked once per dataset and kept."""
        if (rank, key, "chunks") in self._tables:
            return self._tables[(rank, key, "chunks")]
        where = self._where(rank, key)
        table, _ = self._stored_tables(rank, key, info)
        if table is None:
            if chunk_count(info.nbytes):  # the writer always stores a table for such a dataset
                raise StoreError(f"{where} lacks the chunk checksums a dataset of {info.nbytes:,} bytes "
                                 "carries", code="UCL406")
        elif info.chunks is not None:
            if chunk_table_digest(info.checksum, *table) != info.chunks:
                raise StoreError(f"{where}: its chunk checksums do not match the manifest (the file "
                                 "belongs to another rank or checkpoint, or was altered)", code="UCL407")
        else:
            d, _ = self._dataset(rank, key)
            got = h5.checksum_dataset(d, info.shape, info.storage_dtype)
            if got.whole != info.checksum or got.chunks is None or not np.array_equal(got.chunks[1], table[1]):
                raise StoreError(f"checksum mismatch in {where}: manifest has {info.checksum}, data hashes "
                                 f"to {got.whole}", code="UCL407")
        self._tables[(rank, key, "chunks")] = table
        return table

    def _bound_tile_table(self, rank: int, key: str, info: DatasetInfo) -> tuple[TileGrid, Any] | None:
        """The tile table of a dataset whose manifest entry records one (``tiles``), checked against
        that digest (UCL407) after its shape is checked against the writer's rule (UCL406). None
        for entries without ``tiles`` (1-D, small, or written before tiles existed): those are read
        by flat chunks. Checked once per dataset and kept."""
        if (rank, key, "tiles") in self._tables:
            return self._tables[(rank, key, "tiles")]
        table = None
        if info.tiles is not None:
            where = self._where(rank, key)
            _, table = self._stored_tables(rank, key, info)
            if table is None:
                raise StoreError(f"{where} lacks the tile checksums its manifest entry records", code="UCL406")
            grid, digests = table
            if tile_table_digest(info.checksum, (grid.tile_rows, grid.tile_cols), digests) != info.tiles:
                raise StoreError(f"{where}: its tile checksums do not match the manifest (the file belongs "
                                 "to another rank or checkpoint, or was altered)", code="UCL407")
        self._tables[(rank, key, "tiles")] = table
        return table

    def _misplaced(self, rank: int, key: str, d: Any, info: DatasetInfo, chunks, tiles) -> str | None:
        """What is wrong with the entry's ``offset`` and ``tables`` (readers go by them, not by HDF5):
        they must locate the very bytes HDF5 holds for the dataset, and the digest attributes, where
        the dataset has them (they are optional beside ``tables``), must be the same."""
        if info.offset is not None and info.offset != h5.data_offset(d):
            return (f"the manifest places its data at byte {info.offset:,}, HDF5 at "
                    f"{h5.data_offset(d)}")
        if info.tables is not None and (chunks is not None or tiles is not None):
            raw_chunks, raw_tiles = self._stored_tables(rank, key, info)
            if not (_same_table(raw_chunks, chunks) and _same_table(raw_tiles, tiles)):
                return f"the digest tables at byte {info.tables:,} of {TABLES_NAME} differ from its HDF5 attributes"
        return None

    def _packed_digests(self, rank: int, key: str, info: DatasetInfo) -> Any:
        """The checksums of a compressed dataset's decoded bytes, every unit read and decoded afresh
        (no cached unit), each unit's stored digest checked on the way (UCL407)."""
        arr = np.empty(info.shape, info.storage_dtype)
        replace(self._packed(rank, key, info), cache=h5.ChunkCache(0)).read_flat_into(0, info.size, arr.reshape(-1))
        return checksums(arr)

    def verify(self, ranks: Sequence[int] | None = None) -> list[str]:
        """Check files and every dataset checksum; returns a list of problems (empty = sound)."""
        problems: list[str] = []
        for rank in range(self.nranks) if ranks is None else ranks:
            self._entries(rank)  # unknown rank: UCL408, not a "problem"
            try:
                with self._lock:
                    f, _ = self._handles.get(rank)
                    present = h5.list_entries(f)
            except StoreError as e:
                problems.append(str(e))
                continue
            except Exception as e:  # damaged metadata: report, keep going
                problems.append(f"{self._where(rank)} cannot be listed (corrupt): {e}")
                continue
            for key in sorted(present - set(self._entries(rank)) - {TABLES_NAME}):
                problems.append(f"{self._where(rank, key)} is not listed in the manifest")
            for key in self.keys(rank):
                try:
                    with self._lock, self._guard(rank, key):
                        d, info = self._dataset(rank, key)
                        digests = self._packed_digests(rank, key, info) if info.encoding else \
                            h5.checksum_dataset(d, info.shape, info.storage_dtype)
                        stored = h5.chunk_table(d, info.nbytes, self._where(rank, key))
                        stored_tiles = h5.tile_table(d, info.shape, info.storage_dtype, self._where(rank, key))
                        misplaced = self._misplaced(rank, key, d, info, stored, stored_tiles)
                        if not misplaced and info.tables is not None and stored is None and stored_tiles is None:
                            stored, stored_tiles = self._stored_tables(rank, key, info)  # no attributes: the tables
                    if misplaced:
                        problems.append(f"{self._where(rank, key)}: {misplaced}")
                        continue
                    got = digests.whole
                    if got == info.checksum:
                        got = _chunk_problem(stored, digests.chunks, info) or \
                            _tile_problem(stored_tiles, digests.tiles, info) or got
                    if got != info.checksum:
                        problems.append(f"checksum mismatch in {self._where(rank, key)}: manifest has "
                                        f"{info.checksum}, data hashes to {got}")
                except StoreError as e:
                    problems.append(str(e))
        return problems


def _same_table(a, b) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and np.array_equal(a[1], b[1]))


def _chunk_problem(stored, computed, info: DatasetInfo) -> str | None:
    """What is wrong with a dataset's stored chunk table, given the one its bytes hash to and the
    manifest's digest of it; None when nothing is."""
    same = (stored is None and computed is None) or (
        stored is not None and computed is not None and stored[0] == computed[0]
        and np.array_equal(stored[1], computed[1]))
    if not same:
        return "chunk checksums that differ"
    if stored is not None and info.chunks is not None and chunk_table_digest(info.checksum, *stored) != info.chunks:
        return "chunk checksums that the manifest does not record"
    return None


def _tile_problem(stored, computed, info: DatasetInfo) -> str | None:
    """What is wrong with a dataset's stored tile table, given the one its bytes hash to and the
    manifest's digest of it; None when nothing is (also for files written before tiles existed)."""
    if stored is None:
        return None if info.tiles is None else "no tile checksums, though the manifest records them"
    if computed is None or stored[0] != computed[0] or not np.array_equal(stored[1], computed[1]):
        return "tile checksums that differ"
    if info.tiles is None or tile_table_digest(
            info.checksum, (stored[0].tile_rows, stored[0].tile_cols), stored[1]) != info.tiles:
        return "tile checksums that the manifest does not record"
    return None
