"""Lowering reuses the cut of a flat buffer across coordinates whose members have the same layouts
(pipeline stages of equal depth), and one skeleton of it across coordinates whose members have the
same local shapes. The reusing path must give exactly what cutting every buffer on its own gives:
compared here value by value on random specs and meshes, and on a pipeline-parallel ZeRO-1 model
where the reuse actually happens. ``DimLayout.restrict``, which cuts every flat piece, is checked
element by element, and lowering leaves no reference cycles for the collector."""
from __future__ import annotations

import gc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ucl
from tests.test_properties import SETTINGS, bind_or_reject, layouts, mesh_of, meshes
from ucl.demo import LLAMA_MEGATRON, llama_params
from ucl.layout.algebra import DimLayout
from ucl.layout.lower import lower
from tests.passes import examples

# random meshes often fit a tensor loosely: the warning is expected here
# (tests/test_mesh_diagnostics.py checks it)
pytestmark = pytest.mark.filterwarnings("ignore::ucl.layout.fit.MeshFitWarning")


def _piece(piece) -> tuple:
    return tuple((d.local, d.segs.tolist(), d.fills.tolist()) for d in piece)


def _fixed(fixed: dict) -> tuple:
    return tuple(sorted(fixed.items()))


def _as_values(sm) -> dict:
    """Everything a ShardMap says, as plain values (no object identities)."""
    return {
        "holdings": [[(_fixed(h.fixed), h.slot, [_piece(p) for p in h.pieces]) for h in hs] for hs in sm.holdings],
        "fills": [(_fixed(f.fixed), f.slot, f.start, f.length) for f in sm.flat_fills],
        "datasets": [(_fixed(d.fixed), d.key, d.shape, d.dtype) for d in sm.datasets],
    }


def _outcome(model, mesh, reuse: bool):
    try:
        return "ok", _as_values(lower(model, mesh, reuse=reuse))
    except ucl.UclError as e:
        return "error", (type(e).__name__, getattr(e, "code", None), str(e))


@settings(max_examples=examples(150), **SETTINGS)
@given(layout=layouts(), mesh=meshes())
def test_reused_cuts_match_fresh_cuts(layout, mesh):
    model = bind_or_reject(layout)
    m = mesh_of(mesh)
    fresh = _outcome(model, m, reuse=False)
    assert _outcome(model, m, reuse=True) == fresh


@given(hidden=st.sampled_from([8, 16, 24]), dp=st.sampled_from([1, 2, 3]), tp=st.sampled_from([1, 2]))
@settings(max_examples=examples(10), deadline=None)
def test_reuse_on_pipeline_stages(hidden, dp, tp):
    """Megatron ZeRO-1 over dp with layers staged over pp: the middle stages cut alike."""
    dims = dict(vocab=10, hidden=hidden, heads=4, kv_heads=2, ffn=12, layers=8)
    model = ucl.load_spec(LLAMA_MEGATRON).bind(dims, llama_params(dims))
    mesh = ucl.Mesh.parse(f"pp=4,dp={dp},tp={tp}")
    reused = lower(model, mesh)
    assert _as_values(reused) == _as_values(lower(model, mesh, reuse=False))
    # layers 2 and 4 sit at the same place of stages 1 and 2: the very same pieces (one cut)
    a, b = (model.tensor(f"exp_avg/decoder.layers.{i}.mlp.linear_fc2.weight") for i in (2, 4))
    assert [h.pieces for h in reused.holdings[a.id]] == [h.pieces for h in reused.holdings[b.id]]
    assert [h.fixed["pp"] for h in reused.holdings[a.id]] != [h.fixed["pp"] for h in reused.holdings[b.id]]


def test_lowering_restores_the_garbage_collector():
    """Lowering pauses the cyclic collector while it builds its objects, and restores its state,
    also when the layout does not fit the mesh."""
    import gc
    dims = dict(vocab=10, hidden=8, heads=4, kv_heads=2, ffn=12, layers=8)
    model = ucl.load_spec(LLAMA_MEGATRON).bind(dims, llama_params(dims))
    assert gc.isenabled()
    lower(model, ucl.Mesh.parse("pp=2,dp=2,tp=2"))
    assert gc.isenabled()
    try:
        lower(model, ucl.Mesh.parse("pp=3,dp=2,tp=2"))  # 8 layers over 3 stages
    except ucl.UclError:
        pass
    else:
        raise AssertionError("8 layers should not spread evenly over pp=3")
    assert gc.isenabled()
    ucl.compile(model, "pp=2,dp=2,tp=2", "pp=1,dp=2,tp=2")  # compiling pauses it too
    assert gc.isenabled()
    gc.disable()
    try:
        lower(model, ucl.Mesh.parse("pp=4,dp=1,tp=2"), reuse=False)
        assert not gc.isenabled()
    finally:
        gc.enable()


