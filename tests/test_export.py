"""Exports (ucl.ops.export and the writers in ucl.formats) checked by the frameworks that read them: PyTorch DCP through
``dcp.load`` + ``set_state_dict`` (one process, and slow: FSDP2 over 2 gloo processes), DeepSpeed's
universal layout against what DeepSpeed's own ``ds_to_universal`` wrote for the fixtures, and
(needs deepspeed) by a DeepSpeed engine resuming with ``load_universal`` at another DP size and
reproducing the loss DeepSpeed recorded one step after the save.

This file is also the DeepSpeed worker those tests start (``python tests/test_export.py --ds-worker``).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import ucl  # noqa: E402
from spawned import free_port  # noqa: E402
from ucl.errors import StoreError  # noqa: E402
from ucl.ops.export import export_dcp, export_deepspeed_universal, survey  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures" / "deepspeed"
sys.path.insert(0, str(FIXTURES))
from tiny_model import TinyLM, loss_fn, make_batches, param_groups  # noqa: E402

LR, BETAS, EPS, WD = 1e-2, (0.9, 0.999), 1e-8, 0.01


def _info(name: str) -> dict:
    return json.loads((FIXTURES / name / "truth.json").read_text())


def _universal(path) -> dict:
    return ucl.load_rank(path, mesh="universal", rank=0, as_torch=True)


def _bits(a, b) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(-1).view(torch.uint8) if a.numel() else a,
                                                                       b.view(-1).view(torch.uint8) if b.numel() else b)


def _fresh():
    torch.manual_seed(0)
    model = TinyLM()
    opt = torch.optim.AdamW([{k: v for k, v in g.items() if k != "names"} for g in param_groups(model, WD)],
                            lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    return model, opt


def _dcp_load(path, model, opt, *, partial=False):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    options = StateDictOptions(flatten_optimizer_state_dict=True)
    msd, osd = get_state_dict(model, opt, options=options)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, checkpoint_id=str(path), planner=dcp.DefaultLoadPlanner(allow_partial_load=partial))
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"], options=options)


def _next_loss(model, opt) -> float:
    """make.py's next step: train on global batch 3 (the mean over the batch = DeepSpeed's DP mean),
    then the eval loss on batch 4."""
    batches = make_batches(5, 4, 1234)
    b = batches[3]
    loss_fn(model(b[:, :-1]), b[:, 1:]).backward()
    opt.step()
    opt.zero_grad()
    with torch.no_grad():
        b = batches[4]
        return loss_fn(model(b[:, :-1]), b[:, 1:]).item()


def _check_loaded(model, opt, want: dict, *, tied=True) -> None:
    """Module weights = fp32 masters (else param), frozen/buffers = param, Adam state = ucl's, bit for bit."""
    sd = model.state_dict()
    names = {p: n for n, p in model.named_parameters()}
    for n, t in sd.items():
        if n == "lm_head.weight":
            assert not tied or _bits(t, sd["embed.weight"])
            continue
        ref = want.get(f"fp32/{n}", want[f"param/{n}"])
        assert _bits(t, ref.to(t.dtype) if t.dtype != ref.dtype else ref), n
    for p, s in opt.state.items():
        n = names[p]
        for k in ("exp_avg", "exp_avg_sq"):
            assert _bits(s[k], want[f"{k}/{n}"]), (n, k)
        assert float(s["step"]) == float(want[f"step/{n}"]) and s["step"].dtype == torch.float32


# ------------------------------------------------------------------------------------------- DCP


@pytest.mark.parametrize("name", ["z1_fp32_dp2", "z2_bf16_dp2", "z3_fp32_dp2"])
def test_dcp_loads_into_plain_module(name, tmp_path):
    """A DeepSpeed folder read in place, exported to DCP, loads through get_state_dict/set_state_dict
    into a plain TinyLM + AdamW: every tensor bit-exact, hyperparameters per group where known."""
    out = tmp_path / "dcp"
    stats = export_dcp(FIXTURES / name, out)
    assert stats.bytes_written > 0 and sorted(os.listdir(tmp_path)) == ["dcp"]
    model, opt = _fresh()
    for g in opt.param_groups:
        g["lr"], g["weight_decay"] = 0.5, 0.5  # must come back from the checkpoint (where it records them)
    src = survey(FIXTURES / name)
    _dcp_load(out, model, opt, partial=src.groups is None)
    _check_loaded(model, opt, _universal(FIXTURES / name))
    if src.groups is not None:
        got = [(g["lr"], g["weight_decay"], g["betas"]) for g in opt.param_groups]
        assert got == [(LR, WD, BETAS), (LR, 0.0, BETAS)]
    if name == "z1_fp32_dp2":  # DeepSpeed's own next step, reproduced by plain torch from the export
        assert _next_loss(model, opt) == pytest.approx(_info(name)["next_loss"], rel=1e-5)


