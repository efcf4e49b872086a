"""A checkpoint another framework wrote, read in place.

Its reader (``ucl.formats``) describes it as a :class:`~ucl.store.manifest.Manifest` (spec, dims,
mesh, datasets per rank) plus, for each dataset, an :class:`Extent`: the row-major bytes of the
tensor at a known offset in one of the framework's files (a ``.pt`` zip member, a safetensors
payload, a ``.distcp`` item). :class:`ExtentCheckpoint` then answers the same reads as
:class:`~ucl.store.reader.Checkpoint`, with ``os.pread`` of exactly the bytes asked for, so the
compiler and the one copy loop treat it like any ucl checkpoint. Foreign files carry no ucl
checksums: ``verify`` has nothing to check bytes against and checks the files instead.
"""
from __future__ import annotations

import bisect
import itertools
import os
import stat
import threading
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from .. import dtypes as _dt
from ..dtypes import itemsize
from ..errors import ForeignFormatError, StoreError
from ..files import check_inside
from .h5 import check_box, check_out
from .like import ManifestBacked
from .manifest import DatasetInfo, Manifest

NO_CHECKSUM = "none"  # the checksum of a dataset a foreign framework wrote


@dataclass(frozen=True)
class Piece:
    """``nbytes`` bytes at byte ``offset`` of ``file`` (relative to the checkpoint folder); with
    ``file`` :data:`ZEROS` (``""``), ``nbytes`` zero bytes that no file holds (padding a framework
    did not save or saved as garbage, e.g. Megatron's distributed-optimizer buckets)."""
    file: str
    offset: int
    nbytes: int


ZEROS = ""  # the file of a Piece of zeros


@dataclass(frozen=True)
class Extent:
    """A tensor stored row-major as ``prod(shape)`` elements of ``dtype`` (logical) starting at
    byte ``offset`` of ``file`` (a path relative to the checkpoint folder); or, with ``pieces``,
    as those byte ranges joined in order (a tensor a framework saved in parts, e.g. one per MoE
    expert: ``file``/``offset`` are then the first piece's)."""
    file: str
    offset: int
    dtype: str
    shape: tuple[int, ...]
    pieces: tuple[Piece, ...] = ()

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=object)) * itemsize(self.dtype)

    @classmethod
    def joined(cls, pieces: Sequence[Piece], dtype: str, shape: tuple[int, ...]) -> "Extent":
        return cls(pieces[0].file, pieces[0].offset, dtype, tuple(shape), tuple(pieces))

    def parts(self) -> tuple[Piece, ...]:
        return self.pieces or (Piece(self.file, self.offset, self.nbytes),)


