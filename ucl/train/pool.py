"""The host buffer pool snapshots are copied into: allocated once, handed out as contiguous
regions in FIFO order, and when full a new region waits (back-pressure) instead of growing."""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

from ..errors import StoreError, UclError

ALIGN = 64  # bytes: every tensor in a region starts on a cache line


@dataclass
class Region:
    start: int
    stop: int
    released: bool = False


class HostPool:
    """``nbytes`` of host memory (pinned when ``pin``), as one torch uint8 tensor."""

    def __init__(self, nbytes: int, *, pin: bool = False):
        import torch
        self.nbytes = int(nbytes)
        self.buffer = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=pin)
        self.buffer.numpy()[::4096] = 0  # touch every page now, not during the first snapshot
        self._regions: deque[Region] = deque()
        self._cond = threading.Condition()
        self.high_water = 0  # most bytes held at once

    def _used(self) -> int:
        return sum(r.stop - r.start for r in self._regions)

    def allocate(self, nbytes: int, closed=lambda: False, reclaim=lambda: None) -> tuple[Region, float]:
        """A region of ``nbytes`` (waits for older regions to be released); returns it and the seconds
        waited. When it does not fit, ``reclaim()`` is called once (the owner may give up regions it
        keeps only as a cache); ``closed()`` is polled so a failing flusher cannot leave the caller
        waiting forever."""
        if nbytes > self.nbytes:
            raise UclError(f"a snapshot of this rank needs {nbytes:,} bytes but the pool holds {self.nbytes:,}; "
                           "pass a larger pool_bytes", code="UCL431")
        t0 = time.perf_counter()
        reclaimed = False
        with self._cond:
            while True:
                while self._regions and self._regions[0].released:
                    self._regions.popleft()
                start = self._fit(nbytes)
                if start is not None:
                    region = Region(start, start + nbytes)
                    self._regions.append(region)
                    self.high_water = max(self.high_water, self._used())
                    return region, time.perf_counter() - t0
                if closed():
                    raise StoreError("the checkpointer stopped while waiting for pool space", code="UCL432")
                if not reclaimed:
                    reclaimed = True
                    self._cond.release()  # reclaim() releases regions, which takes this lock
                    try:
                        reclaim()
                    finally:
                        self._cond.acquire()
                    continue
                self._cond.wait(timeout=0.1)

    def _fit(self, nbytes: int) -> int | None:
        """Start of a free stretch after the newest region (wrapping to 0), or None."""
        if not self._regions:
            return 0
        head, tail = self._regions[-1].stop, self._regions[0].start
        if head > tail:  # not wrapped: free after the newest region, or from 0 up to the oldest
            if self.nbytes - head >= nbytes:
                return head
            return 0 if tail >= nbytes else None
        return head if tail - head >= nbytes else None  # wrapped: free between newest and oldest

    def release(self, region: Region) -> None:
        with self._cond:
            region.released = True
            self._cond.notify_all()

    def view(self, region: Region):
        return self.buffer[region.start:region.stop]


def layout_bytes(sizes) -> tuple[list[int], int]:
    """Offsets of tensors of ``sizes`` bytes packed with ALIGN, and the total."""
    offsets, pos = [], 0
    for n in sizes:
        pos = -(-pos // ALIGN) * ALIGN
        offsets.append(pos)
        pos += n
    return offsets, pos
