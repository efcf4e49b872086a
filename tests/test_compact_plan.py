"""Compact plans (docs/ir.md, version 2): rows stored once per set of target replica ranks.

Oracles: version-1 plans (one row per target rank) written by the tiling compiler that preceded
compact plans (tests/fixtures/plan_v1, made from the demo model below), per-rank compiles, and an
element count of every target dataset (each element written by exactly one copy, or a fill)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ucl
from ucl.demo import llama_model, universal_state
from ucl.layout.boxes import box_view
from ucl.layout.lower import lowered

FIXTURES = Path(__file__).parent / "fixtures" / "plan_v1"
SMALL = dict(vocab=200, hidden=32, heads=4, kv_heads=2, ffn=40, layers=4)  # what the fixtures were made from
V1_CASES = {"llama_pp2dp2tp2_to_dp4tp2": ("pp=2,dp=2,tp=2", "dp=4,tp=2"),
            "llama_universal_to_pp2dp3tp2": ("universal", "pp=2,dp=3,tp=2"),
            "llama_tp2dp2_to_universal": ("dp=2,tp=2", "universal")}
SETTINGS = dict(deadline=None, max_examples=10, suppress_health_check=[HealthCheck.too_slow])
MODEL = llama_model(SMALL)


def row_set(table: dict, rank_col: str = "dst_rank") -> list[tuple]:
    """A table's rows as sorted tuples (the order of replica rows is not part of the format)."""
    n = len(table[rank_col])
    if not n:
        return []
    cols = [np.asarray(table[k]).reshape(n, -1) for k in sorted(table)]
    return sorted(map(tuple, np.concatenate(cols, axis=1).tolist()))


def rows_of_rank(table: dict, rank: int) -> list[tuple]:
    sel = np.asarray(table["dst_rank"]) == rank
    return row_set({k: np.asarray(v)[sel] for k, v in table.items()})


def resolved(plan, table: dict) -> dict:
    """``table`` with slot indices replaced by the slots themselves (plans number slots apart)."""
    names = np.array([str(s) for s in plan.slots] or [""], dtype=object)
    return {k: (names[v] if k.endswith("_slot") else np.asarray(v).astype(object)) for k, v in table.items()}


def resolved_rank_rows(plan, table: str, rank: int) -> list[tuple]:
    """``rank``'s rows of a table, resolved (slots by value), sorted: rows are ordered by source
    slot number, and slots equal in value (one flat view in several buffers) are numbered in order
    of first use, which differs between the whole plan and a rank's (docs/ir.md: the same rows)."""
    t = resolved(plan, getattr(plan, table))
    sel = np.asarray(t["dst_rank"]) == rank
    if not sel.any():
        return []
    cols = [np.asarray(t[k])[sel].reshape(int(sel.sum()), -1) for k in sorted(t)]
    return sorted(map(tuple, np.concatenate(cols, axis=1).tolist()))


@pytest.mark.parametrize("name", sorted(V1_CASES))
def test_expanded_compact_plan_equals_the_v1_plan_row_for_row(name):
    v1 = json.loads((FIXTURES / f"{name}.json").read_text())
    plan = ucl.compile(MODEL, *V1_CASES[name])
    assert plan.stored_rows <= len(v1["copies"]["tensor"]) + len(v1["fills"]["tensor"])
    assert [[s.key, s.base, list(s.shape), list(s.dataset_shape)] for s in plan.slots] == v1["slots"]
    assert [dict(d, shape=list(d["shape"])) for d in plan.datasets] == v1["datasets"]
    assert row_set(plan.copies) == row_set(v1["copies"])
    assert row_set(plan.fills) == row_set(v1["fills"])
    assert row_set(plan.dataset_ranks, "rank") == row_set(v1["dataset_ranks"], "rank")
    assert plan.rows == len(v1["copies"]["tensor"]) + len(v1["fills"]["tensor"])
    # each rank's rows keep the source order of the format: sorted by src_rank, src_slot, src_start
    for r in np.unique(plan.copies["dst_rank"]):
        c = plan.copies
        sel = c["dst_rank"] == r
        keys = np.concatenate([c["src_rank"][sel][:, None], c["src_slot"][sel][:, None], c["src_start"][sel]], axis=1)
        assert [tuple(k) for k in keys.tolist()] == sorted(tuple(k) for k in keys.tolist())


