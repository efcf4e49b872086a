"""The reshard's streamed path: one target dataset written block by block (plan.stream), each part
of a block read from the source into memory of our own and verified there, each block hashed and
written while in cache (CheckpointWriter.write_stream); memory stays at a few blocks."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator, Mapping, Sequence

import numpy as np

from ..dtypes import storage_dtype
from ..plan.buffers import Arena, ArenaRing
from ..plan.ir import Plan
from ..plan.stream import StridedCopy, fill_block, fill_parts, parts_in, strided_copies
from ..store.digests import Digests
from ..store.like import CheckpointLike
from ..store.reader import Checkpoint
from ..store.behind import STREAM_DEPTH
from ..store.writer import CheckpointWriter

STREAM_BLOCK_BYTES = 2 << 20  # a streamed dataset passes in blocks of this size: hashed and written from cache
MIN_STREAM_BYTES = 1 << 20  # smaller datasets are assembled whole (a block or less either way)
DURABLE_BLOCK_BYTES = 16 << 20  # a durable reshard streams only datasets too large to hold whole, in these


@dataclass(frozen=True)
class Streamed:
    """What streaming one dataset read: bytes taken from the source (verified reads round out to
    checksum chunks or tiles) and bytes the plan needed."""

    bytes_read: int
    bytes_needed: int


def block_ring() -> ArenaRing:
    """Block buffers for ``stream_dataset``: write_stream may still be writing the last few."""
    return ArenaRing(STREAM_DEPTH + 1)


def streamable(plan: Plan, rows) -> bool:
    """Whether ``stream_dataset`` can stream the target dataset plan ``rows`` fill (with ``force``)."""
    return len(rows) == 0 or strided_copies(plan, rows) is not None


def stream_dataset(plan: Plan, rows, key: str, shape: tuple[int, ...], dtype: str, targets: Mapping[int, int | None],
                   ckpt: CheckpointLike, writer: CheckpointWriter, blocks: ArenaRing, *, verify: bool, durable: bool,
                   block_bytes: int = STREAM_BLOCK_BYTES, force: bool = False, tiles: bool = True) -> Streamed | None:
    """Write dataset ``key`` (filled by plan ``rows``) into the files of ``targets`` (as
    ``write_stream``) block by block: each part of a block is read with ``Checkpoint.read_runs``
    (straight into the block where it lands contiguously), every checksum chunk or tile it touches
    verified there, so the bytes hashed and written are the bytes checked. None (nothing done) for a
    small or empty dataset, a source that is not a ucl checkpoint with byte offsets (a foreign
    format), or a ``durable`` reshard: the caller then assembles the dataset whole. Why not durable:
    its writes go around the page cache (store.direct), and a whole dataset in flight kept the
    device busier than queued blocks (same run, 2-core VM: universal 1.59 s whole vs 1.82 s streamed,
    TP4 1.50 vs 1.60); through the page cache, streaming is the faster. ``force``: stream a durable
    reshard's dataset, or a foreign source's, all the same (one larger than the memory a worker may
    spend on it whole, docs/memory.md), in blocks of ``block_bytes``. ``tiles=False``: the target gets
    no tile digests of its own (``write_stream``)."""
    sdtype = storage_dtype(dtype)
    total = int(np.prod(shape, dtype=np.int64))
    if (durable and not force) or total * sdtype.itemsize < MIN_STREAM_BYTES or not total:
        return None
    if not force and not isinstance(ckpt, Checkpoint):
        return None
    copies = strided_copies(plan, rows)
    if copies is None or (not force and any(ckpt.info(cp.src_rank, cp.src_key).offset is None for cp in copies)):
        return None
    known = carried_digests(copies, shape, dtype, ckpt) if verify else None
    read = [0]
    pieces = (b for _, b in target_blocks(copies, total, sdtype, ckpt, blocks, verify=verify,
                                          block_bytes=block_bytes, read=read))
    writer.write_stream(targets, key, shape, dtype, pieces, digests=known, tiles=tiles)
    return Streamed(read[0], sum(cp.count for cp in copies) * sdtype.itemsize)


def target_blocks(copies: Sequence[StridedCopy], total: int, sdtype: np.dtype, ckpt: CheckpointLike,
                  blocks: ArenaRing, *, verify: bool, block_bytes: int, read: list[int]) -> Iterator[tuple[int, np.ndarray]]:
    """The target dataset ``copies`` (``strided_copies``) fill, ``total`` elements of ``sdtype``, as
    ``(first element, block)`` in flat order, blocks of ``block_bytes`` from ``blocks``: each part of
    a block read with ``read_runs`` (straight into the block where it lands contiguously, verified
    there with ``verify``), elements no copy writes zeroed. ``read[0]`` counts the bytes read."""
    covered = sum(cp.count for cp in copies)
    step = max(1, block_bytes // sdtype.itemsize)
    staging = Arena()

    def fill(p: StridedCopy, dst: np.ndarray) -> None:
        into = dst.reshape(-1) if dst.flags.c_contiguous else staging.array((p.count,), sdtype)
        ckpt.read_runs(p.src_rank, p.src_key, p.src_runs(), out=into, verify=verify)
        read[0] += ckpt.bytes_last_read
        if not dst.flags.c_contiguous:
            np.copyto(dst, into.reshape(p.sizes))

    for lo in range(0, total, step):
        n = min(step, total - lo)
        parts = list(parts_in(copies, lo, lo + n)) if covered < total else None
        # only a block with elements no copy writes (padding, a gap between flat partitions) is zeroed
        out = blocks.array((n,), sdtype, zero=parts is not None and sum(p.count for p in parts) < n)
        if parts is None:
            fill_block(copies, lo, out, fill)
        else:
            fill_parts(parts, lo, out, fill)
        yield lo, out


def zero_gaps(plan: Plan, rows, out: np.ndarray) -> None:
    """Zero the elements of ``out`` (a target dataset assembled whole) that plan ``rows`` do not
    write, a block of ``STREAM_BLOCK_BYTES`` at a time: blocks the copies cover are left as they are
    (zeroing them would be a pass over memory for nothing: a padded flat buffer is mostly covered)."""
    flat = out.reshape(-1)
    copies = strided_copies(plan, rows) if len(rows) else []
    if copies is None:
        flat.fill(0)
        return
    step = max(1, STREAM_BLOCK_BYTES // flat.itemsize)
    for lo in range(0, flat.size, step):
        hi = min(lo + step, flat.size)
        if sum(p.count for p in parts_in(copies, lo, hi)) < hi - lo:
            flat[lo:hi] = 0


def whole_copy(plan: Plan, rows, shape: tuple[int, ...], dtype: str, ckpt: CheckpointLike) -> Digests | None:
    """``carried_digests`` of the target dataset plan ``rows`` fill, for the whole-dataset path."""
    if not isinstance(ckpt, Checkpoint) or not len(rows):
        return None
    copies = strided_copies(plan, rows)
    return None if copies is None else carried_digests(copies, shape, dtype, ckpt)


def carried_digests(copies: Sequence[StridedCopy], shape: tuple[int, ...], dtype: str,
                    ckpt: CheckpointLike) -> Digests | None:
    """The source's checksums when ``copies`` fill the target dataset (``shape``, ``dtype``) with one
    source dataset of the same shape and dtype, each element at its own offset (byte for byte a
    copy): a target read with verification then carries them over rather than hashing its bytes
    again (docs/format.md, "Digests carried over"). None for any other copy (a fill, another
    source, a move), or a source that binds no chunk table."""
    total = math.prod(shape)
    if not copies or not total or not isinstance(ckpt, Checkpoint):
        return None
    rank, key = copies[0].src_rank, copies[0].src_key
    if any((cp.src_rank, cp.src_key) != (rank, key) or cp.src != cp.dst or cp.src_strides != cp.dst_strides
           for cp in copies) or sum(cp.count for cp in copies) != total:
        return None  # (the plan's coverage proof: no target element is written twice)
    info = ckpt.info(rank, key)
    if (info.shape, info.dtype) != (tuple(shape), dtype) or info.encoding is not None:
        return None  # (a compressed source's reads check its stored bytes, not these digests)
    return ckpt.digests(rank, key)
