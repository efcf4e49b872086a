"""Warm, reusable host memory. On machines where freshly mapped pages are slow to touch (and freed
memory goes back to the OS), reusing one grown buffer beats allocating per dataset
(bench/reshard.py)."""
from __future__ import annotations

import numpy as np


# Arrays start on a page boundary: a target dataset assembled here is written to the disk straight
# from it (O_DIRECT needs aligned memory; numpy's own buffers start 16 bytes past one, and every
# write then went through a bounce copy, store.direct)
PAGE = 4096


class Arena:
    """One reusable byte buffer handing out arrays (starting on a page boundary); it grows by at
    least 1.5x when too small. An array it hands out is valid until the next call."""

    def __init__(self) -> None:
        self.buf = np.empty(0, dtype=np.uint8)

    def array(self, shape, dtype, zero: bool = False) -> np.ndarray:
        dtype = np.dtype(dtype)
        shape = tuple(int(x) for x in shape)
        n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if n > self.buf.size:
            raw = np.empty(max(n, int(self.buf.size * 1.5)) + PAGE, dtype=np.uint8)
            start = -raw.ctypes.data % PAGE
            self.buf = raw[start:start + raw.size - PAGE]
        out = self.buf[:n].view(dtype).reshape(shape)
        if zero:
            out.fill(0)
        return out


class ArenaRing:
    """``n`` arenas handing out arrays in turn: an array stays valid until ``n`` more were handed
    out (a writer may still be writing the last few while the next is filled)."""

    def __init__(self, n: int) -> None:
        self.arenas, self.turn = [Arena() for _ in range(n)], 0

    def array(self, shape, dtype, zero: bool = False) -> np.ndarray:
        arena = self.arenas[self.turn % len(self.arenas)]
        self.turn += 1
        return arena.array(shape, dtype, zero)
