"""Recovery benchmark: 4 gloo processes as 2 simulated nodes (each node a folder of its own) train
an FSDP2 MLP and checkpoint it with ``Checkpointer(local=..., replicas=k)``; then jobs of 4 and of 2
processes recover the same state from:

  (a) every node's local folder intact          (b) node 1 lost, replicas=1
  (c) node 1 lost, replicas=0                    (d) every node lost: the shared root only
  (e) torch.distributed.checkpoint.load of the same state from the shared tier

and the cost of replication on the training loop: iteration time without a checkpoint, and with one
every iteration and every 10, with replicas=0 and replicas=1.

    python bench/recover.py [--size-gb 0.25] [--repeat 3] [--iters 20] [--workdir DIR] [--cases abcde]
                            [--no-loop]

Printed: each recovery's wall time (slowest process, from a common barrier), median and min-max of
``--repeat`` runs after one warm-up run, bytes per source (``last_load.bytes_from``), the seconds per
GiB restored, the largest process's peak RSS (median over the runs), and the median of the slowest process's seconds in each phase of ``load()``
(``last_load.seconds``: inventory, manifest, plan, exchange with peers, read into the model); for
the training loop, the mean iteration time and its ratio to the loop without checkpoints. A lost
node is a folder renamed away for the run. Not a test: figures depend on the machine.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import ucl  # noqa: E402

HIDDEN = 1024


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _layers(size_gb: float) -> int:
    # fp32 weights + Adam's two moments: 12 bytes a parameter
    return max(2, round(size_gb * 2**30 / 12 / (HIDDEN * HIDDEN + HIDDEN)))


def _setup(rank: int, world: int, port: int, layers: int):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=600))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(HIDDEN, HIDDEN) for _ in range(layers)])
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return dist, model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def _step(model, opt) -> float:
    t0 = time.perf_counter()
    loss = model(torch.randn(8, HIDDEN, generator=torch.Generator().manual_seed(1))).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    return time.perf_counter() - t0


def _worker(rank, world, nodes, port, layers, base, task, out):
    dist, model, opt = _setup(rank, world, port, layers)
    node = nodes[rank]
    result = {}
    try:
        if task["kind"] == "save":
            _step(model, opt)
            with ucl.Checkpointer(os.path.join(base, "root"), model, opt, node=node, replicas=task["replicas"],
                                  local=os.path.join(base, f"node{node}")) as ck:
                ck.save(1)
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_state_dict
            msd, osd = get_state_dict(model, opt)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(base, "dcp"))
        elif task["kind"] == "load":  # load() alone is timed (its process group is made before, as dcp's is)
            with ucl.Checkpointer(os.path.join(base, "root"), model, opt, node=node,
                                  local=os.path.join(base, f"node{node}")) as ck:
                dist.barrier()
                t0 = time.perf_counter()
                ck.load()
                dist.barrier()
                result = {"seconds": time.perf_counter() - t0, "bytes_from": ck.last_load.bytes_from,
                          "phases": ck.last_load.seconds}
        elif task["kind"] == "dcp":
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
            dist.barrier()
            t0 = time.perf_counter()
            # timed from a fresh optimizer, as ucl's load(): get_state_dict creates Adam's state (a zero step)
            msd, osd = get_state_dict(model, opt)
            state = {"model": msd, "optim": osd}
            dcp.load(state, checkpoint_id=os.path.join(base, "dcp"))
            set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
            dist.barrier()
            result = {"seconds": time.perf_counter() - t0}
        else:  # the training loop
            times = []
            every, k = task["every"], task["replicas"]
            loop = os.path.join(base, task["name"])  # a fresh root and node folders for each loop
            ck = ucl.Checkpointer(os.path.join(loop, "root"), model, opt, node=node, replicas=k,
                                  local=os.path.join(loop, f"node{node}"), persist_every=10 ** 9, keep=2) \
                if every else None
            for i in range(task["iters"]):
                times.append(_step(model, opt))
                if ck is not None and (i + 1) % every == 0:
                    ck.save(i + 1)
            if ck is not None:
                ck.close()
            result = {"iter": statistics.mean(times[2:])}  # the mean: checkpoints are a few of the iterations
    finally:
        result["rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # this process's peak (Linux: KiB)
        with open(os.path.join(out, f"{rank}.json"), "w") as f:
            json.dump(result, f)
        dist.destroy_process_group()


def _run(nodes, layers, base, task) -> list[dict]:
    out = tempfile.mkdtemp(dir=base)
    mp.spawn(_worker, args=(len(nodes), nodes, _port(), layers, base, task, out), nprocs=len(nodes))
    results = [json.load(open(os.path.join(out, f"{r}.json"))) for r in range(len(nodes))]
    shutil.rmtree(out)
    return results


def _gone(base: str, *names: str):
    """Rename node folders away for one run (a lost node), and back."""
    class Away:
        def __enter__(self):
            for n in names:
                os.rename(os.path.join(base, n), os.path.join(base, n + ".away"))

        def __exit__(self, *exc):
            for n in names:
                os.rename(os.path.join(base, n + ".away"), os.path.join(base, n))
    return Away()


def _fmt(xs: list[float]) -> str:
    return f"{statistics.median(xs):7.2f} s ({min(xs):.2f}-{max(xs):.2f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-gb", type=float, default=0.25)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--iters", type=int, default=32)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--cases", default="abcde", help="which recoveries to time (letters a-e)")
    ap.add_argument("--no-loop", action="store_true", help="skip the training-loop figures")
    args = ap.parse_args()
    layers = _layers(args.size_gb)
    work = tempfile.mkdtemp(prefix="ucl-recover-", dir=args.workdir)
    gib = layers * (HIDDEN * HIDDEN + HIDDEN) * 12 / 2**30
    print(f"state {gib:.2f} GiB ({layers} layers of {HIDDEN}x{HIDDEN}, fp32 + Adam), 4 processes as 2 nodes")
    try:
        bases = {k: os.path.join(work, f"r{k}") for k in (0, 1)}
        for k, base in bases.items():
            os.makedirs(base)
            _run([0, 0, 1, 1], layers, base, {"kind": "save", "replicas": k})
        cases = [("(a) all local", bases[1], ()), ("(b) node 1 lost, replicas=1", bases[1], ("node1",)),
                 ("(c) node 1 lost, replicas=0", bases[0], ("node1",)),
                 ("(d) shared root only", bases[0], ("node0", "node1"))]
        for label, base, lost in cases:
            if label[1] not in args.cases:
                continue
            for nodes in ([0, 0, 1, 1], [0, 1]):
                runs, got, phases, rss = [], {}, [], []
                with _gone(base, *lost):
                    for i in range(args.repeat + 1):  # the first run warms the page cache: not counted
                        res = _run(nodes, layers, base, {"kind": "load"})
                        if i:
                            runs.append(max(r["seconds"] for r in res))
                            rss.append(max(r["rss_mib"] for r in res))
                            phases.append(max(res, key=lambda r: r["seconds"])["phases"])
                        got = res[0]["bytes_from"]
                shown = ", ".join(f"{k} {v / 2**20:.0f} MiB" for k, v in sorted(got.items()))
                print(f"{label:30s} onto {len(nodes)}: {_fmt(runs)}  {statistics.median(runs) / gib:5.2f} s/GiB  {shown}  "
                      f"peak RSS {statistics.median(rss):.0f} MiB/process")
                split = {k: statistics.median(p.get(k, 0.0) for p in phases) for k in phases[0]}
                print(" " * 32 + "phases: " + ", ".join(f"{k} {v:.2f}" for k, v in split.items()))
        for nodes in ([0, 0, 1, 1], [0, 1]) if "e" in args.cases else ():
            res = [_run(nodes, layers, bases[0], {"kind": "dcp"}) for _ in range(args.repeat + 1)][1:]
            runs = [max(r["seconds"] for r in one) for one in res]
            rss = [max(r["rss_mib"] for r in one) for one in res]
            print(f"{'(e) dcp.load from shared':30s} onto {len(nodes)}: {_fmt(runs)}  "
                  f"{statistics.median(runs) / gib:5.2f} s/GiB  peak RSS {statistics.median(rss):.0f} MiB/process")
        if args.no_loop:
            return
        base = bases[0]
        plain = max(r["iter"] for r in _run([0, 0, 1, 1], layers, base, {"kind": "loop", "every": 0, "replicas": 0,
                                                                            "iters": args.iters, "name": "loop"}))
        print(f"training loop, no checkpoint: {plain * 1000:.1f} ms an iteration")
        for every in (1, 10):
            for k in (0, 1):
                it = max(r["iter"] for r in _run([0, 0, 1, 1], layers, base, {
                    "kind": "loop", "every": every, "replicas": k, "iters": args.iters, "name": f"loop-{every}-{k}"}))
                print(f"  checkpoint every {every:2d}, replicas={k}: {it * 1000:.1f} ms ({it / plain:.2f}x)")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
