"""numpy values inside a pickle (RNG states, metrics) as inert records of validated, plain numbers,
for ``torchzip.read``'s allow-list: a real numpy dtype or array would let the pickle's BUILD
install any state on it (fields out of bounds, huge shapes) before ucl looks at it."""
from __future__ import annotations

import numpy as np

from .unpickle import brief, pickle_error



_NUMERIC = frozenset("biufc")
NDARRAY = ("numpy-ndarray",)


class NumpyDtype:
    """A numeric numpy dtype named by a pickle; its pickled state may only say the byte order."""

    def __init__(self, spec):
        if not isinstance(spec, str) or len(spec) > 8:
            raise pickle_error(f"a pickle asked for the numpy dtype {brief(spec)}")
        try:
            dtype = np.dtype(spec)
        except TypeError:
            raise pickle_error(f"a pickle asked for the numpy dtype {spec!r}") from None
        if not dtype.isbuiltin or dtype.kind not in _NUMERIC:
            raise pickle_error(f"a pickle asked for the numpy dtype {spec!r}; ucl reads plain numeric ones only")
        self.dtype = dtype

    def __setstate__(self, state):
        if not isinstance(state, tuple) or len(state) < 2 or state[1] not in ("<", "|", "=", ">"):
            raise pickle_error("a pickle holds a malformed numpy dtype state")
        if any(x is not None for x in state[2:5]) if len(state) >= 5 else False:
            raise pickle_error("a pickle gives a numpy dtype fields or a subarray; ucl reads plain numeric ones only")
        self.dtype = self.dtype.newbyteorder(state[1]) if state[1] == ">" else self.dtype


def np_dtype(spec, align=False, copy=False):
    return NumpyDtype(spec)


class NumpyArray:
    """A numpy array a pickle holds, validated: ``array`` is its data, its size bounded by the
    bytes the pickle really holds."""

    def __init__(self):
        self.array = None

    def __setstate__(self, state):
        try:
            _version, shape, dtype, fortran, raw = state
        except (TypeError, ValueError):
            raise pickle_error("a pickle holds a malformed numpy array state") from None
        if not isinstance(dtype, NumpyDtype) or not isinstance(raw, (bytes, bytearray)) or \
                not isinstance(shape, tuple) or len(shape) > 32 or \
                not all(type(n) is int and 0 <= n < 1 << 63 for n in shape):  # numpy's own limit: 32 dims
            raise pickle_error("a pickle holds a malformed numpy array")
        if int(np.prod(shape, dtype=object)) * dtype.dtype.itemsize != len(raw):
            raise pickle_error(f"a pickled numpy array of shape {brief(shape)} holds {len(raw)} bytes")
        flat = np.frombuffer(bytes(raw), dtype.dtype)
        self.array = flat.reshape(shape, order="F" if fortran else "C")


def np_reconstruct(cls, shape, dtype_code):
    # numpy pickles every array as _reconstruct(ndarray, (0,), b'b') followed by its state
    if cls is not NDARRAY or shape != (0,) or dtype_code not in (b"b", "b"):
        raise pickle_error("a pickle asked to build a numpy array other than the way numpy pickles one")
    return NumpyArray()


def np_scalar(dtype, data=None):
    if not isinstance(dtype, NumpyDtype) or not isinstance(data, bytes) or len(data) != dtype.dtype.itemsize:
        raise pickle_error("a pickle holds a malformed numpy scalar")
    return np.frombuffer(data, dtype.dtype)[0].item()
