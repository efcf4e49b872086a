"""DeepSpeed native MoE checkpoints read in place, checked against DeepSpeed's own tools.

Fixtures tests/fixtures/deepspeed/moe_* (make_moe.py: two ``deepspeed.moe.layer.MoE`` layers of 4
experts, ep 2 x expert-data-parallel 2 on 4 ranks, DeepSpeed 0.19.8 on CPU): ``moe_ep2_z2_fp32``
(ZeRO-2, fp32) and ``moe_ep2_z1_bf16`` (ZeRO-1, bf16). Ground truth: ``truth_module`` is every
rank's module state dict with DeepSpeed's global expert numbering, ``truth_state`` DeepSpeed's
``safe_get_full_fp32_param`` / ``safe_get_full_optimizer_state`` per parameter (DeepSpeed 0.19.8's
``ds_to_universal`` crashes and ``zero_to_fp32`` refuses on native MoE checkpoints:
README_moe.md). A rank's own bytes are also checked against ``torch.load`` of DeepSpeed's files.
"""
from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import ucl
from corrupt import rewrite_pickle, scramble
from ucl.dtypes import to_numpy
from ucl.errors import StoreError, UclError
from ucl.formats.registry import describe, forget
from bits import import_reshard_and_back, same_bits as _same  # noqa: E402

HERE = Path(__file__).parent / "fixtures" / "deepspeed"
NAMES = ["moe_ep2_z2_fp32", "moe_ep2_z1_bf16"]
FIXTURE = HERE / "moe_ep2_z2_fp32"
EXPERT = "moe{layer}.deepspeed_moe.experts.deepspeed_experts.{e}.{rest}"


def _truth(what: str, name: str) -> dict[str, np.ndarray]:
    pytest.importorskip("torch")
    from safetensors.torch import load_file
    return {k: to_numpy(v)[0] for k, v in load_file(str(HERE / name / f"truth_{what}.safetensors")).items()}


def _info(name: str) -> dict:
    return json.loads((HERE / name / "truth_moe.json").read_text())


@pytest.fixture(scope="module")
def loaded():
    return {name: ucl.load_rank(HERE / name, mesh="universal", rank=0) for name in NAMES}


@pytest.mark.parametrize("name", NAMES)
def test_layout_is_read_from_the_files(name):
    d, info = describe(HERE / name), _info(name)
    assert dict(d.mesh) == {"edp": info["edp"], "ep": info["ep"]}
    # ucl's rank numbering (row-major edp, ep) is DeepSpeed's: rank = edp_rank * ep + ep_rank
    assert all(r["rank"] == r["edp_rank"] * info["ep"] + r["ep_rank"] for r in info["ranks"])
    for layer in (0, 1):
        assert f"moe{layer}.deepspeed_moe.experts.deepspeed_experts.{{e}}.** : index e of 4 over ep" in d.spec
    assert d.state["moe"]["num_experts"] == [4, 4] and d.state["moe"]["ep"] == 2
    assert "flat over (edp, ep) pad to multiple_of(2 * edp * ep)" in d.spec
    assert "flat over edp pad to multiple_of(2 * edp)" in d.spec
    assert d.state["deepspeed"]["iteration"] == 3
    experts = [n for n in d.params if ".deepspeed_experts." in n]
    assert len(experts) == 2 * 4 * 4  # 2 layers x 4 global experts x (fc1, fc2) x (weight, bias)


@pytest.mark.parametrize("name", NAMES)
def test_weights_match_deepspeeds_module(name, loaded):
    got, module = loaded[name], _truth("module", name)
    assert {k for k in got if k.startswith("param/")} == {f"param/{n}" for n in module}
    for n, want in module.items():
        assert _same(got[f"param/{n}"], want), n
    # the experts differ, so a swapped expert could not pass
    a, b = (module[EXPERT.format(layer=1, e=e, rest="fc1.weight")] for e in (1, 2))
    assert not np.array_equal(a, b)


