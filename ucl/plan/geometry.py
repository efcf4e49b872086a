"""Geometries: the copy rows that cover one target piece from a tensor's deduplicated sources,
relative to the tensor's source list, and the padding fills inside the piece. A geometry is found
once and used by every target piece that has it (layers repeat geometry; the kinds of one flat
statement share their pieces), so a plan's cost follows its distinct pieces, not its ranks.

Pieces are found in batches (every new piece of a tensor at once) with numpy: each piece and each
source is cut into boxes (one run per dim), every overlapping (target box, source box) pair is one
row, and rows that continue each other are merged (:func:`coalesce`). The rows are those of the
per-piece intersection of run lists: the same set of boxes, merged the same way, in an order that
depends only on their values.
"""
from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from ..errors import PlanError
from ..layout.algebra import I64, product
from .ir import BOX_COLUMNS, COPY_COLUMNS, column_dtype, int_dtype, sorted_distinct

_PAIRS_AT_ONCE = 1 << 21  # (target box, source box) pairs tested in one numpy call: bounds memory


def pad_cols(a: np.ndarray, K: int, fill: int) -> np.ndarray:
    """(rows, nd) -> (rows, K) with leading columns set to ``fill``."""
    rows, nd = a.shape
    if nd == K:
        return a
    return np.concatenate([np.full((rows, K - nd), fill, dtype=I64), a], axis=1)


def piece_boxes(pieces: list, nd: int) -> tuple[np.ndarray, np.ndarray]:
    """Every piece as boxes: (owner piece index (B,), runs (B, nd, 3) of global start, local
    start, length), each piece's boxes in row-major order of its runs."""
    if not pieces:
        return np.zeros(0, dtype=I64), np.zeros((0, nd, 3), dtype=I64)
    if nd == 0:
        return np.arange(len(pieces), dtype=I64), np.zeros((len(pieces), 0, 3), dtype=I64)
    segs = [d.segs for p in pieces for d in p]
    runs = np.array([len(s) for s in segs], dtype=I64).reshape(len(pieces), nd)
    flat = np.concatenate(segs)
    if not (runs - 1).any():  # the common case: one run per dim
        return np.arange(len(pieces), dtype=I64), flat.reshape(len(pieces), nd, 3)
    # every piece's boxes, the product of its dims' runs (row-major, the last dim's runs fastest)
    first = (np.cumsum(runs.ravel()) - runs.ravel()).reshape(len(pieces), nd)
    per_piece = np.prod(runs, axis=1)
    owner = np.repeat(np.arange(len(pieces), dtype=I64), per_piece)
    within = np.arange(len(owner), dtype=I64) - np.repeat(np.cumsum(per_piece) - per_piece, per_piece)
    boxes = np.empty((len(owner), nd, 3), dtype=I64)
    for d in range(nd - 1, -1, -1):
        count = runs[owner, d]
        boxes[:, d, :] = flat[first[owner, d] + within % count]
        within //= count
    return owner, boxes


class HeldKeys(NamedTuple):
    """One holding's pieces as bytes, for comparing pieces without per-dim numpy work: each dim is
    numbered by its geometry (:class:`PieceKeys`), a piece is its dims' numbers, so equal bytes
    are equal pieces of a tensor (piece ``i`` is ``sig[i * 8 * ndim:(i + 1) * 8 * ndim]``)."""

    sig: bytes  # every piece's dim numbers, as int64 (a scalar's: how many): equal for equal holdings
    volume: int  # elements of all pieces
    volumes: tuple[int, ...] | None  # each piece's elements, where some piece has none (else None)
    width: int  # bytes of one piece's key (8 per dim)

    def keys(self, n: int) -> list[bytes]:
        """The keys of the holding's ``n`` pieces (b"" for a scalar's: all equal)."""
        w = self.width
        return [self.sig[i * w:(i + 1) * w] for i in range(n)]


