"""A seeded training loop that checkpoints every iteration; tests/test_train_crash.py runs it as a
child process and kills it with SIGKILL at a random moment.

    python tests/train_crash_child.py ROOT SEED

The checkpoint of step ``i`` holds the state after ``i`` training iterations (``save(i)`` comes
before iteration ``i``), with ``extra={"i": i}``. After each ``save`` returns the child prints
``saved <i>`` (flushed) so the parent can follow it. ``build``/``train_step``/``replay`` are shared
with the test, which replays the same seeded run without checkpointing.
"""
from __future__ import annotations

import sys

import torch
from torch import nn

IN, HIDDEN, OUT, BATCH = 128, 512, 16, 8
KEEP = 3
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


def main(root: str, seed: int) -> None:
    torch.set_num_threads(1)
    import ucl
    model, optimizer = build(seed)
    ck = ucl.Checkpointer(root, model, optimizer, keep=KEEP, persist_every=1)
    print("ready", flush=True)
    for i in range(MAX_STEPS):
        ck.save(i, extra={"i": i})
        print(f"saved {i}", flush=True)
        train_step(model, optimizer, seed, i)
    ck.close()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
