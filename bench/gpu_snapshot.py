"""Where a streamed snapshot's time goes on a GPU machine: the checkpointer's copier
(``train.ring.copy_streamed``) taking GPU tensors through a pinned pool smaller than them, the
consumer (the flusher's place) discarding pieces, so only the copy and the hashing are timed.

    python bench/gpu_snapshot.py [--gib 3] [--pool-mib 768] [--repeat 3]

Prints, medians (min-max) over --repeat: one-shot device-to-host copy of the same bytes into pinned
memory (the floor), the hashing alone (store.digests.IncrementalChecksum, with and without tile
digests) on host bytes, and copy_streamed (each piece copied, waited for, hashed), with and without
tile digests. Needs CUDA.

Measured on an H200 machine (2026-11-28, 3.2 GB, pool 768 MiB, before the hasher took pieces a
megabyte at a time: bench/tile_hash.py): device-to-host 54.5 GB/s; hashing 3.05 GB/s with tiles, 8.2 without; copy_streamed 2.7 and 5.7 GB/s: the hashing sets the pace.
Queueing the next pieces' copies while one is hashed was tried and measured: +8% with tiles, -15%
without (one ahead), slower at three ahead; not kept."""
from __future__ import annotations

import argparse, statistics, sys, threading, time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from ucl.store.digests import IncrementalChecksum  # noqa: E402
from ucl.train.pool import HostPool  # noqa: E402
from ucl.train.ring import PieceStream, copy_streamed  # noqa: E402


def med(xs, gb):
    return f"{gb / statistics.median(xs):6.2f} GB/s ({gb / max(xs):.2f}-{gb / min(xs):.2f}), {statistics.median(xs) * 1e3:.0f} ms"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=3.0, help="snapshot size: 16 MiB fp32 matrices and small vectors")
    ap.add_argument("--pool-mib", type=int, default=768)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    dev = torch.device("cuda")
    n = int(args.gib * 2**30) // (16 << 20)
    tensors = []
    for i in range(n):
        tensors += [torch.randn(1024, 4096, device=dev), torch.randn(1024, device=dev)]
    gb = sum(t.numel() * 4 for t in tensors) / 1e9
    print(f"{torch.cuda.get_device_name(0)}: {len(tensors)} tensors, {gb:.2f} GB; pool {args.pool_mib} MiB pinned")
    pinned = torch.empty(sum(t.numel() * 4 for t in tensors), dtype=torch.uint8, pin_memory=True)
    host = [np.random.default_rng(0).standard_normal((1024, 4096), dtype=np.float32)]

    def d2h():
        torch.cuda.synchronize()
        t0, at = time.perf_counter(), 0
        for t in tensors:
            k = t.numel() * 4
            pinned[at:at + k].copy_(t.reshape(-1).view(torch.uint8), non_blocking=True)
            at += k
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    def hashing(tiles):
        t0 = time.perf_counter()
        for _ in range(n):
            h = IncrementalChecksum((1024, 4096), np.float32, tiles=tiles)
            h.advance(0, host[0].reshape(-1))
            h.result(host[0].size)
        return (time.perf_counter() - t0) * gb / (n * host[0].nbytes / 1e9)

    entries = tuple(SimpleNamespace(key=f"t{i}", tensor=t) for i, t in enumerate(tensors))
    keys = frozenset(e.key for e in entries)
    pool = HostPool(args.pool_mib << 20, pin=True)
    side = torch.cuda.Stream()

    def streamed(tiles):
        snap = SimpleNamespace(layout=SimpleNamespace(entries=entries), eager={}, digests={})
        stream = PieceStream(pool)
        drain = threading.Thread(target=lambda: [None for _ in stream.pieces()])
        drain.start()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.cuda.stream(side):
            copy_streamed(snap, stream, keys, tiles=tiles, cuda_stream=side)
        dt = time.perf_counter() - t0
        stream.close()
        drain.join()
        assert all(snap.digests[k] is not None for k in keys)
        return dt

    rows = [("device-to-host, one pass (floor)", d2h)]
    rows += [(f"hashing only, tiles={tiles}", lambda tiles=tiles: hashing(tiles)) for tiles in (True, False)]
    rows += [(f"copy_streamed tiles={tiles}", lambda tiles=tiles: streamed(tiles)) for tiles in (True, False)]
    for name, fn in rows:
        fn()  # warm-up
        print(f"{name:<38} {med([fn() for _ in range(args.repeat)], gb)}", flush=True)


if __name__ == "__main__":
    main()
