"""The compressed encoding of a dataset (docs/format.md, "Compressed datasets"): its bytes cut into
units (cells of ``group`` tile bands by one tile column of a tiled dataset, else runs of ``group``
checksum chunks, else the whole dataset), each unit split into byte planes (floats rotated first so
the exponent fills one plane, or in layout 1 offset and rotated by four; the transform is
``planes``') and each plane coded on its own with zstd or lz4, or kept raw where coding does not
shrink it. Pure: bytes in, bytes out; every length a
stored unit declares is checked against what its geometry allows before anything is allocated or
decoded. The writer works a unit at a time (a unit's temporaries fit in a core's cache), each plane
made straight into the stored bytes when it is kept raw, so Python runs a few statements per plane
of a unit, not per element, and numpy passes over each element only a few times."""
from __future__ import annotations

import math
import struct
import threading
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import xxhash

from ..errors import StoreError
from .checksum import chunk_size, format_checksum
from .tiles import tile_grid, TileGrid
from .planes import (LAYOUTS, MAX_OFFSET, OFFSET_FLOATS, has_layout, join_into, offset_elements, plane_into,
                     planes_of, scratch, split_planes, unit_offset)

CODECS = ("zstd", "lz4")
# zstd's fastest strategy with the smallest hash table and the longest minimum match: on exponent planes
# (a few bits of entropy a byte) matches are short and chance, so finding them costs time and ratio;
# this keeps zstd's Huffman-coded literals and little else (on 256 KiB exponent planes of the trained
# state of bench/compress.py: 1.6-3.8x faster than level 1, and 7-15% smaller)
ZSTD_PARAMS = dict(window_log=17, hash_log=6, chain_log=6, search_log=1, min_match=7, target_length=0)
UNIT_BYTES = 256 << 10  # a writer's units hold at least this many logical bytes where the dataset has them
MAX_UNIT_BANDS = 4  # ... but a tiled dataset's unit spans at most this many tile bands (row reads stay fine)
_RAW = 1 << 31  # a plane header's top bit: the plane is stored raw
_HEADER = struct.Struct("<I")
# a unit not in layout 0 starts with a layout header: a raw plane of no bytes (no plane is empty, so no
# version-3/4 unit starts so), then the layout and its offset, little-endian uint16 each
_LAYOUT = struct.Struct("<IHH")
LAYOUT_BYTES = _LAYOUT.size
LAYOUTS_SINCE = 5  # the format version that brought layout headers: an older checkpoint's unit has none
SAMPLE_ELEMENTS = 16 << 10  # a dataset's first elements, whose planes are coded to see which shrink
BLOCK_BYTES = 1 << 20  # units coded together (one task of a thread pool): about this many logical bytes
RUN_BYTES = 1 << 18  # smaller units split into planes together: fewer numpy calls, still in a core's cache


def check_codec(name: object) -> str | None:
    """``name`` as a codec (None/``"none"``: plain), or UCL418 naming the choices."""
    if name is None or name == "none":
        return None
    if name not in CODECS:
        raise StoreError(f"unknown compression {name!r}: choose one of none, {', '.join(CODECS)}", code="UCL418")
    coders(name)  # installed?
    return str(name)


