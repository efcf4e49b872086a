"""The host buffer pool snapshots are copied into: allocated once, handed out as contiguous
regions in FIFO order (a ring), and when full a new region waits (back-pressure) instead of growing.
A snapshot that fits takes one region (it can stay in memory as tier 0); one that does not goes
through the ring in pieces (train.ring), so any pool of a few blocks works."""
from __future__ import annotations

import os
import threading
import time
from collections import deque
from dataclasses import dataclass

from ..errors import StoreError, UclError
from ..store.direct import BLOCK, MIN_DIRECT_BYTES

ALIGN = 64  # bytes: every tensor in a region starts on a cache line, and a large one on a block
# boundary, so the flusher writes it to disk straight from the pool (store.direct)


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
        whole = torch.empty(self.nbytes + BLOCK, dtype=torch.uint8, pin_memory=pin)
        shift = -whole.data_ptr() % BLOCK
        self.buffer = whole[shift:shift + self.nbytes]
        self.buffer.numpy()[::4096] = 0  # touch every page now, not during the first snapshot
        self._regions: deque[Region] = deque()
        self._cond = threading.Condition()
        self.high_water = 0  # most bytes held at once

    def _used(self) -> int:
        return sum(r.stop - r.start for r in self._regions)

    def allocate(self, nbytes: int, closed=lambda: False, reclaim=lambda: None) -> tuple[Region, float]:
        """A region of ``nbytes`` (waits for older regions to be released); returns it and the seconds
        waited. While it does not fit, ``reclaim()`` is called (the owner may give up regions it keeps
        only as a cache); ``closed()`` is polled so a failing flusher cannot leave the caller
        waiting forever."""
        if nbytes > self.nbytes:
            # never from the checkpointer: a snapshot larger than the pool is streamed in pieces
            raise UclError(f"a region of {nbytes:,} bytes cannot come from a pool of {self.nbytes:,}",
                           code="UCL431")
        t0 = time.perf_counter()
        with self._cond:
            while True:
                region = self._take(nbytes)
                if region is not None:
                    return region, time.perf_counter() - t0
                if closed():
                    raise StoreError("the checkpointer stopped while waiting for pool space", code="UCL432")
                # every time, not once: the snapshot kept as a cache may change while we wait (the copier
                # hands over the newest one just after the fence lets save() in)
                self._cond.release()  # reclaim() releases regions, which takes this lock
                try:
                    reclaim()
                finally:
                    self._cond.acquire()
                while self._regions and self._regions[0].released:
                    self._regions.popleft()
                if self._fit(nbytes) is None:
                    self._cond.wait(timeout=0.1)

    def try_allocate(self, nbytes: int, reclaim=lambda: None) -> Region | None:
        """A region of ``nbytes`` if one is free now (after ``reclaim()``), else None: no waiting."""
        if nbytes > self.nbytes:
            return None
        with self._cond:
            region = self._take(nbytes)
        if region is None:
            reclaim()
            with self._cond:
                region = self._take(nbytes)
        return region

    def _take(self, nbytes: int) -> Region | None:
        """A region of ``nbytes`` where one fits now (the lock held), or None."""
        while self._regions and self._regions[0].released:
            self._regions.popleft()
        start = self._fit(nbytes)
        if start is None:
            return None
        region = Region(start, start + nbytes)
        self._regions.append(region)
        self.high_water = max(self.high_water, self._used())
        return region

    def _fit(self, nbytes: int) -> int | None:
        """Start of a free stretch after the newest region (wrapping to 0), or None. Regions start on
        a block boundary."""
        if not self._regions:
            return 0
        stop, tail = self._regions[-1].stop, self._regions[0].start
        head = -(-stop // BLOCK) * BLOCK
        if stop > tail:  # not wrapped: free after the newest region, or from 0 up to the oldest
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


MIN_POOL_BYTES = BLOCK  # the smallest pool: one piece of one block in flight at a time
MAX_PIECE_BYTES = 16 << 20  # a streamed piece: big enough for the disk, small enough to overlap copy and write


WHOLE_POOL_BYTES = 256 << 20  # below this a snapshot gets a whole region by default: little memory, no ring


def default_pool_bytes(total: int, rollbacks: bool = True, room: int | None = None) -> int:
    """The default pool for snapshots of ``total`` bytes, a whole number of blocks. ``rollbacks``
    (``persist_every > 1``: unwritten saves live only in the pool): one snapshot. ``room``: given
    for a model on a GPU, the host memory this process may take (``host_room()``); one snapshot
    when it needs at most half of that, since the next step's fence waits until every byte left the
    GPU, and through a ring that is until all but a pool's worth were hashed and written (an H200
    machine, 2.9 GB every 10 steps: 1.4 s per checkpoint with a quarter, 12 ms with a whole
    snapshot; docs/training.md). Otherwise every save is written, and a pool of a quarter of the
    snapshot (at least 256 MiB, at most one snapshot) streams it as a ring, at no cost to training
    when the flush drains it during the next forward and backward (bench/save.py, CPU, 218 M
    parameters: 10 ms stall against 9 with a whole snapshot, 0.27 of a snapshot of host memory
    against 1.02)."""
    whole = max(-(-total // BLOCK) * BLOCK, MIN_POOL_BYTES)
    if rollbacks or (room is not None and 2 * whole <= room):
        return whole
    return min(whole, max(-(-(total // 4) // BLOCK) * BLOCK, WHOLE_POOL_BYTES))


def host_room(env=None) -> int | None:
    """Host memory one process may take: MemAvailable over the processes on this node (torchrun's
    LOCAL_WORLD_SIZE, else 1); None where the kernel does not say (not Linux)."""
    env = os.environ if env is None else env
    try:
        with open("/proc/meminfo") as f:
            available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return None
    local = env.get("LOCAL_WORLD_SIZE", "")
    return available // max(1, int(local) if local.isdigit() else 1)


def piece_bytes(pool_bytes: int) -> int:
    """Bytes per piece of a snapshot streamed through a pool of ``pool_bytes``: a quarter of the
    pool (the copier fills pieces while the flusher writes others), in whole blocks, 16 MiB at most."""
    return max(BLOCK, min(pool_bytes // 4, MAX_PIECE_BYTES) // BLOCK * BLOCK)


def layout_bytes(sizes) -> tuple[list[int], int]:
    """Offsets of tensors of ``sizes`` bytes packed with ALIGN, and the total."""
    offsets, pos = [], 0
    for n in sizes:
        align = BLOCK if n >= MIN_DIRECT_BYTES else ALIGN
        pos = -(-pos // align) * align
        offsets.append(pos)
        pos += n
    return offsets, pos
