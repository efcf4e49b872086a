"""Importing another framework's checkpoint: a reshard from the folder, read in place, into an
ordinary ucl checkpoint in the source's own layout (docs/interop.md)."""
from __future__ import annotations

import os
from typing import Callable

from .prepare import mesh_of, open_checkpoint
from .reshard import reshard
from .stats import IOStats


def import_checkpoint(src: str | os.PathLike, dst: str | os.PathLike, *, format: str | None = None,
                      workers: int | None = None, durable: bool = True,
                      progress: Callable[[int], None] | None = None) -> IOStats:
    """Write ucl checkpoint ``dst`` holding the DeepSpeed, DCP, Megatron or Hugging Face checkpoint
    ``src`` (``format`` detected when None) in the layout ``src`` was saved in, with the spec,
    parameters and non-tensor state its reader derived; ``dst`` appears atomically. ``reshard``,
    ``load_rank`` and ``verify`` then treat it like any ucl checkpoint (and they also read ``src``
    directly, without importing it)."""
    with open_checkpoint(src, format) as ckpt:
        mesh, format = mesh_of(ckpt), getattr(ckpt, "format", "ucl")
    return reshard(src, dst, mesh, workers=workers, durable=durable, progress=progress, format=format)
