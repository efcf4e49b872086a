"""Large datasets written around the page cache (store.direct): the bytes HDF5 reads back are the
bytes given, whatever the memory alignment, length or file system, and a failing write publishes
nothing. The oracle is h5py reading the committed file, not ucl's reader."""
from __future__ import annotations

import errno
import importlib
import os
import threading
import time

import h5py
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ucl.errors import StoreError
from ucl.store import Checkpoint, CheckpointWriter
from ucl.store import direct as direct_mod
from ucl.store.direct import BLOCK, MIN_DIRECT_BYTES, DirectWriter
from tests.passes import examples

FIELDS: dict = {}


def raw_arrays(rng, sizes: list[int], shifts: list[int]) -> list[np.ndarray]:
    """uint8 arrays of ``sizes`` whose memory starts ``shift`` bytes past a block boundary."""
    out = []
    for n, shift in zip(sizes, shifts):
        base = np.empty(n + 2 * BLOCK, np.uint8)
        start = (-base.ctypes.data) % BLOCK + shift
        a = base[start:start + n]
        a[...] = rng.integers(0, 256, n, dtype=np.uint8)
        out.append(a)
    return out


def write(path, arrays, **kw) -> CheckpointWriter:
    w = CheckpointWriter(path, 1, **kw, **FIELDS)
    for i, a in enumerate(arrays):
        w.write(0, f"param/t{i}", a, dtype="uint8")
    w.commit()
    return w


def read_back(path, count: int) -> list[np.ndarray]:
    with h5py.File(os.path.join(path, "rank_00000.h5"), "r") as f:
        return [f[f"param/t{i}"][...] for i in range(count)]


@settings(max_examples=examples(25), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sizes=st.lists(st.sampled_from([MIN_DIRECT_BYTES, MIN_DIRECT_BYTES + 1, MIN_DIRECT_BYTES + BLOCK - 1,
                                       3 * MIN_DIRECT_BYTES + 777, 100, MIN_DIRECT_BYTES - 1]), min_size=1, max_size=4),
       shifts=st.lists(st.sampled_from([0, 16, 512, BLOCK - 1]), min_size=4, max_size=4),
       seed=st.integers(0, 2**32 - 1))
def test_direct_writes_read_back_exactly(tmp_path_factory, sizes, shifts, seed):
    arrays = raw_arrays(np.random.default_rng(seed), sizes, shifts)
    d = tmp_path_factory.mktemp("direct")
    w = write(d / "on", arrays, direct=True)
    write(d / "off", arrays, direct=False)
    for a, on, off in zip(arrays, read_back(d / "on", len(arrays)), read_back(d / "off", len(arrays))):
        assert np.array_equal(a, on) and np.array_equal(a, off)
    big = sum(a.size // BLOCK * BLOCK for a in arrays if a.size >= MIN_DIRECT_BYTES)
    assert w._out.disk.direct_bytes in (0, big)  # 0: this file system refuses O_DIRECT
    with Checkpoint.open(d / "on") as on, Checkpoint.open(d / "off") as off:
        assert on.verify() == []  # the checksums were taken from memory, the bytes read from disk
        assert on.manifest.datasets == off.manifest.datasets


def test_large_datasets_bypass_the_page_cache_where_the_file_system_allows(tmp_path):
    probe = tmp_path / "probe"
    probe.write_bytes(b"")
    try:
        os.close(os.open(probe, os.O_WRONLY | getattr(os, "O_DIRECT", 0)))
    except OSError:
        pytest.skip("this file system refuses O_DIRECT")
    arrays = raw_arrays(np.random.default_rng(0), [4 * MIN_DIRECT_BYTES + 5], [0])
    w = write(tmp_path / "ck", arrays)  # durable: direct by default
    assert w._out.disk.direct_bytes == 4 * MIN_DIRECT_BYTES
    assert write(tmp_path / "lazy", arrays, durable=False)._out.disk.direct_bytes == 0
    with h5py.File(tmp_path / "ck" / "rank_00000.h5", "r") as f:
        assert f["param/t0"].id.get_offset() % BLOCK == 0


def test_a_file_system_refusing_o_direct_gets_buffered_writes(tmp_path, monkeypatch):
    real_open = os.open

    def refuse(path, flags, *a):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "O_DIRECT not supported")
        return real_open(path, flags, *a)

    monkeypatch.setattr(direct_mod.os, "open", refuse)
    arrays = raw_arrays(np.random.default_rng(1), [2 * MIN_DIRECT_BYTES + 3, MIN_DIRECT_BYTES], [0, 16])
    w = write(tmp_path / "ck", arrays, direct=True)
    assert w._out.disk.direct_bytes == 0
    assert all(np.array_equal(a, b) for a, b in zip(arrays, read_back(tmp_path / "ck", 2)))


