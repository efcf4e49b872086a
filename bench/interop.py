"""ucl against DeepSpeed's own converter (and cp -r) on one DeepSpeed ZeRO-1 checkpoint.

    python bench/interop.py [--params-m 100] [--dp 2] [--repeat 3] [--workdir DIR] [--json OUT]
    python bench/interop.py --quick          # ~20 M parameters: a couple of minutes
    python bench/interop.py --no-deepspeed   # the DCP part only (no deepspeed installed)

The checkpoint: a plain-torch model (an embedding and blocks of two Linear layers with biases, two
AdamW param groups as HF Trainer makes them: weights with decay, biases without), trained one step by
DeepSpeed (ZeRO-1, fp32, dp=--dp gloo processes on CPU, DS_ACCELERATOR=cpu) and saved with
engine.save_checkpoint. It is made once per --workdir and parameter count (needs deepspeed:
``DS_BUILD_OPS=0 pip install deepspeed``).

Operations, each a fresh process (the command line a user would run), in interleaved rounds after one
untimed warm-up round; page cache warm (the checkpoint was just read by the warm-up):
  cp -r                  the tag folder copied: the physical reference for moving these bytes
  ds_to_universal        python -m deepspeed.checkpoint.ds_to_universal --inject_missing_state
                         (DeepSpeed's default worker counts)
  ucl import             ucl import DS OUT (a ucl checkpoint in the source layout, dp=--dp); durable
                         (fsync before the atomic rename) and with --no-fsync, like cp and DeepSpeed
  ucl export universal   ucl export deepspeed-universal DS OUT, read in place (when ucl has it)
  ucl reshard dp*2       ucl reshard DS OUT --to dp=2*dp, read in place
and on an FSDP2 DCP checkpoint of the same model (dp=--dp processes, torch's own dcp.save of
get_state_dict after one AdamW step):
  dcp cp -r              the DCP folder copied
  dcp_to_torch_save      torch's own consolidation to one torch.save file
  ucl reshard dcp->univ  ucl reshard DCP OUT --to universal --no-fsync (read in place)
and, where ``ucl import --max-memory`` exists (#31), each ucl import and export under the default cap
(2 GB) and under a cap of 1/8 of the checkpoint (``@1/8`` in the table; ``cap ratio``: its time over the
default cap's, target <= 1.2x).
Measured: wall time; peak RSS of the whole process tree (VmRSS of the process and all its descendants,
summed, sampled every 20 ms) and peak PSS (proportional set size, which counts a page shared by forked
workers once: what ``max_memory`` caps); bytes dirtied (write_bytes of every finished descendant, from
getrusage(RUSAGE_CHILDREN).ru_oublock); files and bytes in the output. Reported: median (min-max) over
--repeat rounds, and each operation's time as a ratio to ds_to_universal and to cp -r of the same run.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

HIDDEN, FFN, VOCAB = 1024, 4096, 16000


# ---- the DeepSpeed checkpoint ------------------------------------------------------------------

def _layers_for(params_m: float) -> int:
    per_block = 2 * HIDDEN * FFN + HIDDEN + FFN
    return max(1, round((params_m * 1e6 - VOCAB * HIDDEN) / per_block))


def _model(layers: int):
    """The benchmark model (seeded): an embedding and ``layers`` blocks of Linear, GELU, Linear."""
    import torch
    from torch import nn
    torch.manual_seed(0)
    torch.set_num_threads(1)
    blocks = []
    for _ in range(layers):
        blocks += [nn.Linear(HIDDEN, FFN), nn.GELU(), nn.Linear(FFN, HIDDEN)]
    return nn.Sequential(nn.Embedding(VOCAB, HIDDEN), *blocks)


def _generate_worker(out: str, layers: int) -> None:  # runs under torch.distributed.run
    import deepspeed
    import torch
    model = _model(layers)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=1e-4)
    dp = int(os.environ["WORLD_SIZE"])
    config = {"train_batch_size": dp, "train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 1},
              "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    ids = torch.randint(0, VOCAB, (1, 16))
    loss = engine(ids).float().pow(2).mean()
    engine.backward(loss)
    engine.step()
    engine.save_checkpoint(out, client_state={"iteration": 1})


def generate(workdir: Path, params_m: float, dp: int) -> Path:
    layers = _layers_for(params_m)
    out = workdir / f"ds_zero1_dp{dp}_{layers}blocks"
    if (out / "latest").is_file():
        return out
    shutil.rmtree(out, ignore_errors=True)
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(dp), "--master_port",
           str(free_port()), __file__, "--generate-worker", str(out), str(layers)]
    print(f"generating a DeepSpeed ZeRO-1 checkpoint ({layers} blocks, dp={dp}) in {out} ...", flush=True)
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    return out


def _dcp_worker(rank: int, world: int, out: str, layers: int, port: int) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = _model(layers)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    for m in model:
        if any(True for _ in m.parameters()):
            fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randint(0, VOCAB, (1, 16))).float().pow(2).mean().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=out)
    dist.destroy_process_group()


def generate_dcp(workdir: Path, params_m: float, world: int) -> Path:
    layers = _layers_for(params_m)
    out = workdir / f"dcp_fsdp2_dp{world}_{layers}blocks"
    if (out / ".metadata").is_file():
        return out
    shutil.rmtree(out, ignore_errors=True)
    import torch.multiprocessing as tmp
    print(f"generating an FSDP2 DCP checkpoint ({layers} blocks, dp={world}) in {out} ...", flush=True)
    tmp.start_processes(_dcp_worker, args=(world, str(out), layers, free_port()), nprocs=world,
                        start_method="spawn")
    return out


# ---- measuring a command -----------------------------------------------------------------------

def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(entry))
    return kids


def _kib(pid: int, path: str, field: str) -> int:
    try:
        with open(f"/proc/{pid}/{path}") as f:
            for line in f:
                if line.startswith(field):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def free_port() -> int:
    """A TCP port nothing listens on now (the OS picks it), for torch.distributed's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(cmd: list[str], out: Path | None, env: dict | None = None) -> dict:
    """Wall time, peak RSS of the process tree, bytes dirtied, output files and bytes."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_oublock
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    peak = [0, 0]

    def sample():
        while proc.poll() is None:
            kids, tree, rss, pss = _children(), [proc.pid], 0, 0
            while tree:
                pid = tree.pop()
                rss += _kib(pid, "status", "VmRSS:")
                pss += _kib(pid, "smaps_rollup", "Pss:")
                tree += kids.get(pid, [])
            peak[0], peak[1] = max(peak[0], rss), max(peak[1], pss)
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    _, err = proc.communicate()
    seconds = time.perf_counter() - t0
    sampler.join()
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{err.decode()[-3000:]}")
    dirtied = (resource.getrusage(resource.RUSAGE_CHILDREN).ru_oublock - before) * 512
    files = nbytes = 0
    if out is not None and out.exists():
        for root, _, names in os.walk(out):
            for n in names:
                files += 1
                nbytes += os.path.getsize(os.path.join(root, n))
    return {"seconds": seconds, "peak_rss": peak[0] * 1024, "peak_pss": peak[1] * 1024, "dirtied": dirtied, "files": files, "bytes": nbytes}


def _folder_bytes(path: Path) -> int:
    return sum(os.path.getsize(os.path.join(r, n)) for r, _, ns in os.walk(path) for n in ns)


def _ucl_has(command: str, option: str = "") -> bool:
    help_ = subprocess.run([sys.executable, "-m", "ucl", command, "--help"], capture_output=True, text=True)
    return help_.returncode == 0 and option in help_.stdout


def _capped(ops: dict, names: list[str], size: int) -> None:
    """A ``NAME @1/8`` variant of each of ``names`` under ``--max-memory`` of 1/8 of ``size``."""
    for name in names:
        cmd, env = ops[name]
        ops[f"{name} @1/8"] = (cmd + ["--max-memory", str(max(16 << 20, size // 8))], env)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params-m", type=float, default=100.0, help="model size in millions of parameters")
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="~20 M parameters, 2 repeats")
    ap.add_argument("--workdir", default="/tmp/ucl-bench-interop")
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--no-dcp", action="store_true", help="skip the DCP part")
    ap.add_argument("--no-deepspeed", action="store_true", help="skip the DeepSpeed part (no deepspeed installed)")
    ap.add_argument("--generate-worker", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.generate_worker:
        return _generate_worker(args.generate_worker[0], int(args.generate_worker[1]))
    if args.quick:
        args.params_m, args.repeat = 20.0, 2
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    py, env = sys.executable, {**os.environ, "DS_ACCELERATOR": "cpu"}
    scratch = work / "out"
    ops: dict = {}
    capped = _ucl_has("import", "--max-memory")
    if not args.no_deepspeed:
        ds = generate(work, args.params_m, args.dp)
        tag = ds / (ds / "latest").read_text().strip()
        size = _folder_bytes(tag)
        print(f"checkpoint: {tag} ({size / 1e9:.2f} GB, {len(os.listdir(tag))} files)")
        ops.update({
            "cp -r": (["cp", "-r", str(tag), "{out}"], None),
            "ds_to_universal": ([py, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(tag),
                                 "--output_folder", "{out}", "--inject_missing_state"], env),
            "ucl import": ([py, "-m", "ucl", "import", str(ds), "{out}", "--quiet"], None),
            "ucl import --no-fsync": ([py, "-m", "ucl", "import", str(ds), "{out}", "--quiet", "--no-fsync"], None),
            f"ucl reshard dp={2 * args.dp}": ([py, "-m", "ucl", "reshard", str(ds), "{out}", "--to",
                                               f"dp={2 * args.dp}", "--quiet"], None),
            "ucl reshard --no-fsync": ([py, "-m", "ucl", "reshard", str(ds), "{out}", "--to", f"dp={2 * args.dp}",
                                        "--quiet", "--no-fsync"], None),
        })
        if _ucl_has("export"):
            ops["ucl export universal"] = ([py, "-m", "ucl", "export", "deepspeed-universal", str(ds), "{out}"], None)
            ops["ucl export --no-fsync"] = ([py, "-m", "ucl", "export", "deepspeed-universal", str(ds), "{out}",
                                             "--no-fsync"], None)
        if capped:
            _capped(ops, [n for n in ops if n.startswith("ucl ")], size)
    if not args.no_dcp:
        dcp_dir = generate_dcp(work, args.params_m, args.dp)
        dcp_size = _folder_bytes(dcp_dir)
        print(f"checkpoint: {dcp_dir} ({dcp_size / 1e9:.2f} GB)")
        to_pt = ("import sys; from torch.distributed.checkpoint.format_utils import dcp_to_torch_save; "
                 "import os; os.makedirs(sys.argv[2]); dcp_to_torch_save(sys.argv[1], sys.argv[2] + '/model.pt')")
        dcp_ops = {
            "dcp cp -r": (["cp", "-r", str(dcp_dir), "{out}"], None),
            "dcp_to_torch_save": ([py, "-c", to_pt, str(dcp_dir), "{out}"], None),
            "ucl reshard dcp->universal": ([py, "-m", "ucl", "reshard", str(dcp_dir), "{out}", "--to", "universal",
                                            "--quiet", "--no-fsync"], None),
            "ucl import dcp": ([py, "-m", "ucl", "import", str(dcp_dir), "{out}", "--quiet", "--no-fsync"], None),
        }
        if _ucl_has("export"):
            dcp_ops["ucl export dcp->dcp"] = ([py, "-m", "ucl", "export", "dcp", str(dcp_dir), "{out}"], None)
            dcp_ops["ucl export dcp->universal"] = ([py, "-m", "ucl", "export", "deepspeed-universal", str(dcp_dir),
                                                     "{out}", "--no-fsync"], None)
        if capped:
            _capped(dcp_ops, [n for n in dcp_ops if n.startswith("ucl ")], dcp_size)
        ops.update(dcp_ops)
    results: dict[str, list[dict]] = {k: [] for k in ops}
    for round_ in range(args.repeat + 1):  # round 0 warms up
        for name, (cmd, e) in ops.items():
            shutil.rmtree(scratch, ignore_errors=True)
            r = measure([c.replace("{out}", str(scratch)) for c in cmd], scratch, e)
            if round_:
                results[name].append(r)
        print(f"round {round_}{' (warm-up)' if not round_ else ''} done", flush=True)
    shutil.rmtree(scratch, ignore_errors=True)

    med = {k: statistics.median(r["seconds"] for r in v) for k, v in results.items()}
    print(f"\n{'operation':32} {'wall s (min-max)':>22} {'vs baseline':>12} {'vs cp -r':>9} {'cap ratio':>10} "
          f"{'peak RSS GB':>12} {'peak PSS GB':>12} {'dirtied GB':>11} {'files':>6} {'out GB':>7}")
    for name, runs in results.items():
        secs = [r["seconds"] for r in runs]
        last = runs[-1]
        dcp_side = name.startswith("dcp") or "dcp" in name
        base, cp = ("dcp_to_torch_save", "dcp cp -r") if dcp_side else ("ds_to_universal", "cp -r")
        vs_base = f"{med[base] / med[name]:11.1f}x" if base in med else f"{'-':>12}"
        vs_cp = f"{med[name] / med[cp]:8.1f}x" if cp in med else f"{'-':>9}"
        uncapped = name.removesuffix(" @1/8")
        ratio = f"{med[name] / med[uncapped]:9.2f}x" if name != uncapped else f"{'':>10}"
        print(f"{name:32} {med[name]:8.2f} ({min(secs):.2f}-{max(secs):.2f}){'':>4} {vs_base} {vs_cp} {ratio} "
              f"{statistics.median(r['peak_rss'] for r in runs) / 1e9:12.2f} "
              f"{statistics.median(r['peak_pss'] for r in runs) / 1e9:12.2f} "
              f"{statistics.median(r['dirtied'] for r in runs) / 1e9:11.2f} {last['files']:6d} {last['bytes'] / 1e9:7.2f}")
    print("(vs baseline: how many times faster than ds_to_universal, or dcp_to_torch_save on the DCP side; "
          "vs cp -r: how many times slower than cp -r of the same folder; cap ratio: time under --max-memory of "
          "1/8 of the checkpoint over the time under the default cap)")
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results}, indent=1))


if __name__ == "__main__":
    main()
