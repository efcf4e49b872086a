"""Megatron-core torch_dist checkpoints read in place, checked against Megatron's own loader.

The fixtures (tests/fixtures/megatron, made by make.py with megatron-core 0.16.1 on CPU) carry what
``dist_checkpointing.load_plain_tensors`` returned for each folder (truth_plain.safetensors); the
oracle is Megatron's, and megatron-core is not needed here."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

import ucl
from ucl.dtypes import to_numpy
from ucl.formats.registry import describe
from bits import same_bits as _same  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures" / "megatron"
READ = ["tp2", "pp2", "tp2_dp2_optim_fully"]


def _truth(name: str) -> dict[str, np.ndarray]:
    pytest.importorskip("torch")
    from safetensors.torch import load_file
    return {k: to_numpy(v)[0] for k, v in load_file(str(FIXTURES / name / "truth_plain.safetensors")).items()}


def _key(megatron_key: str) -> str:
    if megatron_key.startswith("optimizer.state."):
        kind, _, name = megatron_key[len("optimizer.state."):].partition(".")
        return f"{'fp32' if kind == 'param' else kind}/{name}"
    return f"param/{megatron_key}"


@pytest.mark.parametrize("name", READ)
def test_in_place_equals_load_plain_tensors(name):
    truth = _truth(name)
    got = ucl.load_rank(FIXTURES / name, mesh="universal", rank=0)
    assert set(got) == {_key(k) for k in truth}
    for k, v in truth.items():
        assert _same(got[_key(k)], v), k


@pytest.mark.parametrize("name", READ)
def test_import_reshard_and_back(name, tmp_path):
    truth = _truth(name)
    ucl.import_checkpoint(FIXTURES / name, tmp_path / "imported")
    ucl.reshard(FIXTURES / name, tmp_path / "tp3", to="tp=3")
    ucl.reshard(tmp_path / "tp3", tmp_path / "back", to="universal")
    for path in (tmp_path / "imported", tmp_path / "back"):
        got = ucl.load_rank(path, mesh="universal", rank=0)
        assert all(_same(got[_key(k)], v) for k, v in truth.items()), path.name


def test_detected_as_megatron_with_its_common_state():
    d = describe(FIXTURES / "tp2_dp2_optim_fully")
    assert d.format == "megatron" and d.spec_name == "megatron-torch_dist"
    assert d.state["megatron"]["metadata"]["sharded_backend"] == "torch_dist"
    assert d.state["megatron"]["common"]["iteration"] == 1
    # the fp32 master and both moments of every parameter, stacked layers included
    assert d.params["decoder.layers.self_attention.linear_qkv.weight"] == (2, 32, 16)
    kinds = {k.partition("/")[0] for k in d.extents[0]}
    assert {"param", "fp32", "exp_avg", "exp_avg_sq"} <= kinds


def test_dp_reshardable_folders_are_read_weights_and_buckets():
    # the buckets themselves: tests/test_interop_megatron_dp_reshardable.py
    d = describe(FIXTURES / "dp2_optim")
    assert d.mesh == (("dp", 2),) and d.state["megatron"]["common"]["iteration"] == 1
    assert {"param/decoder.layers.1.mlp.linear_fc1.weight", "fp32/@flat0", "exp_avg_sq/@flat0"} <= set(d.extents[1])


@pytest.mark.parametrize("name", READ + ["dp2_optim", "tp2_dp2_optim", "pp2_dp2_optim"])
def test_mesh_is_the_runs_own_axes(name):
    """The axes are Megatron's, sized as the generator ran it (truth.json's layout), never made up:
    a TP=2 run is tp=2, not dp=2,tp=2,tp2=2."""
    layout = json.loads((FIXTURES / name / "truth.json").read_text())["layout"]
    d = describe(FIXTURES / name)
    assert set(d.mesh) <= {(a, layout[a]) for a in ("pp", "dp", "tp")}  # the bucket reader leaves out size-1 pp, tp
    assert math.prod(n for _, n in d.mesh) == layout["pp"] * layout["dp"] * layout["tp"]
    assert not any(a[-1].isdigit() for a, _ in d.mesh)


def test_stages_and_tp_splits_are_megatrons():
    pp2 = describe(FIXTURES / "pp2")
    assert "decoder.layers.self_attention.linear_qkv.weight [2, 32, 16] : split 0 over pp\n" in pp2.spec
    assert "embedding.word_embeddings.weight [128, 16] : on pp = first" in pp2.spec
    assert "output_layer.weight [128, 16] : on pp = last" in pp2.spec
    assert pp2.state["megatron"]["layout"]["from"]["pp"] == "the ranks that wrote each layer"
    tp2 = describe(FIXTURES / "tp2_dp2_optim_fully")
    assert "linear_fc1.weight [2, 64, 16] : split 0 over pp; view 1 as [2, 32]; split 1.1 over tp uneven" in tp2.spec
    assert "output_layer.weight [64, 16] : split 0 over tp uneven; on pp = last" in tp2.spec
    assert len(tp2.extents) == 4  # dp=2 x tp=2, as run: the replicas' datasets are the same bytes
    assert tp2.extents[0] == tp2.extents[2] and tp2.extents[1] == tp2.extents[3]
