"""Which run wrote a checkpoint, and which steps later runs abandoned: a node that rejoins with
steps of an abandoned run (the job went back to an older step and saved again while it was away)
must never serve them.

Every checkpoint's state carries ``lineage``: the runs of its history, oldest first, each as
``[run id, the step it resumed from]`` (None: it went on from the newest step). A run is one stretch
of saves: a ``Checkpointer``'s first ``save``, and every ``save`` after a ``load``, start one. Copies
of one history have lineages that are prefixes of one another; the longest one seen says which
steps each earlier run wrote that a later run abandoned: those after the step a later run resumed
from."""
from __future__ import annotations

import time
import uuid
from typing import Any


def new_run() -> str:
    """A run id that sorts by its start time (process rank 0's clock), then a random part."""
    return f"{time.time_ns():016x}-{uuid.uuid4().hex[:8]}"


def of_state(state: Any) -> list:
    """A checkpoint state's lineage (empty: written before lineages, or by ``ucl.save``)."""
    lineage = state.get("lineage") if isinstance(state, dict) else None
    ok = isinstance(lineage, list) and all(isinstance(e, list) and len(e) == 2 and isinstance(e[0], str)
                                           and (e[1] is None or isinstance(e[1], int)) for e in lineage)
    return lineage if ok else []


def authority(lineages: list[list]) -> list:
    """The newest history: the lineage whose last run started last (it decided last what counts)."""
    return max((lin for lin in lineages if lin), key=lambda lin: (lin[-1][0], len(lin)), default=[])


def abandoned(step: int, lineage: list, newest: list) -> bool:
    """Whether a copy of ``step`` with ``lineage`` belongs to a run that a later run of ``newest``
    abandoned (resumed from an older step), or to a history ``newest`` does not continue."""
    if not lineage or not newest:
        return False
    if newest[:len(lineage)] != lineage:
        return True  # another branch: a run the newest history does not descend from
    return any(resumed is not None and resumed < step for _, resumed in newest[len(lineage):])
