"""Known-answer tests for the silent-corruption cases of DESIGN.md section 5.

Every expected per-rank tensor here is built by an *independent reference* written in plain
numpy/torch following the convention of the framework that writes such checkpoints (Megatron-core,
vLLM, DeepSpeed, torch.chunk ...). The reference never calls into ucl. Each test then checks,
bit-exactly (raw bytes, dtype and shape):

* scatter   universal -> A          equals the reference for A,
* reshard   A -> B  (from the *reference* shards of A) equals the reference for B, and back,
* gather    A -> universal          equals the global tensors.

Rank numbering of the reference: mesh axes slowest -> fastest, row-major (``itertools.product``
order), i.e. Megatron's tp-fastest order for ``Mesh(pp=.., dp=.., tp=..)``.
"""
from __future__ import annotations

import itertools
import re

import numpy as np
import pytest
import torch

import ucl
from ucl import UNIVERSAL, Mesh

# some known answers are deliberately loose fits (kv_heads < tp): the warning is
# expected (tests/test_mesh_diagnostics.py checks it)
pytestmark = pytest.mark.filterwarnings("ignore::ucl.layout.fit.MeshFitWarning")


# ---- harness ------------------------------------------------------------------------------------
def per_rank(axes: dict, fn) -> dict[int, dict[str, np.ndarray]]:
    """Reference shards: ``fn(coords)`` for every rank of a mesh with ``axes`` (name -> size, slowest
    first), ranks numbered row-major. ``axes == {}`` is the universal layout (one rank)."""
    names = list(axes)
    out = {}
    for rank, combo in enumerate(itertools.product(*[range(axes[a]) for a in names])):
        out[rank] = fn(dict(zip(names, combo)))
    return out


_FLAT = re.compile(r"/@flat\d+(?=$|\.)")


def _norm(key: str, normalize_flat: bool) -> str:
    # A kind with a single flat group is compared as KIND/@flat: which number G the group gets is
    # checked on its own (test_flat_group_numbering_per_kind_as_documented).
    return _FLAT.sub("/@flat", key) if normalize_flat else key


def assert_shards_equal(got, want, *, normalize_flat=True, where=""):
    assert sorted(got) == sorted(want), f"{where}: ranks {sorted(got)} != {sorted(want)}"
    for r in sorted(want):
        g = {_norm(k, normalize_flat): v for k, v in got[r].items()}
        w = {_norm(k, normalize_flat): v for k, v in want[r].items()}
        assert len(g) == len(got[r]), f"{where}: rank {r}: several flat groups of one kind: {sorted(got[r])}"
        assert sorted(g) == sorted(w), f"{where}: rank {r}: keys {sorted(g)} != {sorted(w)}"
        for k in sorted(w):
            a, b = np.asarray(g[k]), np.asarray(w[k])
            assert a.dtype == b.dtype, f"{where}: rank {r} {k}: dtype {a.dtype} != {b.dtype}"
            assert a.shape == b.shape, f"{where}: rank {r} {k}: shape {a.shape} != {b.shape}"
            if a.tobytes() != b.tobytes():
                bad = np.flatnonzero(a.reshape(-1).view(np.uint8 if a.itemsize == 1 else f"u{a.itemsize}")
                                     != b.reshape(-1).view(np.uint8 if b.itemsize == 1 else f"u{b.itemsize}"))
                raise AssertionError(f"{where}: rank {r} {k}: {len(bad)} elements differ, first at flat {bad[:8]}:"
                                     f"\n got {a.reshape(-1)[bad[:8]]}\nwant {b.reshape(-1)[bad[:8]]}")


def run(model, src: Mesh, dst: Mesh, shards):
    return ucl.execute_memory(ucl.compile(model, src, dst), shards)


def check_layouts(model, universal: dict[str, np.ndarray], cases: list[tuple[dict, dict]]):
    """``cases``: (mesh axes, reference shards). Scatter, gather and every ordered reshard pair."""
    uni = {0: universal}
    for axes, ref in cases:
        mesh = Mesh(**axes)
        assert_shards_equal(run(model, UNIVERSAL, mesh, uni), ref, where=f"universal -> {mesh}")
        assert_shards_equal(run(model, mesh, UNIVERSAL, ref), uni, where=f"{mesh} -> universal")
    for (a, ra), (b, rb) in itertools.permutations(cases, 2):
        assert_shards_equal(run(model, Mesh(**a), Mesh(**b), ra), rb, where=f"{Mesh(**a)} -> {Mesh(**b)}")


def rand(rng, shape, dtype=np.float32):
    """Distinct non-zero values (zeros are reserved for padding)."""
    x = rng.standard_normal(shape).astype(dtype)
    x[x == 0] = 1
    return x


def chunk(x: np.ndarray, parts: int, idx: int, axis: int = 0) -> np.ndarray:
    """Megatron/torch convention for an even TP split: contiguous block ``idx`` of ``parts``."""
    n = x.shape[axis]
    assert n % parts == 0
    s = n // parts
    return np.take(x, np.arange(idx * s, (idx + 1) * s), axis=axis)


# =================================================================================================
# Fused QKV with GQA
# =================================================================================================
HIDDEN = 32


def qkv_hf(rng, heads, kv_heads, head_dim, trailing=(HIDDEN,)):
    """Separate Hugging Face q_proj / k_proj / v_proj weights (rows = output features, head-major)."""
    return (rand(rng, (heads * head_dim, *trailing)), rand(rng, (kv_heads * head_dim, *trailing)),
            rand(rng, (kv_heads * head_dim, *trailing)))


def megatron_fuse_global(q, k, v, heads, kv_heads, head_dim):
    """Megatron-core linear_qkv (as the Megatron HF loaders build it): for each query group g the rows
    are [q heads of group g (heads/kv_heads*head_dim rows), k_g (head_dim rows), v_g (head_dim rows)]."""
    rest = q.shape[1:]
    npg = heads // kv_heads
    qg = q.reshape(kv_heads, npg * head_dim, *rest)
    kg = k.reshape(kv_heads, head_dim, *rest)
    vg = v.reshape(kv_heads, head_dim, *rest)
    return np.concatenate([qg, kg, vg], axis=1).reshape(-1, *rest)


def megatron_qkv_local(q, k, v, heads, kv_heads, head_dim, tp, r):
    """Megatron TP rank r holds query groups [r*G/tp, (r+1)*G/tp), i.e. q heads r*heads/tp.., written
    group by group (a different code path from megatron_fuse_global on purpose)."""
    npg, gpr = heads // kv_heads, kv_heads // tp
    blocks = []
    for g in range(r * gpr, (r + 1) * gpr):
        blocks += [q[g * npg * head_dim:(g + 1) * npg * head_dim], k[g * head_dim:(g + 1) * head_dim],
                   v[g * head_dim:(g + 1) * head_dim]]
    return np.concatenate(blocks)


SPEC_QKV_MEGATRON = """
dims hidden, heads, kv_heads
let head_dim = hidden / heads
mesh dp, tp
qkv.weight [(heads + 2 * kv_heads) * head_dim, hidden]
    : view 0 as [kv_heads, (heads / kv_heads + 2) * head_dim]; split 0.0 over tp
qkv.bias [(heads + 2 * kv_heads) * head_dim]
    : view 0 as [kv_heads, (heads / kv_heads + 2) * head_dim]; split 0.0 over tp
proj.weight [hidden, heads * head_dim] : split 1 over tp
state exp_avg : follow
"""


