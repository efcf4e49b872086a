"""Megatron-LM legacy checkpoints (``iter_N/mp_rank_TT[_PPP]/model_optim_rng.pt``) read in place.

The fixtures (tests/fixtures/megatron_legacy, made by make.py with megatron-core 0.16.1's GPTModel
on CPU) carry each rank's live module state dict (``truth_rank{tp}_{pp}.safetensors``): the oracle
is Megatron's module, not ucl. The global (universal) tensors are checked against the TP/PP
conventions assembled here by hand from those per-rank truths."""
from __future__ import annotations

import json
import os
import pickle
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

import ucl
from corrupt import rewrite_pickle
from ucl.dtypes import to_numpy
from ucl.errors import StoreError
from ucl.formats.registry import describe, detect_format
from bits import same_bits as _same  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures" / "megatron_legacy"
NAMES = ["tp2", "tp2_pp2", "pp2_tied_fp32", "pp2_vpp2"]
PWNED = "/tmp/ucl-pwned-by-megatron-legacy-pickle"


def _layout(name: str) -> dict:
    return json.loads((FIXTURES / name / "truth.json").read_text())["layout"]


def _mesh(name: str) -> str:
    lay = _layout(name)
    return f"pp={lay['pp']},tp={lay['tp']}"


def _truth(name: str, tp: int, pp: int) -> dict[str, np.ndarray]:
    """``<model key>.<name as Megatron's module names it>`` -> the live module's tensor."""
    pytest.importorskip("torch")
    from safetensors.torch import load_file
    return {k: to_numpy(v)[0] for k, v in load_file(str(FIXTURES / name / f"truth_rank{tp}_{pp}.safetensors")).items()}


def _ucl_key(name: str, truth_key: str, pp_rank: int) -> str:
    """Where a rank's tensor is expected in ucl's local naming: virtual chunk c's layer j is the
    rank's layer c * per_chunk + j; a tied embedding's copy on the last stage is the embedding."""
    lay = _layout(name)
    model, _, local = truth_key.partition(".")
    chunk = int(model[5:]) if model != "model" else 0
    per_chunk = lay["layers"] // (lay["pp"] * (lay["vpp"] or 1))
    m = re.match(r"decoder\.layers\.(\d+)\.(.*)", local)
    if m:
        local = f"decoder.layers.{chunk * per_chunk + int(m.group(1))}.{m.group(2)}"
    if lay["tied"] and local == "output_layer.weight" and pp_rank == lay["pp"] - 1:
        local = "embedding.word_embeddings.weight"
    return f"param/{local}"


def _ranks(name: str):
    lay = _layout(name)
    for p in range(lay["pp"]):
        for t in range(lay["tp"]):
            yield p * lay["tp"] + t, t, p


def _assert_rank_equals_truth(name: str, got: dict, t: int, p: int) -> None:
    truth = _truth(name, t, p)
    want = {_ucl_key(name, k, p): v for k, v in truth.items()}
    assert len(want) == len(truth) and set(got) == set(want)
    for k, v in want.items():
        assert _same(got[k], v), (name, t, p, k)


@pytest.mark.parametrize("name", NAMES)
def test_each_rank_in_place_equals_the_live_module(name):
    for rank, t, p in _ranks(name):
        _assert_rank_equals_truth(name, ucl.load_rank(FIXTURES / name, mesh=_mesh(name), rank=rank), t, p)


