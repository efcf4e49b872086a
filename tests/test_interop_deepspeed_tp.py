"""DeepSpeed AutoTP (tensor-parallel) checkpoints read in place, checked against DeepSpeed's own tools.

Fixtures tests/fixtures/deepspeed/tp2_* (make_tp.py: transformers LlamaForCausalLM, AutoTP
tp=2 x dp=2, DeepSpeed 0.19.8 on CPU): ``tp2_z1_fp32`` (ZeRO-1, fp32, untied head: column-, row-
and vocab-parallel splits) and ``tp2_z2_bf16_tied`` (ZeRO-2, bf16, tied embeddings: the embedding
split over the vocabulary, ``lm_head.weight`` a shared alias). Ground truth: ``truth_full.safetensors`` is
DeepSpeed's own gather of the trained model (``_replace_module_consolidated_state_dict``, what
``save_16bit_model`` writes), ``truth_universal.safetensors`` is ``ds_to_universal``'s output.
Where each shard lies comes from DeepSpeed's files (``universal_checkpoint_info['affine_map']``);
``truth_tp.json['split']`` records the split dims read independently from local vs. full shapes.
"""
from __future__ import annotations

import json
import shutil
import zipfile
from pathlib import Path

import numpy as np
import pytest

import ucl
from ucl.dtypes import to_numpy
from ucl.errors import StoreError
from ucl.formats.registry import describe
from bits import import_reshard_and_back, same_bits as _same  # noqa: E402

HERE = Path(__file__).parent / "fixtures" / "deepspeed"
FIXTURE = HERE / "tp2_z1_fp32"
NAMES = ["tp2_z1_fp32", "tp2_z2_bf16_tied"]


def _truth(what: str, name: str = "tp2_z1_fp32") -> dict[str, np.ndarray]:
    pytest.importorskip("torch")
    from safetensors.torch import load_file
    return {k: to_numpy(v)[0] for k, v in load_file(str(HERE / name / f"truth_{what}.safetensors")).items()}


def _info(name: str = "tp2_z1_fp32") -> dict:
    return json.loads((HERE / name / "truth_tp.json").read_text())


@pytest.fixture(scope="module")
def loaded():
    return {name: ucl.load_rank(HERE / name, mesh="universal", rank=0) for name in NAMES}


@pytest.mark.parametrize("name", NAMES)
def test_split_dims_are_read_from_the_files(name):
    d, info = describe(HERE / name), _info(name)
    assert dict(d.mesh) == {"tp": 2, "dp": 2}
    assert d.state["autotp"]["split_dims"] == {n: s["split_dim"] for n, s in info["split"].items()}
    assert {n: list(s) for n, s in d.params.items()} == {n: s["full"] for n, s in info["split"].items()}
    assert d.state["deepspeed"]["shared_params"] == info["tied"]


def test_split_dims_come_from_deepspeeds_affine_map():
    d, info = describe(FIXTURE), _info()
    assert dict(d.mesh) == {"tp": 2, "dp": 2}
    assert d.state["autotp"]["split_dims"] == {n: s["split_dim"] for n, s in info["split"].items()}
    assert {n: list(s) for n, s in d.params.items()} == {n: s["full"] for n, s in info["split"].items()}
    assert d.state["deepspeed"]["iteration"] == 3 and d.state["deepspeed"]["mp_world_size"] == 2
    # column-parallel q/k/v/gate/up and the vocab-parallel head split dim 0, row-parallel o/down dim 1
    assert "model.layers.0.self_attn.o_proj.weight [16, 16] : split 1 over tp" in d.spec
    assert "lm_head.weight [64, 16] : split 0 over tp" in d.spec
    assert "model.embed_tokens.weight [64, 16] : replicate" in d.spec


@pytest.mark.parametrize("name", NAMES)
def test_weights_match_deepspeeds_gather(name, loaded):
    got, full, tied = loaded[name], _truth("full", name), _info(name)["tied"]
    assert {k for k in got if k.startswith("param/")} == {f"param/{n}" for n in full if n not in tied}
    for n, want in full.items():  # a tied alias is its target, stored once
        assert _same(got[f"param/{tied.get(n, n)}"], want), n


@pytest.mark.parametrize("name", NAMES)
def test_optimizer_state_matches_ds_to_universal(name, loaded):
    got, truth, info = loaded[name], _truth("universal", name), _info(name)
    master = "fp32" if info["dtype"] != "fp32" else "param"
    kinds = {"fp32": master, "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq", "step": "step"}
    checked = 0
    for key, want in truth.items():
        n, kind = key.rsplit("/", 1)
        if n in info["tied"]:  # ds_to_universal writes a copy (of one tp shard) for the tied alias
            continue
        mine = got[f"{kinds[kind]}/{n}"]
        if kind == "step":
            assert float(mine) == float(want), key
        else:
            assert _same(mine, want.astype(mine.dtype)), key
        checked += 1
    assert checked == 4 * len(info["split"])


def test_a_rank_holds_deepspeeds_shard():
    """tp rank 1 of the stored layout holds exactly mp_rank_01's shards."""
    torch = pytest.importorskip("torch")
    sd = torch.load(FIXTURE / "global_step3" / "mp_rank_01_model_states.pt", map_location="cpu",
                    weights_only=False)["module"]
    got = ucl.load_rank(FIXTURE, mesh="tp=2,dp=2", rank=3)  # rank = t * dp + d
    for n, t in sd.items():
        assert _same(got[f"param/{n}"], t.numpy()), n


@pytest.mark.parametrize("name,to", [("tp2_z1_fp32", "tp=1,dp=3"), ("tp2_z1_fp32", "tp=4,dp=1"),
                                     ("tp2_z2_bf16_tied", "tp=4,dp=3")])
def test_import_reshard_and_back(name, to, tmp_path, loaded):
    import_reshard_and_back(HERE / name, tmp_path, to, loaded[name], {"tp": 2, "dp": 2})


# ---- refusals --------------------------------------------------------------------------------


def _copy_with(tmp_path: Path, old: bytes, new: bytes) -> Path:
    dst = tmp_path / "ck"
    shutil.copytree(FIXTURE, dst, ignore=shutil.ignore_patterns("truth*", "pickles.json"))
    for t in (0, 1):
        pt = dst / "global_step3" / f"mp_rank_{t:02d}_model_states.pt"
        with zipfile.ZipFile(pt) as z:
            items = [(i, z.read(i.filename)) for i in z.infolist()]
        with zipfile.ZipFile(pt, "w", zipfile.ZIP_STORED) as z:
            for info, data in items:
                if info.filename.endswith("data.pkl"):
                    assert old in data
                    data = data.replace(old, new)
                z.writestr(info, data)
    return dst


def test_tp_without_affine_map_is_refused(tmp_path):
    """Without AutoTP's universal_checkpoint_info the split dims are not in DeepSpeed's files."""
    ck = _copy_with(tmp_path, b"affine_map", b"affine_mXp")
    with pytest.raises(StoreError, match="tensor-parallel") as e:
        describe(ck)
    assert e.value.code == "UCL502"


def test_a_parameter_the_affine_map_does_not_name_is_refused(tmp_path):
    ck = _copy_with(tmp_path, b"^lm_head\\.weight$", b"^lm_hXad\\.weight$")
    with pytest.raises(StoreError, match="lm_head.weight: 0 entries") as e:
        describe(ck)
    assert e.value.code == "UCL502"
