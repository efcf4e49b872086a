"""Flat reads and whole-row reads of a tiled compressed dataset: the tile bands a read covers whole
are decoded straight into the caller's array (no band buffer), the partial ones through one; either
way every flat range and block of rows reads the dataset's bytes, whatever bands it starts and
stops in."""
from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings, strategies as st

from tests.passes import examples
from tests.test_compress import _storage, _write
from ucl.store.codec import group_for, units_of

CASES = [("float32", (1024, 384)), ("bfloat16", (2048, 320)), ("int64", (3000, 128))]


@settings(max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=st.sampled_from(CASES), a=st.integers(0, 10**9), b=st.integers(0, 10**9), snap=st.booleans(),
       codec=st.sampled_from(["zstd", "lz4"]))
def test_a_flat_range_reads_its_bytes(tmp_path_factory, case, a, b, snap, codec):
    dtype, shape = case
    arr = np.ascontiguousarray(_storage(dtype, shape, np.random.default_rng(a % 97)))
    grid = units_of(shape, arr.itemsize, group_for(shape, arr.itemsize)).grid  # int64: a short last band
    assert grid is not None and grid.nr > 2, "a dataset of several tile bands"
    band = grid.tile_rows * grid.cols
    start, stop = sorted((a % (arr.size + 1), b % (arr.size + 1)))
    if snap:  # whole bands, the case read straight into the caller's array
        start, stop = start // band * band, stop // band * band
    with _write(tmp_path_factory.mktemp("x") / "c", {"param/w": (arr, dtype)}, codec) as c:
        out = np.full(stop - start, 0x5A, arr.dtype)
        got = c.read_flat(0, "param/w", start, stop, out=out)
        assert got is out and out.tobytes() == arr.reshape(-1)[start:stop].tobytes()
        whole = c.read(0, "param/w")
        assert whole.tobytes() == arr.tobytes()
        rows, cols = shape
        r0 = min(start // cols, rows - 1)  # a block of whole rows from here (a TP rank's row slice)
        r1 = max(stop // cols, r0 + 1)
        k, half = r1 - r0, cols // 2
        for runs, want in (([(r0 * cols, k, cols, cols)], arr[r0:r1]),
                           ([(r0 * cols, 1, k * cols, k * cols)], arr[r0:r1]),
                           ([(r0 * cols, k, cols, half)], arr[r0:r1, :half])):  # not whole rows
            got = c.read_runs(0, "param/w", runs, verify=False)
            assert got.tobytes() == np.ascontiguousarray(want).tobytes(), runs


def test_the_warm_stored_buffer_is_nobody_elses(tmp_path):
    """Stored bytes are read into a buffer this thread reuses read after read: nothing decoded is a
    view of it and no decoding temporary shares it, so reads of other datasets between two reads
    of one (cached units or not) change nothing."""
    rng = np.random.default_rng(9)
    arrays = {"param/a": (np.ascontiguousarray(_storage("float32", (512, 640), rng)), "float32"),
              "param/b": (np.ascontiguousarray(_storage("float32", (700, 300), rng)), "float32"),
              "param/c": (np.ascontiguousarray(_storage("bfloat16", (300, 200), rng)), "bfloat16"),
              "param/d": (np.ascontiguousarray(_storage("float32", (100_000,), rng)), "float32")}
    with _write(tmp_path / "x", arrays, "zstd") as c:
        for key in ["param/a", "param/b", "param/c", "param/d", "param/a", "param/c", "param/b", "param/d"]:
            want = arrays[key][0]
            assert c.info(0, key).encoding == "zstd"
            assert c.read_flat(0, key, 0, want.size).tobytes() == want.tobytes(), key
            if key == "param/d":  # the second round decodes everything again
                c.limit_caches(0)
