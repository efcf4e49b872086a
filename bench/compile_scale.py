"""Compile-time scale benchmark: plan Llama-3-70B / 405B-shaped reshards from metadata alone
(the built-in Megatron-core spec of ucl.demo: fused QKV, SwiGLU, padded vocab, PP, bf16 weights,
fp32 master + Adam moments in ZeRO-1 flat buffers over dp).

    python bench/compile_scale.py            # both cases
    python bench/compile_scale.py --only 70b

Prints compile seconds (median of --repeat runs, with min-max), plan rows and plan memory, and as
a baseline the time to merely enumerate every (rank, tensor) pair in Python in the same run.
"""
from __future__ import annotations

import argparse
import gc
import resource
import statistics
import time

import ucl
from ucl.demo import LLAMA_MEGATRON as SPEC, llama_params as params_of

CASES = {
    "70b": (dict(vocab=128256, hidden=8192, heads=64, kv_heads=8, ffn=28672, layers=80),
            "pp=8,dp=16,tp=8", "pp=16,dp=8,tp=4"),
    "405b": (dict(vocab=128256, hidden=16384, heads=128, kv_heads=8, ffn=53248, layers=126),
             "pp=16,dp=128,tp=8", "pp=8,dp=256,tp=8"),
}


def run(name: str, repeat: int) -> None:
    dims, src, dst = CASES[name]
    params = params_of(dims)
    src_mesh, dst_mesh = ucl.Mesh.parse(src), ucl.Mesh.parse(dst)
    spec_text = SPEC
    if dims["layers"] % 16:  # 126 layers: shorter first and last stages, as Megatron configures them
        spec_text = spec_text.replace(
            "index i of layers over pp",
            "index i of layers over pp first (layers - (pp - 2) * ceil_div(layers, pp)) / 2 "
            "last (layers - (pp - 2) * ceil_div(layers, pp)) / 2")
    times, plan = [], None
    for _ in range(repeat):
        text = spec_text
        spec = ucl.load_spec(text)
        gc.collect()
        t0 = time.perf_counter()
        model = spec.bind(dims, params)
        plan = ucl.compile(model, src_mesh, dst_mesh)
        times.append(time.perf_counter() - t0)
        from ucl.layout.algebra import dim_layout
        dim_layout.cache_clear()  # every repeat starts cold
    # Baseline: a bare Python loop over every (target rank, tensor) pair, doing nothing.
    t0 = time.perf_counter()
    n = 0
    for _r in range(dst_mesh.size):
        for _t in range(len(model.tensors)):
            n += 1
    baseline = time.perf_counter() - t0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    med = statistics.median(times)
    print(f"[{name}] {len(params)} params, {len(model.tensors)} tensors, {src} ({src_mesh.size} ranks) -> {dst} "
          f"({dst_mesh.size} ranks)")
    print(f"  compile: median {med:.2f} s (min {min(times):.2f}, max {max(times):.2f}, {repeat} runs, cold caches)")
    print(f"  plan rows: {len(plan.copies['tensor']):,} copies + {len(plan.fills['dst_rank']):,} fills; "
          f"plan memory {plan.nbytes() / 2**20:.1f} MiB; peak RSS {rss:.0f} MiB")
    print(f"  baseline: empty loop over {n:,} (rank, tensor) pairs: {baseline:.2f} s -> compile/baseline "
          f"{med / baseline:.1f}x")
    print(f"  reads {plan.bytes_read / 2**40:.2f} TiB, amplification {plan.read_amplification:.2f}x, "
          f"peak memory bound {plan.peak_memory_bound() / 2**20:.0f} MiB")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=sorted(CASES))
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    for name in ([args.only] if args.only else ["70b", "405b"]):
        run(name, args.repeat)


if __name__ == "__main__":
    main()
