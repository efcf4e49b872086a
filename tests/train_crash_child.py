"""A seeded training loop that checkpoints every iteration; tests/test_train_crash.py runs it in a
child process (``run``, forked by a forkserver that has torch and ucl imported already) and kills it
with SIGKILL at a random moment. By hand:

    python tests/train_crash_child.py ROOT SEED      # prints `ready`, then `saved <i>` per save

The checkpoint of step ``i`` holds the state after ``i`` training iterations (``save(i)`` comes
before iteration ``i``), with ``extra={"i": i}``. After each ``save`` returns the child reports
``saved <i>`` so the parent can follow it. ``build``/``train_step``/``replay`` are shared with the
test, which replays the same seeded run without checkpointing.
"""
from __future__ import annotations

import os
import signal
import sys

import torch
from torch import nn

IN, HIDDEN, OUT, BATCH = 128, 512, 16, 8
KEEP = 3
TIER_SUFFIX = "-tier"  # run_killed_in(where="promote"): the further tier is ROOT-tier
MAX_STEPS = 100_000  # the parent kills the child long before this


def build(seed: int):
    """A small seeded MLP (~0.9 MB of float32 parameters; with Adam's two moments ~2.7 MB of state)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, 256), nn.ReLU(),
                          nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, OUT))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    return model, optimizer


def train_step(model, optimizer, seed: int, i: int) -> None:
    """Iteration ``i``: its batch depends only on (seed, i)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + i)
    x = torch.randn(BATCH, IN, generator=g)
    y = torch.randint(0, OUT, (BATCH,), generator=g)
    loss = nn.functional.cross_entropy(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def replay(seed: int, steps, threads: int = 1) -> dict[int, dict]:
    """The uninterrupted run without a checkpointer: {step: {"params": {...}, "optimizer": state_dict}}
    for each wanted step (state after ``step`` iterations), deep-copied."""
    import copy
    wanted = sorted(set(steps))
    old = torch.get_num_threads()
    torch.set_num_threads(threads)  # the child runs with the same thread count: same bits
    try:
        model, optimizer = build(seed)
        out = {}
        for i in range(wanted[-1] + 1 if wanted else 0):
            if i in wanted:
                out[i] = {"params": {k: v.detach().clone() for k, v in model.state_dict().items()},
                          "optimizer": copy.deepcopy(optimizer.state_dict())}
            train_step(model, optimizer, seed, i)
        return out
    finally:
        torch.set_num_threads(old)


def _train(root: str, seed: int, report, tiers=None) -> None:
    """Checkpoint before every iteration; ``report(line)`` after each ``save`` returned."""
    torch.set_num_threads(1)
    import ucl
    model, optimizer = build(seed)
    ck = ucl.Checkpointer(root, model, optimizer, keep=KEEP, persist_every=1, tiers=tiers)
    report("ready")
    for i in range(MAX_STEPS):
        ck.save(i, extra={"i": i})
        report(f"saved {i}")
        train_step(model, optimizer, seed, i)
    ck.close()


def _redirect(log: str) -> None:
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def run(root: str, seed: int, conn, log: str, tiers=None) -> None:
    """Entry point of a trial process forked by the test's forkserver: progress goes to ``conn``
    (one small ``send_bytes`` = one ``write``, so a kill cannot tear a message), stdout and stderr
    to the file ``log``."""
    _redirect(log)
    _train(root, seed, lambda line: conn.send_bytes(line.encode()), tiers)


KILL_STEP = 4  # the self-killing runs die while step 4 (the 5th checkpoint) is being published


def run_killed_in(root: str, seed: int, where: str, conn, log: str) -> None:
    """``run``, but the process SIGKILLs itself at a precise point of the flusher:

    * ``set_latest``: step KILL_STEP is committed, ``latest`` not yet touched;
    * ``replace_latest``: the new ``latest`` (naming step KILL_STEP) is written and fsynced under its
      temp name, not yet renamed over ``latest``;
    * ``prune``: the first pruned checkpoint (step 0, when step 3 is published) is renamed to its
      ``.tmp-del-`` name, not yet deleted;
    * ``promote``: with a directory tier ``ROOT-tier``, the promoter has copied one file of step
      KILL_STEP into the tier's hidden temp folder and starts on the next.
    """
    import shutil
    from ucl.store.root import CheckpointRoot

    def die():
        os.kill(os.getpid(), signal.SIGKILL)

    if where == "set_latest":
        real_set_latest = CheckpointRoot.set_latest

        def set_latest(self, name):
            if name == KILL_STEP:
                die()
            return real_set_latest(self, name)
        CheckpointRoot.set_latest = set_latest
    elif where == "replace_latest":
        real_replace = os.replace

        def replace(src, dst, *a, **k):
            if os.path.basename(dst) == "latest":
                with open(src) as f:
                    if f.read().strip() == f"step_{KILL_STEP:08d}":
                        die()
            return real_replace(src, dst, *a, **k)
        os.replace = replace
    elif where == "prune":
        real_rmtree = shutil.rmtree

        def rmtree(path, *a, **k):
            if ".tmp-del-" in os.path.basename(path):
                die()
            return real_rmtree(path, *a, **k)
        shutil.rmtree = rmtree
    elif where == "promote":
        real_copyfile = shutil.copyfile
        tier = os.path.abspath(root + TIER_SUFFIX)

        def copyfile(src, dst, *a, **k):
            folder = os.path.dirname(os.path.abspath(dst))
            if (os.path.dirname(folder) == tier and os.path.basename(folder).startswith(f".step_{KILL_STEP:08d}.tmp-")
                    and any(not n.startswith(".ucl-writer") for n in os.listdir(folder))):
                die()
            return real_copyfile(src, dst, *a, **k)
        shutil.copyfile = copyfile
        run(root, seed, conn, log, tiers=[root + TIER_SUFFIX])
        return
    else:
        raise ValueError(where)
    run(root, seed, conn, log)


if __name__ == "__main__":  # by hand, to reproduce a trial: progress on stdout
    _train(sys.argv[1], int(sys.argv[2]), lambda line: print(line, flush=True))