def test_universal_tensors_follow_megatrons_tp_conventions():
    # built by hand from the two TP ranks: QKV interleaved per query group (whole groups per
    # rank), SwiGLU [gate_r; up_r] per rank, row-parallel dim 1, the padded vocabulary as stored
    r0, r1 = _truth("tp2", 0, 0), _truth("tp2", 1, 0)
    g = ucl.load_rank(FIXTURES / "tp2", mesh="universal", rank=0)
    L = "decoder.layers.1."
    cat0 = lambda k: np.concatenate([r0["model." + k], r1["model." + k]], 0)  # noqa: E731
    cat1 = lambda k: np.concatenate([r0["model." + k], r1["model." + k]], 1)  # noqa: E731
    assert _same(g["param/embedding.word_embeddings.weight"], cat0("embedding.word_embeddings.weight"))
    assert g["param/embedding.word_embeddings.weight"].shape == (256, 16)  # padded_vocab_size rows
    assert _same(g["param/output_layer.weight"], cat0("output_layer.weight"))
    assert _same(g[f"param/{L}self_attention.linear_qkv.weight"], cat0(L + "self_attention.linear_qkv.weight"))
    assert _same(g[f"param/{L}self_attention.linear_proj.weight"], cat1(L + "self_attention.linear_proj.weight"))
    assert _same(g[f"param/{L}mlp.linear_fc2.weight"], cat1(L + "mlp.linear_fc2.weight"))
    fc1 = [r["model." + L + "mlp.linear_fc1.weight"] for r in (r0, r1)]
    gate_up = np.concatenate([fc1[0][:16], fc1[1][:16], fc1[0][16:], fc1[1][16:]], 0)
    assert _same(g[f"param/{L}mlp.linear_fc1.weight"], gate_up)
    assert _same(g[f"param/{L}input_layernorm.weight"], r1["model." + L + "input_layernorm.weight"])
    assert _same(g[f"param/{L}mlp.linear_fc2.bias"], r0["model." + L + "mlp.linear_fc2.bias"])


def test_universal_layers_follow_the_pipeline_and_virtual_stages():
    g = ucl.load_rank(FIXTURES / "pp2_vpp2", mesh="universal", rank=0)
    # 4 layers, pp=2, vpp=2: chunk c of stage p holds global layer c * 2 + p
    for p in range(2):
        truth = _truth("pp2_vpp2", 0, p)
        for c in range(2):
            key = f"model{c}.decoder.layers.0.mlp.linear_fc1.weight"
            assert _same(g[f"param/decoder.layers.{c * 2 + p}.mlp.linear_fc1.weight"], truth[key])
    assert _same(g["param/output_layer.weight"], _truth("pp2_vpp2", 0, 1)["model1.output_layer.weight"])


def test_tied_embedding_is_one_tensor_held_by_both_ends():
    first, last = _truth("pp2_tied_fp32", 0, 0), _truth("pp2_tied_fp32", 0, 1)
    emb = first["model.embedding.word_embeddings.weight"]
    assert _same(last["model.output_layer.weight"], emb)  # Megatron synchronised the copies at init
    g = ucl.load_rank(FIXTURES / "pp2_tied_fp32", mesh="universal", rank=0)
    assert "param/output_layer.weight" not in g and _same(g["param/embedding.word_embeddings.weight"], emb)
    assert _same(g["param/decoder.layers.1.self_attention.linear_qkv.weight"],
                 last["model.decoder.layers.0.self_attention.linear_qkv.weight"])


@pytest.mark.parametrize("name", NAMES)
def test_import_universal_and_resplit_round_trip(name, tmp_path):
    universal = ucl.load_rank(FIXTURES / name, mesh="universal", rank=0)
    ucl.import_checkpoint(FIXTURES / name, tmp_path / "imported")
    ucl.reshard(FIXTURES / name, tmp_path / "universal", to="universal")
    again = ucl.load_rank(tmp_path / "universal", mesh="universal", rank=0)
    assert set(again) == set(universal) and all(_same(again[k], v) for k, v in universal.items())
    for rank, t, p in _ranks(name):
        for source in ("imported", "universal"):
            _assert_rank_equals_truth(name, ucl.load_rank(tmp_path / source, mesh=_mesh(name), rank=rank), t, p)


@pytest.mark.parametrize("name,other", [("tp2", "tp=1"), ("tp2_pp2", "pp=1,tp=1"), ("pp2_tied_fp32", "pp=1"),
                                        ("pp2_vpp2", "pp=1")])
def test_reshard_to_another_layout_and_back(name, other, tmp_path):
    ucl.reshard(FIXTURES / name, tmp_path / "other", to=other)
    ucl.reshard(tmp_path / "other", tmp_path / "back", to=_mesh(name))
    for rank, t, p in _ranks(name):
        _assert_rank_equals_truth(name, ucl.load_rank(tmp_path / "back", mesh=_mesh(name), rank=rank), t, p)


