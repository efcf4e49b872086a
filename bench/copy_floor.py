"""The least a verified copy written in Python pays here: the floor under any reshard that keeps
ucl's guarantee (every published byte read into the writer's own memory, checked there, and
hashed for the target's checksums), without a plan, HDF5 or the format. bench/reshard.py runs it
beside `cp -r` and the reshards, so a reshard's ratio can be read against what is possible at all.

    python bench/copy_floor.py SRC DST [--workers N]

Copies every regular file of SRC into DST (same relative paths), a block of 2 MiB at a time (the
block size the reshard streams in): one ``preadv`` into a reused buffer, three XXH3-64 passes over
the block while it is in cache (the source's chunk digests, as verification computes them; the
target's chunk digests; the target's whole checksum), one ``pwrite``. ``--workers N`` forks N
processes that split the files by size (default: the cores this process may use, at most 2, as
the reshard's default). Imports only numpy and xxhash (the reshard also needs h5py, its own
modules and a plan: that is the difference this measures). Prints the bytes copied and the time.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import xxhash

BLOCK = 2 << 20  # the reshard's STREAM_BLOCK_BYTES
CHUNK = 32 << 10  # a 32 MiB dataset's checksum chunk (docs/format.md: at most 1024 chunks, >= 16 KiB)


def copy_file(src: str, dst: str, buf: np.ndarray) -> int:
    view = memoryview(buf)
    fin = os.open(src, os.O_RDONLY)
    fout = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        whole, pos = xxhash.xxh3_64(), 0
        while True:
            got = os.preadv(fin, [view], pos)
            if got <= 0:
                break
            block = buf[:got]
            n = got // CHUNK * CHUNK
            for _ in range(2):  # the source's chunk digests (verification), then the target's
                np.fromiter(map(xxhash.xxh3_64_intdigest, block[:n].reshape(-1, CHUNK)), np.uint64, n // CHUNK)
            whole.update(block)
            done = 0
            while done < got:
                done += os.pwrite(fout, view[done:got], pos + done)
            pos += got
        whole.intdigest()
        return pos
    finally:
        os.close(fin)
        os.close(fout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--workers", type=int, default=min(2, len(os.sched_getaffinity(0))))
    args = ap.parse_args()
    t0 = time.perf_counter()
    files = []
    for root, _, names in os.walk(args.src):
        for name in names:
            path = os.path.join(root, name)
            if os.path.isfile(path) and not os.path.islink(path):
                files.append((os.path.getsize(path), os.path.relpath(path, args.src)))
    for rel in {os.path.dirname(r) for _, r in files}:
        os.makedirs(os.path.join(args.dst, rel), exist_ok=True)
    shares: list[list[str]] = [[] for _ in range(max(1, args.workers))]
    loads = [0] * len(shares)
    for size, rel in sorted(files, reverse=True):  # largest first, each to the least loaded worker
        i = loads.index(min(loads))
        shares[i].append(rel)
        loads[i] += size
    pids = []
    for share in shares[1:]:
        pid = os.fork()
        if pid == 0:
            buf = np.empty(BLOCK, np.uint8)
            for rel in share:
                copy_file(os.path.join(args.src, rel), os.path.join(args.dst, rel), buf)
            os._exit(0)
        pids.append(pid)
    buf = np.empty(BLOCK, np.uint8)
    for rel in shares[0]:
        copy_file(os.path.join(args.src, rel), os.path.join(args.dst, rel), buf)
    failed = [pid for pid in pids if os.waitpid(pid, 0)[1] != 0]
    if failed:
        sys.exit(f"copy_floor: {len(failed)} worker(s) failed")
    print(f"copied {sum(loads):,} B in {len(files)} files with {len(shares)} process(es) in "
          f"{time.perf_counter() - t0:.2f} s")


if __name__ == "__main__":
    main()