@st.composite
def dim_layouts(draw):
    """A dim's local extent cut into runs, each real data (global starts increasing, gaps allowed)
    or padding, and a window [lo, hi) of it."""
    runs = draw(st.lists(st.tuples(st.booleans(), st.integers(1, 6), st.integers(0, 4)), max_size=6))
    segs, fills, local, glob = [], [], 0, 0
    for real, length, skip in runs:
        if real:
            glob += skip
            segs.append((glob, local, length))
            glob += length
        else:
            fills.append((local, length))
        local += length
    lo = draw(st.integers(0, local))
    hi = draw(st.integers(lo, local))
    layout = DimLayout(local, np.array(segs, dtype=np.int64).reshape(-1, 3),
                       np.array(fills, dtype=np.int64).reshape(-1, 2))
    return layout, lo, hi


def _elements(d: DimLayout) -> dict:
    """Local position -> global index (data) or None (padding), element by element."""
    out = {}
    for g, l, k in d.segs.tolist():
        out.update({l + i: g + i for i in range(k)})
    for l, k in d.fills.tolist():
        out.update({l + i: None for i in range(k)})
    return out


@settings(max_examples=examples(400), deadline=None)
@given(case=dim_layouts())
def test_restrict_keeps_exactly_the_window(case):
    """Post-condition: the restriction maps every position in [lo, hi) as the whole dim does, holds
    nothing else, keeps the whole dim's coordinates, its runs sorted and non-empty, and is hi - lo long."""
    d, lo, hi = case
    r = d.restrict(lo, hi)
    assert r.local == hi - lo
    assert _elements(r) == {p: v for p, v in _elements(d).items() if lo <= p < hi}
    assert r.segs.dtype == np.int64 and r.fills.dtype == np.int64
    assert r.segs.shape[1:] == (3,) and r.fills.shape[1:] == (2,)
    assert np.all(r.segs[:, 2] > 0) and np.all(r.fills[:, 1] > 0)
    assert np.all(np.diff(r.segs[:, 1]) > 0) and np.all(np.diff(r.segs[:, 0]) > 0)


def test_lowering_leaves_no_reference_cycles():
    """Lowering builds ~10^5 objects with the collector paused; none of them may be cyclic garbage
    (a recursive closure per tensor once was), or the first collection after it pays for them."""
    dims = dict(vocab=10, hidden=8, heads=4, kv_heads=2, ffn=12, layers=8)
    model = ucl.load_spec(LLAMA_MEGATRON).bind(dims, llama_params(dims))
    ucl.compile(model, "pp=2,dp=2,tp=2", "pp=1,dp=2,tp=2")  # lazy imports and first-call caches
    gc.collect()
    was = gc.get_debug()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        ucl.compile(model, "pp=4,dp=1,tp=2", "pp=2,dp=4,tp=1")
        ucl.compile(model, "pp=4,dp=1,tp=2", "pp=2,dp=4,tp=1", ranks=[3])
        gc.collect()
        garbage = [type(o).__name__ for o in gc.garbage]
    finally:
        gc.set_debug(was)
        gc.garbage.clear()
    assert garbage == []


def test_paused_collector_promotes_what_lowering_made():
    """What a paused lowering made is moved to the oldest generation on the way out (the next young
    collection does not walk it all), without thawing what someone else froze."""
    from ucl.layout.lower import gc_paused
    gc.collect()
    with gc_paused():
        made = [[i] for i in range(200_000)]  # tracked objects, as a large lowering makes
    assert gc.isenabled()
    oldest = {id(o) for o in gc.get_objects(generation=2)}
    assert id(made) in oldest and id(made[0]) in oldest and id(made[-1]) in oldest
    frozen = [[i] for i in range(10)]
    gc.freeze()
    try:
        before = gc.get_freeze_count()
        with gc_paused():
            more = [[i] for i in range(200_000)]
        # left frozen, and this time no promotion: the count may only drop by the few frozen objects
        # that other threads free meanwhile (CI saw 2), never by a thaw nor rise by 200,000
        after = gc.get_freeze_count()
        assert before - 1000 < after <= before
    finally:
        gc.unfreeze()
    del made, more, frozen


def _proof_outcome(prove):
    try:
        prove()
        return "ok"
    except ucl.UclError as e:
        return getattr(e, "code", None)


@settings(max_examples=examples(150), **SETTINGS)
@given(layout=layouts(), mesh=meshes())
def test_a_flat_tensor_proved_unflattened_as_its_pieces_are(layout, mesh):
    """The target's proof of a tensor in flat buffers is made on its layouts before flattening
    (docs/ir.md): it settles exactly what proving the flat pieces themselves settles."""
    from ucl.plan.proof import dedup_sources
    model = bind_or_reject(layout)
    try:
        sm = lower(model, mesh_of(mesh))
    except ucl.UclError:
        return
    assume = [t for t in model.tensors if t.id in sm.unflattened]
    for t in assume:
        unflattened = _proof_outcome(lambda: dedup_sources(sm, t, "target"))
        pieces = _proof_outcome(lambda: dedup_sources(sm, t, "source"))  # proves the pieces, where they lie
        assert unflattened == pieces, (t.name, t.kind)