@dataclass(frozen=True, eq=False)
class PieceKeys:
    """:func:`held_keys`' memo for one plan: a flat buffer's cut recurs on every pipeline stage of
    the same depth and for every kind of its statement (shared lists), so each list is turned into
    bytes once; dims are numbered by geometry (equal runs, padding and extent: one number)."""

    lists: dict[int, HeldKeys] = field(default_factory=dict)  # by id of a piece list (alive in its map)
    # a DimLayout (compared by identity, alive in its map; the object, not its id: no int per key) -> its number
    dims: dict = field(default_factory=dict)
    numbers: dict[bytes, int] = field(default_factory=dict)  # a dim's geometry as bytes -> number
    elements: list[int] = field(default_factory=list)  # by number: a dim's elements (its geometry's)
    # equal keys as one object: half the lists of a 131,072-rank plan repeat another's (some
    # 50,000 keys, volumes and tuples that would otherwise outlive the loop to the table's peak)
    shared: dict[bytes, HeldKeys] = field(default_factory=dict)


def held_keys(memo: PieceKeys, pieces: list) -> HeldKeys:
    """:class:`HeldKeys` of ``pieces`` (a holding's piece list), found once per list in ``memo``."""
    found = memo.lists.get(id(pieces))
    if found is None:
        dims, numbers, elements, ids, volumes = memo.dims, memo.numbers, memo.elements, [], []
        for p in pieces:
            v = 1
            for d in p:
                dim = dims.get(d)
                if dim is None:  # without numpy calls on these tiny arrays: some 10^5 dims
                    segs, fills = d.segs.astype(I64, copy=False), d.fills.astype(I64, copy=False)
                    geometry = array("q", (len(segs), len(fills), d.local)).tobytes() + segs.tobytes() + fills.tobytes()
                    dim = dims[d] = numbers.setdefault(geometry, len(numbers))
                    if dim == len(elements):
                        elements.append(sum([r[2] for r in segs.tolist()]))
                ids.append(dim)
                v *= elements[dim]
            volumes.append(v)
        volumes = tuple(volumes)
        # the lists (and their dims) are alive in the plan's ShardMaps while the memo is used
        nd = len(pieces[0]) if pieces else 0
        found = HeldKeys(array("q", ids if nd else [len(pieces)]).tobytes(), sum(volumes),
                         volumes if 0 in volumes else None, 8 * nd)
        same = memo.shared.setdefault(found.sig, found)  # equal bytes and width: equal pieces, equal volumes
        if same.width == found.width:
            found = same
        memo.lists[id(pieces)] = found
    return found


def fill_boxes(piece) -> np.ndarray:
    """Local boxes of a piece that are padding: (rows, nd, 2) of (local start, length)."""
    if not any(len(d.fills) for d in piece):  # the common case: no padding at all
        return np.zeros((0, len(piece), 2), dtype=I64)
    per_dim = []
    for d in piece:
        runs = [np.concatenate([d.segs[:, 1:3], np.zeros((len(d.segs), 1), dtype=I64)], axis=1),
                np.concatenate([d.fills, np.ones((len(d.fills), 1), dtype=I64)], axis=1)]
        per_dim.append(np.concatenate(runs))
    prod = product(per_dim)  # (rows, nd, 3)
    is_fill = prod[:, :, 2].any(axis=1)
    return prod[is_fill][:, :, :2]


def pieces_rows(t, pieces: list, volumes: list[int], src_boxes: tuple[np.ndarray, np.ndarray]):
    """Rows covering each of ``pieces`` (target pieces of tensor ``t``) from the source boxes
    ``src_boxes`` (:func:`piece_boxes` of the tensor's deduplicated sources, owner = source index):
    (piece (n,), global start, dst local start, src local start, size (n, nd each), source index
    (n,)), merged by :func:`coalesce`, grouped by piece in order. Proves each piece is covered
    exactly once by its ``volumes`` entry (UCL314 names the first piece that is not)."""
    nd = len(t.shape)
    owner, tb = piece_boxes(pieces, nd)
    src_of, sb = src_boxes
    a, b = _overlapping(tb, sb)
    ta, sbb = tb[a], sb[b]
    lo = np.maximum(ta[:, :, 0], sbb[:, :, 0])
    size = np.minimum(ta[:, :, 0] + ta[:, :, 2], sbb[:, :, 0] + sbb[:, :, 2]) - lo
    dl = ta[:, :, 1] + lo - ta[:, :, 0]
    sl = sbb[:, :, 1] + lo - sbb[:, :, 0]
    piece = owner[a]
    got = _sums(piece, np.prod(size, axis=1, dtype=I64), len(pieces))  # a scalar's box holds 1 element
    want = np.asarray(volumes, dtype=I64)
    bad = np.flatnonzero(got != want)
    if len(bad):
        i = int(bad[0])
        raise PlanError(f"{t.name} ({t.kind}): a target box of {int(want[i])} elements found {int(got[i])} "
                        "source elements", code="UCL314")
    return coalesce(piece, lo, dl, sl, size, src_of[b])