@pytest.mark.parametrize("name", sorted(V1_CASES))
def test_a_v1_plan_is_read_and_runs_like_the_compiled_one(name):
    text = (FIXTURES / f"{name}.json").read_text()
    old, new = ucl.Plan.from_json(text), ucl.compile(MODEL, *V1_CASES[name])
    assert row_set(old.copies) == row_set(new.copies) and row_set(old.fills) == row_set(new.fills)
    assert old.bytes_read_per_rank().tolist() == new.bytes_read_per_rank().tolist()
    assert (old.bytes_read, old.bytes_unique, old.rows) == (new.bytes_read, new.bytes_unique, new.rows)
    src = ucl.compile(MODEL, "universal", V1_CASES[name][0])
    shards = ucl.execute_memory(src, {0: universal_state(MODEL)})
    want, got = ucl.execute_memory(new, shards), ucl.execute_memory(old, shards)
    assert want.keys() == got.keys()
    for r in want:
        assert want[r].keys() == got[r].keys()
        for k in want[r]:
            assert want[r][k].tobytes() == got[r][k].tobytes(), (r, k)
    again = ucl.Plan.from_json(old.to_json())  # written back as version 2
    assert json.loads(old.to_json())["version"] == 2 and row_set(again.copies) == row_set(new.copies)


def test_replicas_are_stored_once():
    plan = ucl.compile(MODEL, "pp=2,dp=2,tp=2", "dp=4,tp=2")
    weights = [i for i, t in enumerate(plan.tensors) if t["kind"] == "param"]
    c = plan.stored_copies
    sel = np.isin(c["tensor"], weights)
    assert plan.rank_sets.sizes[c["dst_set"][sel]].min() == 4  # every weight row: all 4 dp replicas at once
    assert plan.copy_count == len(plan.copies["tensor"]) > len(c["tensor"])


def check_coverage(plan, rank: int) -> None:
    """Every element of every dataset of ``rank`` is written by exactly one copy, or is a fill."""
    counts = {d["key"]: np.zeros(d["shape"], dtype=np.int64) for d in ucl.plan.execute.rank_datasets(plan, rank)}
    for table, weight in ((plan.copies, 1), (plan.fills, 1000)):
        for i in np.flatnonzero(table["dst_rank"] == rank):
            slot = plan.slots[table["dst_slot"][i]]
            box_view(counts[slot.key], slot, table["dst_start"][i], table["size"][i])[...] += weight
    for key, n in counts.items():
        assert set(np.unique(n).tolist()) <= {1, 1000}, (rank, key, np.unique(n))


def meshes():
    sizes = st.tuples(st.sampled_from([1, 2, 4]), st.sampled_from([1, 2, 3]), st.sampled_from([1, 2]))
    return sizes.map(lambda s: ",".join(f"{a}={n}" for a, n in zip(("pp", "dp", "tp"), s) if n > 1) or "universal")


@settings(**SETTINGS)
@given(src=meshes(), dst=meshes())
def test_compact_plan_per_rank_equals_per_rank_compiles(src, dst):
    plan = ucl.compile(MODEL, src, dst)
    per_rank = plan.bytes_read_per_rank()
    ones = [ucl.compile(MODEL, src, dst, ranks=[r]) for r in range(ucl.Mesh.parse(dst).size)]
    assert plan.rows == sum(one.rows for one in ones)
    for r, one in enumerate(ones):
        cut = plan.for_ranks([r])
        for table in ("copies", "fills"):
            want = row_set(resolved(one, getattr(one, table)))
            assert rows_of_rank(resolved(plan, getattr(plan, table)), r) == want
            assert row_set(resolved(cut, getattr(cut, table))) == want
        assert sorted(ucl.plan.execute.rank_datasets(plan, r), key=str) == \
            sorted(ucl.plan.execute.rank_datasets(one, r), key=str)
        assert int(per_rank[r]) == one.bytes_read
        stored = plan.stored_rows_for(r)
        mine = {k: v[stored] for k, v in plan.stored_copies.items() if k != "dst_set"}
        assert row_set(mine, "tensor") == row_set({k: v for k, v in cut.stored_copies.items() if k != "dst_set"},
                                                  "tensor")
        assert len(stored) == len(one.copies["tensor"])
        check_coverage(cut, r)


