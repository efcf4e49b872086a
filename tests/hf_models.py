"""Tiny, offline Hugging Face causal-LM models for tests.

Every architecture below is built from a hand-written config (no network, no
downloads) with the real ``transformers`` model class, on CPU, with
``torch.manual_seed(0)``; each builds in ~10 ms (plus ~2 s for the first
``import transformers``).

Sizes are chosen to exercise resharding edge cases:

* ``vocab_size=99`` (odd: not divisible by TP degrees 2/4/8) so vocab padding
  and uneven-shard paths are hit;
* ``hidden_size=64``, ``num_attention_heads=4``, ``num_key_value_heads=2``
  (GQA, group size 2), ``head_dim=16``;
* MoE archs have 4 experts, top-2 routing.

API::

    ARCHS                       # list of arch names
    config(arch)                # fresh tiny PretrainedConfig
    build(arch)                 # torch.nn.Module (real HF class), seeded, eval()
    tp_plan(arch)               # config.base_model_tp_plan (None for gpt2)
    named_tensors(model)        # {name: shape} of state_dict() (params + persistent buffers)
    saved_names(model, tmpdir)  # {name: shape} of save_pretrained() safetensors
    tied(model)                 # lm_head shares the input embedding?
    MOE_ARCHS, TIED_ARCHS       # subsets of ARCHS

Note: transformers 5 holds MoE experts fused in memory
(``mlp.experts.gate_up_proj [E, 2*I, H]``, ``mlp.experts.down_proj
[E, H, I]``) but ``save_pretrained`` writes the legacy per-expert names
(``mlp.experts.{e}.gate_proj.weight`` ...; Mixtral: ``w1/w2/w3``).  Use
``named_tensors`` for the in-memory view and ``saved_names`` for the on-disk
view; docs/stdlib.md lists, per family, the layouts the specs cover.
"""

from __future__ import annotations

import json
import os
from typing import Callable, Dict, Optional, Tuple

import torch

# Common tiny sizes.
H = 64  # hidden_size
NH = 4  # num_attention_heads
KV = 2  # num_key_value_heads
HD = 16  # head_dim (= H // NH)
FFN = 128  # intermediate_size (dense MLP; also Mixtral's per-expert size)
MI = 32  # moe_intermediate_size (per expert)
V = 99  # vocab_size: deliberately not a multiple of 8
L = 2  # num_hidden_layers
E = 4  # number of routed experts

_COMMON = dict(
    hidden_size=H,
    num_attention_heads=NH,
    num_key_value_heads=KV,
    intermediate_size=FFN,
    vocab_size=V,
    num_hidden_layers=L,
    max_position_embeddings=128,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


def _llama():
    from transformers import LlamaConfig

    return LlamaConfig(**_COMMON, head_dim=HD, tie_word_embeddings=False)


def _llama_tied():
    from transformers import LlamaConfig

    return LlamaConfig(**_COMMON, head_dim=HD, tie_word_embeddings=True)


def _mistral():
    from transformers import MistralConfig

    return MistralConfig(**_COMMON, head_dim=HD, tie_word_embeddings=False)


def _qwen2():
    from transformers import Qwen2Config

    # Qwen2: q/k/v have biases (hard-wired), o_proj does not.
    return Qwen2Config(**_COMMON, tie_word_embeddings=False)


def _qwen3():
    from transformers import Qwen3Config

    return Qwen3Config(**_COMMON, head_dim=HD, tie_word_embeddings=False)


def _gemma():
    from transformers import GemmaConfig

    # Gemma default head_dim is 256 -> must override; tied by default.
    return GemmaConfig(**_COMMON, head_dim=HD, tie_word_embeddings=True)


def _phi3():
    from transformers import Phi3Config

    # Phi3 default pad_token_id=32000 would be out of range for V=99.
    return Phi3Config(**_COMMON, tie_word_embeddings=False)


def _gpt2():
    from transformers import GPT2Config

    return GPT2Config(
        n_embd=H,
        n_head=NH,
        n_layer=L,
        n_inner=None,  # -> 4 * n_embd = 256
        n_positions=128,
        vocab_size=V,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=True,
    )


def _mixtral():
    from transformers import MixtralConfig

    return MixtralConfig(
        **_COMMON,
        head_dim=HD,
        num_local_experts=E,
        num_experts_per_tok=2,
        tie_word_embeddings=False,
    )


def _qwen2_moe():
    from transformers import Qwen2MoeConfig

    # Layer 0 dense (mlp_only_layers), layers 1..2 sparse with shared expert.
    return Qwen2MoeConfig(
        **{**_COMMON, "num_hidden_layers": 3},
        num_experts=E,
        num_experts_per_tok=2,
        moe_intermediate_size=MI,
        shared_expert_intermediate_size=48,
        decoder_sparse_step=1,
        mlp_only_layers=[0],
        tie_word_embeddings=False,
    )


def _qwen3_moe():
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        **_COMMON,
        head_dim=HD,
        num_experts=E,
        num_experts_per_tok=2,
        moe_intermediate_size=MI,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        tie_word_embeddings=False,
    )


