"""Reading a committed checkpoint: whole datasets, boxes, flat ranges and strided runs, each
verified against the manifest's checksums where asked. h5py is reached only through ``h5``."""
from __future__ import annotations

import contextlib
import os
import threading
from typing import Any, Iterator, Sequence

import numpy as np
import xxhash

from .. import dtypes as _dt
from ..errors import StoreError
from ..plan.buffers import Arena
from . import h5
from .atomic import is_tmp_name
from .checksum import checksum_of, raw_bytes
from .manifest import MANIFEST_NAME, DatasetInfo, Manifest

class Checkpoint:
    """Read access to a committed checkpoint directory. Thread-safe; files open lazily."""

    def __init__(self, path: str, manifest: Manifest, max_open_files: int = 128):
        self.path, self.manifest = path, manifest
        self._lock = threading.RLock()
        self._handles = h5.Handles(self._open_rank, max_open_files)
        self._verified = h5.ChunkCache(64 << 20)  # chunks already checked, for verified partial reads
        self.bytes_last_read = 0  # bytes the last read_runs took from disk
        self._scratch = Arena()  # warm memory for verified partial reads

    @classmethod
    def open(cls, path: str | os.PathLike[str], *, max_open_files: int = 128) -> "Checkpoint":
        path = os.path.abspath(os.fspath(path))
        if not os.path.isdir(path):
            raise StoreError(f"checkpoint {path} does not exist (or is not a directory)", code="UCL404")
        if is_tmp_name(os.path.basename(path)):
            raise StoreError(f"{path} is an uncommitted temp directory, not a checkpoint", code="UCL404")
        mpath = os.path.join(path, MANIFEST_NAME)
        try:
            with open(mpath, "rb") as f:
                text = f.read()
        except FileNotFoundError:
            raise StoreError(f"{path} is not a ucl checkpoint: no {MANIFEST_NAME}", code="UCL401") from None
        return cls(path, Manifest.from_json(text), max_open_files)

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Checkpoint({self.path!r}, nranks={self.nranks})"

    def close(self) -> None:
        with self._lock:
            self._handles.close()

    @property
    def nranks(self) -> int:
        return self.manifest.nranks

    @property
    def state(self) -> Any:
        return self.manifest.state

    def keys(self, rank: int) -> list[str]:
        return sorted(self._entries(rank))

    def info(self, rank: int, key: str) -> DatasetInfo:
        e = self._entries(rank).get(key)
        if e is None:
            raise StoreError(f"rank {rank} has no dataset {key!r} in {self.path}", code="UCL408")
        return DatasetInfo(e["dtype"], tuple(e["shape"]), e["checksum"])

    def _entries(self, rank: int) -> dict[str, Any]:
        if not isinstance(rank, (int, np.integer)) or not 0 <= rank < self.nranks:
            raise StoreError(f"no rank {rank} in {self.path} ({self.nranks} ranks)", code="UCL408")
        return self.manifest.datasets[rank]

    def _where(self, rank: int, key: str | None = None) -> str:
        s = f"rank {rank} file {os.path.join(self.path, self.manifest.files[rank])}"
        return s + (f" dataset {key!r}" if key else "")

    def _open_rank(self, rank: int) -> Any:
        p = os.path.join(self.path, self.manifest.files[rank])
        if not os.path.isfile(p):
            raise StoreError(f"{self._where(rank)} is missing", code="UCL404")
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
            d = h5.get_dataset(f, key)
            if d is None:
                raise StoreError(f"{self._where(rank, key)} is listed in the manifest but missing "
                                 "from the file", code="UCL406")
            if d.shape != info.shape or d.dtype.newbyteorder("<") != info.storage_dtype.newbyteorder("<"):
                raise StoreError(f"{self._where(rank, key)} has shape {d.shape} dtype {d.dtype} but the "
                                 f"manifest says {info.shape} {info.dtype}", code="UCL406")
            cache[key] = d
        return d, info

    def read(self, rank: int, key: str, *, verify: bool = True, out: np.ndarray | None = None) -> np.ndarray:
        """The whole dataset as a storage-typed array; checksum verified unless ``verify=False``."""
        with self._lock, self._guard(rank, key):
            d, info = self._dataset(rank, key)
            out = h5.check_out(out, info.shape, info.storage_dtype)
            h5.read_box_into(d, (0,) * len(info.shape), info.shape, out)
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
            d, info = self._dataset(rank, key)
            if not 0 <= start <= stop <= info.size:
                raise StoreError(f"flat range [{start}, {stop}) out of bounds for {self._where(rank, key)} "
                                 f"of {info.size} elements", code="UCL409")
            out = h5.check_out(out, (stop - start,), info.storage_dtype)
            h5.read_flat_into(d, info.shape, start, stop, out)
            return out

    def read_box(self, rank: int, key: str, starts: Sequence[int], sizes: Sequence[int], *,
                 out: np.ndarray | None = None) -> np.ndarray:
        """The N-d box ``[starts, starts+sizes)`` read with ``read_direct`` (no checksum)."""
        starts, sizes = tuple(int(s) for s in starts), tuple(int(z) for z in sizes)
        with self._lock, self._guard(rank, key):
            d, info = self._dataset(rank, key)
            h5.check_box(starts, sizes, info.shape, self._where(rank, key))
            out = h5.check_out(out, sizes, info.storage_dtype)
            h5.read_box_into(d, starts, sizes, out)
            return out

    def read_runs(self, rank: int, key: str, runs: Sequence[tuple[int, int, int, int]], *,
                  out: np.ndarray | None = None, verify: bool = False) -> np.ndarray:
        """Elements of the row-major flattening selected by regular runs ``(start, count, stride,
        block)`` (``count`` blocks of ``block`` elements, ``stride`` apart), in increasing order and
        non-overlapping, as one 1-D array read with a single HDF5 call (no checksum)."""
        with self._lock, self._guard(rank, key):
            d, info = self._dataset(rank, key)
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
                self.bytes_last_read = self._read_runs_verified(rank, key, d, info, runs, out)
                return out
            self.bytes_last_read = out.nbytes
            if len(info.shape) != 1:  # flat selections address 1-D (flat buffer) datasets
                flat = self.read(rank, key, verify=False).reshape(-1)
                return np.concatenate([np.lib.stride_tricks.as_strided(flat[s:], (c, b), (t * flat.itemsize, flat.itemsize)).reshape(-1)
                                       for s, c, t, b in runs])
            h5.read_runs_into(d, runs, out)
            return out

    def _read_runs_verified(self, rank, key, d, info: DatasetInfo, runs, out: np.ndarray) -> int:
        """``read_runs`` reading the whole checksum chunks around the runs, each verified before use
        (a small dataset is one chunk). Verified chunks are kept in a small LRU, so boxes of the
        same dataset do not read them again. Returns the bytes read from disk."""
        item = info.storage_dtype.itemsize
        size = info.size
        chunk_bytes, digests = h5.chunk_checksums(d)
        per = int(chunk_bytes) // item if digests is not None else max(size, 1)
        n = -(-size // per) if size else 0
        touched = np.zeros(n + 1, dtype=np.int64)
        for start, count, stride, block in runs:
            b = start + np.arange(count, dtype=np.int64) * stride
            np.add.at(touched, b // per, 1)
            np.add.at(touched, (b + block - 1) // per + 1, -1)
        need = np.flatnonzero(np.cumsum(touched[:n]) > 0)
        cache = self._verified
        have = {int(c): cache.get((rank, key, int(c))) for c in need}
        missing = [c for c, v in have.items() if v is None]
        read = 0
        whole_buf = None  # the buffer of a single read covering every needed chunk, if there is one
        # one read per run of consecutive missing chunks; every chunk verified before use
        groups = np.split(np.array(missing, dtype=np.int64), np.flatnonzero(np.diff(missing) != 1) + 1) if missing else []
        for g in groups:
            first = int(g[0])
            lo, hi = first * per, min((int(g[-1]) + 1) * per, size)
            # one group reads into reusable (warm) scratch memory; several need their own buffers
            buf = self._scratch.array((hi - lo,), info.storage_dtype) if len(groups) == 1 else np.empty(hi - lo, info.storage_dtype)
            h5.read_flat_into(d, info.shape, lo, hi, buf)
            read += buf.nbytes
            if len(groups) == 1 and len(g) == len(need):
                whole_buf = buf
            for c in (int(x) for x in g):
                piece = buf[(c - first) * per:(c - first + 1) * per]
                ok = (checksum_of(piece) == info.checksum) if digests is None else \
                    xxhash.xxh3_64_intdigest(raw_bytes(piece)) == int(digests[c])
                if not ok:
                    raise StoreError(f"checksum mismatch in {self._where(rank, key)} (elements "
                                     f"{c * per}..{min((c + 1) * per, size)})", code="UCL407")
                have[c] = piece
                if c in (int(g[0]), int(g[-1])):  # edge chunks are the ones neighbouring boxes share
                    cache.put((rank, key, c), piece.copy())
        if len(need) and need[-1] - need[0] + 1 == len(need):
            # the usual case: one contiguous stretch of chunks; cut the runs out with strided views
            c0 = int(need[0])
            span = whole_buf if whole_buf is not None else (
                have[c0] if len(need) == 1 else np.concatenate([have[int(c)] for c in need]))
            base, pos = c0 * per, 0
            for start, count, stride, block in runs:
                n = count * block
                view = np.lib.stride_tricks.as_strided(span[start - base:], (count, block),
                                                       (stride * item, item), writeable=False)
                out[pos:pos + n].reshape(count, block)[...] = view
                pos += n
            return read
        pos = 0
        for start, count, stride, block in runs:
            for i in range(count):
                b, left = start + i * stride, block
                while left:
                    c = b // per
                    take = min(left, (c + 1) * per - b)
                    out[pos:pos + take] = have[c][b - c * per:b - c * per + take]
                    pos, b, left = pos + take, b + take, left - take
        return read

    def verify(self, ranks: Sequence[int] | None = None) -> list[str]:
        """Check files and every dataset checksum; returns a list of problems (empty = sound)."""
        problems: list[str] = []
        for rank in range(self.nranks) if ranks is None else ranks:
            self._entries(rank)  # unknown rank: UCL408, not a "problem"
            try:
                with self._lock:
                    f, _ = self._handles.get(rank)
                    present = h5.list_datasets(f)
            except StoreError as e:
                problems.append(str(e))
                continue
            except Exception as e:  # damaged metadata: report, keep going
                problems.append(f"{self._where(rank)} cannot be listed (corrupt): {e}")
                continue
            for key in sorted(present - set(self._entries(rank))):
                problems.append(f"{self._where(rank, key)} is not listed in the manifest")
            for key in self.keys(rank):
                try:
                    with self._lock, self._guard(rank, key):
                        d, info = self._dataset(rank, key)
                        got, chunks = h5.checksum_dataset(d, info.shape, info.storage_dtype)
                    stored = h5.chunk_checksums(d)[1]
                    if got == info.checksum and stored is not None and (
                            chunks is None or not np.array_equal(np.asarray(stored, dtype=np.uint64), chunks[1])):
                        got = "chunk checksums that differ"
                    if got != info.checksum:
                        problems.append(f"checksum mismatch in {self._where(rank, key)}: manifest has "
                                        f"{info.checksum}, data hashes to {got}")
                except StoreError as e:
                    problems.append(str(e))
        return problems
