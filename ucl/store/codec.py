"""The compressed encoding of a dataset (docs/format.md, "Compressed datasets"): its bytes cut into
units (the tiles of a tiled dataset, else its checksum chunks, else the whole dataset), each unit
split into byte planes (floats rotated first so the exponent fills one plane) and each plane coded
on its own with zstd or lz4, or kept raw where coding does not shrink it. Pure: bytes in, bytes out;
every length a stored unit declares is checked against what its geometry allows before anything is
allocated or decoded."""
from __future__ import annotations

import math
import struct
import threading
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import xxhash

from ..errors import StoreError
from .checksum import chunk_size, format_checksum, tile_grid, TileGrid

CODECS = ("zstd", "lz4")
ZSTD_LEVEL = 1  # level 1: the mantissa planes barely compress at any level, the exponent plane does at 1
_RAW = 1 << 31  # a plane header's top bit: the plane is stored raw
_HEADER = struct.Struct("<I")
_FLOATS = frozenset({"bfloat16", "float16", "float32", "float64"})
_BLOCK_BYTES = 1 << 20  # flat chunks split into planes together, about this many bytes at a time


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
    """How a dataset of ``shape`` is cut into coded units: the tiles of ``grid`` row-major (each
    tile's bytes row by row within it), else consecutive ``chunk`` bytes of its flattening (the last
    may be short)."""

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


def units_of(shape: Sequence[int], itemsize: int) -> Units:
    """The writer's units for a dataset (docs/format.md): its tiles when it has a tile grid, else its
    checksum chunks, else one unit of the whole dataset."""
    shape = tuple(int(x) for x in shape)
    nbytes = math.prod(shape) * itemsize
    grid = tile_grid(shape, itemsize)
    return Units(shape, itemsize, grid, chunk_size(nbytes) or max(nbytes, 1))


def planes_of(dtype: str, itemsize: int) -> int:
    """Byte planes a unit of this logical dtype is split into (1: not split)."""
    return itemsize if itemsize > 1 and (dtype in _FLOATS or dtype.startswith(("int", "uint"))) else 1


def _rotate(u: np.ndarray, left: bool) -> np.ndarray:
    """Each unsigned element rotated by one bit: left puts the sign bit lowest, so the exponent
    (of a float) fills the top byte (bf16, fp32) or its top bits (fp16, fp64)."""
    bits = u.dtype.itemsize * 8
    one, back = u.dtype.type(1), u.dtype.type(bits - 1)
    return (u << one) | (u >> back) if left else (u >> one) | (u << back)


def split_planes(raw: np.ndarray, dtype: str, itemsize: int) -> list[np.ndarray]:
    """A unit's bytes (uint8, whole elements) as its byte planes, most significant first."""
    k = planes_of(dtype, itemsize)
    if k == 1:
        return [raw]
    u = raw.view(f"<u{itemsize}")
    if dtype in _FLOATS:
        u = _rotate(u, True)
    planes = u.view(np.uint8).reshape(-1, k).T[::-1].copy()  # one transposing copy: row p is plane p
    return list(planes)


def join_planes(planes: Sequence[np.ndarray], dtype: str, itemsize: int, out: np.ndarray) -> None:
    """Inverse of :func:`split_planes`, into the uint8 ``out``."""
    k = len(planes)
    if k == 1:
        out[...] = planes[0]
        return
    by = out.reshape(-1, k)
    for p in range(k):  # plane by plane: 10x faster than one transposing copy of the stacked planes
        by[:, k - 1 - p] = planes[p]
    if dtype in _FLOATS:
        u = out.view(f"<u{itemsize}")
        u[...] = _rotate(u, False)


_LOCAL = threading.local()  # per thread: zstd contexts are not shared between threads


def coders(name: str) -> tuple[Callable[[bytes], bytes], Callable[[bytes, int], bytes]]:
    """(compress, decompress(data, exact size)) of a codec, made once per thread (a zstd context
    costs more to make than a unit costs to code); UCL418 if its package is missing."""
    made = getattr(_LOCAL, "codecs", None)
    if made is None:
        made = _LOCAL.codecs = {}
    if name not in made:
        made[name] = _make_codec(name)
    return made[name]


