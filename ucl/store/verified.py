"""Verified partial reads of one stored dataset: strided runs read with every byte checked against
the dataset's checksum chunks or tiles (docs/format.md) before use, reading the fewest bytes the
tables allow, and the chunks and edge tiles neighbouring reads share kept once verified. The
reader (``Checkpoint.read_runs(verify=True)``) binds the tables to the manifest; this reads by them."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ..errors import StoreError
from ..plan.buffers import Arena
from . import h5
from .checksum import checksum_of, chunk_digests, raw_bytes
from .tiles import TileGrid, TilePlan, band_digests, tile_plan
from .manifest import DatasetInfo
from .runs import chunks_touched, columns_wanted, one_range


@dataclass(frozen=True)
class Verifiable:
    """A dataset to read verified: where its bytes are read (``src``: a ``raw``, ``packed`` or
    ``h5`` dataset), its manifest entry, its name in messages, its key in the cache of verified
    pieces, and its chunk and tile tables, bound to the manifest when first asked for (binding
    checks them, UCL406/UCL407, so a read that needs no tile table never binds it)."""

    src: Any
    info: DatasetInfo
    where: str
    ident: tuple[int, str]
    chunk_table: Callable[[], tuple[int, Any] | None]
    tile_table: Callable[[], tuple[TileGrid, Any] | None]


class VerifiedRuns:
    """Reads runs verified, keeping verified chunks and edge tiles in ``cache`` (an LRU, by the
    dataset's ``ident``) and assembling them in ``scratch``. Not thread-safe: the reader calls it
    under its lock."""

    def __init__(self, cache: h5.ChunkCache, scratch: Arena):
        self.cache, self.scratch = cache, scratch

    def read(self, ds: Verifiable, runs, out: np.ndarray) -> int:
        """``read_runs`` with every byte verified. Runs forming one flat range (a tensor inside a flat
        buffer, a block of whole rows) have the checksum chunks wholly inside it read straight into
        ``out`` and verified there (no bounce copy); the rest goes through :meth:`_chunks`.
        On a mismatch the error is raised and ``out`` may hold the bad bytes."""
        src, info = ds.src, ds.info
        table = ds.chunk_table()
        span = one_range(runs)
        if table is None or span is None:
            return self._chunks(ds, runs, out)
        a, b = span
        per = table[0] // info.storage_dtype.itemsize
        x0, x1 = -(-a // per) * per, (b if b == info.size else b // per * per)  # the chunks inside [a, b)
        if x1 - x0 < per:
            return self._chunks(ds, runs, out)
        inside = out[x0 - a:x1 - a]
        src.read_flat_into(x0, x1, inside)
        check_chunks(ds.where, info, inside, x0 // per, per, table[1])
        read = inside.nbytes
        if x0 > a:
            read += self._chunks(ds, [(a, 1, x0 - a, x0 - a)], out[:x0 - a])
        if b > x1:
            read += self._chunks(ds, [(x1, 1, b - x1, b - x1)], out[x1 - a:])
        return read

    def _chunks(self, ds: Verifiable, runs, out: np.ndarray) -> int:
        """``read_runs`` reading the whole checksum chunks around the runs, or the tiles around them
        when those hold fewer bytes (column blocks), each verified before use (a small dataset is
        one chunk). Verified chunks are kept in a small LRU, so boxes of the same dataset do not
        read them again. Returns the bytes read from disk."""
        info = ds.info
        item = info.storage_dtype.itemsize
        size = info.size
        table = ds.chunk_table()  # checked even when tiles are used
        tiles = ds.tile_table()
        per = table[0] // item if table is not None else max(size, 1)
        n = -(-size // per) if size else 0
        need = chunks_touched(runs, per, n)
        cache = self.cache
        if tiles is not None:  # by tiles when the tiles around the runs hold fewer bytes than the chunks
            plan = tile_plan(tiles[0], runs, lambda b, j: cache.get((*ds.ident, "tile", b, j)) is not None)
            if plan.bytes(item, cached=False) < int((np.minimum((need + 1) * per, size) - need * per).sum()) * item:
                return self._tiles(ds, tiles, plan, runs, out)
        have = {int(c): cache.get((*ds.ident, int(c))) for c in need}
        missing = [c for c, v in have.items() if v is None]
        digests = table[1] if table is not None else None
        # one read per run of consecutive missing chunks; every chunk verified before use
        groups = np.split(np.array(missing, dtype=np.int64), np.flatnonzero(np.diff(missing) != 1) + 1) if missing else []
        if len(need) and need[-1] - need[0] + 1 == len(need):
            # the usual case: one contiguous stretch of chunks, assembled in one span of warm scratch
            # memory (missing chunks read into their place, cached ones copied into theirs: no
            # buffer per group, no second copy of the stretch), the runs cut out with strided views
            c0 = int(need[0])
            base = c0 * per
            span = self.scratch.array((min((int(need[-1]) + 1) * per, size) - base,), info.storage_dtype)
            read = sum(self._group(ds, g, per, digests, span[int(g[0]) * per - base:])
                       for g in groups)
            for c, v in have.items():
                if v is not None:
                    span[c * per - base:c * per - base + v.size] = v
            pos = 0
            for start, count, stride, block in runs:
                n = count * block
                view = np.lib.stride_tricks.as_strided(span[start - base:], (count, block),
                                                       (stride * item, item), writeable=False)
                out[pos:pos + n].reshape(count, block)[...] = view
                pos += n
            return read
        read = 0
        for g in groups:
            buf = np.empty(min((int(g[-1]) + 1) * per, size) - int(g[0]) * per, info.storage_dtype)
            read += self._group(ds, g, per, digests, buf)
            for c in (int(x) for x in g):
                have[c] = buf[(c - int(g[0])) * per:(c - int(g[0]) + 1) * per]
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

    def _group(self, ds: Verifiable, g, per: int, digests, buf: np.ndarray) -> int:
        """Read the consecutive chunks ``g`` into the front of ``buf``, verify them (against the whole
        checksum where ``digests`` is None: a dataset verified whole), and keep the edge chunks,
        the ones neighbouring boxes share, in the LRU. Returns the bytes read."""
        src, info = ds.src, ds.info
        first, size = int(g[0]), info.size
        lo, hi = first * per, min((int(g[-1]) + 1) * per, size)
        buf = buf[:hi - lo]
        src.read_flat_into(lo, hi, buf)
        if digests is None:
            if checksum_of(buf) != info.checksum:
                raise StoreError(f"checksum mismatch in {ds.where} (elements 0..{size})", code="UCL407")
        else:
            check_chunks(ds.where, info, buf, first, per, digests)
        for c in {first, int(g[-1])}:
            self.cache.put((*ds.ident, c), buf[(c - first) * per:(c - first + 1) * per].copy())
        return buf.nbytes

    def _tiles(self, ds: Verifiable, tiles, plan: TilePlan, runs, out: np.ndarray) -> int:
        """``read_runs`` by tiles: one hyperslab per group of tile bands (the tiles a box touches in
        them), every tile verified before use; edge tiles kept in the LRU for neighbouring boxes."""
        src, info = ds.src, ds.info
        grid, digests = tiles
        (r0, r1), (c0, c1) = plan.rows, plan.cols
        buf = self.scratch.array((r1 - r0, c1 - c0), info.storage_dtype)
        cache, read = self.cache, 0
        # the cached tiles the plan counts on, held before this read's own puts can evict them
        held = {(b, j): cache.get((*ds.ident, "tile", b, j)) for t in plan.reads for b in t.bands for j in t.cached}
        want = columns_wanted(runs, grid.cols)
        for t in plan.reads:
            bands, j0, j1 = t.bands, t.first, t.last
            ra, rb = grid.row_span(bands[0])[0], grid.row_span(bands[-1])[1]
            ca, cb = grid.col_span(j0, j1) if j1 >= j0 else (0, 0)
            src.read_rows_into((ra, rb), (ca, cb), buf, (ra - r0, ca - c0))
            read += (rb - ra) * max(cb - ca, 0) * buf.itemsize
            for b in bands:
                br0, br1 = grid.row_span(b)
                if j1 >= j0:
                    got = band_digests(buf[br0 - r0:br1 - r0, ca - c0:cb - c0], grid.tile_cols)
                    for j, g in zip(range(j0, j1 + 1), got):
                        if g != int(digests[b * grid.nc + j]):
                            tc0, tc1 = grid.col_span(j, j)
                            raise StoreError(f"checksum mismatch in {ds.where} (tile {b},{j}: rows "
                                             f"{br0}..{br1}, columns {tc0}..{tc1})", code="UCL407")
                    for j in {j0, j1}:  # edge tiles the read takes part of are the ones neighbouring boxes share
                        tc0, tc1 = grid.col_span(j, j)
                        if not want[0] <= tc0 < tc1 <= want[1]:
                            cache.put((*ds.ident, "tile", b, j), buf[br0 - r0:br1 - r0, tc0 - c0:tc1 - c0].copy())
                for j in t.cached:
                    tc0, tc1 = grid.col_span(j, j)
                    buf[br0 - r0:br1 - r0, tc0 - c0:tc1 - c0] = held[(b, j)]
        flat, item, width, pos = buf.reshape(-1), buf.itemsize, c1 - c0, 0
        for start, count, stride, block in runs:
            r, c = divmod(start, grid.cols)
            if width == grid.cols:  # full rows: flat offsets
                off, step = start - r0 * grid.cols, stride
            else:  # a column block: every run stays in its columns (tile_plan)
                off, step = (r - r0) * width + c - c0, (stride // grid.cols) * width
            view = np.lib.stride_tricks.as_strided(flat[off:], (count, block), (step * item, item), writeable=False)
            out[pos:pos + count * block].reshape(count, block)[...] = view
            pos += count * block
        return read


def check_chunks(where: str, info: DatasetInfo, buf: np.ndarray, first: int, per: int, digests) -> None:
    """UCL407 unless ``buf`` (elements from chunk ``first`` on, whole chunks of ``per`` elements but
    the dataset's last) hashes chunk by chunk to ``digests[first:]``."""
    got = chunk_digests(raw_bytes(buf), per * info.storage_dtype.itemsize)
    bad = np.flatnonzero(got != np.asarray(digests[first:first + got.size], dtype=np.uint64))
    if bad.size:
        c = first + int(bad[0])
        raise StoreError(f"checksum mismatch in {where} (elements "
                         f"{c * per}..{min((c + 1) * per, info.size)})", code="UCL407")
