"""Geometry of regular runs ``(start, count, stride, block)`` over a dataset's flat checksum chunks and
its rows: which chunks a read touches, which columns it takes, whether it is one flat range. Pure
functions of numbers; the verified reads of ``reader.Checkpoint`` decide what to read with them."""
from __future__ import annotations

import numpy as np


def chunks_touched(runs, per: int, n: int) -> np.ndarray:
    """The chunks (of ``per`` elements, ``n`` of them) the regular runs touch, ascending. A run whose
    gaps (``stride - block``) are shorter than a chunk touches every chunk from its first to its
    last (no chunk fits in a gap): a range, found without an array per run (the streamed path reads
    a run or two per block, thousands of times a reshard)."""
    spans = []
    for start, count, stride, block in runs:
        if count * block == 0:
            continue
        if count > 1 and stride - block >= per:
            break
        spans.append((start // per, (start + (count - 1) * stride + block - 1) // per + 1))
    else:
        if len(spans) == 1:
            return np.arange(*spans[0], dtype=np.int64)
        touched = np.zeros(n + 1, dtype=np.int64)
        for a, b in spans:
            touched[a] += 1
            touched[b] -= 1
        return np.flatnonzero(np.cumsum(touched[:n]) > 0)
    touched = np.zeros(n + 1, dtype=np.int64)
    for start, count, stride, block in runs:
        b = start + np.arange(count, dtype=np.int64) * stride
        np.add.at(touched, b // per, 1)
        np.add.at(touched, (b + block - 1) // per + 1, -1)
    return np.flatnonzero(np.cumsum(touched[:n]) > 0)


def columns_wanted(runs, cols: int) -> tuple[int, int]:
    """The columns ``[lo, hi)`` the runs ``(start, count, stride, block)`` take, of rows ``cols``
    wide: every column when a run leaves its row. Runs repeat in the same columns (one block, or a
    stride of whole rows), as a tile plan's do."""
    lo, hi = cols, 0
    for start, _, _, block in runs:
        c = start % cols
        if c + block > cols:
            return 0, cols
        lo, hi = min(lo, c), max(hi, c + block)
    return lo, hi


def one_range(runs) -> tuple[int, int] | None:
    """The flat range ``[a, b)`` that ``runs`` cover when they are contiguous and adjacent, else None."""
    a = b = None
    for start, count, stride, block in runs:
        if count > 1 and stride != block:
            return None
        if b is not None and start != b:
            return None
        a = start if a is None else a
        b = start + count * block
    return None if a is None else (a, b)
