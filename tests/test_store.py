"""Store layer: bit-exact round trips, hyperslab reads, corruption detection, crash safety."""
from __future__ import annotations

import errno
import json
import math
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ucl.store.h5 as store_h5
import ucl.store.writer as store_writer
from ucl.errors import StoreError
from ucl.dtypes import LOGICAL_DTYPES, itemsize, storage_dtype, to_numpy, to_torch
from ucl.layout.boxes import flat_boxes
from ucl.store import FORMAT_VERSION, READ_VERSION, Checkpoint, CheckpointRoot, CheckpointWriter, Manifest, cleanup_stale
from tests.corrupt import without_offsets
from tests.passes import examples

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAST = settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _tensor(dtype: str, shape=(5, 6), seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == "bool":
        return torch.rand(shape, generator=g) > 0.5
    if dtype.startswith(("int", "uint")):
        lo, hi = (0, 256) if dtype == "uint8" else (-100, 100)
        return torch.randint(lo, hi, shape, generator=g).to(getattr(torch, dtype))
    return (torch.randn(shape, generator=g) * 3).to(getattr(torch, dtype))


def _bits(t: torch.Tensor) -> torch.Tensor:
    if t.dtype == torch.bool:
        return t
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _listing(root):
    return sorted(os.listdir(root))


# ---------------------------------------------------------------- dtypes

def test_dtype_table():
    assert set(LOGICAL_DTYPES) == {"float32", "float64", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2",
                                   "int8", "int16", "int32", "int64", "uint8", "bool"}
    assert storage_dtype("bfloat16") == np.dtype("<u2") and storage_dtype("float8_e5m2") == np.dtype("u1")
    assert itemsize("float64") == 8 and itemsize("bool") == 1
    with pytest.raises(StoreError) as e:
        storage_dtype("complex64")
    assert e.value.code == "UCL412"


@pytest.mark.parametrize("dtype", LOGICAL_DTYPES)
def test_roundtrip_every_dtype_from_torch(tmp_path, dtype):
    t = _tensor(dtype, (6, 8))
    views = {"param/full": t, "param/strided.t": t[:, ::3].t(), "step/scalar": t[2, 3]}
    assert not views["param/strided.t"].is_contiguous() and views["step/scalar"].dim() == 0
    with CheckpointWriter(tmp_path / "ck", 1, state={"dtype": dtype}) as w:
        for key, v in views.items():
            w.write(0, key, v)
        w.commit()
    with Checkpoint.open(tmp_path / "ck") as ck:
        for key, v in views.items():
            info = ck.info(0, key)
            assert info.dtype == dtype and info.shape == tuple(v.shape)
            back = ck.to_torch(0, key)
            assert back.dtype == v.dtype and back.shape == v.shape
            assert torch.equal(_bits(back), _bits(v))
            raw, logical = to_numpy(v)
            assert logical == dtype and np.array_equal(ck.read(0, key), raw)
        assert ck.verify() == []


@pytest.mark.parametrize("dtype", LOGICAL_DTYPES)
def test_to_numpy_to_torch_bit_exact(dtype):
    t = _tensor(dtype, (3, 4, 5), seed=1)[:, 1:, ::2]
    arr, logical = to_numpy(t)
    assert logical == dtype and arr.dtype == storage_dtype(dtype) and arr.flags.c_contiguous
    assert torch.equal(_bits(to_torch(arr, dtype)), _bits(t))


def test_numpy_inputs(tmp_path):
    bits = np.array([0x3F80, 0xC000, 0x7FC0], dtype=np.uint16)  # bf16 1.0, -2.0, nan
    with pytest.raises(StoreError) as e:
        to_numpy(bits)
    assert e.value.code == "UCL412" and "bfloat16" in str(e.value)
    with CheckpointWriter(tmp_path / "ck", 1) as w:
        w.write(0, "param/bf", bits, dtype="bfloat16")
        w.write(0, "param/be", np.arange(6, dtype=">f4").reshape(2, 3))  # big-endian in, little out
        w.write(0, "param/py", np.float64(2.5))
        w.commit()
    ck = Checkpoint.open(tmp_path / "ck")
    assert ck.to_torch(0, "param/bf").tolist()[:2] == [1.0, -2.0]
    assert ck.read(0, "param/be").dtype == np.dtype("<f4") and ck.read(0, "param/be")[1, 2] == 5
    assert ck.read(0, "param/py").shape == () and ck.info(0, "param/py").dtype == "float64"


# ---------------------------------------------------------------- hyperslabs

@given(shape=st.lists(st.integers(0, 5), max_size=4), data=st.data())
@settings(max_examples=examples(300), deadline=None)
def test_flat_boxes_cover_range_exactly(shape, data):
    total = math.prod(shape)
    start = data.draw(st.integers(0, total))
    stop = data.draw(st.integers(start, total))
    idx = np.arange(total).reshape(shape)
    boxes = list(flat_boxes(tuple(shape), start, stop))
    assert len(boxes) <= max(1, 2 * len(shape) - 1)
    got = [idx[tuple(slice(s, s + z) for s, z in zip(st_, sz))].reshape(-1) for _, st_, sz in boxes]
    flat = np.concatenate(got) if got else np.zeros(0, int)
    assert flat.tolist() == list(range(start, stop))
    assert [off for off, _, _ in boxes] == [int(g[0]) for g in got if g.size]


SHAPES = [(), (0,), (7,), (3, 4), (2, 3, 5), (2, 1, 3, 4), (4, 0, 3)]


@pytest.fixture(scope="module", params=["offsets", "hdf5"])
def slab_ck(tmp_path_factory, request):
    """Read by the manifest's byte offsets, or through HDF5 (a checkpoint written before offsets)."""
    path = tmp_path_factory.mktemp("slab") / "ck"
    arrays = {f"param/a{i}.w": np.arange(math.prod(s), dtype=np.float32).reshape(s) * 1.5 - 7
              for i, s in enumerate(SHAPES)}
    arrays["param/bf"] = np.arange(60, dtype=np.uint16).reshape(3, 4, 5)
    with CheckpointWriter(path, 1) as w:
        for k, a in arrays.items():
            w.write(0, k, a, dtype="bfloat16" if k == "param/bf" else None)
        w.commit()
    if request.param == "hdf5":
        without_offsets(path)
    ck = Checkpoint.open(path)
    yield ck, arrays
    ck.close()


@given(data=st.data())
@settings(max_examples=examples(200), deadline=None)
def test_read_box_and_flat_equal_numpy(slab_ck, data):
    ck, arrays = slab_ck
    key = data.draw(st.sampled_from(sorted(arrays)))
    a = arrays[key]
    starts = [data.draw(st.integers(0, n)) for n in a.shape]
    sizes = [data.draw(st.integers(0, n - s)) for s, n in zip(starts, a.shape)]
    box = ck.read_box(0, key, starts, sizes)
    assert box.dtype == a.dtype and np.array_equal(box, a[tuple(slice(s, s + z) for s, z in zip(starts, sizes))])
    start = data.draw(st.integers(0, a.size))
    stop = data.draw(st.integers(start, a.size))
    assert np.array_equal(ck.read_flat(0, key, start, stop), a.reshape(-1)[start:stop])


def test_read_bounds_and_out(slab_ck):
    ck, arrays = slab_ck
    with pytest.raises(StoreError) as e:
        ck.read_box(0, "param/a3.w", (2, 0), (2, 4))
    assert e.value.code == "UCL409"
    with pytest.raises(StoreError):
        ck.read_flat(0, "param/a3.w", 5, 13)
    out = np.empty((2, 2), np.float32)
    assert ck.read_box(0, "param/a3.w", (1, 2), (2, 2), out=out) is out
    with pytest.raises(StoreError) as e:
        ck.read(0, "param/nope")
    assert e.value.code == "UCL408"
    with pytest.raises(StoreError):
        ck.keys(1)


@given(shape=st.lists(st.integers(1, 4), min_size=0, max_size=3), data=st.data())
@FAST
def test_preallocated_pieces_in_any_order(tmp_path, shape, data):
    a = np.arange(math.prod(shape), dtype=np.int32).reshape(shape) * 3 - 5
    cuts = sorted(set(data.draw(st.lists(st.integers(0, a.size), max_size=4)) + [0, a.size]))
    pieces = list(zip(cuts[:-1], cuts[1:]))
    order = data.draw(st.permutations(pieces))
    path = tmp_path / f"ck{len(os.listdir(tmp_path))}"
    with CheckpointWriter(path, 1) as w:
        w.create(0, "exp_avg/@flat0", shape, "int32")
        for s, e in order:
            w.write_flat(0, "exp_avg/@flat0", s, a.reshape(-1)[s:e])
        w.create(0, "exp_avg/boxed", shape, "int32")
        if shape:
            half = shape[0] // 2
            w.write_slice(0, "exp_avg/boxed", (slice(half, None),) + (slice(None),) * (len(shape) - 1), a[half:])
            w.write_box(0, "exp_avg/boxed", (0,) * len(shape), a[:half])
        else:
            w.write_slice(0, "exp_avg/boxed", 0, a)
        w.commit()
    with Checkpoint.open(path) as ck:
        assert np.array_equal(ck.read(0, "exp_avg/@flat0"), a) and np.array_equal(ck.read(0, "exp_avg/boxed"), a)
        assert ck.verify() == []


def test_write_misuse(tmp_path):
    with CheckpointWriter(tmp_path / "ck", 1) as w:
        w.create(0, "fp32/x", (4,), "float32")
        with pytest.raises(StoreError) as e:
            w.write_flat(0, "fp32/x", 0, np.zeros(4, np.float64))  # no silent casts
        assert e.value.code == "UCL409"
        with pytest.raises(StoreError):
            w.write_flat(0, "fp32/x", 2, np.zeros(3, np.float32))
        with pytest.raises(StoreError) as e:
            w.create(0, "fp32/x", (4,), "float32")
        assert e.value.code == "UCL411"
        for bad in ("nokind", "a/b/c", "/x", "a/.."):
            with pytest.raises(StoreError):
                w.write(0, bad, np.zeros(1))
        with pytest.raises(StoreError) as e:
            w.write(1, "param/x", np.zeros(1))
        assert e.value.code == "UCL408"
        w.commit()


# ---------------------------------------------------------------- manifest

def test_manifest_roundtrip_and_validation():
    m = Manifest(dims={"hidden": 8}, mesh=[("pp", 2), ("tp", 1)], files=["rank_00000.h5", "rank_00001.h5"],
                 datasets=[{"param/w": {"dtype": "bfloat16", "shape": [2, 3], "checksum": "xxh3_64:" + "0" * 16}}, {}],
                 spec="mesh pp, tp", params={"w": [2, 3]}, state={"step": np.int64(5), "rng": np.arange(3)})
    m2 = Manifest.from_json(m.to_json())
    assert m2.mesh == [("pp", 2), ("tp", 1)] and m2.state == {"step": 5, "rng": [0, 1, 2]}
    assert m2.datasets == m.datasets and m2.nranks == 2 and m2.version == FORMAT_VERSION
    d = json.loads(m.to_json())
    for key in ("files", "datasets", "mesh", "version"):
        bad = {k: v for k, v in d.items() if k != key}
        with pytest.raises(StoreError, match=key):
            Manifest.from_json(json.dumps(bad))
    with pytest.raises(StoreError) as e:
        Manifest.from_json(json.dumps({**d, "mesh": [["pp", 3]]}))  # 3 ranks, 2 files
    assert e.value.code == "UCL403"
    with pytest.raises(StoreError) as e:
        Manifest.from_json(json.dumps({**d, "files": ["../evil.h5", "rank_00001.h5"]}))
    assert e.value.code == "UCL403"
    assert Manifest.from_json(json.dumps({**d, "future_key": 1})).extra == {"future_key": 1}
    with pytest.raises(StoreError) as e:
        Manifest(state={"loss": float("nan")}, files=["rank_00000.h5"], datasets=[{}]).to_json()
    assert e.value.code == "UCL403"


def _simple(path, value=1.0, nranks=2):
    with CheckpointWriter(path, nranks, mesh=[("dp", nranks)], state={"step": int(value)}) as w:
        for r in range(nranks):
            w.write(r, "param/layers.0.w", np.full((4, 5), value + r, np.float32))
            w.write(r, "step/step", np.int64(value))
        w.commit()
    return path


def test_newer_version_refused(tmp_path):
    p = _simple(tmp_path / "ck")
    m = json.loads((p / "manifest.json").read_text())
    m["version"] = READ_VERSION + 1
    (p / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(StoreError, match="newer") as e:
        Checkpoint.open(p)
    assert e.value.code == "UCL402"


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(StoreError) as e:
        Checkpoint.open(tmp_path / "missing")
    assert e.value.code == "UCL404"
    with pytest.raises(StoreError) as e:
        Checkpoint.open(tmp_path)
    assert e.value.code == "UCL401"


# ---------------------------------------------------------------- corruption

def test_corrupt_byte_detected(tmp_path):
    p = tmp_path / "ck"
    pattern = (np.arange(512, dtype="<i8") * 7919 + 0x1234567890)
    with CheckpointWriter(p, 1) as w:
        w.write(0, "exp_avg/layers.3.mlp.w", pattern)
        w.write(0, "param/ok", np.ones(3, np.float32))
        w.commit()
    f = p / "rank_00000.h5"
    raw = bytearray(f.read_bytes())
    at = raw.find(pattern.tobytes()) + 1000
    raw[at] ^= 0xFF
    f.write_bytes(bytes(raw))
    ck = Checkpoint.open(p)
    with pytest.raises(StoreError, match=r"exp_avg/layers\.3\.mlp\.w") as e:
        ck.read(0, "exp_avg/layers.3.mlp.w")
    assert e.value.code == "UCL407" and "rank 0" in str(e.value) and "rank_00000.h5" in str(e.value)
    assert ck.read(0, "param/ok").tolist() == [1, 1, 1]
    problems = ck.verify()
    assert len(problems) == 1 and "exp_avg/layers.3.mlp.w" in problems[0]


@pytest.mark.parametrize("runs", [
    [(0, 1, 40_000, 40_000)],  # one flat range: its whole chunks are read in place and checked there
    [(3, 9_000, 4, 2)],  # strided: the chunks around it are staged, then checked
])
def test_a_flipped_byte_is_reported_with_its_chunks_elements(tmp_path, runs):
    """The chunk a flipped byte lies in (16 KiB = 4,096 float32 elements here) is the one named,
    whichever path verifies it; reads that avoid it still succeed."""
    p = tmp_path / "ck"
    data = np.arange(40_000, dtype=np.float32)
    with CheckpointWriter(p, 1) as w:
        w.write(0, "param/w", data)
        w.commit()
    f = p / "rank_00000.h5"
    raw = bytearray(f.read_bytes())
    at = raw.find(data.tobytes()) + 4 * 4096 * 5 + 123  # inside chunk 5: elements 20480..24576
    raw[at] ^= 0x01
    f.write_bytes(bytes(raw))
    ck = Checkpoint.open(p)
    with pytest.raises(StoreError, match=r"elements 20480\.\.24576\)") as e:
        ck.read_runs(0, "param/w", runs, verify=True)
    assert e.value.code == "UCL407"
    assert np.array_equal(ck.read_runs(0, "param/w", [(0, 1, 20_480, 20_480)], verify=True), data[:20_480])
    assert np.array_equal(ck.read_runs(0, "param/w", [(24_576, 1, 15_424, 15_424)], verify=True), data[24_576:])


def test_truncated_file_is_a_clear_error(tmp_path):
    p = _simple(tmp_path / "ck")
    f = p / "rank_00001.h5"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    ck = Checkpoint.open(p)  # lazy: rank 0 still readable
    assert ck.read(0, "param/layers.0.w")[0, 0] == 1.0
    with pytest.raises(StoreError, match="truncated") as e:
        ck.read(1, "param/layers.0.w")
    assert e.value.code == "UCL406" and "rank_00001.h5" in str(e.value)
    problems = ck.verify()
    assert len(problems) == 1 and "rank 1" in problems[0]
    os.unlink(p / "rank_00000.h5")
    assert any("missing" in s for s in Checkpoint.open(p).verify())


# ---------------------------------------------------------------- commit protocol

def test_existing_target_is_refused_untouched(tmp_path):
    p = _simple(tmp_path / "ck")
    before = {n: (p / n).read_bytes() for n in os.listdir(p)}
    with pytest.raises(StoreError) as e:
        CheckpointWriter(p, 2, mesh=[("dp", 2)])
    assert e.value.code == "UCL405"
    assert {n: (p / n).read_bytes() for n in os.listdir(p)} == before and _listing(tmp_path) == ["ck"]


def test_leaving_without_commit_discards(tmp_path):
    with pytest.raises(StoreError) as e:
        with CheckpointWriter(tmp_path / "ck", 1) as w:
            w.write(0, "param/x", np.zeros(2))
    assert e.value.code == "UCL411" and _listing(tmp_path) == []
    with pytest.raises(StoreError):
        w.write(0, "param/y", np.zeros(2))


def _root_with_step1(tmp_path):
    root = CheckpointRoot(tmp_path / "run")
    _simple(root.path_for(1), 1.0)
    root.set_latest(1)
    return root


def _assert_only_step1(root):
    assert root.steps() == [1] and root.latest() == root.path_for(1)
    assert [n for n in _listing(root.root) if not n.startswith(".")] == ["latest", "step_00000001"]
    with root.open() as ck:
        assert ck.verify() == [] and ck.read(1, "param/layers.0.w")[0, 0] == 2.0 and ck.state == {"step": 1}


@pytest.mark.parametrize("failure", ["runtime", "enospc", "enospc_at_commit"])
def test_failed_write_leaves_previous_checkpoint(tmp_path, monkeypatch, failure):
    root = _root_with_step1(tmp_path)
    calls = []
    real = store_h5.create_dataset

    def flaky(*args, **kw):
        calls.append(1)
        if len(calls) > 2:
            if failure == "runtime":
                raise RuntimeError("boom after two datasets")
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*args, **kw)

    def full_disk(*args, **kw):
        raise OSError(errno.ENOSPC, "No space left on device")

    if failure == "enospc_at_commit":
        monkeypatch.setattr(store_writer, "write_atomic", full_disk)
    else:
        monkeypatch.setattr(store_h5, "create_dataset", flaky)
    with pytest.raises((RuntimeError, StoreError)) as e:
        with root.writer(2, 2, mesh=[("dp", 2)]) as w:
            for r in range(2):
                w.write(r, "param/a", np.ones(10, np.float32))
                w.write(r, "param/b", np.ones(10, np.float32))
            w.commit()
            root.set_latest(2)
    if failure != "runtime":
        assert e.value.code == "UCL410" and "No space" in str(e.value)
    _assert_only_step1(root)
    assert _listing(root.root) == ["latest", "step_00000001"]  # temp dir removed too


KILLED_WRITER = """
import os, signal, sys
import numpy as np
import ucl.store.writer as h
from ucl.store import CheckpointRoot
root = CheckpointRoot(sys.argv[1])
die = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
if sys.argv[2] == "before_rename":
    h.publish_dir = die
w = root.writer(2, 2, mesh=[("dp", 2)])
w.write(0, "param/layers.0.w", np.zeros((4, 5), np.float32))
if sys.argv[2] == "mid_write":
    w.create(1, "param/layers.0.w", (4, 5), "float32")
    w.write_flat(1, "param/layers.0.w", 0, np.zeros(7, np.float32))
    die()
w.write(1, "param/layers.0.w", np.zeros((4, 5), np.float32))
w.commit()
root.set_latest(2)
"""


@pytest.mark.parametrize("where", ["mid_write", "before_rename"])
def test_killed_writer_leaves_previous_checkpoint(tmp_path, where):
    root = _root_with_step1(tmp_path)
    env = {**os.environ, "PYTHONPATH": REPO}
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(KILLED_WRITER), root.root, where], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == -9, proc.stderr
    _assert_only_step1(root)
    stale = [n for n in _listing(root.root) if n.startswith(".step_00000002.tmp-")]
    assert len(stale) == 1
    with pytest.raises(StoreError):
        Checkpoint.open(os.path.join(root.root, stale[0]))
    assert cleanup_stale(root.root, min_age_s=3600) == []
    assert root.cleanup_stale() == [os.path.join(root.root, stale[0])]
    assert _listing(root.root) == ["latest", "step_00000001"]


