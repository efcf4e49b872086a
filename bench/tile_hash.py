"""How fast the store's digests (whole, chunk, tile) are computed, and how much they hold the GIL.

    python bench/tile_hash.py [--repeat 5] [--mib 64] [--piece-mib 16] [--probe-s 1.0] [--src DIR ...]

For each matrix shape (fp32 and 2-byte, wide and narrow tiles) ``--mib`` of distinct matrices are
fed to ``store.digests.IncrementalChecksum`` in ``--piece-mib`` pieces (the ring's GPU path hands
it 16 MiB pieces), with tile digests and without: GB/s per CPU-second of the hashing thread
(``time.thread_time``: on a machine shared with other work, wall time counts their turns too),
median (min-max) over --repeat.

GIL probes (tiles on, the first shape), wall-clock: a training-like thread (steps of 2 ms of
Python, as kernel launches are, then 1 ms with the GIL released, as a GPU sync is) runs beside
the hashing: its median step over its step alone, and the hashing's GB/s meanwhile. A
pure-Python thread counting in a loop: its rate beside the hashing over its rate alone (1.0: the
hashing never held it back), and the hashing's GB/s meanwhile. Two threads hashing separate
matrices: their wall time over one thread's for the same work each (1.0: they scale; 2.0:
serialised; on a machine with fewer free cores than threads, above 1.0 regardless).

``--src`` (repeatable): the checkouts whose digests (``ucl/store/digests.py``) to time, each loaded
as a package of its own and measured in turn within each repeat, so a baseline (e.g. main's) and a change see the same
load; default: this checkout.

Measured on the 2-core VM (2026-11-28, other agents loading it; --repeat 7, main before this change
vs after): 16 MiB pieces with tiles 3.4-4.5 -> 6.8-7.8 GB/s on the five matrix shapes with tile rows
of 256 B-2 KiB, 7.45 -> 7.26 with 8 KiB tile rows; without tiles 8.1-12.8 -> 12.7-16.0; 1 MiB
pieces with tiles 6.7-7.7 -> 7.0-7.8. Training-like thread beside the hashing: 1.51x -> 1.02x."""
from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import importlib
import importlib.util

import numpy as np


def _load(src: str):
    """``src``'s digest module (ucl/store/digests.py; ucl/store/checksum.py in checkouts before it was
    split out), imported from that checkout's ucl package loaded under a name of its own."""
    name = f"ucl_{abs(hash(str(Path(src).resolve())))}"
    if name not in sys.modules:
        root = Path(src) / "ucl"
        spec = importlib.util.spec_from_file_location(name, root / "__init__.py", submodule_search_locations=[str(root)])
        pkg = importlib.util.module_from_spec(spec)
        sys.modules[name] = pkg  # dataclasses look their module up
        spec.loader.exec_module(pkg)
    try:
        return importlib.import_module(f"{name}.store.digests")
    except ModuleNotFoundError:
        return importlib.import_module(f"{name}.store.checksum")


SHAPES = [((1024, 4096), "float32"), ((4096, 4096), "float32"), ((4096, 4096), "uint16"),
          ((8192, 1024), "uint16"), ((256, 16384), "float32"), ((16, 65536), "float32")]


