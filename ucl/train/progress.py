"""What the checkpointer and its background stages share: how much saved work is unfinished
(flushes and promotions) and the first background error, kept until the next call raises it."""
from __future__ import annotations

import os
import queue
import sys
import threading

# The promoter runs this much nicer than training (Linux): copying to a further tier gates nothing,
# and on a CPU box it would otherwise take cores from the training threads' parallel regions, which
# then wait for their slowest thread. Its bounded queue keeps it from falling behind unboundedly.
BACKGROUND_NICE = 10


def lower_priority(by: int | None = None) -> None:
    """Raise the calling thread's nice value by ``by`` (default BACKGROUND_NICE; Linux only: there a
    thread id is a ``setpriority`` target of its own, elsewhere it would name a process). Best effort."""
    by = BACKGROUND_NICE if by is None else by
    if by <= 0 or not sys.platform.startswith("linux"):
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + by))
    except OSError:
        pass


class Progress:
    def __init__(self):
        self._cond = threading.Condition()
        self._pending = 0
        self._error: BaseException | None = None
        self._broken = False  # a failure that stops further flushes until it is raised

    def begin(self) -> None:
        """One more piece of work (a flush, a promotion) that ``wait`` must see finished."""
        with self._cond:
            self._pending += 1

    def done(self) -> None:
        with self._cond:
            self._pending -= 1
            self._cond.notify_all()

    def fail(self, error: BaseException) -> None:
        """Record a background error that stops further flushes until it is raised; the first error
        wins, the next ``save``/``wait``/``close`` raises it."""
        with self._cond:
            if self._error is None:
                self._error = error
            self._broken = True
            self._cond.notify_all()

    def report(self, error: BaseException) -> None:
        """Record a background error that stops nothing (a failed promotion: the checkpoint is
        durable in root, and later ones are written and promoted as usual)."""
        with self._cond:
            if self._error is None:
                self._error = error
            self._cond.notify_all()

    @property
    def failed(self) -> bool:
        return self._broken

    def raise_error(self) -> None:
        with self._cond:
            error, self._error, self._broken = self._error, None, False
        if error is not None:
            raise error

    def wait_idle(self) -> None:
        """Until every piece of work begun so far is done, or one failed."""
        with self._cond:
            while self._pending and self._error is None:
                self._cond.wait(timeout=0.1)


class Stage:
    """One background stage: a daemon thread handling queued items in order (``depth`` 0:
    unbounded, else ``put`` waits while full); ``stop`` ends it after what is queued."""

    def __init__(self, name: str, depth: int = 0) -> None:
        self._q: queue.Queue = queue.Queue(maxsize=depth)
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _put(self, item) -> None:
        self._q.put(item)

    def stop(self, timeout: float = 60) -> None:
        self._q.put(None)
        self._thread.join(timeout=timeout)

    def _loop(self) -> None:
        self._setup()
        while (item := self._q.get()) is not None:
            self._handle(item)

    def _setup(self) -> None:
        """Run once on the stage's thread before the first item."""

    def _handle(self, item) -> None:
        raise NotImplementedError

