"""ucl.Checkpointer under torch.distributed (gloo): DDP replicas, FSDP2 ``fully_shard``, TP
``parallelize_module``, FSDP2 x TP (``_StridedShard``) and a Megatron-style manual spec. A job saves
mid-training; another job, on another world size or parallelism, loads and continues. The losses
after resuming must equal those of the uninterrupted run bit for bit, and the global state saved
must equal the single-process reference."""
from __future__ import annotations

import datetime
import json
import os

import pytest

torch = pytest.importorskip("torch")
import torch.multiprocessing as tmp_mp  # noqa: E402

import ucl  # noqa: E402
from spawned import free_port, spawn_ranks  # noqa: E402

SAVE_AT, STEPS, DIM, OUT = 3, 6, 16, 8


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(DIM, 32), torch.nn.ReLU(), torch.nn.Linear(32, OUT))


def _parallelize(model, mode: str, world: int):
    from torch.distributed.device_mesh import init_device_mesh
    if mode == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model)
    if mode in ("fsdp", "fsdp_tp"):
        from torch.distributed.fsdp import fully_shard
        shape, names = ((world,), ("dp",)) if mode == "fsdp" else ((2, world // 2), ("dp", "tp"))
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        if mode == "fsdp_tp":
            _tp(model, mesh["tp"])
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        return model
    if mode == "tp":
        _tp(model, init_device_mesh("cpu", (world,), mesh_dim_names=("tp",)))
    return model


def _tp(model, mesh):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})


class ManualTP(torch.nn.Module):
    """Megatron-style tensor parallelism with plain local tensors: column-parallel fc1 (rows of the
    weight), row-parallel fc2 (columns), each rank holding its slice under the global name."""

    def __init__(self, rank: int, world: int):
        super().__init__()
        full = _model()
        rows = 32 // world
        self.fc1_w = torch.nn.Parameter(full[0].weight.detach()[rank * rows:(rank + 1) * rows].clone())
        self.fc1_b = torch.nn.Parameter(full[0].bias.detach()[rank * rows:(rank + 1) * rows].clone())
        self.fc2_w = torch.nn.Parameter(full[2].weight.detach()[:, rank * rows:(rank + 1) * rows].clone())
        self.fc2_b = torch.nn.Parameter(full[2].bias.detach().clone())

    def forward(self, x):
        h = torch.relu(x @ self.fc1_w.T + self.fc1_b)
        return _SumPartials.apply(h @ self.fc2_w.T) + self.fc2_b


class _SumPartials(torch.autograd.Function):
    """Row-parallel output: forward sums the ranks' partial products, backward passes the gradient
    through unchanged (every rank already holds the full output gradient)."""

    @staticmethod
    def forward(ctx, y):
        import torch.distributed as dist
        y = y.clone()
        dist.all_reduce(y)
        return y

    @staticmethod
    def backward(ctx, grad):
        return grad


MANUAL_SPEC = """mesh tp
fc1_w [32, 16] : split 0 over tp
fc1_b [32] : split 0 over tp
fc2_w [8, 32] : split 1 over tp
fc2_b [8] : replicate over tp
state exp_avg, exp_avg_sq : follow
state step : scalar
"""


def _batch(i):
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(8, DIM, generator=g), torch.randn(8, OUT, generator=g)


