"""Compile-time scale benchmark: plan Llama-3-70B / 405B-shaped reshards from metadata alone
(the built-in Megatron-core spec of ucl.demo: fused QKV, SwiGLU, padded vocab, PP, bf16 weights,
fp32 master + Adam moments in ZeRO-1 flat buffers over dp).

    python bench/compile_scale.py            # every case
    python bench/compile_scale.py --only 405b --repeat 5
    python bench/compile_scale.py --only 405b-131k    # 131,072 ranks (ZeRO-1 over dp=2048)

Every measurement runs in a fresh Python process (cold caches; its peak RSS is its own): the
whole plan, and one target rank's plan (``compile(..., ranks=[r])``, what ``load_rank`` compiles)
for a rank of the first, a middle and the last pipeline stage; in the middle one's process then two
more ranks' (lowering cached on the model: warm), one on another pipeline stage (its tensors'
proofs still to do) and one on the same stage. Prints medians
with min-max, peak RSS of the compile and then with the plan's statistics (bytes read, distinct
bytes), plan rows stored and expanded (one per target rank), plan memory, and as a baseline
the time to merely enumerate every (rank, tensor) pair in Python in the same run.
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

CASES = {
    "70b": (dict(vocab=128256, hidden=8192, heads=64, kv_heads=8, ffn=28672, layers=80),
            "pp=8,dp=16,tp=8", "pp=16,dp=8,tp=4"),
    "405b": (dict(vocab=128256, hidden=16384, heads=128, kv_heads=8, ffn=53248, layers=126),
             "pp=16,dp=128,tp=8", "pp=8,dp=256,tp=8"),
    "405b-131k": (dict(vocab=128256, hidden=16384, heads=128, kv_heads=8, ffn=53248, layers=126),
                  "pp=16,dp=1024,tp=8", "pp=8,dp=2048,tp=8"),  # 131,072 ranks on each side
}


def _model(name: str):
    import ucl
    from ucl.demo import LLAMA_MEGATRON as SPEC, llama_params
    dims, src, dst = CASES[name]
    spec_text = SPEC
    if dims["layers"] % 16:  # 126 layers: shorter first and last stages, as Megatron configures them
        spec_text = spec_text.replace(
            "index i of layers over pp",
            "index i of layers over pp first (layers - (pp - 2) * ceil_div(layers, pp)) / 2 "
            "last (layers - (pp - 2) * ceil_div(layers, pp)) / 2")
    return ucl.load_spec(spec_text).bind(dims, llama_params(dims)), ucl.Mesh.parse(src), ucl.Mesh.parse(dst)


def child(name: str, what: str) -> dict:
    """One measurement, in this (fresh) process."""
    import ucl
    t0 = time.perf_counter()
    model, src, dst = _model(name)
    out = {"bind": time.perf_counter() - t0}
    if what == "full":
        t0, c0 = time.perf_counter(), time.process_time()
        plan = ucl.compile(model, src, dst)
        out["seconds"], out["cpu"] = time.perf_counter() - t0, time.process_time() - c0
        out["rss_compile"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # before the statistics
        out.update(stored=plan.stored_rows, expanded=plan.rows, nbytes=plan.nbytes(), tensors=len(model.tensors),
                   bytes_read=plan.bytes_read, amplification=plan.read_amplification,
                   peak=plan.peak_memory_bound())
    else:
        # a rank of the first, a middle or the last pipeline stage (the first and last hold the
        # embedding and output layer, and stages of other sizes, so they cut other flat buffers)
        r1 = {"first": 3, "middle": dst.size // 2 + 3, "last": dst.size - 5}[what.split(":")[1]]
        t0, c0 = time.perf_counter(), time.process_time()
        plan = ucl.compile(model, src, dst, ranks=[r1])
        out["seconds"], out["cpu"] = time.perf_counter() - t0, time.process_time() - c0
        if what == "rank:middle":
            t0, c0 = time.perf_counter(), time.process_time()
            ucl.compile(model, src, dst, ranks=[dst.size - 5])  # another stage: lowered afresh
            out["warm"], out["warm_cpu"] = time.perf_counter() - t0, time.process_time() - c0
            t0, c0 = time.perf_counter(), time.process_time()
            ucl.compile(model, src, dst, ranks=[r1 + 1])  # same stage as r1: placed and proved already
            out["warm_same"], out["warm_same_cpu"] = time.perf_counter() - t0, time.process_time() - c0
        out.update(stored=plan.stored_rows, expanded=plan.rows)
    out["rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # MiB (Linux: KiB)
    return out


def _spawn(name: str, what: str) -> dict:
    p = subprocess.run([sys.executable, __file__, "--child", what, "--only", name], check=True,
                       capture_output=True, text=True)
    return json.loads(p.stdout.strip().splitlines()[-1])


def _med(xs, unit="s", fmt="{:.2f}") -> str:
    return f"median {fmt.format(statistics.median(xs))} {unit} (min {fmt.format(min(xs))}, max {fmt.format(max(xs))})"


def run(name: str, repeat: int) -> None:
    dims, src, dst = CASES[name]
    full = [_spawn(name, "full") for _ in range(repeat)]
    stages = {stage: [_spawn(name, f"rank:{stage}") for _ in range(repeat)] for stage in ("first", "middle", "last")}
    one = stages["middle"]
    # Baseline: a bare Python loop over every (target rank, tensor) pair, doing nothing.
    f0 = full[0]
    from ucl.layout.mesh import Mesh
    n_ranks = Mesh.parse(dst).size
    t0 = time.perf_counter()
    n = 0
    for _r in range(n_ranks):
        for _t in range(f0["tensors"]):
            n += 1
    baseline = time.perf_counter() - t0
    med = statistics.median(x["seconds"] for x in full)
    print(f"[{name}] {f0['tensors']} tensors, {src} ({Mesh.parse(src).size} ranks) -> {dst} ({n_ranks} ranks); "
          f"{repeat} fresh processes each")
    print(f"  full plan: compile {_med([x['seconds'] for x in full])} (CPU {_med([x['cpu'] for x in full])}); peak RSS "
          f"{_med([x['rss_compile'] for x in full], 'MiB', '{:.0f}')}, with the plan's statistics after "
          f"{_med([x['rss'] for x in full], 'MiB', '{:.0f}')}")
    print(f"    rows: {f0['stored']:,} stored, {f0['expanded']:,} expanded (one per target rank, "
          f"{f0['expanded'] / max(f0['stored'], 1):.1f}x); plan memory {f0['nbytes'] / 2**20:.1f} MiB")
    for stage, runs in stages.items():
        print(f"  one rank of the {stage} stage (ranks=[r]): compile {_med([x['seconds'] for x in runs], fmt='{:.3f}')} "
              f"cold (CPU {_med([x['cpu'] for x in runs], fmt='{:.3f}')})")
    print(f"  in the middle stage's process, model lowered: a rank of another stage "
          f"{_med([x['warm'] for x in one], fmt='{:.3f}')} (CPU {_med([x['warm_cpu'] for x in one], fmt='{:.3f}')}), "
          f"of the same stage {_med([x['warm_same'] for x in one], fmt='{:.3f}')} "
          f"(CPU {_med([x['warm_same_cpu'] for x in one], fmt='{:.3f}')}); "
          f"{one[0]['expanded']:,} rows; peak RSS {_med([x['rss'] for x in one], 'MiB', '{:.0f}')}")
    worst = max(statistics.median(x["seconds"] for x in runs) for runs in stages.values())
    print(f"  baseline: empty loop over {n:,} (rank, tensor) pairs: {baseline:.2f} s -> full compile/baseline "
          f"{med / baseline:.2f}x, one rank cold (slowest stage)/baseline {worst / baseline:.3f}x")
    print(f"  reads {f0['bytes_read'] / 2**40:.2f} TiB, amplification {f0['amplification']:.2f}x, "
          f"peak memory bound {f0['peak'] / 2**20:.0f} MiB")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=sorted(CASES))
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--child", choices=("full", "rank:first", "rank:middle", "rank:last"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.only, args.child)))
        return
    for name in ([args.only] if args.only else list(CASES)):
        run(name, args.repeat)


if __name__ == "__main__":
    main()
