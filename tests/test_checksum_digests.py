"""Every digest the hashers give (whole, chunk, tile) against a brute-force reference written from
docs/format.md alone: XXH3-64 (seed 0) of all the storage bytes; of each chunk of the flat bytes
(a power of two of at least 16 KiB, at most 1024 chunks); of each tile's bytes taken row by row,
on the grid the rule in "Tile checksums" gives. Shapes, dtypes and the pieces a dataset arrives in
are drawn (pieces cut rows and tile bands anywhere), and so is the size of the hashers' blocks, so
that small arrays take every path big ones do (bands wider than a block, several bands a block)."""
from __future__ import annotations

import math
from unittest import mock

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from ucl.store import checksum, digests
from ucl.store.tiles import band_digests
from ucl.store.digests import IncrementalChecksum, checksums, copy_checksummed
from tests.passes import examples

DTYPES = ["uint8", "bool", "float16", "uint16", "float32", "int32", "float64"]  # bf16 is stored as uint16
BLOCKS = [512, 4096, 40_000, 1 << 20]  # hasher block bytes: the default (1 MiB) and smaller ones


def _ref_chunk_bytes(nbytes: int) -> int | None:
    if nbytes <= 16 << 10:
        return None
    size = 16 << 10
    while nbytes > size * 1024:
        size *= 2
    return size


