"""Checkpoint-save benchmark: what checkpointing costs a training loop, for ucl.Checkpointer against
torch.save and torch.distributed.checkpoint (DCP), measured in one run on the same seeded GPT-like toy
transformer (torch.nn: embedding, N blocks of attention + MLP, AdamW; CPU).

    python bench/save.py [--params-m 50] [--every 1 10] [--iters N] [--rounds 3] [--batch 2] [--seq 128] [--workdir DIR]
    python bench/save.py --quick        # tiny model, few timed iterations: checks that everything runs
    python bench/save.py --device cuda --bf16-autocast --params-m 940 --batch 8 --seq 1024 --every 1 40   # a GPU

Variants: none; torch.save of model + optimizer state_dicts, then fsync; DCP save (FileSystemWriter
fsyncs); DCP async_save in a thread (default stager: copies inside the call); DCP async_save with
AsyncCheckpointerType.PROCESS and a shared-memory DefaultStager staging in the background (the
optimizer step waits for it); ucl.Checkpointer (its default pool: a quarter of a snapshot, at least 256 MiB, on the CPU; one snapshot from a GPU where the host has room); ucl-flat: the same
with tile_checksums=False (flat chunk checksums only: about a third less snapshot CPU); ucl-host:
persist_every=10; ucl-poolF: pool_bytes = F x one snapshot (--pools; below 1 the snapshot streams
through the pool as a ring, docs/training.md "Sizing the host pool"). Async
variants finish one checkpoint before the next (DCP: future.result(); ucl: pool back-pressure). Each (variant, interval) runs in its own process
(`--variant X --interval K`, JSON on stdout), so peak RSS (getrusage maxrss) does not mix.

Per run: 2 warm-up iterations (the second saves once: one-time setup shows as "1st durable"), drain,
then --rounds rounds of: 4 timed iterations without saving, then N timed iterations saving at every
K-th (saving every iteration, an untimed one before them saves too, so each timed one runs beside
the previous checkpoint's flush), an untimed one whose optimizer step fences the last save, and an
untimed drain. Alternating the phases lets the machine's drift hit both alike. Medians (min-max) of:
stall = training-thread time in the save call plus the wait in the next optimizer step's pre-hook
(ucl fence, DCP staging); call = the save call alone (torch.save: before fsync); iteration time over
the same process's no-saving ones (median and mean: other load on the machine moves both); durable =
save call -> fsync'd (ucl: -> `latest` moved, from its trace); peak RSS, and above the no-checkpoint run's
(in MiB and in snapshots); bytes on disk per checkpoint;
ratios to torch.save; for ucl, its trace's phases and the CPU time of its snapshot and flush threads per
checkpoint (on a machine whose cores training keeps busy, about what checkpointing costs it).
Baselines delete checkpoints beyond 3 between iterations (untimed); ucl prunes itself (keep=3). A last
run checks that a ucl checkpoint loads bit-exactly.
"""
from __future__ import annotations

import argparse, copy, json, os, resource, shutil, statistics, subprocess, sys, tempfile, time, warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
VARIANTS = ["torch.save", "dcp", "dcp-async", "dcp-async-proc", "ucl", "ucl-flat", "ucl-host"]
KEEP = 3  # checkpoints kept on disk
BASE = 4  # iterations without checkpointing timed in every round, right before the checkpointing ones


