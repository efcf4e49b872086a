"""Reshard benchmark: a ~2 GB Llama-shaped checkpoint (fp32 weights + Adam moments, ZeRO-1 flat
optimizer buffers) on TP2·PP2·DP2, against `cp -r` of the same directory measured in the same run.

    python bench/reshard.py [--size-gb 2] [--repeat 3] [--workdir DIR] [--cores 1,2]
    python bench/reshard.py --procs 1,2,4 [--to pp=1,dp=2,tp=4] [--size-gb 2] [--repeat 3]
    python bench/reshard.py --growth [--size-gb 1] [--repeat 3]
    python bench/reshard.py --size-gb 1 --cap-share 8      # + every reshard and load under 1/8 of the checkpoint

Each operation runs as its own process (like a user would run it), in interleaved rounds after one
warm-up round; the source is read (untimed) right before every run, so it is in the page cache
("warm") even on machines that reclaim cached pages; medians with min-max are printed, plus ratios to `cp -r`
(of the medians, and of the fastest runs); beside `cp -r` runs the "verified-copy floor" (bench/copy_floor.py: the
same files copied by a Python process with one read, three XXH3 passes and one write per 2 MiB block, and
nothing else: the least a copy with ucl's verification costs here, so a reshard's ratio can be read against
what is possible at all); the CPU time of each run's process tree (steadier than wall time
on a shared machine), bytes read vs needed, the peak RSS of the largest process and the peak PSS of each
run's whole process tree (its forked workers included; tests/memprobe.py), less that of a reshard of a
3 MB checkpoint (interpreter and imports: "added" is about what ``--max-memory`` caps, docs/memory.md). Each reshard and the
load also run under ``--max-memory`` of 1/``--cap-share`` of the checkpoint (default 8; 0: not), with
their time over the same operation under the default cap (2 GB). ``--cores 1,2`` repeats
the comparison with every command (cp -r included) pinned to 1, then 2 cores (taskset), so the single-core
ratio is visible (a reshard's default workers follow the cores it may use). Runs load ucl's bytecode
from a cache (written by the warm-up round), as an installed package does, even where the environment
sets PYTHONDONTWRITEBYTECODE (``--no-bytecode-cache``: compile every run, as before). Likewise the runs after
the warm-up take the source's spec from ucl's cache of parsed specs (``UCL_CACHE_DIR``; docs/security.md),
as every command after the first on a checkpoint does. Before each timed run the benchmark
touches and frees ``--pretouch-gb`` of memory, so that every run (cp -r included) finds hot free
pages on VMs that hand freed memory back to the host.

``--procs`` measures the distributed reshard instead (docs/distributed.md): `torchrun
--nproc_per_node N -m ucl reshard ... --workers 1` for each N, against `cp -r` of the same source in
the same run; wall time includes torchrun's start-up, "reshard s" is the job's own time as rank 0
reports it (plan included). N=1 is the single-process path (torchrun's WORLD_SIZE is 1); plain
`ucl reshard --workers 1` and `--workers 2` (no torchrun) are printed for reference.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import ucl  # noqa: E402
from tests.memprobe import TreeMemory, available as pss_available  # noqa: E402
from ucl.ops import expected_datasets  # noqa: E402
from ucl.demo import LLAMA_MEGATRON, llama_params  # noqa: E402
from ucl.dtypes import storage_dtype  # noqa: E402
from ucl.store import CheckpointWriter  # noqa: E402

SPEC = (LLAMA_MEGATRON.replace("state param : dtype bfloat16", "state param : dtype float32")
        .replace("state fp32, exp_avg, exp_avg_sq :", "state exp_avg, exp_avg_sq :")
        .replace("state step : dtype int64; scalar\n", ""))


def dims_for(size_gb: float) -> dict:
    # fp32 weights replicated over dp=2 plus two fp32 moments: 16 bytes per parameter; below 1 GB a
    # narrower model with a smaller vocabulary, so that the size is still reached by whole layers
    hidden, ffn, vocab = (1024, 2816, 32000) if size_gb >= 1 else (512, 1408, 8192)
    d = dict(vocab=vocab, hidden=hidden, heads=16, kv_heads=8, ffn=ffn, layers=2)
    per_layer = 2 * hidden * hidden + hidden * hidden + 3 * ffn * hidden + 2 * hidden  # qkv (GQA), proj, fc1, fc2, norms
    fixed = 2 * vocab * hidden
    d["layers"] = max(2, int(round((size_gb * 2**30 / 16 - fixed) / per_layer / 2)) * 2)
    return d


def build_source(path: Path, dims: dict, mesh: ucl.Mesh | None = None) -> ucl.Mesh:
    model = ucl.load_spec(SPEC).bind(dims, llama_params(dims))
    mesh = mesh or ucl.Mesh(pp=2, dp=2, tp=2)
    rng = np.random.default_rng(0)
    fields = dict(spec=SPEC, spec_name="bench:llama_megatron_fp32", dims=dims, mesh=mesh.to_json(),
                  params={n: list(s) for n, s in model.params.items()}, frozen=[], state={"step": 1})
    with CheckpointWriter(path, mesh.size, **fields) as w:
        for r in range(mesh.size):
            for key, (shape, dtype) in sorted(expected_datasets(model, mesh, r).items()):
                w.write(r, key, rng.standard_normal(shape, dtype=np.float32).astype(storage_dtype(dtype)), dtype=dtype)
        w.commit()
    return mesh


PRETOUCH_BYTES = 0  # set by --pretouch-gb
_TOUCHER: subprocess.Popen | None = None
TOUCHER = """
import sys, numpy
for line in sys.stdin:
    numpy.ones(int(line), numpy.uint8)
    print("ok", flush=True)