def _deepseek_v3():
    from transformers import DeepseekV3Config

    # MLA + MoE. Layer 0 dense (first_k_dense_replace=1), layers 1..2 MoE.
    return DeepseekV3Config(
        **{**_COMMON, "num_hidden_layers": 3, "num_key_value_heads": NH},
        moe_intermediate_size=MI,
        n_routed_experts=E,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=1,
        q_lora_rank=24,
        kv_lora_rank=20,
        qk_rope_head_dim=8,
        qk_nope_head_dim=12,
        v_head_dim=10,
        tie_word_embeddings=False,
    )


_CONFIGS: Dict[str, Callable] = {
    "llama": _llama,
    "llama_tied": _llama_tied,
    "mistral": _mistral,
    "qwen2": _qwen2,
    "qwen3": _qwen3,
    "gemma": _gemma,
    "phi3": _phi3,
    "gpt2": _gpt2,
    "mixtral": _mixtral,
    "qwen2_moe": _qwen2_moe,
    "qwen3_moe": _qwen3_moe,
    "deepseek_v3": _deepseek_v3,
}

ARCHS = list(_CONFIGS)
MOE_ARCHS = ["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3"]
TIED_ARCHS = ["llama_tied", "gemma", "gpt2"]


def config(arch: str):
    """Return a fresh tiny config for ``arch`` (one of ``ARCHS``)."""
    try:
        return _CONFIGS[arch]()
    except KeyError:
        raise ValueError(f"unknown arch {arch!r}; choose from {ARCHS}") from None


def build(arch: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """Instantiate the real HF causal-LM class for ``arch`` on CPU, seeded with 0."""
    from transformers import AutoModelForCausalLM

    cfg = config(arch)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return model.eval()


def tp_plan(arch: str) -> Optional[dict]:
    """The config's own ``base_model_tp_plan`` as transformers declares it.

    Keys are relative to the base model (``model.``; for gpt2 it would be
    ``transformer.``) e.g. ``"layers.*.self_attn.q_proj": "colwise"``.
    Returns None for gpt2 (it declares none).  Returns a copy.
    """
    plan = getattr(config(arch), "base_model_tp_plan", None)
    return dict(plan) if plan is not None else None


def named_tensors(model: torch.nn.Module) -> Dict[str, Tuple[int, ...]]:
    """``{name: shape}`` of ``model.state_dict()`` (params + persistent buffers).

    Tied parameters appear under every name that ``state_dict()`` reports
    (e.g. both ``model.embed_tokens.weight`` and ``lm_head.weight``).
    """
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def saved_names(model: torch.nn.Module, tmpdir: str) -> Dict[str, Tuple[int, ...]]:
    """Run ``save_pretrained(tmpdir)`` (safetensors) and return ``{name: shape}``
    of every tensor in the written file(s).  ``tmpdir`` should be empty.

    Differs from :func:`named_tensors` for tied models (no ``lm_head.weight``
    on disk) and MoE models (per-expert legacy names on disk; Mixtral also
    renames ``mlp.`` -> ``block_sparse_moe.`` and uses ``w1/w3/w2``).
    """
    from safetensors import safe_open

    model.save_pretrained(tmpdir, safe_serialization=True)
    files = sorted(f for f in os.listdir(tmpdir) if f.endswith(".safetensors"))
    index = os.path.join(tmpdir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as fh:
            files = sorted(set(json.load(fh)["weight_map"].values()))
    out: Dict[str, Tuple[int, ...]] = {}
    for fname in files:
        with safe_open(os.path.join(tmpdir, fname), framework="pt") as f:
            for k in f.keys():
                out[k] = tuple(f.get_slice(k).get_shape())
    return out


def tied(model: torch.nn.Module) -> bool:
    """True if lm_head shares storage with the input embedding."""
    out = model.get_output_embeddings()
    inp = model.get_input_embeddings()
    return out is not None and out.weight is inp.weight
