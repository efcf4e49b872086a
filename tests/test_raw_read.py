"""Reads by byte offset (ucl.store.raw): every read equals numpy indexing of the same bytes.

The oracle is numpy on the array the file was made from; the file holds it at an arbitrary offset
between unrelated bytes, so an off-by-one in an offset reads those instead."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ucl.errors import StoreError
from ucl.store.raw import RawFile, locate, read_table
from tests.passes import examples

SETTINGS = settings(deadline=None, max_examples=examples(60), suppress_health_check=[HealthCheck.function_scoped_fixture])


def _file(tmp_path, arr: np.ndarray, offset: int):
    path = tmp_path / "f.bin"
    rng = np.random.default_rng(offset)
    junk = rng.integers(0, 256, offset + 4096, dtype=np.uint8)
    path.write_bytes(junk[:offset].tobytes() + arr.tobytes() + junk[offset:].tobytes())
    return RawFile(str(path), "test file")


@given(rows=st.integers(1, 40), cols=st.integers(1, 3000), dtype=st.sampled_from(["uint8", "float32", "int64"]),
       offset=st.integers(0, 5000), data=st.data())
@SETTINGS
def test_runs_and_rows_equal_numpy(tmp_path, rows, cols, dtype, offset, data):
    # uint8 rows of 3000 elements, cut in big blocks, take the block-by-block path (>= 64 KiB blocks
    # need wide rows: runs of whole rows reach it); short blocks are gathered from a mapping
    arr = np.random.default_rng(rows * cols).integers(0, 100, (rows, cols)).astype(dtype)
    f = _file(tmp_path, arr, offset)
    try:
        d = locate(f, offset, arr.shape, arr.dtype, arr.nbytes)
        flat = arr.reshape(-1)
        start = data.draw(st.integers(0, flat.size - 1))
        block = data.draw(st.integers(1, flat.size - start))
        stride = data.draw(st.integers(block, max(block, flat.size)))
        count = data.draw(st.integers(1, (flat.size - start - block) // stride + 1))
        out = np.empty(count * block, arr.dtype)
        d.read_runs_into([(start, count, stride, block)], out)
        want = np.concatenate([flat[start + i * stride:start + i * stride + block] for i in range(count)])
        assert np.array_equal(out, want)
        r0 = data.draw(st.integers(0, rows - 1))
        r1 = data.draw(st.integers(r0 + 1, rows))
        c0 = data.draw(st.integers(0, cols - 1))
        c1 = data.draw(st.integers(c0 + 1, cols))
        pad = data.draw(st.integers(0, 3))  # a destination wider than the box: rows are not contiguous
        dst = np.zeros((r1 - r0 + 1, c1 - c0 + pad), arr.dtype)
        d.read_rows_into((r0, r1), (c0, c1), dst, (1, pad))
        assert np.array_equal(dst[1:, pad:], arr[r0:r1, c0:c1]) and not dst[0].any() and not dst[:, :pad].any()
    finally:
        f.close()


def test_big_blocks_are_read_one_by_one(tmp_path):
    arr = np.arange(4 * 70_000, dtype=np.uint8).reshape(4, 70_000)
    f = _file(tmp_path, arr, 123)
    d = locate(f, 123, arr.shape, arr.dtype, arr.nbytes)
    out = np.empty(2 * 66_000, np.uint8)
    d.read_runs_into([(10, 2, 140_000, 66_000)], out)  # rows 0 and 2, 66,000 bytes each
    assert np.array_equal(out, np.concatenate([arr[0, 10:66_010], arr[2, 10:66_010]]))
    f.close()


def test_small_blocks_far_apart_are_read_one_by_one(tmp_path, monkeypatch):
    """Column blocks of wide rows: one pread per block, not the span; spied on, checked against numpy."""
    import ucl.store.raw as raw_mod
    arr = np.arange(6 * 10_000, dtype=np.float32).reshape(6, 10_000)  # rows 40,000 bytes apart
    f = _file(tmp_path, arr, 77)
    d = locate(f, 77, arr.shape, arr.dtype, arr.nbytes)
    reads = []
    real = raw_mod.RawDataset.read_flat_into
    monkeypatch.setattr(raw_mod.RawDataset, "read_flat_into",
                        lambda self, a, b, out: reads.append(b - a) or real(self, a, b, out))
    out = np.empty(6 * 500, np.float32)
    d.read_runs_into([(2_000, 6, 10_000, 500)], out)
    assert np.array_equal(out.reshape(6, 500), arr[:, 2_000:2_500]) and reads == [500] * 6
    f.close()


@pytest.mark.parametrize("offset,nbytes", [(-1, 8), (10 ** 9, 8), (0, 10 ** 9), ("8", 8), (True, 8)])
def test_offsets_outside_the_file_are_refused_before_reading(tmp_path, offset, nbytes):
    f = _file(tmp_path, np.zeros(16, np.uint8), 0)
    with pytest.raises(StoreError) as e:
        locate(f, offset, (nbytes,), np.dtype(np.uint8), nbytes)
    assert e.value.code == "UCL406" and "test file" in str(e.value)
    with pytest.raises(StoreError):
        read_table(f, offset, nbytes)
    f.close()


@pytest.mark.parametrize("runs", [[(0, 1, 1000, 1000)], [(0, 100, 10, 3)]], ids=["contiguous", "strided"])
def test_a_file_cut_short_after_the_check_is_a_clear_error(tmp_path, runs):
    """Read by pread or gathered from a mapping: a file truncated since its size was checked is a
    StoreError (a mapped read past the end would be a SIGBUS)."""
    arr = np.arange(1000, dtype=np.int64)
    f = _file(tmp_path, arr, 64)
    d = locate(f, 64, arr.shape, arr.dtype, arr.nbytes)
    with open(tmp_path / "f.bin", "r+b") as fh:  # truncated by someone else after the size was checked
        fh.truncate(64 + 800)
    with pytest.raises(StoreError) as e:
        d.read_runs_into(runs, np.empty(sum(c * b for _, c, _, b in runs), np.int64))
    assert e.value.code == "UCL406" and "truncated" in str(e.value)
    f.close()


def test_short_blocks_close_together_are_gathered_from_a_mapping(tmp_path, monkeypatch):
    """Column blocks of narrow rows: no pread of the span (spied on), the blocks copied out of a
    mapping, released after each piece; checked against numpy."""
    import ucl.store.raw as raw_mod
    arr = np.arange(5000 * 96, dtype=np.float32).reshape(5000, 96)  # rows 384 bytes apart
    f = _file(tmp_path, arr, 4099)  # the data starts past a page boundary, not on one
    d = locate(f, 4099, arr.shape, arr.dtype, arr.nbytes)
    reads, maps = [], []
    monkeypatch.setattr(raw_mod.RawFile, "read_into", lambda self, offset, out: reads.append(offset))
    real_mmap = raw_mod.mmap.mmap

    def spy(*a, **kw):
        maps.append(real_mmap(*a, **kw))
        return maps[-1]
    monkeypatch.setattr(raw_mod.mmap, "mmap", spy)
    monkeypatch.setattr(raw_mod, "_SPAN_BYTES", 64 << 10)  # several pieces
    out = np.empty(5000 * 24, np.float32)
    d.read_runs_into([(40, 5000, 96, 24)], out)
    assert np.array_equal(out.reshape(5000, 24), arr[:, 40:64]) and reads == []
    assert len(maps) > 1 and all(m.closed for m in maps)
    f.close()


def test_a_file_system_refusing_mmap_gets_span_reads(tmp_path, monkeypatch):
    """Where mmap is refused (ENODEV on some FUSE mounts), strided reads take their span by pread,
    every piece after the first refusal too; equal to numpy."""
    import errno
    import ucl.store.raw as raw_mod
    calls = []

    def refuse(*a, **kw):
        calls.append(a)
        raise OSError(errno.ENODEV, "No such device")
    monkeypatch.setattr(raw_mod.mmap, "mmap", refuse)
    monkeypatch.setattr(raw_mod, "_SPAN_BYTES", 64 << 10)  # several pieces
    arr = np.arange(3000 * 96, dtype=np.float32).reshape(3000, 96)
    f = _file(tmp_path, arr, 13)
    d = locate(f, 13, arr.shape, arr.dtype, arr.nbytes)
    out = np.empty(3000 * 10, np.float32)
    d.read_runs_into([(5, 3000, 96, 10)], out)
    assert np.array_equal(out.reshape(3000, 10), arr[:, 5:15]) and len(calls) == 1 and f.unmappable
    f.close()
