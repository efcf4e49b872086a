"""What the checkpointer did and when, per rank: intervals (blocked, fence, snapshot, flush,
promote to a further tier, restore from host memory) with bytes and the host pool's high-water mark, appended as JSON lines next to the
checkpoints (``ROOT/trace-rank00000.jsonl``). Each event names its ``run``: the wall-clock time its
process's checkpointer started, so the runs of a resumed root (several lifetimes appending to one
file) are told apart."""
from __future__ import annotations

import json
import os
import threading
import time


KEPT_EVENTS = 4096  # events kept in memory for events(); the file has them all (a long run's memory stays flat)


class Trace:
    def __init__(self, root: str, rank: int):
        self.path = os.path.join(root, f"trace-rank{rank:05d}.jsonl")
        self.rank = rank
        self.origin = time.time() - time.perf_counter()  # perf_counter -> wall clock
        self.run = round(time.time(), 6)
        self._events: list[dict] = []  # the newest events (KEPT_EVENTS once written to the file), for events()
        self._written = 0  # how many of them the trace file has
        self._lock = threading.Lock()
        self._file_lock = threading.Lock()  # the flusher and the promoter both flush: one appender at a time

    def add(self, phase: str, start: float, end: float, **info) -> None:
        with self._lock:
            self._events.append({"rank": self.rank, "phase": phase, "start": self.origin + start,
                                 "end": self.origin + end, "run": self.run, **info})

    def events(self) -> list[dict]:
        """The events recorded in memory: all of a short run, the newest KEPT_EVENTS of a long one."""
        with self._lock:
            return list(self._events)

    def flush(self) -> None:
        """Append the events recorded since the last flush to the trace file."""
        with self._file_lock:
            with self._lock:
                events, self._written = self._events[self._written:], len(self._events)
                drop = len(self._events) - KEPT_EVENTS  # written ones only: the file has them
                if drop > 0:
                    del self._events[:drop]
                    self._written -= drop
            if not events:
                return
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            with open(self.path, "a") as f:
                f.write("".join(json.dumps(e) + "\n" for e in events))
