"""Lowering shares one set of coordinate dicts and piece lists among the tensors of one shape placed
alike (docs/ir.md), so a consumer that changed one tensor's holdings would change every layer's of
the stage. Checked here: nothing changes them after lowering (they are made read-only views and
every plan, execution and picture still runs), and on a spec with an empty pipeline stage, `keep`
local names, uneven splits, experts over EP, per-parameter ZeRO-3 buffers, buckets and frozen
parameters, each rank's plan is the full plan's rows and a round trip is bit-exact."""
from __future__ import annotations

import sys
import types
import warnings

import pytest

import ucl
import ucl.layout.lower  # noqa: F401  (the module, not the function ucl.layout exports)
from tests.test_compact_plan import resolved_rank_rows as _rows
from ucl import UNIVERSAL, Mesh
from ucl.demo import llama_model, universal_state
from ucl.layout.fit import MeshFitWarning
from ucl.picture import flat_buffer, layout_boxes

LOWER = sys.modules["ucl.layout.lower"]

SPEC = """
dims vocab, hidden, ffn, layers, experts
mesh pp, dp, ep, tp
layers.{i}.** : index i of layers over pp sizes [3, 0, 3]
head.{i}.** : index i of 4 over pp first 1 last 1 keep
emb.weight [vocab, hidden] : pad 0 to multiple_of(8 * tp); split 0 over tp uneven; on pp = first, last
layers.{i}.w1 [ffn, hidden] : split 0 over tp uneven
layers.{i}.w2 [hidden, ffn] : split 1 over tp uneven
layers.{i}.w3 [hidden, ffn] : split 1 over tp uneven
layers.{i}.norm [hidden] : replicate
layers.{i}.frozen [hidden] : replicate
layers.{i}.ex.{e}.w [ffn, hidden] : index e of experts over ep; split 0 over tp uneven
head.{i}.w [hidden, hidden] : split 0 over tp uneven; split 0 over dp uneven
state param : dtype bfloat16
state fp32, exp_avg : flat over dp align 4 pad to multiple_of(2 * dp) bucket 100
state fp32, exp_avg for layers.*.ex.** : flat over dp per_param
state fp32, exp_avg for head.** : follow
state step : dtype int64; scalar
"""


def _model():
    p = {"emb.weight": (50, 12)}
    for i in range(6):
        p.update({f"layers.{i}.w1": (10, 12), f"layers.{i}.w2": (12, 10), f"layers.{i}.w3": (12, 10),
                  f"layers.{i}.norm": (12,), f"layers.{i}.frozen": (12,)})
        if i % 2:  # experts in every other layer: layers of one shape, some in a ZeRO-3 buffer
            p.update({f"layers.{i}.ex.{e}.w": (10, 12) for e in range(4)})
    p.update({f"head.{i}.w": (12, 12) for i in range(4)})
    return ucl.load_spec(SPEC).bind(dict(vocab=50, hidden=12, ffn=10, layers=6, experts=4), p,
                                    frozen=[f"layers.{i}.frozen" for i in range(6)])


def _round_trip(model, a: str, b: str, full) -> None:
    uni = universal_state(model)
    there = ucl.execute_memory(ucl.compile(model, UNIVERSAL, a), {0: uni})
    back = ucl.execute_memory(ucl.compile(model, b, UNIVERSAL), ucl.execute_memory(full, there))
    assert sorted(back[0]) == sorted(uni)
    assert all(back[0][k].tobytes() == v.tobytes() for k, v in uni.items())


@pytest.mark.filterwarnings("ignore::ucl.layout.fit.MeshFitWarning")
def test_holdings_are_never_changed_after_lowering(monkeypatch):
    views: dict[int, object] = {}
    alive = []  # the originals, so that their ids stay theirs: shared objects stay shared views

    def read_only(x):
        if id(x) not in views:
            alive.append(x)
            views[id(x)] = types.MappingProxyType(x) if isinstance(x, dict) else tuple(x)
        return views[id(x)]

    holding, dataset = LOWER.Holding, LOWER.DatasetSlot
    monkeypatch.setattr(LOWER, "Holding", lambda fixed, slot, pieces: holding(read_only(fixed), slot, read_only(pieces)))
    monkeypatch.setattr(LOWER, "DatasetSlot", lambda fixed, *rest: dataset(read_only(fixed), *rest))
    for model, a, b in ((llama_model(dict(vocab=200, hidden=32, heads=4, kv_heads=2, ffn=40, layers=12)),
                         "pp=3,dp=2,tp=2", "pp=4,dp=3,tp=1"),
                        (_model(), "pp=3,dp=2,ep=2,tp=3", "pp=3,dp=3,ep=1,tp=2")):
        for src, dst in ((a, b), (b, a)):
            for r in range(0, Mesh.parse(dst).size, 5):
                ucl.compile(model, src, dst, ranks=[r])
            _round_trip(model, src, dst, ucl.compile(model, src, dst))
            for t in model.tensors[:60]:
                if t.kind == "fp32":
                    layout_boxes(model, dst, t.name)
                    flat_buffer(model, dst, t.name, "fp32")
    assert len(views) > 100  # the views were in use


@pytest.mark.parametrize("src,dst", [("pp=3,dp=2,ep=2,tp=3", "pp=3,dp=3,ep=1,tp=2"),
                                     ("pp=3,dp=4,ep=4,tp=1", "pp=3,dp=2,ep=2,tp=3")])
def test_one_rank_plans_are_the_full_plans_rows_on_uneven_stages_and_experts(src, dst):
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        model = _model()
        full = ucl.compile(model, src, dst)
    # stage 1 holds no layer: warned about once per mesh, not once per layer or per kind
    assert sorted(str(x.message).split(": ", 1)[1] for x in w if issubclass(x.category, MeshFitWarning)) == \
        sorted(f"mesh {m}: pp stage 1 gets none of the 6 i-values of `layers.{{i}}.**` (stage sizes [3, 0, 3]): "
               "those ranks hold none of its parameters" for m in (src, dst))
    one_model = _model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MeshFitWarning)
        for r in range(Mesh.parse(dst).size):
            one = ucl.compile(one_model, src, dst, ranks=[r])
            assert _rows(one, "copies", r) == _rows(full, "copies", r), r
            assert _rows(one, "fills", r) == _rows(full, "fills", r), r
        _round_trip(model, src, dst, full)
