"""Where the bytes of a trained state go (issue #32's ratio target): per kind, the compressed
encoding's saving beside the entropy bounds any lossless per-dataset coder meets, on the trained
state of bench/compress.py (same model, same --cache).

    python bench/entropy.py [--cache FILE] [--steps 300] [--dim 256] [--layers 4]

Reported per kind (fp32 weights, exp_avg, exp_avg_sq, bf16 weights), in bits per element:
- ucl: the stored size of ucl's encoding (codec.encode) and its saving;
- per byte plane (docs/format.md's planes): order-0 entropy of the plane vs zstd with ucl's
  parameters (a plane kept raw counts 8 bits a byte);
- i.i.d. bound: per tensor, the empirical entropy of each element's top 16 bits taken jointly
  (sign, exponent, top mantissa bits) plus the order-0 entropy of the lower bytes: what a coder
  treating elements as independent draws of their tensor's own distribution could reach at best
  (no model cost counted: a slight underestimate);
- neighbours: H(exponent) and H(exponent | left and upper neighbours' exponents) over the matrices
  (per tensor): what context modelling of the exponent could add to that bound at most;
- joint layout: the saving of plane layout 1 (docs/format.md, version 5) on every unit, each with the
  offset its own elements give (planes.unit_offset; the writer takes one per dataset and uses the
  layout only where it pays), planes zstd-coded (ucl's parameters) where that saves 2%.
Totals for the fp32 state (weights, exp_avg, exp_avg_sq) and the bf16 mixed state (bf16 weights,
fp32 master, moments). Ratios only: no timings (see bench/compress.py for speed).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from compress import kinds, model_args, trained  # noqa: E402
from ucl.store.codec import coders, encode, group_for, unit_view, units_of  # noqa: E402
from ucl.store.planes import split_planes, unit_offset  # noqa: E402


def entropy_bits(symbols: np.ndarray) -> float:
    """Empirical order-0 entropy of ``symbols`` (non-negative ints), in bits for all of them."""
    _, counts = np.unique(symbols, return_counts=True)
    return float(-(counts * np.log2(counts / symbols.size)).sum())


def cond_bits(symbols: np.ndarray, context: np.ndarray) -> float:
    """Empirical H(symbols | context) in bits for all of them (both non-negative ints < 2^16)."""
    joint = context.astype(np.int64) << 16 | symbols.astype(np.int64)
    return entropy_bits(joint) - entropy_bits(context.astype(np.int64))


def units(arr: np.ndarray):
    """The logical bytes of each unit ucl's writer makes of ``arr``."""
    us = units_of(arr.shape, arr.itemsize, group_for(arr.shape, arr.itemsize))
    return [unit_view(arr, us, u) for u in range(us.count)]


def coded_bits(plane: np.ndarray) -> int:
    """Bits ucl stores for a plane: zstd-coded when that saves 2%, else raw."""
    compress, _ = coders("zstd")
    n = len(compress(np.ascontiguousarray(plane)))
    return 8 * (n if n < 0.98 * plane.size else plane.size)


def joint_layout_bits(raw: np.ndarray, dtype: str, itemsize: int) -> int:
    """Stored bits of one unit in plane layout 1 (docs/format.md), its offset taken from the unit."""
    offset = unit_offset(raw.view(np.uint32 if itemsize == 4 else np.uint16))
    return sum(coded_bits(p) for p in split_planes(raw, dtype, itemsize, 1, offset))


def kind_figures(tensors) -> dict:
    n = sum(a.size for a, _ in tensors)
    item = tensors[0][0].itemsize
    out = {"elements": n, "bits": 8 * item}
    out["ucl"] = 8 * sum(encode(np.ascontiguousarray(a), d, "zstd").stored.size for a, d in tensors) / n
    h0, zs = np.zeros(item), np.zeros(item)
    iid = joint = 0.0
    e_bits = e_ctx = 0.0
    e_n = 0
    for a, d in tensors:
        a = np.ascontiguousarray(a)
        for raw in units(a):
            for p, plane in enumerate(split_planes(raw, d, item)):
                h0[p] += entropy_bits(plane)
                zs[p] += coded_bits(plane)
            joint += joint_layout_bits(raw, d, item)
        x = a.reshape(-1).view(np.uint32 if item == 4 else np.uint16)
        top = x >> (8 * item - 16) if item == 4 else x
        iid += entropy_bits(top) + sum(entropy_bits((x >> (8 * b)) & 0xFF) for b in range(item - 2))
        if a.ndim == 2 and a.shape[0] > 1 and a.shape[1] > 1:
            e = ((a.view(x.dtype) >> (8 * item - 9)) & 0xFF).astype(np.int64)
            here, left, up = e[1:, 1:], e[1:, :-1], e[:-1, 1:]
            e_n += here.size
            e_bits += entropy_bits(here)
            e_ctx += cond_bits(here, left << 8 | up)
    out.update(planes_h0=(h0 / n).tolist(), planes_zstd=(zs / n).tolist(), iid=iid / n, joint=joint / n,
               e_h=e_bits / max(e_n, 1), e_ctx=e_ctx / max(e_n, 1))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    model_args(ap)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, opt, *_ = trained(args)
    figs = {}
    for kind, tensors in kinds(model, opt).items():
        if kind == "fp32 master":
            continue  # the fp32 weights again
        f = figs[kind] = kind_figures(tensors)
        b = f["bits"]
        print(f"{kind}: {f['elements']:,} elements of {b} bits")
        print(f"  ucl {f['ucl']:.3f} bits ({1 - f['ucl'] / b:.2%} saving); i.i.d. bound {f['iid']:.3f} "
              f"({1 - f['iid'] / b:.2%}); joint layout {f['joint']:.3f} ({1 - f['joint'] / b:.2%})")
        print("  planes, bits a byte, order-0 entropy / zstd: "
              + ", ".join(f"{h:.3f} / {z:.3f}" for h, z in zip(f["planes_h0"], f["planes_zstd"])))
        print(f"  exponent over the matrices: H {f['e_h']:.3f}, given left and upper neighbours {f['e_ctx']:.3f}")
    figs["fp32 master"] = figs["fp32 weights"]
    for variant, members in (("fp32 state", ("fp32 weights", "exp_avg", "exp_avg_sq")),
                             ("bf16 mixed state", ("bf16 weights", "fp32 master", "exp_avg", "exp_avg_sq"))):
        logical = sum(figs[k]["elements"] * figs[k]["bits"] for k in members)

        def saving(key: str, extra=lambda k: 0.0) -> float:
            return 1 - sum(figs[k]["elements"] * (figs[k][key] - extra(k)) for k in members) / logical
        ctx = lambda k: figs[k]["e_h"] - figs[k]["e_ctx"]  # noqa: E731
        print(f"{variant}: ucl {saving('ucl'):.2%} saving; joint layout {saving('joint'):.2%}; i.i.d. bound "
              f"{saving('iid'):.2%}; with the neighbours' gain on the exponent {saving('iid', ctx):.2%}")


if __name__ == "__main__":
    main()
