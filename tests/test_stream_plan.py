"""plan.stream: a target dataset assembled block by block in flat order. Every operation is checked
against brute-force enumeration of the box's elements (hypothesis)."""
from __future__ import annotations

import itertools
import math

import numpy as np
from hypothesis import given, settings, strategies as st

from ucl.layout.boxes import strides
from ucl.plan.stream import StridedCopy, box_rank, fill_block, parts_in
from tests.passes import examples


@st.composite
def boxes_in(draw, sizes):
    """A shape the box ``sizes`` fits in, the box's start in it, and a flat base offset."""
    shape = tuple(n + draw(st.integers(0, 3)) for n in sizes)
    start = tuple(draw(st.integers(0, s - n)) for s, n in zip(shape, sizes))
    base = draw(st.integers(0, 20))
    st_ = tuple(strides(shape))
    return base + sum(a * s for a, s in zip(start, st_)), st_, math.prod(shape) + base


@st.composite
def copies(draw):
    sizes = tuple(draw(st.lists(st.integers(1, 5), min_size=0, max_size=3)))
    src, src_st, src_len = draw(boxes_in(sizes))
    dst, dst_st, dst_len = draw(boxes_in(sizes))
    return StridedCopy(0, "k", src, src_st, dst, dst_st, sizes), src_len, dst_len


def elements(cp: StridedCopy):
    """(source offset, target offset) of every element, row-major over the box."""
    for idx in itertools.product(*(range(n) for n in cp.sizes)):
        yield (cp.src + sum(i * s for i, s in zip(idx, cp.src_strides)),
               cp.dst + sum(i * s for i, s in zip(idx, cp.dst_strides)))


@settings(max_examples=examples(300), deadline=None)
@given(copies())
def test_box_rank_counts_elements_below_an_offset(c):
    cp, _, dst_len = c
    offsets = [d - cp.dst for _, d in elements(cp)]
    assert offsets == sorted(offsets) and len(set(offsets)) == len(offsets)
    for x in range(-2, dst_len + 2):
        assert box_rank(cp.sizes, cp.dst_strides, x) == sum(o < x for o in offsets)
    assert cp.dst_stop == cp.dst + max(offsets) + 1 and cp.src_stop == cp.src + max(s for s, _ in elements(cp)) - cp.src + 1


@settings(max_examples=examples(300), deadline=None)
@given(copies(), st.data())
def test_parts_in_a_block_are_exactly_its_elements(c, data):
    cp, _, dst_len = c
    lo = data.draw(st.integers(0, dst_len))
    hi = data.draw(st.integers(lo, dst_len + 1))
    got = sorted(e for p in parts_in([cp], lo, hi) for e in elements(p))
    assert got == sorted(e for e in elements(cp) if lo <= e[1] < hi)


@settings(max_examples=examples(300), deadline=None)
@given(copies())
def test_src_runs_list_the_source_offsets_in_box_order(c):
    cp, _, _ = c
    got = [start + i * stride + j for start, count, stride, block in cp.src_runs()
           for i in range(count) for j in range(block)]
    assert got == [s for s, _ in elements(cp)]


@settings(max_examples=examples(200), deadline=None)
@given(st.lists(copies(), min_size=1, max_size=3), st.data())
def test_fill_block_by_blocks_equals_elementwise_copy(cs, data):
    """Copies into disjoint target ranges (one after another) filled in blocks of any size give the
    element-by-element result; untouched elements keep their value."""
    placed, at = [], 0
    for k, (cp, src_len, dst_len) in enumerate(cs):
        placed.append((StridedCopy(k, f"s{k}", cp.src, cp.src_strides, at + cp.dst, cp.dst_strides, cp.sizes), src_len))
        at += dst_len
    total = at
    sources = {(p.src_rank, p.src_key): np.arange(n, dtype=np.int64) * 10 + 1000 * p.src_rank for p, n in placed}
    want = np.full(total, -1, np.int64)
    for p, _ in placed:
        for s, d in elements(p):
            want[d] = sources[(p.src_rank, p.src_key)][s]

    def read(p, view):  # the part's source elements in box order, as a reader of runs gives them
        src = sources[(p.src_rank, p.src_key)]
        view[...] = np.array([src[s] for s, _ in elements(p)], np.int64).reshape(p.sizes)
    block = data.draw(st.integers(1, max(1, total)), label="block")
    got = np.full(total, -1, np.int64)
    plist = [p for p, _ in placed]
    for lo in range(0, total, block):
        hi = min(lo + block, total)
        assert fill_block(plist, lo, got[lo:hi], read) == int((want[lo:hi] != -1).sum())
    assert np.array_equal(got, want)
