"""Rank files replayed from a template (store.template, the training checkpointer's path): h5py reads
back the bytes given, ucl reads and verifies them, the checksums are those ``write`` computes, and
corruption of data or digest tables is caught. Oracles: h5py on the committed file, and a second
checkpoint of the same arrays written dataset by dataset through HDF5."""
from __future__ import annotations

import json
import os
import shutil

import h5py
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ucl.dtypes import storage_dtype
from ucl.errors import StoreError
from ucl.store import Checkpoint, CheckpointWriter
from ucl.store.direct import MIN_DIRECT_BYTES

SHAPES = [(), (0,), (3, 0), (5,), (4000,), (300, 70), (64, 4096), (MIN_DIRECT_BYTES // 4 + 3,), (2, 3, 700)]
DTYPES = ["float32", "bfloat16", "int64", "uint8"]


def arrays_for(draw_shapes, seed) -> dict[str, tuple[np.ndarray, str]]:
    rng = np.random.default_rng(seed)
    out = {}
    for i, (shape, dtype) in enumerate(draw_shapes):
        store = storage_dtype(dtype)
        a = rng.integers(0, 2**8 if store.itemsize == 1 else 2**15, shape).astype(store)
        out[f"{['param', 'exp_avg', 'step'][i % 3]}/t{i}"] = (a, dtype)
    return out


def write_plain(path, arrays) -> None:
    with CheckpointWriter(path, 1) as w:
        for k, (a, dt) in arrays.items():
            w.write(0, k, a, dtype=dt)
        w.commit()


def entries(path) -> dict:
    return json.loads((path / "manifest.json").read_text())["datasets"][0]


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(specs=st.lists(st.tuples(st.sampled_from(SHAPES), st.sampled_from(DTYPES)), min_size=1, max_size=6),
       durable=st.booleans(), seed=st.integers(0, 2**16))
def test_a_template_replays_files_equal_to_plain_writes(tmp_path_factory, specs, durable, seed):
    d = tmp_path_factory.mktemp("tpl")
    first, second = arrays_for(specs, seed), arrays_for(specs, seed + 1)
    datasets = {k: (a.shape, dt) for k, (a, dt) in first.items()}
    template = None
    for name, arrays in (("a", first), ("b", second)):  # one template, two checkpoints
        with CheckpointWriter(d / name, 1, durable=durable) as w:
            template = template or w.template(0, datasets)
            w.write_from(0, template, {k: a for k, (a, _) in arrays.items()})
            w.commit()
        write_plain(d / f"plain-{name}", arrays)
        with h5py.File(d / name / "rank_00000.h5", "r") as f:
            for k, (a, dt) in arrays.items():
                assert f[k].dtype == a.dtype and f[k].shape == a.shape and f[k][...].tobytes() == a.tobytes(), k
                assert f[k].attrs["ucl_dtype"] == dt
        got, want = entries(d / name), entries(d / f"plain-{name}")
        for k in want:  # the same checksums; offsets are the file's own
            assert {x: v for x, v in got[k].items() if x not in ("offset", "tables")} == \
                {x: v for x, v in want[k].items() if x not in ("offset", "tables")}, k
            assert ("tables" in got[k]) == ("tables" in want[k]), k
        with Checkpoint.open(d / name) as c:
            assert c.verify() == []
            for k, (a, _) in arrays.items():
                assert c.read(0, k, verify=True).tobytes() == a.tobytes()
                if a.ndim == 1 and a.size > 10:
                    lo, hi = a.size // 3, a.size // 3 + a.size // 4
                    assert c.read_runs(0, k, [(lo, 1, hi - lo, hi - lo)], verify=True).tobytes() == a[lo:hi].tobytes()
    assert not [n for n in os.listdir(d) if n.startswith(".")]  # no scratch file left


@pytest.fixture
def replayed(tmp_path):
    rng = np.random.default_rng(3)
    arrays = {"param/w": rng.standard_normal((256, 2048)).astype(np.float32),
              "exp_avg/b": rng.standard_normal(5000).astype(np.float32)}
    with CheckpointWriter(tmp_path / "ck", 1) as w:
        w.write_from(0, w.template(0, {k: (a.shape, "float32") for k, a in arrays.items()}), arrays)
        w.commit()
    return tmp_path / "ck", arrays


def flip(path, offset) -> None:
    with open(path, "r+b") as fh:
        fh.seek(offset)
        b = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([b[0] ^ 0x01]))


@pytest.mark.parametrize("where", ["data", "tables"])
def test_corruption_of_a_replayed_file_is_caught(replayed, tmp_path, where):
    path, arrays = replayed
    e = entries(path)["param/w"]
    flip(path / "rank_00000.h5", e["offset"] + 12345 if where == "data" else e["tables"] + 8 * 3)
    with Checkpoint.open(path) as c:
        assert c.verify()
        with pytest.raises(StoreError) as err:
            c.read_runs(0, "param/w", [(0, 1, 4096, 4096)], verify=True)  # the first chunks
        assert err.value.code == "UCL407"
        if where == "data":
            with pytest.raises(StoreError) as err:
                c.read(0, "param/w", verify=True)
            assert err.value.code == "UCL407"
        else:  # the bytes are sound: a whole read checks them against the manifest's own checksum
            assert np.array_equal(c.read(0, "param/w", verify=True), arrays["param/w"])
        assert np.array_equal(c.read(0, "exp_avg/b", verify=True), arrays["exp_avg/b"])


def test_replaying_other_arrays_is_refused(tmp_path):
    w = CheckpointWriter(tmp_path / "ck", 1)
    t = w.template(0, {"param/a": ((4, 4), "float32"), "param/b": ((3,), "bfloat16")})
    with pytest.raises(StoreError, match=r"missing \['param/b'\]") as e:
        w.write_from(0, t, {"param/a": np.zeros((4, 4), np.float32)})
    assert e.value.code == "UCL409"
    with pytest.raises(StoreError, match=r"'param/a'.*float32 \[4, 4\].*\[2, 8\]"):
        w.write_from(0, t, {"param/a": np.zeros((2, 8), np.float32), "param/b": np.zeros(3, np.uint16)})
    w.write_from(0, t, {"param/a": np.ones((4, 4), np.float32), "param/b": np.zeros(3, np.uint16)})
    w.commit()
    with Checkpoint.open(tmp_path / "ck") as c:
        assert c.verify() == [] and c.read(0, "param/a").sum() == 16
    shutil.rmtree(tmp_path / "ck")


def test_a_template_without_tiles_writes_flat_checksums_and_refuses_tiled_digests(tmp_path):
    """``tiles=False`` lays out and fills no tile table (the datasets read by flat chunks, as the
    format allows); digests computed with tiles do not fit it and are refused, not written short."""
    from ucl.store.digests import checksums
    a = np.arange(64 * 4096, dtype=np.float32).reshape(64, 4096)
    w = CheckpointWriter(tmp_path / "ck", 1)
    t = w.template(0, {"param/a": ((64, 4096), "float32")}, tiles=False)
    with pytest.raises(StoreError, match=r"'param/a'.* without tiles") as e:
        w.write_from(0, t, {"param/a": a}, {"param/a": checksums(a)})
    assert e.value.code == "UCL409"
    w.abort()
    w = CheckpointWriter(tmp_path / "ck", 1)
    w.write_from(0, w.template(0, {"param/a": ((64, 4096), "float32")}, tiles=False), {"param/a": a},
                 {"param/a": checksums(a, tiles=False)})
    w.commit()
    e = entries(tmp_path / "ck")["param/a"]
    assert "chunks" in e and "tiles" not in e
    write_plain(tmp_path / "plain", {"param/a": (a, "float32")})
    assert "tiles" in entries(tmp_path / "plain")["param/a"]  # the default writes them
    with Checkpoint.open(tmp_path / "ck") as c:
        assert c.verify() == [] and np.array_equal(c.read(0, "param/a"), a)
        assert e["checksum"] == entries(tmp_path / "plain")["param/a"]["checksum"]
