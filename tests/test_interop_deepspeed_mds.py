"""Megatron-DeepSpeed style tensor-parallel checkpoints read in place, checked against DeepSpeed's tools.

Fixtures tests/fixtures/deepspeed/mds_* (make_mds.py: a hand-written Megatron-style model, its own
column/row/vocab-parallel shards and a fused SwiGLU [gate; up] fc1, passed to DeepSpeed 0.19.8 with
an ``mpu`` over gloo groups, tp=2 x dp=2, ZeRO-1, fp32 and bf16). The split of every parameter comes
from the pattern form of ``universal_checkpoint_info`` the client state carries. Ground truth:
``truth_universal.safetensors`` is ``ds_to_universal``'s output; ``truth_full.safetensors`` is every
parameter all-gathered over the tp group by the training workers (padded vocab rows dropped), and
``truth_mds.json['placement']`` is how the generator sharded each parameter. None of it is ucl's.
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
from ucl.dtypes import to_numpy
from ucl.errors import StoreError
from ucl.formats.registry import describe, forget
from bits import same_bits as _same  # noqa: E402

HERE = Path(__file__).parent / "fixtures" / "deepspeed"
NAMES = ["mds_tp2_z1_fp32", "mds_tp2_z1_bf16"]
FIXTURE = HERE / NAMES[0]
SWIGLU = "layers.0.mlp.dense_h_to_4h.weight"


def _truth(what: str, name: str = NAMES[0]) -> dict[str, np.ndarray]:
    pytest.importorskip("torch")
    from safetensors.torch import load_file
    return {k: to_numpy(v)[0] for k, v in load_file(str(HERE / name / f"truth_{what}.safetensors")).items()}


def _info(name: str = NAMES[0]) -> dict:
    return json.loads((HERE / name / "truth_mds.json").read_text())


@pytest.fixture(scope="module")
def loaded():
    return {name: ucl.load_rank(HERE / name, mesh="universal", rank=0) for name in NAMES}


@pytest.mark.parametrize("name", NAMES)
def test_placements_come_from_the_patterns(name):
    d, info = describe(HERE / name), _info(name)
    assert dict(d.mesh) == {"tp": 2, "dp": 2}
    vocab = info["vocab"]
    want = {n: [vocab] + p["full"][1:] if p["kind"] == "vocab" else p["full"] for n, p in info["placement"].items()}
    assert {n: list(s) for n, s in d.params.items()} == want
    kinds = {"replicated": "replicate", "column": "split 0 over tp", "row": "split 1 over tp",
             "vocab": f"pad 0 to {info['padded_vocab']}; split 0 over tp",
             "swiglu": f"view 0 as [2, {info['ffn']}]; split 0.1 over tp"}
    assert d.state["megatron_deepspeed"]["layouts"] == {n: kinds[p["kind"]] for n, p in info["placement"].items()}
    assert d.state["deepspeed"]["iteration"] == 3 and d.spec_name == "deepspeed-mds-zero1"


@pytest.mark.parametrize("name", NAMES)
def test_weights_match_the_gathered_model(name, loaded):
    got, full = loaded[name], _truth("full", name)
    assert {k for k in got if k.startswith("param/")} == {f"param/{n}" for n in full}
    for n, want in full.items():
        assert _same(got[f"param/{n}"], want), n


@pytest.mark.parametrize("name", NAMES)
def test_optimizer_state_matches_ds_to_universal(name, loaded):
    got, truth, info = loaded[name], _truth("universal", name), _info(name)
    master = "fp32" if info["dtype"] != "fp32" else "param"
    kinds = {"fp32": master, "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq", "step": "step"}
    for key, want in truth.items():
        n, kind = key.rsplit("/", 1)
        mine = got[f"{kinds[kind]}/{n}"]
        if kind == "step":
            assert float(mine) == float(want) == 3.0, key
        else:
            assert _same(mine, want.astype(mine.dtype)), key
    assert len(truth) == 4 * len(info["placement"])


def test_a_rank_holds_deepspeeds_shard_padding_stripped():
    """tp rank 1 of the stored layout holds mp_rank_01's shards; the padded vocab rows (trained only
    by weight decay) are dropped as ds_to_universal drops them, and read back as zeros."""
    torch = pytest.importorskip("torch")
    sd = torch.load(FIXTURE / "global_step3" / "mp_rank_01_model_states.pt", map_location="cpu",
                    weights_only=False)["module"]
    got, info = ucl.load_rank(FIXTURE, mesh="tp=2,dp=2", rank=3), _info()  # rank = t * dp + d
    real = info["vocab"] - info["padded_vocab"] // 2  # rank 1's rows below the original vocab
    for n, t in sd.items():
        want = t.numpy().copy()
        if info["placement"][n]["kind"] == "vocab":
            assert np.any(want[real:] != 0)
            want[real:] = 0
        assert _same(got[f"param/{n}"], want), n


@pytest.mark.parametrize("name,to", [("mds_tp2_z1_fp32", "tp=1,dp=3"), ("mds_tp2_z1_bf16", "tp=4,dp=1")])
def test_import_reshard_and_back(name, to, tmp_path, loaded):
    universal = loaded[name]
    ucl.import_checkpoint(HERE / name, tmp_path / "imported")
    with ucl.open(tmp_path / "imported") as ck:
        assert ck.verify() == [] and dict(ck.manifest.mesh) == {"tp": 2, "dp": 2}
    ucl.reshard(HERE / name, tmp_path / "re", to=to)
    ucl.reshard(tmp_path / "re", tmp_path / "back", to="tp=2,dp=2")
    for path in (tmp_path / "imported", tmp_path / "back"):
        again = ucl.load_rank(path, mesh="universal", rank=0)
        assert set(again) == set(universal)
        assert all(_same(again[k], v) for k, v in universal.items()), path.name
    for r in range(4):  # the way back lands on DeepSpeed's own layout, rank by rank
        mine, theirs = ucl.load_rank(tmp_path / "back", mesh="tp=2,dp=2", rank=r), \
            ucl.load_rank(HERE / name, mesh="tp=2,dp=2", rank=r)
        assert mine.keys() == theirs.keys() and all(_same(mine[k], theirs[k]) for k in mine)


@settings(max_examples=4, deadline=None)
@given(tp=st.sampled_from([1, 2, 4]), dp=st.integers(1, 3))
def test_any_layout_round_trips(tp, dp):
    universal = ucl.load_rank(FIXTURE, mesh="universal", rank=0)
    with tempfile.TemporaryDirectory() as tmp:
        ucl.reshard(FIXTURE, Path(tmp, "a"), to=f"tp={tp},dp={dp}")
        ucl.reshard(Path(tmp, "a"), Path(tmp, "b"), to="universal")
        again = ucl.load_rank(Path(tmp, "b"), mesh="universal", rank=0)
    assert set(again) == set(universal) and all(_same(again[k], v) for k, v in universal.items())


# ---- the same layout said with other patterns, and hostile patterns ----------------------------


def _with_info(tmp_path: Path, edit) -> Path:
    """A copy of the fp32 fixture whose model states carry ``edit(universal_checkpoint_info)``."""
    torch = pytest.importorskip("torch")
    dst = tmp_path / "ck"
    shutil.copytree(FIXTURE, dst, ignore=shutil.ignore_patterns("truth*", "pickles.json"))
    for t in (0, 1):
        pt = dst / "global_step3" / f"mp_rank_{t:02d}_model_states.pt"
        ms = torch.load(pt, map_location="cpu", weights_only=False)
        info = edit(json.loads(json.dumps(ms["universal_checkpoint_info"])))
        if info is None:
            del ms["universal_checkpoint_info"]
        else:
            ms["universal_checkpoint_info"] = info
        torch.save(ms, pt)
    forget()
    return dst


@pytest.mark.parametrize("shape,version", [([[24, 24], 16], 0.4), ([2, -1], 0.0)])
def test_swiglu_as_sub_params_reads_the_same(shape, version, tmp_path, loaded):
    """DeepSpeed's other spelling of the fused fc1 (parameter_with_sub_params: widths, or a count)."""
    def edit(info):
        fc1 = info.pop("parameter_with_2_sub_params_cat_dim_0")
        info["parameter_with_sub_params"] = [{"patterns": fc1, "shape": shape, "partition_dim": 0}]
        info["universal_checkpoint_version"] = version
        if version >= 0.4:
            info["sub_param_shard_widths"] = {fc1[0]: [[12, 12], [12, 12]]}
        return info
    ck = _with_info(tmp_path, edit)
    assert f"{SWIGLU} [48, 16] : concat 0 as [p0 = 24, p1 = 24]; split 0 over tp" in describe(ck).spec
    got, want = ucl.load_rank(ck, mesh="universal", rank=0), loaded[NAMES[0]]
    assert got.keys() == want.keys() and all(_same(got[k], want[k]) for k in want)


