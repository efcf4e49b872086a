"""A snapshot larger than what the pool has free, streamed through it as a ring: the copier fills
pieces (whole small tensors, slices of large ones) and hands each to the flusher, which writes it
at its offset in the rank file and gives its region back. When the ring is full the copier waits
for the flusher, so the host memory held is the pool, not the snapshot; only bytes still uncopied at
the fence delay ``optimizer.step()``."""
from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from ..dtypes import logical_of_torch_dtype, storage_dtype
from ..errors import StoreError
from ..store.checksum import IncrementalChecksum
from .pool import HostPool, Region, piece_bytes

HASH_BYTES = 1 << 20  # copied then hashed a megabyte at a time, while it is still in cache


class PieceStream:
    """Pieces of one snapshot from the copier to the flusher, in order: (key, byte offset in the
    dataset, region of the pool). Whoever ends up with a piece releases its region."""

    def __init__(self, pool: HostPool):
        self.pool = pool
        self._cond = threading.Condition()
        self._items: deque[tuple[str, int, Region]] = deque()
        self._closed = False
        self._error: BaseException | None = None
        self.abandoned = False  # the flusher will take no more (nothing is written, or it failed)

    def put(self, key: str, start: int, region: Region) -> bool:
        """Hand a filled piece over; False (and the region released) when the flusher abandoned it."""
        with self._cond:
            if not self.abandoned:
                self._items.append((key, start, region))
                self._cond.notify_all()
                return True
        self.pool.release(region)
        return False

    @property
    def failed(self) -> bool:
        """The copy failed (the copier reported it)."""
        with self._cond:
            return self._error is not None

    def close(self, error: BaseException | None = None) -> None:
        """No more pieces (``error``: the copy failed; the flusher raises it)."""
        with self._cond:
            self._closed, self._error = True, error
            self._cond.notify_all()

    def abandon(self) -> None:
        """The flusher takes no more: queued pieces and later ones go back to the pool."""
        with self._cond:
            self.abandoned = True
            items, self._items = list(self._items), deque()
        for _, _, region in items:
            self.pool.release(region)

    def pieces(self) -> Iterator[tuple[str, int, np.ndarray]]:
        """Each piece's (key, offset, bytes), waiting for the copier; a piece's region goes back to
        the pool when the next one is asked for (the consumer has written it by then)."""
        while True:
            with self._cond:
                while not self._items and not self._closed:
                    self._cond.wait()
                if not self._items:
                    if self._error is not None:
                        raise StoreError(f"the snapshot copy failed: {self._error}", code="UCL432")
                    return
                key, start, region = self._items.popleft()
            try:
                yield key, start, self.pool.buffer.numpy()[region.start:region.stop]
            finally:
                self.pool.release(region)


