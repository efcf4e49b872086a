"""Repeated operations on one checkpoint prepare once: the spec is parsed, bound and each rank's
plan compiled on the first call only (the einops recipe-cache idea), and mesh strings are accepted
wherever a Mesh is."""
from __future__ import annotations

import numpy as np
import pytest

import ucl
import ucl.ops.prepare as prepare
from ucl.demo import llama_model, universal_state
from ucl.lang.spec import Spec


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    model = llama_model()
    truth = universal_state(model, seed=3)
    mesh = ucl.Mesh.parse("pp=2,dp=2,tp=2")
    shards = ucl.execute_memory(ucl.compile(model, ucl.UNIVERSAL, mesh), {0: truth})
    path = ucl.save(tmp_path_factory.mktemp("cache") / "ck", shards, model=model, mesh=mesh)
    expected = ucl.execute_memory(ucl.compile(model, ucl.UNIVERSAL, ucl.Mesh(tp=4)), {0: truth})
    return path, expected


def test_repeated_load_rank_parses_binds_and_compiles_once(checkpoint, monkeypatch):
    path, expected = checkpoint
    calls = {"parse": 0, "compile": 0}
    real_from_text, real_compile = Spec.from_text.__func__, prepare.compile

    def counting_from_text(cls, *a, **k):
        calls["parse"] += 1
        return real_from_text(cls, *a, **k)

    def counting_compile(*a, **k):
        calls["compile"] += 1
        return real_compile(*a, **k)

    monkeypatch.setattr(Spec, "from_text", classmethod(counting_from_text))
    monkeypatch.setattr(prepare, "compile", counting_compile)
    prepare.forget()  # a cold cache, so the first round really prepares
    for rank in range(4):
        got = ucl.load_rank(path, mesh="tp=4", rank=rank)
        assert all(np.array_equal(got[k], v) for k, v in expected[rank].items())
    assert calls == {"parse": 1, "compile": 4}
    for rank in range(4):  # the second round prepares nothing
        got = ucl.load_rank(path, mesh=ucl.Mesh(tp=4), rank=rank)
        assert all(np.array_equal(got[k], v) for k, v in expected[rank].items())
    assert calls == {"parse": 1, "compile": 4}


def test_mesh_strings_everywhere(checkpoint, tmp_path):
    path, expected = checkpoint
    got = ucl.load_rank(path, mesh="tp=4", rank=1)
    assert set(got) == set(expected[1])
    ucl.reshard(path, tmp_path / "u", to="universal")
    ucl.reshard(path, tmp_path / "t", to="tp=4")
    with ucl.open(tmp_path / "t") as c:
        assert c.nranks == 4
    with pytest.raises(ucl.MeshError):
        ucl.load_rank(path, mesh=42, rank=0)
