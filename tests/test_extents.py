"""ExtentCheckpoint: reads of tensors stored at byte offsets (whole, or joined from pieces in
several files) equal numpy slicing of the same tensor, for any box, run list and split into pieces."""
from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ucl.errors import StoreError
from ucl.store.extents import Extent, ExtentCheckpoint, Piece
from ucl.store.manifest import Manifest
from tests.passes import examples


def _checkpoint(folder, tensor: np.ndarray, cuts: list[int], pad: int = 3) -> ExtentCheckpoint:
    """``tensor``'s bytes cut at ``cuts`` into pieces, each in its own file after ``pad`` junk bytes."""
    raw = tensor.tobytes()
    bounds = [0, *sorted(set(c for c in cuts if 0 < c < len(raw))), len(raw)]
    pieces = []
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        name = f"part{i}.bin"
        with open(os.path.join(folder, name), "wb") as f:
            f.write(b"\xff" * pad + raw[a:b] + b"\xee" * pad)
        pieces.append(Piece(name, pad, b - a))
    e = Extent.joined(pieces, "float32", tensor.shape) if len(pieces) > 1 else \
        Extent(pieces[0].file, pad, "float32", tensor.shape)
    m = Manifest(dims={}, mesh=[], files=["t"], datasets=[{"k/t": {"dtype": "float32", "shape": list(tensor.shape),
                                                                    "checksum": "none"}}])
    return ExtentCheckpoint(str(folder), m, [{"k/t": e}], "test")


@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(shape=st.lists(st.integers(1, 5), min_size=1, max_size=3), data=st.data())
def test_reads_equal_numpy(tmp_path_factory, shape, data):
    folder = tmp_path_factory.mktemp("ext")
    tensor = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)
    cuts = data.draw(st.lists(st.integers(0, tensor.nbytes), max_size=4))
    ck = _checkpoint(folder, tensor, cuts)
    assert np.array_equal(ck.read(0, "k/t"), tensor)
    starts = [data.draw(st.integers(0, n - 1)) for n in shape]
    sizes = [data.draw(st.integers(0, n - s)) for n, s in zip(shape, starts)]
    box = ck.read_box(0, "k/t", starts, sizes)
    assert np.array_equal(box, tensor[tuple(slice(s, s + z) for s, z in zip(starts, sizes))])
    n = tensor.size
    block = data.draw(st.integers(1, n))
    stride = data.draw(st.integers(block, n))
    count = data.draw(st.integers(1, max(1, (n - block) // stride + 1)))
    start = data.draw(st.integers(0, n - block - (count - 1) * stride))
    runs = ck.read_runs(0, "k/t", [(start, count, stride, block)])
    flat = tensor.reshape(-1)
    assert np.array_equal(runs, np.concatenate([flat[start + i * stride:start + i * stride + block] for i in range(count)]))


def test_an_extent_past_its_file_is_refused_on_opening(tmp_path):
    (tmp_path / "f").write_bytes(b"\0" * 16)
    m = Manifest(dims={}, mesh=[], files=["t"], datasets=[{"k/t": {"dtype": "float32", "shape": [8], "checksum": "none"}}])
    with pytest.raises(StoreError, match="run past the end") as e:
        ExtentCheckpoint(str(tmp_path), m, [{"k/t": Extent("f", 0, "float32", (8,))}], "test")
    assert e.value.code == "UCL406"
    with pytest.raises(StoreError, match="pieces hold") as e:
        ExtentCheckpoint(str(tmp_path), m, [{"k/t": Extent.joined([Piece("f", 0, 16)], "float32", (8,))}], "test")
    assert e.value.code == "UCL502"


def test_a_file_outside_the_folder_is_refused(tmp_path):
    inside = tmp_path / "ck"
    inside.mkdir()
    (tmp_path / "secret").write_bytes(b"\0" * 64)
    m = Manifest(dims={}, mesh=[], files=["t"], datasets=[{"k/t": {"dtype": "float32", "shape": [4], "checksum": "none"}}])
    with pytest.raises(StoreError) as e:
        ExtentCheckpoint(str(inside), m, [{"k/t": Extent("../secret", 0, "float32", (4,))}], "test")
    assert e.value.code == "UCL416"
