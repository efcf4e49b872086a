"""The standard library of specs (stdlib_patterns/*.ucl), verified against real models.

What is checked, and against what (never against ucl itself):

* every Hugging Face spec matches every ``named_parameters()`` name + persistent buffer of the real
  transformers model (tests/hf_models.py, tiny seeded configs) exactly once with the right shape,
  with dims read by ``Spec.dims_from_config(config.to_dict())``;
* its tensor-parallel splits agree with the plan transformers itself declares
  (``model._tp_plan``: ``base_model_tp_plan`` + embedding/lm_head), mapped to dims as
  transformers' ``distributed/tensor_parallel.py`` does (see ``HF_STYLE``), and the per-rank
  values equal ``torch.chunk`` of the global tensor (DTensor ``Shard`` semantics);
* a layout oracle independent of ucl: real ``torch.distributed.tensor.distribute_tensor`` on a
  4-process gloo ``DeviceMesh`` (dp=2, tp=2) and (ep=2, tp=2), FSDP2-on-TP as two DTensor steps;
* hand-written Megatron conventions (DESIGN.md section 5) for megatron_gpt and
  megatron_legacy_gpt: fused QKV per query group / per head, SwiGLU [gate_r; up_r], vocab padding
  to 128 * tp, local layer numbers incl. virtual stages, EP renumbering, distributed optimizer;
* bit-exact round trips through three meshes and the universal layout for every spec, with Adam
  states (exp_avg, exp_avg_sq: distinct random values) and step scalars;
* ucl.formats.hf: read_tensor_names, check_against (saved per-expert MoE names), draft_spec_from_hf.
"""
from __future__ import annotations

import itertools
import json
import os
import re

import numpy as np
import pytest
import torch

import hf_models as H
import ucl
from spawned import free_port  # noqa: E402
from ucl import UNIVERSAL, Mesh
from ucl.formats import hf as uhf

# round trips on meshes wider than some models' kv_heads: the warning is expected
# (tests/test_mesh_diagnostics.py checks it)
pytestmark = pytest.mark.filterwarnings("ignore::ucl.layout.fit.MeshFitWarning")

HF_SPEC = {"llama": "llama", "llama_tied": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3",
           "gemma": "gemma", "phi3": "phi3", "gpt2": "gpt2", "mixtral": "mixtral", "qwen2_moe": "qwen2_moe",
           "qwen3_moe": "qwen3_moe", "deepseek_v3": "deepseek_v3"}
STDLIB = sorted(set(HF_SPEC.values()) | {"megatron_gpt", "megatron_legacy_gpt"})


# ---- helpers ------------------------------------------------------------------------------------
_MODELS: dict = {}


def real(arch):
    """(model, {name: shape} of named_parameters() + persistent buffers in model order, buffers)."""
    if arch not in _MODELS:
        m = H.build(arch)
        sd = m.state_dict()
        params = {n: tuple(p.shape) for n, p in m.named_parameters()}
        bufs = [n for n, _ in m.named_buffers() if n in sd]
        params.update({n: tuple(sd[n].shape) for n in bufs})
        _MODELS[arch] = (m, params, bufs)
    return _MODELS[arch]


def bound(arch):
    m, params, bufs = real(arch)
    spec = ucl.load_spec("stdlib:" + HF_SPEC[arch])
    dims = spec.dims_from_config(H.config(arch).to_dict())
    return spec.bind(dims, params, frozen=bufs)


def global_values(arch, seed=0):
    """Universal shards: real weights, distinct random Adam moments, step scalars."""
    m, params, bufs = real(arch)
    sd = m.state_dict()
    rng = np.random.default_rng(seed)
    uni = {}
    for n, shape in params.items():
        uni[f"param/{n}"] = sd[n].detach().numpy().copy()
        if n in bufs:
            continue
        uni[f"exp_avg/{n}"] = rng.standard_normal(shape).astype(np.float32)
        uni[f"exp_avg_sq/{n}"] = rng.random(shape).astype(np.float32) + 1
        uni[f"step/{n}"] = np.array(rng.integers(1, 1000), dtype=np.float32)
    return uni


def run(model, src, dst, shards):
    return ucl.execute_memory(ucl.compile(model, src, dst), shards)


def assert_same(got, want, where=""):
    assert sorted(got) == sorted(want), f"{where}: ranks {sorted(got)} != {sorted(want)}"
    for r in want:
        assert sorted(got[r]) == sorted(want[r]), f"{where}: rank {r}: {sorted(set(got[r]) ^ set(want[r]))}"
        for k, w in want[r].items():
            g = np.asarray(got[r][k])
            w = np.asarray(w)
            assert g.dtype == w.dtype and g.shape == w.shape, f"{where}: rank {r} {k}: {g.dtype}{g.shape} != {w.dtype}{w.shape}"
            assert g.tobytes() == w.tobytes(), f"{where}: rank {r} {k} differs"


