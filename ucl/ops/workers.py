"""Forked worker processes, one per task, for the reshard: each sends its byte counts, then its
result or its error, over a pipe of its own, and the parent wakes for whichever comes first. A
worker that dies without a result (the OOM killer, a SIGKILL) fails the run at once instead of
leaving the parent waiting; a worker never outlives its parent."""
from __future__ import annotations

import contextlib
import ctypes
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from typing import Any, Callable, Sequence

from ..errors import StoreError

_PR_SET_PDEATHSIG = 1
PARENT_POLL_S = 0.25  # how often a worker checks that the parent that forked it is still there
CANCEL_POLL_S = 0.1  # how often the parent checks its cancel event while the workers run


class Stopped(Exception):
    """The run was cancelled (``cancel`` set): the workers were stopped."""


class WorkerTraceback(Exception):
    """Where a worker's error was raised, in the worker (the ``__cause__`` of the error re-raised here)."""

    def __str__(self) -> str:
        return "\n" + self.args[0]


def run_forked(work: Callable[[Any, Callable[[int], None] | None], Any], tasks: Sequence[Any],
               progress: Callable[[int], None] | None = None, cancel: threading.Event | None = None,
               name: str = "worker") -> list[Any]:
    """``[work(task, report) for task in tasks]``, each in a process forked for it (``work`` and the
    tasks are inherited, not pickled; results come back pickled). ``report`` sends a byte count to
    ``progress``, called in this thread (None when ``progress`` is None). The first error of any
    worker is raised here as soon as it comes, and the other workers are stopped; so they are when
    ``cancel`` is set (``Stopped``). A worker that exits without a result raises StoreError UCL410."""
    import multiprocessing.connection  # (4 ms of import: a one-core reshard forks no worker)
    ctx = multiprocessing.get_context("fork")
    procs: list[Any] = []
    pipes: list[Any] = []
    try:
        for i, task in enumerate(tasks):
            receive, send = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_worker_main, args=(work, task, send, os.getpid(), progress is not None),
                            name=f"ucl-{name}-{i}", daemon=True)
            p.start()
            send.close()  # the worker holds the only write end: its death reads as end of file
            procs.append(p)
            pipes.append(receive)
        results: dict[int, Any] = {}
        while len(results) < len(tasks):
            if cancel is not None and cancel.is_set():
                raise Stopped()
            waiting = [i for i in range(len(tasks)) if i not in results]
            multiprocessing.connection.wait([pipes[i] for i in waiting] + [procs[i].sentinel for i in waiting],
                                            timeout=CANCEL_POLL_S)
            for i in waiting:
                got = _receive(pipes[i], progress)
                if got is not None:
                    results[i] = got[0]
                elif not procs[i].is_alive():
                    got = _receive(pipes[i], progress)  # what it sent right before it exited
                    if got is None:
                        raise StoreError(f"{name} process {procs[i].pid} died ({_how(procs[i].exitcode)}) before it "
                                         "finished; nothing was published", code="UCL410")
                    results[i] = got[0]
        return [results[i] for i in range(len(tasks))]
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join()
            p.close()
        for r in pipes:
            r.close()


def _receive(pipe, progress: Callable[[int], None] | None) -> tuple[Any] | None:
    """Everything the worker has sent so far: byte counts go to ``progress``; its result comes back
    as a 1-tuple, its error is raised; None while it has sent neither (or died before it did)."""
    while pipe.poll():
        try:
            kind, value, *where = pipe.recv()
        except EOFError:
            return None
        if kind == "bytes":
            progress(value)
        elif kind == "done":
            return (value,)
        else:
            raise value from WorkerTraceback(where[0])
    return None


def _how(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        name = signal.Signals(-exitcode).name if -exitcode in signal.valid_signals() else str(-exitcode)
        return f"killed by {name}" + (", out of memory?" if exitcode == -signal.SIGKILL else "")
    return f"exit code {exitcode}"


def _worker_main(work, task, send, parent: int, reports: bool) -> None:
    _die_with_parent(parent)
    try:
        message = ("done", work(task, (lambda n: send.send(("bytes", n))) if reports else None))
    except BaseException as e:  # the parent raises it
        message = ("failed", _portable(e), "".join(traceback.format_exception(e)))
    try:
        send.send(message)
    except Exception as e:  # a result that cannot be pickled (or a parent gone: then this fails too)
        with contextlib.suppress(Exception):
            send.send(("failed", StoreError(f"a worker's result could not be sent back: {e}", code="UCL410"), ""))
    finally:
        send.close()


def _portable(e: BaseException) -> BaseException:
    """``e``, or a StoreError naming it where it cannot be pickled back to the parent."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:
        return StoreError(f"{type(e).__name__}: {e}", code="UCL410")


def _die_with_parent(parent: int) -> None:
    """A worker must not outlive the run that forked it. A parent killed with SIGKILL cannot stop its
    workers, and they would go on writing into a temp directory that no one will ever commit (and,
    holding its lock, that ``ucl gc`` must leave alone)."""
    if sys.platform.startswith("linux"):
        # the kernel sends SIGKILL when the forking thread exits: run_forked forks from the thread that
        # calls it and waits for the workers there, so that thread outlives them
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent:  # it died before the line above took effect
        os.kill(os.getpid(), signal.SIGKILL)
    # everywhere (and where prctl is missing): re-parenting shows the parent is gone
    threading.Thread(target=_watch_parent, args=(parent,), name="ucl-parent-watch", daemon=True).start()


def _watch_parent(parent: int) -> None:
    while True:
        time.sleep(PARENT_POLL_S)
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGKILL)
