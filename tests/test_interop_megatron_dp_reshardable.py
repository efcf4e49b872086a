"""Megatron-core's dp_reshardable distributed-optimizer state (torch_dist) read in place.

The oracle is Megatron's: ``truth_plain.safetensors`` (its ``load_plain_tensors``: the weights and
each bucket tensor whole) and ``truth.json``'s ``buffers`` (each DDP buffer's ``param_index_map``:
where Megatron put every parameter, recorded by make.py from the live optimizer). Each parameter's
expected state is a plain slice of its bucket at Megatron's recorded offsets; nothing here uses
ucl's own layout code to compute what to expect. ``dp2_optim``: DP=2, one bucket;
``dp3_optim_buckets``: DP=3 with four buckets, each padded at its end (lcm(3, 128) = 384), so the
last rank's slice runs past the saved (unpadded) tensor."""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ucl
from ucl.dtypes import to_numpy
from ucl.errors import StoreError
from ucl.formats.megatron import buckets as megatron_buckets, dist as megatron
from bits import same_bits as _same  # noqa: E402
from tests.passes import examples

FIXTURES = Path(__file__).parent / "fixtures" / "megatron"
NAMES = ["dp2_optim", "dp3_optim_buckets", "tp2_dp2_optim", "pp2_dp2_optim"]
KINDS = {"param": "fp32", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}
BUCKET = "optimizer.distributed.dp_group_idx_{}.gbuf_idx_0.dtype_(torch.float32, torch.float32).bucket_idx_{}.{}"
# the local layer spec's module names -> the Transformer Engine names megatron saves them under
TE = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_", "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}
CAT0 = ("word_embeddings.weight", "output_layer.weight", "linear_qkv.weight", "linear_qkv.bias")
CAT1 = ("linear_proj.weight", "linear_fc2.weight")  # row-parallel: split dim 1


def _ucl_name(module_name: str, stage: int = 0, per_stage: int = 0) -> str:
    """ucl's name of a stage's module parameter: TE names, global layer numbers (Megatron numbers a
    stage's layers from 0; with even stages stage s starts at layer s * per_stage)."""
    for a, b in TE.items():
        module_name = module_name.replace(a, b)
    m = re.match(r"decoder\.layers\.(\d+)\.(.*)", module_name)
    return f"decoder.layers.{stage * per_stage + int(m.group(1))}.{m.group(2)}" if m else module_name


def _truth(name: str) -> tuple[dict[str, np.ndarray], dict]:
    """Megatron's tensors, and per model-parallel rank (its DP rank 0): its stage and TP rank, the
    data-parallel group its optimizer items are keyed by (from its own sharded state dict) and its
    buffer's param_index_map."""
    pytest.importorskip("torch")
    from safetensors.torch import load_file
    tensors = {k: to_numpy(v)[0] for k, v in load_file(str(FIXTURES / name / "truth_plain.safetensors")).items()}
    truth = json.loads((FIXTURES / name / "truth.json").read_text())
    lay = truth["layout"]
    ranks = []
    for rank in truth["ranks"]:
        if rank["coords"]["dp"] == 0:
            (group,) = {re.match(r"optimizer\.distributed\.dp_group_idx_(\d+)\.", it["key"]).group(1)
                        for it in rank["items"] if it.get("key", "").startswith("optimizer.distributed.")}
            (buffer,) = rank["buffers"]
            ranks.append({"pp": rank["coords"]["pp"], "tp": rank["coords"]["tp"], "group": int(group), "buffer": buffer})
    ranks.sort(key=lambda r: (r["pp"], r["tp"]))
    per_stage = truth["transformer_config"]["num_layers"] // lay["pp"]
    return tensors, {"ranks": ranks, "dp": lay["dp"], "tp": lay["tp"], "pp": lay["pp"], "per_stage": per_stage}


def _global(pieces: list[np.ndarray], key: str) -> np.ndarray:
    """A tensor from its TP ranks' pieces, by Megatron's TP conventions (written out here)."""
    if len(pieces) == 1:
        return pieces[0]
    if key.endswith(CAT0):
        return np.concatenate(pieces, 0)
    if key.endswith(CAT1):
        return np.concatenate(pieces, 1)
    if key.endswith(("linear_fc1.weight", "linear_fc1.bias")):  # SwiGLU: each rank holds [gate_r; up_r]
        h = pieces[0].shape[0] // 2
        return np.concatenate([p[:h] for p in pieces] + [p[h:] for p in pieces], 0)
    assert all(_same(p, pieces[0]) for p in pieces), key  # replicated over TP: the ranks agree
    return pieces[0]