def _overlapping(tb: np.ndarray, sb: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every (target box, source box) pair that overlaps, as index arrays. Candidates come from an
    interval join along the dim that yields the fewest (sources sorted by start there: a source
    that ends after a target box starts begins at most its longest length before it), then are
    tested in every dim."""
    P, Q, nd = len(tb), len(sb), tb.shape[1]
    if not P or not Q:
        return np.zeros(0, dtype=I64), np.zeros(0, dtype=I64)
    if nd == 0:  # scalars: every pair
        return np.repeat(np.arange(P, dtype=I64), Q), np.tile(np.arange(Q, dtype=I64), P)
    best = None
    for d in range(nd):
        order = np.argsort(sb[:, d, 0], kind="stable")
        starts = sb[order, d, 0]
        first = np.searchsorted(starts, tb[:, d, 0] - sb[:, d, 2].max(), side="right")
        count = np.maximum(np.searchsorted(starts, tb[:, d, 0] + tb[:, d, 2], side="left") - first, 0)
        total = int(count.sum())
        if best is None or total < best[0]:
            best = (total, order, first, count)
    total, order, first, count = best
    t_lo, t_hi = tb[:, :, 0], tb[:, :, 0] + tb[:, :, 2]
    s_lo, s_hi = sb[:, :, 0], sb[:, :, 0] + sb[:, :, 2]
    out_a, out_b = [], []
    ends = np.cumsum(count)
    lo = 0
    while lo < P:  # in slices of about _PAIRS_AT_ONCE candidates: bounds memory
        hi = max(lo + 1, int(np.searchsorted(ends, (ends[lo - 1] if lo else 0) + _PAIRS_AT_ONCE, side="right")))
        c = count[lo:hi]
        a = np.repeat(np.arange(lo, hi, dtype=I64), c)
        within = np.arange(len(a), dtype=I64) - np.repeat(np.cumsum(c) - c, c)
        b = order[np.repeat(first[lo:hi], c) + within]
        keep = np.all((t_lo[a] < s_hi[b]) & (s_lo[b] < t_hi[a]), axis=1)
        out_a.append(a[keep])
        out_b.append(b[keep])
        lo = hi
    return np.concatenate(out_a), np.concatenate(out_b)


def _sums(group: np.ndarray, values: np.ndarray, n: int) -> np.ndarray:
    """Exact int64 sums of ``values`` per ``group`` (bincount would sum in float64)."""
    out = np.zeros(n, dtype=I64)
    np.add.at(out, group, values)
    return out


def coalesce(piece, g, dl, sl, n, idx):
    """Merge rows of one target piece that continue each other along a dim in global, target and
    source coordinates alike (same source, same extent in the other dims): fewer, larger I/O calls.
    Done per geometry, before rows are repeated over replicas, so it costs little. Rows of each
    piece end in an order that depends only on their values."""
    nd = g.shape[1]
    for d in range(nd):
        if len(idx) < 2:
            break
        others = [k for k in range(nd) if k != d]
        keys = [piece, idx] + [a[:, k] for a in (g, dl, sl, n) for k in others]
        order = np.lexsort([g[:, d]] + keys[::-1])
        piece, g, dl, sl, n, idx = piece[order], g[order], dl[order], sl[order], n[order], idx[order]
        same = (piece[1:] == piece[:-1]) & (idx[1:] == idx[:-1])
        for a in (g, dl, sl, n):
            for k in others:
                same &= a[1:, k] == a[:-1, k]
        for a in (g, dl, sl):
            same &= a[1:, d] == a[:-1, d] + n[:-1, d]
        if not same.any():
            continue
        group = np.concatenate([[0], np.cumsum(~same)])
        first = np.concatenate([[0], np.flatnonzero(~same) + 1])
        piece, g, dl, sl, idx = piece[first], g[first], dl[first], sl[first], idx[first]
        size = n[first].copy()
        size[:, d] = _sums(group, n[:, d], len(first))
        n = size
    return piece, g, dl, sl, n, idx


class Uses:
    """Where geometries are used: one entry per target piece."""

    def __init__(self):
        self.geo, self.tensor, self.dst_set, self.dst_slot, self.src_base = [], [], [], [], []
        # uses added by :meth:`add_many`: (geo, tensor, dst_set, dst_slot, src_base), the tensor
        # and source base as ints (one per call: not repeated until :meth:`take`)
        self.chunks: list[tuple] = []

    def add(self, geo: int, tensor: int, dst_set: int, dst_slot: int, src_base: int) -> None:
        self.geo.append(geo)
        self.tensor.append(tensor)
        self.dst_set.append(dst_set)
        self.dst_slot.append(dst_slot)
        self.src_base.append(src_base)

    def add_many(self, geo: np.ndarray, tensor: int, dst_set: np.ndarray, dst_slot: np.ndarray, src_base: int) -> None:
        self.chunks.append((geo, tensor, dst_set, dst_slot, src_base))

    def take(self) -> tuple[np.ndarray, ...]:
        """(geo, tensor, dst_set, dst_slot, src_base): every use, those of :meth:`add` first, each
        column int32 where all its values fit (:func:`column_dtype`). Empties this object, each
        column's chunks freed as soon as it is joined (they are a full plan's largest inputs, alive
        until its tables are built)."""
        chunks, self.chunks = [list(ch) for ch in self.chunks], []
        lengths = np.array([len(ch[0]) for ch in chunks], dtype=I64)
        cols = []
        for k, head in enumerate((self.geo, self.tensor, self.dst_set, self.dst_slot, self.src_base)):
            parts = [ch[k] for ch in chunks]
            for ch in chunks:
                ch[k] = None
            parts = [np.asarray(head, dtype=I64)] + ([np.array(parts, dtype=I64)] if k in (1, 4) else parts)
            dtype = column_dtype(*parts)
            if k in (1, 4):  # one int per chunk
                parts[1] = np.repeat(parts[1].astype(dtype), lengths)
            cols.append(np.concatenate(parts, dtype=dtype))
            del parts
        self.geo, self.tensor, self.dst_set, self.dst_slot, self.src_base = [], [], [], [], []
        return tuple(cols)


class Geometries:
    """The rows of each distinct geometry (copies relative to the tensor's source list, and fills),
    stored once, in batches; :meth:`rows` lays them out for every use in a few numpy operations."""

    def __init__(self, K: int):
        self.K = K
        self.copy_chunks: list[tuple] = []  # (global, dst, src starts, size (rows, K)), source index
        self.copy_counts: list[np.ndarray] = []  # rows per geometry, chunk after chunk
        self.fills: dict[int, tuple] = {}  # geometry -> (dst start, size): the few with padding
        self.gaps: dict[tuple[int, int], int] = {}  # flat-buffer gap (start, length) -> geometry
        self.count = 0

    def reserve(self) -> int:
        """The id of the next geometry; its rows come with the next :meth:`add_batch`."""
        self.count += 1
        return self.count - 1

    def add_batch(self, batch, n_geos: int, fill_boxes_of: list) -> None:
        """Rows of the last ``n_geos`` reserved geometries (:func:`pieces_rows` of their pieces,
        in order) and each one's padding boxes."""
        K = self.K
        piece, g, dl, sl, n, idx = batch
        # each int32 where its values fit: a full plan's geometries are some 10^5 rows
        cols = (pad_cols(g, K, 0), pad_cols(dl, K, 0), pad_cols(sl, K, 0), pad_cols(n, K, 1), idx)
        self.copy_chunks.append(tuple(a.astype(column_dtype(a), copy=False) for a in cols))
        self.copy_counts.append(np.bincount(piece, minlength=n_geos).astype(I64))
        first = self.count - n_geos
        for i, fb in enumerate(fill_boxes_of):
            if len(fb):
                self.fills[first + i] = (pad_cols(fb[:, :, 0], K, 0), pad_cols(fb[:, :, 1], K, 1))

    def add_fill(self, start: int, length: int) -> int:
        """The geometry of a flat-buffer gap (no copies): one per distinct gap."""
        geo = self.gaps.get((start, length))
        if geo is None:
            geo = self.gaps[(start, length)] = self.reserve()
            self.copy_counts.append(np.zeros(1, dtype=I64))
            at = np.zeros((1, self.K), dtype=I64)
            at[0, -1] = start
            size = np.ones((1, self.K), dtype=I64)
            size[0, -1] = length
            self.fills[geo] = (at, size)
        return geo

    def rows(self, uses: Uses, flat_fills: Uses, src_rank: np.ndarray, src_slot: np.ndarray):
        """(copies, fills): every use's rows; copies sorted by source rank, slot and start. Consumes
        this object and both :class:`Uses`: the copy table of a full plan is its largest part
        (some 10^6 rows), so each input is freed once read (they would otherwise add to its peak)."""
        K = self.K
        geo, tensor, dst_set, dst_slot, src_base = uses.take()
        fills = self._fills((geo, tensor, dst_set, dst_slot), flat_fills.take()[:4])
        empty = np.zeros((0, K), dtype=I64)
        chunks, self.copy_chunks = self.copy_chunks, []
        cols = list(zip(*chunks)) or [[empty]] * 4 + [[np.zeros(0, dtype=I64)]]
        del chunks
        g, dl, sl, n = (np.concatenate(x) for x in cols[:4])
        idx = np.concatenate(cols[4])
        del cols
        counts = np.concatenate(self.copy_counts) if self.copy_counts else np.zeros(0, dtype=I64)
        self.copy_counts = []
        row, use = gather(counts, geo)
        del geo, counts
        # a source index is below the number of sources: int32 where that fits
        source = src_base[use].astype(int_dtype(0, len(src_rank)), copy=False)
        del src_base
        source += idx.astype(source.dtype)[row]
        del idx
        # Sequential reads: rows by source rank (file), then dataset, then position; sorted before
        # the other columns are gathered, so the table is built once, in its final order.
        order = copy_order(src_rank, src_slot, sl, source, row)
        copies = _table(len(order), K, {"tensor": column_dtype(tensor), "dst_set": column_dtype(dst_set),
                                        "dst_slot": column_dtype(dst_slot), "src_rank": column_dtype(src_rank),
                                        "src_slot": column_dtype(src_slot), "src_start": column_dtype(sl),
                                        "dst_start": column_dtype(dl), "global_start": column_dtype(g),
                                        "size": column_dtype(n)})
        # each column gathered in turn into the table, every input freed after its last use;
        # mode="clip" writes straight into ``out`` (the default buffers it), so an index that wrapped
        # (a narrowing bound gone wrong) would be clamped to a wrong row: check the ranges first
        for what, index, size in (("use", use, len(tensor)), ("source", source, len(src_rank)), ("row", row, len(sl))):
            if len(index) and not (0 <= int(index.min()) and int(index.max()) < size):
                raise PlanError(f"internal error: copy-table {what} index out of [0, {size})", code="UCL314")
        del index  # it still holds ``row``, about to be replaced by its sorted copy
        use = use[order]
        for k, col in (("tensor", tensor), ("dst_set", dst_set), ("dst_slot", dst_slot)):
            np.take(col, use, out=copies[k], mode="clip")
        del tensor, dst_set, dst_slot, use
        source = source[order]
        for k, col in (("src_rank", src_rank), ("src_slot", src_slot)):
            np.take(col, source, out=copies[k], mode="clip")
        del src_rank, src_slot, source
        row = row[order]
        del order
        for k, table in (("src_start", sl), ("dst_start", dl), ("global_start", g), ("size", n)):
            np.take(table, row, axis=0, out=copies[k], mode="clip")
        return copies, fills

    def _fills(self, *uses) -> dict[str, np.ndarray]:
        """The fill rows of every use in ``uses`` ((geo, tensor, dst_set, dst_slot) columns each), in order."""
        empty = np.zeros((0, self.K), dtype=I64)
        with_fills = sorted(self.fills)
        fcounts = np.zeros(self.count, dtype=I64)
        fcounts[with_fills] = [len(self.fills[i][0]) for i in with_fills]
        fstart = np.concatenate([empty] + [self.fills[i][0] for i in with_fills])
        fsize = np.concatenate([empty] + [self.fills[i][1] for i in with_fills])
        fills = {k: [] for k in ("tensor", "dst_set", "dst_slot", "dst_start", "size")}
        for u_geo, u_tensor, u_set, u_slot in uses:
            row, use = gather(fcounts, u_geo)
            for k, v in (("tensor", u_tensor), ("dst_set", u_set), ("dst_slot", u_slot)):
                fills[k].append(v[use])
            fills["dst_start"].append(fstart[row])
            fills["size"].append(fsize[row])
        return {k: np.concatenate(v).astype(I64, copy=False) for k, v in fills.items()}  # fills stay int64: few


def _table(rows: int, K: int, dtypes: dict[str, np.dtype]) -> dict[str, np.ndarray]:
    """An empty copy table of ``rows`` rows, columns of ``dtypes`` (:func:`column_dtype`), its
    columns views of one block: a full plan's (some 100 MB) is one allocation, which glibc maps
    apart from the heap and whose pages become resident only as they are written; columns
    allocated one by one among the build's temporaries leave heap holes that stay resident
    (measured: 15 MiB more peak on the 131k plan). The widest columns come first (each aligned)."""
    widths = [(k, 1) for k in COPY_COLUMNS] + [(k, K) for k in BOX_COLUMNS]
    widths.sort(key=lambda kw: -dtypes[kw[0]].itemsize)  # stable: table order within a width
    block = np.empty(rows * sum([w * dtypes[k].itemsize for k, w in widths]), dtype=np.uint8)
    out, at = {}, 0
    for k, w in widths:
        size = rows * w * dtypes[k].itemsize
        out[k] = block[at:at + size].view(dtypes[k]).reshape((rows, w) if k in BOX_COLUMNS else rows)
        at += size
    return {k: out[k] for k in COPY_COLUMNS + BOX_COLUMNS}


def copy_order(src_rank: np.ndarray, src_slot: np.ndarray, starts: np.ndarray, source: np.ndarray, row: np.ndarray,
               key_limit: int = 1 << 62) -> np.ndarray:
    """The order of copy rows (row ``i`` reads source ``source[i]`` at ``starts[row[i]]``) by source
    rank, then slot, then start: the order of a stable lexsort over those K + 2 row-sized columns,
    found as one stable sort of one int64 key per row (a numbering of the distinct (rank, slot)
    pairs times the number of distinct starts plus a numbering of the starts; equal values, equal
    numbers), so K + 2 keys are not alive at once at the plan's peak. Above ``key_limit`` distinct
    combinations (no plan comes near: it would need some 2^31 of each) the two numbers are lexsorted."""
    by_source, n_sources = _dense_ranks(src_rank, src_slot)
    by_start, n_starts = _dense_ranks(*(starts[:, k] for k in range(starts.shape[1])))
    if n_sources * max(n_starts, 1) >= key_limit:
        return np.lexsort((by_start[row], by_source[source]))
    key = by_source[source]
    del by_source
    key *= n_starts
    key += by_start[row]
    return np.argsort(key, kind="stable")


def _dense_ranks(*cols: np.ndarray) -> tuple[np.ndarray, int]:
    """Each position's rank among the distinct tuples of ``cols`` (the first column most
    significant; equal tuples, equal rank) and how many distinct tuples there are."""
    if not len(cols[0]):
        return np.zeros(0, dtype=I64), 0
    order, new = sorted_distinct(cols)
    rank = np.empty(len(order), dtype=I64)
    rank[order] = np.cumsum(new) - 1
    return rank, int(rank[order[-1]]) + 1


def gather(counts: np.ndarray, geo: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For uses of geometries ``geo`` whose row counts are ``counts``: (row of the concatenated
    geometry tables, use) for every output row, uses in order and each geometry's rows in order;
    int32 where every row, use and output position fits (a full plan's are some 10^6 each)."""
    counts_a = np.asarray(counts, dtype=I64)
    offsets = np.concatenate([np.zeros(1, dtype=I64), np.cumsum(counts_a, dtype=I64)])
    geo_a = np.asarray(geo, dtype=I64)
    m = counts_a[geo_a] if len(geo_a) else np.zeros(0, dtype=I64)
    first = np.cumsum(m) - m  # each use's first output position
    total = int(first[-1] + m[-1]) if len(m) else 0
    dtype = int_dtype(0, max(total, int(offsets[-1]), len(geo_a)))
    use = np.repeat(np.arange(len(geo_a), dtype=dtype), m)
    # output i of use u is row offsets[geo[u]] + (i - first[u]); |offsets - first| < 2**31 when int32
    row = np.repeat((offsets[geo_a] - first).astype(dtype), m)
    del m, first
    row += np.arange(total, dtype=dtype)
    return row, use