def chunk(x, parts, idx, dim=0):
    """torch.chunk semantics (DTensor Shard / FSDP2): ceil-sized pieces, trailing ones short or empty."""
    n = x.shape[dim]
    c = -(-n // parts)
    return np.take(x, np.arange(min(idx * c, n), min((idx + 1) * c, n)), axis=dim)


# ---- 1. every spec loads, documents itself ---------------------------------------------------------
@pytest.mark.parametrize("name", STDLIB)
def test_stdlib_spec_loads_and_has_header(name):
    spec = ucl.load_spec(f"stdlib:{name}")
    head = spec.text.split("\ndims", 1)[0]
    assert head.startswith(f"# stdlib:{name} -- "), head[:80]
    for word in ("Framework", "dims", "ptimizer"):
        assert word in head, f"{name}: header lacks {word!r}"
    for dim in spec.dims:  # every dim's config field is documented in the header
        assert re.search(rf"\b{dim}\b", head), f"{name}: dim {dim} undocumented"


# ---- 2. HF specs match the real model exactly ---------------------------------------------------------
@pytest.mark.parametrize("arch", H.ARCHS)
def test_hf_spec_matches_real_model(arch):
    m, params, bufs = real(arch)
    model = bound(arch)  # raises BindError on unmatched / doubly matched / mis-shaped
    assert set(model.params) == set(params)
    tied = H.tied(m)
    assert ("lm_head.weight" in params) == (not tied)
    # frozen buffers have no optimizer state; everything else has exp_avg, exp_avg_sq and a step
    kinds = {}
    for t in model.tensors:
        kinds.setdefault(t.name, set()).add(t.kind)
    for n in params:
        assert kinds[n] == ({"param"} if n in bufs else {"param", "exp_avg", "exp_avg_sq", "step"}), n
    # every rule the model needs is used; the others say `optional` (a misspelt pattern would show here)
    assert [d.render(model.spec.text, model.spec.filename) for d in model.unmatched()] == []


# ---- 3. TP splits agree with transformers' own plan --------------------------------------------------
# transformers' styles -> the split of a parameter (distributed/tensor_parallel.py):
#   colwise, colwise_gather_output, embedding_rowwise: weight Shard(ndim - 2), bias Shard(0)
#   rowwise, rowwise_split_input: weight Shard(-1), bias replicated
#   packed_colwise: weight _StridedShard(ndim - 2, split_factor=2) = each half chunked: [gate_r; up_r]
#   replicated_with_grad_allreduce, moe_tp_experts (module-level) and params the plan does not name:
#   replicated
HF_STYLE = {"colwise": "col", "colwise_gather_output": "col", "embedding_rowwise": "col",
            "rowwise": "row", "rowwise_split_input": "row", "packed_colwise": "packed"}
# GPT-2 declares no plan; the stdlib spec uses the Megatron-style plan written for Conv1D [in, out]
# weights: column-parallel = split dim 1 (fused c_attn per q/k/v part), row-parallel = split dim 0.
GPT2_PLAN = {"transformer.wte": "col", "transformer.h.*.attn.c_attn": "qkv_conv1d",
             "transformer.h.*.attn.c_proj": "row_conv1d", "transformer.h.*.mlp.c_fc": "col_conv1d",
             "transformer.h.*.mlp.c_proj": "row_conv1d"}


# Where transformers' plan says nothing, a stdlib spec follows Megatron-core (the layout a TP runtime
# uses): DeepSeek's MLA splits its up-projections by head and its output by row, the low-rank
# down-projections (q_a_proj, kv_a_proj_with_mqa) and their norms stay whole.
MLA_PLAN = {"model.layers.*.self_attn.q_proj": "colwise", "model.layers.*.self_attn.q_b_proj": "colwise",
            "model.layers.*.self_attn.kv_b_proj": "colwise", "model.layers.*.self_attn.o_proj": "rowwise"}
PLAN_ADDITIONS = {"deepseek_v3": MLA_PLAN}


def plan_of(arch, m):
    """The plan a stdlib spec follows: transformers' ``_tp_plan`` plus PLAN_ADDITIONS (gpt2: GPT2_PLAN)."""
    return GPT2_PLAN if arch == "gpt2" else {**m._tp_plan, **PLAN_ADDITIONS.get(arch, {})}


def hf_style(name, plan):
    """transformers' lookup: layer numbers -> '*', then the parameter's key or its module's key."""
    g = re.sub(r"\.\d+(?=\.|$)", ".*", name)
    if g in plan:
        return plan[g]
    return plan.get(g.rsplit(".", 1)[0])


def expected_tp_local(arch, name, x, tp, r, cfg):
    """The TP-local tensor of rank r, from transformers' plan (gpt2: GPT2_PLAN), with torch.chunk."""
    m = real(arch)[0]
    leaf = name.rsplit(".", 1)[-1]
    if arch == "gpt2":
        style = hf_style(name, GPT2_PLAN)
        if style == "col":
            return chunk(x, tp, r, 0)
        if style == "col_conv1d":
            return chunk(x, tp, r, x.ndim - 1)
        if style == "row_conv1d":
            return chunk(x, tp, r, 0) if leaf == "weight" else x
        if style == "qkv_conv1d":
            parts = np.split(x, 3, axis=x.ndim - 1)
            return np.concatenate([chunk(p, tp, r, x.ndim - 1) for p in parts], axis=x.ndim - 1)
        return x
    style = HF_STYLE.get(hf_style(name, plan_of(arch, m)))
    if arch == "phi3" and "qkv_proj" in name:
        # transformers: colwise_gather_output = dim 0. The spec splits it per part and per head
        # (vLLM/Megatron convention; see stdlib_patterns/phi3.ucl): [Q_r; K_r; V_r].
        assert style == "col"
        hd = cfg.hidden_size // cfg.num_attention_heads
        q, k, v = np.split(x, [cfg.num_attention_heads * hd, (cfg.num_attention_heads + cfg.num_key_value_heads) * hd])
        return np.concatenate([chunk(q, tp, r), chunk(k, tp, r), chunk(v, tp, r)])
    if arch == "phi3" and "gate_up_proj" in name:
        assert style == "col"  # colwise_gather_output: same dim; the spec keeps gate/up aligned
        style = "packed"
    if style is None:
        return x
    if style == "col":
        return chunk(x, tp, r, x.ndim - 2 if leaf != "bias" and x.ndim > 1 else 0)
    if style == "row":
        return chunk(x, tp, r, x.ndim - 1) if leaf != "bias" else x
    if style == "packed":
        d = x.ndim - 2
        a, b = np.split(x, 2, axis=d)
        return np.concatenate([chunk(a, tp, r, d), chunk(b, tp, r, d)], axis=d)
    raise AssertionError(style)


@pytest.mark.parametrize("arch", H.ARCHS)
def test_tp_splits_agree_with_hf_plan(arch):
    model = bound(arch)
    m, params, bufs = real(arch)
    cfg = H.config(arch)
    uni = {f"param/{n}": np.arange(int(np.prod(s)), dtype=np.float32).reshape(s) for n, s in params.items()}
    tp = 2
    states = {f"{kind}/{n}": uni[f"param/{n}"] for n in params if n not in bufs for kind in ("exp_avg", "exp_avg_sq")}
    steps = {f"step/{n}": np.array(1, np.float32) for n in params if n not in bufs}
    got = run(model, UNIVERSAL, Mesh(tp=tp), {0: {**uni, **states, **steps}})
    split_dims = {}
    for n, s in params.items():
        x = uni[f"param/{n}"]
        for r in range(tp):
            want = expected_tp_local(arch, n, x, tp, r, cfg)
            g = got[r][f"param/{n}"]
            assert g.shape == want.shape and np.array_equal(g, want), f"{arch} {n} rank {r}: {g.shape} vs {want.shape}"
        split_dims[n] = [d for d in range(len(s)) if got[0][f"param/{n}"].shape[d] != s[d]]
    # the dims actually split are exactly the plan's (a summary that reads like the plan)
    plan = plan_of(arch, m)
    for n, dims in split_dims.items():
        style = hf_style(n, plan)
        if style is None or style in ("replicated_with_grad_allreduce",):
            assert dims == [], f"{arch} {n}: not in the plan but split on {dims}"


# ---- 4. layout oracle: real DTensor on a gloo DeviceMesh ----------------------------------------------
ORACLE_ARCHS = ["llama_tied", "qwen2", "qwen3_moe", "deepseek_v3"]


def _dtensor_worker(rank, world, port, outdir):
    """One of 4 gloo ranks: every parameter laid out by DTensor as FSDP2-on-TP does it."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    try:
        from torch.distributed.tensor.placement_types import _StridedShard
    except ImportError:  # pragma: no cover
        _StridedShard = None

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        dp_tp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        ep_tp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "tp"))
        out = {}

        def tp_place(style, leaf, ndim):
            if style == "col":
                return Shard(ndim - 2 if leaf != "bias" and ndim > 1 else 0)
            if style == "row" and leaf != "bias":
                return Shard(ndim - 1)
            if style == "packed":
                return _StridedShard(ndim - 2, split_factor=2)
            return Replicate()

        for arch in ORACLE_ARCHS:
            m = H.build(arch)
            sd = m.state_dict()
            bufs = {n for n, _ in m.named_buffers() if n in sd}
            names = [n for n, _ in m.named_parameters()] + sorted(bufs)
            for n in names:
                x = sd[n].detach().contiguous()
                leaf = n.rsplit(".", 1)[-1]
                style = HF_STYLE.get(hf_style(n, plan_of(arch, m)))
                tpp = tp_place(style, leaf, x.ndim)
                # mesh (dp=2, tp=2): TP, then FSDP2 = Shard(0) of the TP-local tensor
                if n in bufs:  # FSDP2 does not shard buffers
                    local = distribute_tensor(x, dp_tp, [Replicate(), Replicate()]).to_local()
                elif isinstance(tpp, Shard) and tpp.dim == 0:
                    # Shard(0) twice: FSDP2 chunks the TP shard (DTensor's [Shard(0), Shard(0)] would
                    # chunk over dp first), so lay it out in two steps on the sub-meshes
                    t = distribute_tensor(x, dp_tp["tp"], [tpp]).to_local()
                    local = distribute_tensor(t.contiguous(), dp_tp["dp"], [Shard(0)]).to_local()
                else:  # TP on another dim (or none): the two placements commute
                    local = distribute_tensor(x, dp_tp, [Shard(0), tpp]).to_local()
                out[f"{arch}|dp=2,tp=2|{n}"] = local.clone()
                # mesh (ep=2, tp=2): stacked experts split over ep (base_model_ep_plan grouped_gemm)
                if arch not in H.MOE_ARCHS:
                    continue
                if ".mlp.experts." in n:
                    local = distribute_tensor(x, ep_tp, [Shard(0), tpp]).to_local()
                else:
                    local = distribute_tensor(x, ep_tp, [Replicate(), tpp if n not in bufs else Replicate()]).to_local()
                out[f"{arch}|ep=2,tp=2|{n}"] = local.clone()
        torch.save(out, os.path.join(outdir, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def dtensor_layouts(tmp_path_factory):
    """One spawn of 4 gloo processes for the whole module; returns {rank: {key: tensor}}."""
    import torch.multiprocessing as mp
    outdir = str(tmp_path_factory.mktemp("dtensor"))
    mp.spawn(_dtensor_worker, args=(4, free_port(), outdir), nprocs=4, join=True)
    return {r: torch.load(os.path.join(outdir, f"rank{r}.pt"), weights_only=True) for r in range(4)}


@pytest.mark.slow  # 4 spawned torch processes; the known-answer layouts stay in the default pass
@pytest.mark.parametrize("arch,mesh", [(a, "dp=2,tp=2") for a in ORACLE_ARCHS]
                         + [(a, "ep=2,tp=2") for a in ORACLE_ARCHS if a in H.MOE_ARCHS])
def test_layout_matches_dtensor_oracle(dtensor_layouts, arch, mesh):
    model = bound(arch)
    uni = global_values(arch)
    got = run(model, UNIVERSAL, Mesh.parse(mesh), {0: uni})
    _, params, _ = real(arch)
    checked = 0
    for r in range(4):
        for n in params:
            want = dtensor_layouts[r][f"{arch}|{mesh}|{n}"].numpy()
            g = got[r][f"param/{n}"]
            assert g.shape == want.shape, f"{arch} {mesh} rank {r} {n}: ucl {g.shape} vs DTensor {want.shape}"
            assert g.tobytes() == want.tobytes(), f"{arch} {mesh} rank {r} {n}: values differ"
            checked += 1
    assert checked == 4 * len(params)
    # the uneven vocab split (99 rows over tp=2 then dp=2: 25, 25 | 25, 24) was exercised
    if mesh == "dp=2,tp=2":
        emb = "model.embed_tokens.weight"
        assert [got[r][f"param/{emb}"].shape[0] for r in range(4)] == [25, 25, 25, 24]


# ---- 5. round trips through three meshes for every spec ---------------------------------------------
# (mesh A, mesh B, mesh C); each model's tiny dims decide what fits: 2 or 3 layers, 4 heads,
# 2 KV heads (phi3 shares them when tp=4), 4 experts.
DENSE_MESHES = ("pp=2,dp=2,tp=2", "dp=2,tp=4", "pp=2,dp=4")
ROUND_TRIPS = {
    "llama": DENSE_MESHES, "llama_tied": DENSE_MESHES, "mistral": DENSE_MESHES, "qwen2": DENSE_MESHES,
    "qwen3": DENSE_MESHES, "gemma": DENSE_MESHES, "phi3": DENSE_MESHES,
    "gpt2": ("pp=2,dp=2,tp=2", "dp=3,tp=4", "pp=2,dp=2"),
    "mixtral": ("pp=2,dp=2,ep=2,tp=2", "dp=2,ep=4", "pp=2,ep=2,tp=4"),
    "qwen2_moe": ("pp=3,dp=2,ep=2", "dp=2,ep=2,tp=2", "pp=2,ep=4,tp=4"),
    "qwen3_moe": ("pp=2,dp=2,ep=2,tp=2", "dp=3,ep=4", "pp=2,ep=2,tp=4"),
    "deepseek_v3": ("pp=3,dp=2,ep=2", "dp=2,ep=2,tp=2", "pp=2,ep=4,tp=4"),
}


def _round_trip(model, uni, a, b, c):
    A, B, C = (Mesh.parse(x) for x in (a, b, c))
    shards_a = run(model, UNIVERSAL, A, {0: uni})
    shards_b = run(model, A, B, shards_a)
    back = run(model, B, UNIVERSAL, shards_b)
    assert_same(back, {0: uni}, f"{a} -> {b} -> universal")
    shards_c = run(model, UNIVERSAL, C, back)
    assert_same(run(model, A, C, shards_a), shards_c, f"{a} -> {c} vs universal -> {c}")
    assert_same(run(model, C, A, shards_c), shards_a, f"{c} -> {a}")
    return shards_a, shards_b, shards_c


@pytest.mark.parametrize("arch", H.ARCHS)
def test_round_trip_three_meshes(arch):
    model = bound(arch)
    uni = global_values(arch, seed=1)
    a, b, c = ROUND_TRIPS[arch]
    shards_a, _, _ = _round_trip(model, uni, a, b, c)
    # pipeline staging on mesh A: layer 0 on stage 0, the last layer on the last stage, renumbered
    A = Mesh.parse(a)
    layers = H.config(arch).num_hidden_layers if arch != "gpt2" else H.config(arch).n_layer
    pp = A.axis_size("pp")
    prefix = "transformer.h" if arch == "gpt2" else "model.layers"
    last = A.rank(pp=pp - 1)
    assert any(k.startswith(f"param/{prefix}.0.") for k in shards_a[0])
    per_last = layers // pp
    assert any(k.startswith(f"param/{prefix}.{per_last - 1}.") for k in shards_a[last])
    assert not any(k.startswith(f"param/{prefix}.{per_last}.") for k in shards_a[last])
    embed = "transformer.wte.weight" if arch == "gpt2" else "model.embed_tokens.weight"
    tied = H.tied(real(arch)[0])
    assert (f"param/{embed}" in shards_a[last]) == tied, "tied embedding also on the last stage"


# ---- 6. Megatron conventions, hand-written ------------------------------------------------------------
def megatron_params(d, moe_layers=(), local_spec=False):
    """Global names/shapes of a Megatron-core GPTModel (TE spec), in module order."""
    h, hd, nh, ng = d["hidden"], d["head_dim"], d["heads"], d["kv_heads"]
    glu = 1 + d["swiglu"]
    p = {"embedding.word_embeddings.weight": (d["vocab"], h)}
    for i in range(d["layers"]):
        pre = f"decoder.layers.{i}."
        p[pre + "self_attention.linear_qkv.layer_norm_weight"] = (h,)
        p[pre + "self_attention.linear_qkv.weight"] = ((nh + 2 * ng) * hd, h)
        p[pre + "self_attention.linear_proj.weight"] = (h, nh * hd)
        if i in moe_layers:
            p[pre + "pre_mlp_layernorm.weight"] = (h,)
            p[pre + "mlp.router.weight"] = (d["experts"], h)
            for e in range(d["experts"]):
                p[pre + f"mlp.experts.local_experts.{e}.linear_fc1.weight"] = (glu * d["moe_ffn"], h)
                p[pre + f"mlp.experts.local_experts.{e}.linear_fc2.weight"] = (h, d["moe_ffn"])
            p[pre + "mlp.shared_experts.linear_fc1.weight"] = (glu * d["shared_ffn"], h)
            p[pre + "mlp.shared_experts.linear_fc2.weight"] = (h, d["shared_ffn"])
        else:
            p[pre + "mlp.linear_fc1.layer_norm_weight"] = (h,)
            p[pre + "mlp.linear_fc1.weight"] = (glu * d["ffn"], h)
            p[pre + "mlp.linear_fc2.weight"] = (h, d["ffn"])
    p["decoder.final_layernorm.weight"] = (h,)
    if d["untied"]:
        p["output_layer.weight"] = (d["vocab"], h)
    return p


MEG = dict(vocab=300, hidden=16, heads=8, kv_heads=4, head_dim=2, ffn=12, swiglu=1, layers=4, vpp=1,
           experts=4, moe_ffn=4, shared_ffn=8, untied=1)


def bf16_bits(rng, shape):
    """Random bfloat16 values as raw bits (uint16), none zero."""
    x = rng.standard_normal(shape).astype(np.float32)
    x[x == 0] = 1
    return (x.view(np.uint32) >> 16).astype(np.uint16)


def meg_universal(params, rng, kinds=("param", "fp32", "exp_avg", "exp_avg_sq")):
    uni = {}
    for n, s in params.items():
        for k in kinds:
            uni[f"{k}/{n}"] = bf16_bits(rng, s) if k == "param" else rng.standard_normal(s).astype(np.float32) + 3
    return uni


def megatron_fused_qkv(q, k, v, nh, ng, hd):
    """linear_qkv as Megatron builds it from separate q/k/v: per query group g the rows
    [q heads g*nh/ng .. (g+1)*nh/ng - 1 | k_g | v_g]."""
    per = nh // ng
    rows = []
    for g in range(ng):
        rows += [q[(g * per + j) * hd:(g * per + j + 1) * hd] for j in range(per)]
        rows += [k[g * hd:(g + 1) * hd], v[g * hd:(g + 1) * hd]]
    return np.concatenate(rows)


def meg_padded_vocab(vocab, tp):
    m = 128 * tp
    return -(-vocab // m) * m


def meg_stage(i, layers, pp, vpp):
    """Megatron's interleaved schedule: chunk q = i // per goes to stage q % pp, as the rank's
    virtual chunk q // pp; ucl numbers a rank's layers consecutively over its chunks."""
    per = layers // (pp * vpp)
    q = i // per
    return q % pp, (q // pp) * per + i % per


def megatron_reference(uni, params, d, axes):
    """Every rank's datasets under Megatron's conventions, written without ucl."""
    pp, dp, ep, tp = (axes.get(a, 1) for a in ("pp", "dp", "ep", "tp"))
    E = d["experts"]
    out = {}
    for rank, (s, c, x, t) in enumerate(itertools.product(range(pp), range(dp), range(ep), range(tp))):
        held = []  # (global name, local name, TP-local param) in model order
        for n in params:
            m = re.match(r"decoder\.layers\.(\d+)\.(.*)", n)
            local = n
            if m:
                stage, li = meg_stage(int(m.group(1)), d["layers"], pp, d["vpp"])
                if stage != s:
                    continue
                local = f"decoder.layers.{li}.{m.group(2)}"
                me = re.match(r"(.*local_experts\.)(\d+)(\..*)", local)
                if me:
                    e = int(me.group(2))
                    if e // (E // ep) != x:
                        continue
                    local = f"{me.group(1)}{e % (E // ep)}{me.group(3)}"
            elif n.startswith("embedding."):
                if s != 0 and not (s == pp - 1 and not d["untied"]):
                    continue
            elif s != pp - 1:
                continue
            held.append((n, local))
        ds = {}
        tp_local = {}
        for n, local in held:
            for k in ("param", "fp32", "exp_avg", "exp_avg_sq"):
                w = uni[f"{k}/{n}"]
                if n.endswith(("word_embeddings.weight", "output_layer.weight")):
                    full = np.zeros((meg_padded_vocab(w.shape[0], tp), w.shape[1]), w.dtype)
                    full[:w.shape[0]] = w
                    w = np.split(full, tp)[t]
                elif n.endswith("linear_qkv.weight"):
                    nh, ng, hd = d["heads"], d["kv_heads"], d["head_dim"]
                    per = nh // ng
                    groups = range(t * ng // tp, (t + 1) * ng // tp)  # whole query groups per rank
                    rows = []
                    for g in groups:
                        base = g * (per + 2) * hd
                        rows.append(w[base:base + (per + 2) * hd])
                    w = np.concatenate(rows)
                elif n.endswith("linear_fc1.weight"):
                    gate, up = np.split(w, 2)
                    w = np.concatenate([np.split(gate, tp)[t], np.split(up, tp)[t]])  # [gate_r; up_r]
                elif n.endswith(("linear_fc2.weight", "linear_proj.weight")):
                    w = np.split(w, tp, axis=1)[t]
                if k == "param":
                    ds[f"param/{local}"] = w
                else:
                    # dense params shard over the whole DP group (dp x ep), experts over expert-DP (dp)
                    group = 1 if ".local_experts." in n else 0
                    tp_local.setdefault((k, group), []).append(w)
        # distributed optimizer: reverse order, 64-aligned starts, padded to lcm(group size, 128),
        # split over the group; the group rank of (dp c, ep x) in the dense group is c * ep + x
        for (k, group), tensors in tp_local.items():
            size, index = (dp * ep, c * ep + x) if group == 0 else (dp, c)
            buf, pos = [], 0
            for w in reversed(tensors):
                start = -(-pos // 64) * 64
                buf.append(np.zeros(start - pos, np.float32))
                buf.append(w.reshape(-1))
                pos = start + w.size
            unit = np.lcm(size, 128)
            total = -(-pos // unit) * unit
            buf.append(np.zeros(total - pos, np.float32))
            flat = np.concatenate(buf)
            ds[f"{k}/@flat{group}"] = np.split(flat, size)[index]
        out[rank] = ds
    return out


def test_megatron_gpt_known_answers():
    spec = ucl.load_spec("stdlib:megatron_gpt")
    rng = np.random.default_rng(5)
    params = megatron_params(MEG, moe_layers=(2, 3))
    model = spec.bind(MEG, params)
    uni = meg_universal(params, rng)
    cases = [dict(pp=2, dp=2, tp=2), dict(dp=2, ep=2, tp=4), dict(pp=4, ep=4), dict(pp=2, dp=3, ep=2, tp=2)]
    refs = []
    for axes in cases:
        mesh = Mesh(**axes)
        ref = megatron_reference(uni, params, MEG, axes)
        got = run(model, UNIVERSAL, mesh, {0: uni})
        assert_same(got, ref, f"universal -> {mesh}")
        assert_same(run(model, mesh, UNIVERSAL, ref), {0: uni}, f"{mesh} -> universal")
        refs.append((mesh, ref))
    for (a, ra), (b, rb) in itertools.permutations(refs[:3], 2):
        assert_same(run(model, a, b, ra), rb, f"{a} -> {b}")
    # spot checks of the conventions on tp=2 (pp=2, dp=2): rank (pp0, dp0, tp1)
    ref = refs[0][1]
    r = Mesh(pp=2, dp=2, tp=2).rank(pp=0, dp=0, tp=1)
    emb = ref[r]["param/embedding.word_embeddings.weight"]
    assert emb.shape == (256, 16)  # 300 -> 512 padded rows over tp=2; rank 1 holds rows 256..511
    assert not emb[300 - 256:].any() and np.array_equal(emb[:300 - 256], uni["param/embedding.word_embeddings.weight"][256:])
    # EP: expert 3 of 4 on ep=4 is local expert 0 of EP rank 3, layer 3 on stage 3 is local layer 0
    ref4 = refs[2][1]
    r = Mesh(pp=4, ep=4).rank(pp=3, ep=3)
    assert np.array_equal(ref4[r]["param/decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"],
                          uni["param/decoder.layers.3.mlp.experts.local_experts.3.linear_fc1.weight"])


def test_megatron_gpt_fused_qkv_gqa_per_group():
    """tp rank r holds whole query groups [q heads of g | k_g | v_g] (DESIGN.md section 5)."""
    spec = ucl.load_spec("stdlib:megatron_gpt")
    params = megatron_params(MEG)
    model = spec.bind(MEG, params)
    rng = np.random.default_rng(6)
    q, k, v = (rng.standard_normal((n * 2, 16)).astype(np.float32) for n in (8, 4, 4))
    uni = meg_universal(params, rng)
    name = "decoder.layers.1.self_attention.linear_qkv.weight"
    uni[f"param/{name}"] = megatron_fused_qkv(q, k, v, 8, 4, 2).view(np.uint32).astype(np.uint16)  # any bits
    got = run(model, UNIVERSAL, Mesh(tp=4), {0: uni})
    for t in range(4):  # one query group per rank: q heads 2t, 2t+1, k_t, v_t
        want = megatron_fused_qkv(q[4 * t:4 * t + 4], k[2 * t:2 * t + 2], v[2 * t:2 * t + 2], 2, 1, 2)
        assert np.array_equal(got[t][f"param/{name}"], want.view(np.uint32).astype(np.uint16))


def test_megatron_gpt_virtual_stages_and_tied_embedding():
    d = dict(MEG, layers=8, vpp=2, untied=0)
    spec = ucl.load_spec("stdlib:megatron_gpt")
    params = megatron_params(d)
    assert "output_layer.weight" not in params
    model = spec.bind(d, params)
    rng = np.random.default_rng(7)
    uni = meg_universal(params, rng)
    for axes in (dict(pp=2, tp=2), dict(pp=4, dp=2)):
        mesh = Mesh(**axes)
        ref = megatron_reference(uni, params, d, axes)
        got = run(model, UNIVERSAL, mesh, {0: uni})
        only = lambda sh: {r: {k: v for k, v in x.items() if k.startswith("param/")} for r, x in sh.items()}
        assert_same(only(got), only(ref), f"universal -> {mesh}")
    # pp=2, vpp=2, 8 layers: chunks of 2; stage 1 holds layers 2, 3 (chunk 1) and 6, 7 (chunk 3) as 0..3
    got = run(model, UNIVERSAL, Mesh(pp=2), {0: uni})
    names = sorted({k.split(".")[2] for k in got[1] if k.startswith("param/decoder.layers.")})
    assert names == ["0", "1", "2", "3"]
    assert np.array_equal(got[1]["param/decoder.layers.2.mlp.linear_fc2.weight"],
                          uni["param/decoder.layers.6.mlp.linear_fc2.weight"])
    # tied: the embedding is on the first and the last stage, and gathered once
    assert "param/embedding.word_embeddings.weight" in got[0] and "param/embedding.word_embeddings.weight" in got[1]
    _round_trip(model, uni, "pp=2,dp=2,tp=2", "dp=4,tp=4", "pp=2,dp=3")


def legacy_params(d):
    h, hd, nh = d["hidden"], d["head_dim"], d["heads"]
    p = {"language_model.embedding.word_embeddings.weight": (d["vocab"], h),
         "language_model.embedding.position_embeddings.weight": (32, h)}
    for i in range(d["layers"]):
        pre = f"language_model.encoder.layers.{i}."
        p.update({pre + "input_layernorm.weight": (h,), pre + "input_layernorm.bias": (h,),
                  pre + "self_attention.query_key_value.weight": (3 * nh * hd, h),
                  pre + "self_attention.query_key_value.bias": (3 * nh * hd,),
                  pre + "self_attention.dense.weight": (h, nh * hd), pre + "self_attention.dense.bias": (h,),
                  pre + "post_attention_layernorm.weight": (h,), pre + "post_attention_layernorm.bias": (h,),
                  pre + "mlp.dense_h_to_4h.weight": ((1 + d["swiglu"]) * d["ffn"], h),
                  pre + "mlp.dense_h_to_4h.bias": ((1 + d["swiglu"]) * d["ffn"],),
                  pre + "mlp.dense_4h_to_h.weight": (h, d["ffn"]), pre + "mlp.dense_4h_to_h.bias": (h,)})
    p["language_model.encoder.final_layernorm.weight"] = (h,)
    p["language_model.encoder.final_layernorm.bias"] = (h,)
    if d["untied"]:
        p["language_model.output_layer.weight"] = (d["vocab"], h)
    return p


LEG = dict(vocab=250, hidden=12, heads=4, kv_heads=4, head_dim=3, ffn=8, swiglu=0, layers=4, vpp=1, untied=0)


@pytest.mark.parametrize("swiglu", [0, 1])
def test_megatron_legacy_gpt_known_answers(swiglu):
    d = dict(LEG, swiglu=swiglu)
    spec = ucl.load_spec("stdlib:megatron_legacy_gpt")
    params = legacy_params(d)
    model = spec.bind(d, params)
    rng = np.random.default_rng(8)
    uni = meg_universal(params, rng)
    nh, hd, h = d["heads"], d["head_dim"], d["hidden"]

    def ref(axes):
        pp, dp, tp = (axes.get(a, 1) for a in ("pp", "dp", "tp"))
        out = {}
        for rank, (s, c, t) in enumerate(itertools.product(range(pp), range(dp), range(tp))):
            ds, states = {}, {}
            for n in params:
                m = re.match(r"language_model\.encoder\.layers\.(\d+)\.(.*)", n)
                local = n
                if m:
                    per = d["layers"] // pp
                    if int(m.group(1)) // per != s:
                        continue
                    local = f"language_model.encoder.layers.{int(m.group(1)) % per}.{m.group(2)}"
                elif "embedding" in n:
                    if not (s == 0 or (s == pp - 1 and "word_embeddings" in n and not d["untied"])):
                        continue
                elif s != pp - 1:
                    continue
                for k in ("param", "fp32", "exp_avg", "exp_avg_sq"):
                    w = uni[f"{k}/{n}"]
                    if "word_embeddings" in n:
                        full = np.zeros((meg_padded_vocab(w.shape[0], tp), h), w.dtype)
                        full[:w.shape[0]] = w
                        w = np.split(full, tp)[t]
                    elif "query_key_value" in n:
                        # [heads, 3, head_dim]: rank t holds heads t*nh/tp.., each [q_h | k_h | v_h]
                        w = w.reshape(nh, 3 * hd, *w.shape[1:])[t * nh // tp:(t + 1) * nh // tp].reshape(-1, *w.shape[1:])
                    elif "dense_h_to_4h" in n:
                        halves = np.split(w, 1 + swiglu)
                        w = np.concatenate([np.split(x, tp)[t] for x in halves])
                    elif n.endswith(("dense.weight", "dense_4h_to_h.weight")):
                        w = np.split(w, tp, axis=1)[t]
                    if k == "param":
                        ds[f"param/{local}"] = w
                    else:
                        states.setdefault(k, []).append(w.reshape(-1))
            for k, ws in states.items():  # legacy distributed optimizer: reverse order, pad to dp
                flat = np.concatenate(ws[::-1])
                flat = np.concatenate([flat, np.zeros(-len(flat) % dp, np.float32)])
                ds[f"{k}/@flat0"] = np.split(flat, dp)[c]
            out[rank] = ds
        return out

    cases = [(a, ref(a)) for a in (dict(pp=2, dp=2, tp=2), dict(dp=3, tp=4), dict(pp=4, dp=2))]
    for a, r in cases:
        assert_same(run(model, UNIVERSAL, Mesh(**a), {0: uni}), r, f"universal -> {Mesh(**a)}")
        assert_same(run(model, Mesh(**a), UNIVERSAL, r), {0: uni}, f"{Mesh(**a)} -> universal")
    for (a, ra), (b, rb) in itertools.permutations(cases, 2):
        assert_same(run(model, Mesh(**a), Mesh(**b), ra), rb, f"{Mesh(**a)} -> {Mesh(**b)}")


def test_megatron_round_trips_bf16_with_moe():
    spec = ucl.load_spec("stdlib:megatron_gpt")
    params = megatron_params(MEG, moe_layers=(1, 3))
    model = spec.bind(MEG, params)
    uni = meg_universal(params, np.random.default_rng(9))
    a, b, c = _round_trip(model, uni, "pp=2,dp=2,ep=2,tp=2", "dp=2,ep=4,tp=4", "pp=4,dp=3")
    assert a[0]["param/embedding.word_embeddings.weight"].dtype == np.uint16  # bf16 bits
    # every expert is held exactly once per (dp, tp) coordinate on mesh B
    B = Mesh.parse("dp=2,ep=4,tp=4")
    for e in range(4):
        r = B.rank(ep=e)
        assert "param/decoder.layers.1.mlp.experts.local_experts.0.linear_fc1.weight" in b[r]
        assert "param/decoder.layers.1.mlp.experts.local_experts.1.linear_fc1.weight" not in b[r]


# ---- 7. ucl.formats.hf-----------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", H.ARCHS)
def test_check_against_saved_and_in_memory(arch, tmp_path):
    m, params, bufs = real(arch)
    spec = ucl.load_spec("stdlib:" + HF_SPEC[arch])
    dims = spec.dims_from_config(H.config(arch).to_dict())
    saved = H.saved_names(m, str(tmp_path))
    assert uhf.read_tensor_names(tmp_path) == saved
    assert uhf.check_against(spec, dims, saved, frozen=bufs) == []
    assert uhf.check_against(spec, dims, params, frozen=bufs) == []
    fused, problems = uhf.fuse_saved_experts(saved)
    assert problems == [] and fused == {n: s for n, s in params.items()}, "saved names map onto the in-memory ones"


def test_check_against_reports_problems(tmp_path):
    _, params, bufs = real("mixtral")
    spec = ucl.load_spec("stdlib:mixtral")
    dims = spec.dims_from_config(H.config("mixtral").to_dict())
    saved = H.saved_names(real("mixtral")[0], str(tmp_path))
    gone = {k: v for k, v in saved.items() if ".experts.3.w3." not in k}
    probs = uhf.check_against(spec, dims, gone)
    assert any("expert 3 has no up matrix" in p for p in probs), probs
    bad = dict(params, **{"model.layers.0.self_attn.q_proj.weight": (65, 64), "extra.weight": (3,)})
    probs = uhf.check_against(spec, dims, bad)
    assert any("UCL203" in p and "q_proj" in p for p in probs) and any("UCL201" in p and "extra.weight" in p for p in probs), probs
    assert any("UCL209" in p for p in uhf.check_against(spec, dict(dims, hidden=None), params))


def test_read_tensor_names_sources(tmp_path):
    from safetensors.torch import save_file
    m, params, _ = real("llama")
    sharded = tmp_path / "sharded"
    m.save_pretrained(sharded, max_shard_size="60KB")
    assert (sharded / "model.safetensors.index.json").exists()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    assert uhf.read_tensor_names(sharded) == params
    assert uhf.read_tensor_names(sharded / "model.safetensors.index.json") == params
    one = tmp_path / "one.safetensors"
    save_file({"a.weight": torch.zeros(3, 5), "b": torch.zeros(7, dtype=torch.bfloat16)}, str(one))
    assert uhf.read_tensor_names(one) == {"a.weight": (3, 5), "b": (7,)}
    ckpt = tmp_path / "step_00000001"
    ckpt.mkdir()
    (ckpt / "manifest.json").write_text(json.dumps({"format": "ucl-checkpoint", "version": 1, "dims": {}, "mesh": [["dp", 2]],
                                                     "files": [], "datasets": [], "params": {"w": [4, 2], "s": []}}))
    assert uhf.read_tensor_names(ckpt) == {"w": (4, 2), "s": ()}
    (ckpt / "manifest.json").write_text(json.dumps({"format": "ucl-checkpoint", "version": 1, "dims": {}, "mesh": [],
                                                     "files": ["rank_00000.h5"], "params": None, "datasets": [
                                                         {"param/w": {"dtype": "float32", "shape": [4, 2], "checksum": ""},
                                                          "exp_avg/w": {"dtype": "float32", "shape": [4, 2], "checksum": ""}}]}))
    assert uhf.read_tensor_names(ckpt) == {"w": (4, 2)}


def test_load_config_fills_head_dim(tmp_path):
    cfg = H.config("mistral").to_dict()
    del cfg["head_dim"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    spec = ucl.load_spec("stdlib:mistral")
    # the one config reader fills head_dim for dims_from_config too (old configs have none)
    assert spec.dims_from_config(tmp_path)["head_dim"] == 16
    assert spec.dims_from_config(uhf.load_config(tmp_path))["head_dim"] == 16


@pytest.mark.parametrize("arch", H.ARCHS)
def test_draft_spec_from_hf_binds_real_model(arch):
    m, params, bufs = real(arch)
    text = uhf.draft_spec_from_hf(H.config(arch))
    spec = ucl.load_spec(text)
    dims = spec.dims_from_config(H.config(arch).to_dict())
    model = spec.bind(dims, params, frozen=bufs)
    meshes = {"gpt2": "pp=2,dp=2"}.get(arch, "pp=2,dp=2,tp=2")
    if "ep" in spec.axes:
        meshes = "pp=2,dp=2,ep=2,tp=2" if arch != "qwen2_moe" and arch != "deepseek_v3" else "dp=2,ep=2,tp=2"
    uni = global_values(arch, seed=2)
    _round_trip(model, uni, meshes, "dp=2,tp=2" if "ep" not in spec.axes else "ep=4", "dp=3")
    if arch in ("llama", "qwen3_moe", "deepseek_v3"):
        # the draft rediscovers what the hand-written spec says for the main tensors
        assert "model.layers.{i}.self_attn.k_proj.weight [kv_heads * head_dim, hidden] : split 0 over tp uneven" in text \
            or arch == "deepseek_v3"
        if arch != "llama":
            assert "mlp.experts.gate_up_proj [experts, 2 * moe_ffn, hidden] : view 1 as [2, moe_ffn]; split 0 over ep" in text


def test_draft_spec_from_a_folder(tmp_path):
    H.config("qwen2").save_pretrained(tmp_path)
    text = uhf.draft_spec_from_hf(tmp_path)
    assert "let head_dim = hidden / heads" in text
    _, params, bufs = real("qwen2")
    spec = ucl.load_spec(text)
    spec.bind(spec.dims_from_config(tmp_path), params, frozen=bufs)


def test_draft_checks_with_the_raw_config_it_came_from(tmp_path):
    """A config.json that leaves head_dim / tie_word_embeddings to the class defaults: the draft
    must still read its dims from that very file (`ucl check DRAFT --dims CONFIG`)."""
    cfg = {"model_type": "llama", "vocab_size": 99, "hidden_size": 64, "num_attention_heads": 4,
           "num_key_value_heads": 2, "intermediate_size": 128, "num_hidden_layers": 2}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    text = uhf.draft_spec_from_hf(tmp_path / "config.json")
    assert "let head_dim = hidden / heads" in text and "let tied = " in text
    spec = ucl.load_spec(text)
    dims = spec.dims_from_config(tmp_path / "config.json")
    from transformers import LlamaConfig
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM
    m = AutoModelForCausalLM.from_config(LlamaConfig(**{k: v for k, v in cfg.items() if k != "model_type"}))
    spec.bind(dims, {n: tuple(p.shape) for n, p in m.named_parameters()})


def test_saved_experts_of_a_feed_forward_block_are_fused_in_place():
    """Jamba names its MoE block ``feed_forward``: the saved per-expert matrices map onto
    ``feed_forward.experts.gate_up_proj`` / ``down_proj`` (they were left unfused), Mixtral's
    ``block_sparse_moe`` onto ``mlp`` as before."""
    saved = {f"model.layers.1.feed_forward.experts.{e}.{p}.weight": s for e in range(3)
             for p, s in (("gate_proj", (8, 4)), ("up_proj", (8, 4)), ("down_proj", (4, 8)))}
    saved["model.layers.1.feed_forward.router.weight"] = (3, 4)
    saved |= {f"model.layers.2.block_sparse_moe.experts.{e}.{p}.weight": s for e in range(2)
              for p, s in (("w1", (8, 4)), ("w3", (8, 4)), ("w2", (4, 8)))}
    fused, problems = uhf.fuse_saved_experts(saved)
    assert problems == []
    assert fused == {"model.layers.1.feed_forward.experts.gate_up_proj": (3, 16, 4),
                     "model.layers.1.feed_forward.experts.down_proj": (3, 4, 8),
                     "model.layers.1.feed_forward.router.weight": (3, 4),
                     "model.layers.2.mlp.experts.gate_up_proj": (2, 16, 4),
                     "model.layers.2.mlp.experts.down_proj": (2, 4, 8)}
