"""Megatron-LM legacy ``distrib_optim.pt`` (--use-distributed-optimizer, --ckpt-format torch) read
in place.

Fixture ``tests/fixtures/megatron_legacy/tp2_dp2_distopt`` (make.py): TP=2 x DP=2, bf16 weights,
Megatron's DistributedOptimizer after one Adam step, saved as Megatron-LM does (DP rank 0 writes
``model_optim_rng.pt`` with ``optimizer`` and ``save_parameter_state``'s ``distrib_optim.pt``).
The oracle is Megatron's: the saved world tensors read with ``torch.load`` and sliced at each
parameter's ``param_index_map`` entry, recorded by make.py from the live DDP buffer
(``truth.json``), assembled into global tensors here by hand with the TP conventions."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

import ucl
from ucl.dtypes import to_numpy
from ucl.errors import StoreError
from ucl.formats.megatron import legacy as megatron_legacy
from bits import same_bits as _same  # noqa: E402

NAME = "tp2_dp2_distopt"
FOLDER = Path(__file__).parent / "fixtures" / "megatron_legacy" / NAME
KINDS = {"param": "fp32", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}
CAT1 = ("linear_proj.weight", "linear_fc2.weight")  # row-parallel: split dim 1
CAT0 = ("word_embeddings.weight", "output_layer.weight", "linear_qkv.weight", "linear_qkv.bias")


def _per_rank_states() -> list[dict[str, np.ndarray]]:
    """Per TP rank: ``KIND/<module name>`` -> the TP-local state, sliced from Megatron's file."""
    torch = pytest.importorskip("torch")
    truth = json.loads((FOLDER / "truth.json").read_text())
    out = []
    for rank in truth["ranks"]:
        saved = torch.load(FOLDER / "iter_0000007" / f"mp_rank_{rank['tp']:02d}" / "distrib_optim.pt", weights_only=True)
        (world,) = saved[0].values()
        (buf,) = rank["buffers"]
        states = {}
        for p in buf["params"]:
            for mkind, kind in KINDS.items():
                states[f"{kind}/{p['name']}"] = world[mkind][p["start"]:p["end"]].reshape(p["shape"]).numpy()
        out.append(states)
    return out


def _global(states: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    out = {}
    for key, r0 in states[0].items():
        r1 = states[1][key]
        if key.endswith(CAT0):
            out[key] = np.concatenate([r0, r1], 0)
        elif key.endswith(CAT1):
            out[key] = np.concatenate([r0, r1], 1)
        elif key.endswith(("linear_fc1.weight", "linear_fc1.bias")):  # SwiGLU: each rank holds [gate_r; up_r]
            h = r0.shape[0] // 2
            out[key] = np.concatenate([r0[:h], r1[:h], r0[h:], r1[h:]], 0)
        else:  # replicated over TP: both ranks agree
            assert _same(r0, r1), key
            out[key] = r0
    return out


def test_every_parameters_optimizer_state_equals_megatrons():
    want = _global(_per_rank_states())
    got = ucl.load_rank(FOLDER, mesh="universal", rank=0)
    assert {k for k in got if not k.startswith("param/")} == set(want)
    for k, v in want.items():
        assert _same(got[k], v), k
    # the bf16 weights are the fp32 masters rounded (Megatron copies them back after the step)
    torch = pytest.importorskip("torch")
    for k in (k for k in got if k.startswith("fp32/")):
        w = got["param/" + k[5:]]
        assert _same(w, to_numpy(torch.from_numpy(got[k]).to(torch.bfloat16))[0]), k


def test_each_rank_holds_the_file_then_zero_padding():
    torch = pytest.importorskip("torch")
    for t in range(2):
        saved = torch.load(FOLDER / "iter_0000007" / f"mp_rank_{t:02d}" / "distrib_optim.pt", weights_only=True)
        (world,) = saved[0].values()
        got = ucl.load_rank(FOLDER, mesh="pp=1,tp=2", rank=t)
        n = world["numel_unpadded"]
        for mkind, kind in KINDS.items():
            flat = got[f"{kind}/@flat0"]
            assert flat.shape == (math.ceil(n / 128) * 128,) and _same(flat[:n], world[mkind].numpy())
            assert not flat[n:].any()


def test_import_and_reshard_over_dp_and_tp_and_back(tmp_path):
    want = ucl.load_rank(FOLDER, mesh="universal", rank=0)
    ucl.import_checkpoint(FOLDER, tmp_path / "imported")
    ucl.reshard(tmp_path / "imported", tmp_path / "dp2", to="pp=1,dp=2,tp=2")
    ucl.reshard(tmp_path / "dp2", tmp_path / "tp1", to="dp=3")
    ucl.reshard(tmp_path / "tp1", tmp_path / "back", to="pp=1,tp=2")
    for path in ("imported", "dp2", "tp1", "back"):
        got = ucl.load_rank(tmp_path / path, mesh="universal", rank=0)
        assert set(got) == set(want) and all(_same(got[k], v) for k, v in want.items()), path
    for t in range(2):
        a = ucl.load_rank(tmp_path / "back", mesh="pp=1,tp=2", rank=t)
        b = ucl.load_rank(FOLDER, mesh="pp=1,tp=2", rank=t)
        assert set(a) == set(b) and all(_same(a[k], b[k]) for k in a), t


def test_description_reads_the_optimizer_and_notes_its_hyperparameters():
    d = megatron_legacy.describe(str(FOLDER))
    assert d.frozen == () and d.state["megatron"]["weights_only"] is False
    groups = d.state["megatron"]["optimizer"]["optimizer"]["param_groups"]
    assert [g["step"] for g in groups] == [1, 1]


def test_a_buffer_size_that_megatrons_rule_does_not_give_is_refused(monkeypatch):
    from ucl.formats.megatron import legacy_optim as megatron_legacy_optim

    monkeypatch.setattr(megatron_legacy_optim, "ALIGN", 32)
    with pytest.raises(StoreError, match="numel_unpadded is 7552") as e:
        megatron_legacy.describe(str(FOLDER))
    assert e.value.code == "UCL502"
