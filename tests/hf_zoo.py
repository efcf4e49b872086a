"""Tiny configs for every decoder causal-LM type of the installed transformers (the drafter's sweep).

``zoo_types()`` lists the model types of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` that are decoder-only
language models (encoder-decoder, encoder-as-decoder (BERT-like) and multimodal composite configs are
left out, with the reason in ``SKIPPED``); ``tiny_config(model_type, size)`` builds a seeded-size config
(``size`` 0: the default tiny sizes, 1: other sizes, for checking that a draft generalises).
Models are built on the meta device: only names and shapes are needed.
"""
from __future__ import annotations

import warnings

# size 0 and size 1 of the common fields (a field is set only where the config class has it)
_SIZES = [
    dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
         vocab_size=99, num_hidden_layers=2, moe_intermediate_size=32, num_experts=4, num_local_experts=4,
         n_routed_experts=4, num_experts_per_tok=2, max_position_embeddings=128, shared_expert_intermediate_size=48,
         pad_token_id=0, bos_token_id=1, eos_token_id=2),
    dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=3, head_dim=8, intermediate_size=160,
         vocab_size=101, num_hidden_layers=3, moe_intermediate_size=40, num_experts=6, num_local_experts=6,
         n_routed_experts=6, num_experts_per_tok=2, max_position_embeddings=64, shared_expert_intermediate_size=24,
         pad_token_id=0, bos_token_id=1, eos_token_id=2),
]
# per type: fields for size 0 and size 1 (None: the field is removed from the common ones)
_EXTRA: dict[str, tuple[dict, dict]] = {
    "falcon": ({"new_decoder_architecture": True, "num_kv_heads": 2, "head_dim": None},
               {"new_decoder_architecture": True, "num_kv_heads": 3, "head_dim": None}),
    "gpt_neo": ({"attention_types": [[["global", "local"], 1]]}, {"attention_types": [[["global", "local", "global"], 1]]}),
    "mamba2": ({"num_heads": 8, "expand": 2, "n_groups": 2, "head_dim": 16}, {"num_heads": 12, "expand": 2, "n_groups": 3, "head_dim": 16}),
    "bamba": ({"mamba_n_heads": 8}, {"mamba_n_heads": 12}),
    "granitemoehybrid": ({"mamba_n_heads": 8, "layer_types": ["mamba", "attention"]},
                         {"mamba_n_heads": 12, "layer_types": ["mamba", "attention", "mamba"]}),
    "diffllama": ({}, {"num_key_value_heads": 2}),
    "zamba": ({"layers_block_type": ["mamba", "hybrid", "mamba", "hybrid"], "num_hidden_layers": 4},
              {"layers_block_type": ["mamba", "hybrid", "mamba", "hybrid"], "num_hidden_layers": 4}),
    "lfm2_moe": ({"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
                 {"layer_types": ["conv", "full_attention", "conv"], "num_dense_layers": 1}),
    "dots1": ({"n_shared_experts": 1}, {"n_shared_experts": 2}),
    "zamba2": ({"layers_block_type": ["mamba", "hybrid"]}, {"layers_block_type": ["mamba", "hybrid", "mamba"]}),
    "zaya": ({"num_experts_per_tok": 1}, {"num_experts_per_tok": 1}),
    "dbrx": ({"d_model": 64, "n_heads": 4, "n_layers": 2, "max_seq_len": 128,
              "attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0}, "ffn_config": {"ffn_hidden_size": 128, "moe_num_experts": 4, "moe_top_k": 2}},
             {"d_model": 96, "n_heads": 6, "n_layers": 3, "max_seq_len": 64,
              "attn_config": {"kv_n_heads": 3, "rope_theta": 10000.0}, "ffn_config": {"ffn_hidden_size": 160, "moe_num_experts": 6, "moe_top_k": 2}}),
    "mpt": ({"d_model": 64, "n_heads": 4, "n_layers": 2, "max_seq_len": 128, "expansion_ratio": 2},
            {"d_model": 96, "n_heads": 6, "n_layers": 3, "max_seq_len": 64, "expansion_ratio": 3}),
}
# composite configs that are still plain decoders
_COMPOSITE_DECODERS = {"dbrx", "mpt"}
SKIPPED: dict[str, str] = {}


def zoo_types() -> list[str]:
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as names
    out = []
    for t in names:
        try:
            d = CONFIG_MAPPING[t]()
        except Exception as e:  # noqa: BLE001 - recorded, not hidden
            SKIPPED[t] = f"default config fails: {' '.join(str(e).split())[:80]}"
            continue
        if getattr(d, "is_encoder_decoder", False):
            SKIPPED[t] = "encoder-decoder"
        elif getattr(d, "sub_configs", None) and t not in _COMPOSITE_DECODERS:
            SKIPPED[t] = "multimodal (composite config; its *_text type is swept where there is one)"
        elif getattr(d, "is_decoder", None) is False:
            SKIPPED[t] = "encoder used as a decoder (BERT-like)"
        else:
            out.append(t)
    return out


def tiny_config(model_type: str, size: int = 0):
    from transformers import CONFIG_MAPPING
    cls = CONFIG_MAPPING[model_type]
    default = cls()
    kw = {k: v for k, v in _SIZES[size].items() if hasattr(default, k)}
    for k, v in _EXTRA.get(model_type, ({}, {}))[size].items():
        if v is None:
            kw.pop(k, None)
        else:
            kw[k] = v
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cls(**kw)


def meta_model(config):
    import torch
    from transformers import AutoModelForCausalLM
    with warnings.catch_warnings(), torch.device("meta"):
        warnings.simplefilter("ignore")
        return AutoModelForCausalLM.from_config(config)


def state_shapes(model) -> tuple[dict[str, tuple[int, ...]], list[str]]:
    """({name: shape} of parameters then persistent buffers, in model order; the buffer names)."""
    sd = model.state_dict()
    out = {n: tuple(p.shape) for n, p in model.named_parameters()}
    bufs = [n for n, _ in model.named_buffers() if n in sd and n not in out]
    out.update({n: tuple(sd[n].shape) for n in bufs})
    return out, bufs