def _make_codec(name: str) -> tuple[Callable[[bytes], bytes], Callable[[bytes, int], bytes]]:
    try:
        if name == "zstd":
            import zstandard
            cctx, dctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL), zstandard.ZstdDecompressor()

            def unzstd(data: bytes, n: int) -> bytes:
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


def encode_unit(raw: np.ndarray, dtype: str, itemsize: int, codec: str, tries: Sequence[bool] | None = None) -> bytes:
    """One unit's stored bytes: per plane a little-endian uint32 header (its stored length; top bit
    set: raw), then the plane. ``tries[p]`` False: plane ``p`` is stored raw without trying to code it."""
    return _pack(split_planes(raw, dtype, itemsize), codec, tries)


def _pack(planes: Sequence[np.ndarray], codec: str, tries: Sequence[bool] | None) -> bytes:
    """A unit's stored bytes from its planes (contiguous uint8 arrays)."""
    compress, _ = coders(codec)
    parts = []
    for p, plane in enumerate(planes):
        coded = compress(plane.data) if tries is None or tries[p] else b""
        if coded and len(coded) < plane.size:
            parts += [_HEADER.pack(len(coded)), coded]
        else:
            parts += [_HEADER.pack(plane.size | _RAW), plane.tobytes()]
    return b"".join(parts)


def decode_unit(stored: memoryview, logical: int, dtype: str, itemsize: int, codec: str, out: np.ndarray,
                where: Callable[[], str]) -> None:
    """Decode one unit's ``stored`` bytes into the uint8 ``out`` of ``logical`` bytes. Every header
    is checked against the unit's geometry first; a corrupt stream is UCL406 naming ``where()``."""
    k = planes_of(dtype, itemsize)
    each = logical // k
    _, decompress = coders(codec)
    planes, pos = [], 0
    try:
        for _ in range(k):
            if pos + 4 > len(stored):
                raise ValueError("ends inside a plane header")
            (head,) = _HEADER.unpack_from(stored, pos)
            n, raw = head & ~_RAW, bool(head & _RAW)
            pos += 4
            if pos + n > len(stored) or (raw and n != each) or (not raw and n >= each):
                raise ValueError(f"a plane of {n:,} stored bytes where {each:,} are decoded")
            data = stored[pos:pos + n]
            pos += n
            plane = np.frombuffer(data if raw else decompress(data, each), np.uint8)
            if plane.size != each:
                raise ValueError(f"a plane decoded to {plane.size:,} bytes, not {each:,}")
            planes.append(plane)
        if pos != len(stored):
            raise ValueError(f"{len(stored) - pos:,} bytes after its last plane")
    except StoreError:
        raise
    except Exception as e:  # zstd and lz4 raise their own types on a corrupt stream
        raise StoreError(f"{where()}: corrupt {codec} stream ({e})", code="UCL406") from None
    join_planes(planes, dtype, itemsize, out)


def unit_view(arr: np.ndarray, units: Units, u: int) -> np.ndarray:
    """Unit ``u``'s logical bytes of the C-contiguous storage array ``arr``, as a uint8 array (a
    copy for a tile, a view for a chunk)."""
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
    stored byte) and the xxh3-64 of each unit's stored bytes."""

    stored: np.ndarray  # uint8
    ends: np.ndarray  # uint64
    digests: np.ndarray  # uint64

    def table(self) -> np.ndarray:
        """Its values in the rank file's ``ucl_tables``: the ends, then the digests."""
        return np.concatenate([self.ends, self.digests])


