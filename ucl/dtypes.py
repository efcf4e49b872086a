"""Logical dtypes and their on-disk storage types.

numpy has no bfloat16 or float8, so those are stored as raw bits in an unsigned
integer of the same width and the *logical* dtype is recorded beside them. Every
conversion here is a bit-level view, never a numeric cast, so round trips are exact.
Storage is always little-endian.

torch is imported lazily: only when handed a tensor (then it is already imported)
or when asked to build one.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

from .errors import StoreError


@dataclass(frozen=True)
class DType:
    """One logical dtype and its names elsewhere: the little-endian numpy type it is stored as,
    its ``torch`` attribute name, its safetensors header name and the torch storage class a tensor
    of it is pickled with (``torch.save``; None: torch has no typed storage for it and pickles an
    ``UntypedStorage`` and the dtype); ``floating`` as torch's ``is_floating_point``."""

    name: str
    storage: np.dtype
    safetensors: str
    torch_storage: str | None
    floating: bool = False

    @property
    def itemsize(self) -> int:
        return self.storage.itemsize

    @property
    def torch_name(self) -> str:
        return self.name  # torch.float32, torch.bfloat16, torch.float8_e4m3fn ...


# The one table of dtypes ucl knows (logical name -> storage and foreign names).
DTYPES: dict[str, DType] = {d.name: d for d in (
    DType("float32", np.dtype("<f4"), "F32", "FloatStorage", True),
    DType("float64", np.dtype("<f8"), "F64", "DoubleStorage", True),
    DType("float16", np.dtype("<f2"), "F16", "HalfStorage", True),
    DType("bfloat16", np.dtype("<u2"), "BF16", "BFloat16Storage", True),
    DType("float8_e4m3fn", np.dtype("u1"), "F8_E4M3", None, True),
    DType("float8_e5m2", np.dtype("u1"), "F8_E5M2", None, True),
    DType("int8", np.dtype("i1"), "I8", "CharStorage"),
    DType("int16", np.dtype("<i2"), "I16", "ShortStorage"),
    DType("int32", np.dtype("<i4"), "I32", "IntStorage"),
    DType("int64", np.dtype("<i8"), "I64", "LongStorage"),
    DType("uint8", np.dtype("u1"), "U8", "ByteStorage"),
    DType("bool", np.dtype("?"), "BOOL", "BoolStorage"),
)}
LOGICAL_DTYPES: tuple[str, ...] = tuple(DTYPES)
# the floating dtypes (fp8 included, as torch's is_floating_point): what casts and ``.float()`` apply to
FLOAT_DTYPES = frozenset(d.name for d in DTYPES.values() if d.floating)

# logical dtypes whose storage type differs from their meaning (raw bits)
BIT_DTYPES = frozenset({"bfloat16", "float8_e4m3fn", "float8_e5m2"})

# numpy (incl. ml_dtypes) names that map 1:1 to a logical dtype
_NUMPY_NAMES = {
    "float32": "float32", "float64": "float64", "float16": "float16",
    "int8": "int8", "int16": "int16", "int32": "int32", "int64": "int64",
    "uint8": "uint8", "bool": "bool",
    # ml_dtypes registers these names; their bytes are the same bits we store
    "bfloat16": "bfloat16", "float8_e4m3fn": "float8_e4m3fn", "float8_e5m2": "float8_e5m2",
}


def _unsupported(what: str, hint: str = "") -> StoreError:
    msg = f"unsupported dtype {what}; supported: {', '.join(LOGICAL_DTYPES)}"
    return StoreError(msg + (f" ({hint})" if hint else ""), code="UCL412")


def check_logical(logical: str) -> str:
    """Return ``logical`` if it names a supported logical dtype, else raise UCL412."""
    if logical not in DTYPES:
        raise _unsupported(repr(logical))
    return logical


def storage_dtype(logical: str) -> np.dtype:
    """The numpy dtype a logical dtype is stored as (little-endian)."""
    return DTYPES[check_logical(logical)].storage


def itemsize(logical: str) -> int:
    """Bytes per element of a logical dtype."""
    return storage_dtype(logical).itemsize


def logical_of_numpy_dtype(dt: Any) -> str:
    """Logical dtype of a numpy dtype. uint16 is refused: it is ambiguous with bf16 bits."""
    dt = np.dtype(dt)
    name = _NUMPY_NAMES.get(dt.name)
    if name is None:
        hint = "pass dtype='bfloat16' if these are bfloat16 bits" if dt.name == "uint16" else ""
        raise _unsupported(f"numpy {dt}", hint)
    return name


def logical_of_torch_dtype(dt: Any) -> str:
    """Logical dtype of a ``torch.dtype`` (e.g. ``torch.bfloat16`` -> ``"bfloat16"``)."""
    name = str(dt).rsplit(".", 1)[-1]
    if name not in DTYPES:
        raise _unsupported(f"torch {dt}")
    return name


def of_safetensors(name: str) -> str:
    """Logical dtype of a safetensors header dtype name (``BF16`` -> ``bfloat16``)."""
    for d in DTYPES.values():
        if d.safetensors == name:
            return d.name
    raise _unsupported(f"safetensors {name}")


def torch_dtype(logical: str) -> Any:
    """The ``torch.dtype`` of a logical dtype (imports torch)."""
    import torch

    return getattr(torch, check_logical(logical))