def _expected(name: str) -> dict[str, np.ndarray]:
    """Every dataset of the universal layout, from Megatron's own outputs."""
    tensors, meta = _truth(name)
    local: dict[str, dict[int, np.ndarray]] = {}
    for r in meta["ranks"]:
        buf = r["buffer"]
        for p in buf["params"]:
            n, b = _ucl_name(p["name"], r["pp"], meta["per_stage"]), p["bucket"]
            first = buf["bucket_indices"][b][0]
            for mkind, kind in KINDS.items():
                bucket = tensors[BUCKET.format(r["group"], b, mkind)]
                local.setdefault(f"{kind}/{n}", {})[r["tp"]] = \
                    bucket[p["start"] - first:p["end"] - first].reshape(p["shape"])
    out = {k: _global([v[t] for t in sorted(v)], k) for k, v in local.items()}
    for k in [k for k in out if k.startswith("fp32/")]:
        n = k[5:]
        if n.startswith("decoder.layers."):  # the saved weights are stacked along a layer axis
            layer, _, rest = n[len("decoder.layers."):].partition(".")
            out[f"param/{n}"] = tensors[f"decoder.layers.{rest}"][int(layer)]
        else:
            out[f"param/{n}"] = tensors[n]
    return out


def _mesh(meta: dict) -> str:
    return ",".join(f"{a}={meta[a]}" for a in ("pp", "dp", "tp") if meta[a] > 1 or a == "dp")


@pytest.mark.parametrize("name", NAMES)
def test_in_place_every_parameter_equals_megatron(name):
    want = _expected(name)
    got = ucl.load_rank(FIXTURES / name, mesh="universal", rank=0)
    assert set(got) == set(want)
    for k, v in want.items():
        assert _same(got[k], v), k
    # fp32 training: the master Megatron saved is the weight the model saved
    assert all(_same(got[k], got["param/" + k.split("/", 1)[1]]) for k in got if k.startswith("fp32/"))


@pytest.mark.parametrize("name", NAMES)
def test_each_rank_holds_its_slice_of_each_bucket_padding_zero(name):
    tensors, meta = _truth(name)
    dp, tp = meta["dp"], meta["tp"]
    # one flat statement per (stage, bucket), numbered in that order
    first_number = {s: sum(len(r["buffer"]["bucket_indices"]) for r in meta["ranks"] if r["pp"] < s and r["tp"] == 0)
                    for s in range(meta["pp"])}
    for rk in meta["ranks"]:
        buf = rk["buffer"]
        for b, (first, end) in enumerate(buf["bucket_indices"]):
            part = (end - first) // dp
            for d in range(dp):
                got = ucl.load_rank(FIXTURES / name, mesh=_mesh(meta), rank=(rk["pp"] * dp + d) * tp + rk["tp"])
                for mkind, kind in KINDS.items():
                    bucket = tensors[BUCKET.format(rk["group"], b, mkind)]
                    want = np.zeros(part, np.float32)
                    for p in buf["params"]:
                        lo, hi = max(p["start"] - first, d * part), min(p["end"] - first, (d + 1) * part)
                        if p["bucket"] == b and lo < hi:
                            want[lo - d * part:hi - d * part] = bucket[lo:hi]
                    assert _same(got[f"{kind}/@flat{first_number[rk['pp']] + b}"], want), (rk, b, d, kind)


@pytest.mark.parametrize("name", NAMES)
def test_import_reshard_to_dp1_and_back(name, tmp_path):
    want = _expected(name)
    meta = _truth(name)[1]
    dp, mesh = meta["dp"], _mesh(meta)
    ucl.import_checkpoint(FIXTURES / name, tmp_path / "imported")
    ucl.reshard(tmp_path / "imported", tmp_path / "dp1", to="dp=1")
    ucl.reshard(tmp_path / "dp1", tmp_path / "back", to=mesh)
    ucl.reshard(FIXTURES / name, tmp_path / "dp4", to="dp=4")
    for path in ("imported", "dp1", "back", "dp4"):
        got = ucl.load_rank(tmp_path / path, mesh="universal", rank=0)
        assert set(got) == set(want) and all(_same(got[k], v) for k, v in want.items()), path
    for r in range(meta["pp"] * dp * meta["tp"]):  # back at Megatron's layout: the very bytes read in place, by rank
        a = ucl.load_rank(tmp_path / "back", mesh=mesh, rank=r)
        b = ucl.load_rank(FIXTURES / name, mesh=mesh, rank=r)
        assert set(a) == set(b) and all(_same(a[k], b[k]) for k in a), r


