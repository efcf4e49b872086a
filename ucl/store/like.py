"""``CheckpointLike``: what a checkpoint opened for reading answers, whether a ucl checkpoint
(``reader.Checkpoint``, HDF5 rank files) or another framework's folder read in place
(``extents.ExtentCheckpoint``). Everything above ``store`` (``ops.prepare``, ``StoreSource``, the
loaders and exports) is written against this protocol; ``tests/test_store_protocol.py`` checks
that both classes keep its exact signatures. :class:`ManifestBacked` is the part every such class
answers from its manifest alone, written once."""
from __future__ import annotations

from typing import Any, Protocol, Sequence, runtime_checkable

import numpy as np

from .manifest import DatasetInfo, Manifest


@runtime_checkable
class CheckpointLike(Protocol):
    """A checkpoint's manifest and its datasets, per rank, by key (``"param/w"``)."""

    path: str
    manifest: Manifest
    bytes_last_read: int  # bytes the last ``read_runs`` took from disk (verified reads round out)

    @property
    def nranks(self) -> int: ...

    @property
    def state(self) -> Any: ...

    def __enter__(self) -> "CheckpointLike": ...

    def __exit__(self, *exc: Any) -> None: ...

    def close(self) -> None: ...

    def keys(self, rank: int) -> list[str]:
        """The dataset keys rank ``rank`` holds, sorted."""

    def info(self, rank: int, key: str) -> DatasetInfo:
        """Dtype, shape and checksum of one dataset, from the manifest."""

    def check_files(self, ranks: Sequence[int]) -> None:
        """StoreError unless the files of ``ranks`` are there (before anything is read)."""

    def verify(self, ranks: Sequence[int] | None = None) -> list[str]:
        """Every dataset (of ``ranks``) read and checked against its checksum: the problems."""

    def read(self, rank: int, key: str, *, verify: bool = True, out: np.ndarray | None = None) -> np.ndarray:
        """A whole dataset (storage dtype), into ``out`` when given."""

    def to_torch(self, rank: int, key: str, *, verify: bool = True) -> Any:
        """A whole dataset as a torch tensor of its logical dtype."""

    def read_flat(self, rank: int, key: str, start: int, stop: int, *, out: np.ndarray | None = None) -> np.ndarray:
        """Elements ``start:stop`` of the row-major flattened dataset."""

    def read_box(self, rank: int, key: str, starts: Sequence[int], sizes: Sequence[int], *,
                 out: np.ndarray | None = None) -> np.ndarray:
        """The box ``starts:starts+sizes`` of the dataset."""

    def read_runs(self, rank: int, key: str, runs: Sequence[tuple[int, int, int, int]], *,
                  out: np.ndarray | None = None, verify: bool = False) -> np.ndarray:
        """Strided runs ``(start, count, stride, block)`` of the flattened dataset, concatenated."""


class ManifestBacked:
    """``nranks``, ``state`` and the context manager, for a checkpoint class with a ``manifest`` and a ``close``."""

    manifest: Manifest

    @property
    def nranks(self) -> int:
        return self.manifest.nranks

    @property
    def state(self) -> Any:
        return self.manifest.state

    def __enter__(self):
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        pass