def to_float32(array: np.ndarray, logical: str) -> np.ndarray:
    """A storage array of a floating logical dtype as float32, as torch's ``.float()`` gives it
    (exact for bf16, fp16 and fp8, NaNs as torch makes them; round to nearest even from float64);
    other dtypes are refused."""
    if logical == "float32":
        return array
    if logical == "bfloat16":  # a bf16 value is the top half of the float32 with the same value
        return (array.astype(np.uint32) << 16).view(np.float32)
    if logical in ("float16", "float64"):
        return array.astype(np.float32)
    if logical in ("float8_e4m3fn", "float8_e5m2"):
        return _fp8_to_float32(logical)[array].view(np.float32)
    raise _unsupported(f"converting {logical} to float32")


@lru_cache(maxsize=None)
def _fp8_to_float32(logical: str) -> np.ndarray:
    """float32 bits of each of the 256 fp8 codes (exact: every fp8 value is a float32 value)."""
    code = np.arange(256, dtype=np.uint32)
    sign = (code >> 7) << 31
    if logical == "float8_e5m2":  # the top byte of a float16; torch quiets signalling NaNs
        half = (code << 8).astype(np.uint16).view(np.float16)
        with np.errstate(invalid="ignore"):
            bits = half.astype(np.float32).view(np.uint32)
        return np.where(np.isnan(half), bits | 0x00400000, bits).astype(np.uint32)
    exp, man = (code >> 3) & 15, code & 7  # e4m3fn: bias 7, no infinities, S.1111.111 is NaN
    value = np.where(exp == 0, man / 8 * 2.0 ** -6, (1 + man / 8) * 2.0 ** (exp.astype(np.int64) - 7))
    bits = value.astype(np.float32).view(np.uint32) | sign
    return np.where((exp == 15) & (man == 7), sign | 0x7FF00000, bits).astype(np.uint32)


def contiguous(arr: np.ndarray) -> np.ndarray:
    """C-contiguous version of ``arr`` that keeps 0-d arrays 0-d (np.ascontiguousarray does not)."""
    return arr if arr.flags.c_contiguous else arr.copy(order="C")


def _is_tensor(obj: Any) -> bool:
    torch = sys.modules.get("torch")  # a tensor can only exist if torch is imported
    return torch is not None and isinstance(obj, torch.Tensor)


def to_numpy(obj: Any, dtype: str | None = None) -> tuple[np.ndarray, str]:
    """Convert a tensor or array to ``(C-contiguous little-endian storage array, logical dtype)``.

    Tensors are detached and copied to CPU; bf16/fp8 come back as their raw bits.
    ``dtype`` declares the logical dtype of a numpy array that already holds storage
    bits (e.g. uint16 holding bfloat16); the array must then have that storage dtype.
    The result may share memory with the input.
    """
    if _is_tensor(obj):
        t = obj.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        logical = logical_of_torch_dtype(t.dtype)
        if dtype is not None and dtype != logical:
            raise StoreError(f"tensor has dtype {logical}, but dtype={dtype!r} was given", code="UCL409")
        t = t.contiguous()
        if logical == "bfloat16":
            import torch

            arr = t.view(torch.int16).numpy().view("<u2")
        elif logical in BIT_DTYPES:
            import torch

            arr = t.view(torch.uint8).numpy()
        else:
            arr = t.numpy()
        return contiguous(arr), logical

    arr = np.asarray(obj)
    if dtype is not None:
        want = storage_dtype(dtype)
        if arr.dtype.name in BIT_DTYPES and arr.dtype.name == dtype:
            arr = arr.view(want)  # ml_dtypes array of the declared type
        if arr.dtype.newbyteorder("<") != want.newbyteorder("<") or arr.dtype.kind != want.kind:
            raise StoreError(
                f"array of dtype {arr.dtype} cannot hold {dtype} data (expected storage dtype {want})",
                code="UCL409",
            )
        logical = dtype
    else:
        logical = logical_of_numpy_dtype(arr.dtype)
        if logical in BIT_DTYPES:
            arr = arr.view(storage_dtype(logical))
    want = storage_dtype(logical)
    if arr.dtype != want:  # only byte order can differ here
        arr = arr.astype(want)
    return contiguous(arr), logical


def storage_view(obj: Any, logical: str) -> np.ndarray | None:
    """A writable C-contiguous storage-typed numpy view sharing memory with ``obj`` (a CPU tensor
    or an array of ``logical`` dtype), so writing it fills ``obj`` in place; None when there is no
    such view (a GPU or non-contiguous tensor, another dtype)."""
    if _is_tensor(obj):
        t = obj.detach()
        if t.device.type != "cpu" or not t.is_contiguous() or logical_of_torch_dtype(t.dtype) != logical:
            return None
        arr = to_numpy(t)[0]
    else:
        arr = obj
    if not isinstance(arr, np.ndarray) or arr.dtype != storage_dtype(logical) or not arr.flags.c_contiguous \
            or not arr.flags.writeable:
        return None
    return arr


def to_torch(array: np.ndarray, logical: str) -> Any:
    """Build a CPU tensor of ``logical`` dtype from a storage array (bit-exact, owns a copy if needed)."""
    import torch

    want = storage_dtype(logical)
    arr = np.asarray(array)
    if arr.dtype.newbyteorder("<") != want.newbyteorder("<") or arr.dtype.kind != want.kind:
        raise StoreError(f"array of dtype {arr.dtype} is not {logical} storage ({want})", code="UCL409")
    arr = contiguous(arr.astype(want, copy=False))
    if not arr.flags.writeable:
        arr = arr.copy()  # torch.from_numpy wants writable memory
    if logical == "bfloat16":
        return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
    if logical in BIT_DTYPES:
        return torch.from_numpy(arr).view(getattr(torch, logical))
    return torch.from_numpy(arr)
