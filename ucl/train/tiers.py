"""Further directory tiers: a committed checkpoint copied elsewhere, atomically, with its own
``latest`` and retention."""
from __future__ import annotations

import os
import shutil

from ..store.atomic import fsync_path, publish_dir, tmp_name
from ..store.root import CheckpointRoot


def promote(path: str, tier: CheckpointRoot, step: int, keep: int) -> None:
    """Copy a committed checkpoint to another directory tier, atomically, then move its ``latest``."""
    os.makedirs(tier.root, exist_ok=True)
    final = tier.path_for(step)
    if os.path.exists(final):
        return
    tmp = os.path.join(tier.root, tmp_name(os.path.basename(final)))
    shutil.copytree(path, tmp)
    for name in os.listdir(tmp):
        fsync_path(os.path.join(tmp, name))
    publish_dir(tmp, final)
    tier.set_latest(step)
    tier.prune(keep)
