"""Read-once loading benchmark: W gloo processes (torch.multiprocessing) each load their rank of a
DP-replicated checkpoint (Megatron-style Llama, bf16 weights replicated over dp; weights only, as a
fine-tune or an evaluation job starts), with plain ``load_rank`` and with ``read_once=True``, in
alternation, in the same run.

    python bench/read_once.py [--procs 2,4] [--size-gb 0.5] [--repeat 3] [--mesh dp] [--cold] [--workdir DIR]

Each mode runs once to warm up (page cache, plan compile, the read-once group), then ``--repeat``
times; printed: the job's wall time (slowest process, from a common barrier), median and min-max;
storage reads summed over the processes (``/proc/self/io`` rchar deltas: what the read path
delivered, from the page cache when warm) against the checkpoint's size; with ``--cold`` the
checkpoint's pages are dropped from the page cache before every load (``posix_fadvise``
DONTNEED on its files only), and "disk GiB" (read_bytes) is what really came from the device;
bytes received over the group; and the ratios to plain ``load_rank`` measured in the same run.
``--mesh dp`` loads ``dp=W``; ``--mesh dp_tp`` loads ``dp=W/2,tp=2`` (norms replicated over tp too).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import ucl  # noqa: E402
from ucl.demo import LLAMA_MEGATRON, llama_params  # noqa: E402
from ucl.ops import IOStats  # noqa: E402


def dims_for(size_gb: float) -> dict:
    # bf16 weights only: 2 bytes per parameter
    d = dict(vocab=32000, hidden=1024, heads=16, kv_heads=8, ffn=2816, layers=2)
    per_layer = 2048 * 1024 + 1024 * 1024 + 2 * 2816 * 1024 + 1024 * 2816 + 2 * 1024
    d["layers"] = max(1, int(round((size_gb * 2**30 / 2 - 2 * 32000 * 1024) / per_layer)))
    return d


def weights_model(dims: dict):
    """The demo's Megatron layout with every parameter frozen: weights only, replicated over dp."""
    params = llama_params(dims)
    return ucl.load_spec(LLAMA_MEGATRON).bind(dims, params, frozen=list(params))


def build_source(path: Path, dims: dict) -> int:
    model = weights_model(dims)
    rng = np.random.default_rng(0)
    state = {t.key: rng.integers(0, 1 << 16, size=t.shape, dtype=np.uint16) for t in model.tensors}
    ucl.save(path, {0: state}, model=model, mesh=ucl.UNIVERSAL, durable=False)
    return sum(a.nbytes for a in state.values())


def _io() -> tuple[int, int]:
    with open("/proc/self/io") as f:
        fields = dict(line.split(":") for line in f.read().splitlines())
    return int(fields["rchar"]), int(fields["read_bytes"])


def _drop_cache(src: str) -> None:
    """Evict the checkpoint's files (only them) from the page cache: the next read goes to the disk."""
    for name in os.listdir(src):
        fd = os.open(os.path.join(src, name), os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _worker(rank: int, world: int, port: int, src: str, mesh: str, repeat: int, cold: bool, out: str) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    import torch
    import torch.distributed as dist
    from ucl.ops.dist import allgather_json
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=600))
    rows = []
    try:
        for i in range(repeat + 1):  # the first of each mode warms up
            for mode in ("plain", "read_once"):
                stats = IOStats()
                if cold and rank == 0:
                    _drop_cache(src)
                dist.barrier()
                (rc0, rb0), t0 = _io(), time.perf_counter()
                shard = ucl.load_rank(src, mesh=mesh, rank=rank, stats=stats, read_once=mode == "read_once")
                seconds = time.perf_counter() - t0
                rc1, rb1 = _io()
                del shard
                every = allgather_json([seconds, rc1 - rc0, rb1 - rb0, stats.bytes_read, stats.bytes_received,
                                        stats.bytes_sent])
                if i and rank == 0:
                    rows.append({"mode": mode, "seconds": max(e[0] for e in every),
                                 **{k: sum(e[j] for e in every) for j, k in enumerate(
                                     ("rchar", "read_bytes", "bytes_read", "received", "sent"), start=1)}})
    finally:
        dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(json.dumps(rows))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(world: int, src: Path, mesh: str, repeat: int, cold: bool, workdir: Path) -> list[dict]:
    import torch.multiprocessing as mp
    out = workdir / f"rows_{world}.json"
    mp.spawn(_worker, args=(world, _free_port(), str(src), mesh, repeat, cold, str(out)), nprocs=world, join=True)
    return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--procs", default="2,4")
    ap.add_argument("--size-gb", type=float, default=0.5)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--mesh", choices=["dp", "dp_tp"], default="dp")
    ap.add_argument("--cold", action="store_true", help="drop the checkpoint from the page cache before each load")
    ap.add_argument("--workdir")
    a = ap.parse_args()
    workdir = Path(a.workdir or tempfile.mkdtemp(prefix="ucl-bench-ro-"))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        dims = dims_for(a.size_gb)
        t0 = time.perf_counter()
        ckpt_bytes = build_source(workdir / "src", dims)
        print(f"checkpoint: {ckpt_bytes / 2**30:.2f} GiB of bf16 weights ({dims['layers']} layers), universal, "
              f"written in {time.perf_counter() - t0:.1f} s; {'cold' if a.cold else 'warm'} page cache; "
              f"{os.cpu_count()} cores")
        print(f"{'W':>2} {'mesh':<12} {'mode':<10} {'median s':>9} {'min-max s':>13} {'x plain':>8} "
              f"{'rchar GiB':>10} {'x ckpt':>7} {'disk GiB':>9} {'IOStats read':>13} {'recv GiB':>9}")
        for world in (int(x) for x in a.procs.split(",")):
            mesh = f"dp={world}" if a.mesh == "dp" else f"dp={world // 2},tp=2"
            rows = run(world, workdir / "src", mesh, a.repeat, a.cold, workdir)
            base = statistics.median(r["seconds"] for r in rows if r["mode"] == "plain")
            for mode in ("plain", "read_once"):
                mine = [r for r in rows if r["mode"] == mode]
                secs = [r["seconds"] for r in mine]
                med = statistics.median(secs)
                rchar = statistics.median(r["rchar"] for r in mine)
                print(f"{world:>2} {mesh:<12} {mode:<10} {med:>9.3f} {min(secs):>6.3f}-{max(secs):<6.3f} "
                      f"{med / base:>8.2f} {rchar / 2**30:>10.2f} {rchar / ckpt_bytes:>7.2f} "
                      f"{statistics.median(r['read_bytes'] for r in mine) / 2**30:>9.2f} "
                      f"{statistics.median(r['bytes_read'] for r in mine) / ckpt_bytes:>12.2f}x "
                      f"{statistics.median(r['received'] for r in mine) / 2**30:>9.2f}")
    finally:
        if not a.workdir:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
