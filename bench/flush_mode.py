"""Flush in a thread or in a process? What writing a checkpoint from host memory costs a training loop
that runs at the same time, for the two ways ucl.Checkpointer's flusher could run, measured in one run.

    python bench/flush_mode.py [--params-m 100] [--iters 8] [--workdir DIR]

The training loop is bench/save.py's (seeded GPT-like toy, AdamW, CPU). Its state is copied once into a
host buffer (page-aligned, shared memory) laid out as the Checkpointer's pool; every iteration then
writes that buffer as one ucl checkpoint (CheckpointWriter: direct writes, checksums, fsync, atomic
commit), the way the flusher does, either

  thread   on a thread of the training process (what ucl.Checkpointer does), or
  process  in a separate process started beforehand, reading the same shared buffer,

and the next write starts only when the previous one finished (as pool back-pressure would). Printed:
iteration time (median, min-max) over the same process's iterations without writing, and the write's
wall time. The faster mode is the one the Checkpointer should use (docs/training.md has the figures).
"""
from __future__ import annotations

import argparse
import importlib.util
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from multiprocessing import shared_memory
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))
_spec = importlib.util.spec_from_file_location("bench_save", ROOT / "save.py")
bench_save = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_save)

from ucl.store import CheckpointWriter  # noqa: E402
from ucl.train.pool import layout_bytes  # noqa: E402

BASE = 4  # iterations without writing, before the timed ones


def write_checkpoint(buf: np.ndarray, items: list, path: str) -> None:
    """One ucl checkpoint of ``items`` (key, offset, shape, numpy dtype) living in ``buf``."""
    with CheckpointWriter(path, 1, write_behind=True) as w:
        for key, off, shape, dtype in items:
            n = int(np.prod(shape)) * np.dtype(dtype).itemsize
            w.write(0, key, buf[off:off + n].view(dtype).reshape(shape), dtype=dtype)
        w.commit()


def writer_process(shm_name: str, items: list, conn) -> None:
    shm = shared_memory.SharedMemory(name=shm_name)
    buf = np.frombuffer(shm.buf, dtype=np.uint8)
    try:
        while (path := conn.recv()) is not None:
            shutil.rmtree(path, ignore_errors=True)
            t0 = time.perf_counter()
            write_checkpoint(buf, items, path)
            conn.send(time.perf_counter() - t0)
    finally:
        del buf
        shm.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params-m", type=float, default=100.0)
    ap.add_argument("--iters", type=int, default=8)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args()
    args.quick = False
    cfg = bench_save.shape(args)
    model, opt = bench_save.build(cfg, 0)
    x = torch.randint(0, cfg["vocab"], (args.batch, cfg["seq"]), generator=torch.Generator().manual_seed(0))

    def iteration() -> float:
        t0 = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(model(x).reshape(-1, cfg["vocab"]), x.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        return time.perf_counter() - t0

    iteration()  # optimizer state exists from here on
    tensors = {f"param/{n}": p.detach() for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        for kind, v in opt.state[p].items():
            if torch.is_tensor(v) and v.dim():
                tensors[f"{kind}/{n}"] = v
    offsets, total = layout_bytes([t.numel() * t.element_size() for t in tensors.values()])
    shm = shared_memory.SharedMemory(create=True, size=total)
    buf = np.frombuffer(shm.buf, dtype=np.uint8)
    items = []
    for (key, t), off in zip(tensors.items(), offsets):
        src = t.reshape(-1).view(torch.uint8).numpy()
        buf[off:off + src.size] = src
        items.append((key, off, tuple(t.shape), str(t.numpy().dtype)))
    work = Path(args.workdir or tempfile.mkdtemp(prefix="ucl-bench-flush-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"model {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters, checkpoint "
          f"{total / 2**20:.0f} MiB in {len(items)} datasets; torch {torch.__version__}, {torch.get_num_threads()} "
          f"threads, {os.cpu_count()} CPUs; {work}")

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=writer_process, args=(shm.name, items, child), daemon=True)
    proc.start()
    parent.send(str(work / "warm-proc"))
    parent.recv()
    write_checkpoint(buf, items, str(work / "warm-thread"))  # both paths warm

    rows = []
    for mode in ("thread", "process", "thread", "process"):  # interleaved: drift hits both
        base = [iteration() for _ in range(BASE)]
        times, writes, pending = [], [], None
        for i in range(args.iters):
            idle = pending is None or (not pending.is_alive() if mode == "thread" else parent.poll())
            if idle:  # the previous write is done: start the next one before this iteration
                if mode == "process" and pending is not None:
                    writes.append(parent.recv())
                path = str(work / f"{mode}-{i % 3}")
                shutil.rmtree(path, ignore_errors=True)
                if mode == "thread":
                    t = threading.Thread(target=lambda p=path: writes.append(_timed(write_checkpoint, buf, items, p)))
                    t.start()
                    pending = t
                else:
                    parent.send(path)
                    pending = True
            times.append(iteration())
        if mode == "thread":
            pending.join()
        elif pending is not None:
            writes.append(parent.recv())
        m = statistics.median(base)
        rows.append((mode, statistics.median(times) / m, min(times) / m, max(times) / m, statistics.median(writes), len(writes)))
    parent.send(None)
    proc.join(timeout=30)
    buf = None  # the view must go before the shared memory closes
    shm.close()
    shm.unlink()
    print(f"{'mode':8} {'iter x none':>12} {'min-max':>12} {'write s':>8} {'writes':>7}")
    for mode, med, lo, hi, w, n in rows:
        print(f"{mode:8} {med:12.2f} {lo:5.2f}-{hi:<6.2f} {w:8.2f} {n:7d}")
    shutil.rmtree(work, ignore_errors=True) if not args.workdir else None


def _timed(fn, *a) -> float:
    t0 = time.perf_counter()
    fn(*a)
    return time.perf_counter() - t0


if __name__ == "__main__":
    main()
