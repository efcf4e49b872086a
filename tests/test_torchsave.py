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
from tests.passes import examples

torch = pytest.importorskip("torch")

_DTYPES = {"float32": np.float32, "float64": np.float64, "float16": np.float16, "bfloat16": np.uint16,
           "int64": np.int64, "int32": np.int32, "int16": np.int16, "int8": np.int8, "uint8": np.uint8,
           "bool": np.bool_, "float8_e4m3fn": np.uint8, "float8_e5m2": np.uint8}
plain = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False)
                     | st.text(max_size=8),
                     lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=5), kids, max_size=3)
                     | st.tuples(kids, kids), max_leaves=12)


@settings(max_examples=examples(40), deadline=None)
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


@pytest.mark.filterwarnings("ignore:TypedStorage is deprecated")
def test_storage_classes_and_floats_come_from_the_one_dtype_table():
    """The .pt reader and writer share ``DType.torch_storage`` (torch's own class for each dtype), and
    ``FLOAT_DTYPES`` is torch's ``is_floating_point`` (fp8 included)."""
    torch = pytest.importorskip("torch")
    from ucl.dtypes import DTYPES, FLOAT_DTYPES, torch_dtype
    assert FLOAT_DTYPES == {n for n in DTYPES if torch_dtype(n).is_floating_point}
    for name, d in DTYPES.items():
        if d.torch_storage is None:  # torch has no typed storage class for fp8: it pickles an UntypedStorage
            assert not hasattr(torch, f"{name.capitalize()}Storage") and name.startswith("float8_"), name
        else:
            assert getattr(torch, d.torch_storage).dtype == torch_dtype(name), name


def test_fp8_to_float32_is_torchs_float():
    """Every fp8 code (NaNs too) becomes the float32 bits torch's ``.float()`` gives."""
    torch = pytest.importorskip("torch")
    from ucl.dtypes import to_float32
    codes = np.arange(256, dtype=np.uint8)
    for name in ("float8_e4m3fn", "float8_e5m2"):
        want = torch.from_numpy(codes).view(getattr(torch, name)).float().view(torch.int32).numpy()
        assert np.array_equal(to_float32(codes, name).view(np.int32), want), name
