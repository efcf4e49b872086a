"""Reading a compressed dataset (docs/format.md, "Compressed datasets") as if it were plain: the
same reads as ``raw.RawDataset`` (flat ranges, runs, boxes, row-and-column blocks), each decoding
only the units it touches, every unit's stored bytes checked against the frame table's digest
before they are decoded."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import xxhash

from ..errors import StoreError
from ..layout.boxes import Slot, flat_runs
from .codec import LAYOUTS_SINCE, Units, check_ends, decode_unit, frame_table_digest, units_of
from .planes import scratch
from .raw import RawFile, locate


_GROUP_BYTES = 16 << 20  # chunks decoded per group of a long flat read
_WARM_BYTES = 32 << 20  # stored bytes read into this thread's scratch (kept for the next read) up to this size


@dataclass
class ReadCount:
    """Stored bytes read from disk by compressed reads (a reader's running total)."""

    stored: int = 0


@dataclass(frozen=True)
class PackedDataset:
    """A compressed dataset whose stored bytes start at ``offset`` of ``file``; ``ends`` and
    ``digests`` are its frame table, already bound to the manifest by the caller. ``cache`` (an
    ``h5.ChunkCache``) keeps decoded units, keyed from ``key``."""

    file: RawFile
    offset: int
    shape: tuple[int, ...]
    dtype: np.dtype
    logical: str
    codec: str
    units: Units
    ends: np.ndarray
    digests: np.ndarray
    cache: Any
    key: tuple
    count: ReadCount
    layouts: bool = True  # the checkpoint's version has layout headers (codec.LAYOUTS_SINCE)

    def _span(self, u: int) -> tuple[int, int]:
        return (int(self.ends[u - 1]) if u else 0), int(self.ends[u])

    def _decode(self, u: int, stored: memoryview) -> np.ndarray:
        """Unit ``u`` from its stored bytes, digest checked first (UCL407), as uint8."""
        where = lambda: f"{self.file.where} unit {u}"  # noqa: E731
        if xxhash.xxh3_64_intdigest(stored) != int(self.digests[u]):
            raise StoreError(f"checksum mismatch in {where()}: its stored bytes differ from the frame table",
                             code="UCL407")
        out = np.empty(self.units.unit_bytes(u), np.uint8)
        decode_unit(stored, out.size, self.logical, self.dtype.itemsize, self.codec, out, where, self.layouts)
        return out

    def decoded(self, first: int, last: int) -> list[np.ndarray]:
        """Units ``first..last`` decoded (uint8 each): cached ones taken from the cache, the others
        read with one ``pread`` per run of consecutive missing units."""
        got: dict[int, np.ndarray] = {}
        missing = []
        for u in range(first, last + 1):
            hit = self.cache.get(self.key + (u,))
            if hit is None:
                missing.append(u)
            else:
                got[u] = hit
        i = 0
        while i < len(missing):
            j = i
            while j + 1 < len(missing) and missing[j + 1] == missing[j] + 1:
                j += 1
            a, b = self._span(missing[i])[0], self._span(missing[j])[1]
            # warm memory: a fresh buffer of a band's stored bytes costs its page faults each read, more
            # than the copy from the page cache (the planes join into each unit's own array, so no unit
            # returned is a view of it)
            # (at most the decoded-unit cache's budget too: a max_memory cap shrinks both)
            warm = b - a <= min(_WARM_BYTES, self.cache.budget)
            buf = scratch("stored", b - a) if warm else np.empty(b - a, np.uint8)
            self.file.read_into(self.offset + a, buf)
            self.count.stored += buf.size
            view = memoryview(buf)
            for u in missing[i:j + 1]:
                s, e = self._span(u)
                got[u] = self._decode(u, view[s - a:e - a])
                self.cache.put(self.key + (u,), got[u])
            i = j + 1
        return [got[u] for u in range(first, last + 1)]

    def _block(self, r0: int, r1: int, c0: int, c1: int) -> np.ndarray:
        """Rows ``[r0, r1)`` x columns ``[c0, c1)`` of a tiled dataset (seen as rows x cols), from
        the tiles around them."""
        g = self.units.grid
        b0, b1 = r0 // g.tile_rows, (r1 - 1) // g.tile_rows
        j0, j1 = c0 // g.tile_cols, (c1 - 1) // g.tile_cols
        ra, ca = g.row_span(b0)[0], g.col_span(j0, j0)[0]
        rb, cb = g.row_span(b1)[1], g.col_span(j1, j1)[1]
        buf = np.empty((rb - ra, cb - ca), self.dtype)
        for b in range(b0, b1 + 1):
            tr0, tr1 = g.row_span(b)
            self._band_into(b, j0, j1, buf[tr0 - ra:tr1 - ra], ca)
        return buf[r0 - ra:r1 - ra, c0 - ca:c1 - ca]

    def _band_into(self, b: int, j0: int, j1: int, dst: np.ndarray, ca: int) -> None:
        """Tiles ``j0..j1`` of tile band ``b`` into ``dst`` (the band's rows; its column 0 is the
        dataset's column ``ca``)."""
        g = self.units.grid
        rows = dst.shape[0]
        for j, t in zip(range(j0, j1 + 1), self.decoded(b * g.nc + j0, b * g.nc + j1)):
            tc0, tc1 = g.col_span(j, j)
            dst[:, tc0 - ca:tc1 - ca] = t.view(self.dtype).reshape(rows, tc1 - tc0)

    def read_flat_into(self, start: int, stop: int, out: np.ndarray) -> None:
        """Elements ``[start, stop)`` of the row-major flattening into the 1-D ``out``, a band of
        tiles or a group of chunks at a time (memory: the read plus one group)."""
        if stop <= start:
            return
        g = self.units.grid
        if g is not None:
            for b in range(start // g.cols // g.tile_rows, (stop - 1) // g.cols // g.tile_rows + 1):
                r0, r1 = g.row_span(b)
                lo, hi = max(start, r0 * g.cols), min(stop, r1 * g.cols)
                if (lo, hi) == (r0 * g.cols, r1 * g.cols) and out.strides[0] == out.itemsize:
                    # a whole band: its tiles straight into ``out`` (no band buffer, one copy less)
                    self._band_into(b, 0, g.nc - 1, out[lo - start:hi - start].reshape(r1 - r0, g.cols), 0)
                    continue
                band = self._block(r0, r1, 0, g.cols).reshape(-1)
                out[lo - start:hi - start] = band[lo - r0 * g.cols:hi - r0 * g.cols]
            return
        item, size = self.dtype.itemsize, self.units.chunk
        dst, a, b = out.view(np.uint8), start * item, stop * item
        first, last = a // size, (b - 1) // size
        per = max(1, _GROUP_BYTES // size)
        pos = 0
        for g0 in range(first, last + 1, per):
            g1 = min(last, g0 + per - 1)
            for u, data in zip(range(g0, g1 + 1), self.decoded(g0, g1)):
                lo, hi = max(a, u * size), min(b, u * size + data.size)
                dst[pos:pos + hi - lo] = data[lo - u * size:hi - u * size]
                pos += hi - lo

    def read_rows_into(self, rows: tuple[int, int], cols: tuple[int, int], out: np.ndarray,
                       at: tuple[int, int]) -> None:
        """Rows x columns of the dataset seen as (leading dims collapsed) x (last dim), into the 2-D
        ``out`` at ``at``: a tiled dataset decodes only the tiles around them."""
        (r0, r1), (c0, c1) = rows, cols
        if r1 <= r0 or c1 <= c0:
            return
        dst = out[at[0]:at[0] + r1 - r0, at[1]:at[1] + c1 - c0]
        if self.units.grid is not None:
            dst[...] = self._block(r0, r1, c0, c1)
            return
        width = self.shape[-1]
        tmp = np.empty((r1 - r0) * width, self.dtype)
        self.read_flat_into(r0 * width, r1 * width, tmp)
        dst[...] = tmp.reshape(r1 - r0, width)[:, c0:c1]

    def read_runs_into(self, runs: Sequence[tuple[int, int, int, int]], out: np.ndarray) -> None:
        """Elements selected by regular runs ``(start, count, stride, block)``, in order, into the 1-D
        ``out``: each run cut out of the rows (and, tiled, the columns) around it."""
        g, pos = self.units.grid, 0
        for start, count, stride, block in runs:
            n = count * block
            if n == 0:
                continue
            dst = out[pos:pos + n].reshape(count, block)
            c = start % g.cols if g is not None else 0
            if g is not None and c == 0 and n % g.cols == 0 and (count == 1 or stride == block):
                self.read_flat_into(start, start + n, out[pos:pos + n])  # whole rows: bands straight into ``out``
            elif g is not None and c + block <= g.cols and (count == 1 or stride % g.cols == 0):
                r, step = start // g.cols, max(1, stride // g.cols)
                rows = self._block(r, r + (count - 1) * step + 1, c, c + block)
                dst[...] = rows[::step]
            else:
                end = start + (count - 1) * stride + block
                span = np.empty(end - start, self.dtype)
                self.read_flat_into(start, end, span)
                dst[...] = np.lib.stride_tricks.as_strided(span, (count, block), (stride * span.itemsize,
                                                                                  span.itemsize), writeable=False)
            pos += n

    def read_box_into(self, starts: Sequence[int], sizes: Sequence[int], out: np.ndarray) -> None:
        """The N-d box ``[starts, starts + sizes)`` into the C-contiguous ``out`` of its shape."""
        self.read_runs_into(flat_runs(Slot("", 0, self.shape, self.shape), starts, sizes), out.reshape(-1))


def open_packed(file: RawFile, info: Any, values: np.ndarray, cache: Any, key: tuple, count: ReadCount,
                where: str, version: int) -> PackedDataset:
    """A compressed dataset's reader, once its manifest entry is checked against the file: the
    stored bytes lie inside it (UCL406), the frame table (``values``: ends, then digests) is the one
    the entry's ``frames`` binds (UCL407) and fits the units' geometry (UCL406). Nothing is
    allocated from a stored length before these checks. ``version``: the checkpoint's format version."""
    sdtype = info.storage_dtype
    locate(file, info.offset, (info.stored,), np.dtype(np.uint8), info.stored)
    n = values.size // 2
    ends, digests = values[:n], values[n:]
    if frame_table_digest(info.checksum, info.encoding, info.stored, ends, digests, info.group) != info.frames:
        raise StoreError(f"{where}: its frame table does not match the manifest (the file belongs to another "
                         "rank or checkpoint, or was altered)", code="UCL407")
    units = units_of(info.shape, sdtype.itemsize, info.group or 1)
    check_ends(units, info.dtype, ends, info.stored, where)
    return PackedDataset(file, info.offset, tuple(info.shape), sdtype, info.dtype, info.encoding, units, ends,
                         digests, cache, key, count, version >= LAYOUTS_SINCE)
