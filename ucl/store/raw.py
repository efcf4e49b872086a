"""Reading a dataset's bytes straight from its rank file, at the byte offset the manifest records
(docs/format.md, ``offset`` and ``tables``): no HDF5 object is opened, so a load pays one ``pread``
per read instead of HDF5's per-dataset metadata work. The manifest entry, not the file, says where the
bytes are; every offset is checked against the file's size before a byte is read, and what is read
is verified against the manifest's checksums like any other read."""
from __future__ import annotations

import mmap
import os
import stat
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..errors import StoreError
from ..layout.boxes import Slot, flat_runs

_SPAN_BYTES = 16 << 20  # a strided read takes its span in pieces of at most this (bounded memory)
_DIRECT_BLOCK_BYTES = 64 << 10  # runs of blocks at least this long are read block by block, no span
# ... and so are blocks this far apart: one pread per block costs less than copying the gaps twice
# (into the span, then out of it); measured from the page cache: 1.27x faster at 8 KiB blocks 32 KiB
# apart, slower at 16 KiB apart (the Python per pread)
_DIRECT_STRIDE_BYTES = 32 << 10
# a gather's window is mapped with its pages at once (one call, not a fault per 64 KiB): 1.3x faster
_MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)


class RawFile:
    """A rank file opened for positional reads (never through a link: the caller checked the path
    lies inside the checkpoint; ``O_NOFOLLOW`` keeps it so)."""

    def __init__(self, path: str, where: str):
        self.where = where
        self.fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0))
        st = os.fstat(self.fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(self.fd)
            raise StoreError(f"{where} is not a regular file", code="UCL416")
        self.size = st.st_size
        self.unmappable = False  # set once mmap is refused: strided reads then take their span by pread

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def gather_into(self, offset: int, count: int, stride: int, block: int, out: np.ndarray) -> None:
        """``count`` blocks of ``block`` bytes, ``stride`` bytes apart from byte ``offset``, into
        the C-contiguous uint8 ``out``: copied out of a read-only mapping of just that span, so only
        the blocks are copied, not the gaps between them (a ``pread`` of the span copies those too).
        The file's size is checked again right before: a file cut short since it was opened is a
        clear error, not a SIGBUS (cut short during the copy, it is one, as for any mapped read)."""
        end = offset + (count - 1) * stride + block
        size = os.fstat(self.fd).st_size
        if end > size:
            raise StoreError(f"{self.where} ends at byte {size:,}, before the {end - offset:,} bytes at "
                             f"{offset:,} its manifest places there (truncated)", code="UCL406")
        base = offset - offset % mmap.ALLOCATIONGRANULARITY
        window = None
        if not self.unmappable:
            try:
                window = mmap.mmap(self.fd, end - base, flags=_MAP_FLAGS, prot=mmap.PROT_READ, offset=base)
            except OSError:  # a file system without mmap (some FUSE mounts): the span is read instead
                self.unmappable = True
        span = None
        try:
            if window is not None:
                span = np.frombuffer(window, np.uint8)[offset - base:]
            else:
                span = np.empty(end - offset, np.uint8)
                self.read_into(offset, span)
            out.reshape(count, block)[...] = np.lib.stride_tricks.as_strided(span, (count, block), (stride, 1),
                                                                             writeable=False)
        finally:
            span = None  # a mapping closes only once no array points into it
            if window is not None:
                window.close()

    def read_into(self, offset: int, out: np.ndarray) -> None:
        """Fill the C-contiguous ``out`` with the file's bytes from ``offset`` (short reads retried;
        a file that ends early raises UCL406)."""
        view = memoryview(out.reshape(-1).view(np.uint8))
        done, n = 0, view.nbytes
        while done < n:
            got = os.preadv(self.fd, [view[done:]], offset + done)
            if got <= 0:
                raise StoreError(f"{self.where} ends at byte {offset + done:,}, before the {n:,} bytes at "
                                 f"{offset:,} its manifest places there (truncated)", code="UCL406")
            done += got


@dataclass(frozen=True)
class RawDataset:
    """One dataset's bytes: ``shape`` elements of ``dtype``, row-major, from byte ``offset`` of ``file``."""

    file: RawFile
    offset: int
    shape: tuple[int, ...]
    dtype: np.dtype

    def read_flat_into(self, start: int, stop: int, out: np.ndarray) -> None:
        """Elements ``[start, stop)`` of the row-major flattening into the 1-D ``out``."""
        if stop > start:
            self.file.read_into(self.offset + start * self.dtype.itemsize, out)

    def read_runs_into(self, runs: Sequence[tuple[int, int, int, int]], out: np.ndarray) -> None:
        """Elements selected by regular runs ``(start, count, stride, block)`` of the flattening, in
        order, into the 1-D ``out``: a contiguous run or a long block is read straight into place;
        short strided blocks are copied out of a mapping of their span, in bounded pieces."""
        item, pos = self.dtype.itemsize, 0
        for start, count, stride, block in runs:
            n = count * block
            if count == 1 or stride == block:
                self.read_flat_into(start, start + n, out[pos:pos + n])
            elif block * item >= _DIRECT_BLOCK_BYTES or stride * item >= _DIRECT_STRIDE_BYTES:
                for i in range(count):
                    b = start + i * stride
                    self.read_flat_into(b, b + block, out[pos + i * block:pos + (i + 1) * block])
            else:  # short blocks close together: gathered from a mapping of a bounded piece at a time
                per = max(1, _SPAN_BYTES // (stride * item))  # blocks per piece
                for i in range(0, count, per):
                    k = min(per, count - i)
                    dst = out[pos + i * block:pos + (i + k) * block].view(np.uint8)
                    self.file.gather_into(self.offset + (start + i * stride) * item, k, stride * item,
                                          block * item, dst)
            pos += n

    def read_box_into(self, starts: Sequence[int], sizes: Sequence[int], out: np.ndarray) -> None:
        """The N-d box ``[starts, starts + sizes)`` into the C-contiguous ``out`` of its shape."""
        self.read_runs_into(flat_runs(Slot("", 0, self.shape, self.shape), starts, sizes), out.reshape(-1))

    def read_rows_into(self, rows: tuple[int, int], cols: tuple[int, int], out: np.ndarray,
                       at: tuple[int, int]) -> None:
        """Rows ``rows`` x columns ``cols`` of the dataset seen as (leading dims collapsed) x (last
        dim), into the 2-D ``out`` at row, column ``at``."""
        (r0, r1), (c0, c1) = rows, cols
        if r1 <= r0 or c1 <= c0:
            return
        width = self.shape[-1]
        dst = out[at[0]:at[0] + r1 - r0, at[1]:at[1] + c1 - c0]
        if c1 - c0 == width and dst.flags.c_contiguous:  # whole rows: one read, in place
            self.read_flat_into(r0 * width, r1 * width, dst.reshape(-1))
            return
        flat = dst.reshape(-1) if dst.flags.c_contiguous else None
        runs = [(r0 * width + c0, r1 - r0, width, c1 - c0)]
        if flat is not None:
            self.read_runs_into(runs, flat)
        else:
            tmp = np.empty((r1 - r0) * (c1 - c0), self.dtype)
            self.read_runs_into(runs, tmp)
            dst[...] = tmp.reshape(r1 - r0, c1 - c0)


def locate(file: RawFile, offset: object, shape: tuple[int, ...], dtype: np.dtype, nbytes: int) -> RawDataset:
    """The dataset at ``offset`` of ``file``, once the manifest's offset is checked to be an integer
    whose ``nbytes`` lie inside the file (UCL406 otherwise: truncated, or a manifest that lies)."""
    if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0 or offset + nbytes > file.size:
        raise StoreError(f"{file.where}: the manifest places {nbytes:,} bytes at offset {offset!r}, outside the "
                         f"file's {file.size:,} bytes (truncated, or a manifest that lies)", code="UCL406")
    return RawDataset(file, offset, shape, dtype)


def read_table(file: RawFile, offset: object, count: int) -> np.ndarray:
    """``count`` little-endian uint64 values at byte ``offset`` (bounds checked first, UCL406)."""
    located = locate(file, offset, (count,), np.dtype("<u8"), 8 * count)
    out = np.empty(count, "<u8")
    located.read_flat_into(0, count, out)
    return out.astype(np.uint64, copy=False)