# ---- model ---------------------------------------------------------------------------------------------
class GPT(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, seq: int):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(nn.TransformerEncoderLayer(d, max(1, d // 64), 4 * d, dropout=0.0, activation="gelu",
                                                               batch_first=True, norm_first=True) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        mask = nn.Transformer.generate_square_subsequent_mask(idx.shape[1], device=idx.device)
        for blk in self.blocks:  # pre-norm causal self-attention + GELU MLP
            x = blk(x, src_mask=mask, is_causal=True)
        return self.head(self.ln(x))


def shape(args) -> dict:
    if args.quick:
        return dict(vocab=512, d=64, layers=2, seq=32)
    vocab, d = 8192, 512 if args.params_m < 40 else 768 if args.params_m < 250 else 1024
    return dict(vocab=vocab, d=d, layers=max(1, round((args.params_m * 1e6 - 2 * vocab * d) / (12 * d * d))), seq=args.seq)


def build(cfg: dict, seed: int, device: str = "cpu"):
    torch.manual_seed(seed)
    model = GPT(cfg["vocab"], cfg["d"], cfg["layers"], cfg["seq"]).to(device)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


# ---- savers: save(step) runs on the training thread, pre_step() in the optimizer step pre-hook ----------
class Saver:
    def __init__(self, root: Path, model, opt):
        self.root, self.model, self.opt = root, model, opt
        self.call, self.durable, self.paths, self.note = {}, {}, [], ""

    def state(self):
        return {"model": self.model.state_dict(), "optim": self.opt.state_dict()}

    def pre_step(self):  # in the optimizer step pre-hook
        pass

    def drain(self):  # until everything saved so far is durable
        pass

    def housekeep(self):  # untimed: delete all but the newest KEEP checkpoints
        while len(self.paths) > KEEP:
            p = self.paths.pop(0)
            shutil.rmtree(p) if p.is_dir() else p.unlink()

    def close(self):
        self.drain()


class TorchSave(Saver):
    def save(self, step):
        path, t0 = self.root / f"step_{step}.pt", time.perf_counter()
        with open(path, "wb") as f:
            torch.save(self.state(), f)
            f.flush()
            self.call[step] = time.perf_counter() - t0
            os.fsync(f.fileno())
        self.durable[step] = time.perf_counter() - t0
        self.paths.append(path)


class DCPSync(Saver):
    def save(self, step):
        path, t0 = self.root / f"step_{step}", time.perf_counter()
        dcp.save(self.state(), checkpoint_id=str(path))  # no process group: torch 2.13 saves single-process
        self.note = "ran without a process group"
        self.call[step] = self.durable[step] = time.perf_counter() - t0
        self.paths.append(path)


class DCPAsync(Saver):
    def __init__(self, root, model, opt, process=False):
        super().__init__(root, model, opt)
        self.process, self.pending, self.stager, self.staging = process, None, None, None
        if self.process:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
            if not dist.is_initialized():  # the writer process needs a process group: a 1-rank gloo one
                from torch.distributed.elastic.utils.distributed import get_free_port
                os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(get_free_port()))
                dist.init_process_group("gloo", rank=0, world_size=1)
            cuda = torch.cuda.is_available()
            self.stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=True,
                                                       use_async_staging=True, use_non_blocking_copy=cuda))
            self.note = "shared-memory stager, background staging, " + ("pinned" if cuda else "no pinning (no CUDA)")

    def save(self, step):
        self.drain()  # the previous checkpoint must finish before its staging buffers are reused
        path, t0 = self.root / f"step_{step}", time.perf_counter()
        out = dcp.async_save(self.state(), checkpoint_id=str(path), async_stager=self.stager,
                             async_checkpointer_type=AsyncCheckpointerType.PROCESS if self.process
                             else AsyncCheckpointerType.THREAD)
        self.call[step] = time.perf_counter() - t0
        self.pending, self.staging = (out.upload_completion, out.staging_completion) \
            if hasattr(out, "upload_completion") else (out, None)
        self.pending.add_done_callback(lambda f, s=step: self.durable.__setitem__(s, time.perf_counter() - t0))
        self.paths.append(path)

    def pre_step(self):
        if self.staging is not None:
            self.staging.result()
            self.staging = None

    def drain(self):
        self.pre_step()
        if self.pending is not None:
            self.pending.result()
            while len(self.durable) < len(self.call):  # the done callback runs just after result() wakes
                time.sleep(0.001)
            self.pending = None

    def writer_rss_mb(self):  # DCP's writer process, read while it is alive
        from torch.distributed.checkpoint import _async_process_executor as ape
        with open(f"/proc/{ape._CHECKPOINT_PROCESS._save_process.pid}/status") as f:
            return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmHWM"))

    def close(self):
        self.drain()
        self.stager and self.stager.close()