# ---------------------------------------------------------------- root, retention, multi-process

def test_root_latest_and_prune(tmp_path):
    root = CheckpointRoot(tmp_path / "run")
    assert root.steps() == [] and root.latest() is None
    for step in (100, 200, 300, 400):
        _simple(root.path_for(step), float(step), nranks=1)
    assert root.path_for(100).endswith("step_00000100") and root.steps() == [100, 200, 300, 400]
    with pytest.raises(StoreError) as e:
        root.set_latest(500)
    assert e.value.code == "UCL413"
    root.set_latest(200)
    assert root.latest_step() == 200 and (tmp_path / "run" / "latest").read_text() == "step_00000200\n"
    removed = root.prune(keep=1)
    assert sorted(removed) == [root.path_for(100), root.path_for(300)]
    assert root.steps() == [200, 400] and root.latest() == root.path_for(200)
    assert root.open(400).read(0, "step/step") == 400
    (tmp_path / "run" / "latest").write_text("step_00000300\n")  # dangling pointer
    with pytest.raises(StoreError) as e:
        root.latest()
    assert e.value.code == "UCL413"


def test_participant_files_adopted_by_owner(tmp_path):
    owner = CheckpointWriter(tmp_path / "ck", 3, mesh=[("dp", 3)])
    part = CheckpointWriter.join(owner.tmp_path, 3)  # stands for another process
    part.write(1, "param/w", torch.arange(6, dtype=torch.bfloat16))
    part.create(2, "exp_avg/@flat0", (2, 2), "float32")
    part.write_flat(2, "exp_avg/@flat0", 0, np.ones(4, np.float32))
    entries = json.loads(json.dumps(part.finish()))  # travels as JSON between processes
    owner.write(0, "param/w", torch.zeros(6, dtype=torch.bfloat16))
    with pytest.raises(StoreError) as e:
        owner.write(1, "param/other", np.zeros(1))  # rank 1 belongs to the participant
    assert e.value.code == "UCL411"
    for rank, ent in entries.items():
        owner.adopt(int(rank), ent)
    owner.commit()
    with Checkpoint.open(tmp_path / "ck", max_open_files=1) as ck:
        assert ck.verify() == [] and ck.to_torch(1, "param/w").tolist() == list(range(6))
        assert ck.read(2, "exp_avg/@flat0").sum() == 4 and ck.keys(0) == ["param/w"]