def _worker(rank: int, world: int, port: int, root: str, mode: str, phase: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import torch.distributed as dist
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    result: dict = {"rank": rank, "losses": []}
    try:
        if mode == "manual":
            model = ManualTP(rank, world)
            spec = ucl.load_spec(MANUAL_SPEC)
            bound = spec.bind({}, spec.synthesize_params({}))
            kw = dict(spec=bound, mesh=ucl.Mesh(tp=world))
        else:
            model = _parallelize(_model(), mode, world)
            kw = {}
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        if phase == "own_root":  # a per-process temp dir by mistake
            try:
                ucl.Checkpointer(f"{root}-{rank}", model, opt, **kw)
            except ucl.UclError as e:
                result["code"], result["message"] = e.code, str(e)
            return
        if phase == "peer_fails":  # process 1's module does not fit its layout: its save() raises, it exits
            x, y = _batch(0)
            ((model(x) - y) ** 2).mean().backward()
            opt.step()
            if rank == 1:
                model.extra = torch.nn.Parameter(torch.ones(3))
            ck = ucl.Checkpointer(root, model, opt, **kw)
            try:
                ck.save(5)
                ck.wait()
            except ucl.StoreError as e:
                result["code"], result["message"] = e.code, str(e)
            finally:  # its threads and group go before the process group does (else, at times, SIGABRT at exit)
                try:
                    ck.close()
                except ucl.UclError:
                    pass
            return
        if phase == "mismatch":  # every process saves, but not the same step
            ck = ucl.Checkpointer(root, model, opt, **kw)
            try:
                ck.save(5 + rank)
                ck.wait()
            except ucl.StoreError as e:
                result["code"] = e.code
            finally:
                try:
                    ck.close()
                except ucl.StoreError as e:
                    result.setdefault("code", e.code)
            return
        if phase == "memory":  # a snapshot kept in host memory only, rolled back to after a bad step
            import warnings
            kw["persist_every"] = 1000
        with ucl.Checkpointer(root, model, opt, **kw) as ck:
            start = 0
            if phase == "memory":
                for i in range(SAVE_AT):
                    x, y = _batch(i)
                    opt.zero_grad()
                    ((model(x) - y) ** 2).mean().backward()
                    opt.step()
                ck.save(SAVE_AT + 1, extra={"data_position": SAVE_AT})
                torch.manual_seed(1234 + rank)  # the bad step moves the generators too
                x, y = torch.randn(8, DIM) * 100, torch.randn(8, OUT)
                opt.zero_grad()
                ((model(x) - y) ** 2).mean().backward()
                opt.step()
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    start, extra = ck.load()
                result["warnings"] = [str(w.message) for w in caught]
                result["on_disk"] = ucl.store.CheckpointRoot(root).steps()
                result["rng_after_load"] = torch.rand(2).tolist()
                start = SAVE_AT
            if phase == "load":
                start, extra = ck.load()
                result["extra"] = extra
            for i in range(start, STEPS):
                x, y = _batch(i)
                loss = ((model(x) - y) ** 2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                result["losses"].append(loss.item())
                if phase == "save" and i + 1 == SAVE_AT:
                    ck.save(SAVE_AT, extra={"data_position": SAVE_AT})
                    result["rng_at_save"] = torch.rand(2).tolist()  # what the generators give next (no dropout here)
    except Exception as e:  # noqa: BLE001 - reported to the parent, which fails the test
        import traceback
        result["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
    finally:
        with open(os.path.join(out, f"{phase}_{rank}.json"), "w") as f:
            json.dump(result, f)
        dist.destroy_process_group()


def _spawn(world: int, root, mode: str, phase: str, out, limit_s: float = 120.0) -> list[dict]:
    return spawn_ranks(_worker, world, (world, free_port(), str(root), mode, phase, str(out)), str(out), phase,
                       limit_s, label=f"{mode} {phase}")


def _reference() -> tuple[list[float], dict]:
    """The uninterrupted single-process run: losses, and the state right after step SAVE_AT."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, at_save = [], {}
    for i in range(STEPS):
        x, y = _batch(i)
        loss = ((model(x) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if i + 1 == SAVE_AT:
            at_save = {k: v.detach().clone() for k, v in model.state_dict().items()}
            for n, p in model.named_parameters():
                for kind, v in opt.state[p].items():
                    at_save[f"{kind}/{n}"] = v.detach().clone()
    return losses, at_save


MANUAL_NAMES = {"0.weight": "fc1_w", "0.bias": "fc1_b", "2.weight": "fc2_w", "2.bias": "fc2_b"}


# the default pass keeps one representative (DDP saved, resumed as a plain module); the rest spawn
# 2-4 processes each: the slow pass
@pytest.mark.parametrize("saver,savers,loader,loaders", [
    ("ddp", 2, "plain", 1),
    pytest.param("ddp", 2, "ddp", 2, marks=pytest.mark.slow),
    pytest.param("fsdp", 2, "plain", 1, marks=pytest.mark.slow),
    pytest.param("fsdp", 2, "tp", 2, marks=pytest.mark.slow),
    pytest.param("tp", 2, "fsdp", 2, marks=pytest.mark.slow),
    pytest.param("fsdp_tp", 4, "plain", 1, marks=pytest.mark.slow),
    pytest.param("plain", 1, "fsdp_tp", 4, marks=pytest.mark.slow),
    pytest.param("manual", 2, "manual", 2, marks=pytest.mark.slow),
])
def test_save_on_one_parallelism_resume_on_another(tmp_path, saver, savers, loader, loaders):
    reference, at_save = _reference()
    root = tmp_path / "ckpt"
    saved = _spawn(savers, root, saver, "save", tmp_path / "out")
    assert saved[0]["losses"] == pytest.approx(reference, rel=1e-6, abs=1e-7)  # sharded math may round differently
    # the global state on disk is the reference state at SAVE_AT, bit for bit
    from ucl.store import CheckpointRoot
    path = CheckpointRoot(root).latest()
    with ucl.open(path) as ck:
        assert ck.verify() == []
    glob = ucl.load_rank(path, mesh="universal", rank=0, as_torch=True)
    for key, want in at_save.items():
        kind, _, name = key.rpartition("/") if "/" in key else ("param", "", key)
        name = MANUAL_NAMES[name] if saver == "manual" else name
        got = glob[f"{kind or 'param'}/{name}"]
        if saver in ("plain", "ddp") or kind == "step":
            assert torch.equal(got, want), key  # no sharded arithmetic: exact
        else:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # resuming on another parallelism continues exactly like the saving job would have
    resumed = _spawn(loaders, root, loader, "load", tmp_path / "out")
    assert resumed[0]["extra"] == {"data_position": SAVE_AT}
    if (saver, loader) in (("ddp", "plain"), ("manual", "manual"), ("plain", "fsdp_tp")) or saver == loader:
        want = saved[0]["losses"][SAVE_AT:] if saver == loader else reference[SAVE_AT:]
        for r in resumed:  # every process: a DDP replica restores its own copy too
            assert r["losses"] == pytest.approx(want, rel=1e-6, abs=1e-7), r["rank"]
    else:
        assert resumed[0]["losses"] == pytest.approx(reference[SAVE_AT:], rel=1e-5, abs=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_a_rollback_from_host_memory_restores_every_process(tmp_path, mode):
    """persist_every keeps the snapshot in host memory only: after a bad step, load() restores it on
    every process (a DDP replica receives rank 0's copy), RNG included, and training goes on as the
    uninterrupted run (the "save" phase) did."""
    saved = _spawn(2, tmp_path / "ref", mode, "save", tmp_path / "out")
    rolled = _spawn(2, tmp_path / "mem", mode, "memory", tmp_path / "out")
    for r in rolled:
        assert r["on_disk"] == [] and r["warnings"] == [], r
        assert r["rng_after_load"] == saved[r["rank"]]["rng_at_save"], r["rank"]
        assert r["losses"] == pytest.approx(saved[0]["losses"][SAVE_AT:], rel=1e-6, abs=1e-7), r["rank"]


@pytest.mark.slow
def test_processes_saving_different_steps_all_fail_and_write_nothing(tmp_path):
    """save(5) on one process and save(6) on the other: each raises UCL436 (no hang), and no
    checkpoint is committed under either number."""
    results = _spawn(2, tmp_path / "ck", "fsdp", "mismatch", tmp_path / "out", limit_s=90)
    assert [r.get("code") for r in results] == ["UCL436", "UCL436"]
    assert ucl.store.CheckpointRoot(tmp_path / "ck").steps() == []


def _mixed_mesh_worker(rank: int, port: int, root: str, out: str) -> None:
    """FSDP2 x TP where a LayerNorm is not tensor-parallel: FSDP2 puts it on the 1-D ``dp`` slice of
    the (dp, tp) mesh, the TP'd Linears on the 2-D mesh. Saves, and writes torch's own full state."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    dist.init_process_group("gloo", rank=rank, world_size=4, timeout=datetime.timedelta(seconds=60))
    try:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        model = _normed_model()
        parallelize_module(model, mesh["tp"], {"1": ColwiseParallel(), "3": RowwiseParallel()})
        fully_shard(model, mesh=mesh["dp"])
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for i in range(2):
            x, y = _batch(i)
            opt.zero_grad()
            ((model(x) - y) ** 2).mean().backward()
            opt.step()
        meshes = sorted({p.device_mesh.ndim for p in model.parameters()})
        with ucl.Checkpointer(root, model, opt) as ck:
            ck.save(2)
        msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            torch.save({"model": msd, "optim": osd, "meshes": meshes}, os.path.join(out, "torch_full.pt"))
    finally:
        dist.destroy_process_group()


def _normed_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.LayerNorm(DIM), torch.nn.Linear(DIM, 32), torch.nn.ReLU(),
                               torch.nn.Linear(32, OUT))


@pytest.mark.slow
def test_fsdp2_tp_with_a_parameter_on_the_dp_slice_saves_and_loads_anywhere(tmp_path):
    """A norm left out of the TP plan lives on the dp slice of the mesh (UCL430 before): it is
    replicated over tp. Loaded into a plain module, every tensor equals torch's own full state."""
    root, out = tmp_path / "ckpt", tmp_path / "out"
    out.mkdir()
    tmp_mp.spawn(_mixed_mesh_worker, args=(free_port(), str(root), str(out)), nprocs=4)
    want = torch.load(out / "torch_full.pt", weights_only=True)
    assert want["meshes"] == [1, 2]  # the case at hand: parameters on two meshes
    model = _normed_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with ucl.Checkpointer(root, model, opt) as ck:
        assert ck.load()[0] == 2
    for name, value in model.state_dict().items():
        assert torch.equal(value, want["model"][name]), name
    for name, p in model.named_parameters():
        for kind, value in opt.state[p].items():
            assert torch.equal(value, want["optim"]["state"][name][kind]), (name, kind)


@pytest.mark.slow
def test_a_process_that_fails_its_save_and_exits_fails_the_others_with_ucl424(tmp_path):
    """The others' flush is waiting for it: they learn at once that it stopped answering (UCL424,
    as docs/training.md says; it was a bare UCL410 'writing failed'), and nothing is written."""
    results = _spawn(2, tmp_path / "ck", "manual", "peer_fails", tmp_path / "out", limit_s=90)
    assert results[1]["code"] == "UCL421" and "extra" in results[1]["message"], results[1]
    assert results[0]["code"] == "UCL424" and "stopped answering" in results[0]["message"], results[0]
    from ucl.store import CheckpointRoot
    assert CheckpointRoot(tmp_path / "ck").steps() == []


@pytest.mark.slow
def test_processes_given_different_roots_are_refused_at_construction(tmp_path):
    """Rank 0's root would get every rank file and the others' none; a later load() would restore
    only some processes."""
    results = _spawn(2, tmp_path / "ck", "fsdp", "own_root", tmp_path / "out", limit_s=90)
    for r in results:
        assert r.get("code") == "UCL430" and "different checkpoint roots" in r["message"], r
        assert f"rank 1: {tmp_path / 'ck'}-1" in r["message"], r
