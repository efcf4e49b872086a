"""The byte-plane transform of the compressed encoding (docs/format.md, "Compressed datasets"):
floats rotated left by one bit (layout 0) or, in layout 1 (float32/bfloat16), their sign and
exponent offset then the whole rotated left by four, then plane ``p`` the byte ``itemsize - 1 - p``
of every element.
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
# layout 1: the floats with an 8-bit exponent, whose top plane then holds its low 5 bits and the top 3
# of the mantissa, and the lowest the sign and the exponent's top 3 beside 4 mantissa bits
OFFSET_FLOATS = frozenset({"bfloat16", "float32"})
LAYOUTS = (0, 1)
MAX_OFFSET = 255  # layout 1's offset is added to the 9 bits of sign and exponent
OFFSET_SAMPLES = 1024  # about this many of a unit's elements, evenly spaced, set a layout-1 offset
_TURN = (1, 4)  # bits each layout rotates a float left by
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


def has_layout(dtype: str, layout: int) -> bool:
    """Whether units of this logical dtype may be stored in ``layout``."""
    return layout == 0 or (layout == 1 and dtype in OFFSET_FLOATS)


def offset_unit(itemsize: int, offset: int) -> int:
    """What layout 1 adds to an element for ``offset``: the offset at the exponent's lowest bit."""
    return offset << (8 * itemsize - 9)


def rotate(u: np.ndarray, left: bool, by: int = 1) -> np.ndarray:
    """Each unsigned element rotated by ``by`` bits: left by one puts the sign bit lowest, so the
    exponent (of a float) fills the top byte (bf16, fp32) or its top bits (fp16, fp64)."""
    bits = u.dtype.itemsize * 8
    one, back = u.dtype.type(by), u.dtype.type(bits - by)
    return (u << one) | (u >> back) if left else (u >> one) | (u << back)


def split_planes(raw: np.ndarray, dtype: str, itemsize: int, layout: int = 0, offset: int = 0) -> list[np.ndarray]:
    """A unit's bytes (uint8, whole elements) as its byte planes, most significant first: the rule
    as stated (offset in layout 1, rotate, then gather each byte), each plane a new contiguous array."""
    if planes_of(dtype, itemsize) == 1:
        return [raw]
    elems = raw.view(f"<u{itemsize}")
    if layout:
        elems = elems + elems.dtype.type(offset_unit(itemsize, offset))  # modulo 2**bits
    if dtype in FLOATS:
        elems = rotate(elems, True, _TURN[layout])
    by = np.ascontiguousarray(elems).view(np.uint8).reshape(-1, itemsize)
    return [np.ascontiguousarray(by[:, itemsize - 1 - p]) for p in range(itemsize)]