class Ucl(Saver):
    def __init__(self, root, model, opt, persist_every=1, tile_checksums=True, pool=None):
        super().__init__(root, model, opt)
        import ucl
        pool_bytes = None if pool is None else max(4096, int(pool * snapshot_bytes(model, laid_out=True)))
        self.ck = ucl.Checkpointer(root, model, opt, keep=KEEP, persist_every=persist_every,  # + step pre-hook fence
                                   tile_checksums=tile_checksums, pool_bytes=pool_bytes)
        if pool is not None:
            self.note = f"pool_bytes {pool:g} x one snapshot = {pool_bytes / 2**20:.1f} MiB"
        if persist_every > 1:
            self.note = f"host-memory snapshot at every save, every {persist_every}th written to disk"
        if not tile_checksums:
            self.note = "tile_checksums=False: flat chunk checksums only"

    def save(self, step):
        t0 = time.perf_counter()
        self.ck.save(step)
        self.call[step] = time.perf_counter() - t0

    def drain(self):
        self.ck.wait()
        ev = self.ck.trace.events()  # durable: save() called -> `latest` moved (wall-clock seconds)
        start = {e["step"]: e["start"] for e in ev if e["phase"] == "blocked"}
        self.durable.update({e["step"]: e["end"] - start[e["step"]] for e in ev if e["phase"] == "flush"})


