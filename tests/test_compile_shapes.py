"""Tensors of one shape placed alike (every layer's weight of a kind on one pipeline stage) hold the
very same coordinates and pieces, so what later layers find by identity (the proof, the rows of
each piece) is found once per shape, not once per layer (docs/ir.md). Oracles: the full plan of
another model object, its rows for each rank, and ``lower(reuse=False)``
(tests/test_lower_cache.py compares it value by value on random specs)."""
from __future__ import annotations

import pytest

import ucl
from tests.test_compact_plan import resolved_rank_rows as _rows
from ucl.demo import llama_model
from ucl.layout.lower import lower
from ucl.plan.execute import rank_datasets
from ucl.plan.proof import dedup_sources

DIMS = dict(vocab=200, hidden=32, heads=4, kv_heads=2, ffn=40, layers=8)
# two layers a target stage, four a source stage: the layers of a stage share their holdings on both
SRC, DST = "pp=2,dp=4,tp=2", "pp=4,dp=32,tp=2"
FULL = ucl.compile(llama_model(DIMS), SRC, DST)


@pytest.mark.parametrize("rank", [0, 5, 63, 64, 101, 130, 191, 200, 255])
def test_one_rank_plans_are_the_full_plans_rows(rank):
    one = ucl.compile(llama_model(DIMS), SRC, DST, ranks=[rank])
    for table in ("copies", "fills"):
        mine = _rows(one, table, rank)
        assert mine == _rows(FULL, table, rank), table
        assert mine or table == "fills"
    assert sorted(rank_datasets(one, rank), key=str) == sorted(rank_datasets(FULL, rank), key=str)


def test_layers_of_one_shape_on_a_stage_share_holdings_and_proof():
    model = llama_model(DIMS)
    sm = lower(model, ucl.Mesh.parse(DST))
    a, b, c = (model.tensor(f"param/decoder.layers.{i}.self_attention.linear_qkv.weight") for i in (2, 3, 4))
    ha, hb, hc = sm.holdings[a.id], sm.holdings[b.id], sm.holdings[c.id]
    assert [h.fixed["pp"] for h in ha] == [h.fixed["pp"] for h in hb] != [h.fixed["pp"] for h in hc]
    assert all(x.pieces is y.pieces and x.fixed is y.fixed for x, y in zip(ha, hb))  # layers 2, 3: stage 1
    assert all(x.slot != y.slot for x, y in zip(ha, hb))  # each its own dataset
    assert dedup_sources(sm, a) is dedup_sources(sm, b)  # one proof for the shape
    assert dedup_sources(sm, c) is not dedup_sources(sm, a)  # stage 2: other coordinates
    fresh = lower(model, ucl.Mesh.parse(DST), reuse=False)  # every tensor on its own: nothing shared
    assert not any(x.pieces is y.pieces for x, y in zip(fresh.holdings[a.id], fresh.holdings[b.id]))