"""


def pretouch() -> None:
    """Touch and free PRETOUCH_BYTES of memory right before a timed run. Some VMs hand freed memory
    back to the host within seconds, and first touches of it then run several times slower: one
    run would pay for the previous run's freed output, another not. Touched just now, the pages
    are still hot when the run (cp -r or ucl alike) allocates its own. A helper process does it
    (the high-water mark of this one would be inherited by every child), reaped only at the end
    (a reaped child's peak would count in RUSAGE_CHILDREN)."""
    global _TOUCHER
    if not PRETOUCH_BYTES:
        return
    if _TOUCHER is None:
        _TOUCHER = subprocess.Popen([sys.executable, "-c", TOUCHER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    text=True)
    _TOUCHER.stdin.write(f"{PRETOUCH_BYTES}\n")
    _TOUCHER.stdin.flush()
    if _TOUCHER.stdout.readline().strip() != "ok":
        raise SystemExit("the pretouch helper failed")


def rewarm(folder: Path) -> None:
    """Read every file of ``folder`` (untimed), so a run finds all of it in the page cache: some VMs
    reclaim cached pages within seconds, and a run that reads part of its source from disk is not
    comparable to one that does not."""
    buf = bytearray(16 << 20)
    for f in sorted(p for p in folder.rglob("*") if p.is_file()):
        with open(f, "rb", buffering=0) as fh:
            while fh.readinto(buf):
                pass


def timed(cmd: list[str], warm: Path | None = None, peaks: list | None = None) -> tuple[float, str]:
    """Wall time and stdout of ``cmd``; ``peaks``: gets the peak PSS of its process tree appended."""
    if warm is not None:
        rewarm(warm)
    pretouch()
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if peaks is not None and pss_available():
        with TreeMemory(p.pid, interval=0.01) as mem:
            out, err = p.communicate()
        peaks.append(mem.peak)
    else:
        out, err = p.communicate()
    dt = time.perf_counter() - t0
    if p.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{out}\n{err}")
    return dt, out


TINY = dict(vocab=512, hidden=128, heads=8, kv_heads=4, ffn=352, layers=2)  # ~3 MB


def idle_pss(work: Path) -> int:
    """Peak PSS of ``ucl reshard`` of a ~3 MB checkpoint (one file, no workers): the interpreter,
    its imports and the command's own state, the baseline "added" memory is counted from."""
    src, peaks = work / "idle-src", []
    if not src.exists():
        build_source(src, TINY)
    for i in range(2):
        timed([sys.executable, "-m", "ucl.cli", "reshard", str(src), str(work / "idle-out"), "--to", "universal",
               "--quiet", "--no-fsync"], peaks=peaks if i else None)
        shutil.rmtree(work / "idle-out")
    return peaks[0] if peaks else 0


def cached_fraction(folder: Path) -> float | None:
    """Share of the folder's file pages in the page cache right now (mincore), or None where that
    cannot be asked. "Warm" runs are only warm when this stays near 1: some VMs reclaim the page
    cache within seconds, and a source read back from disk makes a run several times slower."""
    import ctypes
    import mmap
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    page, held, total = mmap.PAGESIZE, 0, 0
    for f in (p for p in folder.rglob("*") if p.is_file() and p.stat().st_size):
        n = f.stat().st_size
        pages = -(-n // page)
        vec = (ctypes.c_ubyte * pages)()
        with open(f, "rb") as fh, mmap.mmap(fh.fileno(), n, access=mmap.ACCESS_COPY) as m:
            start = ctypes.c_char.from_buffer(m)  # private, untouched: mincore sees the file's cached pages
            rc = libc.mincore(ctypes.addressof(start), n, vec)
            del start  # the buffer export must end before the mapping closes
        if rc != 0:
            return None
        held += sum(b & 1 for b in vec)
        total += pages
    return held / total if total else None


def rss_children_mb() -> float:
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024


LOAD_ONE = """
import json, resource, sys, time, ucl
from ucl.ops import IOStats
st = IOStats()
t = time.perf_counter()
out = ucl.load_rank(sys.argv[1], mesh=ucl.Mesh.parse(sys.argv[2]), rank=int(sys.argv[3]), stats=st,
                    max_memory=int(sys.argv[4]) if len(sys.argv) > 4 else None)
print(json.dumps({"s": time.perf_counter() - t, "read": st.bytes_read, "needed": st.bytes_needed,
                  "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "result": sum(a.nbytes for a in out.values())}))
"""


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def repeated(cmd, work: Path, repeat: int, warm: Path | None = None) -> tuple[list[float], str]:
    """Wall times of ``repeat`` runs of ``cmd(out)`` after one warm-up run, and the last one's output;
    ``warm``: a folder read (untimed) before each run."""
    times, last = [], ""
    for i in range(repeat + 1):
        out = work / f"out-{i}"
        dt, last = timed(cmd(out), warm=warm)
        if i:
            times.append(dt)
        shutil.rmtree(out)
    return times, last


def children_cpu() -> float:
    """User + system CPU seconds of this process's reaped children so far (a run's workers included)."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def interleaved(ops: dict, work: Path, repeat: int, src: Path, cpu: dict | None = None,
                pss: dict | None = None) -> tuple[dict, dict, dict]:
    """``repeat`` rounds of every operation ``ops[name](out) -> command`` in turn, after one warm-up
    round (interleaved, so the machine's drift hits every operation alike), ``src`` re-read before
    each run: wall times per operation, each one's last output, and the least share of ``src`` in
    the page cache after its runs (None where that cannot be asked). ``cpu``: filled with each
    operation's CPU seconds per run (its whole process tree); ``pss``: with each one's peak PSS
    per run (its whole process tree)."""
    times = {name: [] for name in ops}
    last, warm = {}, {name: [] for name in ops}
    for i in range(repeat + 1):
        for k, (name, cmd) in enumerate(ops.items()):
            out = work / f"out-{k}-{i}"
            before = children_cpu()
            peaks: list = []
            dt, last[name] = timed(cmd(out), warm=src, peaks=peaks)
            if i and pss is not None and peaks:
                pss.setdefault(name, []).append(peaks[0])
            if i:
                times[name].append(dt)
                if cpu is not None:
                    cpu.setdefault(name, []).append(children_cpu() - before)
                warm[name].append(cached_fraction(src))  # after the run: what it may have lost to reclaim
            shutil.rmtree(out)
    cached = {name: None if None in warm[name] else min(warm[name]) for name in ops}
    return times, last, cached


def growth(args, work: Path) -> None:
    """Time against size, and against the source's rank count at equal bytes, each as a ratio to
    `cp -r` of the same source measured right before it (warm cache, page-cache writes)."""
    cli = [sys.executable, "-m", "ucl.cli", "reshard"]
    targets = ("pp=1,dp=2,tp=4", "universal")

    def row(label: str, src: Path) -> None:
        size = sum(p.stat().st_size for p in src.rglob("*") if p.is_file())
        ops = {"cp": lambda out: ["cp", "-r", str(src), str(out)]}
        ops.update({to: (lambda out, to=to: cli + [str(src), str(out), "--to", to, "--quiet", "--no-fsync"])
                    for to in targets})
        times, _, _ = interleaved(ops, work, args.repeat, src)
        cp = statistics.median(times["cp"])
        cells = [f"{label:<22} {size / 2**30:6.2f} {cp:7.2f}"]
        for to in targets:
            t = times[to]
            cells.append(f"{statistics.median(t):7.2f} ({min(t):.2f}-{max(t):.2f}) {statistics.median(t) / cp:5.2f}x")
        print("  ".join(cells), flush=True)

    head = f"{'source':<22} {'GiB':>6} {'cp -r s':>7}  " + "  ".join(f"{'-> ' + t:<26}" for t in targets)
    print(f"\ntime vs size (source TP2·PP2·DP2; medians of {args.repeat} interleaved warm rounds, min-max, x cp -r)\n{head}")
    for gb in (0.25, 0.5, 1.0, 2.0):
        src = work / f"src-{gb}"
        build_source(src, dims_for(gb))
        row(f"{gb} GB", src)
        shutil.rmtree(src)
    print(f"\ntime vs source ranks at equal bytes ({args.size_gb} GB of weights and moments, dp=1)\n{head}")
    dims = dims_for(args.size_gb * 4 / 3)  # dims_for counts 16 B/parameter (dp=2 weights); dp=1 stores 12
    for mesh in (ucl.Mesh(pp=1, dp=1, tp=1), ucl.Mesh(pp=1, dp=1, tp=2), ucl.Mesh(pp=2, dp=1, tp=2),
                 ucl.Mesh(pp=2, dp=1, tp=4), ucl.Mesh(pp=2, dp=1, tp=8)):
        src = work / f"src-{mesh.size}"
        build_source(src, dims, mesh)
        row(f"{mesh.size} ranks ({mesh})", src)
        shutil.rmtree(src)


def scaling(args, src: Path, size: int, work: Path) -> None:
    """The distributed reshard with 1, 2, 4... torchrun processes vs `cp -r`, all in this run."""
    import re
    torchrun = str(Path(sys.executable).parent / "torchrun")
    procs = [int(x) for x in args.procs.split(",")]

    def job(n: int):
        return lambda out: [torchrun, "--nproc_per_node", str(n), "--master_port", str(free_port()), "-m", "ucl",
                            "reshard", str(src), str(out), "--to", args.to, "--quiet", "--no-fsync", "--workers", "1"]
    base, _ = repeated(lambda out: ["cp", "-r", str(src), str(out)], work, args.repeat, warm=src)
    cp = statistics.median(base)
    print(f"\n{'operation':<30} {'median s':>9} {'min-max s':>13} {'GB/s':>6} {'x cp -r':>8} {'speedup':>8} "
          f"{'reshard s':>10} {'plan s':>7}  (warm cache, {args.repeat} runs, {os.cpu_count()} cores)")
    print(f"{'cp -r':<30} {cp:9.2f} {min(base):6.2f}-{max(base):<6.2f} {size / cp / 1e9:6.2f} {1:8.2f}")
    plain = [sys.executable, "-m", "ucl", "reshard", str(src), "--to", args.to, "--quiet", "--no-fsync", "--workers"]
    runs = [(f"ucl reshard --workers {w}", lambda out, w=w: plain[:5] + [str(out)] + plain[5:] + [str(w)])
            for w in (1, 2)]  # the single-process path without torchrun, for reference
    runs += [(f"torchrun x{n} -> {args.to}", job(n)) for n in procs]
    first = None
    for name, cmd in runs:
        times, text = repeated(cmd, work, args.repeat, warm=src)
        med = statistics.median(times)
        if name.startswith("torchrun"):
            first = first or med
        own = re.search(r"in ([\d.]+) s \(plan ([\d.]+) s\)", text)
        inner = f"{float(own.group(1)):10.2f} {float(own.group(2)):7.2f}" if own else ""
        speedup = f"{first / med:8.2f}" if first and name.startswith("torchrun") else " " * 8
        print(f"{name:<30} {med:9.2f} {min(times):6.2f}-{max(times):<6.2f} "
              f"{size / med / 1e9:6.2f} {med / cp:8.2f} {speedup} {inner}")


def pinned(cores: int | None) -> list[str]:
    """A command prefix running it on the first ``cores`` cores this process may use (taskset), or []."""
    if cores is None:
        return []
    usable = sorted(os.sched_getaffinity(0))
    if not 1 <= cores <= len(usable):
        raise SystemExit(f"--cores {cores}: this process may use {len(usable)} cores")
    return ["taskset", "-c", ",".join(str(c) for c in usable[:cores])]


def compare(args, src: Path, work: Path, cores: int | None, cap: int = 0) -> None:
    """cp -r (and + sync) against the reshards to TP4 and to universal (page cache and durable), all
    pinned to ``cores`` cores (None: as the machine lets them run); each reshard also under
    ``--max-memory cap`` (bytes; 0: not)."""
    pin = pinned(cores)
    env_cli = pin + [sys.executable, "-m", "ucl.cli"]
    ops = {
        "cp -r": lambda out: pin + ["cp", "-r", str(src), str(out)],
        "cp -r + sync": lambda out: pin + ["sh", "-c", f"cp -r '{src}' '{out}' && sync '{out}'/*"],
        # the least any verified copy in Python pays here (bench/copy_floor.py): what the reshard's ratio is up against
        "verified-copy floor": lambda out: pin + [sys.executable, str(ROOT / "bench" / "copy_floor.py"), str(src),
                                                  str(out)],
        "reshard -> TP4·PP1·DP2": lambda out: env_cli + ["reshard", str(src), str(out), "--to", "pp=1,dp=2,tp=4",
                                                         "--quiet", "--no-fsync"],
        "  -> TP4·PP1·DP2, fsync": lambda out: env_cli + ["reshard", str(src), str(out), "--to", "pp=1,dp=2,tp=4", "--quiet"],
        "reshard -> universal": lambda out: env_cli + ["reshard", str(src), str(out), "--to", "universal", "--quiet",
                                                       "--no-fsync"],
        "  -> universal, fsync": lambda out: env_cli + ["reshard", str(src), str(out), "--to", "universal", "--quiet"],
    }
    if cap:
        for name in [n for n in ops if "->" in n]:
            ops[f"{name} [capped]"] = lambda out, cmd=ops[name]: cmd(out) + ["--max-memory", str(cap)]
    cpu: dict = {}
    pss: dict = {}
    times, last, cached = interleaved(ops, work, args.repeat, src, cpu, pss)
    results = {name: (times[name], last[name]) for name in ops}
    base = statistics.median(results["cp -r"][0])
    fastest = min(results["cp -r"][0])
    where = "" if cores is None else f"; pinned to {cores} core{'s' if cores > 1 else ''} (taskset)"
    idle = idle_pss(work)
    print(f"\n{'operation':<38} {'median s':>9} {'min-max s':>13} {'x cp -r':>8} {'min/min':>7} {'CPU s':>6} "
          f"{'cached':>6} {'PSS MiB':>8} {'added':>6}  notes  (warm cache, {args.repeat} interleaved rounds; min/min: "
          "fastest run over cp -r's fastest; CPU s: median user + system time of the whole process tree; cached: "
          "least share of the source in the page cache after a run; PSS: the highest peak of the whole process "
          f"tree over the runs, added: less that of a reshard of a 3 MB checkpoint, {idle / 2**20:.0f} MiB"
          + (f"; [capped]: --max-memory {cap / 2**20:.0f} MiB, 1/{args.cap_share} of the checkpoint" if cap else "")
          + where + ")")
    for name, (times, text) in results.items():
        med = statistics.median(times)
        note = text.strip().splitlines()[-1][:110] if text.strip() else ""
        share = "?" if cached[name] is None else f"{cached[name]:.0%}"
        peak = max(pss.get(name, [0]))
        print(f"{name:<38} {med:9.2f} {min(times):6.2f}-{max(times):<6.2f} {med / base:8.2f} {min(times) / fastest:7.2f} "
              f"{statistics.median(cpu[name]):6.2f} {share:>6} {peak / 2**20:8.0f} {(peak - idle) / 2**20:6.0f}  {note}")
    if cap:
        print(f"\nunder --max-memory {cap / 2**20:.0f} MiB (1/{args.cap_share} of the checkpoint) vs the default cap: "
              "time ratio of the medians (min-max of the capped runs), peak added PSS of both")
        for name in [n for n in results if "->" in n and "[capped]" not in n]:
            free, capped = results[name][0], results[f"{name} [capped]"][0]
            ratio = statistics.median(capped) / statistics.median(free)
            peaks = [(max(pss.get(n, [0])) - idle) / 2**20 for n in (name, f"{name} [capped]")]
            print(f"  {name.strip():<30} {ratio:5.2f}x ({min(capped):.2f}-{max(capped):.2f} s)   added PSS "
                  f"{peaks[0]:6.0f} MiB -> {peaks[1]:6.0f} MiB (cap {cap / 2**20:.0f} MiB)"
                  f"{'' if peaks[1] * 2**20 <= cap else '  OVER THE CAP'}")
    if any(c is not None and c < 0.95 for c in cached.values()):
        print("warning: the source was partly evicted from the page cache before some runs (the machine reclaims "
              "it): those runs read from disk and are not comparable to cp -r from cache")
    synced = statistics.median(results["cp -r + sync"][0])
    for name in ("  -> TP4·PP1·DP2, fsync", "  -> universal, fsync"):
        print(f"{name.strip():<28} vs cp -r + sync: {statistics.median(results[name][0]) / synced:.2f}x")
    return base


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gb", type=float, default=2.0)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--pretouch-gb", type=float, default=4.0, help="memory touched and freed before each timed "
                    "run, so that every run starts with hot free pages (0: off)")
    ap.add_argument("--procs", default=None, metavar="N,N,...", help="measure the distributed reshard under "
                    "torchrun with these numbers of processes instead")
    ap.add_argument("--to", default="pp=1,dp=2,tp=4", metavar="MESH", help="the target of --procs")
    ap.add_argument("--growth", action="store_true", help="time vs size (0.25-2 GB) and vs source rank count "
                    "at equal bytes, each against cp -r")
    ap.add_argument("--cores", default=None, metavar="N,N,...", help="run the comparison once per number of cores, "
                    "every command (cp -r too) pinned to that many cores with taskset, e.g. 1,2")
    ap.add_argument("--cap-share", type=int, default=8, metavar="N", help="also run every reshard and the load "
                    "under --max-memory of 1/N of the checkpoint (0: not)")
    ap.add_argument("--no-bytecode-cache", action="store_true", help="let every run compile ucl's sources afresh "
                    "where the environment says so (PYTHONDONTWRITEBYTECODE), instead of loading bytecode from a "
                    "cache the warm-up round writes, as an installed package does")
    args = ap.parse_args()
    if not args.no_bytecode_cache:  # an installed package has its bytecode: runs should not compile ucl each time
        os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
        os.environ["PYTHONPYCACHEPREFIX"] = os.path.join(tempfile.gettempdir(), f"ucl-bench-pycache-{os.getuid()}")
    global PRETOUCH_BYTES
    PRETOUCH_BYTES = int(args.pretouch_gb * 2**30)
    if args.workdir:
        os.makedirs(args.workdir, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="ucl-bench-", dir=args.workdir))
    os.environ["PYTHONPATH"] = str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")
    if args.growth:
        try:
            return growth(args, work)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    py = sys.executable
    try:
        dims = dims_for(args.size_gb)
        src = work / "src"
        t0 = time.perf_counter()
        build_source(src, dims)
        size = sum(p.stat().st_size for p in src.rglob("*") if p.is_file())
        print(f"source: {size / 2**30:.2f} GiB, TP2·PP2·DP2, dims {dims}, built in {time.perf_counter() - t0:.1f} s")
        if args.procs:
            return scaling(args, src, size, work)

        cap = size // args.cap_share if args.cap_share else 0
        for cores in ([None] if args.cores is None else [int(x) for x in args.cores.split(",")]):
            base = compare(args, src, work, cores, cap)
        # (d) load one target rank straight from the source (hyperslab reads only)
        idle = idle_pss(work)
        for label, capped in [("", None)] + ([(" [capped]", str(cap))] if cap else []):
            loads, peaks = [], []
            for i in range(args.repeat + 1):
                _, text = timed([py, "-c", LOAD_ONE, str(src), "pp=1,dp=2,tp=4", "3"] + ([capped] if capped else []),
                                warm=src, peaks=peaks if i else None)
                if i:
                    loads.append(json.loads(text))
            med = statistics.median(x["s"] for x in loads)
            one = loads[-1]
            beyond = (max(peaks, default=idle) - idle - one["result"]) / 2**20
            print(f"{'load_rank(TP4 rank 3)' + label:<38} {med:9.2f} {min(x['s'] for x in loads):6.2f}-"
                  f"{max(x['s'] for x in loads):<6.2f} {med / base:8.2f}  read {one['read'] / 2**20:.0f} MiB for "
                  f"{one['needed'] / 2**20:.0f} MiB needed ({one['read'] / max(one['needed'], 1):.2f}x), "
                  f"{size / 2**20:.0f} MiB in checkpoint; RSS {one['rss']:.0f} MiB; PSS added beyond the "
                  f"{one['result'] / 2**20:.0f} MiB result: {beyond:.0f} MiB")
        print(f"\npeak RSS of the largest process over all runs: {rss_children_mb():.0f} MiB")
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if _TOUCHER is not None:
            _TOUCHER.stdin.close()
            _TOUCHER.wait()


if __name__ == "__main__":
    main()
