"""DeepSpeed ZeRO checkpoints read in place and imported, checked against DeepSpeed's own tools.

The fixtures (tests/fixtures/deepspeed, made by make.py with DeepSpeed 0.19 on CPU) carry the
ground truth DeepSpeed itself produced: ``ds_to_universal`` (truth_universal), ``zero_to_fp32``
(truth_fp32), the module's weights (truth_module) and, for the resume check, the loss DeepSpeed
computed one step after the save. None of it is made by ucl, and DeepSpeed is not needed here.
"""
from __future__ import annotations

import json
import os
import pickle
import shutil
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

import ucl
from corrupt import rewrite_pickle, scramble
from ucl.dtypes import to_numpy
from ucl.errors import StoreError
from ucl.formats.registry import describe

FIXTURES = Path(__file__).parent / "fixtures" / "deepspeed"
ALL = sorted(p.name for p in FIXTURES.iterdir() if (p / "truth.json").is_file() and (p / "latest").is_file())
FP32 = [n for n in ALL if "fp32" in n and not n.startswith("pp")]  # pipeline names are not TinyLM's


def _truth(name: str, what: str) -> dict[str, np.ndarray]:
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file
    path = FIXTURES / name / f"truth_{what}.safetensors"
    return {k: to_numpy(v)[0] for k, v in load_file(str(path)).items()} if path.exists() else {}


def _info(name: str) -> dict:
    return json.loads((FIXTURES / name / "truth.json").read_text())


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.size == b.size and a.dtype == b.dtype and a.tobytes() == b.tobytes()


def _universal(path) -> dict[str, np.ndarray]:
    return ucl.load_rank(path, mesh="universal", rank=0)


@pytest.fixture(scope="module")
def loaded():
    return {name: _universal(FIXTURES / name) for name in ALL}


@pytest.mark.parametrize("name", ALL)
def test_matches_ds_to_universal(name, loaded):
    """Every fp32 master, Adam moment and step equals what DeepSpeed's own ds_to_universal wrote."""
    got, truth, info = loaded[name], _truth(name, "universal"), _info(name)
    if not truth:
        pytest.skip("ds_to_universal gave no truth for this fixture")
    trainable = _trainable(name, truth)
    master = "fp32" if info["dtype"] != "fp32" and info["zero_stage"] < 3 else "param"
    checked = 0
    for key, want in truth.items():
        name_, kind = key.rsplit("/", 1)
        if name_ not in trainable:  # tied aliases and frozen tensors: DeepSpeed writes copies
            continue
        mine = got[f"{master if kind == 'fp32' else kind}/{name_}"]
        if kind == "step":
            assert float(mine) == float(want), key
        else:
            assert _same(mine.reshape(-1), want.reshape(-1).astype(mine.dtype)), key
            assert mine.size == want.size
        checked += 1
    kinds = {k.rsplit("/", 1)[1] for k in truth}  # ds_to_universal writes no step for ZeRO-3
    assert {"fp32", "exp_avg", "exp_avg_sq"} <= kinds and checked == len(kinds) * len(trainable)


def _trainable(name: str, truth: dict) -> set[str]:
    """Names DeepSpeed trains: TinyLM's, or for a pipeline the PipelineModule's (from DeepSpeed's truth)."""
    if name.startswith("pp"):
        return {k.rsplit("/", 1)[0] for k in truth if k.endswith("/exp_avg")}
    return {n for g in _info(name)["param_groups"] for n in g["names"]}


@pytest.mark.parametrize("name", [n for n in ALL if not n.startswith("pp")])
def test_matches_zero_to_fp32_and_module(name, loaded):
    got, info = loaded[name], _info(name)
    master = "fp32" if info["dtype"] != "fp32" and info["zero_stage"] < 3 else "param"
    trainable = {n for g in info["param_groups"] for n in g["names"]}
    fp32 = _truth(name, "fp32")
    for n in trainable if fp32 else ():  # zero_to_fp32 gave no truth for BF16_Optimizer files
        assert _same(got[f"{master}/{n}"], fp32[n]), n
    if info["zero_stage"] < 3:  # ZeRO-3 stores no module weights
        module = _truth(name, "module")
        tied = {a for pair in info["tied"] for a in pair[1:]}
        for n, want in module.items():
            if n not in tied:
                assert _same(got[f"param/{n}"], want), n


