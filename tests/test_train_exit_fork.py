"""The exit hook that closes open Checkpointers leaves alone what is not its own: a forked child
(DataLoader and Pool workers run threading's exit hooks as they leave) holds copies of the parent's
Checkpointers without their threads, and waiting for them would hang it; a Checkpointer made by a
thread that outlives the main thread is that thread's to use and close."""
from __future__ import annotations

import multiprocessing as mp
import threading

import pytest

torch = pytest.importorskip("torch")

import ucl  # noqa: E402
from ucl.train.flusher import Flusher  # noqa: E402


def _leave() -> None:
    return  # a worker that is done: multiprocessing runs the threading exit hooks on the way out


def test_a_forked_child_exits_while_the_parent_has_a_save_in_flight(tmp_path, monkeypatch):
    release = threading.Event()
    handle = Flusher._handle

    def held(self, snap):  # the parent's flush waits until the child has been watched
        release.wait(60)
        handle(self, snap)

    monkeypatch.setattr(Flusher, "_handle", held)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 64)).sum().backward()
    opt.step()
    ck = ucl.Checkpointer(tmp_path / "ck", model, opt)
    try:
        ck.save(1)
        child = mp.get_context("fork").Process(target=_leave)
        child.start()
        child.join(timeout=20)
        hung = child.is_alive()
        if hung:
            child.kill()
            child.join()
    finally:
        release.set()
        ck.close()
    assert not hung, "a forked child of a process with an open Checkpointer did not exit"
    assert child.exitcode == 0


THREAD_SCRIPT = """
import sys, threading, torch, ucl

def train(root, ready):
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.AdamW(model.parameters())
    ck = ucl.Checkpointer(root, model, opt)
    ready.set()
    while threading.main_thread().is_alive():  # stopped after the interpreter's thread exit hooks ran
        threading.Event().wait(0.01)
    model(torch.ones(2, 64)).sum().backward()
    opt.step()
    ck.save(1)
    ck.close()

ready = threading.Event()
threading.Thread(target=train, args=(sys.argv[1], ready)).start()  # not a daemon: Python waits for it
ready.wait()
"""


@pytest.mark.slow
def test_a_checkpointer_of_a_thread_that_outlives_the_main_thread_is_not_closed_under_it(tmp_path):
    """threading's exit hooks run before Python joins the non-daemon threads: closing every open
    Checkpointer there made this thread's next save() fail ("save() after close()"), nothing saved."""
    import subprocess
    import sys
    from ucl.store import CheckpointRoot
    root = tmp_path / "ck"
    done = subprocess.run([sys.executable, "-c", THREAD_SCRIPT, str(root)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and "Error" not in done.stderr, done.stderr[-2000:]
    assert CheckpointRoot(root).steps() == [1]