def copy_streamed(snap, stream: PieceStream, keys: frozenset[str], *, tiles: bool, cuda_stream=None,
                  waiting=lambda: False, reclaim=lambda: None, ahead: int = 1) -> tuple[int, float]:
    """Copy the tensors of ``snap`` named in ``keys`` into pieces of ``stream``'s pool, hashing
    them as they go (``snap.digests``); returns (pieces, seconds waited for ring space). Stops early
    when the flusher abandons the stream. ``waiting()`` true: stop waiting for space (UCL432).
    From a GPU (``cuda_stream``), up to ``ahead`` pieces' copies are queued while the one before
    them is hashed, as many as the pool has room for."""
    import torch
    pool, waited, count = stream.pool, 0.0, 0
    size = piece_bytes(pool.nbytes)
    in_flight: deque[_Landing] = deque()
    depth = max(0, ahead) if cuda_stream is not None else 0

    def land() -> bool:  # the oldest piece in flight: wait for its copy, hash it, hand it over
        p = in_flight.popleft()
        p.event.synchronize()
        p.hasher.advance(p.start // p.store.itemsize, pool.buffer.numpy()[p.region.start:p.region.stop].view(p.store))
        if p.total is not None:
            snap.digests[p.key] = p.hasher.result(p.total)
        return stream.put(p.key, p.start, p.region)

    def allocate(n: int) -> tuple[Region | None, float]:
        # never waits while holding pieces in flight (only they could free the space): lands them first
        while in_flight:
            region = pool.try_allocate(n, reclaim=reclaim)
            if region is not None:
                return region, 0.0
            if not land():
                return None, 0.0
        return pool.allocate(n, closed=lambda: waiting() or stream.abandoned, reclaim=reclaim)

    def abandon() -> None:  # pieces still in flight go back to the pool
        while in_flight:
            p = in_flight.popleft()
            p.event.synchronize()  # the copy may still be writing the region
            pool.release(p.region)

    try:
        for e in snap.layout.entries:
            if e.key not in keys:
                continue
            t = snap.eager.get(e.key, e.tensor)
            store = storage_dtype(logical_of_torch_dtype(t.dtype))
            nbytes = t.numel() * t.element_size()
            h = IncrementalChecksum(tuple(t.shape), store, tiles=tiles)
            flat = _flat_bytes(t)
            if not nbytes:
                snap.digests[e.key] = h.result(0)
            for start in range(0, nbytes, size):
                n = min(size, nbytes - start)
                region, w = allocate(n)
                waited += w
                if region is None:  # the flusher abandoned the stream
                    return count, waited
                count += 1
                last = start + n == nbytes  # before its last piece goes: the flusher may take the digests with it
                dst = pool.buffer.numpy()[region.start:region.stop]
                if isinstance(flat, np.ndarray):  # host memory: copy a block, hash it from cache
                    for at in range(0, n, HASH_BYTES):
                        block = dst[at:at + HASH_BYTES]
                        np.copyto(block, flat[start + at:start + at + block.size])
                        h.advance((start + at) // store.itemsize, block.view(store))
                elif cuda_stream is not None:  # a GPU tensor: queued on the copy stream, hashed once it landed
                    pool.buffer[region.start:region.stop].copy_(flat[start:start + n], non_blocking=True)
                    event = torch.cuda.Event()
                    event.record(cuda_stream)
                    in_flight.append(_Landing(e.key, start, region, event, h, store, t.numel() if last else None))
                    while len(in_flight) > depth:
                        if not land():
                            return count, waited
                    continue
                else:  # a strided or non-CPU tensor without a copy stream: torch copies synchronously
                    pool.buffer[region.start:region.stop].copy_(flat[start:start + n])
                    h.advance(start // store.itemsize, dst.view(store))
                if last:
                    snap.digests[e.key] = h.result(t.numel())
                if not stream.put(e.key, start, region):
                    return count, waited
        while in_flight:
            if not land():
                return count, waited
        return count, waited
    finally:  # a failed copy, or an abandoned stream: what is still in flight goes back to the pool
        abandon()


@dataclass(frozen=True)
class _Landing:
    """A piece whose copy from the GPU was queued: hashed and handed over once ``event`` passed."""
    key: str
    start: int
    region: Region
    event: object
    hasher: IncrementalChecksum
    store: np.dtype
    total: int | None  # the tensor's element count when this is its last piece (its digests are then complete)


def whole_datasets(pieces: Iterator[tuple[str, int, np.ndarray]], datasets) -> Iterator[tuple[str, np.ndarray]]:
    """Each dataset of ``datasets`` (key -> (shape, logical dtype), in the copier's order) as a
    whole storage array assembled from its pieces: for a writer that needs whole arrays (compressed
    datasets are coded whole), each assembled when the consumer asks for it: the flusher's
    ``store.ahead`` holds as many as its coded-ahead budget allows (docs/training.md)."""
    pieces = iter(pieces)
    for key, (shape, dtype) in datasets.items():
        arr = np.empty(shape, storage_dtype(dtype))
        raw, filled = arr.reshape(-1).view(np.uint8), 0
        while filled < raw.size:
            got, start, data = next(pieces, (None, 0, None))
            if got != key or start != filled:
                raise StoreError(f"dataset {key!r}: the ring handed over {got!r} at byte {start}, not byte {filled} "
                                 "of it", code="UCL432")
            raw[filled:filled + data.size] = data
            filled += data.size
        yield key, arr
    for _ in pieces:  # the iterator ends (and gives back its last region)
        pass


def _flat_bytes(t):
    """``t``'s bytes, flat: a numpy array sharing a dense CPU tensor's memory, else a torch uint8
    tensor (on the tensor's device; a strided one is made contiguous first)."""
    import torch
    raw = host_bytes(t)
    if raw is not None or t.numel() == 0:
        return raw if raw is not None else np.empty(0, np.uint8)
    t = t.detach()
    if type(t) is not torch.Tensor:
        t = t.as_subclass(torch.Tensor)
    return t.contiguous().reshape(-1).view(torch.uint8)


def host_bytes(t) -> np.ndarray | None:
    """The bytes of a dense, contiguous CPU tensor as a flat uint8 array sharing its memory, or None
    (another device, a strided view, a subclass such as DTensor, no elements)."""
    import torch
    if type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter:
        return None
    if t.device.type != "cpu" or t.layout != torch.strided or not t.is_contiguous() or t.numel() == 0:
        return None
    return t.detach().reshape(-1).view(torch.uint8).numpy()