def test_pipeline_weights_come_from_the_layer_files(loaded):
    """PipelineModule names (<layer>.<name>, tied_modules.<key>.<name>) read from layer_NN files."""
    d = describe(FIXTURES / "pp2_z1_fp32_dp2")
    assert dict(d.mesh) == {"pp": 2, "dp": 2}
    module = _truth("pp2_z1_fp32_dp2", "module")  # keyed layer_NN.<name> by the fixture generator
    got = loaded["pp2_z1_fp32_dp2"]
    for name, layer in d.state["pipeline"]["layer_files"].items():
        head, _, rest = name.partition(".")
        local = rest if head.isdigit() else rest.partition(".")[2]
        assert _same(got[f"param/{name}"], module[f"{layer}.{local}"]), name
    assert "tied_modules.embed.pos.weight" in d.frozen and "tied_modules.embed.pos_scale" in d.frozen
    # the tied embedding is trained on both stages, each stage with its own optimizer state
    first = ucl.load_rank(FIXTURES / "pp2_z1_fp32_dp2", mesh="pp=2,dp=1", rank=0)
    last = ucl.load_rank(FIXTURES / "pp2_z1_fp32_dp2", mesh="pp=2,dp=1", rank=1)
    assert "param/tied_modules.embed.embed.weight" in first and "param/tied_modules.embed.embed.weight" in last
    assert "param/3.norm.weight" in last and "param/3.norm.weight" not in first


@pytest.mark.parametrize("name", [n for n in ALL if not n.startswith("pp")])
def test_layout_is_read_from_metadata(name):
    d = describe(FIXTURES / name)
    info = _info(name)
    assert dict(d.mesh) == {"dp": info["dp"]}
    assert d.state["format"] == "deepspeed"
    assert d.state["deepspeed"]["shared_params"] == {"lm_head.weight": "embed.weight"}
    assert d.state["deepspeed"]["iteration"] == 3  # client state
    assert set(d.frozen) == set(info["frozen"]) | set(info["buffers"])
    assert list(d.params)[:len(info["param_groups"][0]["names"])] == info["param_groups"][0]["names"]


@pytest.mark.parametrize("name", ALL)
def test_import_reshard_and_back(name, tmp_path, loaded):
    """Import (dp=2 ucl checkpoint), reshard in place to dp=3, and back to universal: bit-exact."""
    stats = ucl.import_checkpoint(FIXTURES / name, tmp_path / "imported")
    assert stats.datasets_written > 0
    with ucl.open(tmp_path / "imported") as ck:
        assert ck.verify() == []
        assert dict(ck.manifest.mesh)["dp"] == _info(name)["dp"] // (_info(name).get("pp") or 1)  # "dp": the world
        assert ck.state["deepspeed"]["global_steps"] == 3
    ucl.reshard(FIXTURES / name, tmp_path / "dp3", to="dp=3")
    ucl.reshard(tmp_path / "dp3", tmp_path / "back", to="universal")
    for path in (tmp_path / "imported", tmp_path / "back"):
        again = _universal(path)
        assert set(again) == set(loaded[name])
        for k, v in loaded[name].items():
            assert _same(again[k], v), (path.name, k)