def test_description_reads_layout_and_state_from_args():
    assert detect_format(FIXTURES / "tp2_pp2") == "megatron-legacy"
    d = describe(FIXTURES / "tp2_pp2")
    assert d.format == "megatron-legacy" and d.spec_name == "stdlib:megatron_gpt"
    assert dict(d.mesh) == {"pp": 2, "tp": 2} and d.dims["kv_heads"] == 2 and d.dims["vocab"] == 256
    assert d.files[3] == os.path.join("iter_0000007", "mp_rank_01_001", "model_optim_rng.pt")
    meg = d.state["megatron"]
    assert meg["iteration"] == 7 and meg["checkpoint_version"] == 3.0 and meg["weights_only"]
    assert meg["args"]["tensor_model_parallel_size"] == 2 and meg["vocab_size"] == 200
    json.dumps(d.state)  # plain data only
    assert not any(k.endswith("_extra_state") for table in d.extents for k in table)
    # fp32 run: the spec gets a dtype line; bf16 runs use the stdlib text as it is
    assert describe(FIXTURES / "pp2_tied_fp32").spec.rstrip().endswith("state param for ** : dtype float32")
    assert describe(FIXTURES / "tp2").spec == ucl.load_spec("stdlib:megatron_gpt").text


def test_an_iteration_folder_and_a_release_tracker_work_too(tmp_path):
    d = describe(FIXTURES / "tp2" / "iter_0000007")
    assert dict(d.mesh) == {"pp": 1, "tp": 2}
    folder = tmp_path / "run"
    shutil.copytree(FIXTURES / "tp2", folder)
    (folder / "iter_0000007").rename(folder / "release")
    (folder / "latest_checkpointed_iteration.txt").write_text("release")
    got = ucl.load_rank(folder, mesh="pp=1,tp=2", rank=1)
    _assert_rank_equals_truth("tp2", got, 1, 0)
    assert describe(folder).state["megatron"]["release"] is True


def test_a_tracker_cannot_name_a_path(tmp_path):
    folder = tmp_path / "run"
    shutil.copytree(FIXTURES / "tp2", folder)
    (folder / "latest_checkpointed_iteration.txt").write_text("../../etc")
    assert detect_format(folder) is None
    with pytest.raises(StoreError) as e:
        ucl.load_rank(folder, mesh="universal", rank=0)
    assert e.value.code == "UCL501"


def test_a_missing_rank_file_is_named(tmp_path):
    folder = tmp_path / "run"
    shutil.copytree(FIXTURES / "tp2_pp2", folder)
    (folder / "iter_0000007" / "mp_rank_01_001" / "model_optim_rng.pt").unlink()
    with pytest.raises(StoreError, match=r"mp_rank_01_001/model_optim_rng\.pt") as e:
        ucl.load_rank(folder, mesh="pp=2,tp=2", rank=0)
    assert e.value.code == "UCL502" and "tensor_model_parallel_size=2" in str(e.value)


def test_a_rank_folder_the_args_do_not_name_is_refused(tmp_path):
    folder = tmp_path / "run"
    shutil.copytree(FIXTURES / "tp2", folder)
    shutil.copytree(folder / "iter_0000007" / "mp_rank_01", folder / "iter_0000007" / "mp_rank_02")
    with pytest.raises(StoreError, match="mp_rank_02") as e:
        describe(folder)
    assert e.value.code == "UCL502"


class _Boom:
    def __reduce__(self):
        return (os.system, (f"touch {PWNED}",))


def test_a_pickle_needing_a_forbidden_class_is_refused_and_runs_nothing(tmp_path):
    folder = tmp_path / "run"
    shutil.copytree(FIXTURES / "tp2", folder)
    if os.path.exists(PWNED):
        os.remove(PWNED)
    rewrite_pickle(folder / "iter_0000007" / "mp_rank_01" / "model_optim_rng.pt",
                    lambda data: pickle.dumps({"args": None, "model": {}, "evil": _Boom()}, protocol=2))
    with pytest.raises(StoreError, match=r"posix\.system|os\.system") as e:
        ucl.load_rank(folder, mesh="pp=1,tp=2", rank=0)
    assert e.value.code == "UCL500"
    assert not os.path.exists(PWNED)


