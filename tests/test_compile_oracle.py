"""Compiled plans against oracles that share nothing with how ``compile`` finds its rows.

- Element ids (brute force): every element of every tensor gets its own id; every source rank's
  datasets are filled with the ids of what its ShardMap says it holds, every target rank's
  expected datasets likewise. Running each target rank's expanded rows (copies, then fills) on
  those source datasets, with a loop of numpy slices, must give exactly the expected datasets,
  with every element written once (a copy) or only by fills.
- Plans of the compiler that preceded batched geometries (tests/fixtures/plan_v2, written by it
  from the demo model below): the stored tables are equal, slot numbering and row order included.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ucl
from ucl.demo import llama_model
from ucl.layout.boxes import box_view
from ucl.layout.lower import lower

FIXTURES = Path(__file__).parent / "fixtures" / "plan_v2"
SMALL = dict(vocab=200, hidden=32, heads=4, kv_heads=2, ffn=40, layers=4)  # what the fixtures were made from
V2_CASES = {"llama_pp2dp3tp2_to_pp4dp5": ("pp=2,dp=3,tp=2", "pp=4,dp=5,tp=1"),
            "llama_dp2tp2_to_pp2dp7tp2": ("dp=2,tp=2", "pp=2,dp=7,tp=2")}
MODEL = llama_model(SMALL)


def element_ids(model) -> dict[int, np.ndarray]:
    """Tensor id -> its elements' ids, distinct over the model and never 0 (0 is padding)."""
    out, at = {}, 1
    for t in model.tensors:
        out[t.id] = np.arange(at, at + t.numel, dtype=np.int64).reshape(t.shape)
        at += t.numel
    return out


def rank_arrays(model, mesh: ucl.Mesh, rank: int, ids) -> dict[str, np.ndarray]:
    """What rank ``rank`` of ``mesh`` holds, as element ids, straight from the ShardMap."""
    sm = lower(model, mesh)
    coords = mesh.coords(rank) if not mesh.is_universal else {}
    out = {k: np.zeros(shape, dtype=np.int64) for k, (shape, _) in sm.rank_datasets(rank).items()}
    for t in model.tensors:
        for h in sm.holdings[t.id]:
            if not all(coords.get(a, 0) == v for a, v in h.fixed.items()):
                continue
            for piece in h.pieces:
                for runs in _boxes(piece):
                    glob = tuple(slice(g, g + n) for g, _, n in runs)
                    box_view(out[h.slot.key], h.slot, [l for _, l, _ in runs], [n for _, _, n in runs])[...] = \
                        ids[t.id][glob] if runs else ids[t.id]
    return out


def _boxes(piece) -> list[list[tuple[int, int, int]]]:
    boxes = [[]]
    for d in piece:
        boxes = [b + [tuple(int(x) for x in seg)] for b in boxes for seg in d.segs]
    return boxes


def run_rank(plan, rank: int, sources: dict[int, dict[str, np.ndarray]]) -> tuple[dict, dict]:
    """Rank ``rank``'s expanded rows run one by one: (datasets, times each element was copied to)."""
    shapes = {plan.datasets[d]["key"]: plan.datasets[d]["shape"]
              for r, d in zip(plan.dataset_ranks["rank"], plan.dataset_ranks["dataset"]) if r == rank}
    got = {k: np.zeros(s, dtype=np.int64) for k, s in shapes.items()}
    hits = {k: np.zeros(s, dtype=np.int64) for k, s in shapes.items()}
    c = plan.copies
    for i in np.flatnonzero(c["dst_rank"] == rank):
        src_slot, dst_slot = plan.slots[c["src_slot"][i]], plan.slots[c["dst_slot"][i]]
        box = box_view(sources[int(c["src_rank"][i])][src_slot.key], src_slot, c["src_start"][i], c["size"][i])
        box_view(got[dst_slot.key], dst_slot, c["dst_start"][i], c["size"][i])[...] = box
        box_view(hits[dst_slot.key], dst_slot, c["dst_start"][i], c["size"][i])[...] += 1
    f = plan.fills
    for i in np.flatnonzero(f["dst_rank"] == rank):
        slot = plan.slots[f["dst_slot"][i]]
        box_view(got[slot.key], slot, f["dst_start"][i], f["size"][i])[...] = 0
    return got, hits


def meshes():
    sizes = st.tuples(st.sampled_from([1, 2, 4]), st.sampled_from([1, 2, 3, 5]), st.sampled_from([1, 2]))
    return sizes.map(lambda s: ",".join(f"{a}={n}" for a, n in zip(("pp", "dp", "tp"), s) if n > 1) or "universal")


def check_against_element_ids(model, src: str, dst: str) -> None:
    plan = ucl.compile(model, src, dst)
    src_mesh, dst_mesh = ucl.Mesh.parse(src), ucl.Mesh.parse(dst)
    ids = element_ids(model)
    sources = {r: rank_arrays(model, src_mesh, r, ids) for r in range(src_mesh.size)}
    for r in range(dst_mesh.size):
        want = rank_arrays(model, dst_mesh, r, ids)
        got, hits = run_rank(plan, r, sources)
        assert sorted(got) == sorted(want), r
        for key in want:
            assert np.array_equal(got[key], want[key]), (r, key)
            assert np.array_equal(hits[key] == 1, want[key] != 0), (r, key)  # one copy each, none to padding
            assert hits[key].max(initial=0) <= 1, (r, key)


@settings(deadline=None, max_examples=12, suppress_health_check=[HealthCheck.too_slow])
@given(src=meshes(), dst=meshes())
def test_every_target_element_is_the_source_element_it_should_be(src, dst):
    check_against_element_ids(MODEL, src, dst)


@pytest.mark.parametrize("src,dst", [("tp=2", "dp=64"), ("pp=4,dp=3,tp=2", "universal"), ("universal", "pp=2,dp=5,tp=2")])
def test_element_ids_of_wide_and_consolidating_plans(src, dst):
    check_against_element_ids(MODEL, src, dst)


@pytest.mark.parametrize("name", sorted(V2_CASES))
def test_stored_tables_equal_those_of_the_previous_compiler(name):
    old = ucl.Plan.from_json((FIXTURES / f"{name}.json").read_text())
    plan = ucl.compile(MODEL, *V2_CASES[name])
    assert plan.slots == old.slots
    assert plan.datasets == old.datasets
    assert np.array_equal(plan.rank_sets.offsets, old.rank_sets.offsets)
    assert np.array_equal(plan.rank_sets.ranks, old.rank_sets.ranks)
    for new_t, old_t in ((plan.stored_copies, old.stored_copies), (plan.stored_fills, old.stored_fills),
                         (plan.stored_datasets, old.stored_datasets)):
        assert new_t.keys() == old_t.keys()
        for k in new_t:
            assert np.array_equal(new_t[k], old_t[k]), (name, k)
    assert json.loads(plan.to_json()) == json.loads((FIXTURES / f"{name}.json").read_text())
