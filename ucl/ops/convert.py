"""Importing another framework's checkpoint: a reshard from the folder, read in place, into an
ordinary ucl checkpoint in the source's own layout (docs/interop.md)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Mapping

from ..errors import UclError
from ..lang.spec import load_spec, Spec
from ..memory import MemoryCap, memory_cap
from .prepare import mesh_of, open_checkpoint
from .reshard import reshard
from .stats import IOStats

if TYPE_CHECKING:
    from ..formats.base import UserSpec


def import_checkpoint(src: str | os.PathLike, dst: str | os.PathLike, *, format: str | None = None,
                      workers: int | None = None, durable: bool = True,
                      progress: Callable[[int], None] | None = None,
                      spec: str | Path | Spec | None = None, dims: Mapping[str, int] | None = None,
                      compress: str | None = None,
                      max_memory: int | str | MemoryCap | None = None) -> IOStats:
    """Write ucl checkpoint ``dst`` holding the DeepSpeed, DCP, Megatron or Hugging Face checkpoint
    ``src`` (``format`` detected when None) in the layout ``src`` was saved in, with the spec,
    parameters and non-tensor state its reader derived; ``dst`` appears atomically. ``reshard``,
    ``load_rank`` and ``verify`` then treat it like any ucl checkpoint (and they also read ``src``
    directly, without importing it). ``spec`` (text, a ``.ucl`` path or ``stdlib:NAME``) and its
    ``dims``: the parameter placements of a DeepSpeed tensor-parallel checkpoint whose files do not
    record them (mesh ``tp, dp``, a rule with a shape per parameter; the optimizer state's layout
    stays generated from the files). ``compress``: ``dst``'s encoding, as for ``reshard``.
    ``max_memory``: the host memory the import may add over all its processes (bytes, ``"2GB"``, a
    :class:`~ucl.memory.MemoryCap`; default 2 GB), passed on to ``reshard``, which reads the
    folder's tensors as byte ranges of its files (docs/memory.md)."""
    cap = memory_cap(max_memory)  # a bad size is UCL011 before the folder is read
    user = user_spec(spec, dims)
    with open_checkpoint(src, format, user) as ckpt:
        mesh, format = mesh_of(ckpt), getattr(ckpt, "format", "ucl")
    return reshard(src, dst, mesh, workers=workers, durable=durable, progress=progress, format=format, user=user,
                   compress=compress, max_memory=cap)


def user_spec(spec: str | Path | Spec | None, dims: Mapping[str, int] | None = None) -> UserSpec | None:
    """The parameter placements ``spec`` (with its ``dims``) gives a foreign folder whose files do
    not record them, as ``open_checkpoint`` and ``reshard`` take them; None when ``spec`` is None."""
    if spec is None:
        if dims:
            raise UclError("dims are given without a spec for the parameter placements", code="UCL009")
        return None
    from ..formats.base import UserSpec  # (a reshard of a ucl checkpoint imports no format code)
    s = load_spec(spec)
    return UserSpec(s.text, tuple((str(k), int(v)) for k, v in (dims or {}).items()), s.filename)
