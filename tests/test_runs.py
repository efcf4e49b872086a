"""``store.runs``: each function of run geometry against brute force over the elements the runs name."""
from __future__ import annotations

import numpy as np
from hypothesis import given, settings, strategies as st

from passes import examples
from ucl.store.runs import chunks_touched, columns_wanted, one_range


@st.composite
def runs_in(draw, size_max=400):
    """Increasing, non-overlapping regular runs inside a dataset of ``size`` elements."""
    size = draw(st.integers(1, size_max))
    runs, pos = [], 0
    for _ in range(draw(st.integers(0, 4))):
        if pos >= size:
            break
        start = draw(st.integers(pos, size - 1))
        block = draw(st.integers(1, size - start))
        stride = draw(st.integers(block, block + 40))
        count = draw(st.integers(1, max(1, (size - start - block) // stride + 1)))
        runs.append((start, count, stride, block))
        pos = start + (count - 1) * stride + block
    return size, runs


def _elements(runs) -> list[int]:
    return [s + i * stride + j for s, count, stride, block in runs for i in range(count) for j in range(block)]


@settings(max_examples=examples(400), deadline=None)
@given(runs_in(), st.integers(1, 64))
def test_chunks_touched_are_the_chunks_of_the_elements(case, per):
    size, runs = case
    n = -(-size // per)
    want = sorted({e // per for e in _elements(runs)})
    assert chunks_touched(runs, per, n).tolist() == want


@settings(max_examples=examples(400), deadline=None)
@given(runs_in(), st.integers(1, 50))
def test_columns_wanted_span_the_elements_columns(case, cols):
    _, runs = case
    # its callers' runs (tile plans) repeat in the same columns: one block each, or a stride of whole rows
    runs = [(s, c, stride, b) for s, c, stride, b in runs if c == 1 or stride % cols == 0]
    got = columns_wanted(runs, cols)
    if any(s % cols + block > cols for s, _, _, block in runs):  # a run leaves its row: every column
        assert got == (0, cols)
    elif runs:
        els = _elements(runs)
        assert got == (min(e % cols for e in els), max(e % cols for e in els) + 1)


@settings(max_examples=examples(400), deadline=None)
@given(runs_in())
def test_one_range_only_for_runs_that_are_one_flat_range(case):
    _, runs = case
    els = _elements(runs)
    got = one_range(runs)
    if els and els == list(range(els[0], els[-1] + 1)):
        assert got == (els[0], els[-1] + 1)
    else:
        assert got is None or not els


def test_known_answers():
    assert chunks_touched([(3, 2, 10, 2)], 4, 5).tolist() == [0, 1, 3]  # elements 3,4 and 13,14
    assert columns_wanted([(5, 3, 8, 2)], 8) == (5, 7)
    assert one_range([(0, 2, 4, 4), (8, 1, 3, 3)]) == (0, 11)
    assert one_range([(0, 2, 5, 4)]) is None