def _ref_grid(shape, item):
    """(rows, cols, tile_rows, tile_cols) by docs/format.md's rule, or None."""
    if len(shape) < 2:
        return None
    rows, cols = math.prod(shape[:-1]), shape[-1]
    nbytes = rows * cols * item
    if nbytes <= 16 << 10:
        return None
    most = min(1024, nbytes // (16 << 10))
    pow2 = lambda n: 1 << (n.bit_length() - 1)  # noqa: E731 (n >= 1 here)
    bound = min(32, most, cols * item // 256)
    if bound < 2:
        return None
    gc = pow2(bound)
    gr = pow2(min(rows, 32, most // gc))
    th, tw = -(-rows // gr), -(-cols // gc)
    return None if -(-cols // tw) < 2 else (rows, cols, th, tw)


def _reference(arr: np.ndarray, tiles: bool):
    raw = arr.tobytes()
    whole = "xxh3_64:" + xxhash.xxh3_64_hexdigest(raw)
    size = _ref_chunk_bytes(len(raw))
    chunks = None if size is None else [xxhash.xxh3_64_intdigest(raw[i:i + size]) for i in range(0, len(raw), size)]
    grid = _ref_grid(arr.shape, arr.itemsize) if tiles else None
    table = None
    if grid is not None:
        rows, cols, th, tw = grid
        m = arr.reshape(rows, cols)
        table = [[xxhash.xxh3_64_intdigest(b"".join(m[r, c:c + tw].tobytes() for r in range(r0, min(r0 + th, rows))))
                  for c in range(0, cols, tw)] for r0 in range(0, rows, th)]
    return whole, size, chunks, grid, table


def _check(got, arr, tiles):
    whole, size, chunks, grid, table = _reference(arr, tiles)
    assert got.whole == whole
    assert (got.chunks is None) == (size is None)
    if size is not None:
        assert got.chunks[0] == size and got.chunks[1].dtype == np.uint64 and got.chunks[1].tolist() == chunks
    assert (got.tiles is None) == (grid is None)
    if grid is not None:
        g, digests = got.tiles
        assert (g.rows, g.cols, g.tile_rows, g.tile_cols) == grid
        assert digests.dtype == np.uint64 and digests.reshape(len(table), -1).tolist() == table


def _array(shape, dtype, seed):
    n = math.prod(shape) * np.dtype(dtype).itemsize
    raw = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)
    return (raw & 1).view(bool).reshape(shape) if dtype == "bool" else raw.view(dtype).reshape(shape)


@st.composite
def _cases(draw):
    dtype = draw(st.sampled_from(DTYPES))
    item = np.dtype(dtype).itemsize
    lead = draw(st.lists(st.integers(1, 4), max_size=1))
    k = lead[0] if lead else 1
    if draw(st.booleans()):  # any size (most have no tiles)
        rows = draw(st.integers(1, 160))
        cols = draw(st.integers(1, max(1, min((3 << 19) // (item * rows * k), (48 << 10) // item))))
    else:  # tiled: rows of at least 512 bytes, over 16 KiB in all, at most 1.5 MiB
        cols = draw(st.integers(512 // item, (48 << 10) // item))
        rows = draw(st.integers((16 << 10) // (cols * item * k) + 1, max(1, (3 << 19) // (cols * item * k))))
    shape = tuple(lead) + (rows, cols)
    n = math.prod(shape)
    cols_flat = shape[-1]
    # cuts anywhere, and on or next to row and band edges
    grid = _ref_grid(shape, item)
    band = (grid[2] if grid else 1) * cols_flat
    near = st.builds(lambda k, d, e: k * e + d, st.integers(0, n // max(1, min(band, n)) + 1), st.integers(-2, 2),
                     st.sampled_from([cols_flat, band]))
    cuts = draw(st.lists(st.one_of(st.integers(0, n), near), max_size=8))
    return shape, dtype, sorted({0, n, *(c for c in cuts if 0 <= c <= n)})


@settings(max_examples=examples(100), deadline=None)
@given(case=_cases(), block=st.sampled_from(BLOCKS), tiles=st.sampled_from([True, True, True, False]), seed=st.integers(0, 2**31))
def test_incremental_digests_equal_the_format_definition(case, block, tiles, seed):
    """Pieces of any size in flat order, any hasher block: whole, chunk and tile digests as defined."""
    shape, dtype, bounds = case
    arr = _array(shape, dtype, seed)
    flat = arr.reshape(-1)
    with mock.patch.object(checksum, "HASH_BLOCK_BYTES", block):
        h = IncrementalChecksum(shape, arr.dtype, tiles=tiles)
        for a, b in zip(bounds, bounds[1:]):
            h.advance(a, flat[a:b])
        got = h.result(flat.size)
    _check(got, arr, tiles)


@settings(max_examples=examples(40), deadline=None)
@given(case=_cases(), block=st.sampled_from(BLOCKS), tiles=st.sampled_from([True, True, True, False]), seed=st.integers(0, 2**31))
def test_whole_array_digests_equal_the_format_definition(case, block, tiles, seed):
    """``checksums`` and ``copy_checksummed`` (which hashes each block right after copying it)."""
    shape, dtype, _ = case
    arr = _array(shape, dtype, seed)
    with mock.patch.object(checksum, "HASH_BLOCK_BYTES", block):
        _check(checksums(arr, tiles=tiles), arr, tiles)
        dst = np.zeros_like(arr)
        _check(copy_checksummed(dst, arr, tiles=tiles), arr, tiles)
    assert dst.tobytes() == arr.tobytes()


@settings(max_examples=examples(40), deadline=None)
@given(rows=st.integers(1, 70), width=st.integers(1, 300), ntiles=st.integers(1, 6), extra=st.integers(0, 299),
       left=st.integers(0, 9), item=st.sampled_from([1, 2, 4, 8]), block=st.sampled_from(BLOCKS),
       seed=st.integers(0, 2**31))
def test_band_digests_of_a_column_window(rows, width, ntiles, extra, left, item, block, seed):
    """A verified read's band: a window of a wider buffer's columns (rows not contiguous), cut every
    ``width`` columns, the last tile possibly narrower; each tile hashed row by row."""
    cols = (ntiles - 1) * width + 1 + extra % width
    buf = _array((rows, left + cols + 3), f"u{item}", seed)
    window = buf[:, left:left + cols]
    want = [xxhash.xxh3_64_intdigest(b"".join(window[r, c:c + width].tobytes() for r in range(rows)))
            for c in range(0, cols, width)]
    with mock.patch.object(checksum, "HASH_BLOCK_BYTES", block):
        assert band_digests(window, width) == want


@pytest.mark.parametrize("shape,dtype", [((1024, 4096), "float32"), ((3, 700, 1331), "uint16"), ((40, 70000), "uint8")])
def test_megabyte_blocks_of_real_sizes(shape, dtype):
    """Default blocks on arrays of several of them (bands of several blocks, several bands a block),
    in pieces cutting rows mid-way."""
    arr = _array(shape, dtype, 3)
    flat, step = arr.reshape(-1), 3_000_001
    h = IncrementalChecksum(shape, arr.dtype)
    for a in range(0, flat.size, step):
        h.advance(a, flat[a:a + step])
    _check(h.result(flat.size), arr, True)


def test_band_digests_of_strided_columns():
    """Columns a stride apart (not a window): copied before being cut into tiles."""
    buf = _array((50, 1200), "uint16", 4)
    band = buf[:, ::3]
    want = [xxhash.xxh3_64_intdigest(np.ascontiguousarray(band[:, c:c + 128]).tobytes()) for c in range(0, 400, 128)]
    assert band_digests(band, 128) == want


def test_hasher_offers_the_gil_after_each_full_block():
    """A thread waiting for the GIL gets a chance after every block (bench/tile_hash.py measures
    what that buys); a small dataset, one partial block, makes no system call."""
    offers = []
    arr = _array((1024, 4096), "float32", 5)  # 16 MiB: 16 blocks of 1 MiB (whole bands)
    with mock.patch.object(digests, "_offer_gil", lambda: offers.append(1)):
        got = checksums(arr)
        assert len(offers) == arr.nbytes // checksum.HASH_BLOCK_BYTES
        checksums(arr[:3])
        assert len(offers) == arr.nbytes // checksum.HASH_BLOCK_BYTES
    _check(got, arr, True)