def _refused(ck: Path, *words: str) -> StoreError:
    with pytest.raises(StoreError) as e:
        describe(ck)
    assert e.value.code == "UCL502", e.value
    for w in words:
        assert w in str(e.value), (w, str(e.value))
    return e.value


def test_no_universal_checkpoint_info_is_refused(tmp_path):
    _refused(_with_info(tmp_path, lambda info: None), "tensor-parallel", "mp_world_size=2")


def test_averaged_parameters_are_refused(tmp_path):
    def edit(info):
        info["parameter_to_average_patterns"] = [r"final_layernorm\.weight"]
        info["tp_replicated_parameter_patterns"].remove(r"final_layernorm\.weight")
        return info
    _refused(_with_info(tmp_path, edit), "final_layernorm.weight", "averaged")


def test_row_parallel_on_a_vector_is_refused(tmp_path):
    def edit(info):
        info["parameter_with_row_parallelism_patterns"].append(r"layers\.\d+\.self_attention\.query_key_value\.bias")
        return info
    _refused(_with_info(tmp_path, edit), "layers.0.self_attention.query_key_value.bias", "no dim 1")


def test_vocabulary_on_a_vector_is_refused(tmp_path):
    def edit(info):
        info["vocabulary_parameter_patterns"].append(r"final_layernorm")
        return info
    _refused(_with_info(tmp_path, edit), "final_layernorm.weight", "vocabulary_parameter_patterns")


