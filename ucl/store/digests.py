"""A dataset's checksums computed in one pass over its bytes (docs/format.md): the whole checksum,
the flat chunk digests and the tile digests, about a megabyte at a time so each block is read from
memory once and hashed from cache; also fed piecewise (:class:`IncrementalChecksum`) and written
into a manifest entry (:func:`checksum_fields`)."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np
import xxhash

from . import checksum
from .checksum import (chunk_digests, chunk_size, chunk_table_digest, format_checksum, raw_bytes,
                       tile_table_digest)
from .tiles import TileGrid, TileHasher, tile_grid


@dataclass(frozen=True)
class Digests:
    """A dataset's checksums: the whole one, the flat chunk table (chunk bytes, digests) and the tile
    table (grid, digests, grid row-major); tables are None where the dataset carries none."""

    whole: str
    chunks: tuple[int, np.ndarray] | None = None
    tiles: tuple[TileGrid, np.ndarray] | None = None

    def table(self) -> np.ndarray | None:
        """The dataset's values in a rank file's ``ucl_tables``: its chunk digests, then its tile
        digests (row-major); None when it has neither (docs/format.md)."""
        parts = ([self.chunks[1]] if self.chunks is not None else []) + \
            ([self.tiles[1].reshape(-1)] if self.tiles is not None else [])
        return None if not parts else parts[0] if len(parts) == 1 else np.concatenate(parts)


def checksums(arr: np.ndarray, *, tiles: bool = True) -> Digests:
    """Every checksum of a storage array in one pass, about a megabyte at a time (each block is
    read from memory once, then hashed from cache). ``tiles=False``: no tile table, as for a
    dataset that carries none (a writer may leave it out, docs/format.md)."""
    h, flat = IncrementalChecksum(arr.shape, arr.dtype, tiles=tiles), arr.reshape(-1)
    h.advance(0, flat)  # in blocks of about a megabyte
    return h.result(flat.size)


def copy_checksummed(dst: np.ndarray, src: np.ndarray, *, tiles: bool = True) -> Digests:
    """Copy ``src`` into ``dst`` (C-contiguous, same shape and dtype) and return
    ``checksums(dst, tiles=tiles)``, hashing each block of about a megabyte right after copying
    it, while it is still in cache: the checksums cost about what hashing from cache costs, not a
    second pass over memory (tile digests still cost a copy to tile order: about as much again)."""
    if dst.shape != src.shape or dst.dtype != src.dtype or not (dst.flags.c_contiguous and src.flags.c_contiguous):
        raise ValueError(f"copy_checksummed: {dst.dtype} {dst.shape} from {src.dtype} {src.shape}, "
                         "both C-contiguous, alike")
    h, out, flat = IncrementalChecksum(dst.shape, dst.dtype, tiles=tiles), dst.reshape(-1), src.reshape(-1)
    step = h.step
    for i in range(0, flat.size, step):
        np.copyto(out[i:i + step], flat[i:i + step])
        h.advance(i, out[i:i + step])
    return h.result(flat.size)


def _block_elements(shape: tuple[int, ...], itemsize: int, grid: TileGrid | None = None) -> int:
    """Elements hashed per step: about ``checksum.HASH_BLOCK_BYTES``; with tiles (``grid``), whole
    tile bands where a band fits (each tile then hashed in one call), else whole rows."""
    if grid is None:
        return max(1, checksum.HASH_BLOCK_BYTES // max(1, itemsize))
    band = grid.tile_rows * grid.cols * itemsize
    if band <= checksum.HASH_BLOCK_BYTES:
        return grid.tile_rows * grid.cols * (checksum.HASH_BLOCK_BYTES // band)
    return grid.cols * max(1, checksum.HASH_BLOCK_BYTES // (grid.cols * itemsize))


class IncrementalChecksum:
    """Checksums (whole, per chunk, per tile) of a dataset filled piecewise: hashed on the fly while
    pieces arrive in flat order."""

    def __init__(self, shape: tuple[int, ...], dtype: np.dtype, *, tiles: bool = True) -> None:
        dtype = np.dtype(dtype)
        nbytes = math.prod(shape) * dtype.itemsize
        self.hasher, self.next_flat, self.in_order = xxhash.xxh3_64(), 0, True
        self.size = chunk_size(nbytes)
        self.chunks: list[int] = []
        self.chunk, self.chunk_fill = xxhash.xxh3_64(), 0
        grid = tile_grid(tuple(shape), dtype.itemsize) if tiles else None
        self.tiles = TileHasher(grid, dtype) if grid is not None else None
        self.step = _block_elements(tuple(shape), dtype.itemsize, grid)

    def advance(self, start: int, flat: np.ndarray) -> None:
        if self.in_order and start == self.next_flat:
            flat, step, pos = flat.reshape(-1), self.step, 0
            while pos < flat.size:  # blocks end on multiples of step: read from memory once, then from cache
                end = min(flat.size, (start + pos) // step * step + step - start)
                self._block(flat[pos:end])
                if end - pos == step:
                    _offer_gil()
                pos = end
            self.next_flat += flat.size
        elif flat.size:
            self.in_order = False  # out of order or overwrite: caller re-reads at close

    def _block(self, flat: np.ndarray) -> None:
        raw = raw_bytes(flat)
        self.hasher.update(raw)
        if self.size:
            self._advance_chunks(raw)
        if self.tiles is not None:
            self.tiles.advance(flat)

    def _advance_chunks(self, raw: np.ndarray) -> None:
        size, pos, n = self.size, 0, raw.size
        if self.chunk_fill:  # finish the chunk an earlier piece began
            pos = min(size - self.chunk_fill, n)
            self.chunk.update(raw[:pos])
            self.chunk_fill += pos
            if self.chunk_fill < size:
                return
            self.chunks.append(self.chunk.intdigest())
            self.chunk, self.chunk_fill = xxhash.xxh3_64(), 0
        stop = pos + (n - pos) // size * size  # whole chunks: one call each (equal to streaming them)
        if stop > pos:
            self.chunks.extend(chunk_digests(raw[pos:stop], size).tolist())
        if stop < n:
            self.chunk.update(raw[stop:])
            self.chunk_fill = n - stop

    def result(self, total: int) -> Digests | None:
        """The dataset's :class:`Digests` if exactly ``total`` elements arrived in order, else None."""
        if not (self.in_order and self.next_flat == total):
            return None
        chunks = self.chunks + ([self.chunk.intdigest()] if self.chunk_fill else [])
        return Digests(format_checksum(self.hasher.hexdigest()),
                       (self.size, np.array(chunks, dtype=np.uint64)) if self.size else None,
                       (self.tiles.grid, self.tiles.digests) if self.tiles is not None else None)