@pytest.mark.parametrize("name", NAMES)
def test_optimizer_state_matches_deepspeeds_gather(name, loaded):
    got, truth, info = loaded[name], _truth("state", name), _info(name)
    master = "fp32" if info["dtype"] != "fp32" else "param"
    for key, want in truth.items():
        n, kind = key.rsplit("/", 1)
        assert _same(got[f"{master if kind == 'fp32' else kind}/{n}"], want), key
    trainable = {k.rsplit("/", 1)[0] for k in truth}
    assert len(truth) == 3 * len(trainable) and len(trainable) == 8 + 32
    assert {float(got[f"step/{n}"]) for n in trainable} == {float(info["steps"])}


@pytest.mark.parametrize("name", NAMES)
def test_a_rank_holds_deepspeeds_own_bytes(name):
    """Rank 3 of the stored layout (edp 1, ep 1) holds global experts 2, 3 under their local
    names, and its expert flat buffers are DeepSpeed's rank-3 partitions."""
    torch = pytest.importorskip("torch")
    tag = HERE / name / "global_step3"
    got = ucl.load_rank(HERE / name, mesh="edp=2,ep=2", rank=3)
    for layer in (0, 1):
        for local in (0, 1):
            sd = torch.load(tag / f"layer_{layer}_expert_{2 + local}_mp_rank_00_model_states.pt", weights_only=True)
            for rest in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"):
                want = sd[EXPERT.format(layer=layer, e=2 + local, rest=rest)]
                assert _same(got[f"param/{EXPERT.format(layer=layer, e=local, rest=rest)}"], to_numpy(want)[0])
    prefix = "bf16_" if "bf16" in name else ""
    osd = _torch_load_inert(tag / f"{prefix}zero_pp_rank_3_mp_rank_00_optim_states.pt")["optimizer_state_dict"]
    for g in (2, 3):  # the expert groups
        for kind in ("exp_avg", "exp_avg_sq"):
            want = to_numpy(osd["base_optimizer_state"]["state"][g][kind])[0]
            assert _same(got[f"{kind}/@flat{g}"], want), (g, kind)


def _torch_load_inert(path: Path):
    """torch.load of an optimizer file with DeepSpeed's classes as empty records: DeepSpeed is not
    imported (test_interop_deepspeed.py checks it stays out of the process)."""
    import pickle
    import types

    import torch

    class Record:
        def __init__(self, *args, **kwargs):
            pass

        def __setstate__(self, state):
            pass

    class Unpickler(pickle.Unpickler):
        def find_class(self, module, name):
            if module.split(".")[0] == "deepspeed":
                return type(name, (Record,), {})
            return super().find_class(module, name)

    return torch.load(path, weights_only=False, pickle_module=types.SimpleNamespace(
        Unpickler=Unpickler, load=pickle.load, __name__="inert"))


@pytest.mark.parametrize("name,to", [("moe_ep2_z2_fp32", "edp=1,ep=4"), ("moe_ep2_z2_fp32", "edp=3,ep=1"),
                                     ("moe_ep2_z1_bf16", "edp=4,ep=2")])
def test_import_reshard_and_back(name, to, tmp_path, loaded):
    import_reshard_and_back(HERE / name, tmp_path, to, loaded[name], {"edp": 2, "ep": 2})


@settings(max_examples=5, deadline=None)
@given(edp=st.integers(1, 4), ep=st.sampled_from([1, 2, 4]))
def test_any_layout_round_trips(edp, ep):
    """DeepSpeed's layout -> (edp, ep) -> DeepSpeed's own (edp=2, ep=2) -> universal: unchanged."""
    universal = ucl.load_rank(FIXTURE, mesh="universal", rank=0)
    with tempfile.TemporaryDirectory() as tmp:
        ucl.reshard(FIXTURE, Path(tmp, "a"), to=f"edp={edp},ep={ep}")
        ucl.reshard(Path(tmp, "a"), Path(tmp, "b"), to="edp=2,ep=2")
        for r in range(4):  # each rank of the round trip is DeepSpeed's rank, as read in place
            mine, theirs = ucl.load_rank(Path(tmp, "b"), mesh="edp=2,ep=2", rank=r), \
                ucl.load_rank(FIXTURE, mesh="edp=2,ep=2", rank=r)
            assert mine.keys() == theirs.keys() and all(_same(mine[k], theirs[k]) for k in mine)
        again = ucl.load_rank(Path(tmp, "b"), mesh="universal", rank=0)
    assert all(_same(again[k], v) for k, v in universal.items())


