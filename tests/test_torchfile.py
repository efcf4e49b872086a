"""ucl.formats.torchzip.read against hostile torch.save files: a pickle can build nothing but inert
records of validated numbers, never reads outside its bytes, never allocates what it does not hold,
and anything else is a UclError (UCL500) naming the problem."""
from __future__ import annotations

import io
import math
import pickle
import zipfile

import numpy as np
import pytest

from ucl.errors import StoreError
from ucl.formats.torchzip.read import read_torch_file
from ucl.formats.torchzip.plain import plain

try:
    from numpy._core.multiarray import _reconstruct, scalar
except ImportError:  # numpy < 2
    from numpy.core.multiarray import _reconstruct, scalar


def _pt(path, payload: bytes, storages: dict[str, bytes] | None = None, compress: bool = False) -> str:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED if compress else zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", payload)
        z.writestr("archive/byteorder", "little")
        for key, raw in (storages or {}).items():
            z.writestr(f"archive/data/{key}", raw)
    return str(path)


def _refused(path, match=None) -> str:
    with pytest.raises(StoreError, match=match) as e:
        read_torch_file(path)
    assert e.value.code == "UCL500"
    return str(e.value)


class _Reduce:
    def __init__(self, fn, args, state=None):
        self.r = (fn, args) if state is None else (fn, args, state)

    def __reduce__(self):
        return self.r


def test_numpy_values_are_read_as_plain_numbers(tmp_path):
    rng_state = {"bit_generator": "PCG64", "state": np.arange(4, dtype=np.uint64), "x": np.float32(1.5),
                 "inf": float("inf"), "nan": np.float64("nan")}
    got = plain(read_torch_file(_pt(tmp_path / "a.pt", pickle.dumps(rng_state, protocol=2))).obj)
    assert got == {"bit_generator": "PCG64", "state": [0, 1, 2, 3], "x": 1.5, "inf": None, "nan": None}


def test_a_numpy_dtype_with_out_of_bounds_fields_is_refused(tmp_path):
    """The BUILD of a void dtype could give it a field far outside its 8 bytes; reading it would
    read the process's memory (or crash it)."""
    dtype = _Reduce(np.dtype, ("V8", False, True), (3, "|", None, ("a",), {"a": (np.dtype("<i8"), 65536)}, 8, 1, 0))
    value = _Reduce(scalar, (dtype, b"\0" * 8))
    _refused(_pt(tmp_path / "a.pt", pickle.dumps({"x": value}, protocol=2)), "numpy dtype 'V8'")


@pytest.mark.parametrize("bomb", ["object array", "bytearray", "big array"])
def test_a_pickle_cannot_allocate_what_it_does_not_hold(tmp_path, bomb):
    if bomb == "object array":
        obj = _Reduce(_reconstruct, (np.ndarray, (10**8,), b"O"))
    elif bomb == "bytearray":
        obj = _Reduce(bytearray, (10**8,))
    else:  # an array state claiming 10^12 elements over 8 bytes
        obj = _Reduce(_reconstruct, (np.ndarray, (0,), b"b"), (1, (10**12,), np.dtype("<f8"), False, b"\0" * 8))
    _refused(_pt(tmp_path / "a.pt", pickle.dumps(obj, protocol=2)))


def test_build_cannot_rewrite_a_tensor_reference_after_its_checks(tmp_path):
    torch = pytest.importorskip("torch")
    buf = io.BytesIO()
    torch.save({"t": torch.zeros(4)}, buf)
    with zipfile.ZipFile(buf) as z:
        storage = z.read(next(n for n in z.namelist() if n.endswith("data/0")))
        data = z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
    # append a BUILD of {'shape': (10**9,)} on the tensor, just before the final SETITEM and STOP
    evil = data[:-2] + b"}X\x05\x00\x00\x00shape(J\x00\xca\x9a;tsb" + data[-2:]
    _refused(_pt(tmp_path / "a.pt", evil, {"0": storage}), "state of a tensor")


def test_compressed_members_are_refused_before_they_are_read(tmp_path):
    _refused(_pt(tmp_path / "a.pt", pickle.dumps({"a": 1}, protocol=2), compress=True), "compressed")


def test_plain_keeps_json_valid_and_shallow():
    deep: list = []
    node = deep
    for _ in range(10_000):
        node.append([])
        node = node[0]
    assert "nested too deep" in str(plain(deep))
    assert plain([math.inf, -math.inf, complex(1, 2)]) == [None, None, [1.0, 2.0]]


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2"])
def test_torchs_own_fp8_tensors_are_read_in_place(tmp_path, dtype):
    """torch.save pickles fp8 tensors as ``_rebuild_tensor_v3`` over an UntypedStorage (there is no
    ``Float8_*Storage`` class): ucl reads them, bytes where they are."""
    torch = pytest.importorskip("torch")
    t = torch.arange(256, dtype=torch.uint8).view(getattr(torch, dtype)).reshape(16, 16)[2:4]
    torch.save({"t": t}, tmp_path / "x.pt")
    f = read_torch_file(str(tmp_path / "x.pt"))
    ref = f.obj["t"]
    assert ref.dtype == dtype and ref.shape == (2, 16) and ref.contiguous
    with open(tmp_path / "x.pt", "rb") as fh:
        fh.seek(f.byte_offset(ref))
        assert fh.read(32) == t.view(torch.uint8).numpy().tobytes()


def test_an_untyped_storage_must_hold_whole_elements(tmp_path):
    torch = pytest.importorskip("torch")
    buf = io.BytesIO()
    torch.save({"t": torch.zeros(3, dtype=torch.float8_e4m3fn)}, buf)
    with zipfile.ZipFile(buf) as z:
        pkl = z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
    odd = pkl.replace(b"torch\nfloat8_e4m3fn\n", b"torch\nfloat16\n")  # 3 bytes as float16
    assert odd != pkl
    _refused(_pt(tmp_path / "odd.pt", odd, {"0": b"abc"}), match="whole float16")
