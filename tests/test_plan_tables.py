"""The copy table build of a plan (ucl.plan.geometry): the order of its rows and the use columns it
consumes. Oracles: numpy's lexsort over every sort column, and the columns written out by hand."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ucl
from ucl.demo import llama_model
from ucl.layout.algebra import I64
from ucl.plan.geometry import Uses, copy_order
from ucl.plan.ir import BOX_COLUMNS, COPY_COLUMNS


@st.composite
def copy_rows(draw):
    """Sources (rank, slot), geometry rows' starts (G, K) and rows (source, geometry row), with
    ties in every column (small value ranges)."""
    k = draw(st.integers(1, 3))
    n_src, n_geo, n = draw(st.integers(1, 12)), draw(st.integers(1, 12)), draw(st.integers(0, 60))
    ints = lambda size, hi: np.array(draw(st.lists(st.integers(0, hi), min_size=size, max_size=size)), dtype=I64)
    return (ints(n_src, 3), ints(n_src, 2), ints(n_geo * k, 4).reshape(n_geo, k),
            ints(n, n_src - 1), ints(n, n_geo - 1))


@settings(max_examples=200, deadline=None)
@given(copy_rows(), st.sampled_from([1 << 62, 1]))
def test_copy_order_is_the_stable_lexsort_by_source_rank_slot_and_start(rows, key_limit):
    src_rank, src_slot, starts, source, row = rows
    want = np.lexsort(tuple(starts[row, k] for k in range(starts.shape[1] - 1, -1, -1))
                      + (src_slot[source], src_rank[source]))
    # key_limit=1: the lexsort of the two numberings (a plan with over 2^62 combinations)
    assert copy_order(src_rank, src_slot, starts, source, row, key_limit).tolist() == want.tolist()


def test_uses_take_joins_single_and_batched_uses_in_order_and_empties():
    u = Uses()
    u.add(7, 1, 2, 3, 4)
    u.add_many(np.array([5, 6], dtype=I64), 9, np.array([10, 11], dtype=I64), np.array([12, 13], dtype=I64), 14)
    u.add_many(np.zeros(0, dtype=I64), 8, np.zeros(0, dtype=I64), np.zeros(0, dtype=I64), 15)
    u.add_many(np.array([16], dtype=I64), 17, np.array([18], dtype=I64), np.array([19], dtype=I64), 20)
    got = [c.tolist() for c in u.take()]
    assert got == [[7, 5, 6, 16], [1, 9, 9, 17], [2, 10, 11, 18], [3, 12, 13, 19], [4, 14, 14, 20]]
    assert all(c.dtype == I64 for c in u.take())
    assert [c.tolist() for c in u.take()] == [[]] * 5  # taken: the uses are gone


@pytest.mark.parametrize("src, dst", [("pp=2,dp=3,tp=2", "pp=4,dp=8,tp=2"), ("dp=2", "tp=2")])
def test_the_copy_table_has_its_columns_shapes_and_dtypes(src, dst):
    plan = ucl.compile(llama_model(dict(vocab=200, hidden=32, heads=4, kv_heads=2, ffn=40, layers=4)), src, dst)
    c = plan.stored_copies
    assert list(c) == list(COPY_COLUMNS + BOX_COLUMNS)
    n = len(c["tensor"])
    assert n and all(c[k].shape == (n,) for k in COPY_COLUMNS)
    assert all(c[k].shape == (n, plan.ndim) for k in BOX_COLUMNS)
    assert all(v.dtype == I64 and v.flags.c_contiguous for v in c.values())