@dataclass(frozen=True)
class Units:
    """How a dataset of ``shape`` is cut into coded units: the cells of ``grid`` row-major (each
    cell's bytes row by row within it), else consecutive ``chunk`` bytes of its flattening (the last
    may be short). ``grid`` is the tile grid with ``group`` tile bands to a row of cells."""

    shape: tuple[int, ...]
    itemsize: int
    grid: TileGrid | None
    chunk: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize

    @property
    def count(self) -> int:
        if self.grid is not None:
            return self.grid.count
        return -(-self.nbytes // self.chunk) if self.nbytes else 0

    def unit_bytes(self, u: int) -> int:
        """Logical bytes of unit ``u``."""
        g = self.grid
        if g is not None:
            b, j = divmod(u, g.nc)
            (r0, r1), (c0, c1) = g.row_span(b), g.col_span(j, j)
            return (r1 - r0) * (c1 - c0) * self.itemsize
        return min(self.chunk, self.nbytes - u * self.chunk)


def units_of(shape: Sequence[int], itemsize: int, group: int = 1) -> Units:
    """A dataset's units (docs/format.md): ``group`` tile bands of one tile column when it has a
    tile grid, else ``group`` consecutive checksum chunks, else one unit of the whole dataset
    (``group`` 1: the units of version-3 entries, which record none)."""
    shape = tuple(int(x) for x in shape)
    nbytes = math.prod(shape) * itemsize
    grid = tile_grid(shape, itemsize)
    if grid is not None:
        grid = TileGrid(grid.rows, grid.cols, min(grid.rows, grid.tile_rows * group), grid.tile_cols)
    size = chunk_size(nbytes)
    return Units(shape, itemsize, grid, min(nbytes, size * group) if size else max(nbytes, 1))


def group_for(shape: Sequence[int], itemsize: int) -> int:
    """The ``group`` a writer chooses: the least power of two giving units of at least UNIT_BYTES
    (fewer, larger units cost less per byte to code), at most MAX_UNIT_BANDS tile bands of a tiled
    dataset, and no more chunks or bands than the dataset has."""
    base = units_of(shape, itemsize)
    if base.grid is not None:
        g, top = base.grid, min(MAX_UNIT_BANDS, base.grid.nr)
        each = g.tile_rows * g.tile_cols * itemsize
    else:
        top, each = base.count, base.chunk
    group = 1
    while group < top and group * each < UNIT_BYTES:
        group *= 2
    return group


_LOCAL = threading.local()  # per thread: zstd contexts are not shared between threads


def coders(name: str) -> tuple[Callable[[Any], bytes], Callable[[Any, int], bytes]]:
    """(compress, decompress(data, exact size)) of a codec, made once per thread (a zstd context
    costs more to make than a unit costs to code); UCL418 if its package is missing."""
    made = getattr(_LOCAL, "codecs", None)
    if made is None:
        made = _LOCAL.codecs = {}
    if name not in made:
        made[name] = _make_codec(name)
    return made[name]


def _make_codec(name: str) -> tuple[Callable[[Any], bytes], Callable[[Any, int], bytes]]:
    try:
        if name == "zstd":
            import zstandard
            params = zstandard.ZstdCompressionParameters(strategy=zstandard.STRATEGY_FAST, **ZSTD_PARAMS)
            cctx, dctx = zstandard.ZstdCompressor(compression_params=params), zstandard.ZstdDecompressor()

            def unzstd(data: Any, n: int) -> bytes:
                # the frame's own declared size is checked before zstd allocates anything for it
                if zstandard.frame_content_size(data) != n:
                    raise ValueError("declared size differs from the unit's")
                return dctx.decompress(data, max_output_size=n)
            return cctx.compress, unzstd
        import lz4.block
        return (lambda data: lz4.block.compress(data, store_size=False),
                lambda data, n: lz4.block.decompress(data, uncompressed_size=n))
    except ImportError:
        raise StoreError(f"compression {name!r} needs its Python package ({'zstandard' if name == 'zstd' else 'lz4'}),"
                         " which is not installed", code="UCL418") from None


@dataclass(frozen=True)
class Coding:
    """How a writer codes a dataset's units: which planes it tries to code (``tries[p]`` False:
    stored raw untried; None: all tried), in which plane ``layout`` (0: floats rotated left by one;
    1: float32/bfloat16 offset by ``offset``, then rotated left by four)."""

    tries: tuple[bool, ...] | None = None
    layout: int = 0
    offset: int = 0

    def header(self) -> bytes:
        """The layout header each unit starts with (none in layout 0)."""
        return _LAYOUT.pack(_RAW, self.layout, self.offset) if self.layout else b""


def encode_unit(raw: np.ndarray, dtype: str, itemsize: int, codec: str, coding: Coding = Coding()) -> bytes:
    """One unit's stored bytes: its layout header (layout 1), then per plane a little-endian uint32
    header (its stored length; top bit set: raw) and the plane."""
    parts: list = [coding.header()]
    _pack(split_planes(raw, dtype, itemsize, coding.layout, coding.offset), codec, coding.tries, parts)
    return b"".join(parts)


def _pack(planes: Sequence[np.ndarray], codec: str, tries: Sequence[bool] | None, parts: list) -> int:
    """A unit's stored bytes from its planes (contiguous uint8 arrays), appended to ``parts`` (raw
    planes as they are: the caller joins everything once); returns their length."""
    compress, _ = coders(codec)
    n = 0
    for p, plane in enumerate(planes):
        coded = compress(plane) if tries is None or tries[p] else b""
        if coded and len(coded) < plane.size:
            parts += [_HEADER.pack(len(coded)), coded]
            n += 4 + len(coded)
        else:
            parts += [_HEADER.pack(plane.size | _RAW), plane]
            n += 4 + plane.size
    return n


def decode_unit(stored: memoryview, logical: int, dtype: str, itemsize: int, codec: str, out: np.ndarray,
                where: Callable[[], str], layouts: bool = True) -> None:
    """Decode one unit's ``stored`` bytes into the uint8 ``out`` of ``logical`` bytes. Every header
    is checked against the unit's geometry first; a corrupt stream is UCL406 naming ``where()``.
    The planes (raw ones read where they lie) are joined into ``out`` once all are checked.
    ``layouts``: whether the checkpoint's version has layout headers (LAYOUTS_SINCE); where it does
    not, a unit starting with one is refused, as that version's readers refuse it."""
    k = planes_of(dtype, itemsize)
    each, size = logical // k, len(stored)
    _, decompress = coders(codec)
    layout, offset, pos = _layout_of(stored, dtype, where, layouts)
    planes = []
    try:
        for p in range(k):
            if pos + 4 > size:
                raise ValueError("ends inside a plane header")
            (head,) = _HEADER.unpack_from(stored, pos)
            n, raw = head & ~_RAW, head & _RAW
            pos += 4
            if pos + n > size or (raw and n != each) or (not raw and n >= each):
                raise ValueError(f"a plane of {n:,} stored bytes where {each:,} are decoded")
            data = stored[pos:pos + n] if raw else decompress(stored[pos:pos + n], each)
            if len(data) != each:
                raise ValueError(f"a plane decoded to {len(data):,} bytes, not {each:,}")
            planes.append(np.frombuffer(data, np.uint8))
            pos += n
        if pos != size:
            raise ValueError(f"{size - pos:,} bytes after its last plane")
    except StoreError:
        raise
    except Exception as e:  # zstd and lz4 raise their own types on a corrupt stream
        raise StoreError(f"{where()}: corrupt {codec} stream ({e})", code="UCL406") from None
    join_into(planes, dtype, out, layout, offset)


def _layout_of(stored: memoryview, dtype: str, where: Callable[[], str], layouts: bool) -> tuple[int, int, int]:
    """A unit's plane layout, its offset and where its planes start: layout 0 at 0 unless the unit
    starts with a layout header, whose fields are checked here (UCL406 naming ``where()``)."""
    if len(stored) < 4 or _HEADER.unpack_from(stored, 0)[0] != _RAW:
        return 0, 0, 0
    if not layouts:
        raise StoreError(f"{where()}: starts with a layout header, which its checkpoint's format version "
                         f"(before {LAYOUTS_SINCE}) does not have (corrupt, or the manifest's version was edited)",
                         code="UCL406")
    if len(stored) < LAYOUT_BYTES:
        raise StoreError(f"{where()}: ends inside its layout header (corrupt)", code="UCL406")
    _, layout, offset = _LAYOUT.unpack_from(stored, 0)
    if layout not in LAYOUTS[1:] or not has_layout(dtype, layout):
        raise StoreError(f"{where()}: unknown plane layout {layout} for {dtype} (corrupt, or written by a newer ucl)",
                         code="UCL406")
    if offset > MAX_OFFSET:
        raise StoreError(f"{where()}: layout offset {offset} out of range (0 to {MAX_OFFSET}; corrupt)", code="UCL406")
    return layout, offset, LAYOUT_BYTES


def unit_view(arr: np.ndarray, units: Units, u: int) -> np.ndarray:
    """Unit ``u``'s logical bytes of the C-contiguous storage array ``arr``, as a uint8 array (a
    copy for a cell of a grid, a view for a chunk)."""
    g = units.grid
    if g is not None:
        b, j = divmod(u, g.nc)
        (r0, r1), (c0, c1) = g.row_span(b), g.col_span(j, j)
        return np.ascontiguousarray(arr.reshape(g.rows, g.cols)[r0:r1, c0:c1]).reshape(-1).view(np.uint8)
    flat = arr.reshape(-1).view(np.uint8)
    return flat[u * units.chunk:(u + 1) * units.chunk]


@dataclass(frozen=True)
class Encoded:
    """A dataset's stored bytes and its frame table: where each unit ends (relative to the first
    stored byte) and the xxh3-64 of each unit's stored bytes; ``group`` as units_of takes it."""

    stored: np.ndarray  # uint8
    ends: np.ndarray  # uint64
    digests: np.ndarray  # uint64
    group: int = 1

    def table(self) -> np.ndarray:
        """Its values in the rank file's ``ucl_tables``: the ends, then the digests."""
        return np.concatenate([self.ends, self.digests])


def encode(arr: np.ndarray, dtype: str, codec: str, pool: Executor | None = None, group: int | None = None) -> Encoded:
    """Encode a C-contiguous storage array unit by unit (``group``: default group_for's), a block
    of units of about BLOCK_BYTES at a time (in ``pool``'s threads when given: zstd and lz4 release
    the GIL), into one buffer sized for the worst case: without a pool each block is written right
    after the previous one; with one, each at its worst-case offset, then moved down into place
    (no second buffer of the whole dataset). The planes coded are those the dataset's first
    elements show worth coding, in the layout they show smaller (:func:`choose`)."""
    group = group_for(arr.shape, arr.itemsize) if group is None else group
    units = units_of(arr.shape, arr.itemsize, group)
    if not units.count:
        return Encoded(np.zeros(0, np.uint8), np.zeros(0, np.uint64), np.zeros(0, np.uint64), group)
    if units.unit_bytes(0) // planes_of(dtype, arr.itemsize) >= _RAW:  # the first unit is a largest one
        raise StoreError(f"cannot compress a {dtype} dataset of shape {tuple(arr.shape)}: a coded unit's plane "
                         f"would hold {units.unit_bytes(0) // planes_of(dtype, arr.itemsize):,} bytes, and a plane "
                         "header records fewer than 2**31; save it with compress='none'", code="UCL418")
    coding = choose(arr, dtype, codec, units)
    blocks = _blocks(units)
    heads = 4 * planes_of(dtype, arr.itemsize) + (LAYOUT_BYTES if coding.layout else 0)
    most = [sum(units.unit_bytes(u) + heads for u in range(a, b + 1)) for a, b in blocks]
    out = np.empty(sum(most), np.uint8)
    job = lambda block, at: _encode_block(arr, units, dtype, codec, coding, *block, out, at)  # noqa: E731
    lengths: list[int] = []
    digests: list[int] = []
    pos = 0
    if pool is None or len(blocks) == 1:
        for block in blocks:
            pos, ls, ds = job(block, pos)
            lengths += ls
            digests += ds
    else:
        starts = np.cumsum([0] + most[:-1]).tolist()
        view = memoryview(out)
        for at, (end, ls, ds) in zip(starts, pool.map(job, blocks, starts)):
            if at != pos:
                view[pos:pos + end - at] = view[at:end]  # a memmove: the two may overlap
            pos += end - at
            lengths += ls
            digests += ds
    ends = np.cumsum(np.array(lengths, np.uint64), dtype=np.uint64)
    return Encoded(out[:pos], ends, np.array(digests, np.uint64), group)


def _blocks(units: Units) -> list[tuple[int, int]]:
    """Runs ``(first, last)`` of units coded together: about BLOCK_BYTES of consecutive units; with a
    grid, units of one row of it and of one width (a narrower last column is a block of its own)."""
    per = max(1, BLOCK_BYTES // max(1, units.unit_bytes(0)))
    g = units.grid
    if g is None:
        return [(a, min(a + per, units.count) - 1) for a in range(0, units.count, per)]
    full = g.cols // g.tile_cols  # columns of full width
    out = []
    for r in range(0, units.count, g.nc):
        out += [(r + a, r + min(a + per, full) - 1) for a in range(0, full, per)]
        out += [(r + full, r + full)] if full < g.nc else []
    return out


def _encode_block(arr: np.ndarray, units: Units, dtype: str, codec: str, coding: Coding, first: int,
                  last: int, out: np.ndarray, at: int) -> tuple[int, list[int], list[int]]:
    """Units ``first..last`` (one block) coded into ``out`` from ``at`` on, one after the other:
    where they end, each one's length and the xxh3-64 of each one's stored bytes (hashed while in
    cache). Units are taken a run of about RUN_BYTES at a time (a grid's cells copied to contiguous
    scratch first: their rows are strided). A run of one unit has each plane made with one or two
    numpy passes straight into ``out`` when it is kept raw, else into scratch for the coder; a run
    of smaller units is split into planes at once (fewer numpy calls a unit) and each unit's part
    of a plane coded or copied. A coded plane that did not shrink is stored raw after all. In layout
    1 the run's elements are offset once (into scratch) before any plane is made of them."""
    item, g = arr.itemsize, units.grid
    tries, layout, head = coding.tries, coding.layout, np.frombuffer(coding.header(), np.uint8)
    k = planes_of(dtype, item)
    elems = np.dtype(f"<u{item}") if k > 1 else np.dtype(np.uint8)
    compress, _ = coders(codec)
    flat, rows = arr.reshape(-1), arr.reshape(g.rows, g.cols) if g is not None else None
    lengths, digests, pos = [], [], at
    step = max(1, RUN_BYTES // max(1, units.unit_bytes(first)))
    for a in range(first, last + 1, step):
        b = min(last, a + step - 1)
        sizes = [units.unit_bytes(u) // elems.itemsize for u in range(a, b + 1)]
        if g is not None:  # one band of cells of one width (_blocks): copied in one pass
            (r0, r1), (c0, c1) = g.row_span(a // g.nc), g.col_span(a % g.nc, b % g.nc)
            nu, h, w = b - a + 1, r1 - r0, (c1 - c0) // (b - a + 1)
            cells = scratch("cells", (c1 - c0) * h * item).view(arr.dtype).reshape(nu, h, w)
            np.copyto(cells, rows[r0:r1, c0:c1].reshape(h, nu, w).transpose(1, 0, 2))
            x = cells.reshape(-1).view(elems)
        else:
            per = units.chunk // item
            x = flat[a * per:a * per + sum(sizes) * elems.itemsize // item].view(elems)
        if layout:
            x = offset_elements(x, coding.offset)
        planes = None
        if a < b:
            planes = scratch("planes", k * x.size).reshape(k, x.size)
            for p in range(k):
                plane_into(x, dtype, p, planes[p], layout)
        off = 0
        for n in sizes:
            start = pos
            out[pos:pos + head.size] = head
            pos += head.size
            for p in range(k):
                if planes is None and not tries[p]:  # straight into the stored bytes
                    plane_into(x, dtype, p, out[pos + 4:pos + 4 + n], layout)
                else:
                    if planes is None:
                        plane = scratch("plane", n)
                        plane_into(x, dtype, p, plane, layout)
                    else:
                        plane = planes[p, off:off + n]
                    coded = compress(plane) if tries[p] else None
                    if coded is not None and len(coded) < n:
                        _HEADER.pack_into(out, pos, len(coded))
                        out[pos + 4:pos + 4 + len(coded)] = np.frombuffer(coded, np.uint8)
                        pos += 4 + len(coded)
                        continue
                    out[pos + 4:pos + 4 + n] = plane
                _HEADER.pack_into(out, pos, n | _RAW)
                pos += 4 + n
            off += n
            lengths.append(pos - start)
            digests.append(xxhash.xxh3_64_intdigest(out[start:pos]))
    return pos, lengths, digests


def choose(arr: np.ndarray, dtype: str, codec: str, units: Units | None = None) -> Coding:
    """How to code a dataset (a writer's choice: readers follow each unit's header). Planes worth
    coding: those of its first SAMPLE_ELEMENTS elements that shrink by at least 2%; the others (the
    mantissa bytes of trained floats, noise to a coder) are stored raw in every unit without being
    tried. Layout 1 (with the first unit's offset, planes.unit_offset) where the dtype has it and
    the first unit (of ``units``, default group_for's) has no sign bit set (exp_avg_sq: layout 0
    codes its lowest plane for the one sign bit; layout 1 puts the exponent's top bits there
    instead) and takes fewer bytes in it, its top and lowest planes tried in each layout (the
    others are mantissa bits in both: kept as the first elements say). A whole unit, not the first
    elements: exponents that repeat from row to row of a tile (a column's scale) are matches to
    layout 0, which layout 1's mantissa bits break, and a few rows do not show how many."""
    k = planes_of(dtype, arr.itemsize)
    elems = f"<u{arr.itemsize}" if k > 1 else np.uint8
    plain = _trial(arr.reshape(-1)[:SAMPLE_ELEMENTS].view(elems), dtype, codec, 0)[0]
    if dtype not in OFFSET_FLOATS or not arr.size:
        return Coding(plain)
    units = units_of(arr.shape, arr.itemsize, group_for(arr.shape, arr.itemsize)) if units is None else units
    first = unit_view(arr, units, 0).view(elems)
    if int(first.max()) >> (8 * arr.itemsize - 1):
        return Coding(plain)
    ends = (0, k - 1)
    offset = unit_offset(first)
    other = _trial(offset_elements(first, offset), dtype, codec, 1, ends)
    if other[1] >= _trial(first, dtype, codec, 0, ends)[1]:
        return Coding(plain)
    return Coding(tuple(other[0][p] if p in ends else plain[p] for p in range(k)), 1, offset)


def _trial(x: np.ndarray, dtype: str, codec: str, layout: int, only: Sequence[int] | None = None
           ) -> tuple[tuple[bool, ...], int]:
    """Which planes of the elements ``x`` (in ``layout``; ``only`` these) shrink by at least 2%,
    and the bytes they take so (the others raw)."""
    compress, _ = coders(codec)
    plane = scratch("plane", x.size)
    tries, size = [], 0
    for p in range(planes_of(dtype, x.dtype.itemsize)):
        if only is not None and p not in only:
            tries.append(False)
            continue
        plane_into(x, dtype, p, plane, layout)
        coded = len(compress(plane))
        tries.append(coded < 0.98 * plane.size)
        size += coded if tries[-1] else plane.size
    return tuple(tries), size


def frame_table_digest(whole: str, codec: str, stored: int, ends: np.ndarray, digests: np.ndarray,
                       group: int | None = None) -> str:
    """``xxh3_64:<hex>`` binding a compressed dataset's whole checksum to its encoding and frame
    table (the entry's ``frames``): the checksum and codec name (ASCII), the stored byte count as
    little-endian int64, the entry's ``group`` likewise where it has one (version 4), then the ends
    and digests as little-endian uint64."""
    h = xxhash.xxh3_64(whole.encode("ascii"))
    h.update(codec.encode("ascii"))
    h.update(np.int64(stored).astype("<i8").tobytes())
    if group is not None:
        h.update(np.int64(group).astype("<i8").tobytes())
    h.update(np.ascontiguousarray(ends, dtype="<u8").tobytes())
    h.update(np.ascontiguousarray(digests, dtype="<u8").tobytes())
    return format_checksum(h.hexdigest())


def check_ends(units: Units, dtype: str, ends: np.ndarray, stored: int, where: str) -> None:
    """A frame table's ends, checked against the units' geometry before any unit is read: strictly
    increasing, the last one the stored size, no unit longer than its headers and raw planes
    (UCL406)."""
    k = planes_of(dtype, units.itemsize)
    lengths = np.diff(np.concatenate([[0], ends.astype(np.int64)]))
    heads = 4 * k + LAYOUT_BYTES  # plane headers and at most a layout header
    most = np.fromiter((heads + units.unit_bytes(u) for u in range(units.count)), np.int64, units.count)
    if ends.size != units.count or (ends.size and int(ends[-1]) != stored) or np.any(lengths < 4 * k) \
            or np.any(lengths > most):
        raise StoreError(f"{where}: its frame table does not fit a dataset of {units.nbytes:,} bytes in "
                         f"{units.count} units stored in {stored:,} bytes (corrupt)", code="UCL406")
