"""The records every foreign format shares: what a reader knows about a folder (:class:`Description`),
the placements a user supplies where a folder does not record them (:class:`UserSpec`), and on the
writing side what an export writes (:class:`ExportSource`), what a writer wrote (:class:`Written`)
the check of an export's target folder (:func:`check_target`), and one exported tensor read in
bounded flat pieces (:class:`Pieces`), how writers take their tensors under a ``max_memory`` cap."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping

import numpy as np

from ..errors import ForeignFormatError
from ..store.extents import NO_CHECKSUM, Extent
from ..store.manifest import Manifest


@dataclass(frozen=True)
class Description:
    """What a format's reader knows about a foreign checkpoint (see the module doc)."""
    format: str
    spec: str
    spec_name: str | None
    dims: Mapping[str, int]
    mesh: tuple[tuple[str, int], ...]
    params: Mapping[str, tuple[int, ...]]
    frozen: tuple[str, ...]
    extents: tuple[Mapping[str, Extent], ...]  # per rank: dataset key -> where its bytes are
    files: tuple[str, ...] = ()  # per rank: the file that names it in messages
    state: Any = field(default_factory=dict)
    read: tuple[str, ...] = ()  # files the description was made from (relative), for the cache

    def manifest(self) -> Manifest:
        datasets = [{k: {"dtype": e.dtype, "shape": list(e.shape), "checksum": NO_CHECKSUM} for k, e in table.items()}
                    for table in self.extents]
        files = list(self.files) or [f"{self.format}:{r}" for r in range(len(self.extents))]
        # version 1: the extents name every rank's copy of a replicated tensor, as the framework wrote them
        return Manifest(version=1, dims=dict(self.dims), mesh=[(a, int(s)) for a, s in self.mesh], files=files,
                        datasets=datasets, spec=self.spec, spec_name=self.spec_name,
                        params={n: list(s) for n, s in self.params.items()}, frozen=sorted(self.frozen),
                        state=self.state)


@dataclass(frozen=True)
class UserSpec:
    """Parameter placements a user supplies for a checkpoint whose files do not record them
    (``ucl import --spec SPEC --dims DIMS``): spec text declaring the mesh and the parameters'
    rules, and its dims. The reader still generates everything its files do say (the optimizer
    state's layout)."""
    text: str
    dims: tuple[tuple[str, int], ...] = ()
    filename: str = "<spec>"


@dataclass(frozen=True)
class ExportSource:
    """What an export needs to know about a checkpoint, from its manifest alone (no tensor read;
    ``ucl.ops.export.survey`` makes it)."""

    path: str
    datasets: dict[str, tuple[tuple[int, ...], str]]  # universal key -> (shape, logical dtype)
    trainable: tuple[str, ...]  # parameters with optimizer state, in the checkpoint's order
    frozen: tuple[str, ...]  # frozen parameters and persistent buffers
    master: dict[str, str]  # trainable name -> key of its fp32 master ("fp32/N", else "param/N")
    moments: dict[str, tuple[str, ...]]  # trainable name -> its optimizer-state keys but step
    aliases: dict[str, str]  # tied alias -> the parameter it shares storage with
    hyperparameters: tuple[dict, ...]  # per optimizer param group, without "params"
    groups: tuple[tuple[str, ...], ...] | None  # trainable names per group, None when unknown
    state: dict = field(default_factory=dict)  # the manifest's non-tensor state
    user: "UserSpec | None" = None  # placements a foreign folder does not record (reads pass them on)

    def step_key(self, name: str) -> str | None:
        key = f"step/{name}"
        return key if key in self.datasets else None

    def training_keys(self) -> list[str]:
        """What a resumable export reads: masters of the trainable parameters, the frozen ones,
        then the optimizer state and the steps."""
        keys = [self.master[n] for n in self.trainable] + [f"param/{n}" for n in self.frozen]
        keys += [k for n in self.trainable for k in self.moments[n]]
        return keys + [k for n in self.trainable if (k := self.step_key(n)) is not None]


@dataclass(frozen=True)
class Pieces:
    """One tensor of an export, read in flat pieces so that a writer holds at most ``step``
    elements of it at a time: ``read(lo, hi)`` gives elements ``[lo, hi)`` of its row-major
    flattening in storage form (bf16 as uint16 bits), valid until the next read."""

    key: str
    shape: tuple[int, ...]
    dtype: str  # logical
    step: int  # elements per piece, at least 1
    read: Callable[[int, int], np.ndarray]

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def __iter__(self) -> Iterator[tuple[int, np.ndarray]]:
        """``(first element, piece)`` in order, each piece at most ``step`` elements."""
        for lo in range(0, self.size, self.step):
            yield lo, self.read(lo, min(lo + self.step, self.size))

    def whole(self) -> np.ndarray:
        """The tensor in one array of its shape (for what a format cannot take in pieces), valid
        until the next read."""
        return self.read(0, self.size).reshape(self.shape)


@dataclass(frozen=True)
class Written:
    """What a writer wrote: bytes, tensors, and what the export's statistics report about it."""
    bytes: int
    tensors: int
    details: Mapping[str, Any] = field(default_factory=dict)


def check_target(out: str | os.PathLike) -> str:
    """``out`` as an absolute path, refused (UCL503) when something is there already."""
    out = os.path.abspath(os.fspath(out))
    if os.path.lexists(out):
        raise ForeignFormatError(f"cannot export to {out}: it exists (exports never overwrite; remove it or pick "
                                 "another name)", code="UCL503")
    return out