def test_a_truncated_rank_file_is_refused_before_reading(tmp_path):
    folder = tmp_path / "run"
    shutil.copytree(FIXTURES / "tp2", folder)
    pt = folder / "iter_0000007" / "mp_rank_00" / "model_optim_rng.pt"
    pt.write_bytes(pt.read_bytes()[:5000])
    with pytest.raises(StoreError) as e:
        ucl.load_rank(folder, mesh="pp=1,tp=2", rank=1)
    assert e.value.code == "UCL500" and "mp_rank_00" in str(e.value)


def test_dims_come_from_megatron_argument_names():
    from ucl.formats.megatron.legacy import dims_from_args
    spec = ucl.load_spec("stdlib:megatron_legacy_gpt")
    args = {"num_layers": 4, "hidden_size": 64, "num_attention_heads": 8, "num_query_groups": 1,
            "group_query_attention": False, "ffn_hidden_size": 256, "padded_vocab_size": 512,
            "untie_embeddings_and_output_weights": True, "virtual_pipeline_model_parallel_size": None}
    dims = dims_from_args(args, spec)
    # num_query_groups counts only with group_query_attention; kv_channels defaults to hidden / heads
    assert dims == {"vocab": 512, "hidden": 64, "heads": 8, "kv_heads": 8, "head_dim": 8, "ffn": 256, "swiglu": 0,
                    "layers": 4, "vpp": 1, "untied": 1}


def test_cli_import_detects_the_format(tmp_path, capsys):
    from ucl.cli import main
    assert main(["import", str(FIXTURES / "tp2_pp2"), str(tmp_path / "out"), "--quiet"]) == 0
    assert main(["verify", str(tmp_path / "out")]) == 0
    for rank, t, p in _ranks("tp2_pp2"):
        _assert_rank_equals_truth("tp2_pp2", ucl.load_rank(tmp_path / "out", mesh="pp=2,tp=2", rank=rank), t, p)


@pytest.mark.parametrize("size", [100000, 3])
def test_args_naming_more_ranks_than_folders_are_refused_before_any_is_named(tmp_path, size):
    """tp = pp = 100000 in args made 10**10 rank names (a MemoryError) before the folder was looked at."""
    folder = tmp_path / "run"
    shutil.copytree(FIXTURES / "tp2", folder)
    for sub in ("mp_rank_00", "mp_rank_01"):
        rewrite_pickle(folder / "iter_0000007" / sub / "model_optim_rng.pt",
                       lambda d: d.replace(b"tensor_model_parallel_sizeq(K\x02", b"tensor_model_parallel_sizeq(J"
                                           + size.to_bytes(4, "little"))
                       .replace(b"pipeline_model_parallel_sizeq)K\x01", b"pipeline_model_parallel_sizeq)J"
                                + size.to_bytes(4, "little")))
    with pytest.raises(StoreError, match=f"tensor_model_parallel_size={size:,}") as e:
        describe(folder)
    assert e.value.code == "UCL502" and "holds 2 mp_rank_* folder(s)" in str(e.value)


def test_a_value_holding_itself_in_a_rank_file_is_refused_naming_the_file(tmp_path):
    torch = pytest.importorskip("torch")
    folder = tmp_path / "run"
    shutil.copytree(FIXTURES / "tp2", folder)
    pt = folder / "iter_0000007" / "mp_rank_00" / "model_optim_rng.pt"
    head = torch.load(pt, weights_only=False)
    loop: list = []
    loop.append(loop)
    head["client_loop"] = loop
    torch.save(head, pt)
    with pytest.raises(StoreError, match=r"mp_rank_00/model_optim_rng\.pt.*itself") as e:
        describe(folder)
    assert e.value.code == "UCL500"
