"""Tile checksums of 2-D datasets (docs/format.md "Tile checksums"): a verified column block reads
only the tiles around it, every tile is checked before use, and tampering never yields wrong data.

Oracles: numpy slicing of the array written, and tile digests recomputed here with xxhash over
each tile copied out by numpy (not the store's hasher)."""
from __future__ import annotations

import json
import math
import os
import shutil

import h5py
import numpy as np
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ucl.dtypes import storage_dtype
from ucl.errors import StoreError
from ucl.layout.boxes import Slot, flat_runs
from ucl.store import Checkpoint, CheckpointWriter, StoreSource
from ucl.store.checksum import MIN_CHUNK_BYTES, chunk_count, chunk_size
from ucl.store.tiles import tile_grid
from tests.corrupt import without_offsets
from tests.passes import examples

SETTINGS = settings(max_examples=int(os.environ.get("UCL_FUZZ_EXAMPLES", 40)), deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
DTYPES = ["float32", "bfloat16", "float16", "int64", "uint8", "bool", "float64"]


def _array(shape, dtype, seed=0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    sd = storage_dtype(dtype)
    if dtype == "bool":
        return rng.integers(0, 2, shape).astype(bool)
    raw = rng.integers(0, 256, math.prod(shape) * sd.itemsize, dtype=np.uint8)
    return raw.view(sd).reshape(shape)


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    """Bit-for-bit equality (random bits hold NaNs)."""
    return a.shape == b.shape and a.dtype == b.dtype and np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes()


def _ref_tiles(arr: np.ndarray, grid) -> np.ndarray:
    a2 = arr.reshape(grid.rows, grid.cols)
    h, w = grid.tile_rows, grid.tile_cols
    return np.array([xxhash.xxh3_64_intdigest(np.ascontiguousarray(a2[b * h:(b + 1) * h, j * w:(j + 1) * w]).tobytes())
                     for b in range(grid.nr) for j in range(grid.nc)], dtype=np.uint64)


def _stored(path, key):
    with h5py.File(os.path.join(path, "rank_00000.h5"), "r") as f:
        a = f[key].attrs
        return (np.asarray(a["ucl_tiles"]).shape, np.asarray(a["ucl_tiles"]).reshape(-1)) if "ucl_tiles" in a else None


def _save(path, arrays: dict, how="whole", pieces=None):
    with CheckpointWriter(path, 1) as w:
        for key, (arr, dtype) in arrays.items():
            if how == "whole":
                w.write(0, key, arr, dtype=dtype)
                continue
            w.create(0, key, arr.shape, dtype)
            flat = arr.reshape(-1)
            if how == "flat":  # in flat order, pieces cut anywhere (mid-row too)
                cuts = sorted({0, flat.size, *(p % (flat.size + 1) for p in (pieces or []))})
                for a, b in zip(cuts, cuts[1:]):
                    w.write_flat(0, key, a, flat[a:b])
            else:  # out of order: the digests come from re-reading the dataset at commit
                half = arr.shape[0] // 2
                w.write_box(0, key, (half,) + (0,) * (arr.ndim - 1), arr[half:])
                w.write_box(0, key, (0,) * arr.ndim, arr[:half])
        w.commit()
    return str(path)


def _box_read(ck, key, shape, start, size):
    slot = Slot(key, 0, tuple(shape), tuple(shape))
    return ck.read_runs(0, key, flat_runs(slot, start, size), verify=True).reshape(size)


def _tile_bound(grid, shape, start, size, item) -> int:
    """Bytes of the box rounded out to tile edges (the rows x columns view of ``shape``)."""
    rows = np.zeros(grid.rows, bool)
    lead = np.zeros(tuple(shape[:-1]), bool)
    lead[tuple(slice(a, a + n) for a, n in zip(start[:-1], size[:-1]))] = True
    rows[:] = lead.reshape(-1)
    bands = np.unique(np.flatnonzero(rows) // grid.tile_rows)
    nrows = sum(min((b + 1) * grid.tile_rows, grid.rows) - b * grid.tile_rows for b in bands)
    c0, c1 = start[-1] // grid.tile_cols * grid.tile_cols, -(-(start[-1] + size[-1]) // grid.tile_cols) * grid.tile_cols
    return nrows * (min(c1, grid.cols) - c0) * item


def _chunk_bound(shape, start, size, item) -> int:
    """Bytes of the flat checksum chunks the box touches."""
    per = chunk_size(math.prod(shape) * item) // item
    idx = np.arange(math.prod(shape)).reshape(shape)[tuple(slice(a, a + n) for a, n in zip(start, size))]
    chunks = np.unique(idx.reshape(-1) // per)
    total = math.prod(shape)
    return sum(min((c + 1) * per, total) - c * per for c in chunks) * item


# ---------------------------------------------------------------- the grid rule

@given(rows=st.integers(1, 5000), cols=st.integers(1, 5000), item=st.sampled_from([1, 2, 4, 8]))
@settings(max_examples=examples(300), deadline=None)
def test_grid_rule(rows, cols, item):
    g = tile_grid((rows, cols), item)
    nbytes = rows * cols * item
    if g is None:
        return
    assert nbytes > MIN_CHUNK_BYTES and 2 <= g.nc <= 32 and 1 <= g.nr <= 32
    assert g.tile_rows * g.tile_cols * item >= MIN_CHUNK_BYTES  # full tiles are at least 16 KiB
    assert g.tile_cols * item >= 256
    gc, gr = -(-cols // g.tile_cols), -(-rows // g.tile_rows)
    assert (g.nr, g.nc) == (gr, gc) and g.nr * g.tile_rows >= rows and g.nc * g.tile_cols >= cols
    if cols % 32 == 0 and nbytes >= 32 * 32 * MIN_CHUNK_BYTES and cols * item >= 32 * 256:
        assert g.tile_cols == cols // 32  # big matrices: 32 columns of tiles, on the 2/4/8/16/32-way splits


def test_no_tiles_for_flat_small_or_narrow_datasets():
    assert tile_grid((1 << 20,), 4) is None                     # 1-D: flat chunks
    assert tile_grid((64, 64), 4) is None                       # 16 KiB: verified whole
    assert tile_grid((1 << 16, 32), 4) is None                  # 128-byte rows: one tile column at most
    assert tile_grid((4, 64, 1024), 4) == tile_grid((256, 1024), 4)  # leading dims collapse


# ---------------------------------------------------------------- round trips

@given(rows=st.integers(2, 300), cols=st.integers(40, 700), lead=st.sampled_from([None, 2, 3]),
       dtype=st.sampled_from(DTYPES), how=st.sampled_from(["whole", "flat", "box"]),
       pieces=st.lists(st.integers(0, 10 ** 6), max_size=6), offsets=st.booleans(), data=st.data())
@SETTINGS
def test_verified_box_reads_equal_numpy(tmp_path_factory, rows, cols, lead, dtype, how, pieces, offsets, data):
    shape = (rows, cols) if lead is None else (lead, max(1, rows // lead), cols)
    arr = _array(shape, dtype, seed=rows * cols)
    path = _save(tmp_path_factory.mktemp("t") / "c", {"w/x": (arr, dtype)}, how, pieces)
    if not offsets:  # read through HDF5's metadata, as a checkpoint written before offsets
        without_offsets(path)
    grid = tile_grid(shape, arr.itemsize)
    stored = _stored(path, "w/x")
    if grid is None:
        assert stored is None
    else:
        assert stored[0] == (grid.nr, grid.nc)
        assert np.array_equal(stored[1], _ref_tiles(arr, grid))
    with Checkpoint.open(path) as ck:
        assert ck.verify() == []
        for _ in range(3):
            start = tuple(data.draw(st.integers(0, n - 1)) for n in shape)
            size = tuple(data.draw(st.integers(1, n - s)) for s, n in zip(start, shape))
            want = arr[tuple(slice(a, a + n) for a, n in zip(start, size))]
            fresh = Checkpoint.open(path)
            assert _same(_box_read(fresh, "w/x", shape, start, size), want)
            if grid is not None:  # the guarantee: never more than the cheaper of tiles or chunks
                assert fresh.bytes_last_read <= min(_tile_bound(grid, shape, start, size, arr.itemsize),
                                                    _chunk_bound(shape, start, size, arr.itemsize))
            assert _same(_box_read(ck, "w/x", shape, start, size), want)  # warm: cached tiles


@given(rows=st.integers(8, 200), cols=st.integers(64, 500), offsets=st.booleans(), verify=st.booleans(),
       data=st.data())
@SETTINGS
def test_arbitrary_runs_read_by_tiles(tmp_path_factory, rows, cols, offsets, verify, data):
    # runs that are not a box's rows (e.g. a flat slot laid over a 2-D dataset) still read exact bytes
    arr = _array((rows, cols), "float32", seed=rows)
    path = _save(tmp_path_factory.mktemp("r") / "c", {"w/x": (arr, "float32")})
    if not offsets:
        without_offsets(path)
    flat, runs, pos = arr.reshape(-1), [], 0
    for _ in range(data.draw(st.integers(1, 4))):
        start = data.draw(st.integers(pos, flat.size - 1))
        block = data.draw(st.integers(1, min(2 * cols, flat.size - start)))
        stride = data.draw(st.integers(block, 3 * cols))
        count = data.draw(st.integers(1, max(1, (flat.size - start - block) // stride + 1)))
        runs.append((start, count, stride, block))
        pos = start + (count - 1) * stride + block
        if pos >= flat.size:
            break
    want = np.concatenate([flat[s + i * t:s + i * t + b] for s, c, t, b in runs for i in range(c)])
    with Checkpoint.open(path) as ck:
        assert _same(ck.read_runs(0, "w/x", runs, verify=verify), want)


def test_piecewise_writes_give_the_whole_writes_digests(tmp_path):
    arr = _array((300, 1000), "bfloat16", seed=3)
    digests = [_stored(_save(tmp_path / how, {"w/x": (arr, "bfloat16")}, how, [1, 999, 1001, 77_777, 150_000]), "w/x")
               for how in ("whole", "flat", "box")]
    assert all(d[0] == digests[0][0] and np.array_equal(d[1], digests[0][1]) for d in digests)


# ---------------------------------------------------------------- bytes read

@pytest.mark.parametrize("shape,dtype", [((1024, 4096), "float32"), ((512, 1024), "bfloat16"), ((192, 768), "float32"),
                                         ((4, 128, 2048), "float32"), ((2048, 1536), "float32")])
@pytest.mark.parametrize("parts", [2, 4, 8])
def test_column_and_row_blocks_read_little_more_than_needed(tmp_path, shape, dtype, parts):
    """The bound: a column block of a 2/4/8-way split of columns that divide evenly reads exactly its
    bytes (tile columns are powers of two); a row block reads at most one flat chunk more at each
    end (chunks are max(16 KiB, 1/1024 of the dataset)): within 5% once the dataset has 8 MiB."""
    arr = _array(shape, dtype)
    path = _save(tmp_path / "c", {"w/x": (arr, dtype)})
    for axis in (len(shape) - 1, 0):  # column blocks, then row blocks
        n = shape[axis] // parts
        for k in range(parts if n else 0):
            start = tuple(k * n if d == axis else 0 for d in range(len(shape)))
            size = tuple(n if d == axis else shape[d] for d in range(len(shape)))
            with Checkpoint.open(path) as ck:
                got = _box_read(ck, "w/x", shape, start, size)
                want = arr[tuple(slice(a, a + z) for a, z in zip(start, size))]
                assert _same(got, want)
                if axis:
                    assert ck.bytes_last_read == want.nbytes, (k, ck.bytes_last_read, want.nbytes)
                else:
                    assert ck.bytes_last_read <= want.nbytes + 2 * chunk_size(arr.nbytes)
                    if arr.nbytes >= 8 << 20:
                        assert ck.bytes_last_read <= 1.05 * want.nbytes


def test_store_source_column_block_reads_only_its_tiles(tmp_path):
    arr = _array((256, 2048), "float32")
    path = _save(tmp_path / "c", {"w/x": (arr, "float32")})
    with Checkpoint.open(path) as ck:
        src = StoreSource(ck)
        slot = Slot("w/x", 0, arr.shape, arr.shape)
        got = src.read(0, slot, (0, 512), (256, 512))
        assert _same(got, arr[:, 512:1024]) and src.bytes_read == arr[:, 512:1024].nbytes
        out = np.zeros((100, 300), np.float32)  # straight into the caller's array, no buffer between
        assert src.read_into(0, slot, (7, 1000), (100, 300), out)
        assert _same(out, arr[7:107, 1000:1300])


def test_neighbouring_column_blocks_share_their_edge_tiles(tmp_path):
    arr = _array((256, 2048), "float32", seed=4)  # tiles of 64 x 64
    path = _save(tmp_path / "c", {"w/x": (arr, "float32")})
    with Checkpoint.open(path) as ck:
        assert _same(_box_read(ck, "w/x", arr.shape, (0, 100), (256, 900)), arr[:, 100:1000])
        assert ck.bytes_last_read == 256 * (1024 - 64) * 4  # tile columns 1..15
        assert _same(_box_read(ck, "w/x", arr.shape, (0, 1000), (256, 500)), arr[:, 1000:1500])
        assert ck.bytes_last_read == 256 * (1536 - 1024) * 4  # column 15 came from the cache


def test_only_edge_tiles_a_read_takes_part_of_are_kept(tmp_path, monkeypatch):
    """Column blocks on tile edges (a TP split of the columns) keep nothing for their neighbours, who
    need none of their tiles; a block ending inside a tile keeps that tile (spied on the cache)."""
    from ucl.store.h5 import ChunkCache
    kept = []
    real = ChunkCache.put
    monkeypatch.setattr(ChunkCache, "put", lambda self, k, v: kept.append(k[2:]) or real(self, k, v))
    arr = _array((256, 2048), "float32", seed=5)  # tiles of 64 x 64, 4 bands
    path = _save(tmp_path / "e", {"w/x": (arr, "float32")})
    with Checkpoint.open(path) as ck:
        for c0 in (0, 1024):
            assert _same(_box_read(ck, "w/x", arr.shape, (0, c0), (256, 1024)), arr[:, c0:c0 + 1024])
            assert ck.bytes_last_read == 256 * 1024 * 4
        assert [k for k in kept if k[0] == "tile"] == []
        assert _same(_box_read(ck, "w/x", arr.shape, (0, 64), (256, 100)), arr[:, 64:164])
        assert sorted(k for k in kept if k[0] == "tile") == [("tile", b, 2) for b in range(4)]


# ---------------------------------------------------------------- tampering

@pytest.fixture
def tiled(tmp_path):
    arr = _array((256, 2048), "float32", seed=9)
    other = _array((256, 2048), "float32", seed=10)
    a = _save(tmp_path / "a", {"w/x": (arr, "float32")})
    b = _save(tmp_path / "b", {"w/x": (other, "float32")})
    return a, b, arr


def _refused(call, code):
    with pytest.raises(StoreError) as e:
        call()
    assert e.value.code == code, (e.value.code, str(e.value))
    return str(e.value)


def test_flipped_byte_in_a_tile_is_caught_and_other_tiles_still_read(tiled):
    path, _, arr = tiled
    grid = tile_grid(arr.shape, 4)
    r, c = grid.tile_rows + 3, 5 * grid.tile_cols + 7  # inside tile (1, 5)
    f = os.path.join(path, "rank_00000.h5")
    with h5py.File(f, "r") as h:
        offset = h["w/x"].id.get_offset()
    with open(f, "r+b") as fh:
        fh.seek(offset + (r * arr.shape[1] + c) * 4)
        b = fh.read(1)
        fh.seek(offset + (r * arr.shape[1] + c) * 4)
        fh.write(bytes([b[0] ^ 0x10]))
    with Checkpoint.open(path) as ck:
        msg = _refused(lambda: _box_read(ck, "w/x", arr.shape, (0, 4 * grid.tile_cols), (256, 4 * grid.tile_cols)), "UCL407")
        assert "tile 1,5" in msg
        clean = (0, 8 * grid.tile_cols), (256, 8 * grid.tile_cols)
        assert _same(_box_read(ck, "w/x", arr.shape, *clean), arr[:, 8 * grid.tile_cols:16 * grid.tile_cols])
        assert ck.bytes_last_read == arr[:, :8 * grid.tile_cols].nbytes  # read by tiles, not by flat chunks
        assert any("checksum mismatch" in p for p in ck.verify())


def _set_attr(path, name, value):
    with h5py.File(os.path.join(path, "rank_00000.h5"), "r+") as h:
        if value is None:
            del h["w/x"].attrs[name]
        else:
            h["w/x"].attrs[name] = value


COLUMN_BLOCK = ((0, 512), (256, 512))


@pytest.mark.parametrize("name,value,code", [
    ("ucl_tiles", "flip", "UCL407"),                          # an edited digest
    ("ucl_tiles", np.zeros(3, np.uint64), "UCL406"),          # a table of the wrong length
    ("ucl_tiles", np.zeros((8, 16), np.uint64), "UCL406"),    # a grid the writer's rule does not give
    ("ucl_tiles", np.zeros(128, np.uint64), "UCL406"),        # the right count, not the grid
    ("ucl_tiles", np.zeros((4, 32), np.int64), "UCL406"),     # signed
    ("ucl_tiles", None, "UCL406"),                            # table removed, manifest still records one
])
def test_tampered_tile_attributes_are_refused(tiled, name, value, code):
    path, _, arr = tiled
    without_offsets(path)  # the tables are read from the attributes (a checkpoint without offsets)
    if isinstance(value, str):
        with h5py.File(os.path.join(path, "rank_00000.h5"), "r") as h:
            value = np.array(h["w/x"].attrs["ucl_tiles"])
        value.reshape(-1)[17] ^= np.uint64(1)
    _set_attr(path, name, value)
    with Checkpoint.open(path) as ck:
        _refused(lambda: _box_read(ck, "w/x", arr.shape, *COLUMN_BLOCK), code)
        assert ck.verify() != []
        assert _same(ck.read(0, "w/x"), arr)  # the data itself is intact: whole reads still work


def test_tampered_table_in_ucl_tables_is_refused(tiled):
    # what readers use when the manifest locates the tables: one tile digest edited in ucl_tables
    path, _, arr = tiled
    with open(os.path.join(path, "manifest.json")) as fh:
        e = json.load(fh)["datasets"][0]["w/x"]
    at = e["tables"] + 8 * (chunk_count(arr.nbytes) + 17)  # tile 17, after the chunk digests
    with open(os.path.join(path, "rank_00000.h5"), "r+b") as fh:
        fh.seek(at)
        b = fh.read(1)
        fh.seek(at)
        fh.write(bytes([b[0] ^ 1]))
    with Checkpoint.open(path) as ck:
        _refused(lambda: _box_read(ck, "w/x", arr.shape, *COLUMN_BLOCK), "UCL407")
        assert any("ucl_tables" in p for p in ck.verify())
        assert _same(ck.read(0, "w/x"), arr)  # the data itself is intact: whole reads still work


def test_edited_manifest_tile_digest_is_refused(tiled):
    path, _, arr = tiled
    mp = os.path.join(path, "manifest.json")
    d = json.loads(open(mp).read())
    e = d["datasets"][0]["w/x"]
    e["tiles"] = e["tiles"][:-1] + ("0" if e["tiles"][-1] != "0" else "1")
    open(mp, "w").write(json.dumps(d))
    with Checkpoint.open(path) as ck:
        _refused(lambda: _box_read(ck, "w/x", arr.shape, *COLUMN_BLOCK), "UCL407")
        assert any("tile" in p for p in ck.verify())


def test_swapped_rank_file_is_refused(tiled):
    path, other, arr = tiled
    shutil.copy(os.path.join(other, "rank_00000.h5"), os.path.join(path, "rank_00000.h5"))
    with Checkpoint.open(path) as ck:
        _refused(lambda: _box_read(ck, "w/x", arr.shape, *COLUMN_BLOCK), "UCL407")
        assert ck.verify() != []


def test_checkpoint_written_before_tiles_reads_by_flat_chunks(tiled):
    # what a ucl without tiles wrote: flat chunk tables only, no 'tiles' in the manifest
    path, _, arr = tiled
    _set_attr(path, "ucl_tiles", None)
    mp = os.path.join(path, "manifest.json")
    d = json.loads(open(mp).read())
    del d["datasets"][0]["w/x"]["tiles"]
    open(mp, "w").write(json.dumps(d))
    with Checkpoint.open(path) as ck:
        assert ck.verify() == []
        assert _same(_box_read(ck, "w/x", arr.shape, *COLUMN_BLOCK), arr[:, 512:1024])
        assert ck.bytes_last_read == arr.nbytes  # every chunk cuts every row


def test_tile_attributes_on_a_flat_dataset_are_refused_by_verify(tmp_path):
    path = _save(tmp_path / "c", {"w/x": (np.arange(1 << 14, dtype=np.float32), "float32")})
    _set_attr(path, "ucl_tiles", np.zeros(4, np.uint64))
    with Checkpoint.open(path) as ck:
        assert any("tile checksum attributes" in p for p in ck.verify())


@settings(max_examples=examples(40), deadline=None)
@given(rows=st.integers(1, 300), cols=st.integers(1, 700), item=st.sampled_from([1, 2, 4]),
       cuts=st.lists(st.floats(0, 1), max_size=6), seed=st.integers(0, 2**31))
def test_incremental_checksums_of_any_pieces_equal_direct_hashes(rows, cols, item, cuts, seed):
    """Pieces of any size, in order: the whole, chunk and tile digests equal hashes taken directly
    of the whole bytes, of each chunk's bytes and of each tile copied out contiguously."""
    from ucl.store.digests import IncrementalChecksum, checksums
    dtype = np.dtype(f"u{item}")
    arr = np.random.default_rng(seed).integers(0, 255, (rows, cols), dtype=np.uint8).astype(dtype)
    flat, raw = arr.reshape(-1), arr.reshape(-1).view(np.uint8)
    bounds = sorted({0, flat.size, *(int(c * flat.size) for c in cuts)})
    h = IncrementalChecksum(arr.shape, dtype)
    for a, b in zip(bounds, bounds[1:]):
        h.advance(a, flat[a:b])
    got, whole = h.result(flat.size), checksums(arr)
    assert got.whole == whole.whole and (got.chunks is None) == (whole.chunks is None)
    assert got.chunks is None or np.array_equal(got.chunks[1], whole.chunks[1])
    assert got.whole == "xxh3_64:" + xxhash.xxh3_64_hexdigest(raw)
    size = chunk_size(raw.size)
    if size is None:
        assert got.chunks is None
    else:
        assert got.chunks[0] == size
        assert list(got.chunks[1]) == [xxhash.xxh3_64_intdigest(raw[i:i + size]) for i in range(0, raw.size, size)]
    grid = tile_grid(arr.shape, item)
    if grid is None:
        assert got.tiles is None
    else:
        want = [xxhash.xxh3_64_intdigest(np.ascontiguousarray(arr[slice(*grid.row_span(b)), slice(*grid.col_span(j, j))]))
                for b in range(grid.nr) for j in range(grid.nc)]
        assert got.tiles[0] == grid and list(got.tiles[1]) == want


@pytest.mark.parametrize("shape,item", [((3 << 20,), 1), ((1500, 1100), 4), ((3, 700, 333), 8)])
@pytest.mark.parametrize("tiles", [True, False])
def test_copy_checksummed_of_several_blocks(shape, item, tiles):
    """Arrays of several copy blocks (about 1 MiB each; rows of 4,400 and 2,664 bytes do not divide it)."""
    test_copy_checksummed_copies_and_gives_the_digests_of_the_bytes.hypothesis.inner_test(shape, item, 5, tiles)


@settings(max_examples=examples(40), deadline=None)
@given(shape=st.lists(st.integers(1, 400), min_size=0, max_size=3).filter(lambda s: math.prod(s) <= 200_000),
       item=st.sampled_from([1, 2, 4, 8]), seed=st.integers(0, 2**31), tiles=st.booleans())
def test_copy_checksummed_copies_and_gives_the_digests_of_the_bytes(shape, item, seed, tiles):
    """The copy is exact, and its digests are those hashed directly of the bytes: whole, per flat
    chunk, and the tiles (none with ``tiles=False``, the flat digests unchanged); ``checksums``
    of the copy agrees."""
    from ucl.store.digests import checksums, copy_checksummed
    dtype = np.dtype(f"u{item}")
    src = np.random.default_rng(seed).integers(0, 255, shape, dtype=np.uint8).astype(dtype)
    dst = np.full_like(src, 7)
    got = copy_checksummed(dst, src, tiles=tiles)
    again = checksums(dst, tiles=tiles)
    assert got.whole == again.whole and (got.tiles is None) == (again.tiles is None)
    assert np.array_equal(dst, src)
    raw = src.reshape(-1).view(np.uint8)
    assert got.whole == "xxh3_64:" + xxhash.xxh3_64_hexdigest(raw)
    size = chunk_size(raw.size)
    assert (got.chunks is None) == (size is None)
    if size is not None:
        assert list(got.chunks[1]) == [xxhash.xxh3_64_intdigest(raw[i:i + size]) for i in range(0, raw.size, size)]
    grid = tile_grid(src.shape, item) if tiles else None
    assert (got.tiles is None) == (grid is None)
    if grid is not None:  # each tile copied out contiguously, hashed
        arr = src.reshape(-1, src.shape[-1])
        want = [xxhash.xxh3_64_intdigest(np.ascontiguousarray(arr[slice(*grid.row_span(b)), slice(*grid.col_span(j, j))]))
                for b in range(grid.nr) for j in range(grid.nc)]
        assert got.tiles[0] == grid and list(got.tiles[1]) == want


def test_copy_checksummed_refuses_unlike_arrays():
    from ucl.store.digests import copy_checksummed
    with pytest.raises(ValueError):
        copy_checksummed(np.zeros((4, 4), np.float32), np.zeros((4, 4), np.float64))
    with pytest.raises(ValueError):
        copy_checksummed(np.zeros((4, 4), np.float32), np.zeros((4, 8), np.float32)[:, ::2])
