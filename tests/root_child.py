"""Processes tests/test_root_lifecycle.py SIGKILLs while they re-save a step (forked by its
forkserver, which has torch and ucl imported): ``resave_forever`` at a random moment, ``resave_killed_at``
at a named point of the publication. Each reports ``ready`` once its first checkpoints are durable."""
from __future__ import annotations

import os
import signal

import torch

from train_crash_child import build, train_step  # noqa: F401  (build: the tests' model too)


def _send(conn, line: str) -> None:
    conn.send_bytes(line.encode())


def _first_saves(root: str, seed: int, steps=(0, 1)):
    import ucl
    torch.set_num_threads(1)
    model, optimizer = build(seed)
    ck = ucl.Checkpointer(root, model, optimizer, keep=3)
    for s in steps:
        ck.save(s, extra={"step": s})
        train_step(model, optimizer, seed, s)
    ck.wait()
    return ck, model, optimizer


def resave_forever(root: str, seed: int, conn) -> None:
    """Steps 0 and 1, then ``load()`` (step 1), a training step, ``save(1)`` again, forever."""
    ck, model, optimizer = _first_saves(root, seed)
    _send(conn, "ready")
    for i in range(100_000):
        assert ck.load()[0] == 1
        train_step(model, optimizer, seed, 100 + i)  # the new copy differs from the old one
        ck.save(1, extra={"step": 1})
        ck.wait()
        _send(conn, f"resaved {i}")


def resave_killed_at(root: str, where: str, conn) -> None:
    """Steps (0 and) 1, then ``load()`` and ``save(1)``, dying by SIGKILL at ``where``:
    ``writing`` (the new copy's rank file being written), ``after_swap`` (the atomic swap done, the
    old copy not yet deleted), ``gap`` / ``gap_no_older`` (no atomic swap: the old copy renamed aside,
    the new one not yet renamed in; with step 0 for ``latest`` to stand on, or without)."""
    import ucl.store.root as root_module
    from ucl.store.writer import CheckpointWriter
    ck, model, optimizer = _first_saves(root, 5, steps=(1,) if where == "gap_no_older" else (0, 1))
    _send(conn, "ready")

    def die(*_a, **_k):
        _send(conn, "killing")
        os.kill(os.getpid(), signal.SIGKILL)

    if where == "writing":
        CheckpointWriter.write_from = die
    elif where == "after_swap":
        real = root_module.exchange_dirs

        def exchange(a, b):
            if real(a, b):
                die()
            _send(conn, "no swap")  # this file system cannot swap: the test skips
            return False
        root_module.exchange_dirs = exchange
    elif where in ("gap", "gap_no_older"):
        root_module.exchange_dirs = lambda a, b: False
        root_module.publish_dir = die
    else:
        raise ValueError(where)
    assert ck.load()[0] == 1
    train_step(model, optimizer, 5, 100)
    ck.save(1, extra={"step": 1})
    ck.wait()
    _send(conn, "not killed")
