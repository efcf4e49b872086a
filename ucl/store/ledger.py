"""What a checkpoint writer has put in each rank file: the manifest entries, their digest tables
queued for the file's ``ucl_tables``, the datasets laid out for other processes to fill, and which
files were made here or adopted. Pure bookkeeping: ``CheckpointWriter`` does the I/O around it."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from ..errors import StoreError
from .checksum import chunk_count, chunk_size, is_checksum
from .tiles import tile_grid
from .digests import Digests, checksum_fields
from .manifest import split_key


@dataclass(frozen=True)
class Filled:
    """A dataset another process filled in a laid-out rank file (``CheckpointWriter.fill``): what the
    writer that laid the file out needs to finish it (``adopt_filled``)."""

    rank: int
    key: str
    dtype: str
    shape: tuple[int, ...]
    digests: Digests


def entry_fields(dtype: str, shape: Sequence[int], digests: Digests, offset: int | None,
                 tables: int | None = None) -> dict[str, Any]:
    """A dataset's manifest entry (docs/format.md): dtype, shape, checksums, and where its bytes and
    digest tables are in the rank file, where known."""
    e = {"dtype": dtype, "shape": list(shape), **checksum_fields(digests)}
    if offset is not None:
        e["offset"] = offset
    if tables is not None:
        e["tables"] = tables
    return e


def known_digests(digests: Digests, shape: Sequence[int], sdtype: Any, key: str) -> Digests:
    """``digests`` handed to a writer for data it does not hash again (``write``, ``fill``,
    ``write_stream``): those of a source dataset of the same shape and storage type whose every byte
    the caller read and verified against them (a dataset copied whole; docs/format.md, "Digests
    carried over"). Their tables must be what the format's rules give for that shape (UCL409)."""
    shape, sdtype = tuple(int(x) for x in shape), np.dtype(sdtype)
    size = chunk_size(math.prod(shape) * sdtype.itemsize)
    grid = tile_grid(shape, sdtype.itemsize)
    chunks_ok = (digests.chunks is None) if size is None else (
        digests.chunks is not None and digests.chunks[0] == size and digests.chunks[1].shape == (chunk_count(
            math.prod(shape) * sdtype.itemsize),))
    tiles_ok = digests.tiles is None or (digests.tiles[0] == grid and digests.tiles[1].shape == (grid.count,))
    if not (is_checksum(digests.whole) and chunks_ok and tiles_ok):
        raise StoreError(f"checksums handed over for {key!r} do not fit a {sdtype} dataset of shape {list(shape)}",
                         code="UCL409")
    return digests


Laid = tuple[tuple[int, ...], str, "int | None"]  # a laid-out dataset: shape, dtype, byte offset


class Ledger:
    """The rank files of one writer, ``nranks`` of them: ``entries`` (per rank, key -> manifest
    entry), ``created`` (ranks whose file this writer made) and ``adopted`` (ranks another writer
    made, taken over whole). Not thread-safe: its owner calls it under its lock."""

    def __init__(self, nranks: int):
        self.nranks = nranks
        self.entries: list[dict[str, dict[str, Any]]] = [{} for _ in range(nranks)]
        self.created: set[int] = set()
        self.adopted: set[int] = set()
        self._laid: dict[int, dict[str, Laid]] = {}  # rank -> datasets laid out, not yet filled
        self._tables: list[list[np.ndarray]] = [[] for _ in range(nranks)]  # digest tables, per rank file
        self._table_at: list[dict[str, int]] = [{} for _ in range(nranks)]  # key -> its first value's index there
        self._table_len = [0] * nranks

    def claim(self, rank: int, key: str) -> tuple[str, str]:
        """(kind, name) of ``key``, a dataset new to rank ``rank`` (UCL408: no such rank; UCL411:
        written already, or the rank was adopted)."""
        kind, name = split_key(key)
        if not isinstance(rank, (int, np.integer)) or not 0 <= rank < self.nranks:
            raise StoreError(f"no rank {rank} ({self.nranks} ranks)", code="UCL408")
        if rank in self.adopted:
            raise StoreError(f"rank {rank} was adopted from another writer", code="UCL411")
        if key in self.entries[rank] or key in self._laid.get(rank, ()):
            raise StoreError(f"rank {rank} dataset {key!r} written twice", code="UCL411")
        return kind, name

    def record(self, rank: int, key: str, dtype: str, shape: Sequence[int], digests: Digests,
               offset: int | None, frames: np.ndarray | None = None) -> dict[str, Any]:
        """Record (and return) rank ``rank``'s manifest entry for ``key``; its digest tables (and a
        compressed dataset's ``frames`` table after them) are queued for the rank file's ``ucl_tables``."""
        e = entry_fields(dtype, shape, digests, offset)
        values = digests.table()
        if frames is not None:
            values = frames if values is None else np.concatenate([values, frames])
        if values is not None:
            self._table_at[rank][key] = self._table_len[rank]
            self._tables[rank].append(values)
            self._table_len[rank] += values.size
        self.entries[rank][key] = e
        return e

    def queued_tables(self, rank: int) -> np.ndarray | None:
        """Rank ``rank``'s digest tables queued for its ``ucl_tables``, concatenated (None: none)."""
        queued = self._tables[rank]
        return np.concatenate(queued) if queued else None

    def place_tables(self, rank: int, base: int) -> None:
        """Rank ``rank``'s ``ucl_tables`` was written at byte ``base`` of its file: each entry's
        ``tables`` becomes the byte offset of its own; the queue is emptied."""
        for key, at in self._table_at[rank].items():
            self.entries[rank][key]["tables"] = base + 8 * at
        self._tables[rank].clear()

    def lay(self, rank: int, specs: Mapping[str, tuple[tuple[int, ...], str]],
            allocate: Callable[[], Mapping[str, int | None]]) -> dict[str, int | None]:
        """Record rank ``rank``'s datasets ``specs`` (key -> (shape, dtype)) laid out at the byte offsets
        ``allocate`` returns (called once they are checked); returns every laid dataset's offset."""
        laid = self._laid.setdefault(rank, {})
        for key, (shape, _) in specs.items():
            if key in laid or any(x < 0 for x in shape):
                raise StoreError(f"cannot lay out rank {rank} dataset {key!r} of shape {list(shape)}",
                                 code="UCL411")
        for key, offset in allocate().items():
            laid[key] = (*specs[key], offset)
        return {key: offset for key, (_, _, offset) in laid.items()}

    def take_filled(self, p: Filled) -> Laid:
        """The layout of the dataset ``p`` filled, which it must match; it is laid out no longer."""
        laid = self._laid.get(p.rank, {}).get(p.key)
        if laid is None:
            raise StoreError(f"rank {p.rank} dataset {p.key!r} was not laid out by this writer, or was "
                             "filled twice", code="UCL411")
        shape, dtype, _ = laid
        if (p.shape, p.dtype) != (shape, dtype):
            raise StoreError(f"rank {p.rank} dataset {p.key!r} was laid out as {dtype} {list(shape)}, "
                             f"filled with {p.dtype} {list(p.shape)}", code="UCL409")
        del self._laid[p.rank][p.key]
        return laid

    def unfilled(self) -> dict[int, list[str]]:
        """Rank -> the keys laid out there and never filled."""
        return {r: sorted(laid) for r, laid in self._laid.items() if laid}
