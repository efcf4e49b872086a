"""Write-behind: a large dataset's bytes written at their offsets in a rank file (``store.direct``),
here or in one background thread while the caller hashes, reads and assembles the next dataset.

Why a thread of its own: the disk and the CPU work of the next dataset overlap. How far it may run
ahead is bounded, because the caller's memory is written from as it is: one whole dataset in flight
at most, or up to ``STREAM_DEPTH`` pieces of a stream (``CheckpointWriter.write_stream``).
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Sequence

import numpy as np

from .direct import DirectWriter

STREAM_DEPTH = 2  # write_stream pieces queued for the write-behind thread at most


class WriteBehind:
    """Writes byte ranges into existing files through one ``DirectWriter`` (``disk``; ``direct``: where
    the file system takes it, around the page cache). With ``behind``, ``put`` and ``put_piece``
    return before the bytes are written; ``settle`` waits for them and raises their I/O error. Not
    thread-safe: its owner (a ``CheckpointWriter``) calls it under its lock."""

    def __init__(self, direct: bool, behind: bool):
        self.direct = direct
        self.disk = DirectWriter()
        self._pool: ThreadPoolExecutor | None = ThreadPoolExecutor(1, "ucl-write") if behind else None
        self._inflight: Future | None = None
        self._queued: list[Future] = []  # streamed pieces being written, oldest first

    def now(self, path: str, offset: int, raw: np.ndarray) -> None:
        """``raw`` (flat uint8) at byte ``offset`` of ``path``, written before this returns."""
        self.disk.write(path, offset, raw, self.direct)

    def put(self, path: str, offset: int, raw: np.ndarray) -> None:
        """``raw`` at ``offset`` of ``path``: in the thread (the one dataset in flight; the caller has
        settled the last one), or here. The caller leaves ``raw`` untouched until ``settle``."""
        if self._pool is None:
            self.now(path, offset, raw)
        else:
            self._inflight = self._pool.submit(self.now, path, offset, raw)

    def put_piece(self, spots: Sequence[tuple[str, int]], raw: np.ndarray) -> None:
        """``raw`` at each (path, byte offset) of ``spots``: in the thread, behind at most
        ``STREAM_DEPTH`` pieces still queued (older ones are waited for here), or here."""
        def write() -> None:
            for path, offset in spots:
                self.now(path, offset, raw)
        if self._pool is None:
            write()
        else:
            self._queued.append(self._pool.submit(write))
            while len(self._queued) > STREAM_DEPTH:
                self._queued.pop(0).result()

    def settle(self, pieces: bool = True) -> None:
        """Wait for the dataset in flight (and, with ``pieces``, the streamed pieces); its I/O error is
        raised here."""
        inflight, self._inflight = self._inflight, None
        if inflight is not None:
            inflight.result()
        while pieces and self._queued:
            self._queued.pop(0).result()

    def close(self) -> None:
        """Stop the thread once what it was given is written; idempotent."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
