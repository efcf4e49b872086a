"""Writing ``torch.save`` files without torch: the zip layout ``torch.load`` reads (``<a>/data.pkl``,
``<a>/byteorder``, one stored member ``<a>/data/<key>`` per tensor, ``<a>/version``) with a pickle
made of exactly the opcodes needed for plain data and tensors, every global one that
``torch.load(weights_only=True)`` accepts (``torch._utils._rebuild_tensor_v2``, torch's storage
classes, ``torch.Size``, ``collections.OrderedDict``). Twice torch.save's speed here (no torch
import, zlib's CRC-32) and one copy of each tensor in memory: the array itself, written in place.

The pickle is the inverse of ``ucl.formats.torchzip.read``: that module reads what this writes."""
from __future__ import annotations

import math
import os
import struct
import zipfile
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import numpy as np

from ...dtypes import DTYPES, storage_dtype
from ...errors import ForeignFormatError

_ARCHIVE = "archive"  # the folder inside the zip; torch.load takes whatever the first member names


@dataclass(frozen=True)
class Tensor:
    """A tensor to write: ``array`` in storage form (bf16 as uint16 bits) of logical ``dtype``."""
    array: np.ndarray
    dtype: str

    def __post_init__(self):
        if self.dtype not in DTYPES or self.array.dtype != storage_dtype(self.dtype):
            raise ForeignFormatError(f"cannot write a {self.array.dtype} array as a torch {self.dtype} tensor", code="UCL503")


@dataclass(frozen=True)
class PiecedTensor:
    """A tensor written from pieces, never whole in memory: ``pieces()`` gives its row-major storage
    (arrays of the storage dtype of logical ``dtype``) in order, once, as the file is written."""
    shape: tuple[int, ...]
    dtype: str
    pieces: Callable[[], Iterable[np.ndarray]]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * storage_dtype(self.dtype).itemsize


class Size(tuple):
    """A shape written as ``torch.Size``."""


def _global(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


class _Pickler:
    def __init__(self):
        self.out = bytearray(b"\x80\x02")  # protocol 2, as torch.save
        self.storages: list[np.ndarray | PiecedTensor] = []

    def dump(self, obj: Any) -> bytes:
        self._put(obj)
        self.out += b"."
        return bytes(self.out)

    def _put(self, o: Any) -> None:
        out = self.out
        if o is None:
            out += b"N"
        elif o is True or o is False:
            out += b"\x88" if o else b"\x89"
        elif isinstance(o, (int, np.integer)):
            o = int(o)
            if -2**31 <= o < 2**31:
                out += b"J" + struct.pack("<i", o)
            else:
                raw = o.to_bytes((o.bit_length() + 8) // 8, "little", signed=True)
                out += b"\x8a" + bytes([len(raw)]) + raw
        elif isinstance(o, (float, np.floating)):
            out += b"G" + struct.pack(">d", float(o))
        elif isinstance(o, str):
            raw = o.encode("utf-8")
            out += b"X" + struct.pack("<I", len(raw)) + raw
        elif isinstance(o, (Tensor, PiecedTensor)):
            self._tensor(o)
        elif isinstance(o, Size):
            out += _global("torch", "Size")
            self._put(tuple(int(x) for x in o))
            out += b"\x85R"  # TUPLE1 of the shape, REDUCE
        elif isinstance(o, tuple):
            out += b"("
            for v in o:
                self._put(v)
            out += b"t"
        elif isinstance(o, list):
            out += b"]"
            for v in o:
                self._put(v)
                out += b"a"
        elif isinstance(o, OrderedDict):
            out += _global("collections", "OrderedDict") + b")R"
            self._items(o)
        elif isinstance(o, dict):
            out += b"}"
            self._items(o)
        else:
            raise ForeignFormatError(f"cannot write a {type(o).__name__} into a torch.save file", code="UCL503")

    def _items(self, d: dict) -> None:
        for k, v in d.items():
            self._put(k)
            self._put(v)
            self.out += b"s"

    def _tensor(self, t: Tensor | PiecedTensor) -> None:
        key = str(len(self.storages))
        pieced = isinstance(t, PiecedTensor)
        self.storages.append(t if pieced else t.array)
        shape = tuple(int(x) for x in (t.shape if pieced else t.array.shape))
        nbytes, numel = (t.nbytes, math.prod(shape)) if pieced else (t.array.nbytes, t.array.size)
        strides, acc = [], 1
        for n in reversed(shape):
            strides.append(acc)
            acc *= n
        storage_class = DTYPES[t.dtype].torch_storage
        if storage_class is None:  # as torch.save writes fp8: bytes, and the dtype on the tensor
            self.out += _global("torch._utils", "_rebuild_tensor_v3") + b"("
            self.out += b"(" + _pack_str("storage") + _global("torch.storage", "UntypedStorage") + _pack_str(key) \
                + _pack_str("cpu")
            self._put(int(nbytes))
        else:
            self.out += _global("torch._utils", "_rebuild_tensor_v2") + b"("
            self.out += b"(" + _pack_str("storage") + _global("torch", storage_class) + _pack_str(key) \
                + _pack_str("cpu")
            self._put(int(numel))
        self.out += b"tQ"  # the persistent id (storage, class, key, location, numel)
        self._put(0)
        self._put(shape)
        self._put(tuple(reversed(strides)))
        self._put(False)
        self.out += _global("collections", "OrderedDict") + b")R"
        if storage_class is None:
            self.out += _global("torch", t.dtype)
        self.out += b"tR"


def _pack_str(s: str) -> bytes:
    raw = s.encode()
    return b"X" + struct.pack("<I", len(raw)) + raw


def save(obj: Any, path: str | os.PathLike, *, durable: bool = False) -> int:
    """Write ``obj`` (dicts, OrderedDicts, lists, tuples, strings, numbers, None, :class:`Size`,
    :class:`Tensor`, :class:`PiecedTensor`) to ``path`` as ``torch.load`` reads it; returns the file's size."""
    p = _Pickler()
    data = p.dump(obj)
    with open(path, "wb") as f:
        with zipfile.ZipFile(f, "w", zipfile.ZIP_STORED) as z:
            z.writestr(f"{_ARCHIVE}/data.pkl", data)
            z.writestr(f"{_ARCHIVE}/byteorder", "little")
            for key, arr in enumerate(p.storages):
                pieces = arr.pieces() if isinstance(arr, PiecedTensor) else (arr,)
                with z.open(f"{_ARCHIVE}/data/{key}", "w", force_zip64=arr.nbytes >= 1 << 31) as member:
                    done = 0
                    for piece in pieces:
                        piece = np.ascontiguousarray(piece)
                        member.write(memoryview(piece.reshape(-1)).cast("B"))
                        done += piece.nbytes
                if done != arr.nbytes:  # never a storage shorter or longer than its tensor says
                    raise ForeignFormatError(f"{path}: storage {key} got {done:,} bytes of {arr.nbytes:,}", code="UCL503")
            z.writestr(f"{_ARCHIVE}/version", "3\n")
        f.flush()
        if durable:
            os.fsync(f.fileno())
        return f.tell()
