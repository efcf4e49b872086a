"""Peak memory of a process tree, for tests and benchmarks of ``max_memory=`` caps.

:class:`TreeMemory` samples the proportional set size (PSS, ``/proc/PID/smaps_rollup``) of a process and
all its descendants in a background thread and keeps the peak of the sum. PSS, not RSS: a forked worker
shares its parent's pages, and summing RSS would count them once per process. Use it as::

    with TreeMemory() as mem:          # baseline taken on entry (imports already done)
        run_the_operation()
    added = mem.peak_added             # bytes above the baseline at the peak

Linux only (``/proc``); ``available()`` says whether it can run here.
"""
from __future__ import annotations

import os
import threading
import time


def available() -> bool:
    return os.path.exists(f"/proc/{os.getpid()}/smaps_rollup")


def _children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out.extend(int(c) for c in f.read().split())
    except OSError:
        pass
    return out


def _pss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def tree_pss(root: int) -> int:
    """PSS bytes of ``root`` and every descendant, now."""
    total, todo, seen = 0, [root], set()
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        total += _pss(pid)
        todo.extend(_children(pid))
    return total


class TreeMemory:
    """Samples ``tree_pss(root)`` every ``interval`` seconds between ``__enter__`` and ``__exit__``."""

    def __init__(self, root: int | None = None, interval: float = 0.005):
        self.root = os.getpid() if root is None else root
        self.interval = interval
        self.baseline = 0
        self.peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, tree_pss(self.root))
            time.sleep(self.interval)

    def __enter__(self) -> "TreeMemory":
        self.baseline = self.peak = tree_pss(self.root)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join()
        self.peak = max(self.peak, tree_pss(self.root))

    @property
    def peak_added(self) -> int:
        return self.peak - self.baseline
