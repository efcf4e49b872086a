"""A snapshot (what ``save(step)`` captured, living in a region of the host pool, or streamed
through it in pieces: train.ring) and who holds its region: ``memory`` (tier 0: the newest copied snapshot stays in host memory), ``flush`` (until
written) and ``load`` (while restored from). The region goes back to the pool when the last holder
lets go."""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..dtypes import logical_of_torch_dtype, storage_dtype
from .derive import TrainLayout
from .pool import HostPool, Region


@dataclass(eq=False)
class Snapshot:
    step: int
    extra: Any
    layout: TrainLayout
    region: Region | None  # None: streamed through the pool in pieces (``stream``)
    offsets: list[int]
    persist: bool  # written to disk (the local tier when there is one, else root)
    state: dict  # JSON: step, extra, rng, optimizer hyperparameters
    copied: threading.Event = field(default_factory=threading.Event)
    digests: dict = field(default_factory=dict)  # key -> store.digests.Digests, hashed while copied
    holders: set = field(default_factory=set)
    ready_event: Any = None  # CUDA: recorded on the training stream at save(); the copy waits for it
    cuda_event: Any = None  # CUDA: recorded on the copy stream after the copy; the fence waits for it
    shared: bool = True  # with a local tier: copied on to the shared root too (persist_every)
    stream: Any = None  # train.ring.PieceStream of a streamed snapshot
    nbytes: int = 0  # the whole snapshot's bytes (laid out as in a region)
    eager: dict = field(default_factory=dict)  # streamed: key -> host copy of a buffer, taken in save()


class Snapshots:
    """The host pool and the holders of its regions."""

    def __init__(self):
        self.pool: HostPool | None = None
        self._lock = threading.Lock()
        self._memory: Snapshot | None = None

    def view(self, snap: Snapshot, entry, offset: int):
        """The pool bytes of ``entry`` in ``snap`` as a tensor of its dtype and shape."""
        t = entry.tensor
        n = t.numel() * t.element_size()
        raw = self.pool.view(snap.region)[offset:offset + n]
        return raw.view(t.dtype).view(t.shape) if n else raw[:0].view(t.dtype).reshape(t.shape)

    def array(self, snap: Snapshot, entry, offset: int) -> np.ndarray:
        """The pool bytes of ``entry`` in ``snap`` as its storage array (numpy; bf16 as its bits)."""
        t = entry.tensor
        raw = self.bytes(snap, offset, t.numel() * t.element_size())
        return raw.view(storage_dtype(logical_of_torch_dtype(t.dtype))).reshape(tuple(t.shape))

    def bytes(self, snap: Snapshot, offset: int, nbytes: int):
        """``nbytes`` of ``snap``'s region from ``offset``, as a flat uint8 numpy array."""
        return self.pool.buffer.numpy()[snap.region.start + offset:snap.region.start + offset + nbytes]

    def drop(self, snap: Snapshot, *holders: str) -> None:
        with self._lock:
            for h in holders:
                snap.holders.discard(h)
            free = not snap.holders
        if free and self.pool is not None and snap.region is not None:
            self.pool.release(snap.region)

    def remember(self, snap: Snapshot) -> None:
        """``snap`` (copied) becomes tier 0; the one before it lets go of its region."""
        with self._lock:
            previous, self._memory = self._memory, snap
        if previous is not None:
            self.drop(previous, "memory")

    def forget(self) -> None:
        """Give up tier 0, to make room in the pool."""
        with self._lock:
            memory, self._memory = self._memory, None
        if memory is not None:
            self.drop(memory, "memory")

    def borrow(self) -> Snapshot | None:
        """Tier 0, held as ``load`` (not reclaimed while read; ``drop(snap, "load")`` after)."""
        with self._lock:
            snap = self._memory
            if snap is not None:
                snap.holders.add("load")
        return snap