def _matrices(shape, dtype, mib):
    one = int(np.prod(shape)) * np.dtype(dtype).itemsize
    rng = np.random.default_rng(0)
    return [rng.integers(0, 255, one, dtype=np.uint8).view(dtype).reshape(shape)
            for _ in range(max(1, (mib << 20) // one))]


def _hash_all(mod, mats, piece, tiles):
    for m in mats:
        h, flat = mod.IncrementalChecksum(m.shape, m.dtype, tiles=tiles), m.reshape(-1)
        step = max(1, piece // m.itemsize)
        for i in range(0, flat.size, step):
            h.advance(i, flat[i:i + step])
        assert h.result(flat.size) is not None


def _gbs(secs, nbytes):
    med = statistics.median(secs)
    return f"{nbytes / med / 1e9:6.2f} GB/s ({nbytes / max(secs) / 1e9:.2f}-{nbytes / min(secs) / 1e9:.2f})"


def _cpu(fn):
    t0 = time.thread_time()
    fn()
    return time.thread_time() - t0


def _wall(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _count_while(fn, secs):
    """Count rate of a pure-Python thread while ``fn`` runs repeatedly for ``secs``; fn runs/s."""
    stop, got = threading.Event(), []

    def count():
        n = 0
        while not stop.is_set():
            n += 1
        got.append(n)
    t = threading.Thread(target=count)
    t0 = time.perf_counter()
    t.start()
    runs = 0
    while time.perf_counter() - t0 < secs:
        fn()
        runs += 1
    stop.set()
    t.join()
    dt = time.perf_counter() - t0
    return got[0] / dt, runs / dt


def _steps_while(fn, secs, busy=0.002, wait=0.001):
    """A training thread's step (``busy`` s of Python, as kernel launches are, then a ``wait`` with
    the GIL released, as a GPU sync is), timed while ``fn`` runs in a second thread (None: alone):
    median step seconds, and how many times ``fn`` ran per second."""
    stop, runs = threading.Event(), [0]

    def loop():
        while not stop.is_set():
            fn()
            runs[0] += 1
    t = threading.Thread(target=loop) if fn else None
    if t:
        t.start()
    steps, t0 = [], time.perf_counter()
    while time.perf_counter() - t0 < secs:
        a = time.perf_counter()
        while time.perf_counter() - a < busy:
            pass
        time.sleep(wait)
        steps.append(time.perf_counter() - a)
    stop.set()
    if t:
        t.join()
    return statistics.median(steps), runs[0] / (time.perf_counter() - t0)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--mib", type=int, default=64, help="bytes of distinct matrices per shape (beyond the caches)")
    ap.add_argument("--piece-mib", type=float, default=16)
    ap.add_argument("--probe-s", type=float, default=1.0)
    ap.add_argument("--src", action="append", help="checkout whose digests to time (repeatable)")
    args = ap.parse_args()
    srcs = args.src or [str(Path(__file__).resolve().parent.parent)]
    mods = [_load(s) for s in srcs]
    piece = int(args.piece_mib * (1 << 20))
    print(f"pieces of {args.piece_mib:g} MiB, {args.mib} MiB per shape, median (min-max) of {args.repeat}")
    for shape, dtype in SHAPES:
        mats = _matrices(shape, dtype, args.mib)
        nbytes = sum(m.nbytes for m in mats)
        g = mods[0].tile_grid(shape, np.dtype(dtype).itemsize)
        print(f"{dtype} {shape}, tiles {g.tile_rows}x{g.tile_cols} ({g.tile_cols * np.dtype(dtype).itemsize} B rows)")
        got = {(i, t): [] for i in range(len(mods)) for t in (True, False)}
        for _ in range(args.repeat):
            for (i, t), secs in got.items():
                secs.append(_cpu(lambda: _hash_all(mods[i], mats, piece, t)))
        for i, src in enumerate(srcs):
            print(f"  {src:>24}: tiles on {_gbs(got[i, True], nbytes)}; off {_gbs(got[i, False], nbytes)}")

    shape, dtype = SHAPES[0]
    mats, other = _matrices(shape, dtype, args.mib), _matrices(shape, dtype, args.mib)
    nbytes = sum(m.nbytes for m in mats)
    probe = {i: ([], [], [], [], []) for i in range(len(mods))}
    alone = []
    for _ in range(args.repeat):
        alone.append(_steps_while(None, args.probe_s / 2)[0])
        for i, mod in enumerate(mods):
            fracs, rates, slow, rates2, ratios = probe[i]
            work = lambda: _hash_all(mod, mats, piece, True)  # noqa: E731
            step, runs = _steps_while(work, args.probe_s)
            slow.append(step)
            rates2.append(runs * nbytes / 1e9)
            idle, _ = _count_while(lambda: time.sleep(0.01), args.probe_s / 2)
            busy, runs = _count_while(work, args.probe_s)
            fracs.append(busy / idle)
            rates.append(runs * nbytes / 1e9)
            one = min(_wall(work), _wall(lambda: _hash_all(mod, other, piece, True)))
            t = [threading.Thread(target=_hash_all, args=(mod, m, piece, True)) for m in (mats, other)]
            ratios.append(_wall(lambda: ([x.start() for x in t], [x.join() for x in t])) / one)
    base = statistics.median(alone)
    print(f"GIL ({dtype} {shape}, tiles on; wall-clock GB/s of the hashing thread meanwhile)")
    for i, src in enumerate(srcs):
        fracs, rates, slow, rates2, ratios = (sorted(x) for x in probe[i])
        slow = [x / base for x in slow]
        print(f"  {src}\n    training-like thread (2 ms Python, 1 ms GIL-free wait): steps at "
              f"{statistics.median(slow):.2f}x alone ({slow[0]:.2f}-{slow[-1]:.2f}), hashing "
              f"{statistics.median(rates2):.2f} GB/s ({rates2[0]:.2f}-{rates2[-1]:.2f})"
              f"\n    counting thread at {statistics.median(fracs):.2f} of its rate alone "
              f"({fracs[0]:.2f}-{fracs[-1]:.2f}), hashing {statistics.median(rates):.2f} GB/s "
              f"({rates[0]:.2f}-{rates[-1]:.2f})\n    two hashing threads: {statistics.median(ratios):.2f}x "
              f"one's wall time ({ratios[0]:.2f}-{ratios[-1]:.2f})")


if __name__ == "__main__":
    main()
