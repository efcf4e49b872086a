"""The flat (ZeRO) cut checks itself: the target proof counts a flat tensor's elements on its layout
before the cut (docs/ir.md), so a piece the cut lost would otherwise be neither copied nor filled."""
from __future__ import annotations

import pytest

import ucl
import ucl.layout.flat as flat
from ucl.demo import llama_model

SMALL = dict(vocab=200, hidden=32, heads=4, kv_heads=2, ffn=40, layers=4)


def test_the_plain_cut_compiles():
    ucl.compile(llama_model(SMALL), ucl.UNIVERSAL, "pp=2,dp=3,tp=2")


@pytest.mark.parametrize("ranks", [None, [5]])
def test_a_cut_that_loses_a_box_is_refused(monkeypatch, ranks):
    real = flat.flat_boxes

    def lossy(shape, start, stop):  # a bug of the kind the check is for: the last box of a range dropped
        boxes = list(real(shape, start, stop))
        return boxes[:-1] if len(boxes) > 1 else boxes

    monkeypatch.setattr(flat, "flat_boxes", lossy)
    with pytest.raises(ucl.PlanError) as info:
        ucl.compile(llama_model(SMALL), ucl.UNIVERSAL, "pp=2,dp=3,tp=2", ranks=ranks)
    assert info.value.code == "UCL314" and "flat buffer member" in str(info.value)


def test_partition_coordinates_share_their_numbers():
    # a 131,072-rank map has one coordinate dict per partition: their numbers above 256 (not cached
    # by Python) are shared objects, not one each (memory: #35)
    from ucl.layout.lower import lower

    sm = lower(llama_model(SMALL), ucl.Mesh.parse("pp=2,dp=512,tp=1"))
    dps = [h.fixed["dp"] for hs in sm.holdings for h in hs if "dp" in h.fixed]
    assert max(dps) > 256 and len(dps) > len(set(dps))  # numbers recur across holdings
    assert len({id(v) for v in dps}) == len(set(dps))
