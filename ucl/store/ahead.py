"""Coding datasets ahead of their write: while the writer writes dataset k, datasets k+1, k+2 ...
are coded on a pool of threads (a model of many small tensors codes on every thread, not one), and
they come out in their given order, so the file is the same bytes whatever the thread count.

Memory: the logical bytes of the datasets handed over but not yet taken back (the source arrays,
and their coded bytes once coded) stay within ``AHEAD_BYTES`` per thread, or one larger dataset
alone (and one more array is held, taken from the source and waiting for room); nothing is copied."""
from __future__ import annotations

from collections import deque
import threading
import time
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import Any, Iterable, Iterator

import numpy as np

from ..dtypes import to_numpy
from ..errors import StoreError, UclError
from .codec import BLOCK_BYTES, Encoded, encode

AHEAD_BYTES = 16 << 20  # per coding thread: logical bytes coded ahead of the writer at most (and one dataset)


class CodedAhead:
    """``items``, (key, array or tensor, logical dtype) in write order, each yielded back as (key,
    storage array, logical dtype, ``Encoded``, None for an empty array), coded ahead on ``threads``
    threads (never the calling one). Use it in a ``with`` block: on leaving, nothing is being coded
    any more (a failed write does not leave threads reading memory the caller gives back). A coding
    error is raised when its dataset is taken: a StoreError (UCL410) naming the dataset."""

    def __init__(self, items: Iterable[tuple[str, Any, str | None]], codec: str, threads: int = 1):
        self._items, self._codec = iter(items), codec
        self._threads = max(1, int(threads))
        self._budget = AHEAD_BYTES * self._threads
        self._pool = ThreadPoolExecutor(self._threads, "ucl-compress")
        self._workers = _Timed(self._pool)
        # a dataset of several blocks is split into them (codec.encode) here, its blocks coded by the
        # workers: splitting on a worker could wait for blocks queued behind itself
        self._splitter = _Timed(ThreadPoolExecutor(1, "ucl-compress-split"))
        self._queue: deque[tuple[str, np.ndarray, str, Future | None]] = deque()
        self._next: tuple[str, np.ndarray, str] | None = None  # taken from items, not yet handed over
        self.held = 0  # logical bytes handed over and not yet taken back
        self.high_water = 0  # the most bytes ever held
        self.most_queued = 0  # the most datasets ever handed over at once

    def __enter__(self) -> "CodedAhead":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Cancel what has not started; wait for what has (it may read the caller's arrays)."""
        for *_, fut in self._queue:
            if fut is not None:
                fut.cancel()
        self._queue.clear()
        self._splitter.pool.shutdown(wait=True, cancel_futures=True)
        self._pool.shutdown(wait=True, cancel_futures=True)

    @property
    def cpu_seconds(self) -> float:
        """CPU time the coding threads spent so far (read it after ``close``)."""
        return self._workers.cpu_seconds + self._splitter.cpu_seconds

    def _fill(self) -> None:
        """Hand datasets over while they fit the budget; one larger than it goes alone, once the
        queue is empty (so the bytes held never exceed the budget or that one dataset)."""
        while True:
            if self._next is None:
                item = next(self._items, None)
                if item is None:
                    return
                key, data, dtype = item
                self._next = (key, *to_numpy(data, dtype))
            key, arr, dtype = self._next
            if self._queue and self.held + arr.nbytes > self._budget:
                return
            self._next = None
            fut = None
            if arr.nbytes:
                if arr.nbytes > BLOCK_BYTES:  # several blocks: spread over the workers
                    fut = self._splitter.submit(encode, arr, dtype, self._codec, self._workers)
                else:
                    fut = self._workers.submit(encode, arr, dtype, self._codec)
            self._queue.append((key, arr, dtype, fut))
            self.held += arr.nbytes
            self.high_water = max(self.high_water, self.held)
            self.most_queued = max(self.most_queued, len(self._queue))

    def __iter__(self) -> Iterator[tuple[str, np.ndarray, str, Encoded | None]]:
        while True:
            self._fill()
            if not self._queue:
                return
            key, arr, dtype, fut = self._queue.popleft()
            enc = None
            if fut is not None:
                try:
                    enc = fut.result()
                except UclError:
                    raise
                except Exception as e:
                    raise StoreError(f"coding dataset {key!r} failed: {type(e).__name__}: {e}",
                                     code="UCL410") from e
            self.held -= arr.nbytes
            yield key, arr, dtype, enc


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
