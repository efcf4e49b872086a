"""One rank's plan lowers by coordinate (docs/ir.md): of the flat (ZeRO) members placed where the rank
is, only those its partitions hold, with the datasets and gaps of its partitions only; and a ShardMap
stores a flat buffer's partitions as one record. Oracles: the full plan of another model object
(lowered whole), the expanded per-partition datasets, a plain dict numbering of rank sets, a set of
source boxes (distinct bytes) and itertools.product (a piece's boxes)."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ucl
from ucl.demo import llama_model
from ucl.layout.algebra import DimLayout
from ucl.layout.lower import lower, tensors_on
from ucl.plan.geometry import piece_boxes
from ucl.plan.execute import rank_datasets
from ucl.plan.ranksets import RankSetBuilder
from tests.test_compact_plan import resolved, row_set, rows_of_rank

SMALL = dict(vocab=200, hidden=32, heads=4, kv_heads=2, ffn=40, layers=4)
# pp=4: one layer a stage; dp=64 pads each stage's buffer to 4,096 elements, so the last partitions
# hold padding only, and the embedding's stage has partitions of the embedding alone
SRC, DST = "pp=2,dp=3,tp=2", "pp=4,dp=64,tp=2"
FULL = ucl.compile(llama_model(SMALL), SRC, DST)


def _ranks() -> list[int]:
    mesh = ucl.Mesh.parse(DST)
    return [mesh.rank(pp=p, dp=d, tp=t) for p in (0, 1, 3) for d in (0, 1, 30, 62, 63) for t in (0, 1)]


@pytest.mark.parametrize("rank", _ranks())
def test_one_rank_of_zero_partitions_plans_the_rows_of_the_full_plan(rank):
    one = ucl.compile(llama_model(SMALL), SRC, DST, ranks=[rank])
    for table in ("copies", "fills"):
        assert row_set(resolved(one, getattr(one, table))) == rows_of_rank(resolved(FULL, getattr(FULL, table)), rank)
    assert sorted(rank_datasets(one, rank), key=str) == sorted(rank_datasets(FULL, rank), key=str)
    assert int(one.bytes_read) == int(FULL.bytes_read_per_rank()[rank])


def test_a_rank_holding_only_padding_gets_its_partitions_and_fills():
    mesh = ucl.Mesh.parse(DST)
    rank = mesh.rank(pp=1, dp=63, tp=0)  # a layer's 3,584 elements end in partition 55 of 64
    one = ucl.compile(llama_model(SMALL), SRC, DST, ranks=[rank])
    assert {one.tensors[i]["kind"] for i in one.copies["tensor"]} == {"param", "step"}  # no flat state
    flat = [d for d in rank_datasets(one, rank) if "@flat" in d["key"]]
    assert len(flat) == 3  # fp32, exp_avg, exp_avg_sq
    gaps = one.fills["tensor"] == -1
    assert int(np.prod(one.fills["size"][gaps], axis=1).sum()) == sum(int(np.prod(d["shape"])) for d in flat)


def _pieces(pieces) -> list:
    return [tuple((d.local, d.segs.tolist(), d.fills.tolist()) for d in p) for p in pieces]


def _holding(h) -> tuple:
    return h.fixed, h.slot, _pieces(h.pieces)


def test_the_focused_map_holds_only_the_flat_tensors_the_rank_holds():
    model, mesh = llama_model(SMALL), ucl.Mesh.parse(DST)
    whole = lower(llama_model(SMALL), mesh)
    for rank in (mesh.rank(pp=1, dp=5, tp=1), mesh.rank(pp=0, dp=40, tp=0)):
        at = [mesh.coords(rank)]
        sm = lower(model, mesh, tensors=tensors_on(model, mesh, at), at=at, held=True)
        held = {t.id for t in model.tensors if any(all(at[0].get(a, 0) == v for a, v in h.fixed.items())
                                                  for h in whole.holdings[t.id])}
        flat = {t.id for t in model.tensors if t.flat is not None}
        assert sm.focus & flat == held & flat and held & flat
        assert {t for t in range(len(model.tensors)) if sm.holdings[t]} <= sm.focus
        for t in sm.focus:
            if model.tensors[t].flat is None:  # complete holdings: the proofs need every rank's
                assert len(sm.holdings[t]) == len(whole.holdings[t])
                continue
            # a flat tensor: the pieces of this rank's partitions only; its proof on the target is made
            # on its layouts before flattening, which are complete
            mine = [h for h in whole.holdings[t] if all(at[0].get(a, 0) == v for a, v in h.fixed.items())]
            assert mine and [_holding(h) for h in sm.holdings[t]] == [_holding(h) for h in mine]
            assert [(f, _pieces(ls)) for f, ls in sm.unflattened[t]] == \
                [(f, _pieces(ls)) for f, ls in whole.unflattened[t]]
            assert len({tuple(sorted(f.items())) for f, _ in sm.unflattened[t]}) == len(sm.unflattened[t]) > 0
        assert len(sm.datasets) < len(whole.datasets) / 8


@settings(deadline=None, max_examples=8, suppress_health_check=[HealthCheck.too_slow])
@given(mesh=st.sampled_from(["dp=4", "pp=2,dp=3,tp=2", "pp=4,dp=64,tp=2", "dp=5,tp=2", "universal"]),
       stored=st.booleans())
def test_rank_datasets_of_the_compact_map_equal_those_of_its_expanded_datasets(mesh, stored):
    mesh = ucl.Mesh.parse(mesh)
    sm = lower(llama_model(SMALL), mesh)
    for rank in range(0, mesh.size, max(1, mesh.size // 37)):
        c = mesh.coords(rank) if not mesh.is_universal else {}
        want = {d.key: (d.shape, d.dtype) for d in sm.datasets
                if all(c.get(a, 0) == v for a, v in d.fixed.items())
                and (not stored or all(v == 0 for a, v in c.items() if a not in d.fixed))}
        assert sm.rank_datasets(rank, stored) == want


@settings(deadline=None, max_examples=30)
@given(ops=st.lists(st.one_of(st.tuples(st.just("one"), st.integers(0, 9)),
                              st.tuples(st.just("many"), st.lists(st.integers(0, 9), min_size=1, max_size=6)),
                              st.tuples(st.just("set"), st.sets(st.integers(0, 9), min_size=1, max_size=4))),
                    max_size=12))
def test_rank_set_builder_numbers_sets_as_a_dict_in_order_of_first_use(ops):
    b, seen, sets, got, want = RankSetBuilder(10), {}, [], [], []
    for kind, arg in ops:
        groups = [[arg]] if kind == "one" else [[r] for r in arg] if kind == "many" else [sorted(arg)]
        for g in groups:
            want.append(seen.setdefault(tuple(g), len(seen)))
            if len(seen) > len(sets):
                sets.append(g)
        if kind == "one":
            got.append(b.one(arg))
        elif kind == "many":
            got.extend(b.singles(np.array(arg, dtype=np.int64)).tolist())
        else:
            got.append(b.add(np.array(sorted(arg), dtype=np.int64)))
    assert got == want
    built = b.build()
    assert [built.members(i).tolist() for i in range(len(built))] == sets


@pytest.mark.parametrize("src,dst", [(SRC, DST), ("pp=2,dp=3,tp=2", "universal"), ("universal", "dp=5,tp=2")])
def test_distinct_bytes_are_those_of_the_distinct_source_boxes(src, dst):
    plan = ucl.compile(llama_model(SMALL), src, dst)
    c = plan.stored_copies
    boxes = {}
    for i in range(len(c["tensor"])):
        key = (int(c["tensor"][i]), int(c["src_rank"][i]), int(c["src_slot"][i]),
               tuple(c["src_start"][i].tolist()), tuple(c["size"][i].tolist()))
        boxes[key] = int(np.prod(c["size"][i])) * plan.itemsize[c["tensor"][i]]
    assert plan.bytes_unique == sum(boxes.values()) and plan.read_amplification >= 1


@settings(deadline=None, max_examples=40)
@given(st.lists(st.lists(st.lists(st.tuples(st.integers(0, 50), st.integers(0, 50), st.integers(1, 9)),
                                  min_size=1, max_size=3), min_size=2, max_size=2), min_size=1, max_size=5))
def test_piece_boxes_are_the_products_of_each_dims_runs(runs):
    pieces = [tuple(DimLayout(99, np.array(d, dtype=np.int64).reshape(-1, 3), np.zeros((0, 2), dtype=np.int64))
                    for d in p) for p in runs]
    owner, boxes = piece_boxes(pieces, 2)
    want = [(i, combo) for i, p in enumerate(runs) for combo in itertools.product(*p)]
    assert owner.tolist() == [i for i, _ in want]
    assert boxes.tolist() == [[list(r) for r in combo] for _, combo in want]


def test_a_second_rank_of_a_stage_reuses_the_placement_of_the_first():
    # one rank's plan after another's (a loader planning its node's ranks): the tensors placed on a
    # stage and their whole (not flat) holdings are lowered once; only the flat partitions are cut anew
    model, mesh = llama_model(SMALL), ucl.Mesh.parse(DST)
    maps = []
    for rank in (mesh.rank(pp=1, dp=5, tp=1), mesh.rank(pp=1, dp=6, tp=0)):
        at = [mesh.coords(rank)]
        maps.append(lower(model, mesh, tensors=tensors_on(model, mesh, at), at=at, held=True))
    a, b = maps
    whole = [t.id for t in model.tensors if t.flat is None and a.holdings[t.id]]
    assert whole and all(a.holdings[i][0] is b.holdings[i][0] for i in whole)
    assert a.whole_datasets == b.whole_datasets and a.datasets != b.datasets
