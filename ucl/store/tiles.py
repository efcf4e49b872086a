"""Tile digests (docs/format.md, "Tile checksums"): the writer's tile grid over a dataset seen as a
matrix, hashing a band's tiles from rows arriving in order (copied to tile order a block at a time,
hashed while in cache), and which tiles a verified read of some runs must fetch."""
from __future__ import annotations

import functools
import math
from collections import deque
from dataclasses import dataclass

import numpy as np
import xxhash

from . import checksum
from .checksum import MIN_CHUNK_BYTES, chunk_digests, raw_bytes


# 2-D datasets (N-d: leading dims collapsed into rows) also carry a grid of tile digests, so a
# column block is verified by reading only the tiles it touches (flat chunks cut every row).
# Tile columns come first (rows are already served finely by the flat chunks); grid sides are
# powers of two, so a split of the columns into 2, 4, 8... parts falls on tile edges when it is even.
MAX_TILE_GRID = 32
MIN_TILE_ROW_BYTES = 256  # narrower tile rows would make reads and hashing slow, byte for byte


@dataclass(frozen=True)
class TileGrid:
    """Tiles of ``tile_rows`` x ``tile_cols`` elements over a dataset seen as ``rows`` x ``cols``
    (row-major, leading dims collapsed); edge tiles may be smaller."""

    rows: int
    cols: int
    tile_rows: int
    tile_cols: int

    @property
    def nr(self) -> int:
        return -(-self.rows // self.tile_rows)

    @property
    def nc(self) -> int:
        return -(-self.cols // self.tile_cols)

    @property
    def count(self) -> int:
        return self.nr * self.nc

    def row_span(self, band: int) -> tuple[int, int]:
        return band * self.tile_rows, min((band + 1) * self.tile_rows, self.rows)

    def col_span(self, first: int, last: int) -> tuple[int, int]:
        """Columns of tile columns ``first..last`` (inclusive)."""
        return first * self.tile_cols, min((last + 1) * self.tile_cols, self.cols)


def tile_grid(shape: tuple[int, ...], itemsize: int) -> TileGrid | None:
    """The writer's tile grid for a dataset (docs/format.md); None for 0-d/1-d datasets, datasets
    verified whole, and shapes where tiles would not beat the flat chunks (a single tile column)."""
    if len(shape) < 2:
        return None
    cols = int(shape[-1])
    rows = math.prod(int(x) for x in shape[:-1])
    nbytes = rows * cols * itemsize
    if nbytes <= MIN_CHUNK_BYTES:
        return None
    most = min(MAX_TILE_GRID * MAX_TILE_GRID, nbytes // MIN_CHUNK_BYTES)  # tiles of >= 16 KiB
    gc = _pow2_floor(min(MAX_TILE_GRID, most, cols * itemsize // MIN_TILE_ROW_BYTES))
    if gc < 2:
        return None
    gr = _pow2_floor(min(rows, MAX_TILE_GRID, most // gc))
    grid = TileGrid(rows, cols, -(-rows // gr), -(-cols // gc))
    return grid if grid.nc > 1 else None


def _pow2_floor(n: int) -> int:
    """The largest power of two <= n (0 for n < 1)."""
    return 1 << (n.bit_length() - 1) if n >= 1 else 0


def _tile_order(rows: np.ndarray, width: int, full: int, scratch: np.ndarray) -> np.ndarray:
    """The ``full`` tiles of ``width`` columns at the left of ``rows`` (k x h x cols, last axis
    contiguous), each copied out whole, one after another (k x full x h x width), as flat bytes in
    ``scratch``. A tile row is one void element, which numpy copies with one memcpy (from cache,
    a 4-D transpose of the numbers took about 15% longer)."""
    k, h = rows.shape[0], rows.shape[1]
    row = _void(width * rows.itemsize)
    out = scratch[:k * full * h * row.itemsize]
    np.copyto(out.view(row).reshape(k, full, h), rows[:, :, :full * width].view(row).transpose(0, 2, 1))
    return out


@functools.lru_cache(maxsize=64)
def _void(nbytes: int) -> np.dtype:
    return np.dtype((np.void, nbytes))


def _scratch(held: np.ndarray | None, nbytes: int) -> np.ndarray:
    return held if held is not None and held.size >= nbytes else np.empty(nbytes, np.uint8)


class BandHasher:
    """xxh3-64 of a band's tiles, fed its rows in order (columns from a tile edge on, cut every
    ``width``): each block of rows is copied to tile order and hashed while in cache, so memory
    stays bounded and xxhash sees long contiguous pieces."""

    def __init__(self, ntiles: int, width: int) -> None:
        self.width, self.hashers = width, [xxhash.xxh3_64() for _ in range(ntiles)]
        self._scratch: np.ndarray | None = None

    def update(self, rows: np.ndarray) -> None:
        """``rows``: a 2-D array (rows x the columns of the tiles)."""
        if rows.strides[-1] != rows.itemsize:  # tile rows are copied whole: each must be contiguous
            rows = np.ascontiguousarray(rows)
        w, nt = self.width, len(self.hashers)
        ncols = rows.shape[1]
        full = min(nt, ncols // w)
        step = max(1, checksum.HASH_BLOCK_BYTES // max(1, ncols * rows.itemsize))
        for r in range(0, rows.shape[0], step):
            block = rows[r:r + step]
            if full:
                self._scratch = _scratch(self._scratch, block.shape[0] * full * w * rows.itemsize)
                t = _tile_order(block[None], w, full, self._scratch)
                _feed(self.hashers[:full], t, t.size // full)
            if full < nt:  # the narrower last tile column
                self.hashers[full].update(np.ascontiguousarray(block[:, full * w:]).view(np.uint8))

    def digests(self) -> list[int]:
        return [h.intdigest() for h in self.hashers]

    def reset(self) -> None:
        self.hashers = [xxhash.xxh3_64() for _ in self.hashers]


def _feed(hashers: list, raw: np.ndarray, size: int) -> None:
    """``hashers[i].update`` with the i-th ``size``-byte piece of ``raw``, in one C-level loop."""
    deque(map(xxhash.xxh3_64.update, hashers, raw[:len(hashers) * size].reshape(len(hashers), size)), maxlen=0)


def band_digests(rows: np.ndarray, width: int) -> list[int]:
    """Tile digests of a band's ``rows`` (columns start on a tile boundary)."""
    h = BandHasher(-(-rows.shape[1] // width), width)
    h.update(rows)
    return h.digests()


class TileHasher:
    """Tile digests of a dataset whose flat bytes arrive in order, in pieces of any size: whole rows
    are hashed straight from the piece; only a row cut by a piece boundary is staged."""

    def __init__(self, grid: TileGrid, dtype: np.dtype) -> None:
        self.grid, self.row, self.digests = grid, 0, np.empty(grid.count, np.uint64)
        self._band = BandHasher(grid.nc, grid.tile_cols)
        self._stage, self._staged = np.empty(grid.cols, dtype), 0
        self._tiles: np.ndarray | None = None  # bytes of whole bands in tile order (_whole_bands)

    def advance(self, flat: np.ndarray) -> None:
        cols, pos = self.grid.cols, 0
        if self._staged:
            take = min(cols - self._staged, flat.size)
            self._stage[self._staged:self._staged + take] = flat[:take]
            self._staged, pos = self._staged + take, take
            if self._staged == cols:
                self._rows(self._stage.reshape(1, cols))
                self._staged = 0
        whole = (flat.size - pos) // cols
        if whole:
            self._rows(flat[pos:pos + whole * cols].reshape(whole, cols))
            pos += whole * cols
        if pos < flat.size:
            self._stage[:flat.size - pos] = flat[pos:]
            self._staged = flat.size - pos

    def _rows(self, rows: np.ndarray) -> None:
        g = self.grid
        while rows.shape[0]:
            band = self.row // g.tile_rows
            whole = min(rows.shape[0], g.rows - self.row) // g.tile_rows if self.row % g.tile_rows == 0 else 0
            if whole:  # bands wholly inside this piece: each tile hashed in one call
                self._whole_bands(rows[:whole * g.tile_rows], band)
                rows, self.row = rows[whole * g.tile_rows:], self.row + whole * g.tile_rows
                continue
            end = g.row_span(band)[1]
            n = min(rows.shape[0], end - self.row)
            self._band.update(rows[:n])
            rows, self.row = rows[n:], self.row + n
            if self.row == end:
                self.digests[band * g.nc:(band + 1) * g.nc] = self._band.digests()
                self._band.reset()

    def _whole_bands(self, rows: np.ndarray, first: int) -> None:
        """Digests of the full-height bands ``first, first + 1, ...`` that ``rows`` holds exactly:
        about a megabyte of bands at a time is copied to tile order, then each tile is hashed in
        one call (one copy and one call per tile instead of a streaming hasher per band)."""
        g = self.grid
        h, w, nc = g.tile_rows, g.tile_cols, g.nc
        full = g.cols // w  # tile columns of full width; a narrower last one is hashed apart
        per = max(1, checksum.HASH_BLOCK_BYTES // (h * g.cols * rows.itemsize))  # bands per copy
        nb = rows.shape[0] // h
        for b in range(0, nb, per):
            k = min(per, nb - b)
            block = rows[b * h:(b + k) * h].reshape(k, h, g.cols)
            out = self.digests[(first + b) * nc:(first + b + k) * nc].reshape(k, nc)
            if full:
                self._tiles = _scratch(self._tiles, k * full * h * w * rows.itemsize)
                t = _tile_order(block, w, full, self._tiles)
                out[:, :full] = chunk_digests(t, h * w * rows.itemsize).reshape(k, full)
            if full < nc:
                edge = raw_bytes(np.ascontiguousarray(block[:, :, full * w:]))
                out[:, full] = chunk_digests(edge, edge.size // k)


@dataclass(frozen=True)
class TileRead:
    """One hyperslab of a tile plan: tile columns ``first..last`` of the consecutive tile
    ``bands`` (none when ``last < first``), plus the tile columns ``cached`` beside them."""

    bands: tuple[int, ...]
    first: int
    last: int
    cached: tuple[int, ...] = ()


@dataclass(frozen=True)
class TilePlan:
    """The tiles a verified read needs: the tile-aligned box ``rows`` x ``cols`` holding them and
    the reads that fetch them."""

    grid: TileGrid
    rows: tuple[int, int]
    cols: tuple[int, int]
    reads: tuple[TileRead, ...]

    def bytes(self, item: int, cached: bool = True) -> int:
        """Bytes the plan reads (``cached=False``: as if no tile were cached)."""
        g = self.grid
        total = 0
        for t in self.reads:
            j0, j1 = (t.first, t.last) if cached or not t.cached else \
                (min(t.first, *t.cached), max(t.last, *t.cached))
            if j1 >= j0:
                c0, c1 = g.col_span(j0, j1)
                total += (g.row_span(t.bands[-1])[1] - g.row_span(t.bands[0])[0]) * (c1 - c0)
        return total * item


def tile_plan(grid: TileGrid, runs, cached) -> TilePlan:
    """Which tiles the runs ``(start, count, stride, block)`` of the flattening touch; tiles at the
    edge of a band's range for which ``cached(band, column)`` holds are taken from a cache. A run
    inside one column range, its rows a multiple of the row length apart (a box's rows), touches
    its tile columns only; any other run, whole tile bands."""
    cols, h, w = grid.cols, grid.tile_rows, grid.tile_cols
    need = np.zeros((grid.nr, grid.nc), dtype=bool)
    for start, count, stride, block in runs:
        r, c = divmod(start, cols)
        if c + block <= cols and (count == 1 or stride == cols):  # consecutive rows: a range of bands
            need[r // h:(r + count - 1) // h + 1, c // w:(c + block - 1) // w + 1] = True
        elif c + block <= cols and stride % cols == 0:
            rows = r + np.arange(count, dtype=np.int64) * (stride // cols)
            need[np.unique(rows // h), c // w:(c + block - 1) // w + 1] = True
        else:
            last = (start + (count - 1) * stride + block - 1) // cols
            need[r // h:last // h + 1, :] = True
    bands = np.flatnonzero(need.any(axis=1))
    used = np.flatnonzero(need.any(axis=0))
    reads: list[TileRead] = []
    for b in (int(x) for x in bands):
        js = np.flatnonzero(need[b])
        j0, j1 = int(js[0]), int(js[-1])
        lo, hi = j0, j1
        while lo <= hi and cached(b, lo):
            lo += 1
        while hi >= lo and cached(b, hi):
            hi -= 1
        held = tuple(range(j0, lo)) + tuple(range(hi + 1, j1 + 1))
        prev = reads[-1] if reads else None
        if prev is not None and prev.bands[-1] == b - 1 and (prev.first, prev.last) == (lo, hi) \
                and not prev.cached and not held:  # one hyperslab for consecutive bands alike
            reads[-1] = TileRead(prev.bands + (b,), lo, hi)
        else:
            reads.append(TileRead((b,), lo, hi, held))
    return TilePlan(grid, (grid.row_span(int(bands[0]))[0], grid.row_span(int(bands[-1]))[1]),
                    grid.col_span(int(used[0]), int(used[-1])), tuple(reads))
