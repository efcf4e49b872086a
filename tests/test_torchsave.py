"""ucl.formats.torchzip.write writes what torch.load reads (weights_only=True, mmap too) and what
ucl.formats.torchzip.read reads back: the oracle is torch's own loader."""
from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ucl.formats.torchzip.write import Size, Tensor, save
from ucl.formats.torchzip.read import TensorRef, read_torch_file

torch = pytest.importorskip("torch")

_DTYPES = {"float32": np.float32, "float64": np.float64, "float16": np.float16, "bfloat16": np.uint16,
           "int64": np.int64, "int32": np.int32, "uint8": np.uint8, "bool": np.bool_}
plain = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False)
                     | st.text(max_size=8),
                     lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=5), kids, max_size=3)
                     | st.tuples(kids, kids), max_leaves=12)


@settings(max_examples=40, deadline=None)
@given(value=plain, dtype=st.sampled_from(sorted(_DTYPES)),
       shape=st.lists(st.integers(0, 4), max_size=3), seed=st.integers(0, 2**32 - 1))
def test_torch_load_reads_what_it_writes(tmp_path_factory, value, dtype, shape, seed):
    raw = np.random.default_rng(seed).integers(0, 256, size=int(np.prod(shape)) * np.dtype(_DTYPES[dtype]).itemsize,
                                               dtype=np.uint8)
    arr = raw.view(_DTYPES[dtype]).reshape(shape) if dtype != "bool" else (raw % 2).astype(np.bool_).reshape(shape)
    obj = {"v": value, "t": Tensor(arr, dtype), "od": OrderedDict([("s", Size(shape))])}
    path = tmp_path_factory.mktemp("ts") / "x.pt"
    save(obj, path)
    for mmap in (False, True):
        back = torch.load(path, weights_only=True, mmap=mmap)
        assert back["v"] == value
        t = back["t"]
        assert t.dtype == getattr(torch, dtype) and list(t.shape) == list(shape)
        assert t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() == arr.tobytes()
        assert back["od"]["s"] == torch.Size(shape) and isinstance(back["od"], OrderedDict)
    ref = read_torch_file(str(path)).obj["t"]  # and ucl's own reader finds the bytes where they are
    assert isinstance(ref, TensorRef) and ref.shape == tuple(shape) and ref.dtype == dtype


def test_unknown_objects_are_refused(tmp_path):
    from ucl.errors import StoreError
    with pytest.raises(StoreError, match="cannot write a set"):
        save({"x": {1, 2}}, tmp_path / "x.pt")
    with pytest.raises(StoreError, match="cannot write a float32 array as a torch bfloat16"):
        Tensor(np.zeros(2, np.float32), "bfloat16")