def unit_offset(x: np.ndarray) -> int:
    """The layout-1 offset a writer takes from a unit of unsigned elements ``x`` (its dataset's
    first): it moves the median exponent of about OFFSET_SAMPLES of them, evenly spaced, to 16 of
    a window of 32, so most exponents share their top three bits. Once per dataset: per unit,
    on units of 64 KiB, it cost a quarter of the coding time and gained nothing measurable."""
    if not x.size:
        return 0
    e = x[::max(1, x.size // OFFSET_SAMPLES)] >> x.dtype.type(8 * x.dtype.itemsize - 9)
    e &= x.dtype.type(0xFF)  # the sign bit is not the exponent's
    return (16 - int(np.partition(e, e.size // 2)[e.size // 2])) % 32


def offset_elements(x: np.ndarray, offset: int) -> np.ndarray:
    """Layout 1's first step on the unsigned elements ``x``: ``offset`` added at the exponent's lowest
    bit, modulo 2**bits (in this thread's scratch; what plane_into then takes for layout 1)."""
    y = _temp("offset", x.size, x.dtype)
    np.add(x, x.dtype.type(offset_unit(x.dtype.itemsize, offset)), out=y)
    return y


def plane_into(x: np.ndarray, dtype: str, p: int, dst: np.ndarray, layout: int = 0) -> None:
    """Plane ``p`` of the elements ``x`` (1-D unsigned of the dtype's width; uint8 when the dtype
    is one plane; in layout 1, offset_elements' result) into the uint8 ``dst`` of ``x.size``. Of
    the float rotated left by ``r``, byte ``b`` >= 1 is bits ``8b-r .. 8b+7-r`` of the element
    itself: one shift and a narrowing cast; only byte 0 (the low bits and the top ``r``) takes two."""
    k = x.dtype.itemsize
    shift = 8 * (k - 1 - p)
    r = _TURN[layout]
    if k == 1:
        np.copyto(dst, x.view(np.uint8))
    elif dtype not in FLOATS:
        np.right_shift(x, shift, out=dst, casting="unsafe")
    elif shift:
        np.right_shift(x, shift - r, out=dst, casting="unsafe")
    else:
        np.left_shift(x, r, out=dst, casting="unsafe")
        top = _temp("sign", x.size, np.uint8)
        np.right_shift(x, 8 * k - r, out=top, casting="unsafe")
        np.bitwise_or(dst, top, out=dst)


def join_into(planes: Sequence[np.ndarray], dtype: str, out: np.ndarray, layout: int = 0, offset: int = 0) -> None:
    """Inverse of the split: the uint8 ``planes`` (each ``out.size // len(planes)`` bytes, most
    significant first) of ``layout`` (and its ``offset``) into the uint8 ``out``."""
    k = len(planes)
    r = _TURN[layout]
    if k == 1:
        out[...] = planes[0]
    elif dtype in FLOATS and k == 4 and out.size >= _HALVES:
        _join_float32(planes, out.view(np.uint32), r, offset_unit(4, offset) >> 16 if layout else 0)
    elif dtype in FLOATS and k == 2:
        _join_half(planes, out.view(np.uint16), r, offset_unit(2, offset) if layout else 0)
    else:
        by = out.reshape(-1, k)
        for p in range(k):  # plane by plane: 10x faster than one transposing copy of the stacked planes
            by[:, k - 1 - p] = planes[p]
        if dtype in FLOATS:
            _rotate_back(out.view(f"<u{k}"), r, offset_unit(k, offset) if layout else 0)


def _join_half(planes: Sequence[np.ndarray], x: np.ndarray, r: int, less: int) -> None:
    """bf16/fp16: the rotated element is ``p0 << 8 | p1``, so the element is ``p0 << 8-r | p1 >> r``
    with ``p1``'s low ``r`` bits on top; minus ``less`` (layout 1's offset), modulo 2**16."""
    t = _temp("half", x.size, np.uint16)
    np.left_shift(planes[0], 8 - r, out=x, dtype=np.uint16)
    np.left_shift(planes[1], 16 - r, out=t, dtype=np.uint16)
    np.bitwise_or(x, t, out=x)
    np.right_shift(planes[1], r, out=t, dtype=np.uint16)
    np.bitwise_or(x, t, out=x)
    if less:
        np.subtract(x, np.uint16(less), out=x)


def _join_float32(planes: Sequence[np.ndarray], x: np.ndarray, r: int, less: int) -> None:
    """fp32 through 16-bit halves: the rotated element's halves ``hi = p0:p1`` and ``lo = p2:p3``
    rotated back are ``hi >> r | lo << 16-r`` and ``lo >> r | hi << 16-r`` (half-width passes, and
    no byte-strided stores); layout 1's offset, ``less`` on the high half, only changes that half."""
    n = x.size
    hi, lo, a, t = (_temp(name, n, np.uint16) for name in ("hi", "lo", "a", "t"))
    np.left_shift(planes[0], 8, out=hi, dtype=np.uint16)
    np.bitwise_or(hi, planes[1], out=hi, dtype=np.uint16)
    np.left_shift(planes[2], 8, out=lo, dtype=np.uint16)
    np.bitwise_or(lo, planes[3], out=lo, dtype=np.uint16)
    np.right_shift(hi, r, out=a)
    np.left_shift(lo, 16 - r, out=t)
    np.bitwise_or(a, t, out=a)  # the element's high half
    if less:
        np.subtract(a, np.uint16(less), out=a)
    np.left_shift(hi, 16 - r, out=t)
    np.right_shift(lo, r, out=lo)
    np.bitwise_or(lo, t, out=lo)  # its low half
    np.left_shift(a, 16, out=x, dtype=np.uint32)
    np.bitwise_or(x, lo, out=x, dtype=np.uint32)


def _rotate_back(u: np.ndarray, r: int, less: int) -> None:
    """Undo the float rotation by ``r`` and the offset ``less`` in place (a temporary in this
    thread's scratch)."""
    low = _temp("low", u.size, u.dtype)
    np.right_shift(u, r, out=low)
    np.left_shift(u, 8 * u.itemsize - r, out=u)
    np.bitwise_or(u, low, out=u)
    if less:
        np.subtract(u, u.dtype.type(less), out=u)