@settings(**SETTINGS)
@given(src=meshes(), dst=meshes(), data=st.data())
def test_one_rank_plans_of_a_fresh_model_equal_the_full_plan(src, dst, data):
    """What load_rank compiles in a fresh process: ranks=[r] on a model with nothing cached lowers
    only the tensors placed where r is, on both meshes (three stages in, the whole model); every
    rank's rows and datasets are those of the full plan (oracle: the full plan of another model
    object, lowered whole)."""
    full = ucl.compile(MODEL, src, dst)
    fresh = llama_model(SMALL)
    n = ucl.Mesh.parse(dst).size
    for i, r in enumerate(data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=4))):
        one = ucl.compile(fresh, src, dst, ranks=[r])
        if i == 0 and n > 1:  # the focused lowering was used, not the whole model's
            assert lowered(fresh, ucl.Mesh.parse(dst)) == "focused"
        for table in ("copies", "fills"):
            assert row_set(resolved(one, getattr(one, table))) == \
                rows_of_rank(resolved(full, getattr(full, table)), r), (r, table)
        assert sorted(ucl.plan.execute.rank_datasets(one, r), key=str) == \
            sorted(ucl.plan.execute.rank_datasets(full, r), key=str)
        assert int(one.bytes_read) == int(full.bytes_read_per_rank()[r])


@settings(**SETTINGS)
@given(src=meshes(), dst=meshes())
def test_json_round_trip(src, dst):
    plan = ucl.compile(MODEL, src, dst)
    again = ucl.Plan.from_json(plan.to_json())
    assert np.array_equal(again.rank_sets.offsets, plan.rank_sets.offsets)
    assert np.array_equal(again.rank_sets.ranks, plan.rank_sets.ranks)
    for a, b in ((again.stored_copies, plan.stored_copies), (again.stored_fills, plan.stored_fills),
                 (again.stored_datasets, plan.stored_datasets)):
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    assert again.summary() == plan.summary() and again.slots == plan.slots and again.datasets == plan.datasets


def _edited(**changes) -> str:
    d = json.loads(ucl.compile(MODEL, "dp=2,tp=2", "pp=2,dp=2").to_json())
    for path, value in changes.items():
        node = d
        *head, last = path.split("__")
        for k in head:
            node = node[k]
        node[last] = value
    return json.dumps(d)


@pytest.mark.parametrize("changes, words", [
    (dict(version=3), "plan version 3"),
    (dict(version="2"), "plan version '2'"),
    (dict(rank_sets__offsets=[1, 2]), "version 2"),
    (dict(rank_sets__ranks=[9, 9, 9, 9]), "version 2"),
    (dict(copies__dst_set=[99]), "version 2"),
])
def test_bad_plans_are_refused_naming_the_version(changes, words):
    with pytest.raises(ucl.PlanError) as info:
        ucl.Plan.from_json(_edited(**changes))
    assert info.value.code == "UCL312" and words in str(info.value)


def test_v1_without_rank_columns_is_malformed():
    d = json.loads((FIXTURES / "llama_tp2dp2_to_universal.json").read_text())
    del d["copies"]["dst_rank"]
    with pytest.raises(ucl.PlanError) as info:
        ucl.Plan.from_json(json.dumps(d))
    assert info.value.code == "UCL312" and "version 1" in str(info.value)


def test_execute_memory_refuses_sources_that_do_not_fit_the_plan():
    """A larger array was read in part, a float64 one cast down silently, a wrong-rank one crashed
    with IndexError: each is UCL315 naming the dataset, before anything is copied."""
    spec = ucl.load_spec("dims n\nmesh tp\nw [n, 4] : split 0 over tp\nstate param : dtype float32\n")
    model = spec.bind({"n": 8}, {"w": (8, 4)})
    plan = ucl.compile(model, ucl.UNIVERSAL, "tp=2")
    good = np.arange(32, dtype=np.float32).reshape(8, 4)
    assert ucl.execute_memory(plan, {0: {"param/w": good}})[1]["param/w"].tobytes() == good[4:].tobytes()
    for bad in (np.zeros((16, 4), np.float32), np.zeros((8, 4), np.float64), np.zeros(3, np.float32)):
        with pytest.raises(ucl.PlanError, match=r"'param/w' is .* the plan reads it as float32 \[8, 4\]") as e:
            ucl.execute_memory(plan, {0: {"param/w": bad}})
        assert e.value.code == "UCL315"
    with pytest.raises(ucl.PlanError, match="has no dataset 'param/w'"):
        ucl.execute_memory(plan, {0: {}})
