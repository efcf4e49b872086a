"""held_keys: a piece list's pieces as bytes, memoised per list; equal keys are one object (memory
of a 131,072-rank plan, #35), but only where they describe the same kind of pieces."""
from __future__ import annotations

import numpy as np

from ucl.layout.algebra import DimLayout
from ucl.plan.geometry import PieceKeys, held_keys


def _dim(start: int, length: int) -> DimLayout:
    return DimLayout(length, np.array([[start, 0, length]], dtype=np.int64), np.zeros((0, 2), dtype=np.int64))


def test_equal_lists_share_one_key():
    memo = PieceKeys()
    a, b = [(_dim(0, 4), _dim(0, 2))], [(_dim(0, 4), _dim(0, 2))]  # equal pieces, distinct objects
    ka, kb = held_keys(memo, a), held_keys(memo, b)
    assert kb is ka and ka.volume == 8 and ka.width == 16


def test_equal_bytes_of_other_widths_stay_apart():
    memo = PieceKeys()
    lists = [[(_dim(0, 4),)], [(_dim(4, 3),)], [()]]  # alive while the memo is used, as in a plan
    held_keys(memo, lists[0])  # dim number 0
    one_dim = held_keys(memo, lists[1])  # dim number 1: its bytes are those of int64 1
    scalar = held_keys(memo, lists[2])  # one scalar piece: its bytes are its count, int64 1
    assert scalar.sig == one_dim.sig
    assert (scalar.width, scalar.volume) == (0, 1) and (one_dim.width, one_dim.volume) == (8, 3)