def test_preallocated_bit_dtypes_accept_tensors_and_raw_bits(tmp_path):
    t = _tensor("bfloat16", (3, 4), seed=2)
    mask = _tensor("bool", (5,), seed=3)
    with CheckpointWriter(tmp_path / "ck", 1) as w:
        w.create(0, "param/bf", (3, 4), "bfloat16")
        w.write_flat(0, "param/bf", 0, t[:1])                        # tensor piece
        w.write_flat(0, "param/bf", 4, to_numpy(t[1:])[0])           # raw uint16 bits
        w.create(0, "buffer/mask", (5,), "bool")
        w.write_box(0, "buffer/mask", (0,), mask)
        w.commit()
    ck = Checkpoint.open(tmp_path / "ck")
    assert torch.equal(_bits(ck.to_torch(0, "param/bf")), _bits(t)) and torch.equal(ck.to_torch(0, "buffer/mask"), mask)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_tensor_is_copied_to_host(tmp_path):
    t = torch.randn(4, 5, device="cuda").to(torch.bfloat16)[:, 1:]
    arr, logical = to_numpy(t)
    assert logical == "bfloat16" and torch.equal(_bits(to_torch(arr, logical)), _bits(t.cpu()))


def test_streaming_checksum_in_small_chunks(tmp_path, monkeypatch):
    monkeypatch.setattr(store_h5, "CHECKSUM_STREAM_BYTES", 12)  # 3 float32 per chunk, not a row multiple
    a = np.arange(35, dtype=np.float32).reshape(5, 7)
    with CheckpointWriter(tmp_path / "ck", 1) as w:
        w.create(0, "fp32/w", a.shape, "float32")
        w.write_box(0, "fp32/w", (2, 0), a[2:])
        w.write_box(0, "fp32/w", (0, 0), a[:2])  # out of order: checksum re-read in chunks
        w.commit()
    ck = Checkpoint.open(tmp_path / "ck")
    assert ck.verify() == [] and np.array_equal(ck.read(0, "fp32/w"), a)


