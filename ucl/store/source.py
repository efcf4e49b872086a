"""A ucl checkpoint as a plan :class:`~ucl.plan.execute.Source`: exact hyperslab reads (strided
ones for tensors inside flat buffers), each byte verified against its checksum where asked."""
from __future__ import annotations

import numpy as np

from ..layout.boxes import Slot, flat_runs, slot_box
from ..plan.buffers import Arena
from .like import CheckpointLike


class StoreSource:
    """Reads plan boxes from a checkpoint (a ucl one or a foreign folder read in place). A box that is a whole dataset is read whole (with
    ``verify``, its checksum checked); with ``verify``, a partial box is read together with the whole checksum
    chunks around it, or the tiles around it when that reads less (a column block of a 2-D dataset;
    docs/format.md), each verified, so corrupt bytes are never passed on. With an arena, results are
    views valid until the next read."""

    def __init__(self, ckpt: CheckpointLike, arena: Arena | None = None, verify: bool = True):
        self.ckpt = ckpt
        self.arena = arena
        self.verify = verify
        self.bytes_read = 0  # bytes taken from disk (verified reads round out to checksum chunks or tiles)

    def read(self, rank: int, slot: Slot, start, size) -> np.ndarray:
        nd = len(slot.shape)
        start, size = slot_box(slot, start, size)
        info = self.ckpt.info(rank, slot.key)
        dtype = info.storage_dtype
        n = int(np.prod(size, dtype=np.int64))
        if start == (0,) * nd and n == info.size and slot.base == 0:
            out = self.ckpt.read(rank, slot.key, verify=self.verify, out=self._buf(info.shape, dtype)).reshape(size)
            self.bytes_read += out.nbytes
            return out
        if self.verify or not slot.is_whole:
            view = slot if not slot.is_whole else Slot(slot.key, 0, tuple(info.shape), tuple(info.shape))
            out = self.ckpt.read_runs(rank, slot.key, flat_runs(view, start, size), out=self._buf((n,), dtype),
                                      verify=self.verify).reshape(size)
            self.bytes_read += self.ckpt.bytes_last_read
            return out
        out = self.ckpt.read_box(rank, slot.key, start, size, out=self._buf(size, dtype))
        self.bytes_read += out.nbytes
        return out

    def read_into(self, rank: int, slot: Slot, start, size, out: np.ndarray) -> bool:
        """Read the box straight into ``out`` (C-contiguous, of the box's shape and storage dtype;
        False otherwise): a whole dataset (with ``verify``, checked against its checksum after the
        read), or any other box (with ``verify``, every chunk or tile it touches checked). On a
        mismatch the error is raised and ``out`` may hold the bad bytes."""
        if not (out.flags.c_contiguous and out.flags.writeable):
            return False
        nd = len(slot.shape)
        start, size = slot_box(slot, start, size)
        info = self.ckpt.info(rank, slot.key)
        if out.dtype != info.storage_dtype or tuple(out.shape) != size:
            return False
        if slot.base == 0 and start == (0,) * nd and int(np.prod(size, dtype=object)) == info.size:
            self.ckpt.read(rank, slot.key, verify=self.verify, out=out.reshape(info.shape))
        elif not self.verify and slot.is_whole:
            self.ckpt.read_box(rank, slot.key, start, size, out=out)
        else:
            view = slot if not slot.is_whole else Slot(slot.key, 0, tuple(info.shape), tuple(info.shape))
            self.ckpt.read_runs(rank, slot.key, flat_runs(view, start, size), out=out.reshape(-1), verify=self.verify)
            self.bytes_read += self.ckpt.bytes_last_read
            return True
        self.bytes_read += out.nbytes
        return True

    def _buf(self, shape, dtype):
        return self.arena.array(tuple(shape), dtype) if self.arena is not None else None