class ExtentCheckpoint(ManifestBacked):
    """Read access to a foreign checkpoint (see the module doc). Every extent is checked against
    its file when the checkpoint is opened: a regular file inside the folder, the bytes there."""

    def __init__(self, path: str, manifest: Manifest, extents: Sequence[dict[str, Extent]], format: str):
        self.path, self.manifest, self.format = path, manifest, format
        self._extents = list(extents)
        if len(self._extents) != manifest.nranks:
            raise ForeignFormatError(f"{path}: {len(self._extents)} ranks of extents for {manifest.nranks} ranks", code="UCL502")
        self._lock = threading.Lock()
        self._fds: dict[str, int] = {}
        self.bytes_last_read = 0
        sizes: dict[str, int] = {}
        self._starts: dict[Extent, list[int]] = {}  # joined extents: where each piece starts in the tensor
        for rank, table in enumerate(self._extents):
            for key, e in table.items():
                for p in e.parts():
                    if p.file == ZEROS and e.pieces:
                        continue
                    if p.file not in sizes:
                        sizes[p.file] = self._file_size(p.file)
                    if p.offset < 0 or p.nbytes < 0 or p.offset + p.nbytes > sizes[p.file]:
                        raise StoreError(f"{self._where(rank, key)}: {p.nbytes:,} bytes at offset {p.offset:,} run "
                                         f"past the end of {p.file} ({sizes[p.file]:,} bytes; truncated?)",
                                         code="UCL406")
                if e.pieces:
                    if sum(p.nbytes for p in e.pieces) != e.nbytes:
                        raise ForeignFormatError(f"{self._where(rank, key)}: its pieces hold "
                                         f"{sum(p.nbytes for p in e.pieces):,} bytes, not {e.nbytes:,}", code="UCL502")
                    self._starts[e] = list(itertools.accumulate((p.nbytes for p in e.pieces), initial=0))

    def __repr__(self) -> str:
        return f"ExtentCheckpoint({self.path!r}, format={self.format!r}, nranks={self.nranks})"

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()

    def keys(self, rank: int) -> list[str]:
        return sorted(self._table(rank))

    def extent(self, rank: int, key: str) -> Extent:
        e = self._table(rank).get(key)
        if e is None:
            raise StoreError(f"rank {rank} has no dataset {key!r} in {self.path}", code="UCL408")
        return e

    def info(self, rank: int, key: str) -> DatasetInfo:
        e = self.extent(rank, key)
        return DatasetInfo(e.dtype, e.shape, NO_CHECKSUM)

    def check_files(self, ranks: Sequence[int]) -> None:
        """Nothing left to check: every extent was checked against its file on opening."""

    def verify(self, ranks: Sequence[int] | None = None) -> list[str]:
        """Problems with the files (missing, shrunk since opening); the bytes have no checksums."""
        problems = []
        for rank in range(self.nranks) if ranks is None else ranks:
            for key, e in self._table(rank).items():
                for p in e.parts():
                    if p.file == ZEROS and e.pieces:
                        continue
                    try:
                        if p.offset + p.nbytes > self._file_size(p.file):
                            problems.append(f"{self._where(rank, key)} runs past the end of {p.file}")
                    except StoreError as err:
                        problems.append(str(err))
        return problems

    # -- reads -------------------------------------------------------------------------------
    def read(self, rank: int, key: str, *, verify: bool = True, out: np.ndarray | None = None) -> np.ndarray:
        e = self.extent(rank, key)
        out = check_out(out, e.shape, _dt.storage_dtype(e.dtype))
        self._pread(e, 0, out.reshape(-1))
        self.bytes_last_read = out.nbytes
        return out

    def to_torch(self, rank: int, key: str, *, verify: bool = True) -> Any:
        return _dt.to_torch(self.read(rank, key), self.extent(rank, key).dtype)

    def read_flat(self, rank: int, key: str, start: int, stop: int, *, out: np.ndarray | None = None) -> np.ndarray:
        e = self.extent(rank, key)
        n = int(np.prod(e.shape, dtype=object))
        if not 0 <= start <= stop <= n:
            raise StoreError(f"flat range [{start}, {stop}) out of bounds for {self._where(rank, key)} of {n} "
                             "elements", code="UCL409")
        return self.read_runs(rank, key, [(start, 1, stop - start, stop - start)], out=out)

    def read_box(self, rank: int, key: str, starts: Sequence[int], sizes: Sequence[int], *,
                 out: np.ndarray | None = None) -> np.ndarray:
        e = self.extent(rank, key)
        starts, sizes = tuple(int(s) for s in starts), tuple(int(z) for z in sizes)
        check_box(starts, sizes, e.shape, self._where(rank, key))
        out = check_out(out, sizes, _dt.storage_dtype(e.dtype))
        nd = len(e.shape)
        if nd == 0 or 0 in sizes:
            return self.read(rank, key, out=out) if nd == 0 else out
        # contiguous from dim k on: one pread per index of the dims before it
        k = nd - 1
        while k > 0 and starts[k] == 0 and sizes[k] == e.shape[k]:
            k -= 1
        strides = [int(np.prod(e.shape[j + 1:], dtype=object)) for j in range(nd)]
        block = sizes[k] * strides[k]
        flat = out.reshape(-1)
        pos = 0
        for idx in np.ndindex(*sizes[:k]):
            first = sum((starts[j] + i) * strides[j] for j, i in enumerate(idx)) + starts[k] * strides[k]
            self._pread(e, first * flat.itemsize, flat[pos:pos + block])
            pos += block
        self.bytes_last_read = out.nbytes
        return out

    def read_runs(self, rank: int, key: str, runs: Sequence[tuple[int, int, int, int]], *,
                  out: np.ndarray | None = None, verify: bool = False) -> np.ndarray:
        """Elements of the row-major flattening selected by runs ``(start, count, stride, block)``
        (as :meth:`ucl.store.reader.Checkpoint.read_runs`), one pread per block."""
        e = self.extent(rank, key)
        size = int(np.prod(e.shape, dtype=object))
        total = sum(c * b for _, c, _, b in runs)
        out = check_out(out, (total,), _dt.storage_dtype(e.dtype))
        pos = 0
        for start, count, step, block in runs:
            if start < 0 or count < 0 or block < 0 or (count and start + (count - 1) * step + block > size):
                raise StoreError(f"run ({start}, {count}, {step}, {block}) out of bounds for "
                                 f"{self._where(rank, key)} of {size} elements", code="UCL409")
            if count > 1 and step == block:  # adjacent blocks: one read
                count, block = 1, count * block
            for i in range(count):
                self._pread(e, (start + i * step) * out.itemsize, out[pos:pos + block])
                pos += block
        self.bytes_last_read = out.nbytes
        return out

    # -- files -------------------------------------------------------------------------------
    def _table(self, rank: int) -> dict[str, Extent]:
        if not isinstance(rank, (int, np.integer)) or not 0 <= rank < self.nranks:
            raise StoreError(f"no rank {rank} in {self.path} ({self.nranks} ranks)", code="UCL408")
        return self._extents[rank]

    def _where(self, rank: int, key: str) -> str:
        return f"{self.format} checkpoint {self.path} rank {rank} dataset {key!r}"

    def _file_size(self, rel: str) -> int:
        p = os.path.join(self.path, rel)
        check_inside(p, self.path, "file", lambda msg: StoreError(msg, code="UCL416"))
        try:
            st = os.stat(p)
        except OSError as e:
            raise StoreError(f"{p}: {e.strerror or e}", code="UCL404") from None
        if not stat.S_ISREG(st.st_mode):
            raise StoreError(f"{p} is not a regular file", code="UCL416")
        return st.st_size

    def _fd(self, rel: str) -> int:
        with self._lock:
            fd = self._fds.get(rel)
            if fd is None:
                # checked again when opened (a file swapped since the checkpoint was opened: a link
                # out of the folder, a FIFO); non-blocking so a FIFO cannot hang the open
                self._file_size(rel)
                fd = os.open(os.path.join(self.path, rel), os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    os.close(fd)
                    raise StoreError(f"{os.path.join(self.path, rel)} is not a regular file", code="UCL416")
                self._fds[rel] = fd
            return fd

    def _pread(self, e: Extent, at: int, out: np.ndarray) -> None:
        """Bytes ``[at, at + out.nbytes)`` of ``e``'s row-major bytes into ``out``."""
        view = memoryview(out.view(np.uint8) if out.ndim else out.reshape(1).view(np.uint8))
        if not e.pieces:
            return self._pread_file(e.file, e.offset + at, view)
        starts = self._starts[e]
        i, done = bisect.bisect_right(starts, at) - 1, 0
        while done < len(view):
            p, inside = e.pieces[i], at + done - starts[i]
            n = min(p.nbytes - inside, len(view) - done)
            if p.file == ZEROS:
                view[done:done + n] = bytes(n)
            else:
                self._pread_file(p.file, p.offset + inside, view[done:done + n])
            done, i = done + n, i + 1

    def _pread_file(self, rel: str, offset: int, view: memoryview) -> None:
        fd, done = self._fd(rel), 0
        while done < len(view):
            n = os.preadv(fd, [view[done:]], offset + done)
            if n <= 0:
                raise StoreError(f"{os.path.join(self.path, rel)} ended {len(view) - done:,} bytes early "
                                 "(truncated after opening?)", code="UCL406")
            done += n
