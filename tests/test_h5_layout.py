"""The writer's HDF5 lay-out through HDF5's own calls (ucl.store.h5: property lists, types and the
scalar space made once per process, groups looked up once per file): the attributes are stored
exactly as h5py's ``d.attrs[name] = value`` stores them, in every file, and the data reads back."""
from __future__ import annotations

import h5py
import numpy as np

from ucl.store import CheckpointWriter, Checkpoint


def _attr_kind(d, name):
    aid = d.attrs.get_id(name)
    t = aid.get_type()
    return type(t).__name__, t.get_class(), t.is_variable_str(), t.get_cset(), aid.get_space().get_simple_extent_type()


def test_attributes_are_stored_as_h5py_stores_them(tmp_path):
    rng = np.random.default_rng(0)
    data = {"param/a": rng.standard_normal((64, 300)).astype(np.float32),
            "param/b": rng.standard_normal((3,)).astype(np.float32),
            "exp_avg/a": rng.standard_normal((64, 300)).astype(np.float32)}
    with CheckpointWriter(tmp_path / "ck", 2, write_behind=True, mesh=[["dp", 2]]) as w:
        for r in range(2):
            for k, v in data.items():
                w.write(r, k, v)
            w.write_stream({r: None}, "exp_avg/s", (600,), "float32",
                           [np.arange(300, dtype=np.float32), np.arange(300, 600, dtype=np.float32)])
        w.commit()
    with h5py.File(tmp_path / "ref.h5", "w") as f:
        f.create_dataset("x", data=np.zeros(3, np.float32)).attrs["ucl_dtype"] = "float32"
        ref = _attr_kind(f["x"], "ucl_dtype")
    ck = Checkpoint.open(tmp_path / "ck")
    for r in range(2):
        with h5py.File(tmp_path / "ck" / f"rank_{r:05d}.h5", "r") as f:
            for k in [*data, "exp_avg/s"]:
                assert f[k].attrs["ucl_dtype"] == "float32" and _attr_kind(f[k], "ucl_dtype") == ref, k
        for k, v in data.items():
            assert np.array_equal(ck.read(r, k), v)
        assert np.array_equal(ck.read(r, "exp_avg/s"), np.arange(600, dtype=np.float32))
