"""The records every foreign format shares: what a reader knows about a folder (:class:`Description`)
and the placements a user supplies where a folder does not record them (:class:`UserSpec`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

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
