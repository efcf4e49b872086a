"""What later layers derive from a bound model (lowering, proofs, plans, replica sets) is cached in
caches each owned by the one module whose pure function they memoise (a class private to it, so
no other module can name it), and they die with the model: nothing module-global keeps a model or
a map of it alive."""
from __future__ import annotations

import gc
import weakref

import ucl
from ucl.demo import llama_model
from ucl.ops.prepare import plan_for
from ucl.ops.read_once import replica_sets


def _exercise(model) -> None:
    src, dst = ucl.Mesh.parse("pp=2,dp=2,tp=2"), ucl.Mesh.parse("pp=1,dp=2,tp=4")
    ucl.compile(model, src, dst, ranks=[3])  # focused lowering, proofs, per-map indexes
    plan_for(model, src, dst)  # whole lowering, a cached plan
    replica_sets(model, dst)


def test_each_cache_is_private_to_the_module_that_fills_it():
    model = llama_model()
    _exercise(model)
    owners = {(t.__module__, t.__name__) for t in model.derived._by_owner}
    assert {m for m, _ in owners} == {"ucl.layout.lower", "ucl.plan.proof", "ucl.ops.prepare", "ucl.ops.read_once"}
    assert all(name.startswith("_") for _, name in owners), owners
    sm = ucl.layout.lower(model, ucl.Mesh.parse("pp=1,dp=2,tp=4"))
    assert {(t.__module__, t.__name__[:1]) for t in sm.derived._by_owner} <= {("ucl.plan.compile", "_")}


def test_the_caches_die_with_the_model():
    model = llama_model()
    _exercise(model)
    gone = weakref.ref(model)
    del model
    gc.collect()  # a ShardMap and the model refer to each other through the cache
    assert gone() is None