def snapshot_bytes(model, laid_out: bool = False) -> int:
    """One AdamW snapshot: parameters and two moments (fp32 here), plus buffers; the steps are scalars.
    ``laid_out``: as the Checkpointer's pool holds it, each tensor starting at a 4 KiB boundary (an
    upper bound), so that a pool of one snapshot really holds one."""
    page = 4096 if laid_out else 1
    params = sum(-(-p.numel() * p.element_size() // page) * page for p in model.parameters())
    steps = page * len(list(model.parameters())) if laid_out else 0
    return 3 * params + steps + sum(-(-b.numel() * b.element_size() // page) * page for b in model.buffers())


def saver_of(variant: str):
    if variant.startswith("ucl-pool"):
        return lambda *a: Ucl(*a, pool=float(variant[len("ucl-pool"):]))
    return SAVERS[variant]


SAVERS = {"none": Saver, "torch.save": TorchSave, "dcp": DCPSync, "dcp-async": DCPAsync,
          "dcp-async-proc": lambda *a: DCPAsync(*a, process=True), "ucl": Ucl, "verify": Ucl,
          "ucl-flat": lambda *a: Ucl(*a, tile_checksums=False), "ucl-host": lambda *a: Ucl(*a, persist_every=10)}


# ---- one variant, in its own process ---------------------------------------------------------------------
def run_variant(args) -> dict:
    cfg = shape(args)
    model, opt = build(cfg, seed=0, device=args.device)
    cuda = args.device.startswith("cuda")
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda and args.bf16_autocast) if cuda \
        else torch.autocast("cpu", enabled=False)
    root = Path(args.workdir) / f"{args.variant}-{args.interval}"
    root.mkdir(parents=True)
    mark = {"t": 0.0, "wait": 0.0}
    opt.register_step_pre_hook(lambda *a: mark.__setitem__("t", time.perf_counter()))
    saver = saver_of(args.variant)(root, model, opt)  # ucl's fence hook lands between ours

    def after_fence(*a):  # times ucl's fence, and DCP's staging wait
        saver.pre_step()
        mark["wait"] = time.perf_counter() - mark["t"]
    opt.register_step_pre_hook(after_fence)

    def iteration(i: int, save: bool):
        t0 = time.perf_counter()
        x = torch.randint(cfg["vocab"], (args.batch, cfg["seq"] + 1), generator=torch.Generator().manual_seed(i))
        x = x.to(args.device)
        with autocast:
            loss = F.cross_entropy(model(x[:, :-1]).flatten(0, 1).float(), x[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        ts = time.perf_counter()
        if save:
            saver.save(i)
        if cuda:  # the training stream only: a checkpoint's copy on a side stream overlaps, as it would
            torch.cuda.current_stream().synchronize()
        te = time.perf_counter()
        return te - t0, te - ts, mark["wait"]

    iteration(0, False)
    first = iteration(1, args.variant != "none")[1]
    if args.variant == "verify":
        return verify(cfg, saver, model, opt, iteration)
    t = time.perf_counter()
    saver.drain()
    first += time.perf_counter() - t  # the warm-up save: call -> durable
    saver.housekeep()
    base, iters, stalls, saved = [], [], [], []
    step = 2
    for _ in range(args.rounds):  # rounds alternate both phases: drift and noise of the machine hit both alike
        for _ in range(BASE):  # this process's no-checkpoint iteration time
            base.append(iteration(step, False)[0])
            step += 1
        # saving every iteration, the untimed first one saves too, so every timed one runs beside a flush;
        # the untimed last one's optimizer step fences the last save
        for i in range(-1, args.iters + 1):
            timed = 0 <= i < args.iters
            save = args.variant != "none" and (i % args.interval == 0 if timed else i == -1 and args.interval == 1)
            it, save_wall, wait = iteration(step, save)
            if timed:
                iters.append(it)
            if saved and saved[-1][0] == step - 1:
                stalls.append(saved[-1][1] + wait)
            if save:
                saved.append((step, save_wall))
            saver.housekeep()
            step += 1
        saver.drain()  # untimed: the next round starts with nothing in flight
        saver.housekeep()
    steps = [s for s, _ in saved]
    out = dict(variant=args.variant, interval=args.interval, iters=iters, base=base, stall=stalls, first_durable=first,
               call=[saver.call[s] for s in steps], durable=[saver.durable[s] for s in steps if s in saver.durable],
               note=saver.note, ckpts=len(steps))
    newest = max((p for p in root.iterdir() if p.name.startswith("step_")), default=None,
                 key=lambda p: int("".join(c for c in p.name if c.isdigit())))
    out["bytes_per_ckpt"] = sum(p.stat().st_size for p in [newest, *newest.rglob("*")] if p.is_file()) if newest else 0
    if args.variant.startswith("ucl"):
        ev = saver.ck.trace.events()
        pick = lambda ph: [e for e in ev if e["phase"] == ph and e["step"] in steps]
        fence = {e["step"]: e["end"] - e["start"] for e in pick("fence")}
        out["trace_stall"] = [b["end"] - b["start"] + fence.get(b["step"], 0.0) for b in pick("blocked")]
        out["trace"] = {ph: [e["end"] - e["start"] for e in pick(ph)] for ph in ("blocked", "fence", "snapshot", "flush")}
        out["trace_cpu"] = {ph: [e["cpu"] for e in pick(ph) if "cpu" in e] for ph in ("snapshot", "flush")}
        out.update(pool_high_water=max(e.get("pool_high_water") or 0 for e in ev),
                   snapshot_mb=max(e["bytes"] for e in ev if e["phase"] == "snapshot") / 2**20,
                   ring_waits=[e.get("waited_for_ring", 0.0) for e in pick("snapshot")],
                   pool_waits=sum(b.get("waited_for_pool", 0) > 0.001 for b in pick("blocked")))
    out["writer_rss_mb"] = saver.writer_rss_mb() if isinstance(saver, DCPAsync) and saver.process else None
    saver.ck.close() if isinstance(saver, Ucl) else saver.close()
    out["rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return out


def verify(cfg, saver, model, opt, iteration) -> dict:
    """The warm-up save (step 1) against a deepcopy taken right after save() returned, loaded into a
    fresh model and optimizer after two more training steps changed the live ones."""
    import ucl
    expect = copy.deepcopy({"model": model.state_dict(), "optim": opt.state_dict()})
    for i in (2, 3):
        iteration(i, False)
    saver.ck.close()
    fresh_model, fresh_opt = build(cfg, seed=1, device=next(model.parameters()).device)
    with ucl.Checkpointer(saver.root, fresh_model, fresh_opt) as ck:
        step, _ = ck.load(1)
    got = {"model": fresh_model.state_dict(), "optim": fresh_opt.state_dict()}
    pairs = [(k, v, got["model"][k]) for k, v in expect["model"].items()]
    pairs += [(f"optim/{i}/{k}", v, got["optim"]["state"][i][k]) for i, st in expect["optim"]["state"].items()
              for k, v in st.items() if torch.is_tensor(v)]
    bad = [k for k, a, b in pairs if not torch.equal(a, b)]
    return dict(variant="verify", step=step, tensors=len(pairs), mismatched=bad[:5], n_bad=len(bad),
                live_changed=not torch.equal(model.tok.weight, expect["model"]["tok.weight"]))


# ---- driver ------------------------------------------------------------------------------------------------
def spawn(args, variant: str, interval: int, iters: int) -> dict:
    cmd = [sys.executable, __file__, "--variant", variant, "--interval", str(interval), "--iters", str(iters),
           "--workdir", args.workdir, "--params-m", str(args.params_m), "--batch", str(args.batch),
           "--seq", str(args.seq), "--rounds", str(args.rounds), "--device", args.device] + \
        (["--quick"] if args.quick else []) + (["--bf16-autocast"] if args.bf16_autocast else [])
    t = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True)
    lines = [x for x in p.stdout.splitlines() if x.startswith("{")]
    if p.returncode or not lines:
        err = (p.stderr.strip().splitlines() or ["?"])[-1][:150]
        print(f"  {variant} every {interval}: FAILED ({err})", flush=True)
        return dict(variant=variant, interval=interval, error=err)
    print(f"  {variant} every {interval}: {time.perf_counter() - t:.0f} s", flush=True)
    if args.results:  # each variant's raw figures as it finishes: a run cut short keeps what it measured
        with open(args.results, "a") as f:
            f.write(lines[-1] + "\n")
    return json.loads(lines[-1])


def med(xs, scale=1.0, fmt="{:.0f}"):
    f = lambda v: fmt.format(v * scale)
    return f"{f(statistics.median(xs))} ({f(min(xs))}-{f(max(xs))})" if xs else "-"


def report(results: list[dict], none: dict):
    x = lambda r, f: f(r["iters"]) / f(r["base"])
    print(f"\nno checkpoint (own process): iteration {med(none['iters'], 1e3)} ms, x its other rounds' {BASE}: median "
          f"{x(none, statistics.median):.2f}, mean {x(none, statistics.mean):.2f} (the noise floor); peak RSS "
          f"{none['rss_mb']:.0f} MiB")
    for interval in sorted({r["interval"] for r in results}):
        rows = [r for r in results if r["interval"] == interval]
        ts = next((r for r in rows if r["variant"] == "torch.save" and "error" not in r), None)
        print(f"\ncheckpoint every {interval} iteration(s): medians (min-max); t.s = torch.save")
        snap = next((r["snapshot_mb"] for r in rows if r.get("snapshot_mb")), None)
        print(f"{'variant':<15} {'stall ms':>18} {'call ms':>16} {'iter x none':>11} {'mean x none':>11} "
              f"{'durable s':>17} {'1st durable s':>13} {'RSS MiB':>8} {'+MiB':>6} {'+snaps':>6} {'MiB/ckpt':>8} "
              f"{'n':>3} {'stall/t.s':>9} {'durable/t.s':>11}")
        for r in (r for r in rows if "error" not in r):
            ratio = lambda k: (f"{statistics.median(r[k]) / statistics.median(ts[k]):.2f}"
                               if ts and r[k] and ts[k] and statistics.median(ts[k]) else "-")
            print(f"{r['variant']:<15} {med(r['stall'], 1e3):>18} {med(r['call'], 1e3):>16} "
                  f"{x(r, statistics.median):11.2f} {x(r, statistics.mean):11.2f} "
                  f"{med(r['durable'], 1, '{:.2f}'):>17} {r['first_durable']:13.2f} {r['rss_mb']:8.0f} "
                  f"{r['rss_mb'] - none['rss_mb']:6.0f} "
                  f"{(r['rss_mb'] - none['rss_mb']) / snap if snap else float('nan'):6.2f} "
                  f"{r['bytes_per_ckpt'] / 2**20:8.0f} {r['ckpts']:3d} {ratio('stall'):>9} {ratio('durable'):>11}")
        for r in rows:
            if "error" in r:
                print(f"  {r['variant']}: unsupported or failed: {r['error']}")
            if r.get("writer_rss_mb"):
                print(f"  {r['variant']}: + writer process peak RSS {r['writer_rss_mb']:.0f} MiB")
            if r.get("note"):
                print(f"  {r['variant']}: {r['note']}")
            if r["variant"].startswith("ucl") and "trace" in r:
                t = r["trace"]
                print(f"  {r['variant']} trace: stall (blocked+fence) {med(r['trace_stall'], 1e3)} ms = blocked {med(t['blocked'], 1e3)}"
                      f" + fence {med(t['fence'], 1e3)} ms; snapshot {med(t['snapshot'], 1e3)} ms; flush "
                      f"{med(t['flush'], 1, '{:.2f}')} s; pool high water {r['pool_high_water'] / 2**20:.0f} MiB; "
                      f"{r['pool_waits']} saves waited for pool space; the copier waited for the ring "
                      f"{med(r['ring_waits'], 1e3)} ms per snapshot")
                cpu = r.get("trace_cpu") or {}
                if cpu.get("snapshot") and cpu.get("flush"):  # what the background threads cost the cores, per checkpoint
                    print(f"  {r['variant']} CPU per checkpoint: snapshot {med(cpu['snapshot'], 1e3)} ms, flush "
                          f"{med(cpu['flush'], 1e3)} ms (thread CPU time, the flush's write-behind included)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params-m", type=float, default=50.0, help="model size in millions of parameters")
    ap.add_argument("--every", type=int, nargs="+", default=[1, 10], help="checkpoint intervals to measure")
    ap.add_argument("--iters", type=int, default=0, help="timed checkpointing iterations per round (default: "
                    "max(4, every))")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of %d iterations without checkpointing, then "
                    "--iters with" % BASE)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--quick", action="store_true", help="tiny model, 4 timed iterations per round")
    ap.add_argument("--results", default=None, help="append each variant's raw figures (one JSON line) to this file")
    ap.add_argument("--workdir", default=None, help="where checkpoints go (default: a temp dir)")
    ap.add_argument("--variants", nargs="+", default=VARIANTS, choices=VARIANTS, help="which to measure")
    ap.add_argument("--pools", type=float, nargs="*", default=[2, 0.5, 0.25, 0.0625],
                    help="ucl pool sizes to measure besides the default (1), in snapshots (ucl-poolF variants)")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda: the model, data and optimizer state on the GPU "
                    "(ucl: pinned pool, side stream); iteration time then ends with the training stream's sync")
    ap.add_argument("--bf16-autocast", action="store_true", help="with --device cuda: forward in bf16 autocast "
                    "(fp32 parameters and AdamW state, as the issue's GPU measurement)")
    ap.add_argument("--variant", help=argparse.SUPPRESS)
    ap.add_argument("--interval", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    if args.variant:
        print(json.dumps(run_variant(args)), flush=True)
        return
    iters = {k: args.iters or (4 if args.quick else max(4, k)) for k in args.every}
    if args.workdir:
        os.makedirs(args.workdir, exist_ok=True)
    args.workdir = work = tempfile.mkdtemp(prefix="ucl-bench-save-", dir=args.workdir)
    try:
        cfg = shape(args)
        n_params = sum(p.numel() for p in build(cfg, 0)[0].parameters())
        if args.device.startswith("cuda"):
            print(f"device: {torch.cuda.get_device_name(0)}, bf16 autocast: {args.bf16_autocast}")
        fs = subprocess.run(["findmnt", "-n", "-o", "FSTYPE", "-T", work], capture_output=True, text=True).stdout.strip()
        print(f"model: {n_params / 1e6:.1f} M parameters {cfg}, batch {args.batch}, AdamW (checkpoint ~"
              f"{n_params * 12 / 2**20:.0f} MiB); torch {torch.__version__}, {torch.get_num_threads()} threads, "
              f"{os.cpu_count()} CPUs; checkpoints in {work} ({fs or '?'}); timed iterations {iters}")
        print("page cache: warm (nothing dropped; every variant fsyncs what it writes, so durable = on disk); "
              f"load average at start {os.getloadavg()[0]:.2f}", flush=True)
        def measured(variant: str, interval: int, n: int) -> dict:
            try:
                return spawn(args, variant, interval, n)
            finally:  # its checkpoints (keep=3 of them, several GB each) go before the next variant's
                shutil.rmtree(Path(work) / f"{variant}-{interval}", ignore_errors=True)

        none = measured("none", 1, max(iters.values()))
        variants = args.variants + [f"ucl-pool{f:g}" for f in args.pools]
        results = [measured(v, k, iters[k]) for k in args.every for v in variants
                   if not (v == "ucl-host" and k != 1)]  # host snapshots matter when saving every iteration
        check = measured("verify", 1, 2)
        report(results, none)
        print(f"\nload average at end {os.getloadavg()[0]:.2f} ({os.cpu_count()} CPUs)")
        ok = f"FAILED to run: {check['error']}" if "error" in check else \
            f"{check['tensors']} tensors, {check['n_bad']} differ {check['mismatched']}, step {check['step']}, live " \
            f"model changed since: {check['live_changed']} -> {'OK' if check['n_bad'] == 0 else 'MISMATCH'}"
        print("ucl bit-exact check: Checkpointer.load(1) into a fresh model + AdamW, every parameter and optimizer "
              f"state tensor torch.equal to a deepcopy taken after save() returned: {ok}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