def test_description_says_megatrons_rule_in_the_language():
    d = megatron.describe(str(FIXTURES / "dp3_optim_buckets"))
    assert d.mesh == (("dp", 3),)
    assert d.spec.count("flat over dp reverse align 64 pad to multiple_of(lcm(dp, 128))") == 4
    opt = d.state["megatron"]["dp_reshardable"]
    assert opt["module_order"] == "local" and [b["numel"] for b in opt["buckets"]] == [1920, 1920, 2304, 2688]
    groups = d.state["megatron"]["objects"]["optimizer.distributed.dp_group_idx_0.optimizer"]
    assert all(g["step"] == 1 for g in groups["param_groups"])


def test_a_module_order_that_does_not_reproduce_the_chunks_is_refused(monkeypatch):
    # qkv's weight where proj's is: the same parameters and total, only the chunk offsets can tell
    order = list(megatron_buckets.ORDERS["local"])
    i, j = order.index("self_attention.linear_proj.weight"), order.index("self_attention.linear_qkv.weight")
    order[i], order[j] = order[j], order[i]
    monkeypatch.setattr(megatron_buckets, "ORDERS", {"swapped": tuple(order)})
    with pytest.raises(StoreError) as e:
        megatron.describe(str(FIXTURES / "dp2_optim"))
    assert e.value.code == "UCL502"
    assert "bucket_idx_0" in str(e.value) and "has a chunk at" in str(e.value)