@pytest.fixture(scope="module")
def flat_ckpt(tmp_path_factory):
    """One 4 MiB flat dataset (256 checksum chunks of 4096 elements), with and without offsets."""
    data = np.arange(1 << 20, dtype=np.float32)
    path = tmp_path_factory.mktemp("flat") / "c"
    with CheckpointWriter(path, 1) as w:
        w.write(0, "exp_avg/@flat0", data)
        w.commit()
    return path, data


@settings(max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(a=st.integers(0, (1 << 20) - 1), n=st.integers(1, 40_000), hdf5=st.booleans(),
       bad=st.sampled_from([None, "head", "inside", "tail"]))
def test_verified_flat_range_reads_its_chunks_once_and_checks_each(flat_ckpt, tmp_path_factory, a, n, hdf5, bad):
    """A flat range (a tensor in a flat buffer) read with verify=True: the bytes equal numpy's, it
    reads exactly the chunks it touches (those inside straight into place, the edges rounded out),
    and a flipped byte in the first, a middle or the last chunk it touches is refused."""
    import shutil

    import h5py
    path, data = flat_ckpt
    per = 4096
    b = min(a + n, data.size)
    first, last = a // per, (b - 1) // per
    if bad is not None:
        at = {"head": a, "tail": b - 1, "inside": (a + b) // 2}[bad]
        copy = tmp_path_factory.mktemp("bad") / "c"
        shutil.copytree(path, copy)
        f = copy / "rank_00000.h5"
        with h5py.File(f, "r") as h:
            offset = h["exp_avg"]["@flat0"].id.get_offset()
        with open(f, "r+b") as fh:
            fh.seek(offset + 4 * at)
            byte = fh.read(1)
            fh.seek(offset + 4 * at)
            fh.write(bytes([byte[0] ^ 0x10]))
        path = copy
    if hdf5:
        copy = tmp_path_factory.mktemp("h5") / "c"
        shutil.copytree(path, copy)
        without_offsets(copy)
        path = copy
    with Checkpoint.open(path) as c:
        if bad is not None:
            with pytest.raises(StoreError) as e:
                c.read_runs(0, "exp_avg/@flat0", [(a, 1, b - a, b - a)], verify=True)
            assert e.value.code == "UCL407"
            return
        got = c.read_runs(0, "exp_avg/@flat0", [(a, 1, b - a, b - a)], verify=True)
        assert np.array_equal(got, data[a:b])
        assert c.bytes_last_read == 4 * (min((last + 1) * per, data.size) - first * per)
        # the same range as adjacent runs of whole rows
        half = a + (b - a) // 2
        runs = [(a, 1, half - a, half - a), (half, 1, b - half, b - half)] if half > a else [(a, 1, b - a, b - a)]
        assert np.array_equal(c.read_runs(0, "exp_avg/@flat0", runs, verify=True), data[a:b])


def test_partial_read_is_verified_by_chunk_checksums(tmp_path):
    """A hyperslab read with verify=True reads only the checksum chunks around it and catches a
    flipped byte anywhere in them; an unverified read of other chunks is unaffected."""
    data = np.arange(1 << 20, dtype=np.float32)  # 4 MiB: 256 chunks of 16 KiB
    path = tmp_path / "c"
    with CheckpointWriter(path, 1) as w:
        w.write(0, "exp_avg/@flat0", data)
        w.commit()
    with Checkpoint.open(path) as c:
        got = c.read_runs(0, "exp_avg/@flat0", [(1000, 3, 5000, 7)], verify=True)
        want = np.concatenate([data[1000 + i * 5000:1000 + i * 5000 + 7] for i in range(3)])
        assert np.array_equal(got, want)
        assert c.bytes_last_read == 3 * (16 << 10)  # the three chunks touched, not 4 MiB
    f = path / "rank_00000.h5"
    import h5py
    with h5py.File(f, "r") as h:
        offset = h["exp_avg"]["@flat0"].id.get_offset()
    raw = bytearray(f.read_bytes())
    raw[offset + 4 * 200_000] ^= 0x40  # element 200000: chunk 195
    f.write_bytes(bytes(raw))
    with Checkpoint.open(path) as c:
        assert np.array_equal(c.read_runs(0, "exp_avg/@flat0", [(0, 1, 1, 100)], verify=True), data[:100])
        with pytest.raises(StoreError) as e:
            c.read_runs(0, "exp_avg/@flat0", [(199_990, 1, 1, 20)], verify=True)
        assert e.value.code == "UCL407" and "exp_avg/@flat0" in str(e.value)
        assert c.verify()