# After each block the hasher offers the GIL to a waiting thread (a training thread back from a GPU
# wait): one that lost the race for it when the hasher last released it otherwise waits out the
# switch interval (5 ms). bench/tile_hash.py, 2-core VM: a thread alternating 2 ms of Python with
# 1 ms GIL-free waits stepped at 1.55x its time alone beside the hashing without the offer, 1.02x
# with it (hashing meanwhile 2.5 and 1.7 GB/s). The price: beside a thread that never waits (pure
# Python), the hashing gets little (0.2 GB/s instead of 1.0); and on a host with more runnable
# threads than cores, each offer may lend the core to another for a time slice.
_offer_gil = getattr(os, "sched_yield", lambda: None)  # releases the GIL while the kernel reschedules


def checksum_fields(d: Digests) -> dict[str, str]:
    """A manifest entry's checksum keys: ``checksum`` (the whole dataset), ``chunks``
    (:func:`chunk_table_digest`) for chunked datasets and ``tiles`` (:func:`tile_table_digest`)
    for tiled ones."""
    out = {"checksum": d.whole}
    if d.chunks is not None:
        out["chunks"] = chunk_table_digest(d.whole, *d.chunks)
    if d.tiles is not None:
        grid, digests = d.tiles
        out["tiles"] = tile_table_digest(d.whole, (grid.tile_rows, grid.tile_cols), digests)
    return out