def test_a_vocabulary_larger_than_the_padded_one_is_refused(tmp_path):
    def edit(info):
        info["original_vocab_size"] = 65
        return info
    _refused(_with_info(tmp_path, edit), "word_embeddings.weight", "65")


def test_uneven_sub_params_are_refused(tmp_path):
    def edit(info):
        fc1 = info.pop("parameter_with_2_sub_params_cat_dim_0")
        info["parameter_with_sub_params"] = [{"patterns": fc1, "shape": [[24, 24], 16], "partition_dim": 0}]
        info["universal_checkpoint_version"] = 0.4
        info["sub_param_shard_widths"] = {fc1[0]: [[14, 10], [10, 14]]}
        return info
    _refused(_with_info(tmp_path, edit), SWIGLU, "evenly")


def test_two_matching_patterns_of_one_kind_are_refused(tmp_path):
    def edit(info):
        info["tp_replicated_parameter_patterns"].append(r"final_")
        return info
    _refused(_with_info(tmp_path, edit), "final_layernorm.weight", "several")


def test_a_bad_regular_expression_is_refused(tmp_path):
    def edit(info):
        info["parameter_with_row_parallelism_patterns"].append("layers(")
        return info
    _refused(_with_info(tmp_path, edit), "layers(", "regular expression")


def test_a_truncated_model_states_file_is_refused(tmp_path):
    dst = tmp_path / "ck"
    shutil.copytree(FIXTURE, dst, ignore=shutil.ignore_patterns("truth*", "pickles.json"))
    pt = dst / "global_step3" / "mp_rank_01_model_states.pt"
    pt.write_bytes(pt.read_bytes()[:4000])
    forget()
    with pytest.raises(StoreError) as e:
        ucl.load_rank(dst, mesh="universal", rank=0)
    assert e.value.code == "UCL500" and "mp_rank_01" in str(e.value)


def test_a_missing_tp_rank_is_named(tmp_path):
    dst = tmp_path / "ck"
    shutil.copytree(FIXTURE, dst, ignore=shutil.ignore_patterns("truth*", "pickles.json"))
    (dst / "global_step3" / "zero_pp_rank_1_mp_rank_01_optim_states.pt").unlink()
    forget()
    _refused(dst, "dp ranks 0..1 x tp ranks 0..1")


# ---- no universal_checkpoint_info at all: the user's spec places the parameters ----------------

USER_SPEC = """\
# TinyMegatron (make_mds.py), said by hand: what a Megatron model's code knows
mesh tp, dp
dims vocab, padded_vocab, hidden, ffn
word_embeddings.weight [vocab, hidden] : pad 0 to padded_vocab; split 0 over tp
lm_head.weight [vocab, hidden] : pad 0 to padded_vocab; split 0 over tp
final_layernorm.weight [hidden] : replicate
layers.{i}.*_layernorm.weight [hidden] : replicate
layers.{i}.self_attention.query_key_value.weight [3 * hidden, hidden] : split 0 over tp
layers.{i}.self_attention.query_key_value.bias [3 * hidden] : split 0 over tp
layers.{i}.self_attention.dense.weight [hidden, hidden] : split 1 over tp
layers.{i}.self_attention.dense.bias [hidden] : replicate
layers.{i}.mlp.dense_h_to_4h.weight [2 * ffn, hidden] : view 0 as [2, ffn]; split 0.1 over tp
layers.{i}.mlp.dense_4h_to_h.weight [hidden, ffn] : split 1 over tp
"""
DIMS = {"vocab": 60, "padded_vocab": 64, "hidden": 16, "ffn": 24}


def test_a_user_spec_places_a_checkpoint_without_patterns(tmp_path, loaded):
    ck = _with_info(tmp_path, lambda info: None)
    ucl.import_checkpoint(ck, tmp_path / "out", spec=USER_SPEC, dims=DIMS)
    with ucl.open(tmp_path / "out") as out:
        assert out.verify() == [] and dict(out.manifest.mesh) == {"tp": 2, "dp": 2}
        assert out.manifest.dims == DIMS and "flat over dp pad to multiple_of(2 * dp)" in out.manifest.spec
    got, want = ucl.load_rank(tmp_path / "out", mesh="universal", rank=0), loaded[NAMES[0]]
    assert got.keys() == want.keys() and all(_same(got[k], want[k]) for k in want)