def test_dcp_from_ucl_checkpoints(tmp_path):
    """An imported ucl checkpoint exports the same DCP keys; a Checkpointer checkpoint (no tied alias,
    hyperparameters without group membership) loads with allow_partial_load."""
    import torch.distributed.checkpoint as dcp

    imported = tmp_path / "imported"
    ucl.import_checkpoint(FIXTURES / "z1_fp32_dp2", imported)
    export_dcp(imported, tmp_path / "a")
    export_dcp(FIXTURES / "z1_fp32_dp2", tmp_path / "b")
    keys = [sorted(dcp.FileSystemReader(str(tmp_path / x)).read_metadata().state_dict_metadata) for x in "ab"]
    assert keys[0] == keys[1] and "model.lm_head.weight" in keys[0]
    assert "optim.state.embed.weight.exp_avg" in keys[0] and "optim.param_groups.norm.weight.lr" in keys[0]

    model, opt = _fresh()
    b = make_batches(1, 4, 7)[0]
    loss_fn(model(b[:, :-1]), b[:, 1:]).backward()
    opt.step()
    with ucl.Checkpointer(tmp_path / "root", model, opt) as ck:
        ck.save(1)
    ckpt = next(p for p in (tmp_path / "root").iterdir() if p.name.startswith("step_"))
    export_dcp(ckpt, tmp_path / "c", style="torchtitan")
    meta = dcp.FileSystemReader(str(tmp_path / "c")).read_metadata().state_dict_metadata
    assert "embed.weight" in meta and "optimizer.state.embed.weight.exp_avg_sq" in meta
    assert not any(k.startswith("optimizer.param_groups.") for k in meta)  # membership unknown: left out
    m2, o2 = _fresh()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
    options = StateDictOptions(flatten_optimizer_state_dict=True)
    msd, osd = get_state_dict(m2, o2, options=options)
    sd = {**msd, "optimizer": osd}
    dcp.load(sd, checkpoint_id=str(tmp_path / "c"), planner=dcp.DefaultLoadPlanner(allow_partial_load=True))
    set_state_dict(m2, o2, model_state_dict={k: sd[k] for k in msd}, optim_state_dict=sd["optimizer"], options=options)
    _check_loaded(m2, o2, _universal(ckpt))
    for a, c in zip(model.parameters(), m2.parameters()):
        assert _bits(a.detach(), c.detach())


def test_exports_refuse_and_leave_nothing(tmp_path, monkeypatch):
    (tmp_path / "taken").mkdir()
    for export in (export_dcp, export_deepspeed_universal):
        with pytest.raises(StoreError) as e:
            export(FIXTURES / "z1_fp32_dp2", tmp_path / "taken")
        assert e.value.code == "UCL503"
    with pytest.raises(StoreError) as e:
        export_dcp(FIXTURES / "z1_fp32_dp2", tmp_path / "x", style="megatron")
    assert e.value.code == "UCL503"
    with pytest.raises(StoreError) as e:
        export_deepspeed_universal(FIXTURES / "z1_fp32_dp2", tmp_path / "x", tag="../up")
    assert e.value.code == "UCL503"

    import torch.distributed.checkpoint as dcp

    def boom(*a, **k):
        raise OSError("disk full")
    monkeypatch.setattr(dcp, "save", boom)
    with pytest.raises(OSError):
        export_dcp(FIXTURES / "z1_fp32_dp2", tmp_path / "half")
    from ucl.formats.torchzip import write as torchsave
    monkeypatch.setattr(torchsave, "save", boom)
    with pytest.raises(OSError):
        export_deepspeed_universal(FIXTURES / "z1_fp32_dp2", tmp_path / "half")
    assert sorted(os.listdir(tmp_path)) == ["taken"]  # no OUT, no temp folder left behind


