"""Random number generator states as JSON (never pickle): torch (CPU and CUDA), numpy, Python."""
from __future__ import annotations

import random
import warnings
from typing import Any

import numpy as np

from ..errors import caller_stacklevel


def capture() -> dict:
    import torch
    np_state = np.random.get_state()
    py_state = random.getstate()
    out = {"torch": torch.get_rng_state().tolist(),
           "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
           "python": [py_state[0], list(py_state[1]), py_state[2]]}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return out


def restore(saved: Any, process_rank: int, world: int) -> None:
    """Restore this process's generators when the checkpoint has them (same world size). When it was
    written by another number of processes the generators keep their current state, and process
    rank 0 alone warns, once, at the user's ``load()`` line (not every rank, not inside ucl)."""
    if not saved:
        return
    mine = saved.get(str(process_rank))
    if len(saved) != world:
        if process_rank == 0:
            warnings.warn(f"the checkpoint holds RNG states of {len(saved)} processes, this job has {world}: "
                          "random generators are not restored on any process", stacklevel=caller_stacklevel())
        return
    if mine is None:  # as many states as processes, but not this one's: a damaged manifest
        warnings.warn(f"the checkpoint holds no RNG state of process {process_rank}: its random generators "
                      "are not restored", stacklevel=caller_stacklevel())
        return
    restore_own(mine)


def restore_own(mine: dict) -> None:
    """Restore this process's generators from its own captured state."""
    import torch
    torch.set_rng_state(torch.tensor(mine["torch"], dtype=torch.uint8))
    s = mine["numpy"]
    np.random.set_state((s[0], np.asarray(s[1], dtype=np.uint32), s[2], s[3], s[4]))
    p = mine["python"]
    random.setstate((p[0], tuple(p[1]), p[2]))
    if "cuda" in mine and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(x, dtype=torch.uint8) for x in mine["cuda"]])
