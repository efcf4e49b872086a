"""The built-in example: a seeded Llama-style model with Adam state in a Megatron TP/PP/DP layout
with ZeRO-1 flat optimizer buffers. Used by ``ucl demo``, the benchmarks and the tests."""
from __future__ import annotations

import numpy as np

from .model import Model
from .spec import Spec

LLAMA_MEGATRON = """\
# Llama-family decoder in Megatron-core naming: fused QKV per KV group, SwiGLU [gate; up],
# vocab padded to 128 * tp, layers staged over pp, bf16 weights, fp32 master + Adam moments in
# ZeRO-1 flat buffers over dp.
dims vocab from vocab_size, hidden from hidden_size, heads from num_attention_heads,
     kv_heads from num_key_value_heads, ffn from intermediate_size, layers from num_hidden_layers
let head_dim = hidden / heads
mesh pp, dp, tp

decoder.layers.{i}.** : index i of layers over pp
embedding.word_embeddings.weight [vocab, hidden] : pad 0 to multiple_of(128 * tp); split 0 over tp; on pp = first
decoder.layers.{i}.self_attention.linear_qkv.weight [(heads + 2 * kv_heads) * head_dim, hidden]
    : view 0 as [kv_heads, (heads / kv_heads + 2) * head_dim]; split 0.0 over tp
decoder.layers.{i}.self_attention.linear_qkv.layer_norm_weight [hidden] : replicate over tp
decoder.layers.{i}.self_attention.linear_proj.weight [hidden, heads * head_dim] : split 1 over tp
decoder.layers.{i}.mlp.linear_fc1.weight [2 * ffn, hidden] : view 0 as [2, ffn]; split 0.1 over tp
decoder.layers.{i}.mlp.linear_fc1.layer_norm_weight [hidden] : replicate over tp
decoder.layers.{i}.mlp.linear_fc2.weight [hidden, ffn] : split 1 over tp
decoder.final_layernorm.weight [hidden] : on pp = last
output_layer.weight [vocab, hidden] : pad 0 to multiple_of(128 * tp); split 0 over tp; on pp = last

state param : dtype bfloat16
state fp32, exp_avg, exp_avg_sq : dtype float32; flat over dp align 64 pad to multiple_of(64 * dp)
state step : dtype int64; scalar
"""

SMALL = dict(vocab=1000, hidden=256, heads=8, kv_heads=4, ffn=704, layers=4)


def llama_params(d: dict) -> dict[str, tuple[int, ...]]:
    """Global parameter names and shapes, in model order."""
    hd = d["hidden"] // d["heads"]
    p = {"embedding.word_embeddings.weight": (d["vocab"], d["hidden"])}
    for i in range(d["layers"]):
        L = f"decoder.layers.{i}."
        p[L + "self_attention.linear_qkv.weight"] = ((d["heads"] + 2 * d["kv_heads"]) * hd, d["hidden"])
        p[L + "self_attention.linear_qkv.layer_norm_weight"] = (d["hidden"],)
        p[L + "self_attention.linear_proj.weight"] = (d["hidden"], d["heads"] * hd)
        p[L + "mlp.linear_fc1.weight"] = (2 * d["ffn"], d["hidden"])
        p[L + "mlp.linear_fc1.layer_norm_weight"] = (d["hidden"],)
        p[L + "mlp.linear_fc2.weight"] = (d["hidden"], d["ffn"])
    p["decoder.final_layernorm.weight"] = (d["hidden"],)
    p["output_layer.weight"] = (d["vocab"], d["hidden"])
    return p


def llama_model(dims: dict | None = None) -> Model:
    dims = dict(SMALL if dims is None else dims)
    return Spec.from_text(LLAMA_MEGATRON, "<demo:llama_megatron>", name="demo:llama_megatron").bind(dims, llama_params(dims))


def universal_state(model: Model, seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded global tensors for every (kind, parameter): bf16 weights as raw uint16 bits (the top
    half of a float32, as torch rounds-to-zero would give), fp32 master/moments, int64 step."""
    rng = np.random.default_rng(seed)
    out = {}
    for t in model.tensors:
        if t.dtype == "bfloat16":
            out[t.key] = (rng.standard_normal(t.shape, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)
        elif t.dtype == "int64":
            out[t.key] = np.asarray(1000 + t.id, dtype=np.int64).reshape(t.shape)
        else:
            out[t.key] = rng.standard_normal(t.shape, dtype=np.float32).astype(t.dtype)
    return out