def _fsdp2_worker(rank: int, world: int, port: int, path: str, want: dict) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", (world,))
        model, _ = _fresh()
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW([{k: v for k, v in g.items() if k != "names"} for g in param_groups(model, WD)],
                                lr=0.5, betas=BETAS, eps=EPS, weight_decay=0.5)
        _dcp_load(path, model, opt)
        names = {p: n for n, p in model.named_parameters()}
        for n, p in model.named_parameters():
            assert p.to_local().numel() < p.numel() or p.numel() < world  # really sharded
            assert _bits(p.full_tensor().detach(), want[f"param/{n}"]), n
        for p, s in opt.state.items():
            for k in ("exp_avg", "exp_avg_sq"):
                assert _bits(s[k].full_tensor(), want[f"{k}/{names[p]}"]), (names[p], k)
        assert [g["weight_decay"] for g in opt.param_groups] == [WD, 0.0]
        dist.barrier()  # both done with their collectives before either tears gloo down (a CI run aborted there once)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_dcp_loads_into_fsdp2(tmp_path):
    """dcp.load reads under any layout: the export loads into a TinyLM sharded by fully_shard over
    2 gloo processes (DTensor shards), equal to ucl's universal tensors."""
    import torch.multiprocessing as mp

    export_dcp(FIXTURES / "z1_fp32_dp2", tmp_path / "dcp")
    want = ucl.load_rank(FIXTURES / "z1_fp32_dp2", mesh="universal", rank=0, as_torch=True)
    mp.spawn(_fsdp2_worker, args=(2, free_port(), str(tmp_path / "dcp"), want), nprocs=2, join=True)


# ------------------------------------------------------------------------------- DeepSpeed universal


def test_ds_client_state_tensors_survive_read_and_export(tmp_path):
    """Tensors in DeepSpeed's client state (Megatron-DeepSpeed keeps RNG states there) are kept bit
    for bit up to 64 KiB (base64 in the manifest's state) and written back as tensors by the
    universal export; a larger one is left out with a warning, never replaced by its description."""
    import shutil
    src = tmp_path / "ds"
    shutil.copytree(FIXTURES / "z1_fp32_dp2", src)
    tag = (src / "latest").read_text().strip()
    path = src / tag / "mp_rank_00_model_states.pt"
    states = torch.load(path, weights_only=False)
    g = torch.Generator().manual_seed(5)
    client = {"rng": torch.get_rng_state(), "bf16": torch.randn(3, 5, generator=g).to(torch.bfloat16),
              "nested": {"steps": torch.arange(7), "flags": [torch.tensor([True, False])]},
              "big": torch.zeros(20000, dtype=torch.float32)}
    states.update(client)
    torch.save(states, path)
    with ucl.open(src) as ck:
        assert set(ck.state["deepspeed"]["rng"]) == {"tensor", "dtype", "base64"}
        assert set(ck.state["deepspeed"]["big"]) == {"tensor", "dtype"}  # 80 KB: described only
    out = tmp_path / "uc"
    with pytest.warns(UserWarning, match="client state big"):
        export_deepspeed_universal(src, out)
    back = torch.load(out / tag / "mp_rank_00_model_states.pt", weights_only=True)
    assert "big" not in back
    assert _bits(back["rng"], client["rng"]) and _bits(back["bf16"], client["bf16"])
    assert _bits(back["nested"]["steps"], client["nested"]["steps"])
    assert _bits(back["nested"]["flags"][0], client["nested"]["flags"][0])


