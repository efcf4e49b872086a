"""A snapshot larger than what the pool has free, streamed through it as a ring: the copier fills
pieces (whole small tensors, slices of large ones) and hands each to the flusher, which writes it
at its offset in the rank file and gives its region back. When the ring is full the copier waits
for the flusher, so the host memory held is the pool, not the snapshot; only bytes still uncopied at
the fence delay ``optimizer.step()``."""
from __future__ import annotations

import threading
from collections import deque
from typing import Iterator

import numpy as np

from ..dtypes import logical_of_torch_dtype, storage_dtype
from ..errors import StoreError
from ..store.digests import IncrementalChecksum
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
                  waiting=lambda: False, reclaim=lambda: None) -> tuple[int, float]:
    """Copy the tensors of ``snap`` named in ``keys`` into pieces of ``stream``'s pool, hashing
    them as they go (``snap.digests``); returns (pieces, seconds waited for ring space). Stops early
    when the flusher abandons the stream. ``waiting()`` true: stop waiting for space (UCL432)."""
    pool, waited, count = stream.pool, 0.0, 0
    size = piece_bytes(pool.nbytes)
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
            region, w = pool.allocate(n, closed=lambda: waiting() or stream.abandoned, reclaim=reclaim)
            waited += w
            dst = pool.buffer.numpy()[region.start:region.stop]
            if isinstance(flat, np.ndarray):  # host memory: copy a block, hash it from cache
                for at in range(0, n, HASH_BYTES):
                    block = dst[at:at + HASH_BYTES]
                    np.copyto(block, flat[start + at:start + at + block.size])
                    h.advance((start + at) // store.itemsize, block.view(store))
            else:  # a CUDA (or strided) tensor: torch copies, the pinned piece is hashed once it landed
                pool.buffer[region.start:region.stop].copy_(flat[start:start + n], non_blocking=cuda_stream is not None)
                if cuda_stream is not None:
                    cuda_stream.synchronize()
                h.advance(start // store.itemsize, dst.view(store))
            count += 1
            if start + n == nbytes:  # before its last piece goes: the flusher may take the digests with it
                snap.digests[e.key] = h.result(t.numel())
            if not stream.put(e.key, start, region):
                return count, waited
    return count, waited


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
