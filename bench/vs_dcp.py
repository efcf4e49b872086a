"""ucl against PyTorch Distributed Checkpoint (DCP), side by side on the same sharded training state.

    python bench/vs_dcp.py [--size-gib 1.5] [--procs 4] [--load-procs 2] [--repeat 3] [--dtype fp32|bf16]
                           [--cold] [--ucl-cached] [--ucl-copy] [--workdir DIR] [--json OUT]
    python bench/vs_dcp.py --quick        # ~100 MB of state, 3 repeats: about a minute

State. A Llama-shaped model (Hugging Face FQNs: model.embed_tokens.weight, model.layers.{i}.self_attn.
{q,k,v,o}_proj.weight, mlp.{gate,up,down}_proj.weight, the two RMSNorm weights, model.norm.weight,
lm_head.weight; ~137 M parameters at the default 1.5 GiB) whose parameters are DTensors Shard(0) over a
1-D DeviceMesh ("dp") of W gloo processes, as FSDP2's fully_shard leaves them (without its hooks), with
AdamW state exp_avg, exp_avg_sq (fp32, DTensors like their parameter) and step (a 0-d fp32 tensor per
parameter). Weights fp32 (default) or bf16. Values are a function of the global element index, so any
shard of any layout can be regenerated to check a load bit for bit. W processes are started by this
script (torch.multiprocessing.start_processes, fork), one thread each (torch.set_num_threads(1)).
  DCP gets the `get_state_dict(model, optimizer)` dicts ({"model": {fqn: DTensor}, "optim": {"state":
{fqn: {kind: ...}}, "param_groups": [...]}}; stored keys model.<fqn>, optim.state.<fqn>.<kind>); ucl
gets the spec `ucl.train.derive(model, optimizer)` writes for the same module ("** : split 0 over dp
uneven", state exp_avg/exp_avg_sq follow, step scalar) and the same local tensors (to_local()), keyed
KIND/FQN, with the param_groups as the manifest's JSON `state`. Both are handed the very same tensors.

Operations (each: one untimed warm-up of both, then --repeat interleaved rounds dcp, ucl, dcp, ucl, ...):
  save          dcp.save(sd, checkpoint_id=new dir)  (FileSystemWriter: one file per rank, fsync)
                vs ucl.save_rank(new dir, tensors, model=, mesh="dp=W", rank=)  (fsync, atomic commit).
                get_state_dict / the key->tensor dict are built once, outside the timing.
  load          dcp.load(sd) into preallocated Shard(0) DTensors (the get_state_dict dicts of a zeroed
                module + AdamW) vs ucl.load_rank(path, mesh="dp=W", rank=, as_torch=True, out=local) filling
                the to_local() shards of the same preallocated tensors in place, + the manifest's JSON
                state. A ucl whose load_rank lacks out= (or --ucl-copy) returns new arrays instead, and the
                copy_ of every tensor into the preallocated ones is then timed as part of ucl ("copy").
  load Shard(1) the same checkpoints loaded into Shard(1) DTensors (1-D norms stay Shard(0)): DCP reshards
                on load; ucl uses load_rank(..., model=) with the spec derive gives for that module.
  load W->W/2   the same checkpoints loaded by --load-procs processes (Shard(0) over dp=W/2), a new group.
  consolidate   dcp_to_torch_save(dcp dir, file.pt) + fsync of the file vs ucl.reshard(ucl dir, new dir,
                to="universal") (durable: fsync), each in a fresh Python process started per run, timed
                inside it around the call alone (imports excluded; one process: a universal target has a
                single rank file, so reshard uses one worker).
ucl keeps a per-process cache of parsed specs and compiled plans; a resume loads once per process, so the
cache is cleared before every timed ucl load (ucl.ops.prepare.forget) unless --ucl-cached is given.

Measured per run: wall time = from a barrier to the end of the call, the max over processes (medians,
min-max over the repeats); from /proc/self/io deltas summed over the processes: rchar (bytes passed by
read syscalls: files, plus the little gloo traffic; page-cache hits included), read_bytes (bytes the
block layer fetched from storage; ~0 with a warm cache), wchar; peak RSS = VmHWM reset right before the
call (/proc/self/clear_refs 5), max over processes, and "+RSS" = that peak minus the process's RSS at the
start of the call (the memory the operation itself needed beyond what the process already held).
Page cache: warm (checkpoints were just written and have been read by the warm-up) unless --cold, which
evicts the checkpoint files with posix_fadvise(DONTNEED) before every timed run (guest page cache only).
Bit-exactness is checked on the last round of every load, outside the timing: the tensors DCP loaded equal
the regenerated source bit for bit on every rank, ucl's loaded tensors equal DCP's (and the source), and
the two consolidated outputs hold the source's bits; any difference aborts the run (the saves are checked
through the loads, which read the last saved checkpoints).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

KINDS = ("param", "exp_avg", "exp_avg_sq")  # tensors shaped like the parameter; plus the scalar `step`
STEP0 = 1000.0  # step of parameter i is STEP0 + i
IMPLS = ("dcp", "ucl")


# ---- model shape and deterministic contents -----------------------------------------------------------
def dims_for(size_gib: float, dtype: str) -> dict:
    per_param = (2 if dtype == "bf16" else 4) + 8  # weight + two fp32 moments
    if size_gib < 0.5:
        d = dict(vocab=8192, hidden=256, heads=8, kv_heads=4, head_dim=32, ffn=704)
    else:
        d = dict(vocab=32000, hidden=768, heads=12, kv_heads=4, head_dim=64, ffn=2048)
    h, q, kv = d["hidden"], d["heads"] * d["head_dim"], d["kv_heads"] * d["head_dim"]
    per_layer = 2 * h * q + 2 * h * kv + 3 * h * d["ffn"] + 2 * h
    fixed = 2 * d["vocab"] * h + h
    d["layers"] = max(1, round((size_gib * 2**30 / per_param - fixed) / per_layer))
    return d


def llama_params(d: dict) -> list[tuple[str, tuple[int, ...]]]:
    """(FQN, global shape) in LlamaForCausalLM.named_parameters() order, untied embeddings."""
    h, q, kv = d["hidden"], d["heads"] * d["head_dim"], d["kv_heads"] * d["head_dim"]
    out = [("model.embed_tokens.weight", (d["vocab"], h))]
    for i in range(d["layers"]):
        p = f"model.layers.{i}."
        out += [(p + "self_attn.q_proj.weight", (q, h)), (p + "self_attn.k_proj.weight", (kv, h)),
                (p + "self_attn.v_proj.weight", (kv, h)), (p + "self_attn.o_proj.weight", (h, q)),
                (p + "mlp.gate_proj.weight", (d["ffn"], h)), (p + "mlp.up_proj.weight", (d["ffn"], h)),
                (p + "mlp.down_proj.weight", (h, d["ffn"])),
                (p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,))]
    return out + [("model.norm.weight", (h,)), ("lm_head.weight", (d["vocab"], h))]


def chunk(n: int, parts: int, i: int) -> slice:
    """torch.chunk's (and DTensor Shard's, and ucl `uneven`'s) i-th piece of range(n)."""
    size = -(-n // parts)
    start = min(i * size, n)
    return slice(start, min(start + size, n))


def local_slices(shape, dim: int, world: int, rank: int) -> tuple[slice, ...]:
    return tuple(chunk(n, world, rank) if d == dim else slice(0, n) for d, n in enumerate(shape))


def gen(tid: int, shape, sl, dtype):
    """Elements [sl] of global tensor `tid`: a bijection of the global index mod 2**24 into the
    mantissa (fp32 values in [0.125, 0.5); bf16 in [0.125, 1.5)), finite and never zero."""
    import torch
    idx = torch.arange(sl[0].start, sl[0].stop, dtype=torch.int64)
    if len(shape) == 2:
        idx = idx.mul_(shape[1])[:, None] + torch.arange(sl[1].start, sl[1].stop, dtype=torch.int64)[None, :]
    h = idx.mul_(2654435761).add_(tid * 40503 + 12345).bitwise_and_(0xFFFFFF)
    if dtype == torch.bfloat16:
        return h.bitwise_and_(0xFFF).add_(0x3E00).to(torch.int16).view(torch.bfloat16)
    return h.add_(0x3E000000).to(torch.int32).view(torch.float32)


def bits(t):
    import torch
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


# ---- the state: a module of DTensor parameters and an AdamW holding state -------------------------------
class State:
    """A module (HF FQNs) of DTensor parameters on `mesh` (Shard(dim2) for matrices, Shard(0) for
    vectors) and an AdamW whose state is set directly; `fill` regenerates the source values, else zeros.
    `expect[KIND/FQN]` -> (tid, global shape, local slices, dtype) to regenerate what a rank must hold."""

    def __init__(self, params, mesh, world: int, rank: int, dim2: int, wdtype, fill: bool):
        import torch
        from torch.distributed.tensor import DTensor, Shard
        self.module, self.expect = torch.nn.Module(), {}
        plist, states = [], []
        for i, (name, shape) in enumerate(params):
            dim = dim2 if len(shape) == 2 else 0
            sl = local_slices(shape, dim, world, rank)
            stride = tuple(shape[1:]) + (1,) if len(shape) == 2 else (1,)
            tensors = {}
            for k, kind in enumerate(KINDS):
                dt = wdtype if kind == "param" else torch.float32
                local = gen(3 * i + k, shape, sl, dt) if fill else torch.zeros([s.stop - s.start for s in sl], dtype=dt)
                tensors[kind] = DTensor.from_local(local, mesh, [Shard(dim)], run_check=False, shape=torch.Size(shape),
                                                   stride=stride)
                self.expect[f"{kind}/{name}"] = (3 * i + k, shape, sl, dt)
            self.expect[f"step/{name}"] = ("step", STEP0 + i)
            m, parts = self.module, name.split(".")
            for p in parts[:-1]:
                if not hasattr(m, p):
                    m.add_module(p, torch.nn.Module())
                m = getattr(m, p)
            param = torch.nn.Parameter(tensors.pop("param"))
            m.register_parameter(parts[-1], param)
            plist.append(param)
            states.append({"step": torch.tensor(STEP0 + i if fill else 0.0), **tensors})
        self.optim = torch.optim.AdamW(plist, lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
        for p, s in zip(plist, states):
            self.optim.state[p] = s

    def dcp_state(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict
        msd, osd = get_state_dict(self.module, self.optim)
        return {"model": msd, "optim": osd}

    def derive(self):
        """ucl's view: the derived layout (spec text, mesh, rank) and KIND/FQN -> local tensor."""
        from ucl.train import derive
        lay = derive(self.module, self.optim)
        return lay, {e.key: e.tensor for e in lay.entries}


def bound_model(lay):
    import ucl
    return ucl.load_spec(lay.spec_text).bind(lay.dims, lay.params, lay.frozen)


def check_against_source(state: State, local: dict) -> list[str]:
    """Keys whose local tensor differs from the regenerated source (bit for bit)."""
    import torch
    bad = []
    for key, t in local.items():
        e = state.expect[key]
        if e[0] == "step":
            ok = t.dim() == 0 and float(t) == e[1]
        else:
            ok = torch.equal(bits(t), bits(gen(e[0], e[1], e[2], e[3])))
        if not ok:
            bad.append(key)
    return bad


# ---- measurement inside a process ------------------------------------------------------------------------
def read_io() -> dict:
    with open("/proc/self/io") as f:
        return {k: int(v) for k, v in (line.split(":") for line in f)}


def vm(field: str) -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith(field))  # MiB


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS


def evict(paths) -> None:
    """Drop the files under `paths` from the page cache (clean pages only; they were fsync'd)."""
    for p in paths:
        for f in Path(p).rglob("*"):
            if f.is_file():
                fd = os.open(f, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)


def trim() -> None:
    """Give freed heap memory back to the OS (glibc malloc_trim), so that the RSS at a call's start is
    what the process holds, not what earlier calls freed, and the call's own peak shows."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def timed_call(fn) -> dict:
    """Run fn() in this process; time, /proc/self/io deltas, peak RSS over the call."""
    trim()
    io0, rss0 = read_io(), vm("VmRSS")
    reset_peak()
    t0 = time.perf_counter()
    extra = fn() or {}
    s = time.perf_counter() - t0
    io1 = read_io()
    rec = dict(s=s, hwm=vm("VmHWM"), rss0=rss0, **{k: io1[k] - io0[k] for k in ("rchar", "wchar", "read_bytes",
                                                                                "write_bytes")})
    rec.update(extra)
    return rec


def combine(recs: list[dict]) -> dict:
    """One run over all processes: wall = max, I/O summed, peak RSS the largest process."""
    out = dict(s=max(r["s"] for r in recs), hwm=max(r["hwm"] for r in recs),
               dhwm=max(r["hwm"] - r["rss0"] for r in recs))
    for k in ("rchar", "wchar", "read_bytes", "write_bytes", "ucl_read", "ucl_needed"):
        if k in recs[0]:
            out[k] = sum(r[k] for r in recs)
    for k in ("copy_s", "compile_s", "load_rank_s"):
        if k in recs[0]:
            out[k] = max(r[k] for r in recs)
    return out


# ---- the distributed part: one group of processes --------------------------------------------------------
def worker(rank: int, cfg: dict, result_path: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    import warnings
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    world = cfg["world"]
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    try:
        out = (save_and_load if cfg.get("group", "main") == "main" else load_resized)(rank, world, mesh, cfg)
        if rank == 0:
            Path(result_path).write_text(json.dumps(out))
    finally:
        dist.destroy_process_group()


class Group:
    """Helpers that every process of a group calls together."""

    def __init__(self, rank: int, cfg: dict):
        self.rank, self.cfg = rank, cfg

    def gather(self, obj):
        import torch.distributed as dist
        out = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)
        return out

    def measure(self, fn, pre=None, evict_paths=()) -> dict:
        import torch.distributed as dist
        if pre is not None:
            pre()
        if self.cfg["cold"] and self.rank == 0 and evict_paths:
            evict(evict_paths)
        gc.collect()
        trim()
        dist.barrier()
        return combine(self.gather(timed_call(fn)))

    def interleaved(self, name: str, calls: dict, pre=None, evict_paths=(), post=None) -> dict:
        """calls: impl -> fn(i); an untimed warm-up of each, then repeat rounds dcp, ucl, ...;
        post(impl) runs (untimed) after each call of the last round."""
        runs = {impl: [] for impl in calls}
        for i in range(self.cfg["repeat"] + 1):
            for impl, fn in calls.items():
                r = self.measure(lambda: fn(i), pre=pre, evict_paths=evict_paths)
                if i:
                    runs[impl].append(r)
                if post is not None and i == self.cfg["repeat"]:
                    post(impl)
        if self.rank == 0:
            print(f"  [{time.time() - self.cfg['t0']:4.0f} s] {name}: " + ", ".join(
                f"{impl} {statistics.median(x['s'] for x in rs):.2f} s" for impl, rs in runs.items()), flush=True)
        return runs

    def fail_if(self, what: str, bad: list[str]) -> None:
        everyone = self.gather(bad)
        if any(everyone):
            lines = [f"rank {r}: {len(b)} tensors differ, e.g. {b[:3]}" for r, b in enumerate(everyone) if b]
            raise SystemExit(f"BIT-EXACTNESS FAILURE in {what}:\n  " + "\n  ".join(lines))


def ucl_out_supported() -> bool:
    """Whether this ucl's load_rank can fill caller tensors in place (out=); older ones return new arrays."""
    import inspect
    import ucl
    return "out" in inspect.signature(ucl.load_rank).parameters


def forget_ucl_cache(cfg: dict) -> None:
    if cfg["ucl_cached"]:
        return
    try:
        from ucl.ops.prepare import forget
        forget()
    except ImportError:  # internal; moved or gone: then loads run with whatever ucl caches
        pass


def load_calls(g: Group, target: State, mesh_str: str, model, dcp_dir: str, ucl_dir: str, rank: int):
    """dcp.load into the target's get_state_dict dicts vs ucl.load_rank + copy into the same tensors."""
    import torch.distributed.checkpoint as dcp
    import ucl
    from ucl.ops import IOStats
    sd = target.dcp_state()
    lay, local = target.derive()

    def dcp_load(i):
        dcp.load(sd, checkpoint_id=dcp_dir)

    use_out = ucl_out_supported() and not g.cfg["ucl_copy"]

    def ucl_load(i):
        forget_ucl_cache(g.cfg)
        st = IOStats()
        t0 = time.perf_counter()
        if use_out:  # fills the preallocated local shards in place
            out = ucl.load_rank(ucl_dir, mesh=mesh_str, rank=rank, model=model, as_torch=True, stats=st, out=local)
            t1 = time.perf_counter()
            if any(out[k] is not t for k, t in local.items()):
                raise SystemExit("ucl.load_rank(out=) returned other objects than the ones given")
        else:  # load_rank returns new arrays: copy them into the preallocated tensors
            out = ucl.load_rank(ucl_dir, mesh=mesh_str, rank=rank, model=model, as_torch=True, stats=st)
            t1 = time.perf_counter()
            for k, t in out.items():
                local[k].copy_(t)
        t2 = time.perf_counter()
        with ucl.open(ucl_dir) as ck:
            sd_state = ck.manifest.state  # the param_groups, as DCP loads them too
        assert sd_state.get("param_groups")
        if set(out) != set(local):
            raise SystemExit(f"ucl.load_rank returned keys {sorted(set(out) ^ set(local))[:4]} that differ from the "
                             "target's")
        return dict(copy_s=t2 - t1, load_rank_s=t1 - t0, compile_s=st.compile_seconds, ucl_read=st.bytes_read,
                    ucl_needed=st.bytes_needed)

    def zero():
        for t in local.values():
            t.zero_()

    return {"dcp": dcp_load, "ucl": ucl_load}, zero, local


def load_checker(g: Group, what: str, target: State, local: dict):
    """post hook of the last round: DCP's load equals the regenerated source, then ucl's load equals
    DCP's (bit for bit) and the source; untimed."""
    import torch
    held = {}

    def post(impl):
        if impl == "dcp":
            g.fail_if(f"{what}: dcp.load vs source", check_against_source(target, local))
            held.update({k: t.clone() for k, t in local.items()})
        else:
            g.fail_if(f"{what}: ucl vs dcp.load",
                      [k for k, t in local.items() if not torch.equal(bits(t), bits(held[k]))])
            g.fail_if(f"{what}: ucl vs source", check_against_source(target, local))
            held.clear()
    return post


def save_and_load(rank: int, world: int, mesh, cfg: dict) -> dict:
    """Group of W processes: save (both), then load at the same layout and at Shard(1)."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    import ucl
    g = Group(rank, cfg)
    wdtype = torch.bfloat16 if cfg["dtype"] == "bf16" else torch.float32
    params = [(n, tuple(s)) for n, s in cfg["params"]]
    mesh_str = f"dp={world}"
    work = Path(cfg["work"])
    results, info = {}, {}

    # -- save ---------------------------------------------------------------------------------------------
    src = State(params, mesh, world, rank, 0, wdtype, fill=True)
    if rank == 0:
        print(f"  [{time.time() - cfg['t0']:4.0f} s] {world} processes up, source state built", flush=True)
    sd = src.dcp_state()
    lay, tensors = src.derive()
    model = bound_model(lay)
    assert str(lay.mesh) == str(ucl.Mesh.parse(mesh_str)) and lay.rank == rank, (lay.mesh, lay.rank)
    pgroups = json.loads(json.dumps(sd["optim"]["param_groups"]))
    info["spec"] = lay.spec_text
    info["local_bytes"] = sum(t.numel() * t.element_size() for t in tensors.values())
    paths = {"dcp": [], "ucl": []}

    def dcp_save(i):
        p = str(work / f"dcp_{i}")
        paths["dcp"].append(p)
        dcp.save(sd, checkpoint_id=p)

    def ucl_save(i):
        p = str(work / f"ucl_{i}")
        paths["ucl"].append(p)
        ucl.save_rank(p, tensors, model=model, mesh=mesh_str, rank=rank, state={"param_groups": pgroups})

    def housekeep():  # untimed, before each run: keep only the newest checkpoint of each
        dist.barrier()
        if rank == 0:
            for impl in IMPLS:
                for p in paths[impl][:-1]:
                    shutil.rmtree(p, ignore_errors=True)
        for impl in IMPLS:
            del paths[impl][:-1]

    results["save"] = g.interleaved("save", {"dcp": dcp_save, "ucl": ucl_save}, pre=housekeep)
    housekeep()
    dcp_dir, ucl_dir = paths["dcp"][-1], paths["ucl"][-1]
    if rank == 0:
        size = lambda p: sum(f.stat().st_size for f in Path(p).rglob("*") if f.is_file())
        info["bytes_on_disk"] = {"dcp": size(dcp_dir), "ucl": size(ucl_dir)}
        info["files"] = {"dcp": len(list(Path(dcp_dir).iterdir())), "ucl": len(list(Path(ucl_dir).iterdir()))}
    src = sd = tensors = None  # free the source state before the loads
    gc.collect()

    # -- load at the same layout, then at Shard(1) ----------------------------------------------------------
    for op, dim2 in (("load", 0), ("load_shard1", 1)):
        target = State(params, mesh, world, rank, dim2, wdtype, fill=False)
        tlay, _ = target.derive()
        tmodel = bound_model(tlay) if dim2 else None  # the checkpoint's own spec for the same layout
        if dim2:
            info["spec_shard1"] = tlay.spec_text
        calls, zero, local = load_calls(g, target, mesh_str, tmodel, dcp_dir, ucl_dir, rank)
        results[op] = g.interleaved(op, calls, pre=zero, evict_paths=(dcp_dir, ucl_dir),
                                    post=load_checker(g, op, target, local))
        del target, calls, local
        gc.collect()
    return dict(results=results, info=info, dcp_dir=dcp_dir, ucl_dir=ucl_dir)


def load_resized(rank: int, world: int, mesh, cfg: dict) -> dict:
    """Group of W/2 processes: load the W-process checkpoints at Shard(0) over dp=W/2."""
    import torch
    g = Group(rank, cfg)
    wdtype = torch.bfloat16 if cfg["dtype"] == "bf16" else torch.float32
    params = [(n, tuple(s)) for n, s in cfg["params"]]
    target = State(params, mesh, world, rank, 0, wdtype, fill=False)
    calls, zero, local = load_calls(g, target, f"dp={world}", None, cfg["dcp_dir"], cfg["ucl_dir"], rank)
    runs = g.interleaved("load_resized", calls, pre=zero, evict_paths=(cfg["dcp_dir"], cfg["ucl_dir"]),
                         post=load_checker(g, "load_resized", target, local))
    return dict(results={"load_resized": runs})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_group(cfg: dict, nprocs: int) -> dict:
    import torch.multiprocessing as mp
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    with tempfile.NamedTemporaryFile(suffix=".json", dir=cfg["work"], delete=False) as f:
        result = f.name
    # fork: the children start with torch imported (spawn would re-import it in every one of them)
    mp.start_processes(worker, args=({**cfg, "world": nprocs}, result), nprocs=nprocs, join=True, start_method="fork")
    out = json.loads(Path(result).read_text())
    os.unlink(result)
    return out


# ---- consolidation: one fresh process per run ------------------------------------------------------------
def consolidate_child(impl: str, src: str, dst: str) -> None:
    """Runs in its own process (--_consolidate): times the call alone and prints a JSON record."""
    import warnings
    warnings.filterwarnings("ignore")
    if impl == "dcp":
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        def fn():
            dcp_to_torch_save(src, dst)
            fd = os.open(dst, os.O_RDONLY)  # torch.save does not fsync; ucl.reshard (durable) does
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    else:
        import ucl

        def fn():
            st = ucl.reshard(src, dst, to="universal")
            return dict(ucl_read=st.bytes_read, ucl_needed=st.bytes_needed, compile_s=st.compile_seconds)
    print(json.dumps(timed_call(fn)), flush=True)


def consolidate(cfg: dict, dcp_dir: str, ucl_dir: str) -> tuple[dict, dict]:
    work = Path(cfg["work"])
    runs = {impl: [] for impl in IMPLS}
    kept = {}
    for i in range(cfg["repeat"] + 1):
        for impl in IMPLS:
            dst = work / (f"consolidated_{i}.pt" if impl == "dcp" else f"universal_{i}")
            src = dcp_dir if impl == "dcp" else ucl_dir
            if cfg["cold"]:
                evict([dcp_dir, ucl_dir])
            p = subprocess.run([sys.executable, __file__, "--_consolidate", impl, src, str(dst)], capture_output=True,
                               text=True)
            lines = [x for x in p.stdout.splitlines() if x.startswith("{")]
            if p.returncode or not lines:
                raise SystemExit(f"consolidation with {impl} failed:\n{p.stdout}\n{p.stderr}")
            if i:
                runs[impl].append(combine([json.loads(lines[-1])]))
            if impl in kept:
                old = kept[impl]
                old.unlink() if old.is_file() else shutil.rmtree(old)
            kept[impl] = dst
    print(f"  [{time.time() - cfg['t0']:4.0f} s] consolidate: " + ", ".join(f"{impl} {statistics.median(x['s'] for x in rs):.2f} s"
                                        for impl, rs in runs.items()), flush=True)
    return runs, kept


def verify_consolidated(cfg: dict, pt: Path, universal: Path) -> int:
    """The torch.save file and the universal ucl checkpoint hold the source's bits, tensor by tensor."""
    import torch
    import ucl
    from ucl.dtypes import to_torch
    wdtype = torch.bfloat16 if cfg["dtype"] == "bf16" else torch.float32
    full = torch.load(pt, weights_only=False, mmap=True)
    bad, n = [], 0
    with ucl.open(universal) as ck:
        assert ck.nranks == 1
        for i, (name, shape) in enumerate(cfg["params"]):
            for k, kind in enumerate(KINDS):
                want = gen(3 * i + k, shape, tuple(slice(0, s) for s in shape), wdtype if kind == "param" else torch.float32)
                d = full["model"][name] if kind == "param" else full["optim"]["state"][name][kind]
                u = to_torch(ck.read(0, f"{kind}/{name}"), ck.info(0, f"{kind}/{name}").dtype)
                n += 1
                if not (torch.equal(bits(d), bits(want)) and torch.equal(bits(u), bits(want))):
                    bad.append(f"{kind}/{name}")
            d, u = full["optim"]["state"][name]["step"], ck.read(0, f"step/{name}")
            if float(d) != STEP0 + i or float(u) != STEP0 + i:
                bad.append(f"step/{name}")
        if full["optim"]["param_groups"][0]["lr"] != ck.manifest.state["param_groups"][0]["lr"]:
            bad.append("param_groups")
    if bad:
        raise SystemExit(f"BIT-EXACTNESS FAILURE in consolidate: {len(bad)} tensors differ, e.g. {bad[:3]}")
    return n


# ---- report ---------------------------------------------------------------------------------------------
OPS = [("save", "save"), ("load", "load, same layout"), ("load_shard1", "load as Shard(1)"),
       ("load_resized", "load W -> W/2"), ("consolidate", "consolidate")]


def med(rs, key, scale=1.0):
    xs = [r[key] * scale for r in rs if key in r]
    return statistics.median(xs) if xs else None


def fmt_s(rs) -> str:
    xs = [r["s"] for r in rs]
    f = lambda v: f"{v:.3f}" if v < 1 else f"{v:.2f}"
    return f"{f(statistics.median(xs))} ({f(min(xs))}-{f(max(xs))})"


def report(results: dict, cfg: dict, info: dict) -> list[str]:
    mib = 1 / 2**20
    hdr = (f"{'operation':<18} {'impl':<4} {'wall s median (min-max)':>24} {'ucl/dcp':>7} {'read MiB':>9} "
           f"{'disk rd':>8} {'written':>8} {'peak RSS':>9} {'+RSS':>7}  notes")
    lines = [hdr, "-" * len(hdr)]
    for op, label in OPS:
        runs = results.get(op)
        if not runs:
            continue
        procs = cfg["load_procs"] if op == "load_resized" else 1 if op == "consolidate" else cfg["procs"]
        base = statistics.median(r["s"] for r in runs["dcp"])
        for impl in IMPLS:
            rs = runs[impl]
            ratio = f"{statistics.median(r['s'] for r in rs) / base:7.2f}" if impl == "ucl" else " " * 7
            note = ""
            if impl == "ucl" and op.startswith("load"):
                how = (f"load_rank(out=) {med(rs, 'load_rank_s'):.2f} s" if cfg["ucl_out"] else
                       f"load_rank {med(rs, 'load_rank_s'):.2f} s + copy {med(rs, 'copy_s'):.2f} s")
                note = (f"{how} (compile {med(rs, 'compile_s'):.2f}); IOStats read {med(rs, 'ucl_read', mib):.0f} MiB for "
                        f"{med(rs, 'ucl_needed', mib):.0f} needed")
            elif impl == "ucl" and op == "consolidate":
                note = f"compile {med(rs, 'compile_s'):.2f} s; IOStats read {med(rs, 'ucl_read', mib):.0f} MiB"
            elif op == "save" and "bytes_on_disk" in info:
                note = f"{info['bytes_on_disk'][impl] * mib:.0f} MiB on disk in {info['files'][impl]} files"
            first = f"{label} ({procs}p)" if impl == "dcp" else ""
            lines.append(f"{first:<18} {impl:<4} {fmt_s(rs):>24} {ratio} {med(rs, 'rchar', mib):9.0f} "
                         f"{med(rs, 'read_bytes', mib):8.0f} {med(rs, 'wchar', mib):8.0f} {med(rs, 'hwm'):9.0f} "
                         f"{med(rs, 'dhwm'):7.0f}  {note}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gib", type=float, default=1.5, help="total state (weights + Adam moments), GiB")
    ap.add_argument("--quick", action="store_true", help="~100 MB of state (--size-gib 0.1)")
    ap.add_argument("--procs", type=int, default=4, help="processes holding the state (W)")
    ap.add_argument("--load-procs", type=int, default=0, help="processes of the resized load (default W/2)")
    ap.add_argument("--repeat", type=int, default=3, help="timed rounds per operation (after one warm-up)")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="weights; Adam state is fp32")
    ap.add_argument("--cold", action="store_true", help="evict the checkpoints from the page cache before each load")
    ap.add_argument("--ucl-cached", action="store_true", help="keep ucl's per-process spec/plan cache between loads")
    ap.add_argument("--ucl-copy", action="store_true", help="ucl loads into new arrays + copy_ even if load_rank has out=")
    ap.add_argument("--workdir", default=None, help="where checkpoints go (default: a temp dir)")
    ap.add_argument("--json", default=None, metavar="OUT", help="also write the raw results as JSON")
    ap.add_argument("--_consolidate", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._consolidate:
        consolidate_child(*args._consolidate)
        return
    import torch
    size = 0.1 if args.quick else args.size_gib
    load_procs = args.load_procs or max(1, args.procs // 2)
    dims = dims_for(size, args.dtype)
    params = llama_params(dims)
    n = sum(torch.Size(s).numel() for _, s in params)
    if args.workdir:
        os.makedirs(args.workdir, exist_ok=True)
    work = tempfile.mkdtemp(prefix="ucl-bench-vs-dcp-", dir=args.workdir)
    cfg = dict(work=work, dtype=args.dtype, params=params, repeat=args.repeat, cold=args.cold,
               ucl_cached=args.ucl_cached, ucl_copy=args.ucl_copy, procs=args.procs, load_procs=load_procs, t0=time.time())
    fs = subprocess.run(["findmnt", "-n", "-o", "FSTYPE", "-T", work], capture_output=True, text=True).stdout.strip()
    state_bytes = n * ((2 if args.dtype == "bf16" else 4) + 8) + 4 * len(params)
    print(f"state: Llama-shaped, {n / 1e6:.1f} M parameters {dims}, {args.dtype} weights + fp32 exp_avg/exp_avg_sq + "
          f"step = {state_bytes / 2**30:.2f} GiB, Shard(0) over {args.procs} gloo processes (1 thread each); "
          f"torch {torch.__version__}, {os.cpu_count()} CPUs; checkpoints in {work} ({fs or '?'})")
    cfg["ucl_out"] = ucl_out_supported() and not args.ucl_copy
    print(f"ucl loads: {'load_rank(..., out=local shards): filled in place' if cfg['ucl_out'] else 'load_rank returns new arrays, then copy_ into the preallocated tensors (part of the timing)'}")
    print(f"page cache: {'COLD (posix_fadvise DONTNEED of the checkpoint files before each load)' if args.cold else 'warm (nothing evicted)'}; "
          f"{args.repeat} interleaved rounds after a warm-up; ucl plan cache "
          f"{'kept' if args.ucl_cached else 'cleared before each load'}; load average {os.getloadavg()[0]:.2f}",
          flush=True)
    t_start = time.perf_counter()
    try:
        main_out = run_group(cfg, args.procs)
        info, results = main_out["info"], dict(main_out["results"])
        resized = run_group({**cfg, "group": "resized", "dcp_dir": main_out["dcp_dir"], "ucl_dir": main_out["ucl_dir"]},
                            load_procs)
        results.update(resized["results"])
        results["consolidate"], kept = consolidate(cfg, main_out["dcp_dir"], main_out["ucl_dir"])
        n_checked = verify_consolidated(cfg, kept["dcp"], kept["ucl"])
        lines = report(results, cfg, info)
        print()
        print("\n".join(lines))
        print(f"\nwall: max over processes, barrier -> end of call; read MiB = rchar (bytes copied by read calls: ucl "
              f"copies short column blocks out of a mapping, which rchar does not see; its IOStats note counts "
              f"them), disk rd = read_bytes, written = "
              f"wchar, all MiB summed over the processes; peak RSS = VmHWM during the call (max process), +RSS = peak "
              f"minus RSS at the call's start (MiB). Medians over {args.repeat} rounds; ucl/dcp = ratio of median walls.")
        print(f"per process held state: {info['local_bytes'] / 2**20:.0f} MiB at W={args.procs}. ucl spec (derived):\n  "
              + info["spec"].strip().replace("\n", "\n  "))
        print(f"bit-exact: every load (dcp == source, ucl == dcp == source, every tensor of every rank) and both "
              f"consolidated outputs ({n_checked} tensors + steps + param_groups) OK")
        print(f"total {time.perf_counter() - t_start:.0f} s; load average at end {os.getloadavg()[0]:.2f}")
        if args.json:
            Path(args.json).write_text(json.dumps(dict(config={k: v for k, v in cfg.items() if k != "params"},
                                                       dims=dims, n_params=n, state_bytes=state_bytes, info=info,
                                                       results=results, torch=torch.__version__), indent=1))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