def test_cli_import_with_spec(tmp_path, capsys, loaded):
    from ucl.cli import main
    ck = _with_info(tmp_path, lambda info: None)
    (tmp_path / "tiny.ucl").write_text(USER_SPEC)
    assert main(["import", str(ck), str(tmp_path / "no"), "--quiet"]) != 0
    assert "--spec" in capsys.readouterr().err and not (tmp_path / "no").exists()
    dims = ",".join(f"{k}={v}" for k, v in DIMS.items())
    assert main(["import", str(ck), str(tmp_path / "out"), "--quiet", "--spec", str(tmp_path / "tiny.ucl"),
                 "--dims", dims]) == 0
    assert "tp=2,dp=2" in capsys.readouterr().out
    got = ucl.load_rank(tmp_path / "out", mesh="universal", rank=0)
    assert all(_same(got[k], v) for k, v in loaded[NAMES[0]].items())


@pytest.mark.parametrize("edit,code,words", [
    (lambda s: s.replace("dense.weight [hidden, hidden] : split 1", "dense.weight [hidden, hidden] : split 0"),
     "UCL417", ["layers.0.self_attention.dense.weight", "[16, 8]"]),
    (lambda s: s.replace("mesh tp, dp", "mesh dp, tp"), "UCL502", ["mesh tp, dp"]),
    (lambda s: s + "state exp_avg : flat over dp\n", "UCL502", ["exp_avg", "DeepSpeed's files"]),
    (lambda s: s.replace("final_layernorm.weight [hidden] : replicate\n", ""), "UCL502",
     ["final_layernorm.weight", "0 rules"]),
])
def test_a_user_spec_that_does_not_fit_is_refused(edit, code, words, tmp_path):
    ck = _with_info(tmp_path, lambda info: None)
    with pytest.raises(ucl.UclError) as e:
        ucl.import_checkpoint(ck, tmp_path / "out", spec=edit(USER_SPEC), dims=DIMS)
    assert e.value.code == code and all(w in str(e.value) for w in words), str(e.value)
    assert not (tmp_path / "out").exists()


def test_a_user_spec_is_not_taken_where_the_files_place_the_shards(tmp_path):
    with pytest.raises(StoreError, match="takes no spec") as e:
        ucl.import_checkpoint(FIXTURE, tmp_path / "out", spec=USER_SPEC, dims=DIMS)
    assert e.value.code == "UCL502"


def test_user_placements_travel_in_the_call_and_the_workers_job(tmp_path, loaded):
    """No process-wide registry of placements: ``open_checkpoint`` and ``reshard`` take them, and the
    forked workers of the reshard get them in their job."""
    from ucl.formats import registry
    from ucl.ops.convert import user_spec
    from ucl.ops.prepare import open_checkpoint
    ck = _with_info(tmp_path, lambda info: None)
    user = user_spec(USER_SPEC, DIMS)
    with open_checkpoint(ck, user=user) as c:
        assert dict(c.manifest.mesh) == {"tp": 2, "dp": 2}
    ucl.reshard(ck, tmp_path / "u", "universal", workers=2, user=user)
    got, want = ucl.load_rank(tmp_path / "u", mesh="universal", rank=0), loaded[NAMES[0]]
    assert got.keys() == want.keys() and all(_same(got[k], want[k]) for k in want)
    with pytest.raises(StoreError, match="--spec"):
        registry.forget()
        ucl.reshard(ck, tmp_path / "v", "universal")  # nothing left behind by the calls above


def test_user_placements_reach_load_rank_iter_rank_and_exports(tmp_path, loaded):
    """A folder whose files do not record its placements is read in place from Python with them too:
    ``load_rank``, ``iter_rank`` and the exports take ``user=`` (before: only ``reshard`` did, and the
    docs pointed at a context manager that no longer exists)."""
    from ucl.ops.convert import user_spec
    from ucl.ops.export import export_deepspeed_universal
    ck = _with_info(tmp_path, lambda info: None)
    user = user_spec(USER_SPEC, DIMS)
    want = loaded[NAMES[0]]
    got = ucl.load_rank(ck, mesh="universal", rank=0, user=user)
    assert got.keys() == want.keys() and all(_same(got[k], want[k]) for k in want)
    streamed = dict(ucl.iter_rank(ck, user=user))
    assert streamed.keys() == want.keys() and all(_same(streamed[k], want[k]) for k in want)
    stats = export_deepspeed_universal(ck, tmp_path / "ds", user=user)
    assert stats.datasets_written > 0 and (tmp_path / "ds").is_dir()
