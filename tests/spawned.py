"""Run a test's worker in ``world`` spawned processes (torch.multiprocessing) and collect what each wrote.

A worker is ``worker(rank, *args)`` and writes ``{out}/{phase}_{rank}.json`` in a ``finally``, with an
``"error"`` key when it failed; :func:`spawn_ranks` kills stragglers after ``limit_s`` and fails the test
on any error, so a hung process group is a failed test, not a hung suite."""
from __future__ import annotations

import json
import os
import socket
import time

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join_within(ctx, limit_s: float, what: str) -> None:
    """Wait for a ``tmp_mp.spawn(..., join=False)`` context; fail the test after ``limit_s`` and kill its processes."""
    deadline = time.time() + limit_s
    try:
        while not ctx.join(timeout=0.5):
            if time.time() > deadline:
                pytest.fail(f"{what}: processes did not finish within {limit_s} s (a collective hangs?)")
    finally:
        for p in ctx.processes:  # only the processes this test spawned
            if p.is_alive():
                p.kill()
                p.join()


def spawn_ranks(worker, world: int, args: tuple, out: str, phase: str, limit_s: float = 120.0,
                label: str | None = None) -> list[dict]:
    import torch.multiprocessing as tmp_mp  # here: importing this module needs no torch (free_port)

    os.makedirs(out, exist_ok=True)
    join_within(tmp_mp.spawn(worker, args=args, nprocs=world, join=False), limit_s, label or phase)
    results = [json.load(open(os.path.join(out, f"{phase}_{r}.json"))) for r in range(world)]
    for r in results:
        assert "error" not in r, r["error"]
    return results
