"""Soak: a small model through thousands of checkpoints, and what the checkpointer holds must stay flat.

    python bench/soak.py [--checkpoints 5000] [--procs 2] [--pools 1 0.25] [--persist-every 2] [--json]

A job of --procs processes (gloo, CPU, DDP) trains a small MLP and saves at every iteration, with
persist_every (unwritten saves kept in host memory), a directory tier, a host pool of --pools
snapshots (below 1: snapshots stream through it as a ring; every --reopen-every saves the
Checkpointer is closed and the next one, with the next pool size, resumes with load()), rollbacks (every --rollback-every
saves: alternately load() of the newest, from memory or disk, and load(step=k) of an older written
step, after which the run goes on from there and re-saves the steps it abandoned), and a tier that
fails for a while and recovers (process rank 0 swaps the tier folder for a file, then puts it
back; each failed promotion raises UCL435 on a later call, and that save is made again).

Every --check-every saves each process waits for everything to be durable (under a timeout: a hang dumps
every thread's stack and fails), then samples its resident memory (after malloc_trim: memory freed but
kept by glibc is no growth), open file descriptors, threads, child processes and /dev/shm mappings and
descriptors; process rank 0 verifies every checkpoint committed since the last check (in the root and
the tier: keep and check-every are chosen so none is pruned unverified) and loads the newest, comparing
it bit for bit with the live model and optimizer state. After warm-up (the first --warmup of the
samples) the resources must stay flat: memory within --rss-tolerance-mib of the warm-up's peak, and the
counts at most the warm-up's peak. Prints a report (or one JSON line with --json); exit status 1 when
anything failed.
"""
from __future__ import annotations

import argparse
import datetime
import faulthandler
import json
import os
import shutil
import socket
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

WIDTH = 256


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- resources of this process -----------------------------------------------------------------------
def _trim_heap() -> None:
    """Hand glibc's free heap pages back before RSS is read: without it RSS also counts memory freed
    but kept by malloc (rank 0's verify/load churn grew it ~7 KB a save; the live heap stayed flat)."""
    import ctypes
    import ctypes.util
    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: RSS as it is
        pass


def resources() -> dict:
    _trim_heap()
    me = os.getpid()
    rss = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmRSS")) / 1024
    fds = os.listdir("/proc/self/fd")
    shm_fds = 0
    for fd in fds:
        try:
            shm_fds += os.readlink(f"/proc/self/fd/{fd}").startswith("/dev/shm/")
        except OSError:
            pass
    shm_maps = sum("/dev/shm/" in line for line in open("/proc/self/maps"))
    return dict(rss_mib=round(rss, 1), fds=len(fds), threads=len(os.listdir("/proc/self/task")),
                children=_children(me), shm=shm_fds + shm_maps)


def _children(pid: int) -> int:
    n = 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    n += int(f.read().rsplit(")", 1)[1].split()[1]) == pid
            except (OSError, IndexError, ValueError):
                pass
    return n