@pytest.mark.parametrize("name", ["z1_fp32_dp2", "z2_bf16_dp2", "z3_bf16_dp2"])
def test_ds_universal_matches_ds_to_universal(name, tmp_path):
    """The exported zero/ folder has the files and dict keys DeepSpeed's own ds_to_universal wrote for
    the fixture (truth.json) with the same values bit for bit; latest_universal names the tag."""
    from safetensors.torch import load_file

    out = tmp_path / "uc"
    export_deepspeed_universal(FIXTURES / name, out)
    info = _info(name)
    tag = (out / "latest_universal").read_text()
    assert tag == info["tag"] and sorted(os.listdir(out)) == ["global_step3", "latest_universal"]
    assert sorted(os.listdir(out / tag)) == ["mp_rank_00_model_states.pt", "zero",
                                             "zero_pp_rank_0_mp_rank_00_model_states.pt"]
    truth = load_file(str(FIXTURES / name / "truth_universal.safetensors"))
    for pname, files in info["universal"]["pt_contents"].items():
        ours = set(os.listdir(out / tag / "zero" / pname))
        assert ours >= set(files) and ours - set(files) <= {"step.pt"}, pname  # ZeRO-3's has no step.pt
        for f, desc in files.items():
            obj = torch.load(out / tag / "zero" / pname / f, weights_only=True)
            if isinstance(desc, dict):
                assert sorted(obj) == sorted(desc), (pname, f)
                t = obj["param"]
            else:  # ZeRO-3 ds_to_universal writes bare tensors; the loader takes both, we write dicts
                t = obj["param"] if isinstance(obj, dict) else obj
            if pname == "lm_head.weight" and info["dtype"] == "bf16":
                continue  # ds_to_universal upcasts the bf16 module weight of the alias; we write the fp32 master
            assert _bits(t.reshape(truth[f"{pname}/{f[:-3]}"].shape), truth[f"{pname}/{f[:-3]}"]), (pname, f)
    for extra in ("pos.weight", "pos_scale", "lm_head.weight"):  # ds_to_universal's fp32.pt of module tensors
        assert sorted(os.listdir(out / tag / "zero" / extra)) == ["fp32.pt"]
    assert _bits(torch.load(out / tag / "zero" / "lm_head.weight" / "fp32.pt", weights_only=True)["param"],
                 truth["embed.weight/fp32"].reshape(61, 15))
    states = torch.load(out / tag / "mp_rank_00_model_states.pt", weights_only=True)
    assert states["global_steps"] == 3 and states["iteration"] == 3 and states["dp_world_size"] == 2
    assert states["shared_params"] == {"lm_head.weight": "embed.weight"}
    assert sorted(states["module"]) == ["pos.weight", "pos_scale"]
    optim = torch.load(out / tag / "zero" / "optimizer_state.pt", weights_only=True)
    assert [g["weight_decay"] for g in optim["param_groups"][:2]] == [WD, 0.0] and optim["ds_version"] == "0.19.8"


def _run_ds(export: Path, dump: Path, world: int, stage: int, bf16: bool) -> dict:
    pytest.importorskip("deepspeed")
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONHASHSEED="0")
    args = [str(Path(__file__).resolve()), "--ds-worker", str(export), str(dump), str(stage), str(int(bf16))]
    if world == 1:
        env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(free_port()))
        cmd = [sys.executable] + args
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}"] + args
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    return torch.load(dump, weights_only=True)


def _check_resumed(got: dict, name: str, *, loss: bool) -> None:
    want = _universal(FIXTURES / name)
    for key, t in got["tensors"].items():
        kind, n = key.split("/", 1)
        ref = want.get(key) if kind != "fp32" else want.get(key, want[f"param/{n}"])
        assert _bits(t, ref.to(t.dtype)), key
    assert got["steps"] == [3.0] and got["weight_decay"] == [WD, 0.0] and got["global_steps"] == 3
    assert got["iteration"] == 3 and set(got["steps_after"]) == {4.0}, got["steps_after"]
    if loss:
        assert got["next_loss"] == pytest.approx(_info(name)["next_loss"], rel=1e-5)


@pytest.mark.slow  # needs deepspeed (installed for the slow run)
def test_ds_universal_resumes_in_deepspeed(tmp_path):
    """DeepSpeed itself (CPU, gloo, 1 process: the fixture had dp 2) resumes the export of
    z1_fp32_dp2 with load_universal: fp32 masters and Adam moments equal ucl's universal tensors,
    and one more step gives the loss DeepSpeed recorded after its own step 4."""
    export_deepspeed_universal(FIXTURES / "z1_fp32_dp2", tmp_path / "uc")
    _check_resumed(_run_ds(tmp_path / "uc", tmp_path / "dump.pt", 1, 1, False), "z1_fp32_dp2", loss=True)


@pytest.mark.slow
@pytest.mark.parametrize("name,world,stage", [("z1_fp32_dp2", 4, 1), ("z2_bf16_dp2", 1, 2), ("z3_fp32_dp2", 4, 3)])
def test_ds_universal_resumes_at_other_dp(name, world, stage, tmp_path):
    """As above at dp 4 (uneven ZeRO partitions of the odd-sized groups) and from bf16 / ZeRO-3 runs."""
    info = _info(name)
    export_deepspeed_universal(FIXTURES / name, tmp_path / "uc")
    got = _run_ds(tmp_path / "uc", tmp_path / "dump.pt", world, stage, info["dtype"] == "bf16")
    _check_resumed(got, name, loss=info["dtype"] == "fp32")


