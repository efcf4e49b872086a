"""Coding datasets ahead of their write: while the writer writes dataset k, datasets k+1, k+2 ...
are coded on a pool of threads (a model of many small tensors codes on every thread, not one), and
they come out in their given order, so the file is the same bytes whatever the thread count.

Memory: the logical bytes of the datasets handed over but not yet taken back (the source arrays,
and their coded bytes once coded) stay within a budget (``AHEAD_BYTES`` per thread at most), or
one larger dataset alone; beside them one more source array is held, taken from the source and waiting for room.
Nothing is copied."""
from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import Any, Iterable, Iterator

import numpy as np

from ..dtypes import to_numpy
from ..errors import StoreError, UclError
from .codec import BLOCK_BYTES, Encoded, encode

AHEAD_BYTES = 16 << 20  # per coding thread: logical bytes coded ahead of the writer at most (and one dataset)
AHEAD_SHARE = 4  # ... and at most this share of what is written (1/4), where that leaves each thread
# two groups: a small snapshot is not copied whole into coded bytes ahead
GROUP_BYTES = 256 << 10  # small datasets are coded a group of about this many bytes per task: handing a
# task to a thread costs about as much CPU as coding some tens of KiB


def ahead_budget(total: int, threads: int) -> int:
    """The bytes ``CodedAhead`` may code ahead when ``total`` bytes are written in all."""
    return min(AHEAD_BYTES * threads, max(total // AHEAD_SHARE, 2 * GROUP_BYTES * threads))


class CodingThreads:
    """The threads datasets are coded on, kept from one ``CodedAhead`` to the next (and with them
    each thread's codec contexts and scratch buffers: made afresh at every save, on the bench's model
    those cost about a quarter of the coding's CPU); started at first use, ended by ``close``."""

    def __init__(self, threads: int = 1):
        self.threads = max(1, int(threads))
        self._workers: _Timed | None = None
        self._splitter: _Timed | None = None
        self._spent = 0.0  # CPU seconds of the threads ended so far

    def pools(self) -> tuple["_Timed", "_Timed"]:
        """(workers, splitter): a dataset of several blocks is split into them (codec.encode) on the
        splitter, its blocks coded by the workers (split on a worker, it could wait for blocks
        queued behind itself)."""
        if self._workers is None:
            self._workers = _Timed(ThreadPoolExecutor(self.threads, "ucl-compress"))
            self._splitter = _Timed(ThreadPoolExecutor(1, "ucl-compress-split"))
        return self._workers, self._splitter

    @property
    def cpu_seconds(self) -> float:
        """CPU time the threads spent coding so far."""
        return self._spent + sum(p.cpu_seconds for p in (self._workers, self._splitter) if p is not None)

    def close(self) -> None:
        """Cancel what has not started, wait for what has (it may read its caller's arrays), end the
        threads; the next use starts new ones."""
        for p in (self._splitter, self._workers):
            if p is not None:
                p.pool.shutdown(wait=True, cancel_futures=True)
                self._spent += p.cpu_seconds
        self._workers = self._splitter = None


class CodedAhead:
    """``items``, (key, array or tensor, logical dtype) in write order, each yielded back as (key,
    storage array, logical dtype, ``Encoded``, None for an empty array), coded ahead on the threads
    of ``threads`` (never the calling one), at most ``budget`` logical bytes ahead (default
    ``AHEAD_BYTES`` per thread; one larger dataset goes alone). Use it in a ``with`` block: left
    before the last item (an error, here or in the caller), it ends ``threads``
    (``CodingThreads.close``), so nothing is being coded any more when it returns. A coding error is
    raised when its dataset is taken: a StoreError (UCL410) naming the dataset."""

    def __init__(self, items: Iterable[tuple[str, Any, str | None]], codec: str, threads: CodingThreads,
                 budget: int | None = None):
        self._items, self._codec, self._threads = iter(items), codec, threads
        self._budget = AHEAD_BYTES * threads.threads if budget is None else int(budget)
        self._workers, self._splitter = threads.pools()
        self._cpu0 = threads.cpu_seconds
        self._queue: deque[tuple[str, np.ndarray, str, _Batch | None, int]] = deque()
        self._batch = _Batch([])  # small datasets gathered for one task, not handed over yet
        self._next: tuple[str, np.ndarray, str] | None = None  # taken from items, not yet handed over
        self._done = False  # every item was taken back
        self.held = 0  # logical bytes handed over and not yet taken back
        self.high_water = 0  # the most bytes ever held
        self.most_queued = 0  # the most datasets ever handed over at once
        self.cpu_seconds = 0.0  # the coding threads' CPU time for these items (set when left)

    def __enter__(self) -> "CodedAhead":
        return self

    def __exit__(self, *exc: object) -> None:
        if not self._done or exc[0] is not None:
            self._threads.close()
        self.cpu_seconds = self._threads.cpu_seconds - self._cpu0

    def _fill(self) -> None:
        """Hand datasets over while they fit the budget; one larger than it goes alone, once the
        queue is empty (so the bytes held never exceed the budget or that one dataset)."""
        while True:
            if self._next is None:
                item = next(self._items, None)
                if item is None:
                    return self._submit()
                key, data, dtype = item
                self._next = (key, *to_numpy(data, dtype))
            key, arr, dtype = self._next
            if self._queue and self.held + arr.nbytes > self._budget:
                return self._submit()
            self._next = None
            batch = None
            if arr.nbytes > BLOCK_BYTES:  # several blocks: spread over the workers
                batch = _Batch([(key, arr, dtype)])
                batch.future = self._splitter.submit(_encode_all, batch.items, self._codec, self._workers)
            elif arr.nbytes:
                batch = self._batch
                batch.items.append((key, arr, dtype))
                batch.nbytes += arr.nbytes
            self._queue.append((key, arr, dtype, batch, len(batch.items) - 1 if batch else 0))
            if self._batch.nbytes >= GROUP_BYTES:
                self._submit()
            self.held += arr.nbytes
            self.high_water = max(self.high_water, self.held)
            self.most_queued = max(self.most_queued, len(self._queue))

    def _submit(self) -> None:
        """Hand the small datasets gathered so far to a worker, as one task."""
        if self._batch.items:
            self._batch.future = self._workers.submit(_encode_all, self._batch.items, self._codec)
            self._batch = _Batch([])

    def __iter__(self) -> Iterator[tuple[str, np.ndarray, str, Encoded | None]]:
        while True:
            self._fill()
            if not self._queue:
                self._done = True
                return
            key, arr, dtype, batch, at = self._queue.popleft()
            self.held -= arr.nbytes
            yield key, arr, dtype, None if batch is None else batch.future.result()[at]


class _Batch:
    """Datasets coded by one task, and its future once handed over."""

    __slots__ = ("items", "nbytes", "future")

    def __init__(self, items: list):
        self.items, self.nbytes, self.future = items, 0, None


def _encode_all(items, codec: str, pool: Executor | None = None) -> list[Encoded]:
    """Each (key, array, dtype) of ``items`` coded; an error names the dataset."""
    done = []
    for key, arr, dtype in items:
        try:
            done.append(encode(arr, dtype, codec, pool))
        except UclError:
            raise
        except Exception as e:
            raise StoreError(f"coding dataset {key!r} failed: {type(e).__name__}: {e}", code="UCL410") from e
    return done


class _Timed(Executor):
    """An executor's tasks, their thread CPU time added up (``codec.encode`` maps a dataset's blocks
    through it)."""

    def __init__(self, pool: ThreadPoolExecutor):
        self.pool, self.cpu_seconds, self._lock = pool, 0.0, threading.Lock()

    def submit(self, fn, /, *args, **kwargs) -> Future:  # type: ignore[override]
        return self.pool.submit(self._run, fn, args, kwargs)

    def _run(self, fn, args, kwargs):
        t0 = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            with self._lock:
                self.cpu_seconds += time.thread_time() - t0