def test_fused_qkv_gqa_megatron_interleaved():
    heads, kv, hd = 8, 4, HIDDEN // 8
    rng = np.random.default_rng(0)
    rows = (heads + 2 * kv) * hd
    model = ucl.load_spec(SPEC_QKV_MEGATRON).bind(
        dims=dict(hidden=HIDDEN, heads=heads, kv_heads=kv),
        params={"qkv.weight": (rows, HIDDEN), "qkv.bias": (rows,), "proj.weight": (HIDDEN, heads * hd)})
    hf, uni = {}, {}
    for kind in ("param", "exp_avg"):
        hf[kind] = {"w": qkv_hf(rng, heads, kv, hd), "b": qkv_hf(rng, heads, kv, hd, trailing=()),
                    "proj": rand(rng, (HIDDEN, heads * hd))}
        uni[f"{kind}/qkv.weight"] = megatron_fuse_global(*hf[kind]["w"], heads, kv, hd)
        uni[f"{kind}/qkv.bias"] = megatron_fuse_global(*hf[kind]["b"], heads, kv, hd)
        uni[f"{kind}/proj.weight"] = hf[kind]["proj"]
        # the two code paths of the reference agree on the trivial layout
        assert np.array_equal(uni[f"{kind}/qkv.weight"], megatron_qkv_local(*hf[kind]["w"], heads, kv, hd, 1, 0))

    def ref(axes):
        tp = axes.get("tp", 1)

        def fn(c):
            r = c.get("tp", 0)
            out = {}
            for kind, h in hf.items():
                out[f"{kind}/qkv.weight"] = megatron_qkv_local(*h["w"], heads, kv, hd, tp, r)
                out[f"{kind}/qkv.bias"] = megatron_qkv_local(*h["b"], heads, kv, hd, tp, r)
                out[f"{kind}/proj.weight"] = chunk(h["proj"], tp, r, axis=1)  # row-parallel
            return out
        return per_rank(axes, fn)

    cases = [(a, ref(a)) for a in (dict(dp=2, tp=2), dict(tp=4), dict(dp=3))]
    # On tp=2, rank 0 holds query groups 0, 1: rows [q0 q1 k0 v0 q2 q3 k1 v1] (heads of head_dim rows),
    # a row block of the *interleaved* tensor; taking Q rows of rank 0 from HF's [Q; K; V] would be wrong.
    q, k, v = hf["param"]["w"]
    r0 = cases[0][1][0]["param/qkv.weight"]
    assert np.array_equal(r0[2 * hd:3 * hd], k[:hd]) and np.array_equal(r0[4 * hd:6 * hd], q[2 * hd:4 * hd])
    assert np.array_equal(cases[0][1][1]["param/qkv.weight"][:2 * hd], q[4 * hd:6 * hd])  # group 2 starts rank 1
    check_layouts(model, uni, cases)


SPEC_QKV_HF = """
dims hidden, heads, kv_heads
let head_dim = hidden / heads
mesh dp, tp
# per part, with head views
qkv.weight [(heads + 2 * kv_heads) * head_dim, hidden]
    : concat 0 as [q = heads * head_dim, k = kv_heads * head_dim, v = kv_heads * head_dim]
    ; view 0.q as [heads, head_dim]; view 0.k as [kv_heads, head_dim]; view 0.v as [kv_heads, head_dim]
    ; split 0.q.0 over tp; split 0.k.0 over tp; split 0.v.0 over tp
# the short form: a split of a concat splits every part
qkv.bias [(heads + 2 * kv_heads) * head_dim]
    : concat 0 as [q = heads * head_dim, k = kv_heads * head_dim, v = kv_heads * head_dim]; split 0 over tp
state exp_avg : follow
"""


def vllm_qkv_local(q, k, v, heads, kv_heads, head_dim, tp, r):
    """vLLM QKVParallelLinear: TP rank r holds [Q_r; K_r; V_r]; q heads [r*heads/tp, ...). When
    kv_heads < tp each KV head is replicated over tp/kv_heads consecutive ranks:
    kv shard = r // (tp // kv_heads)."""
    qh = heads // tp
    out_q = q[r * qh * head_dim:(r + 1) * qh * head_dim]
    if kv_heads >= tp:
        kh = kv_heads // tp
        lo, hi = r * kh * head_dim, (r + 1) * kh * head_dim
    else:
        j = r // (tp // kv_heads)
        lo, hi = j * head_dim, (j + 1) * head_dim
    return np.concatenate([out_q, k[lo:hi], v[lo:hi]])


def test_fused_qkv_hf_style_concat():
    heads, kv, hd = 8, 4, HIDDEN // 8
    rng = np.random.default_rng(1)
    rows = (heads + 2 * kv) * hd
    model = ucl.load_spec(SPEC_QKV_HF).bind(dims=dict(hidden=HIDDEN, heads=heads, kv_heads=kv),
                                            params={"qkv.weight": (rows, HIDDEN), "qkv.bias": (rows,)})
    hf, uni = {}, {}
    for kind in ("param", "exp_avg"):
        hf[kind] = {"w": qkv_hf(rng, heads, kv, hd), "b": qkv_hf(rng, heads, kv, hd, trailing=())}
        uni[f"{kind}/qkv.weight"] = np.concatenate(hf[kind]["w"])  # HF-style fused [Q; K; V]
        uni[f"{kind}/qkv.bias"] = np.concatenate(hf[kind]["b"])

    def ref(axes):
        tp = axes.get("tp", 1)
        return per_rank(axes, lambda c: {
            f"{kind}/qkv.{n}": vllm_qkv_local(*h[s], heads, kv, hd, tp, c.get("tp", 0))
            for kind, h in hf.items() for n, s in (("weight", "w"), ("bias", "b"))})

    cases = [(a, ref(a)) for a in (dict(dp=2, tp=2), dict(tp=4), dict(tp=1))]
    check_layouts(model, uni, cases)


SPEC_QKV_SHARED = """
dims hidden, heads, kv_heads
let head_dim = hidden / heads
mesh dp, tp
qkv.weight [(heads + 2 * kv_heads) * head_dim, hidden]
    : concat 0 as [q = heads * head_dim, k = kv_heads * head_dim, v = kv_heads * head_dim]
    ; view 0.q as [heads, head_dim]; view 0.k as [kv_heads, head_dim]; view 0.v as [kv_heads, head_dim]
    ; split 0.q.0 over tp; split 0.k.0 over tp shared; split 0.v.0 over tp shared
state exp_avg : follow
"""


def _kv_shared_setup():
    heads, kv, hd = 8, 2, HIDDEN // 8
    rng = np.random.default_rng(2)
    rows = (heads + 2 * kv) * hd
    model = ucl.load_spec(SPEC_QKV_SHARED).bind(dims=dict(hidden=HIDDEN, heads=heads, kv_heads=kv),
                                                params={"qkv.weight": (rows, HIDDEN)})
    hf = {kind: qkv_hf(rng, heads, kv, hd) for kind in ("param", "exp_avg")}
    uni = {f"{kind}/qkv.weight": np.concatenate(h) for kind, h in hf.items()}

    def ref(axes):
        tp = axes.get("tp", 1)
        return per_rank(axes, lambda c: {f"{kind}/qkv.weight": vllm_qkv_local(*h, heads, kv, hd, tp, c.get("tp", 0))
                                         for kind, h in hf.items()})

    cases = [(a, ref(a)) for a in (dict(tp=8), dict(dp=2, tp=4), dict(tp=2))]
    return model, uni, hf, hd, cases


