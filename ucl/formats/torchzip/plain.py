"""Pickled values (what :func:`~ucl.formats.torchzip.read.read_torch_file` returns) as plain,
JSON-friendly data for a manifest's state, in bounded work whatever the pickle's sharing: tensors
become short descriptions (small ones keep their bytes, given back bit for bit by
:func:`kept_tensor`), records their state, numpy values lists."""
from __future__ import annotations

import base64
import math
from typing import Any

import numpy as np

from ...dtypes import itemsize, storage_dtype
from .numpy_values import NumpyArray, NumpyDtype
from .read import Record, TensorRef, TorchFile
from .unpickle import brief, pickle_error


MAX_PLAIN_DEPTH = 64  # nesting a manifest's state keeps; deeper is summarised, never recursed into
MAX_PLAIN_NODES = 1 << 22  # values one plain() call may write out, shared references counted each time


MAX_KEPT_TENSOR_BYTES = 64 << 10  # small tensors (RNG states, counters) a manifest's state keeps bit for bit
_PLAIN_KEYS = (str, int, float, bool, type(None))


def plain(obj: Any, depth: int = 0, values: TorchFile | None = None, where: str | None = None) -> Any:
    """``obj`` as JSON-friendly data for a manifest's state: tensors become a short description,
    records their state, numpy values lists, non-finite floats None (JSON has none). With ``values``
    (the file ``obj`` was read from), a contiguous tensor of at most ``MAX_KEPT_TENSOR_BYTES`` keeps
    its bytes too (base64): :func:`kept_tensor` gives it back bit for bit. Each shared value is
    converted once (its result shared); a value containing itself, or one writing out more than
    ``MAX_PLAIN_NODES`` values, is an error naming ``where`` (default: ``values``' file)."""
    return _Plain(values, where or (values.path if values is not None else "a pickled value")).value(obj, depth)


class _Plain:
    """One :func:`plain` call: its memo of converted values and its count of values written."""

    def __init__(self, values: "TorchFile | None", where: str):
        self.values, self.where, self.nodes = values, where, 0
        self.done: dict[int, tuple[Any, int]] = {}  # id -> (result, values it writes out)
        self.open: set[int] = set()
        self.kept: list[Any] = []  # values made on the way (numpy's tolist) stay alive: ids not reused

    def count(self, n: int) -> None:
        self.nodes += n
        if self.nodes > MAX_PLAIN_NODES:
            raise pickle_error(f"{self.where}: a value writes out more than {MAX_PLAIN_NODES:,} values (shared "
                         "references expanded); docs/security.md")

    def value(self, obj: Any, depth: int) -> Any:
        if depth > MAX_PLAIN_DEPTH:
            self.count(1)
            return "(nested too deep)"
        if not isinstance(obj, (TensorRef, Record, NumpyArray, dict, list, tuple, set, frozenset)):
            self.count(1)
            return self.leaf(obj, depth)
        key = id(obj)
        hit = self.done.get(key)
        if hit is not None:
            self.count(hit[1])
            return hit[0]
        if key in self.open:
            raise pickle_error(f"{self.where}: a value contains itself (a reference cycle); checkpoint state never does")
        self.open.add(key)
        self.kept.append(obj)
        before = self.nodes
        self.count(1)
        out = self.container(obj, depth)
        self.open.discard(key)
        self.done[key] = (out, self.nodes - before)
        return out

    def container(self, obj: Any, depth: int) -> Any:
        if isinstance(obj, TensorRef):
            return self.tensor(obj)
        if isinstance(obj, Record):
            return {"class": obj.cls, "state": self.value(obj.state, depth + 1)} if obj.state is not None \
                else {"class": obj.cls}
        if isinstance(obj, dict):
            return {(str(k) if type(k) in _PLAIN_KEYS else brief(k)): self.value(v, depth + 1)
                    for k, v in obj.items()}
        if isinstance(obj, NumpyArray):
            a = obj.array
            if a is None or a.size > 4096:
                return {"array": [] if a is None else list(a.shape), "dtype": "" if a is None else str(a.dtype)}
            return self.value(a.tolist(), depth + 1)
        return [self.value(v, depth + 1) for v in obj]

    def tensor(self, obj: TensorRef) -> dict:
        out: dict[str, Any] = {"tensor": list(obj.shape), "dtype": obj.dtype}
        n = obj.numel * itemsize(obj.dtype)
        values = self.values
        if values is not None and obj.contiguous and n <= MAX_KEPT_TENSOR_BYTES:
            with open(values.path, "rb") as f:
                f.seek(values.byte_offset(obj))
                data = f.read(n)
            if len(data) != n:
                raise pickle_error(f"{values.path}: a tensor of {n} bytes runs past the end of the file")
            out["base64"] = base64.b64encode(data).decode("ascii")
        return out

    def leaf(self, obj: Any, depth: int) -> Any:
        if isinstance(obj, NumpyDtype):
            return str(obj.dtype)
        if isinstance(obj, np.generic):
            return self.leaf(obj.item(), depth + 1)
        if isinstance(obj, (bytes, bytearray)):
            return {"bytes": len(obj)}
        if isinstance(obj, float) and not math.isfinite(obj):
            return None
        if isinstance(obj, complex):
            return [self.leaf(obj.real, depth), self.leaf(obj.imag, depth)]
        if obj is None or isinstance(obj, (bool, int, float, str)):
            return obj
        return brief(obj)


def kept_tensor(value: Any) -> "tuple[np.ndarray, str] | None":
    """The (storage-form array, logical dtype) of a tensor :func:`plain` kept with its bytes, or None
    for anything else (a description without bytes included)."""
    if not (isinstance(value, dict) and set(value) == {"tensor", "dtype", "base64"}):
        return None
    shape, dtype = tuple(int(x) for x in value["tensor"]), str(value["dtype"])
    data = base64.b64decode(value["base64"], validate=True)
    dt = storage_dtype(dtype)
    if len(data) != math.prod(shape) * dt.itemsize:
        raise pickle_error(f"a kept tensor of shape {list(shape)} {dtype} holds {len(data)} bytes")
    return np.frombuffer(data, dt).reshape(shape).copy(), dtype
