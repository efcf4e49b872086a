"""The copy table build of a plan (ucl.plan.geometry): the order of its rows, the use columns it
consumes, and the dtypes its columns take from bounds (int32 where every value fits, int64 else).
Oracles: numpy's lexsort over every sort column, the columns written out by hand, an int64
reference of the row gather, and exact Python-int box arithmetic."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ucl
from ucl.demo import llama_model
from ucl.layout.algebra import I64
from ucl.plan.geometry import Uses, copy_order, gather
from ucl.plan.ir import BOX_COLUMNS, COPY_COLUMNS, column_dtype, int_dtype

I32_MAX = (1 << 31) - 1


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
    cols = u.take()
    assert [c.tolist() for c in cols] == [[7, 5, 6, 16], [1, 9, 9, 17], [2, 10, 11, 18], [3, 12, 13, 19],
                                          [4, 14, 14, 20]]
    assert all(c.dtype == np.int32 for c in cols)  # every value fits
    assert [c.tolist() for c in u.take()] == [[]] * 5  # taken: the uses are gone


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(-(1 << 32), 1 << 32).map(lambda d: I32_MAX + d if d >= 0 else -I32_MAX + d)
                | st.integers(-5, 5), min_size=5, max_size=5))
def test_uses_take_keeps_every_value_near_the_int32_edge(edge):
    """A column holding a value past int32 is int64; at the edge (2**31 - 1, -2**31) still int32."""
    u = Uses()
    u.add(*edge)
    u.add_many(np.array([1, edge[0]], dtype=I64), edge[1], np.array([edge[2], 0], dtype=I64),
               np.array([0, edge[3]], dtype=I64), edge[4])
    cols = u.take()
    want = [[edge[0], 1, edge[0]], [edge[1]] * 3, [edge[2]] * 2 + [0], [edge[3], 0, edge[3]], [edge[4]] * 3]
    assert [c.tolist() for c in cols] == want
    assert [c.dtype for c in cols] == [np.dtype(np.int32) if -I32_MAX - 1 <= min(w) and max(w) <= I32_MAX
                                       else np.dtype(I64) for w in want]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=1, max_size=8), st.data())
def test_gather_equals_its_int64_reference_with_offsets_past_int32(counts, data):
    """Rows of geometries placed past 2**31 by a large unused one stay exact (int64 where needed)."""
    big = data.draw(st.sampled_from([0, 1, I32_MAX - 3, I32_MAX, 1 << 31, 1 << 33]))
    counts = np.array([big] + counts, dtype=I64)  # geometry 0: never used, only shifts the others
    geo = np.array(data.draw(st.lists(st.integers(1, len(counts) - 1), max_size=12)), dtype=I64)
    offsets = np.concatenate([[0], np.cumsum(counts)])
    want_row = [int(offsets[g]) + k for g in geo.tolist() for k in range(int(counts[g]))]
    want_use = [u for u, g in enumerate(geo.tolist()) for _ in range(int(counts[g]))]
    row, use = gather(counts, geo)
    assert row.tolist() == want_row and use.tolist() == want_use
    assert row.dtype == use.dtype == int_dtype(0, int(offsets[-1]))


@given(st.integers(-(1 << 40), 1 << 40), st.integers(0, 1 << 40))
def test_column_dtype_is_int32_exactly_when_every_value_fits(a, d):
    for lo, hi in ((a, a + d), (I32_MAX - d, I32_MAX + a), (-I32_MAX - 1 + a, -I32_MAX - 1 + a + d)):
        lo, hi = min(lo, hi), max(lo, hi)
        fits = -(1 << 31) <= lo and hi <= I32_MAX
        assert column_dtype(np.array([hi, lo], dtype=I64), np.zeros(0, dtype=I64)) == (np.int32 if fits else I64)
        assert column_dtype(np.array([[0, 1]], dtype=I64), np.array([lo], dtype=I64),
                            np.array([hi], dtype=I64)) == (np.int32 if fits else I64)


@pytest.mark.parametrize("src, dst", [("pp=2,dp=3,tp=2", "pp=4,dp=8,tp=2"), ("dp=2", "tp=2")])
def test_the_copy_table_has_its_columns_shapes_and_dtypes(src, dst):
    plan = ucl.compile(llama_model(dict(vocab=200, hidden=32, heads=4, kv_heads=2, ffn=40, layers=4)), src, dst)
    c = plan.stored_copies
    assert list(c) == list(COPY_COLUMNS + BOX_COLUMNS)
    n = len(c["tensor"])
    assert n and all(c[k].shape == (n,) for k in COPY_COLUMNS)
    assert all(c[k].shape == (n, plan.ndim) for k in BOX_COLUMNS)
    assert all(v.dtype == np.int32 and v.flags.c_contiguous for v in c.values())  # small values: int32
    assert all(v.dtype == I64 for v in plan.copies.values())  # what executors read: int64
    assert all(v.dtype == I64 for t in (plan.stored_fills, plan.stored_datasets) for v in t.values())


def test_a_plan_with_boxes_past_int32_keeps_them_exact_in_int64_columns():
    """Starts and sizes above 2**31 elements (a 6 * 2**30-element tensor) stay int64, exact; the
    other columns are int32; cut to ranks and expanded, every column is int64."""
    n = 6 << 30
    spec = ucl.load_spec("dims n\nmesh dp, tp\nw [n] : split 0 over tp\n")
    model = spec.bind(dims={"n": n}, params={"w": (n,)})
    plan = ucl.compile(model, "tp=2", "tp=3")
    c = plan.stored_copies
    got = sorted(zip(c["src_rank"].tolist(), c["dst_set"].tolist(), c["global_start"][:, 0].tolist(),
                     c["src_start"][:, 0].tolist(), c["dst_start"][:, 0].tolist(), c["size"][:, 0].tolist()))
    src, dst = [(r * n // 2, (r + 1) * n // 2) for r in range(2)], [(r * n // 3, (r + 1) * n // 3) for r in range(3)]
    want = sorted((s, plan.rank_sets.ranks.tolist().index(d), max(a, b), max(a, b) - a, max(a, b) - b,
                   min(e, f) - max(a, b))
                  for s, (a, e) in enumerate(src) for d, (b, f) in enumerate(dst) if max(a, b) < min(e, f))
    assert got == want
    # each column int64 exactly where one of its values is past int32 (here global and source
    # starts, sizes), else int32
    names = ("src_rank", "dst_set", "global_start", "src_start", "dst_start", "size")
    wide = {k for j, k in enumerate(names) if max(w[j] for w in want) > I32_MAX}
    assert wide == {"global_start", "src_start", "size"}
    assert {k: v.dtype for k, v in c.items()} == {k: np.dtype(I64 if k in wide else np.int32) for k in c}
    cut = plan.for_ranks([1])  # [n / 3, 2n / 3): from both sources
    assert all(v.dtype == I64 for v in cut.copies.values())
    assert sorted(cut.copies["dst_start"][:, 0].tolist()) == [0, n // 6]


def _narrowest(lo: int, hi: int) -> np.dtype:
    """int_dtype with int8 in place of int32: a bound taken over the wrong array anywhere in the build
    then wraps at 128 rather than 2**31, so a plan of a few hundred ranks shows it."""
    return np.dtype(np.int8) if -128 <= lo and hi <= 127 else np.dtype(np.int64)


def _widest(lo: int, hi: int) -> np.dtype:
    return np.dtype(np.int64)


def _plan_values(plan) -> dict:
    q = type(plan).from_json(plan.to_json())
    return {"copies": {k: v.tolist() for k, v in plan.copies.items()},
            "fills": {k: v.tolist() for k, v in plan.fills.items()},
            "round_trip": {k: v.tolist() for k, v in q.copies.items()},
            "rank0": {k: v.tolist() for k, v in plan.for_ranks([0]).copies.items()},
            "bytes": (plan.bytes_read, plan.bytes_unique, [int(x) for x in plan.bytes_read_per_rank()])}


@pytest.mark.parametrize("src, dst, ranks", [("pp=2,dp=8,tp=4", "pp=4,dp=16,tp=2", None),
                                             ("pp=4,dp=4,tp=2", "pp=8,dp=8,tp=4", [5, 200]),
                                             ("pp=1,dp=300,tp=1", "pp=2,dp=5,tp=2", None),
                                             ("pp=2,dp=5,tp=2", "pp=1,dp=300,tp=1", None)])
def test_narrow_columns_are_chosen_from_bounds_that_hold(monkeypatch, src, dst, ranks):
    """Every narrowing bound of the table build, stressed: with int8 as the narrow type (ranks, slots,
    geometry ids and row counts of a few hundred pass it) a plan equals the one built all in int64."""
    model = llama_model(dict(vocab=1000, hidden=256, heads=8, kv_heads=4, ffn=704, layers=8))
    got = {}
    for name, choose in (("int64", _widest), ("int8", _narrowest)):
        monkeypatch.setattr(int_dtype, "__code__", choose.__code__)  # callers hold the function itself
        got[name] = _plan_values(ucl.compile(model, src, dst, ranks=ranks))
    assert got["int8"] == got["int64"]