def test_fused_qkv_kv_heads_fewer_than_tp_ranks():
    """Scatter to KV-replicating layouts, and reshard *from* tp=2 (kv_heads == tp: no sharing)."""
    model, uni, hf, hd, cases = _kv_shared_setup()
    r8 = cases[0][1]
    _, k, v = hf["param"]
    for r in range(8):  # 4 consecutive ranks share each KV head, Q heads are not shared
        assert np.array_equal(r8[r]["param/qkv.weight"][hd:2 * hd], k[(r // 4) * hd:(r // 4 + 1) * hd])
        assert np.array_equal(r8[r]["param/qkv.weight"][2 * hd:], v[(r // 4) * hd:(r // 4 + 1) * hd])
    for axes, ref in cases:
        assert_shards_equal(run(model, UNIVERSAL, Mesh(**axes), {0: uni}), ref, where=f"universal -> {axes}")
    tp2 = cases[2][1]
    for axes, ref in cases[:2]:
        assert_shards_equal(run(model, Mesh(tp=2), Mesh(**axes), tp2), ref, where=f"tp=2 -> {axes}")
    assert_shards_equal(run(model, Mesh(tp=2), UNIVERSAL, tp2), {0: uni}, where="tp=2 -> universal")


def test_fused_qkv_kv_heads_fewer_than_tp_ranks_from_shared_layout():
    model, uni, hf, hd, cases = _kv_shared_setup()
    check_layouts(model, uni, cases)


# =================================================================================================
# SwiGLU [gate; up]
# =================================================================================================
SPEC_SWIGLU = """
dims hidden, ffn
mesh dp, tp
fc1.weight [2 * ffn, hidden] : view 0 as [2, ffn]; split 0.1 over tp
fc1.bias [2 * ffn]           : view 0 as [2, ffn]; split 0.1 over tp
fc2.weight [hidden, ffn]     : split 1 over tp
state exp_avg, exp_avg_sq : follow
"""


def swiglu_local(w, ffn, tp, r):
    """Megatron-core gated linear_fc1: global rows [gate (ffn); up (ffn)]; TP rank r holds
    [gate_r; up_r] (each of gate and up chunked separately), not a contiguous row block."""
    gate, up = w[:ffn], w[ffn:]
    return np.concatenate([chunk(gate, tp, r), chunk(up, tp, r)])


def test_swiglu_gate_up_per_rank():
    hidden, ffn = 6, 16
    rng = np.random.default_rng(3)
    model = ucl.load_spec(SPEC_SWIGLU).bind(dims=dict(hidden=hidden, ffn=ffn), params={
        "fc1.weight": (2 * ffn, hidden), "fc1.bias": (2 * ffn,), "fc2.weight": (hidden, ffn)})
    uni = {}
    for kind in ("param", "exp_avg", "exp_avg_sq"):
        uni[f"{kind}/fc1.weight"] = np.concatenate([rand(rng, (ffn, hidden)), rand(rng, (ffn, hidden))])
        uni[f"{kind}/fc1.bias"] = rand(rng, (2 * ffn,))
        uni[f"{kind}/fc2.weight"] = rand(rng, (hidden, ffn))

    def ref(axes):
        tp = axes.get("tp", 1)
        return per_rank(axes, lambda c: {
            **{f"{kind}/fc1.{n}": swiglu_local(uni[f"{kind}/fc1.{n}"], ffn, tp, c.get("tp", 0))
               for kind in ("param", "exp_avg", "exp_avg_sq") for n in ("weight", "bias")},
            **{f"{kind}/fc2.weight": chunk(uni[f"{kind}/fc2.weight"], tp, c.get("tp", 0), axis=1)
               for kind in ("param", "exp_avg", "exp_avg_sq")}})

    cases = [(a, ref(a)) for a in (dict(tp=2), dict(dp=2, tp=4), dict(tp=8))]
    # the classic corruption: a contiguous block would put only gate rows on rank 0
    assert not np.array_equal(cases[0][1][0]["param/fc1.weight"], uni["param/fc1.weight"][:ffn])
    check_layouts(model, uni, cases)


# =================================================================================================
# ZeRO / DeepSpeed flat partitions (reference)
# =================================================================================================
def zero_partitions(tensors, parts, *, pad_multiple=1, align=1, reverse=False):
    """DeepSpeed ZeRO-1/2 (stage_1_and_2.py, flatten_dense_tensors_aligned): the rank's tensors in
    model order (Megatron's distributed optimizer: reverse order) are flattened, each starting at a
    multiple of ``align`` (zero gaps), the total padded with zeros to a multiple of ``pad_multiple``
    (DeepSpeed: nccl_start_alignment_factor 2 * dp), and partition r is the contiguous slice r."""
    order = list(reversed(tensors)) if reverse else list(tensors)
    dtype = order[0].dtype
    chunks, pos = [], 0
    for t in order:
        start = -(-pos // align) * align
        chunks.append(np.zeros(start - pos, dtype))
        chunks.append(np.ascontiguousarray(t).reshape(-1))
        pos = start + t.size
    total = -(-pos // pad_multiple) * pad_multiple
    chunks.append(np.zeros(total - pos, dtype))
    flat = np.concatenate(chunks)
    assert total % parts == 0
    n = total // parts
    return [flat[i * n:(i + 1) * n] for i in range(parts)]


SPEC_SWIGLU_ZERO = """
dims hidden, ffn
mesh dp, tp
fc1.weight [2 * ffn, hidden] : view 0 as [2, ffn]; split 0.1 over tp
fc2.weight [hidden, ffn]     : split 1 over tp
norm.weight [hidden]         : replicate
state exp_avg : flat over dp pad to multiple_of(2 * dp)
"""


def test_swiglu_tp_local_then_zero_flat_over_dp():
    hidden, ffn = 6, 8
    rng = np.random.default_rng(4)
    model = ucl.load_spec(SPEC_SWIGLU_ZERO).bind(dims=dict(hidden=hidden, ffn=ffn), params={
        "fc1.weight": (2 * ffn, hidden), "fc2.weight": (hidden, ffn), "norm.weight": (hidden,)})
    uni = {f"{kind}/{n}": rand(rng, s) for kind in ("param", "exp_avg")
           for n, s in (("fc1.weight", (2 * ffn, hidden)), ("fc2.weight", (hidden, ffn)), ("norm.weight", (hidden,)))}

    def tp_local(kind, tp, r):
        return [swiglu_local(uni[f"{kind}/fc1.weight"], ffn, tp, r),
                chunk(uni[f"{kind}/fc2.weight"], tp, r, axis=1), uni[f"{kind}/norm.weight"]]

    def ref(axes):
        dp, tp = axes.get("dp", 1), axes.get("tp", 1)
        parts = {r: zero_partitions(tp_local("exp_avg", tp, r), dp, pad_multiple=2 * dp) for r in range(tp)}

        def fn(c):
            t, d = c.get("tp", 0), c.get("dp", 0)
            p = tp_local("param", tp, t)
            return {"param/fc1.weight": p[0], "param/fc2.weight": p[1], "param/norm.weight": p[2],
                    "exp_avg/@flat0": parts[t][d]}
        return per_rank(axes, fn)

    cases = [(a, ref(a)) for a in (dict(dp=4, tp=2), dict(dp=3, tp=4), dict(dp=2))]
    # dp=4, tp=2: 48 + 24 + 6 = 78 -> 80 elements, 20 per rank: fc1's [gate_r; up_r] straddles dp ranks
    assert cases[0][1][0]["exp_avg/@flat0"].shape == (20,)
    check_layouts(model, uni, cases)


SPEC_SWIGLU_ZERO3 = """
dims hidden, ffn
mesh dp, tp
fc1.weight [2 * ffn, hidden] : view 0 as [2, ffn]; split 0.1 over tp
fc2.weight [hidden, ffn]     : split 1 over tp
state exp_avg : flat over dp per_param
"""


def test_swiglu_tp_local_then_zero3_per_param():
    """DeepSpeed ZeRO-3: every (TP-local) parameter is flattened on its own, padded to a multiple of
    dp (partition size ceil(numel / dp)) and dp rank r holds the contiguous slice r."""
    hidden, ffn = 5, 6
    rng = np.random.default_rng(41)
    params = {"fc1.weight": (2 * ffn, hidden), "fc2.weight": (hidden, ffn)}
    model = ucl.load_spec(SPEC_SWIGLU_ZERO3).bind(dims=dict(hidden=hidden, ffn=ffn), params=params)
    uni = {f"{k}/{n}": rand(rng, s) for k in ("param", "exp_avg") for n, s in params.items()}

    def local(kind, name, tp, t):
        w = uni[f"{kind}/{name}"]
        return swiglu_local(w, ffn, tp, t) if name == "fc1.weight" else chunk(w, tp, t, axis=1)

    def ref(axes):
        dp, tp = axes.get("dp", 1), axes.get("tp", 1)

        def fn(c):
            t, d = c.get("tp", 0), c.get("dp", 0)
            out = {f"param/{n}": local("param", n, tp, t) for n in params}
            for n in params:
                out[f"exp_avg/{n}"] = zero_partitions([local("exp_avg", n, tp, t)], dp, pad_multiple=dp)[d]
            return out
        return per_rank(axes, fn)

    cases = [(a, ref(a)) for a in (dict(dp=4, tp=2), dict(dp=7, tp=3), dict(dp=2))]
    # dp=4, tp=2: fc1 is [6, 5] locally = 30 elements -> 32, 8 per rank; the last holds 6 + 2 padding
    assert cases[0][1][7]["exp_avg/fc1.weight"].shape == (8,) and not cases[0][1][7]["exp_avg/fc1.weight"][6:].any()
    check_layouts(model, uni, cases)


def test_swiglu_tp_local_then_fsdp2_over_dp():
    hidden, ffn = 3, 8
    rng = np.random.default_rng(42)
    spec = ucl.load_spec("""
dims hidden, ffn
mesh dp, tp
fc1.weight [2 * ffn, hidden] : view 0 as [2, ffn]; split 0.1 over tp; split 0 over dp uneven
""")
    model = spec.bind(dims=dict(hidden=hidden, ffn=ffn), params={"fc1.weight": (2 * ffn, hidden)})
    uni = {"param/fc1.weight": rand(rng, (2 * ffn, hidden))}

    def ref(axes):
        """torch FSDP2 fully_shard over a TP DTensor: torch.chunk(tp_local, dp, dim=0)[dp_rank];
        torch.chunk may return fewer than dp chunks, and the ranks past them hold empty shards."""
        dp, tp = axes.get("dp", 1), axes.get("tp", 1)

        def shard(c):
            local = torch.from_numpy(swiglu_local(uni["param/fc1.weight"], ffn, tp, c.get("tp", 0)))
            chunks = torch.chunk(local, dp, 0)
            i = c.get("dp", 0)
            return {"param/fc1.weight": (chunks[i] if i < len(chunks) else local[:0]).numpy()}
        return per_rank(axes, shard)

    check_layouts(model, uni, [(a, ref(a)) for a in (dict(dp=2, tp=2), dict(dp=3, tp=4), dict(tp=2))])


# =================================================================================================
# Vocab padding
# =================================================================================================
SPEC_VOCAB = """
dims vocab, hidden
mesh dp, tp
embed.weight   [vocab, hidden] : pad 0 to multiple_of(128 * tp); split 0 over tp
lm_head.weight [vocab, hidden] : pad 0 to multiple_of(128 * tp); split 0 over tp
state exp_avg, exp_avg_sq : follow
"""
KINDS3 = ("param", "exp_avg", "exp_avg_sq")


def megatron_padded_vocab(vocab, tp, divisible_by=128):
    """megatron.training.tokenizer._vocab_size_with_padding."""
    multiple = divisible_by * tp
    return -(-vocab // multiple) * multiple


def vocab_local(w, tp, r):
    """VocabParallelEmbedding: rank r holds rows [r*padded/tp, (r+1)*padded/tp) of the padded table;
    rows >= vocab are padding (zeros here)."""
    padded = megatron_padded_vocab(w.shape[0], tp)
    full = np.zeros((padded, *w.shape[1:]), w.dtype)
    full[:w.shape[0]] = w
    return chunk(full, tp, r)


@pytest.mark.parametrize("vocab", [1000, 1100])
def test_vocab_padding_changes_with_tp(vocab):
    hidden = 2
    rng = np.random.default_rng(5)
    model = ucl.load_spec(SPEC_VOCAB).bind(dims=dict(vocab=vocab, hidden=hidden), params={
        "embed.weight": (vocab, hidden), "lm_head.weight": (vocab, hidden)})
    uni = {f"{k}/{n}": rand(rng, (vocab, hidden)) for k in KINDS3 for n in ("embed.weight", "lm_head.weight")}

    def ref(axes):
        tp = axes.get("tp", 1)
        return per_rank(axes, lambda c: {k: vocab_local(v, tp, c.get("tp", 0)) for k, v in uni.items()})

    cases = [(a, ref(a)) for a in (dict(tp=2), dict(dp=2, tp=8), dict(tp=4))]
    tp2, tp8 = cases[0][1], cases[1][1]
    assert tp2[0]["param/embed.weight"].shape[0] * 2 == megatron_padded_vocab(vocab, 2)
    assert tp8[0]["param/embed.weight"].shape[0] * 8 == megatron_padded_vocab(vocab, 8)
    check_layouts(model, uni, cases)

    # Garbage in the source's padded rows (a trained, padded embedding) must not leak: the target
    # padding is zeros and the logical rows are exact, for the weights and the optimizer states.
    dirty = {r: {} for r in tp2}
    for r, shards in tp2.items():
        for k, v in shards.items():
            v = v.copy()
            lo = r * v.shape[0]
            pad_from = max(vocab - lo, 0)
            v[pad_from:] = 7.0
            dirty[r][k] = v
    assert any((v == 7.0).any() for s in dirty.values() for v in s.values())
    assert_shards_equal(run(model, Mesh(tp=2), Mesh(dp=2, tp=8), dirty), tp8, where="dirty tp2 -> tp8")
    assert_shards_equal(run(model, Mesh(tp=2), UNIVERSAL, dirty), {0: uni}, where="dirty tp2 -> universal")
    got = run(model, Mesh(tp=2), Mesh(tp=8), dirty)
    for r in range(8):
        for k, v in got[r].items():
            lo = r * v.shape[0]
            assert not v[max(vocab - lo, 0):].any(), f"padded rows of {k} on tp rank {r} are not zero"


SPEC_VOCAB_ZERO = """
dims vocab, hidden
mesh dp, tp
embed.weight [vocab, hidden] : pad 0 to multiple_of(128 * tp); split 0 over tp
norm.weight  [hidden]        : replicate
state exp_avg : flat over dp
"""


def test_vocab_padding_rows_in_zero_flat_optimizer_state():
    vocab, hidden = 1000, 2
    rng = np.random.default_rng(6)
    model = ucl.load_spec(SPEC_VOCAB_ZERO).bind(dims=dict(vocab=vocab, hidden=hidden), params={
        "embed.weight": (vocab, hidden), "norm.weight": (hidden,)})
    uni = {f"{k}/{n}": rand(rng, s) for k in ("param", "exp_avg")
           for n, s in (("embed.weight", (vocab, hidden)), ("norm.weight", (hidden,)))}

    def ref(axes):
        dp, tp = axes.get("dp", 1), axes.get("tp", 1)
        parts = {t: zero_partitions([vocab_local(uni["exp_avg/embed.weight"], tp, t), uni["exp_avg/norm.weight"]], dp)
                 for t in range(tp)}
        return per_rank(axes, lambda c: {
            "param/embed.weight": vocab_local(uni["param/embed.weight"], tp, c.get("tp", 0)),
            "param/norm.weight": uni["param/norm.weight"], "exp_avg/@flat0": parts[c.get("tp", 0)][c.get("dp", 0)]})

    cases = [(a, ref(a)) for a in (dict(dp=2, tp=2), dict(dp=2, tp=8), dict(dp=5, tp=1))]
    # dp=2,tp=2: the tp-local table has 512 rows, 488 real on tp rank 1; dp rank 1 of it holds the pad rows
    last = cases[0][1][3]["exp_avg/@flat0"]
    assert last.shape == (513,) and not last[2 * 488 - 513:2 * 512 - 513].any()
    check_layouts(model, uni, cases)


# =================================================================================================
# ZeRO flat partitions
# =================================================================================================
ZERO_KINDS = ("fp32", "exp_avg", "exp_avg_sq")


def _layer_sizes(count):
    return {f"layers.{i}.w": (3, i + 1) for i in range(count)}  # model order: numeric, distinct sizes


def test_zero_flat_order_straddle_and_dp_ge_10():
    """12 layers of distinct sizes, model order layers.0 .. layers.11 (sorting by name would give
    layers.0, layers.1, layers.10, layers.11, layers.2, ...); dp=12 gives 12 partitions."""
    count = 12
    params = _layer_sizes(count)
    spec = ucl.load_spec("""
mesh dp
layers.{i}.w : replicate
state fp32, exp_avg, exp_avg_sq : flat over dp pad to multiple_of(2 * dp)
""")
    model = spec.bind(dims={}, params=params)
    rng = np.random.default_rng(7)
    uni = {f"{k}/{n}": rand(rng, s) for k in ("param",) + ZERO_KINDS for n, s in params.items()}
    names = list(params)  # model order

    def ref(axes):
        dp = axes.get("dp", 1)
        parts = {k: zero_partitions([uni[f"{k}/{n}"] for n in names], dp, pad_multiple=2 * dp) for k in ZERO_KINDS}
        return per_rank(axes, lambda c: {**{f"param/{n}": uni[f"param/{n}"] for n in names},
                                         **{f"{k}/@flat0": parts[k][c.get("dp", 0)] for k in ZERO_KINDS}})

    cases = [(a, ref(a)) for a in (dict(dp=12), dict(dp=5), dict(dp=16))]
    r12 = cases[0][1]
    # total 3 * 78 = 234 -> 240 (multiple of 24), 20 per rank. layers.0 (3) .. layers.3 (12) fill
    # [0, 30): layers.3 straddles dp ranks 0 and 1.
    assert r12[0]["fp32/@flat0"].shape == (20,)
    l3 = uni["fp32/layers.3.w"].reshape(-1)
    assert np.array_equal(r12[0]["fp32/@flat0"][18:], l3[:2]) and np.array_equal(r12[1]["fp32/@flat0"][:10], l3[2:])
    # rank 2 holds partition 2 and rank 10 partition 10 (numeric, not lexicographic order)
    flat = np.concatenate([uni[f"fp32/{n}"].reshape(-1) for n in names])
    assert np.array_equal(r12[2]["fp32/@flat0"], flat[40:60])
    assert np.array_equal(r12[10]["fp32/@flat0"], flat[200:220])
    check_layouts(model, uni, cases)
    got = run(model, UNIVERSAL, Mesh(dp=12), {0: uni})
    for r in (2, 10):
        (key,) = [k for k in got[r] if re.fullmatch(r"fp32/@flat\d+", k)]
        assert np.array_equal(got[r][key], flat[20 * r:20 * (r + 1)])


def test_zero_flat_empty_partitions():
    """3 elements over dp=16: most partitions hold only padding (DeepSpeed pads to 2 * dp = 32)."""
    params = {"a": (1,), "b": (2,)}
    rng = np.random.default_rng(8)
    for pad, per in (("pad to multiple_of(dp)", 1), ("pad to multiple_of(2 * dp)", 2)):
        spec = ucl.load_spec(f"mesh dp\n** : replicate\nstate exp_avg : flat over dp {pad}\n")
        model = spec.bind(dims={}, params=params)
        uni = {f"{k}/{n}": rand(rng, s) for k in ("param", "exp_avg") for n, s in params.items()}

        def ref(axes, per=per):
            dp = axes.get("dp", 1)
            parts = zero_partitions([uni["exp_avg/a"], uni["exp_avg/b"]], dp, pad_multiple=per * dp)
            return per_rank(axes, lambda c: {"param/a": uni["param/a"], "param/b": uni["param/b"],
                                             "exp_avg/@flat0": parts[c.get("dp", 0)]})

        cases = [(a, ref(a)) for a in (dict(dp=16), dict(dp=2), dict(dp=3))]
        r16 = cases[0][1]
        assert all(r16[r]["exp_avg/@flat0"].shape == (per,) for r in range(16))
        assert not any(r16[r]["exp_avg/@flat0"].any() for r in range(3 // per + 1, 16))
        check_layouts(model, uni, cases)


def test_zero_flat_megatron_reverse_and_align():
    """Megatron distributed optimizer buffers: parameters in reverse order, each start aligned."""
    params = {"a": (3,), "b": (5, 1), "c": (2,)}
    spec = ucl.load_spec("mesh dp\n** : replicate\nstate exp_avg : flat over dp reverse align 4 pad to multiple_of(dp)\n")
    model = spec.bind(dims={}, params=params)
    rng = np.random.default_rng(9)
    uni = {f"{k}/{n}": rand(rng, s) for k in ("param", "exp_avg") for n, s in params.items()}

    def ref(axes):
        dp = axes.get("dp", 1)
        parts = zero_partitions([uni[f"exp_avg/{n}"] for n in params], dp, pad_multiple=dp, align=4, reverse=True)
        return per_rank(axes, lambda c: {**{f"param/{n}": uni[f"param/{n}"] for n in params},
                                         "exp_avg/@flat0": parts[c.get("dp", 0)]})

    cases = [(a, ref(a)) for a in (dict(dp=2), dict(dp=3), dict(dp=7))]
    # c at [0, 2), b at [4, 9), a at [12, 15) -> 15 elements
    assert cases[0][1][0]["exp_avg/@flat0"].shape == (8,)
    check_layouts(model, uni, cases)


SPEC_ZERO_PP = """
dims layers, n
mesh pp, dp
layers.{i}.** : index i of layers over pp
layers.{i}.a [n, 3] : replicate
layers.{i}.b [n]    : replicate
embed [5, n]        : on pp = first
head  [n]           : on pp = last
state exp_avg : flat over dp pad to multiple_of(2 * dp)
"""


def test_zero_flat_holds_only_the_stage_params_in_model_order():
    layers, n = 4, 3
    params = {"embed": (5, n)}
    for i in range(layers):
        params[f"layers.{i}.a"] = (n, 3)
        params[f"layers.{i}.b"] = (n,)
    params["head"] = (n,)
    model = ucl.load_spec(SPEC_ZERO_PP).bind(dims=dict(layers=layers, n=n), params=params)
    rng = np.random.default_rng(10)
    uni = {f"{k}/{p}": rand(rng, s) for k in ("param", "exp_avg") for p, s in params.items()}

    def stage_params(pp, s):
        per = layers // pp
        out = []
        for p in params:  # model order
            m = re.match(r"layers\.(\d+)\.", p)
            if m:
                if int(m.group(1)) // per == s:
                    out.append((p, re.sub(r"^layers\.\d+", f"layers.{int(m.group(1)) % per}", p)))
            elif (p == "embed" and s == 0) or (p == "head" and s == pp - 1):
                out.append((p, p))
        return out

    def ref(axes):
        pp, dp = axes.get("pp", 1), axes.get("dp", 1)
        parts = {s: zero_partitions([uni[f"exp_avg/{g}"] for g, _ in stage_params(pp, s)], dp, pad_multiple=2 * dp)
                 for s in range(pp)}
        return per_rank(axes, lambda c: {**{f"param/{loc}": uni[f"param/{g}"] for g, loc in stage_params(pp, c.get("pp", 0))},
                                         "exp_avg/@flat0": parts[c.get("pp", 0)][c.get("dp", 0)]})

    cases = [(a, ref(a)) for a in (dict(pp=2, dp=3), dict(pp=4, dp=2), dict(dp=5))]
    check_layouts(model, uni, cases)


def test_flat_group_numbering_per_kind_as_documented():
    """docs/language.md: the buffer of group G (statements numbered in order of appearance, *per
    kind*) is KIND/@flatG; its example (`state fp32, exp_avg, exp_avg_sq : ... flat over dp ...`)
    names the buffer `exp_avg/@flat0`."""
    spec = ucl.load_spec("mesh dp\n** : replicate\nstate fp32, exp_avg, exp_avg_sq : flat over dp\n")
    model = spec.bind(dims={}, params={"w": (4,)})
    plan = ucl.compile(model, UNIVERSAL, Mesh(dp=2))
    keys = {d["key"] for d in plan.datasets}
    assert {"fp32/@flat0", "exp_avg/@flat0", "exp_avg_sq/@flat0"} <= keys, sorted(keys)


# =================================================================================================
# Expert parallelism
# =================================================================================================
SPEC_EP = """
dims experts, hidden, ffn
mesh ep, dp, tp
experts.{e}.** : index e of experts over ep
experts.{e}.w1.weight [ffn, hidden] : split 0 over tp
experts.{e}.w2.weight [hidden, ffn] : split 1 over tp
router.weight [experts, hidden]     : replicate
state exp_avg : follow
"""


def test_ep_experts_renumbered_and_saved_once():
    E, hidden, ffn = 8, 4, 6
    params = {"router.weight": (E, hidden)}
    for e in range(E):
        params[f"experts.{e}.w1.weight"] = (ffn, hidden)
        params[f"experts.{e}.w2.weight"] = (hidden, ffn)
    model = ucl.load_spec(SPEC_EP).bind(dims=dict(experts=E, hidden=hidden, ffn=ffn), params=params)
    rng = np.random.default_rng(11)
    uni = {f"{k}/{p}": rand(rng, s) for k in ("param", "exp_avg") for p, s in params.items()}

    def ref(axes):
        """Megatron/DeepSpeed MoE: EP rank c owns experts [c*E/ep, (c+1)*E/ep) as local experts
        0..E/ep-1; within an expert, TP splits as a dense MLP."""
        ep, tp = axes.get("ep", 1), axes.get("tp", 1)

        def fn(c):
            out = {}
            for k in ("param", "exp_avg"):
                out[f"{k}/router.weight"] = uni[f"{k}/router.weight"]
                for j in range(E // ep):
                    e = c.get("ep", 0) * (E // ep) + j
                    out[f"{k}/experts.{j}.w1.weight"] = chunk(uni[f"{k}/experts.{e}.w1.weight"], tp, c.get("tp", 0), 0)
                    out[f"{k}/experts.{j}.w2.weight"] = chunk(uni[f"{k}/experts.{e}.w2.weight"], tp, c.get("tp", 0), 1)
            return out
        return per_rank(axes, fn)

    cases = [(a, ref(a)) for a in (dict(ep=4), dict(ep=2, dp=2, tp=2), dict(ep=8, tp=3))]
    # expert 5 of 8 on ep=4 is local expert 1 on ep rank 2
    got = run(model, UNIVERSAL, Mesh(ep=4), {0: uni})
    assert np.array_equal(got[2]["param/experts.1.w1.weight"], uni["param/experts.5.w1.weight"])
    # every expert exactly once over the EP ranks (no replicas without dp/tp), 2 local experts per rank
    w1 = [v for r in got for k, v in got[r].items() if re.fullmatch(r"param/experts\.\d+\.w1\.weight", k)]
    assert len(w1) == E and sorted(k for k in got[3] if k.startswith("param/experts.")) == [
        "param/experts.0.w1.weight", "param/experts.0.w2.weight", "param/experts.1.w1.weight", "param/experts.1.w2.weight"]
    for e in range(E):
        assert sum(np.array_equal(v, uni[f"param/experts.{e}.w1.weight"]) for v in w1) == 1
    check_layouts(model, uni, cases)
    # gather writes every expert once, under its global number; each element is read once
    plan = ucl.compile(model, Mesh(ep=2, dp=2, tp=2), UNIVERSAL)
    gathered = ucl.execute_memory(plan, cases[1][1])[0]
    assert sorted(gathered) == sorted(uni)
    for i, t in enumerate(plan.tensors):
        sel = plan.copies["tensor"] == i
        assert int(np.prod(plan.copies["size"][sel], axis=1).sum()) == int(np.prod(t["shape"])), t


SPEC_EP_STACKED = """
dims experts, hidden, ffn
mesh ep, tp
moe.w1 [experts, ffn, hidden] : split 0 over ep; split 1 over tp
moe.w2 [experts, hidden, ffn] : split 0 over ep; split 2 over tp
state exp_avg : follow
"""


def test_ep_stacked_experts_split_dim0():
    E, hidden, ffn = 8, 4, 6
    params = {"moe.w1": (E, ffn, hidden), "moe.w2": (E, hidden, ffn)}
    model = ucl.load_spec(SPEC_EP_STACKED).bind(dims=dict(experts=E, hidden=hidden, ffn=ffn), params=params)
    rng = np.random.default_rng(12)
    uni = {f"{k}/{p}": rand(rng, s) for k in ("param", "exp_avg") for p, s in params.items()}

    def ref(axes):
        """Megatron TEGroupedMLP / HF fused experts: [experts, ...] with EP rank c holding experts
        [c*E/ep, (c+1)*E/ep) stacked in order."""
        ep, tp = axes.get("ep", 1), axes.get("tp", 1)
        return per_rank(axes, lambda c: {
            **{f"{k}/moe.w1": chunk(chunk(uni[f"{k}/moe.w1"], ep, c.get("ep", 0), 0), tp, c.get("tp", 0), 1)
               for k in ("param", "exp_avg")},
            **{f"{k}/moe.w2": chunk(chunk(uni[f"{k}/moe.w2"], ep, c.get("ep", 0), 0), tp, c.get("tp", 0), 2)
               for k in ("param", "exp_avg")}})

    cases = [(a, ref(a)) for a in (dict(ep=4, tp=2), dict(ep=8), dict(ep=2, tp=3))]
    check_layouts(model, uni, cases)


# =================================================================================================
# Pipeline parallelism
# =================================================================================================
def _pp_params(layers, hidden):
    params = {"embed.weight": (hidden, hidden)}
    for i in range(layers):
        params[f"layers.{i}.attn.weight"] = (hidden, hidden)
        params[f"layers.{i}.norm.weight"] = (hidden,)
    params["final_norm.weight"] = (hidden,)
    return params


def _pp_ref(uni, params, axes, stage_of, kinds=("param",)):
    """``stage_of(i) -> (stage, local index)``; Megatron stores a stage's layers under local numbers."""
    tp, pp = axes.get("tp", 1), axes.get("pp", 1)

    def fn(c):
        s, t = c.get("pp", 0), c.get("tp", 0)
        out = {}
        for k in kinds:
            for p in params:
                m = re.match(r"layers\.(\d+)\.(.*)", p)
                if m:
                    stage, local = stage_of(int(m.group(1)))
                    if stage != s:
                        continue
                    name = f"layers.{local}.{m.group(2)}"
                elif p == "embed.weight":
                    if s != 0:
                        continue
                    name = p
                else:
                    if s != pp - 1:
                        continue
                    name = p
                v = uni[f"{k}/{p}"]
                out[f"{k}/{name}"] = chunk(v, tp, t) if p.endswith(("attn.weight", "embed.weight")) else v
        return out
    return per_rank(axes, fn)


SPEC_PP = """
dims layers, hidden
mesh pp, tp
layers.{i}.** : index i of layers over pp{option}
layers.{i}.attn.weight [hidden, hidden] : split 0 over tp
layers.{i}.norm.weight [hidden]         : replicate
embed.weight [hidden, hidden]           : split 0 over tp; on pp = first
final_norm.weight [hidden]              : on pp = last
state exp_avg : follow
"""


def test_pp_local_layer_renumbering():
    L, hidden = 8, 4
    params = _pp_params(L, hidden)
    model = ucl.load_spec(SPEC_PP.replace("{option}", "")).bind(dims=dict(layers=L, hidden=hidden), params=params)
    rng = np.random.default_rng(13)
    uni = {f"{k}/{p}": rand(rng, s) for k in ("param", "exp_avg") for p, s in params.items()}

    def ref(axes):
        per = L // axes.get("pp", 1)  # Megatron: stage s holds layers [s*L/pp, (s+1)*L/pp)
        return _pp_ref(uni, params, axes, lambda i: (i // per, i % per), ("param", "exp_avg"))

    cases = [(a, ref(a)) for a in (dict(pp=4), dict(pp=2, tp=2), dict(tp=2))]
    # layers.5 on stage 2 of 4 stages with 8 layers is stored as layers.1
    assert np.array_equal(cases[0][1][2]["param/layers.1.attn.weight"], uni["param/layers.5.attn.weight"])
    check_layouts(model, uni, cases)


def test_pp_interleaved_virtual_stages():
    L, hidden, vpp = 8, 4, 2
    params = _pp_params(L, hidden)
    model = ucl.load_spec(SPEC_PP.replace("{option}", f" virtual {vpp}")).bind(
        dims=dict(layers=L, hidden=hidden), params=params)
    rng = np.random.default_rng(14)
    uni = {f"{k}/{p}": rand(rng, s) for k in ("param", "exp_avg") for p, s in params.items()}

    def ref(axes):
        """Megatron get_transformer_layer_offset with vpp: model chunk v of pipeline rank p holds the
        layers starting at v * (L / vpp) + p * (L / (pp * vpp)); ucl numbers them on the rank as
        v * (L / (pp * vpp)) + offset (Megatron's model{v} chunks concatenated)."""
        pp = axes.get("pp", 1)
        per = L // (pp * vpp)
        table = {}
        for p in range(pp):
            for v in range(vpp):
                first = v * (L // vpp) + p * per
                for j in range(per):
                    table[first + j] = (p, v * per + j)
        assert sorted(table) == list(range(L))
        return _pp_ref(uni, params, axes, table.__getitem__, ("param", "exp_avg"))

    cases = [(a, ref(a)) for a in (dict(pp=2), dict(pp=4, tp=2), dict(tp=1))]
    # pp=2, vpp=2: stage 0 holds layers 0, 1 (chunk 0) and 4, 5 (chunk 2) as local 0..3
    s0 = cases[0][1][0]
    assert np.array_equal(s0["param/layers.2.norm.weight"], uni["param/layers.4.norm.weight"])
    check_layouts(model, uni, cases)


def test_pp_uneven_first_last_stages():
    L, hidden = 16, 4
    sizes = [3, 5, 5, 3]
    params = _pp_params(L, hidden)
    model = ucl.load_spec(SPEC_PP.replace("{option}", f" sizes [{', '.join(map(str, sizes))}]")).bind(
        dims=dict(layers=L, hidden=hidden), params=params)
    rng = np.random.default_rng(15)
    uni = {f"{k}/{p}": rand(rng, s) for k in ("param", "exp_avg") for p, s in params.items()}

    def ref(axes):
        # Megatron --decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers
        if axes.get("pp", 1) == 1:
            return _pp_ref(uni, params, axes, lambda i: (0, i), ("param", "exp_avg"))
        bounds = np.cumsum([0] + sizes)
        return _pp_ref(uni, params, axes,
                       lambda i: next((s, i - bounds[s]) for s in range(len(sizes)) if bounds[s] <= i < bounds[s + 1]),
                       ("param", "exp_avg"))

    cases = [(a, ref(a)) for a in (dict(pp=4), dict(pp=4, tp=2), dict(tp=2), dict(pp=1))]
    assert sorted(k for k in cases[0][1][0] if k.startswith("param/layers.") and k.endswith("norm.weight")) == [
        f"param/layers.{j}.norm.weight" for j in range(3)]
    check_layouts(model, uni, cases)


def test_pp_megatron_first_last_pipeline_num_layers():
    """`index i of layers over pp first 3 last 3`: Megatron --decoder-first-pipeline-num-layers 3
    --decoder-last-pipeline-num-layers 3; the middle stages share the rest evenly
    (get_transformer_layer_offset)."""
    L, hidden, F, Lst = 16, 4, 3, 3
    params = _pp_params(L, hidden)
    model = ucl.load_spec(SPEC_PP.replace("{option}", f" first {F} last {Lst}")).bind(
        dims=dict(layers=L, hidden=hidden), params=params)
    rng = np.random.default_rng(43)
    uni = {f"{k}/{p}": rand(rng, s) for k in ("param", "exp_avg") for p, s in params.items()}

    def ref(axes):
        pp = axes["pp"]
        per_middle = (L - F - Lst) // (pp - 2)
        offsets = [0] + [F + (p - 1) * per_middle for p in range(1, pp)] + [L]
        assert offsets[-2] == L - Lst
        return _pp_ref(uni, params, axes,
                       lambda i: next((p, i - offsets[p]) for p in range(pp) if offsets[p] <= i < offsets[p + 1]),
                       ("param", "exp_avg"))

    cases = [(a, ref(a)) for a in (dict(pp=4), dict(pp=3, tp=2), dict(pp=7))]
    # pp=4: stages hold 3, 5, 5, 3 layers; pp=3: 3, 10, 3; pp=7: 3, 2, 2, 2, 2, 2, 3
    assert [sum(k.startswith("param/layers.") and k.endswith(".norm.weight") for k in cases[0][1][s])
            for s in range(4)] == [3, 5, 5, 3]
    check_layouts(model, uni, cases)


SPEC_TIED = """
dims vocab, hidden, layers
mesh pp, tp
layers.{i}.** : index i of layers over pp
layers.{i}.w [hidden] : replicate
embed.weight [vocab, hidden] : split 0 over tp; on pp = first, last
state exp_avg : follow
"""


def test_pp_tied_embedding_first_and_last_stage():
    V, hidden, L = 8, 3, 4
    params = {"embed.weight": (V, hidden), **{f"layers.{i}.w": (hidden,) for i in range(L)}}
    model = ucl.load_spec(SPEC_TIED).bind(dims=dict(vocab=V, hidden=hidden, layers=L), params=params)
    rng = np.random.default_rng(16)
    uni = {f"{k}/{p}": rand(rng, s) for k in ("param", "exp_avg") for p, s in params.items()}

    def ref(axes):
        """Megatron share_embeddings_and_output_weights: the word embedding lives on the first stage
        and an identical copy as the output layer on the last stage (one copy when pp == 1)."""
        pp, tp = axes.get("pp", 1), axes.get("tp", 1)
        per = L // pp

        def fn(c):
            s, out = c.get("pp", 0), {}
            for k in ("param", "exp_avg"):
                if s in (0, pp - 1):
                    out[f"{k}/embed.weight"] = chunk(uni[f"{k}/embed.weight"], tp, c.get("tp", 0))
                for i in range(s * per, (s + 1) * per):
                    out[f"{k}/layers.{i - s * per}.w"] = uni[f"{k}/layers.{i}.w"]
            return out
        return per_rank(axes, fn)

    cases = [(a, ref(a)) for a in (dict(pp=4, tp=2), dict(pp=2), dict(tp=4))]
    r = cases[0][1]
    assert "param/embed.weight" in r[0] and "param/embed.weight" in r[7] and "param/embed.weight" not in r[3]
    check_layouts(model, uni, cases)
    # gather reads one replica: every element of the embedding is read exactly once
    plan = ucl.compile(model, Mesh(pp=4, tp=2), UNIVERSAL)
    i = next(i for i, t in enumerate(plan.tensors) if t["name"] == "embed.weight" and t["kind"] == "param")
    sel = plan.copies["tensor"] == i
    assert int(np.prod(plan.copies["size"][sel], axis=1).sum()) == V * hidden
    assert len({int(x) // 2 for x in plan.copies["src_rank"][sel]}) == 1  # one pipeline stage


# =================================================================================================
# dtypes, step scalars, frozen parameters and buffers
# =================================================================================================
SPEC_DTYPES = """
dims n
mesh dp, tp
w_bf16 [n, 4] : split 0 over tp
w_fp16 [n, 4] : split 0 over tp
w_fp32 [n, 4] : split 1 over tp
w_fp8  [n, 4] : split 0 over tp
state param for w_bf16 : dtype bfloat16
state param for w_fp16 : dtype float16
state param for w_fp8  : dtype float8_e4m3fn
state exp_avg : dtype float32
state step : scalar; dtype int64
"""


def _torch_bits(t: torch.Tensor) -> np.ndarray:
    """bf16 / fp8 have no numpy dtype: store the raw bits (uint16 / uint8)."""
    raw = {torch.bfloat16: torch.int16, torch.float8_e4m3fn: torch.uint8}[t.dtype]
    return t.contiguous().view(raw).numpy().view(np.uint16 if raw == torch.int16 else np.uint8)


def test_dtypes_bitexact_reshard():
    n = 8
    g = torch.Generator().manual_seed(17)
    bf = torch.randn(n, 4, generator=g).to(torch.bfloat16)
    bf.view(-1)[:6] = torch.tensor([float("inf"), float("-inf"), float("nan"), -0.0, 1e-40, -3.0e38]).to(torch.bfloat16)
    bf_bits = _torch_bits(bf)
    bf_bits.reshape(-1)[6] = 0x7FC1  # a NaN with payload
    bf_bits.reshape(-1)[7] = 0xFF81  # negative signalling NaN
    fp8 = (torch.randn(n, 4, generator=g) * 50).to(torch.float8_e4m3fn)
    fp8.view(-1)[:2] = torch.tensor([float("nan"), -0.0]).to(torch.float8_e4m3fn)
    fp8_bits = _torch_bits(fp8)
    fp16 = torch.randn(n, 4, generator=g).to(torch.float16).numpy()
    fp16.reshape(-1)[:3] = [np.inf, -0.0, np.float16(6e-8)]
    fp32 = torch.randn(n, 4, generator=g).numpy()
    fp32.reshape(-1)[0] = np.frombuffer(np.uint32(0x7FA00001).tobytes(), np.float32)[0]  # NaN payload
    model = ucl.load_spec(SPEC_DTYPES).bind(dims=dict(n=n), params={
        "w_bf16": (n, 4), "w_fp16": (n, 4), "w_fp32": (n, 4), "w_fp8": (n, 4)})
    rng = np.random.default_rng(18)
    uni = {"param/w_bf16": bf_bits, "param/w_fp16": fp16, "param/w_fp32": fp32, "param/w_fp8": fp8_bits}
    for i, p in enumerate(("w_bf16", "w_fp16", "w_fp32", "w_fp8")):
        uni[f"exp_avg/{p}"] = rand(rng, (n, 4))
        uni[f"step/{p}"] = np.array(100 + i, dtype=np.int64)

    def ref(axes):
        tp = axes.get("tp", 1)

        def fn(c):
            r = c.get("tp", 0)
            out = {  # torch.chunk on the real-dtype tensors, then raw bits: an independent path
                "param/w_bf16": _torch_bits(torch.chunk(torch.from_numpy(bf_bits.view(np.int16)).view(torch.bfloat16), tp, 0)[r]),
                "param/w_fp8": _torch_bits(torch.chunk(torch.from_numpy(fp8_bits).view(torch.float8_e4m3fn), tp, 0)[r]),
                "param/w_fp16": torch.chunk(torch.from_numpy(fp16), tp, 0)[r].numpy(),
                "param/w_fp32": torch.chunk(torch.from_numpy(fp32), tp, 1)[r].contiguous().numpy(),
            }
            for i, p in enumerate(("w_bf16", "w_fp16", "w_fp32", "w_fp8")):
                out[f"exp_avg/{p}"] = torch.chunk(torch.from_numpy(uni[f"exp_avg/{p}"]), tp, 1 if p == "w_fp32" else 0)[r].contiguous().numpy()
                out[f"step/{p}"] = np.array(100 + i, dtype=np.int64)
            return out
        return per_rank(axes, fn)

    cases = [(a, ref(a)) for a in (dict(tp=2), dict(dp=2, tp=4), dict(dp=3))]
    check_layouts(model, uni, cases)
    got = run(model, Mesh(tp=2), Mesh(dp=2, tp=4), cases[0][1])
    back = torch.cat([torch.from_numpy(got[r]["param/w_bf16"].view(np.int16)).view(torch.bfloat16) for r in range(4)])
    assert back.dtype == torch.bfloat16 and torch.equal(back.view(torch.int16), torch.from_numpy(bf_bits.view(np.int16)))
    assert np.array_equal(np.concatenate([got[r]["param/w_bf16"] for r in range(4)]), bf_bits)
    assert got[0]["param/w_bf16"].dtype == np.uint16 and got[0]["param/w_fp8"].dtype == np.uint8


SPEC_BF16_FLAT = """
mesh dp, tp
a : split 0 over tp
b : replicate
state param : dtype bfloat16
state fp32, exp_avg : dtype float32; follow
state grad : dtype bfloat16; flat over dp pad to multiple_of(dp)
"""


def test_bf16_flat_buffer_bitexact():
    params = {"a": (4, 3), "b": (5,)}
    model = ucl.load_spec(SPEC_BF16_FLAT).bind(dims={}, params=params)
    rng = np.random.default_rng(19)
    uni = {}
    for p, s in params.items():
        uni[f"param/{p}"] = rng.integers(0, 1 << 16, size=s, dtype=np.uint16)  # every bf16 bit pattern
        uni[f"grad/{p}"] = rng.integers(1, 1 << 16, size=s, dtype=np.uint16)
        uni[f"fp32/{p}"] = rand(rng, s)
        uni[f"exp_avg/{p}"] = rand(rng, s)

    def ref(axes):
        dp, tp = axes.get("dp", 1), axes.get("tp", 1)
        parts = {t: zero_partitions([chunk(uni["grad/a"], tp, t), uni["grad/b"]], dp, pad_multiple=dp) for t in range(tp)}

        def fn(c):
            t = c.get("tp", 0)
            out = {f"{k}/a": chunk(uni[f"{k}/a"], tp, t) for k in ("param", "fp32", "exp_avg")}
            out.update({f"{k}/b": uni[f"{k}/b"] for k in ("param", "fp32", "exp_avg")})
            out["grad/@flat0"] = parts[t][c.get("dp", 0)]
            return out
        return per_rank(axes, fn)

    cases = [(a, ref(a)) for a in (dict(dp=2, tp=2), dict(dp=3, tp=4), dict(dp=11))]
    check_layouts(model, uni, cases)


SPEC_FROZEN = """
dims n, layers
mesh pp, dp, tp
layers.{i}.** : index i of layers over pp
layers.{i}.w [n, n]           : split 0 over tp
layers.{i}.adapter [n, 2]     : split 0 over tp
layers.{i}.norm.running_mean [n] : replicate
rotary.inv_freq [2] : replicate
ignore rope.cache
state exp_avg, exp_avg_sq : follow
state step : scalar
"""


def test_frozen_params_and_buffers_have_no_optimizer_state():
    n, L = 4, 2
    params = {}
    for i in range(L):
        params[f"layers.{i}.w"] = (n, n)
        params[f"layers.{i}.adapter"] = (n, 2)
        params[f"layers.{i}.norm.running_mean"] = (n,)
    params["rotary.inv_freq"] = (2,)
    params["rope.cache"] = (3, 3)  # non-persistent: ignored
    # LoRA-style: the base weights are frozen; buffers are passed as frozen too
    frozen = [f"layers.{i}.w" for i in range(L)] + [f"layers.{i}.norm.running_mean" for i in range(L)] + ["rotary.inv_freq"]
    model = ucl.load_spec(SPEC_FROZEN).bind(dims=dict(n=n, layers=L), params=params, frozen=frozen)
    rng = np.random.default_rng(20)
    uni = {}
    for p, s in params.items():
        if p == "rope.cache":
            continue
        uni[f"param/{p}"] = rand(rng, s)
        if p not in frozen:
            uni[f"exp_avg/{p}"] = rand(rng, s)
            uni[f"exp_avg_sq/{p}"] = rand(rng, s)
            uni[f"step/{p}"] = np.array(float(len(uni)), dtype=np.float32)
    assert {t["kind"] for t in ucl.compile(model, UNIVERSAL, UNIVERSAL).tensors if t["name"] in frozen} == {"param"}

    def ref(axes):
        pp, tp = axes.get("pp", 1), axes.get("tp", 1)
        per = L // pp

        def fn(c):
            s, t, out = c.get("pp", 0), c.get("tp", 0), {}
            for key, v in uni.items():
                kind, name = key.split("/", 1)
                m = re.match(r"layers\.(\d+)\.(.*)", name)
                if m:
                    i = int(m.group(1))
                    if i // per != s:
                        continue
                    name = f"layers.{i % per}.{m.group(2)}"
                    if m.group(2) in ("w", "adapter") and kind != "step":
                        v = chunk(v, tp, t)
                out[f"{kind}/{name}"] = v
            return out
        return per_rank(axes, fn)

    cases = [(a, ref(a)) for a in (dict(pp=2, dp=2, tp=2), dict(tp=4), dict(pp=2))]
    assert "exp_avg/layers.0.w" not in cases[0][1][0] and "step/layers.0.adapter" in cases[0][1][0]
    check_layouts(model, uni, cases)