@pytest.mark.parametrize("dp", [1, 2, 3, 4, 8])
def test_layout_recomputes_megatrons_param_index_map(dp):
    # the recorded map of the 4-bucket fixture is Megatron's at dp=3; the bucket closing points
    # (unpadded sizes) do not depend on dp, the padded ends do
    _, meta = _truth("dp3_optim_buckets")
    buf = meta["ranks"][0]["buffer"]
    order = [_ucl_name(p["name"]) for p in reversed(buf["params"])]
    sizes = {_ucl_name(p["name"]): math.prod(p["shape"]) for p in buf["params"]}
    unpadded = buf["bucket_numel_unpadded"]
    multiple = math.lcm(dp, 128)
    padded = [-(-u // multiple) * multiple for u in unpadded]
    got = megatron_buckets.layout(order, sizes, unpadded, padded, dp)
    assert not isinstance(got, str), got
    buckets, m = got
    assert m == multiple
    if dp == 3:
        starts = {n: buf["bucket_indices"][b.index][0] + s for b in buckets for n, s in zip(b.names, b.starts)}
        assert starts == {_ucl_name(p["name"]): p["start"] for p in buf["params"]}
    assert [b.numel for b in buckets] == padded
    bad = megatron_buckets.layout(order, sizes, unpadded, [p + multiple for p in padded], dp)
    assert isinstance(bad, str) and "do not close buckets" in bad


def test_pieces_that_are_not_the_runs_tp_are_refused_with_the_reason():
    # tp2's weights read with a tensor-parallel size that is not the grid's: QKV's two pieces do not fit
    from ucl.formats.dcp.metadata import read_metadata
    from ucl.formats.megatron.unstack import infer_tp, unstack

    assert infer_tp(read_metadata(str(FIXTURES / "tp2"))) == 2
    with pytest.raises(StoreError, match="tensor-parallel size is 1") as e:
        unstack(read_metadata(str(FIXTURES / "tp2")), tp=1)
    assert e.value.code == "UCL502"
    weights, _ = unstack(read_metadata(str(FIXTURES / "tp2")), tp=2)
    rules = {w.name: w.rule for w in weights}
    assert rules["decoder.layers.1.mlp.linear_fc1.weight"] == "view 0 as [2, 32]; split 0.1 over tp"
    assert rules["decoder.layers.0.self_attention.linear_proj.weight"] == "split 1 over tp"
    assert rules["decoder.layers.0.self_attention.linear_qkv.layer_norm_weight"] == "replicate"


# ---- Megatron's rule vs the generated spec, on random models ---------------------------------------
def _megatron_buffer(sizes: list[int], dp: int, bucket_size: int | None):
    """A plain transcription of megatron-core 0.16's _ParamAndGradBuffer layout with the distributed
    optimizer: params walked in reverse, starts padded to 64, a bucket closes once its span (padding
    included) reaches bucket_size, its end padded to lcm(dp, 128). Returns ({param index: (start,
    bucket)}, [(bucket start, bucket end)], [unpadded numel per bucket])."""
    pad = lambda n, d: -(-n // d) * d  # noqa: E731
    where, bounds, unpadded = {}, [], []
    start = bucket_start = 0
    for i in reversed(range(len(sizes))):
        start = pad(start, 64)
        end = start + sizes[i]
        where[i] = (start, len(bounds))
        if bucket_size is not None and end - bucket_start >= bucket_size:
            unpadded.append(end - bucket_start)
            bounds.append((bucket_start, pad(end, math.lcm(dp, 128))))
            start = bucket_start = bounds[-1][1]
        else:
            start = end
    if len(where) and (not bounds or where[0][1] == len(bounds)):
        unpadded.append(end - bucket_start)
        bounds.append((bucket_start, pad(end, math.lcm(dp, 128))))
    return where, bounds, unpadded


@settings(max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sizes=st.lists(st.integers(1, 300), min_size=1, max_size=10), dp=st.integers(1, 6),
       bucket_size=st.one_of(st.none(), st.integers(1, 900)), seed=st.integers(0, 2 ** 16))
def test_generated_spec_is_megatrons_buffer_layout(sizes, dp, bucket_size, seed):
    where, bounds, unpadded = _megatron_buffer(sizes, dp, bucket_size)
    names = [f"p{i}" for i in range(len(sizes))]
    size_of = dict(zip(names, sizes))
    got = megatron_buckets.layout(names, size_of, unpadded, [e - s for s, e in bounds], dp)
    assert not isinstance(got, str), got
    buckets, _ = got
    assert {n: (b.index, s) for b in buckets for n, s in zip(b.names, b.starts)} == \
        {names[i]: (b, s - bounds[b][0]) for i, (s, b) in where.items()}
    # the compiler's own lowering of the spec scatters the universal tensors to Megatron's buffers
    spec = megatron_buckets.spec_text("a test", names, {n: (z,) for n, z in size_of.items()}, "float32", "float32",
                                      buckets)
    model = ucl.load_spec(spec).bind(dims={}, params={n: (z,) for n, z in size_of.items()})
    rng = np.random.default_rng(seed)
    uni = {f"{k}/{n}": (rng.standard_normal(z).astype(np.float32) + 10) for n, z in size_of.items()
           for k in ("param", "fp32", "exp_avg", "exp_avg_sq")}
    shards = ucl.execute_memory(ucl.compile(model, ucl.UNIVERSAL, ucl.Mesh(dp=dp)), {0: uni})
    for b, (first, end) in enumerate(bounds):
        for kind in ("fp32", "exp_avg"):
            flat = np.zeros(end - first, np.float32)
            for i, (s, bi) in where.items():
                if bi == b:
                    flat[s - first:s - first + sizes[i]] = uni[f"{kind}/{names[i]}"]
            part = (end - first) // dp
            for r in range(dp):
                assert _same(shards[r][f"{kind}/@flat{b}"], flat[r * part:(r + 1) * part]), (b, r, kind)


def test_tensor_parallel_buckets_are_one_group_per_tp_rank():
    d = megatron.describe(str(FIXTURES / "tp2_dp2_optim"))
    assert d.mesh == (("dp", 2), ("tp", 2)) and d.state["megatron"]["dp_reshardable"]["tp"] == 2
    assert "decoder.layers.0.mlp.linear_fc1.weight [64, 16] : view 0 as [2, 32]; split 0.1 over tp" in d.spec
    assert "decoder.layers.0.self_attention.linear_proj.weight [16, 16] : split 1 over tp" in d.spec
    # rank 3 = (dp 1, tp 1): TP-local weights, its slice of group 1's bucket
    assert d.extents[3]["param/decoder.layers.0.mlp.linear_fc1.weight"].shape == (32, 16)