def encode(arr: np.ndarray, dtype: str, codec: str, pool: Executor | None = None) -> Encoded:
    """Encode a C-contiguous storage array unit by unit (in ``pool``'s threads when given: zstd and
    lz4 release the GIL)."""
    units = units_of(arr.shape, arr.itemsize)
    if not units.count:
        return Encoded(np.zeros(0, np.uint8), np.zeros(0, np.uint64), np.zeros(0, np.uint64))
    first = encode_unit(unit_view(arr, units, 0), dtype, arr.itemsize, codec)
    k = planes_of(dtype, arr.itemsize)
    tries = coded_planes(first, k, units.unit_bytes(0) // k)

    def band(b: int) -> list[bytes]:  # tiles: a band of them split into planes at once
        g = units.grid
        r0, r1 = g.row_span(b)
        planes = [q.reshape(r1 - r0, g.cols) for q in split_planes(
            arr.reshape(g.rows, g.cols)[r0:r1].reshape(-1).view(np.uint8), dtype, arr.itemsize)]
        return [_pack([np.ascontiguousarray(q[:, slice(*g.col_span(j, j))]).reshape(-1) for q in planes], codec, tries)
                for j in range(1 if b == 0 else 0, g.nc)]

    def run(lo: int) -> list[bytes]:  # flat chunks: a block of them split into planes at once
        hi = min(units.count, lo + per)
        planes = split_planes(arr.reshape(-1).view(np.uint8)[lo * units.chunk:hi * units.chunk], dtype, arr.itemsize)
        each = units.chunk // k
        return [_pack([q[(u - lo) * each:(u - lo) * each + units.unit_bytes(u) // k] for q in planes], codec, tries)
                for u in range(lo, hi)]
    per = max(1, _BLOCK_BYTES // units.chunk)
    jobs, fn = (range(units.grid.nr), band) if units.grid is not None else (range(1, units.count, per), run)
    coded = [first] + [c for block in (pool.map(fn, jobs) if pool is not None else map(fn, jobs)) for c in block]
    lengths = np.fromiter(map(len, coded), np.uint64, len(coded))
    stored = np.frombuffer(b"".join(coded), np.uint8)
    digests = np.fromiter(map(xxhash.xxh3_64_intdigest, coded), np.uint64, len(coded))
    return Encoded(stored, np.cumsum(lengths, dtype=np.uint64), digests)


def coded_planes(unit: bytes, k: int, each: int) -> list[bool]:
    """Which planes (of ``each`` bytes) of a coded unit shrank by at least 2%: the others (the
    mantissa bytes of trained floats, noise to a coder) are stored raw in the dataset's other units
    without being tried (a writer's choice: readers see raw planes either way)."""
    out, pos = [], 0
    for _ in range(k):
        (head,) = _HEADER.unpack_from(unit, pos)
        n = head & ~_RAW
        out.append(not head & _RAW and n < 0.98 * each)
        pos += 4 + n
    return out


def frame_table_digest(whole: str, codec: str, stored: int, ends: np.ndarray, digests: np.ndarray) -> str:
    """``xxh3_64:<hex>`` binding a compressed dataset's whole checksum to its encoding and frame
    table (the entry's ``frames``): the checksum and codec name (ASCII), the stored byte count as
    little-endian int64, then the ends and digests as little-endian uint64."""
    h = xxhash.xxh3_64(whole.encode("ascii"))
    h.update(codec.encode("ascii"))
    h.update(np.int64(stored).astype("<i8").tobytes())
    h.update(np.ascontiguousarray(ends, dtype="<u8").tobytes())
    h.update(np.ascontiguousarray(digests, dtype="<u8").tobytes())
    return format_checksum(h.hexdigest())


def check_ends(units: Units, dtype: str, ends: np.ndarray, stored: int, where: str) -> None:
    """A frame table's ends, checked against the units' geometry before any unit is read: strictly
    increasing, the last one the stored size, no unit longer than its headers and raw planes
    (UCL406)."""
    k = planes_of(dtype, units.itemsize)
    lengths = np.diff(np.concatenate([[0], ends.astype(np.int64)]))
    most = np.fromiter((4 * k + units.unit_bytes(u) for u in range(units.count)), np.int64, units.count)
    if ends.size != units.count or (ends.size and int(ends[-1]) != stored) or np.any(lengths < 4 * k) \
            or np.any(lengths > most):
        raise StoreError(f"{where}: its frame table does not fit a dataset of {units.nbytes:,} bytes in "
                         f"{units.count} units stored in {stored:,} bytes (corrupt)", code="UCL406")