# ---- hostile input ----------------------------------------------------------------------------


def _copy(tmp_path: Path) -> Path:
    dst = tmp_path / "ck"
    shutil.copytree(FIXTURE, dst, ignore=shutil.ignore_patterns("truth*", "pickles.json"))
    forget()
    return dst


def test_a_truncated_expert_file_is_refused(tmp_path):
    folder = _copy(tmp_path)
    pt = folder / "global_step3" / "layer_1_expert_3_mp_rank_00_model_states.pt"
    pt.write_bytes(pt.read_bytes()[:1500])
    with pytest.raises(StoreError) as e:
        ucl.load_rank(folder, mesh="universal", rank=0)
    assert e.value.code == "UCL500" and "layer_1_expert_3" in str(e.value)


def test_a_missing_expert_file_is_named(tmp_path):
    folder = _copy(tmp_path)
    (folder / "global_step3" / "layer_0_expert_2_mp_rank_00_model_states.pt").unlink()
    with pytest.raises(StoreError, match="lacks layer_0_expert_2_mp_rank_00") as e:
        ucl.load_rank(folder, mesh="universal", rank=0)
    assert e.value.code == "UCL502"


def test_an_expert_file_holding_another_expert_is_refused(tmp_path):
    folder = _copy(tmp_path)
    pt = folder / "global_step3" / "layer_0_expert_2_mp_rank_00_model_states.pt"
    rewrite_pickle(pt, lambda data: data.replace(b"deepspeed_experts.2.", b"deepspeed_experts.3."))
    with pytest.raises(StoreError, match="should hold the trained parameters of expert 2") as e:
        describe(folder)
    assert e.value.code == "UCL502"


def test_mutated_expert_files_give_ucl_errors_only(tmp_path):
    import random
    rng = random.Random(5)
    for i in range(20):
        folder = _copy(tmp_path / f"c{i}")
        scramble(folder / "global_step3" / f"layer_{rng.randrange(2)}_expert_{rng.randrange(4)}_mp_rank_00_model_states.pt",
                 rng)
        forget()
        try:
            ucl.load_rank(folder, mesh="edp=1,ep=2", rank=1)
        except UclError:
            pass


@pytest.mark.parametrize("file,old,new,match", [
    # D + E rank order (ep rank = rank // edp) would place experts elsewhere: refused, not misread
    ("mp_rank_00_model_states.pt", b"X\x14\x00\x00\x00wall_clock_breakdownq\x9d\x89",
     b"X\x22\x00\x00\x00use_data_before_expert_parallelismq\x9d\x88", "use_data_before_expert_parallelism"),
    ("mp_rank_00_model_states.pt", b"num_expertsq\xa0]q\xa1(K\x04K\x04e", b"num_expertsq\xa0]q\xa1(K\x04K\x08e",
     "do not share one expert-parallel size"),
    ("zero_pp_rank_0_mp_rank_00_optim_states.pt", b"ep_size_2", b"ep_size_4", "but the experts say ep=2"),
])
def test_metadata_that_disagrees_is_refused(tmp_path, file, old, new, match):
    folder = _copy(tmp_path)

    def edit(data: bytes) -> bytes:
        assert old in data
        return data.replace(old, new)
    rewrite_pickle(folder / "global_step3" / file, edit)
    with pytest.raises(StoreError, match=match) as e:
        describe(folder)
    assert e.value.code == "UCL502"