def test_short_and_refused_direct_writes_fall_back_without_losing_bytes(tmp_path, monkeypatch):
    real_pwrite = os.pwrite

    def short(fd, data, offset):  # at most 1000 bytes per call: the next direct write is unaligned
        return real_pwrite(fd, memoryview(data)[:1000], offset)

    monkeypatch.setattr(direct_mod.os, "pwrite", short)
    arrays = raw_arrays(np.random.default_rng(2), [MIN_DIRECT_BYTES + 4097], [0])
    write(tmp_path / "ck", arrays, direct=True)
    assert np.array_equal(arrays[0], read_back(tmp_path / "ck", 1)[0])


@pytest.mark.parametrize("shift", [0, 64, BLOCK - 1])
def test_unaligned_memory_is_written_exactly_through_the_bounce_pipeline(tmp_path, monkeypatch, shift):
    """Memory off a block boundary (torch's: 64 bytes past a page) goes through two bounce buffers,
    one copied while the other is written: many pieces per dataset, each piece where it belongs."""
    monkeypatch.setattr(direct_mod, "PIECE", 2 * BLOCK)  # many pieces per dataset
    threads = {t.name for t in threading.enumerate()}
    arrays = raw_arrays(np.random.default_rng(shift), [MIN_DIRECT_BYTES + 5 * BLOCK + 3, MIN_DIRECT_BYTES], [shift] * 2)
    w = write(tmp_path / "ck", arrays, direct=True)
    for a, back in zip(arrays, read_back(tmp_path / "ck", len(arrays))):
        assert np.array_equal(a, back)
    assert w._out.disk.direct_bytes in (0, sum(a.size // BLOCK * BLOCK for a in arrays))
    assert {t.name for t in threading.enumerate()} <= threads  # the pipeline's helper is gone


def test_memory_the_device_takes_unaligned_is_written_without_a_copy(tmp_path, monkeypatch):
    """Devices differ in the memory alignment O_DIRECT needs (NVMe: 4 bytes, virtio: 512): once the
    device has taken O_DIRECT, memory off a page boundary is tried straight, and bounced only where
    the device refuses that alignment (remembered). Whatever it does, the bytes read back exactly."""
    bounced = []
    real = DirectWriter._bounce_buffers
    monkeypatch.setattr(DirectWriter, "_bounce_buffers", lambda self: bounced.append(1) or real(self))
    arrays = raw_arrays(np.random.default_rng(5), [MIN_DIRECT_BYTES] * 3, [512] * 3)
    w = write(tmp_path / "ck", arrays, direct=True)
    for a, back in zip(arrays, read_back(tmp_path / "ck", 3)):
        assert np.array_equal(a, back)
    d = w._out.disk
    if not d.direct_bytes:
        pytest.skip("this file system refuses O_DIRECT")
    dev = os.stat(tmp_path).st_dev
    if d._memory_taken.get(dev) == 512:  # taken: only the first piece (is O_DIRECT taken at all?) was bounced
        assert len(bounced) == 1
    else:  # refused: remembered, and every later piece bounced
        assert d._memory_refused[dev] == 512 and d.direct_bytes == sum(a.size for a in arrays)


def test_a_device_refusing_unaligned_memory_keeps_o_direct_for_the_rest(tmp_path, monkeypatch):
    import fcntl
    real_pwrite, refused = os.pwrite, []

    def picky(fd, data, offset):  # a device that takes O_DIRECT only from page-aligned memory
        direct = fcntl.fcntl(fd, fcntl.F_GETFL) & getattr(os, "O_DIRECT", 0)
        if direct and np.frombuffer(data, np.uint8).ctypes.data % BLOCK:
            refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, data, offset)
    monkeypatch.setattr(direct_mod.os, "pwrite", picky)
    arrays = raw_arrays(np.random.default_rng(6), [MIN_DIRECT_BYTES, MIN_DIRECT_BYTES + 7, MIN_DIRECT_BYTES], [64, 64, 0])
    w = write(tmp_path / "ck", arrays, direct=True)
    for a, back in zip(arrays, read_back(tmp_path / "ck", 3)):
        assert np.array_equal(a, back)
    if w._out.disk.direct_bytes:
        assert len(refused) == 1  # tried once, then remembered
        assert w._out.disk.direct_bytes == sum(a.size // BLOCK * BLOCK for a in arrays)  # every aligned byte direct


@pytest.mark.parametrize("fail_at", [1, 2, 5])
def test_a_failing_bounced_write_publishes_nothing(tmp_path, monkeypatch, fail_at):
    probe = DirectWriter()
    (tmp_path / "probe").write_bytes(bytes(2 * BLOCK))
    probe.write(str(tmp_path / "probe"), 0, raw_arrays(np.random.default_rng(0), [2 * BLOCK], [0])[0])
    if not probe.direct_bytes:
        pytest.skip("this file system refuses O_DIRECT")
    real_pwrite, calls = os.pwrite, []

    def failing(fd, data, offset):
        calls.append(offset)
        if len(calls) == fail_at + 1:
            raise OSError(errno.EIO, "Input/output error")
        return real_pwrite(fd, data, offset)
    monkeypatch.setattr(direct_mod, "PIECE", 2 * BLOCK)
    monkeypatch.setattr(direct_mod.os, "pwrite", failing)
    w = CheckpointWriter(tmp_path / "ck", 1, direct=True, **FIELDS)
    with pytest.raises(StoreError) as e:
        w.write(0, "param/t0", raw_arrays(np.random.default_rng(1), [MIN_DIRECT_BYTES], [64])[0], dtype="uint8")
    assert e.value.code == "UCL410" and "Input/output error" in str(e.value)
    assert not (tmp_path / "ck").exists()


def test_a_failing_direct_write_publishes_nothing(tmp_path, monkeypatch):
    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(direct_mod.os, "pwrite", full)
    w = CheckpointWriter(tmp_path / "ck", 1, direct=True, **FIELDS)
    with pytest.raises(StoreError) as e:
        w.write(0, "param/t0", np.zeros(MIN_DIRECT_BYTES, np.uint8), dtype="uint8")
    assert e.value.code == "UCL410"
    assert not (tmp_path / "ck").exists() and os.listdir(tmp_path) == []


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("fail_at", [0, 1, 2])
def test_write_behind_surfaces_a_failed_write_and_publishes_nothing(tmp_path, monkeypatch, fail_at, direct):
    real_pwrite, calls = os.pwrite, []

    def failing(fd, data, offset):  # dataset fail_at's write (one call each) fails, in the background
        calls.append(offset)
        if len(calls) == fail_at + 1:
            raise OSError(errno.EIO, "Input/output error")
        return real_pwrite(fd, data, offset)

    arrays = raw_arrays(np.random.default_rng(3), [MIN_DIRECT_BYTES] * 3, [0, 0, 0])
    monkeypatch.setattr(direct_mod.os, "pwrite", failing)
    w = CheckpointWriter(tmp_path / "ck", 1, direct=direct, write_behind=True, **FIELDS)
    with pytest.raises(StoreError) as e:
        for i, a in enumerate(arrays):
            w.write(0, f"param/t{i}", a, dtype="uint8")
        w.commit()
    assert e.value.code == "UCL410" and "Input/output error" in str(e.value)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("direct", [True, False])
def test_write_behind_writes_every_dataset_exactly(tmp_path, direct):
    arrays = raw_arrays(np.random.default_rng(4), [MIN_DIRECT_BYTES + 3, 10, 2 * MIN_DIRECT_BYTES], [0, 16, 0])
    write(tmp_path / "ck", arrays, direct=direct, write_behind=True)
    write(tmp_path / "plain", arrays, direct=direct)
    assert all(np.array_equal(a, b) for a, b in zip(arrays, read_back(tmp_path / "ck", 3)))
    with Checkpoint.open(tmp_path / "ck") as behind, Checkpoint.open(tmp_path / "plain") as plain:
        assert behind.verify() == [] and behind.manifest.datasets == plain.manifest.datasets


@pytest.mark.parametrize("direct", [True, False])
def test_write_behind_holds_an_array_only_until_the_next_write_returns(tmp_path, monkeypatch, direct):
    """The reshard workers reuse a target buffer two datasets later: a small dataset in between (written
    by HDF5, not behind) must still wait for the large one in flight, on the disk or the page cache."""
    real = DirectWriter.write

    def slow(self, *a):  # a slow device: the write is still in flight when the caller moves on
        time.sleep(0.3)
        return real(self, *a)

    monkeypatch.setattr(DirectWriter, "write", slow)
    big = raw_arrays(np.random.default_rng(5), [MIN_DIRECT_BYTES + 100], [0])[0]
    want = big.copy()
    w = CheckpointWriter(tmp_path / "ck", 1, direct=direct, write_behind=True, **FIELDS)
    w.write(0, "param/t0", big, dtype="uint8")
    w.write(0, "param/t1", np.arange(10, dtype=np.uint8), dtype="uint8")
    big[...] = 0  # allowed now
    w.commit()
    assert np.array_equal(read_back(tmp_path / "ck", 1)[0], want)


@pytest.mark.parametrize("to", ["pp=1,dp=2,tp=4", "universal"])
def test_reshard_of_large_and_small_datasets_is_exact_on_direct_writes(tmp_path, to):
    """Large datasets (direct, written behind) between small ones (HDF5), two forked workers reusing
    their target buffers: every target dataset equals the in-memory execution of the same plan."""
    import ucl
    from ucl.demo import LLAMA_MEGATRON, llama_params
    from ucl.dtypes import storage_dtype
    from ucl.ops import expected_datasets
    dims = dict(vocab=4096, hidden=256, heads=8, kv_heads=4, ffn=704, layers=2)
    model = ucl.load_spec(LLAMA_MEGATRON).bind(dims, llama_params(dims))
    src_mesh, dst_mesh = ucl.Mesh(pp=2, dp=2, tp=2), ucl.Mesh.parse(to)
    rng = np.random.default_rng(0)
    shards = {r: {k: rng.integers(0, 2**16, shape).astype(storage_dtype(dt))
                  for k, (shape, dt) in sorted(expected_datasets(model, src_mesh, r).items())}
              for r in range(src_mesh.size)}
    assert any(a.nbytes >= MIN_DIRECT_BYTES for a in shards[0].values())
    src = ucl.save(tmp_path / "src", shards, model=model, mesh=src_mesh, state={"step": 1})
    want = ucl.execute_memory(ucl.compile(model, src_mesh, dst_mesh), shards)
    ucl.reshard(src, tmp_path / "dst", dst_mesh, workers=2)
    with ucl.open(tmp_path / "dst") as c:
        assert c.verify() == []
        for r, keys in want.items():
            assert set(c.keys(r)) <= set(keys)  # replicas only on their first holder
            for k in c.keys(r):
                g, w = c.read(r, k), keys[k]
                assert g.dtype == w.dtype and g.shape == w.shape and g.tobytes() == w.tobytes(), (r, k)


# ---- one file filled by several writers (lay_out / fill / adopt_filled) ----

@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sizes=st.lists(st.sampled_from([0, 1, 100, MIN_DIRECT_BYTES, MIN_DIRECT_BYTES + 5, 3 * MIN_DIRECT_BYTES + 777]),
                      min_size=1, max_size=5),
       durable=st.booleans(), seed=st.integers(0, 2**16))
def test_a_laid_out_file_filled_by_several_writers_reads_back_exactly(tmp_path_factory, sizes, durable, seed):
    """Datasets laid out by one writer and filled, in any order, by two others (standing for
    processes): h5py reads back the bytes given, and every checksum verifies."""
    d = tmp_path_factory.mktemp("laid")
    rng = np.random.default_rng(seed)
    arrays = {f"param/t{i}": rng.integers(0, 256, n, dtype=np.uint8) for i, n in enumerate(sizes)}
    owner = CheckpointWriter(d / "ck", 1, durable=durable, **FIELDS)
    layer = CheckpointWriter.join(owner.tmp_path, 1, durable=durable)
    offsets = layer.lay_out(0, {k: (a.shape, "uint8") for k, a in arrays.items()})
    parts = [CheckpointWriter.join(owner.tmp_path, 1, durable=durable, write_behind=True) for _ in range(2)]
    for i, k in enumerate(rng.permutation(sorted(arrays))):
        parts[i % 2].fill(0, k, offsets[k], arrays[k], dtype="uint8")
    for p in parts:
        assert p.finish() == {}
    layer.adopt_filled([f for p in parts for f in p.filled])
    owner.adopt(0, layer.finish([0])[0])
    owner.commit()
    with h5py.File(d / "ck" / "rank_00000.h5", "r") as f:
        for k, a in arrays.items():
            assert np.array_equal(f[k][...], a), k
    with Checkpoint.open(d / "ck") as c:
        assert c.verify() == []


def test_laid_out_datasets_are_filled_once_each_as_laid_out(tmp_path):
    layer = CheckpointWriter(tmp_path / "ck", 1, **FIELDS)
    offsets = layer.lay_out(0, {"param/a": ((4,), "float32"), "param/b": ((2, 3), "float32")})
    part = CheckpointWriter.join(layer.tmp_path, 1)
    part.fill(0, "param/a", offsets["param/a"], np.zeros(4, np.float32))
    part.fill(0, "param/b", offsets["param/b"], np.zeros((3, 2), np.float32))  # the wrong shape
    part.fill(0, "param/a", offsets["param/a"], np.zeros(4, np.float32))  # twice
    with pytest.raises(StoreError, match=r"param/b.*float32 \[2, 3\].*\[3, 2\]"):
        layer.adopt_filled(part.filled[1:2])
    layer.adopt_filled(part.filled[:1])
    with pytest.raises(StoreError, match="filled twice"):
        layer.adopt_filled(part.filled[2:])
    with pytest.raises(StoreError, match="written twice"):
        layer.write(0, "param/b", np.zeros((2, 3), np.float32))
    with pytest.raises(StoreError, match=r"never filled: \{0: \['param/b'\]\}"):
        layer.commit()
    assert not os.path.exists(tmp_path / "ck") and os.listdir(tmp_path) == []


def _demo_source(tmp_path):
    import ucl
    from ucl.demo import LLAMA_MEGATRON, llama_params
    from ucl.dtypes import storage_dtype
    from ucl.ops import expected_datasets
    dims = dict(vocab=1024, hidden=128, heads=8, kv_heads=4, ffn=352, layers=2)
    model = ucl.load_spec(LLAMA_MEGATRON).bind(dims, llama_params(dims))
    mesh = ucl.Mesh(pp=2, dp=2, tp=2)
    rng = np.random.default_rng(1)
    shards = {r: {k: rng.integers(0, 2**16, shape).astype(storage_dtype(dt))
                  for k, (shape, dt) in sorted(expected_datasets(model, mesh, r).items())}
              for r in range(mesh.size)}
    return model, mesh, shards, ucl.save(tmp_path / "src", shards, model=model, mesh=mesh, state={"step": 1})


@pytest.mark.parametrize("to,workers,durable", [("universal", 2, True), ("universal", 3, False),
                                                ("pp=1,dp=1,tp=2", 3, True)])
def test_reshard_fills_large_target_files_with_several_workers(tmp_path, monkeypatch, to, workers, durable):
    """Target files larger than one worker's share are laid out and filled by several forked
    workers: each dataset equals the in-memory execution of the plan, and checksums verify."""
    import ucl
    reshard_mod = importlib.import_module("ucl.ops.reshard")
    model, mesh, shards, src = _demo_source(tmp_path)
    monkeypatch.setattr(importlib.import_module("ucl.ops.shares"), "SPLIT_MIN_BYTES", 0)
    dst_mesh = ucl.Mesh.parse(to)
    results = []
    real = reshard_mod._execute
    monkeypatch.setattr(reshard_mod, "_execute", lambda *a, **k: results.extend(real(*a, **k)) or results)
    ucl.reshard(src, tmp_path / "dst", dst_mesh, workers=workers, durable=durable)
    assert sum(1 for r in results if r.filled) >= 2  # several workers wrote into one file
    want = ucl.execute_memory(ucl.compile(model, mesh, dst_mesh), shards)
    with ucl.open(tmp_path / "dst") as c:
        assert c.verify() == []
        for r, keys in want.items():
            assert set(c.keys(r)) <= set(keys) and c.keys(r)
            for k in c.keys(r):
                g, w = c.read(r, k), keys[k]
                assert g.dtype == w.dtype and g.shape == w.shape and g.tobytes() == w.tobytes(), (r, k)


def test_a_failing_filler_publishes_nothing(tmp_path, monkeypatch):
    import ucl
    reshard_mod = importlib.import_module("ucl.ops.reshard")
    *_, src = _demo_source(tmp_path)
    monkeypatch.setattr(importlib.import_module("ucl.ops.shares"), "SPLIT_MIN_BYTES", 0)
    calls = []

    def failing(self, *a, **k):
        calls.append(1)
        if len(calls) == 3:  # in each forked worker, mid-way
            raise OSError(errno.EIO, "injected")
        return real(self, *a, **k)
    real = DirectWriter.write
    monkeypatch.setattr(DirectWriter, "write", failing)
    with pytest.raises(StoreError, match="injected"):
        ucl.reshard(src, tmp_path / "dst", "universal", workers=2)
    assert not (tmp_path / "dst").exists()
    assert sorted(os.listdir(tmp_path)) == ["src"]


def test_arena_arrays_go_to_the_disk_without_a_bounce_copy(tmp_path, monkeypatch):
    """Reshard workers assemble target datasets in Arena memory: it starts on a page boundary (also
    after growing), so a direct write of it needs no copy through the bounce buffer."""
    from ucl.plan.buffers import Arena
    arena = Arena()
    for n in (10, MIN_DIRECT_BYTES + 8, 3 * MIN_DIRECT_BYTES, 2 * MIN_DIRECT_BYTES):
        a = arena.array((n // 8,), np.float64)
        assert a.ctypes.data % BLOCK == 0 and a.size == n // 8
    monkeypatch.setattr(DirectWriter, "_bounce_buffers", lambda self: pytest.fail("bounce copy of aligned memory"))
    a = arena.array((3 * MIN_DIRECT_BYTES,), np.uint8)
    a[...] = np.random.default_rng(8).integers(0, 256, a.size, dtype=np.uint8)
    w = write(tmp_path / "ck", [a], direct=True)
    assert np.array_equal(read_back(tmp_path / "ck", 1)[0], a)
    assert w._out.disk.direct_bytes in (0, a.size)  # 0: this file system refuses O_DIRECT
