"""The byte-plane transform of the compressed encoding (docs/format.md, "Compressed datasets"):
floats rotated left by one bit, then plane ``p`` the byte ``itemsize - 1 - p`` of every element.
Two implementations of each direction: ``split_planes``/``rotate`` state the rule plainly (the
reference the tests hold the fast ones to); ``plane_into`` and ``join_into`` are the ones the codec
runs, written for the fewest numpy passes over a unit: a plane of a float is one shift of the
unrotated elements with a narrowing cast into its destination (the rotation only matters to the
lowest plane), and a float32 unit is joined through 16-bit halves rather than byte by byte.
Temporaries live in per-thread scratch buffers, reused unit after unit."""
from __future__ import annotations

import threading
from typing import Sequence

import numpy as np

FLOATS = frozenset({"bfloat16", "float16", "float32", "float64"})
_HALVES = 1 << 17  # bytes of a float32 unit from which joining it by halves beats byte-strided stores
_LOCAL = threading.local()  # per thread: scratch buffers are never shared between threads


def planes_of(dtype: str, itemsize: int) -> int:
    """Byte planes a unit of this logical dtype is split into (1: not split)."""
    return itemsize if itemsize > 1 and (dtype in FLOATS or dtype.startswith(("int", "uint"))) else 1


def scratch(name: str, nbytes: int) -> np.ndarray:
    """A uint8 buffer of ``nbytes`` kept by this thread under ``name`` (its contents are whatever
    the last user left: callers overwrite what they read): a temporary of a unit's size made
    afresh costs its page faults each time, more than the arithmetic on it."""
    made = getattr(_LOCAL, "scratch", None)
    if made is None:
        made = _LOCAL.scratch = {}
    buf = made.get(name)
    if buf is None or buf.size < nbytes:
        buf = made[name] = np.empty(max(nbytes, 1), np.uint8)
    return buf[:nbytes]


def _temp(name: str, n: int, dtype: type) -> np.ndarray:
    """``n`` elements of ``dtype`` in this thread's scratch ``name``."""
    return scratch(name, n * np.dtype(dtype).itemsize).view(dtype)


def rotate(u: np.ndarray, left: bool) -> np.ndarray:
    """Each unsigned element rotated by one bit: left puts the sign bit lowest, so the exponent
    (of a float) fills the top byte (bf16, fp32) or its top bits (fp16, fp64)."""
    bits = u.dtype.itemsize * 8
    one, back = u.dtype.type(1), u.dtype.type(bits - 1)
    return (u << one) | (u >> back) if left else (u >> one) | (u << back)


def split_planes(raw: np.ndarray, dtype: str, itemsize: int) -> list[np.ndarray]:
    """A unit's bytes (uint8, whole elements) as its byte planes, most significant first: the rule
    as stated (rotate, then gather each byte), each plane a new contiguous array."""
    if planes_of(dtype, itemsize) == 1:
        return [raw]
    elems = raw.view(f"<u{itemsize}")
    if dtype in FLOATS:
        elems = rotate(elems, True)
    by = np.ascontiguousarray(elems).view(np.uint8).reshape(-1, itemsize)
    return [np.ascontiguousarray(by[:, itemsize - 1 - p]) for p in range(itemsize)]


def plane_into(x: np.ndarray, dtype: str, p: int, dst: np.ndarray) -> None:
    """Plane ``p`` of the elements ``x`` (1-D unsigned of the dtype's width; uint8 when the dtype
    is one plane) into the uint8 ``dst`` of ``x.size``. Of the float rotated left by one, byte
    ``b`` >= 1 is bits ``8b-1 .. 8b+6`` of the element itself: one shift and a narrowing cast;
    only byte 0 (the low seven bits and the sign) takes two."""
    k = x.dtype.itemsize
    shift = 8 * (k - 1 - p)
    if k == 1:
        np.copyto(dst, x.view(np.uint8))
    elif dtype not in FLOATS:
        np.right_shift(x, shift, out=dst, casting="unsafe")
    elif shift:
        np.right_shift(x, shift - 1, out=dst, casting="unsafe")
    else:
        np.left_shift(x, 1, out=dst, casting="unsafe")
        sign = _temp("sign", x.size, np.uint8)
        np.right_shift(x, 8 * k - 1, out=sign, casting="unsafe")
        np.bitwise_or(dst, sign, out=dst)


def join_into(planes: Sequence[np.ndarray], dtype: str, out: np.ndarray) -> None:
    """Inverse of the split: the uint8 ``planes`` (each ``out.size // len(planes)`` bytes, most
    significant first) into the uint8 ``out``."""
    k = len(planes)
    if k == 1:
        out[...] = planes[0]
    elif dtype in FLOATS and k == 4 and out.size >= _HALVES:
        _join_float32(planes, out.view(np.uint32))
    elif dtype in FLOATS and k == 2:
        _join_half(planes, out.view(np.uint16))
    else:
        by = out.reshape(-1, k)
        for p in range(k):  # plane by plane: 10x faster than one transposing copy of the stacked planes
            by[:, k - 1 - p] = planes[p]
        if dtype in FLOATS:
            _rotate_back(out.view(f"<u{k}"))


def _join_half(planes: Sequence[np.ndarray], x: np.ndarray) -> None:
    """bf16/fp16: the rotated element is ``p0 << 8 | p1``, so the element is ``p0 << 7 | p1 >> 1``
    with ``p1``'s low bit (the sign) on top."""
    t = _temp("half", x.size, np.uint16)
    np.left_shift(planes[0], 7, out=x, dtype=np.uint16)
    np.left_shift(planes[1], 15, out=t, dtype=np.uint16)
    np.bitwise_or(x, t, out=x)
    np.right_shift(planes[1], 1, out=t, dtype=np.uint16)
    np.bitwise_or(x, t, out=x)


def _join_float32(planes: Sequence[np.ndarray], x: np.ndarray) -> None:
    """fp32 through 16-bit halves: the rotated element's halves ``hi = p0:p1`` and ``lo = p2:p3``
    rotated back are ``hi >> 1 | lo << 15`` and ``lo >> 1 | hi << 15`` (half-width passes, and
    no byte-strided stores)."""
    n = x.size
    hi, lo, a, t = (_temp(name, n, np.uint16) for name in ("hi", "lo", "a", "t"))
    np.left_shift(planes[0], 8, out=hi, dtype=np.uint16)
    np.bitwise_or(hi, planes[1], out=hi, dtype=np.uint16)
    np.left_shift(planes[2], 8, out=lo, dtype=np.uint16)
    np.bitwise_or(lo, planes[3], out=lo, dtype=np.uint16)
    np.right_shift(hi, 1, out=a)
    np.left_shift(lo, 15, out=t)
    np.bitwise_or(a, t, out=a)  # the element's high half
    np.left_shift(hi, 15, out=t)
    np.right_shift(lo, 1, out=lo)
    np.bitwise_or(lo, t, out=lo)  # its low half
    np.left_shift(a, 16, out=x, dtype=np.uint32)
    np.bitwise_or(x, lo, out=x, dtype=np.uint32)


def _rotate_back(u: np.ndarray) -> None:
    """Undo the float rotation in place (a temporary in this thread's scratch)."""
    low = _temp("low", u.size, u.dtype)
    np.right_shift(u, 1, out=low)
    np.left_shift(u, 8 * u.itemsize - 1, out=u)
    np.bitwise_or(u, low, out=u)