def test_a_rank_reads_only_its_bytes(tmp_path):
    """load_rank for dp=4 from a dp=2 ZeRO-1 folder reads about a quarter of the optimizer bytes."""
    stats = ucl.ops.IOStats()
    part = ucl.load_rank(FIXTURES / "z1_fp32_dp2", mesh="dp=4", rank=1, stats=stats)
    whole = sum(v.nbytes for v in _universal(FIXTURES / "z1_fp32_dp2").values())
    assert stats.bytes_read < 0.6 * whole
    assert part["exp_avg/@flat0"].shape == (-(-2895 // 8) * 8 // 4,)


@pytest.mark.parametrize("name", FP32)
def test_resumes_in_plain_pytorch_after_resharding(name, tmp_path):
    """Imported, resharded to dp=3, consolidated: plain torch AdamW takes the step DeepSpeed took
    after the save and gives DeepSpeed's next loss."""
    torch = pytest.importorskip("torch")
    sys.path.insert(0, str(FIXTURES))
    try:
        from tiny_model import TinyLM, loss_fn, make_batches, param_groups
    finally:
        sys.path.remove(str(FIXTURES))
    info = _info(name)
    ucl.import_checkpoint(FIXTURES / name, tmp_path / "imp")
    ucl.reshard(tmp_path / "imp", tmp_path / "dp3", to="dp=3")
    got = ucl.load_rank(tmp_path / "dp3", mesh="universal", rank=0, as_torch=True)
    model = TinyLM()
    sd = {n: got[f"param/{n}"] for n in model.state_dict() if f"param/{n}" in got}
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert missing == ["lm_head.weight"] and not unexpected  # the tied alias, stored once
    assert model.lm_head.weight is model.embed.weight
    groups = param_groups(model)
    hp = info["adamw"]
    opt = torch.optim.AdamW([{"params": g["params"], "weight_decay": g["weight_decay"]} for g in groups],
                            lr=hp["lr"], betas=tuple(hp["betas"]), eps=hp["eps"])
    for g in groups:
        for n, p in zip(g["names"], g["params"]):
            opt.state[p] = {"step": got[f"step/{n}"].clone(), "exp_avg": got[f"exp_avg/{n}"].clone(),
                            "exp_avg_sq": got[f"exp_avg_sq/{n}"].clone()}
    batches = make_batches(info["steps"] + 2, info["ds_config"]["train_batch_size"], 1234)
    b, dp = batches[info["steps"]], info["dp"]
    rows = b.shape[0] // dp
    loss = sum(loss_fn(model(b[r * rows:(r + 1) * rows, :-1]), b[r * rows:(r + 1) * rows, 1:]) for r in range(dp)) / dp
    opt.zero_grad()
    loss.backward()
    opt.step()
    with torch.no_grad():
        nb = batches[info["steps"] + 1]
        next_loss = loss_fn(model(nb[:, :-1]), nb[:, 1:]).item()
    assert next_loss == pytest.approx(info["next_loss"], rel=1e-5, abs=1e-6)
    after = _truth(name, "next_fp32")
    for n, p in model.named_parameters():
        if n in after:
            np.testing.assert_allclose(p.detach().numpy(), after[n], rtol=1e-5, atol=1e-6, err_msg=n)


# ---- the allow-list unpickler --------------------------------------------------------------------

def _copy(name: str, tmp_path: Path) -> Path:
    dst = tmp_path / name
    shutil.copytree(FIXTURES / name, dst, ignore=shutil.ignore_patterns("truth*", "pickles.json"))
    return dst


class _Boom:
    def __reduce__(self):
        return (os.system, ("touch /tmp/ucl-pwned-by-pickle",))


def test_a_pickle_that_runs_code_is_refused_and_runs_nothing(tmp_path):
    folder = _copy("z1_fp32_dp2", tmp_path)
    pt = folder / "global_step3" / "mp_rank_00_model_states.pt"
    if os.path.exists("/tmp/ucl-pwned-by-pickle"):
        os.remove("/tmp/ucl-pwned-by-pickle")
    rewrite_pickle(pt, lambda data: pickle.dumps({"module": {}, "evil": _Boom()}, protocol=2))
    with pytest.raises(StoreError, match=r"posix\.system|os\.system") as e:
        ucl.load_rank(folder, mesh="universal", rank=0)
    assert e.value.code == "UCL500"
    assert not os.path.exists("/tmp/ucl-pwned-by-pickle")


def test_deepspeed_records_are_inert_without_deepspeed():
    from ucl.formats.torchzip.read import Record, read_torch_file
    tf = read_torch_file(str(FIXTURES / "z1_fp32_dp2" / "global_step3" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"))
    osd = tf.obj["optimizer_state_dict"]
    assert isinstance(osd["loss_scaler"], Record) and osd["loss_scaler"].cls.endswith("LossScaler")
    frag = next(iter(osd["param_slice_mappings"][0].values()))
    assert frag.get("start") == 0 and frag.get("numel") > 0
    assert "deepspeed" not in sys.modules


def test_a_truncated_optimizer_file_is_refused_before_reading(tmp_path):
    folder = _copy("z2_fp32_dp2", tmp_path)
    pt = folder / "global_step3" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    data = pt.read_bytes()
    pt.write_bytes(data[: len(data) // 2])
    with pytest.raises(StoreError) as e:
        ucl.load_rank(folder, mesh="universal", rank=0)
    assert e.value.code == "UCL500" and "zero_pp_rank_1" in str(e.value)


def test_a_storage_smaller_than_its_tensors_is_refused(tmp_path):
    folder = _copy("z1_fp32_dp2", tmp_path)
    pt = folder / "global_step3" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    with zipfile.ZipFile(pt) as z:
        items = [(i, z.read(i.filename)) for i in z.infolist()]
    with zipfile.ZipFile(pt, "w", zipfile.ZIP_STORED) as z:
        for info, data in items:
            z.writestr(info, data[:-4] if info.filename.endswith("/data/1") else data)
    with pytest.raises(StoreError, match="storage 1 holds") as e:
        describe(folder)
    assert e.value.code == "UCL500"


def test_missing_rank_file_is_named(tmp_path):
    folder = _copy("z1_fp32_dp2", tmp_path)
    (folder / "global_step3" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(StoreError, match=r"dp ranks 0\.\.1 .* found ranks \[0\]") as e:
        ucl.load_rank(folder, mesh="universal", rank=0)
    assert e.value.code == "UCL502"


def _edit_model_states(folder: Path, change) -> None:
    """Rewrite mp_rank_00_model_states.pt with ``change(dict)`` applied, as torch.save writes it."""
    torch = pytest.importorskip("torch")
    path = folder / "global_step3" / "mp_rank_00_model_states.pt"
    states = torch.load(path, weights_only=False)
    change(states)
    torch.save(states, path)


def test_zero_stage_0_is_named(tmp_path):
    """Stage 0 keeps the whole torch optimizer state in the model states file and writes no
    zero_pp_rank optimizer files: said so, not reported as missing files."""
    folder = _copy("z1_fp32_dp2", tmp_path)
    for r in (0, 1):
        (folder / "global_step3" / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt").unlink()
    _edit_model_states(folder, lambda st: st.update(optimizer={"state": {}, "param_groups": []}))
    with pytest.raises(StoreError, match="is a ZeRO stage 0 checkpoint") as e:
        describe(folder)
    assert e.value.code == "UCL502"


def test_round_robin_gradients_is_named(tmp_path):
    folder = _copy("z2_fp32_dp2", tmp_path)
    _edit_model_states(folder, lambda st: st["ds_config"].setdefault("zero_optimization", {}).update(
        round_robin_gradients=True))
    with pytest.raises(StoreError, match="round_robin_gradients"):
        describe(folder)


def test_a_tag_folder_works_too_and_latest_cannot_escape(tmp_path, loaded):
    assert dict(describe(FIXTURES / "z1_fp32_dp2" / "global_step3").mesh) == {"dp": 2}
    tag = ucl.load_rank(FIXTURES / "z1_fp32_dp2" / "global_step3", mesh="universal", rank=0)
    assert all(_same(tag[k], v) for k, v in loaded["z1_fp32_dp2"].items())
    folder = _copy("z1_fp32_dp2", tmp_path)
    (folder / "latest").write_text("../../etc")
    with pytest.raises(StoreError) as e:
        ucl.load_rank(folder, mesh="universal", rank=0)
    assert e.value.code == "UCL501"


def test_cli_import(tmp_path, capsys):
    from ucl.cli import main
    assert main(["import", str(FIXTURES / "z2_bf16_dp2"), str(tmp_path / "out"), "--quiet"]) == 0
    assert main(["verify", str(tmp_path / "out")]) == 0
    assert "imported deepspeed checkpoint" in capsys.readouterr().out
    assert main(["import", "--from", "dcp", str(FIXTURES / "z2_bf16_dp2"), str(tmp_path / "out2"), "--quiet"]) != 0
    assert "dcp" in capsys.readouterr().err and not (tmp_path / "out2").exists()


def test_iter_rank_streams_what_load_rank_loads():
    path = FIXTURES / "z2_bf16_dp2"
    whole = ucl.load_rank(path, mesh="dp=3", rank=2)
    streamed = dict(ucl.iter_rank(path, mesh="dp=3", rank=2))
    assert list(streamed) and streamed.keys() == whole.keys()
    assert all(_same(streamed[k], whole[k]) for k in whole)
    one = dict(ucl.iter_rank(path, keys=["exp_avg/embed.weight"]))
    assert list(one) == ["exp_avg/embed.weight"] and one["exp_avg/embed.weight"].shape == (61, 15)
    with pytest.raises(StoreError, match="holds no 'exp_avg/nope'"):
        list(ucl.iter_rank(path, keys=["exp_avg/nope"]))


def test_mutated_files_give_ucl_errors_only(tmp_path):
    """Bytes flipped or cut anywhere in a model-states or optimizer file: a UclError or a (possibly
    wrong) read, never another exception, and never code run (the payload would create a file)."""
    import random

    from ucl.errors import UclError
    from ucl.formats.registry import forget
    rng = random.Random(11)
    files = ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
             "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    for i in range(40):
        folder = _copy("z1_fp32_dp2", tmp_path / f"c{i}")
        scramble(folder / "global_step3" / rng.choice(files), rng)
        forget()
        try:
            ucl.load_rank(folder, mesh="universal", rank=0)
        except UclError:
            pass


def test_a_moved_latest_is_seen_at_once(tmp_path):
    """The description cache follows `latest`: pointing it at another tag reads that tag."""
    folder = _copy("z1_fp32_dp2", tmp_path)
    first = describe(folder)
    shutil.copytree(folder / "global_step3", folder / "global_step9")
    (folder / "latest").write_text("global_step9")
    again = describe(folder)
    assert again is not first and all(e.file.startswith("global_step9") for e in again.extents[0].values())


def test_malformed_values_are_named_errors(tmp_path):
    """A param_shapes size that is a string, not a number: a named error (UCL502), no traceback."""
    folder = _copy("z1_fp32_dp2", tmp_path)
    pt = folder / "global_step3" / "mp_rank_00_model_states.pt"
    with zipfile.ZipFile(pt) as z:
        data = z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
    assert b"K=K\x0f" in data  # embed.weight's (61, 15) as two BININT1
    at = data.rfind(b"K=K\x0f")  # the last one: in param_shapes, after the module's tensors
    rewrite_pickle(pt, lambda data: data[:at] + b"X\x01\x00\x00\x00xK\x0f" + data[at + 4:])
    with pytest.raises(StoreError) as e:
        describe(folder)
    assert e.value.code == "UCL502" and "malformed" in str(e.value)


@pytest.mark.parametrize("name", ["z3_fp32_dp2", "z1_fp32_dp2"])
def test_a_tied_alias_loads_by_its_own_name(name, tmp_path):
    """zero_to_fp32 writes the tied ``lm_head.weight``; DeepSpeed stores it once, as ``embed.weight``
    (``shared_params``): loads by either name give it, read in place and after an import."""
    ucl.import_checkpoint(FIXTURES / name, tmp_path / "imp")
    want = _truth(name, "fp32")["lm_head.weight"]
    for path in (FIXTURES / name, tmp_path / "imp"):
        (key, got), = ucl.iter_rank(path, keys="param/lm_head.weight")
        assert key == "param/lm_head.weight" and np.array_equal(got, want)
        moments = dict(ucl.iter_rank(path, keys=["exp_avg/lm_head.weight", "exp_avg/embed.weight"]))
        assert np.array_equal(moments["exp_avg/lm_head.weight"], moments["exp_avg/embed.weight"])
        alias, embed = np.full_like(want, np.nan), np.full_like(want, np.nan)
        got = ucl.load_rank(path, mesh="universal", rank=0, out={"param/lm_head.weight": alias})
        assert got["param/lm_head.weight"] is alias and np.array_equal(alias, want)
        both = ucl.load_rank(path, mesh="universal", rank=0,
                             out={"param/lm_head.weight": alias, "param/embed.weight": embed})
        assert both["param/embed.weight"] is embed and np.array_equal(alias, embed)
        with pytest.raises(StoreError, match=r"holds it as float32 \[61, 15\]"):  # checked like its tensor
            ucl.load_rank(path, mesh="universal", rank=0, out={"param/lm_head.weight": want[:1].copy()})
    with pytest.raises(StoreError, match="holds no 'fp32/lm_head.weight'"):  # a kind its tensor lacks
        list(ucl.iter_rank(FIXTURES / name, keys="fp32/lm_head.weight"))


@pytest.mark.parametrize("dp, mp", [(10**12, 1), (2, 10**9)])
def test_world_sizes_beyond_the_files_are_refused_before_any_rank_is_named(tmp_path, dp, mp):
    """dp_world_size x mp_world_size is checked against the files the folder holds (10**12 made a
    list of every rank: a MemoryError)."""
    folder = _copy("z1_fp32_dp2", tmp_path)
    _edit_model_states(folder, lambda st: st.update(dp_world_size=dp, mp_world_size=mp))
    with pytest.raises(StoreError, match=f"dp_world_size={dp:,} x mp_world_size={mp:,} ranks, but the folder") as e:
        describe(folder)
    assert e.value.code == "UCL502" and "2 zero_pp_rank_*_optim_states.pt" in str(e.value)


def test_a_weights_only_folder_with_a_huge_dp_is_one_error(tmp_path):
    folder = _copy("z1_fp32_dp2", tmp_path)
    for r in (0, 1):
        (folder / "global_step3" / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt").unlink()
    _edit_model_states(folder, lambda st: st.update(dp_world_size=10**12))
    with pytest.raises(StoreError, match=r"dp_world_size=1000000000000\), found ranks \[\]") as e:
        describe(folder)
    assert e.value.code == "UCL502"
