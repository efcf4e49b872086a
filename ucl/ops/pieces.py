"""An export's tensors in the universal layout, each read in flat pieces of at most
``cap.piece_bytes()`` (docs/memory.md): the plan rows that fill a tensor become strided copies
(``plan.stream``), and a piece takes the parts of them that land in it, read straight from the
source's files (``read_runs``: byte ranges of a ucl rank file, a safetensors payload, a ``.distcp``
item or a torch zip storage, a ZeRO flat partition included). So a writer never holds a whole tensor
larger than its share of the cap; one piece buffer is reused from tensor to tensor."""
from __future__ import annotations

import math
import os
from typing import Iterator, Sequence

import numpy as np

from ..dtypes import storage_dtype
from ..errors import StoreError, UclError
from ..formats.base import Pieces, UserSpec
from ..layout.mesh import UNIVERSAL
from ..memory import MemoryCap, format_size
from ..plan.buffers import Arena
from ..plan.execute import rank_datasets, rank_rows, run_copies
from ..plan.ranksets import sorted_distinct
from ..plan.stream import StridedCopy, fill_parts, parts_in, strided_copies
from ..store.source import StoreSource
from .load import alias_keys
from .prepare import check_stored, mesh_of, model_of, open_checkpoint, plan_for
from .stats import IOStats


class UniversalReader:
    """Checkpoint ``path`` open for reading its universal tensors in pieces, in any order (a
    context manager): :meth:`pieces` of a key; every piece read shares one buffer."""

    def __init__(self, path: str | os.PathLike, cap: MemoryCap, *, verify: bool = True,
                 user: UserSpec | None = None):
        self.cap, self.verify = cap, verify
        self.ckpt = ckpt = open_checkpoint(path, user=user)
        try:
            model = model_of(ckpt)
            self.plan = plan = plan_for(model, mesh_of(ckpt), UNIVERSAL, ranks=[0])
            check_stored(ckpt, model, sorted_distinct(plan.copies["src_rank"]))
            self.rows = rank_rows(plan, 0)
            self.datasets = {d["key"]: d for d in rank_datasets(plan, 0)}
            self._model = model
        except BaseException:
            ckpt.close()
            raise
        self._by_key = _rows_by_key(plan, self.rows)
        self._piece, self._staging = Arena(), Arena()
        self.bytes_read = self.bytes_needed = 0

    def __enter__(self) -> "UniversalReader":
        return self

    def __exit__(self, *exc) -> None:
        self.ckpt.close()

    def aliases(self, keys: Sequence[str]) -> dict[str, str]:
        """Tied alias keys among ``keys`` -> the key they read; UCL408 for a key not held."""
        ties = alias_keys(self.ckpt, self._model, set(keys) - set(self.datasets), self.datasets)
        unknown = [k for k in keys if k not in self.datasets and k not in ties]
        if unknown:
            raise StoreError(f"the universal layout of {self.ckpt.path} holds no {unknown[0]!r}", code="UCL408")
        return ties

    def pieces(self, key: str, real: str | None = None) -> Pieces:
        """Universal dataset ``real`` (default ``key``) as :class:`Pieces` named ``key``."""
        real = key if real is None else real
        d, mine = self.datasets[real], self._by_key.get(real, self.rows[:0])
        shape, logical = tuple(int(x) for x in d["shape"]), d["dtype"]
        sdtype = storage_dtype(logical)
        step = max(1, self.cap.piece_bytes(sdtype.itemsize) // sdtype.itemsize)
        copies = strided_copies(self.plan, mine) if len(mine) else []
        if copies is None:  # a box laid out unlike on both sides (a view): assembled whole
            whole = self._whole(mine, real, shape, logical)
            return Pieces(key, shape, logical, step, lambda lo, hi: whole[lo:hi])
        self.bytes_needed += sum(c.count for c in copies) * sdtype.itemsize

        def read(lo: int, hi: int) -> np.ndarray:
            parts = list(parts_in(copies, lo, hi))
            out = self._piece.array((hi - lo,), sdtype, zero=sum(p.count for p in parts) < hi - lo)
            fill_parts(parts, lo, out, self._fill)
            return out
        return Pieces(key, shape, logical, step, read)

    def _fill(self, p: StridedCopy, dst: np.ndarray) -> None:
        into = dst.reshape(-1) if dst.flags.c_contiguous else self._staging.array((p.count,), dst.dtype)
        self.ckpt.read_runs(p.src_rank, p.src_key, p.src_runs(), out=into, verify=self.verify)
        self.bytes_read += self.ckpt.bytes_last_read
        if not dst.flags.c_contiguous:
            np.copyto(dst, into.reshape(p.sizes))

    def _whole(self, rows, key: str, shape: tuple[int, ...], logical: str) -> np.ndarray:
        """Tensor ``key`` assembled whole by the copy loop (flattened), refused (UCL011) over the cap."""
        nbytes = math.prod(shape) * storage_dtype(logical).itemsize
        if nbytes > self.cap.total // 2:
            raise UclError(f"{self.ckpt.path}: {key} ({format_size(nbytes)}) is stored in a layout ucl reads whole "
                           f"(a view of its dims), which needs more than the max_memory cap of {self.cap} allows; "
                           f"give max_memory of at least {format_size(2 * nbytes)}", code="UCL011")
        arr = np.zeros(shape, dtype=storage_dtype(logical))
        source = StoreSource(self.ckpt, Arena(), verify=self.verify)
        run_copies(self.plan, rows, source, {key: arr})
        self.bytes_read += source.bytes_read
        self.bytes_needed += arr.nbytes
        return arr.reshape(-1)


def universal_pieces(path: str | os.PathLike, keys: Sequence[str], cap: MemoryCap, *, verify: bool = True,
                     stats: IOStats | None = None, user: UserSpec | None = None) -> Iterator[tuple[str, Pieces]]:
    """``(key, Pieces)`` of each of ``keys`` (universal dataset keys, tied aliases too) of
    checkpoint ``path``, in that order; each is read only while it is the current one."""
    with UniversalReader(path, cap, verify=verify, user=user) as reader:
        ties = reader.aliases(keys)
        for key in keys:
            yield key, reader.pieces(key, ties.get(key, key))
        if stats is not None:
            stats.bytes_read += reader.bytes_read
            stats.bytes_needed += reader.bytes_needed


def _rows_by_key(plan, rows: np.ndarray) -> dict[str, np.ndarray]:
    """Target dataset key -> the ``rows`` that write it, in plan order."""
    slot_keys = np.array([sl.key for sl in plan.slots], dtype=object)
    out: dict[str, list[int]] = {}
    for row, key in zip(rows.tolist(), slot_keys[plan.copies["dst_slot"][rows]].tolist()):
        out.setdefault(key, []).append(row)
    return {k: np.asarray(v, dtype=np.int64) for k, v in out.items()}
