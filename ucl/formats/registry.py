"""Checkpoints other frameworks wrote, opened as ucl checkpoints (read in place).

A format's reader describes a folder as a :class:`Description`: the spec (generated, or a stdlib
spec), dims, the mesh read from the framework's own metadata, the parameter list, and for every
rank the datasets it holds as byte :class:`~ucl.store.extents.Extent`\\ s in the framework's files.
It never slices a tensor itself: the compiler checks the description against the spec's lowering
(``check_stored``) and the copy loop reads the bytes. :func:`open_foreign` turns a description into
an :class:`~ucl.store.extents.ExtentCheckpoint`; descriptions are cached by the identity of the
files they were read from, so repeated ``load_rank`` calls parse a framework's metadata once.
"""
from __future__ import annotations

import os
from collections import OrderedDict
from typing import Callable

from ..errors import ForeignFormatError, StoreError
from ..store.extents import ExtentCheckpoint
from .base import Description, UserSpec

FORMATS = ("deepspeed", "dcp", "megatron", "megatron-legacy", "hf")
_CACHE: OrderedDict[tuple, tuple[tuple, "Description"]] = OrderedDict()
_MAX_CACHED = 8


def _describers() -> dict[str, tuple[Callable[[str], bool], Callable[[str], Description]]]:
    # imported when a foreign folder is met, not by every reshard of a ucl checkpoint (~50 ms of start-up)
    from . import deepspeed
    from .dcp import read as dcp
    from .hf import read as hf
    from .megatron import dist as megatron, legacy as megatron_legacy
    # Megatron's torch_dist folders are DCP folders too: asked first
    return {"deepspeed": (deepspeed.detect, deepspeed.describe), "megatron": (megatron.detect, megatron.describe),
            "megatron-legacy": (megatron_legacy.detect, megatron_legacy.describe),
            "dcp": (dcp.detect, dcp.describe), "hf": (hf.detect, hf.describe)}


def detect_format(path: str) -> str | None:
    """The framework that wrote the checkpoint folder ``path``, or None. Megatron's torch_dist
    folders are DCP folders with Megatron's metadata, so Megatron is asked first."""
    for name, (detect, _) in _describers().items():
        if detect(path):
            return name
    return None


def describe(path: str | os.PathLike, format: str | None = None, user: UserSpec | None = None) -> Description:
    """The :class:`Description` of a foreign checkpoint folder (format detected when None);
    ``user``: placements the files do not record (DeepSpeed tensor-parallel checkpoints only; an
    operation that reopens the folder, a reshard's workers, carries it in its task)."""
    path = os.path.abspath(os.fspath(path))
    if not os.path.isdir(path):
        raise StoreError(f"checkpoint {path} {'is not a folder' if os.path.lexists(path) else 'does not exist'}",
                         code="UCL404")
    describers = _describers()
    if format is None:
        format = detect_format(path)
        if format is None:
            raise StoreError(f"{path} is not a checkpoint ucl recognises: no manifest.json, and not a DeepSpeed "
                             "(latest, *_model_states.pt), DCP (.metadata), Megatron or Hugging Face "
                             "(config.json + *.safetensors) folder", code="UCL501")
    elif format not in describers:
        raise StoreError(f"unknown checkpoint format {format!r}; formats: ucl, {', '.join(FORMATS)}", code="UCL501")
    elif not describers[format][0](path):
        raise StoreError(f"{path} is not a {format} checkpoint folder", code="UCL501")
    if user is not None and format not in ("deepspeed", "hf"):
        raise ForeignFormatError(f"{path}: a spec for the parameter placements is read for DeepSpeed tensor-parallel "
                         f"checkpoints and Hugging Face folders only, not {format}", code="UCL502")
    key = (path, format, user)
    hit = _CACHE.get(key)
    if hit is not None and hit[0] == _identity(path, hit[1].read):
        _CACHE.move_to_end(key)
        return hit[1]
    try:
        desc = describers[format][1](path) if user is None else describers[format][1](path, user)
    except (ValueError, TypeError, KeyError, IndexError, AttributeError, RecursionError, OverflowError) as e:
        # a file that says something no reader expects: named, never a traceback
        raise ForeignFormatError(f"{path} is not a {format} checkpoint ucl can read: its metadata is malformed "
                         f"({type(e).__name__}: {str(e)[:200]})", code="UCL502") from None
    _CACHE[key] = (_identity(path, desc.read), desc)
    while len(_CACHE) > _MAX_CACHED:
        _CACHE.popitem(last=False)
    return desc


def open_foreign(path: str | os.PathLike, format: str | None = None,
                 user: UserSpec | None = None) -> ExtentCheckpoint:
    """A foreign checkpoint folder opened for reading in place (``user``: see :func:`describe`)."""
    desc = describe(path, format, user)
    return ExtentCheckpoint(os.path.abspath(os.fspath(path)), desc.manifest(), desc.extents, desc.format)


def _identity(path: str, files: tuple[str, ...]) -> tuple:
    out = []
    for rel in files:
        try:
            st = os.stat(os.path.join(path, rel))
            out.append((rel, st.st_ino, st.st_size, st.st_mtime_ns))
        except OSError:
            out.append((rel, None))
    return tuple(out)


def forget() -> None:
    """Drop every cached description."""
    _CACHE.clear()