def _ds_worker(export: str, dump: str, stage: int, bf16: bool) -> None:
    import deepspeed
    import torch.distributed as dist
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model, opt = _fresh()
    conf = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 4 // world, "gradient_accumulation_steps": 1,
            "gradient_clipping": 0.0, "zero_allow_untested_optimizer": True, "zero_optimization": {"stage": stage},
            "steps_per_print": 1000, "wall_clock_breakdown": False, "checkpoint": {"load_universal": True}}
    if bf16:
        conf["bf16"] = {"enabled": True}
    engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=conf)
    for g in optimizer.optimizer.param_groups if stage < 3 else ():
        g["weight_decay"] = 0.5  # must come back from optimizer_state.pt (ZeRO-1/2; ZeRO-3 keeps the job's)
    _, client = engine.load_checkpoint(export)
    if stage == 3:  # DeepSpeed 0.19.8's ZeRO-3 universal load gives every sub-group the SAME step tensor,
        for st in optimizer.optimizer.state.values():  # which AdamW then bumps once per group: un-share it
            st["step"] = st["step"].clone()
    tensors = {}
    for n, p in engine.module.named_parameters():
        if p.requires_grad:
            tensors[f"fp32/{n}"] = safe_get_full_fp32_param(p).detach().clone()
            for k in ("exp_avg", "exp_avg_sq"):
                tensors[f"{k}/{n}"] = safe_get_full_optimizer_state(p, k).detach().clone()
    steps = sorted({float(s["step"]) for s in optimizer.optimizer.state.values() if "step" in s})
    wd = [g["weight_decay"] for g in optimizer.optimizer.param_groups]
    if stage == 3:
        wd = [WD, 0.0]  # ZeRO-3 keeps the job's own hyperparameters (see ucl.formats.deepspeed.write)
    batches = make_batches(5, 4, 1234)
    mb = 4 // world
    b = batches[3, rank * mb:(rank + 1) * mb]
    engine.backward(loss_fn(engine(b[:, :-1]), b[:, 1:]))
    engine.step()
    steps_after = sorted(float(s["step"]) for s in optimizer.optimizer.state.values() if "step" in s)
    engine.eval()
    with torch.no_grad():
        b = batches[4]
        next_loss = loss_fn(engine(b[:, :-1]), b[:, 1:]).item()
    if rank == 0:
        torch.save({"tensors": tensors, "steps": steps, "weight_decay": wd, "next_loss": next_loss,
                    "steps_after": steps_after,
                    "global_steps": engine.global_steps - 1, "iteration": client.get("iteration")}, dump)
    dist.barrier()


if __name__ == "__main__" and len(sys.argv) == 6 and sys.argv[1] == "--ds-worker":
    _ds_worker(sys.argv[2], sys.argv[3], int(sys.argv[4]), bool(int(sys.argv[5])))


FP8_SPEC = """\
dims n
mesh dp
w [n, n] : replicate over dp
scale [n] : replicate over dp
state param : dtype float32
state param for scale : dtype float8_e4m3fn
state exp_avg : dtype float32
state step : dtype int64; scalar
"""


def test_ds_universal_writes_fp8_as_torch_does(tmp_path):
    """A frozen fp8 tensor: ``fp32.pt`` holds torch's ``.float()`` of it (fp8 is floating, as for the
    Hugging Face cast) and the model states keep it in fp8, both loadable by ``torch.load``."""
    model = ucl.Spec.from_text(FP8_SPEC, "fp8.ucl").bind(dict(n=4), {"w": (4, 4), "scale": (4,)}, ["scale"])
    bits = np.array([0x38, 0xB8, 0x7F, 0x01], dtype=np.uint8)  # 1.0, -1.0, NaN, the smallest subnormal
    shards = {0: {"param/w": np.eye(4, dtype=np.float32), "exp_avg/w": np.zeros((4, 4), np.float32),
                  "step/w": np.array(3, np.int64), "param/scale": torch.from_numpy(bits).view(torch.float8_e4m3fn)}}
    ucl.save(tmp_path / "c", shards, model=model, mesh=ucl.Mesh.parse("dp=1"))
    export_deepspeed_universal(tmp_path / "c", tmp_path / "ds")
    tag = tmp_path / "ds" / "global_step0"
    fp32 = torch.load(tag / "zero" / "scale" / "fp32.pt", weights_only=True)["param"]
    want = torch.from_numpy(bits).view(torch.float8_e4m3fn).float()
    assert fp32.dtype == torch.float32 and _bits(fp32, want)
    kept = torch.load(tag / "mp_rank_00_model_states.pt", weights_only=True)["module"]["scale"]
    assert kept.dtype == torch.float8_e4m3fn and kept.view(torch.uint8).tolist() == bits.tolist()