class Watchdog:
    """Every blocking call of the checkpointer under a timeout: past it, every thread's stack is
    dumped and the process exits (the parent reports a hang)."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def __enter__(self):
        faulthandler.dump_traceback_later(self.seconds, exit=True)

    def __exit__(self, *exc):
        faulthandler.cancel_dump_traceback_later()


# ---- one process of the job ----------------------------------------------------------------------------
def worker(rank: int, args: argparse.Namespace, port: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=args.procs, timeout=datetime.timedelta(seconds=args.timeout))
    result = {"rank": rank, "samples": [], "errors": []}
    try:
        soak(rank, args, result)
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        import traceback
        result["errors"].append(f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
    finally:
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
        dist.destroy_process_group()


def soak(rank: int, args, result: dict) -> None:
    import torch
    import ucl
    from ucl.store import CheckpointRoot
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.GELU(), torch.nn.Linear(WIDTH, WIDTH))
    model = torch.nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    snapshot = 3 * sum(p.numel() * 4 for p in net.parameters())
    root, tier = Path(args.workdir) / "root", Path(args.workdir) / "tier"
    dog = Watchdog(args.timeout)

    def open_checkpointer(segment: int):
        pool = args.pools[segment % len(args.pools)]
        return ucl.Checkpointer(root, model, opt, keep=args.keep, tiers=[tier], persist_every=args.persist_every,
                                pool_bytes=max(4096, int(pool * snapshot)))
    warnings.filterwarnings("ignore", message=".*not kept in host memory.*")  # rollbacks with a ring pool
    ck = open_checkpointer(0)
    verified: set = set()
    stats = result.setdefault("stats", {"saves": 0, "rollbacks": 0, "tier_failures": 0, "verified": 0,
                                        "loads_checked": 0, "tier_errors_raised": 0})

    def train(i: int) -> None:
        g = torch.Generator().manual_seed(i)
        x = torch.randn(16, WIDTH, generator=g)
        loss = (model(x) - x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()

    def tolerant(call) -> None:
        """``call()``, again after each UCL435 (a promotion to the failing tier; each failed one is
        raised once, by a later call): anything else is a failure."""
        with dog:
            while True:
                try:
                    return call()
                except ucl.StoreError as e:
                    if e.code != "UCL435":
                        raise
                    stats["tier_errors_raised"] += 1

    def save(step: int) -> None:
        tolerant(lambda: ck.save(step))
        stats["saves"] += 1

    def wait() -> None:
        tolerant(ck.wait)

    step, broken_until = 0, -1
    while stats["saves"] < args.checkpoints:
        step += 1
        train(step)
        save(step)
        n = stats["saves"]
        if rank == 0 and n % args.tier_fails_every == 0 and tier.is_dir():  # the tier fails for a while
            wait()  # no promotion in flight while the folder goes
            tier.rename(tier.with_name("tier-away"))
            tier.write_text("not a folder")
            broken_until, stats["tier_failures"] = n + 3, stats["tier_failures"] + 1
        if rank == 0 and n == broken_until:  # ... and recovers
            wait()
            tier.unlink()
            tier.with_name("tier-away").rename(tier)
        if n % args.rollback_every == 0:
            wait()  # every process sees the same committed steps
            dist_barrier()
            written = [s for s in CheckpointRoot(root).steps() if s < step]
            with dog:
                if stats["rollbacks"] % 2 == 0 or not written:
                    step = ck.load()[0]
                else:
                    step = ck.load(step=written[-1])[0]
            stats["rollbacks"] += 1
        if n % args.reopen_every == 0:  # the next Checkpointer, with the next pool size
            tolerant(ck.close)
            ck = open_checkpointer(n // args.reopen_every)
            step = tolerant(ck.load)[0]
        if n % args.check_every == 0:
            wait()
            dist_barrier()
            result["samples"].append(dict(saves=n, **resources()))
            if rank == 0:
                check(net, opt, step, [root] + ([tier] if tier.is_dir() else []), verified, stats)
            dist_barrier()
    tolerant(ck.close)


def dist_barrier() -> None:
    import torch.distributed as dist
    dist.barrier()


def unverified(roots, verified: set) -> list[tuple[str, int]]:
    """(path, manifest mtime) of each committed checkpoint in roots not yet in verified, which
    keeps only the keys still on disk: a key per checkpoint ever seen grew rank 0 with the run."""
    from ucl.store import CheckpointRoot
    present = []
    for r in roots:
        cr = CheckpointRoot(r)
        for s in cr.steps():
            path = cr.path_for(s)
            try:
                present.append((str(path), os.stat(os.path.join(path, "manifest.json")).st_mtime_ns))
            except FileNotFoundError:  # pruned since it was listed
                pass
    verified.intersection_update(present)
    return [key for key in present if key not in verified]


def check(net, opt, step: int, roots, verified: set, stats: dict) -> None:
    """Every checkpoint committed since the last check verifies; the newest loads bit for bit (when
    it is the live state's step: not after an unwritten save)."""
    import numpy as np
    import ucl
    from ucl.store import CheckpointRoot
    for key in unverified(roots, verified):
        with ucl.open(key[0]) as c:
            bad = c.verify()
        if bad:
            raise AssertionError(f"{key[0]} does not verify: {bad[:3]}")
        verified.add(key)
        stats["verified"] += 1
    if CheckpointRoot(roots[0]).latest_step() != step:
        return
    newest = CheckpointRoot(roots[0]).latest()
    got = ucl.load_rank(newest, mesh="universal", rank=0, as_torch=True)
    for name, p in net.named_parameters():
        want = {"param": p, "exp_avg": opt.state[p]["exp_avg"], "exp_avg_sq": opt.state[p]["exp_avg_sq"]}
        for kind, t in want.items():
            if not np.array_equal(got[f"{kind}/{name}"].numpy(), t.detach().numpy()):
                raise AssertionError(f"{newest}: {kind}/{name} differs from the live state")
    stats["loads_checked"] += 1


# ---- the parent --------------------------------------------------------------------------------------------
def flat(samples: list[dict], warmup: float, rss_tolerance: float) -> list[str]:
    """What grew after warm-up, per process."""
    k = max(1, int(len(samples) * warmup))
    base, after = samples[:k], samples[k:]
    if not after:
        return ["too few samples to judge (raise --checkpoints or lower --check-every)"]
    grew = []
    peak = max(s["rss_mib"] for s in base)
    worst = max(after, key=lambda s: s["rss_mib"])
    if worst["rss_mib"] > peak + rss_tolerance:
        grew.append(f"RSS {peak:.0f} -> {worst['rss_mib']:.0f} MiB (at save {worst['saves']})")
    for what in ("fds", "threads", "children", "shm"):
        top = max(s[what] for s in base)
        high = max(after, key=lambda s: s[what])
        if high[what] > top:
            grew.append(f"{what} {top} -> {high[what]} (at save {high['saves']})")
    return grew


def run(args) -> dict:
    import torch.multiprocessing as mp
    out = tempfile.mkdtemp(prefix="ucl-soak-out-")
    t0 = time.perf_counter()
    ctx = mp.spawn(worker, args=(args, _free_port(), out), nprocs=args.procs, join=False)
    deadline = time.monotonic() + args.limit
    hung = False
    try:
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                hung = True
                break
    except Exception as e:  # noqa: BLE001 - a worker died (the watchdog's exit included)
        hung = "exited" in str(e) or "signal" in str(e)
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    results = []
    for r in range(args.procs):
        path = os.path.join(out, f"rank{r}.json")
        results.append(json.load(open(path)) if os.path.exists(path) else
                       {"rank": r, "samples": [], "errors": ["no result: the process died or hung (see its stack above)"]})
    shutil.rmtree(out, ignore_errors=True)
    report = {"seconds": round(time.perf_counter() - t0, 1), "hung": bool(hung), "ranks": []}
    for r in results:
        grew = flat(r["samples"], args.warmup, args.rss_tolerance_mib) if r["samples"] else []
        s = r["samples"]
        report["ranks"].append({"rank": r["rank"], "errors": r["errors"], "grew": grew, "stats": r.get("stats", {}),
                                "first": s[0] if s else None, "warm": s[max(1, int(len(s) * args.warmup)) - 1] if s else None,
                                "last": s[-1] if s else None})
    report["ok"] = not hung and all(not r["errors"] and not r["grew"] for r in report["ranks"])
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoints", type=int, default=5000, help="saves per process")
    ap.add_argument("--procs", type=int, default=2, help="processes of the job")
    ap.add_argument("--pools", type=float, nargs="+", default=[1.0, 0.25], help="pool_bytes in snapshots (below 1: "
                    "the ring), one per Checkpointer in turn")
    ap.add_argument("--reopen-every", type=int, default=500, help="saves before the Checkpointer is closed and the "
                    "next one opened (the next pool size), resuming with load()")
    ap.add_argument("--persist-every", type=int, default=2)
    ap.add_argument("--keep", type=int, default=3)
    ap.add_argument("--rollback-every", type=int, default=50)
    ap.add_argument("--tier-fails-every", type=int, default=200, help="saves between failures of the tier")
    ap.add_argument("--check-every", type=int, default=0, help="saves between checks (default: keep x persist_every, "
                    "so no checkpoint is pruned unverified)")
    ap.add_argument("--warmup", type=float, default=0.2, help="share of the samples that is warm-up")
    ap.add_argument("--rss-tolerance-mib", type=float, default=24.0)
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds any save, wait or load may block")
    ap.add_argument("--limit", type=float, default=4 * 3600.0, help="seconds the whole soak may take")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--json", action="store_true", help="one JSON line instead of the report")
    args = ap.parse_args()
    args.check_every = args.check_every or args.keep * args.persist_every
    work = tempfile.mkdtemp(prefix="ucl-soak-", dir=args.workdir)
    args.workdir = work
    try:
        report = run(args)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        print(json.dumps(report))
    else:
        print(f"{args.checkpoints} saves x {args.procs} processes, pools {args.pools} snapshots, persist_every "
              f"{args.persist_every}: {report['seconds']} s, {'HUNG' if report['hung'] else 'no hang'}")
        for r in report["ranks"]:
            print(f"rank {r['rank']}: {r['stats']}")
            for name in ("first", "warm", "last"):
                print(f"  {name:>5}: {r[name]}")
            for g in r["grew"]:
                print(f"  GREW after warm-up: {g}")
            for e in r["errors"]:
                print(f"  ERROR: {e}")
        print("OK: flat after warm-up" if report["ok"] else "FAILED")
    sys.exit(0 if report["ok"] else 1)


if __name__ == "__main__":
    main()
