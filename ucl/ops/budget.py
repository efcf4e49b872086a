"""How the offline operations spend a ``max_memory`` cap (docs/memory.md): how many worker processes
a reshard starts, and what each one's buffers may hold at once; how large a piece a load reads
through memory of its own. ``ucl.memory`` owns the cap itself (sizes, the default, UCL011)."""
from __future__ import annotations

import ctypes
import sys
from dataclasses import dataclass
from typing import Any, Sequence

from ..errors import UclError
from ..memory import MemoryCap, format_size
from ..plan.ir import Plan
from . import streamed

# What a process adds before it holds any data, measured with tests/capped_child.py on a 2-core VM:
# a forked worker writes to pages it shares with its parent (reference counts, the allocator's
# headers) and opens its own HDF5 files, 12-20 MiB; the operation's own process holds the plan, the
# manifest and its open files, a few MiB.
FORK_BYTES = 20 << 20
OWN_BYTES = 8 << 20
MIN_WORKER_BYTES = 64 << 20  # a worker is started only with a share of at least this (its fork costs FORK_BYTES)
MIN_BLOCK_BYTES = 64 << 10
MAX_PIECE_BYTES = 32 << 20  # a bounce read this long makes its per-call costs negligible
MAX_LOAD_BLOCK_BYTES = 64 << 20
MAX_CACHE_BYTES = 64 << 20  # the reader's cache of verified chunks, at most (its size before caps)
ALIGN = 4096  # blocks and pieces are whole pages: a direct (O_DIRECT) write of them needs no bounce copy


def _pages(n: int, floor: int) -> int:
    return max(floor, n // ALIGN * ALIGN)


@dataclass(frozen=True)
class Budget:
    """What one process's buffers may hold at once, ``total``, and how it is spent: ``block``
    (a streamed target block; 4 are held: the one filled, 2 still being written, 1 of staging),
    ``piece`` (a bounce read of a box, and the reader's scratch for the checksum chunks around it),
    ``cache`` (verified chunks kept for neighbouring reads) and ``whole`` (the largest dataset
    assembled whole: the one in flight to the disk and the next one are held together)."""

    total: int
    block: int
    piece: int
    cache: int
    whole: int

    @property
    def stream_block(self) -> int:
        """A block of a load streamed into a caller's tensors: it holds one and its staging, and no
        whole dataset (64 MiB at most: larger blocks copy no faster)."""
        return _pages(min(MAX_LOAD_BLOCK_BYTES, self.total // 4), MIN_BLOCK_BYTES)

    @classmethod
    def of(cls, nbytes: int, block: int) -> "Budget":
        """The budget of ``nbytes`` with streamed blocks of at most ``block`` bytes."""
        nbytes = max(0, nbytes)
        block = _pages(min(block, nbytes // 16), MIN_BLOCK_BYTES)
        piece = _pages(min(MAX_PIECE_BYTES, nbytes // 16), MIN_BLOCK_BYTES)
        cache = min(MAX_CACHE_BYTES, nbytes // 8)
        whole = max(0, (nbytes - 4 * block - 2 * piece - cache) // 2)
        return cls(nbytes, block, piece, cache, whole)


def worker_count(cap: MemoryCap, wanted: int) -> int:
    """At most ``wanted`` workers, fewer where a share of ``cap`` would be under MIN_WORKER_BYTES
    (one always: it runs in the operation's own process, without a fork)."""
    return max(1, min(wanted, cap.total // MIN_WORKER_BYTES))


def worker_budget(cap: MemoryCap, workers: int, block: int, forked: bool | None = None) -> Budget:
    """One of ``workers`` processes' budget: its share of ``cap`` less what a process costs before
    it holds data (a forked one's pages, and the parent's own state, shared out). ``forked``:
    whether the work runs in forked processes (default: when there are several)."""
    if not (workers > 1 if forked is None else forked):
        return Budget.of(cap.total - OWN_BYTES, block)
    return Budget.of(cap.split(workers).total - FORK_BYTES - OWN_BYTES // workers, block)


def load_budget(cap: MemoryCap) -> Budget:
    """The budget of a load in the caller's process (``load_rank``, ``iter_rank``): the cap less
    what the load's own state (plan, manifest, open files) takes; it streams no blocks."""
    return Budget.of(cap.total - OWN_BYTES, MIN_BLOCK_BYTES)


def budgeted(groups: Sequence[Any], plan: Plan, cap: MemoryCap, workers: int, *, compress: bool, durable: bool,
             forked: bool = False) -> tuple[int, Budget]:
    """A reshard's workers (at most ``workers``) and each one's budget under ``cap``, for the target
    datasets ``groups`` (``shares.ReplicaGroup``: ``key``, ``nbytes``, the plan ``rows`` filling it):
    fewer workers where a share would be small (``worker_count``) or where a dataset that must be
    assembled whole (a compressed target's, or one the streamed path cannot take) would not fit
    one share; UCL011 when it fits none, before anything is written. ``forked``: workers are forked
    even when there is one (a distributed reshard). Larger datasets are streamed."""
    workers = worker_count(cap, workers)
    # durable writes go around the page cache (store.direct): larger blocks keep the device busy
    block = streamed.DURABLE_BLOCK_BYTES if durable else streamed.STREAM_BLOCK_BYTES
    least = worker_budget(cap, workers, block, forked=forked or workers > 1).whole
    whole = [g for g in groups if compress or (g.nbytes > least and not streamed.streamable(plan, g.rows))]
    # a coded dataset is held with its coded bytes too (at most its size again, half of it in flight)
    need = max((g.nbytes * 3 // 2 if compress else g.nbytes for g in whole), default=0)
    for w in range(workers, 0, -1):
        budget = worker_budget(cap, w, block, forked=forked or w > 1)
        if need <= budget.whole:
            return w, budget
    g = max(whole, key=lambda g: g.nbytes)
    why = "a compressed target's datasets are coded whole" if compress else "its copies cannot be streamed"
    raise UclError(too_big(f"target dataset {g.key!r} ({g.nbytes:,} B)", 2 * need, cap, why), code="UCL011")


def too_big(what: str, need: int, cap: MemoryCap, hint: str) -> str:
    """The message of a UCL011 for an operation that cannot stay under ``cap``."""
    return f"max_memory {cap} is too small: {what} needs about {format_size(need)} at once ({hint})"


_LIBC: list = []


def give_back_freed() -> None:
    """Hand the heap memory freed so far back to the OS (glibc ``malloc_trim``; elsewhere nothing).
    Why: glibc raises its mmap threshold after a large array is freed (up to 32 MiB), so the next
    arrays come from the heap, and freed heap pages stay counted in the process's memory: a load
    that dropped a 22 MiB array kept 26 MiB it no longer used."""
    if not _LIBC:
        try:
            _LIBC.append(ctypes.CDLL(None).malloc_trim if sys.platform.startswith("linux") else None)
        except (OSError, AttributeError):
            _LIBC.append(None)
    if _LIBC[0] is not None:
        _LIBC[0](0)
