"""Declarative renames from a training framework's tensor names to Hugging Face's, with the fusions
undone: the mapping an HF export applies to a Megatron checkpoint (``linear_qkv`` ->
``q_proj``/``k_proj``/``v_proj``, ``linear_fc1`` -> ``gate_proj``/``up_proj``, padded vocabulary ->
the config's).

A :class:`Rule` says which source tensor a target comes from and which :class:`Part` of it. A part
is the one operation these mappings need: view the source's dim 0 as ``[blocks, rows / blocks]`` and
keep rows ``[start, stop)`` of every block (Megatron interleaves Q, K and V per query group:
``blocks = kv_heads``; SwiGLU stacks ``[gate; up]``: ``blocks = 1``; vocab padding: ``blocks = 1``,
``[0, vocab)``). Sources named per layer (``decoder.layers.3.x``, Megatron-LM legacy, ucl's
``stdlib:megatron_gpt``) or stacked along a leading layer axis (``decoder.layers.x [L, ...]``,
megatron-core ``torch_dist``) are both found. Every source weight must be consumed by some rule:
a tensor the target architecture has no place for (biases, LayerNorm biases, learned position
embeddings) is refused by name rather than dropped.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import numpy as np

from ...errors import ForeignFormatError

_LAYER = "{i}"



@dataclass(frozen=True)
class Part:
    """Rows ``[start, stop)`` of each of ``blocks`` equal blocks of dim 0."""

    blocks: int
    start: int
    stop: int

    def rows(self, n: int) -> int:
        """Rows of the result for a source with ``n`` rows (checked by :meth:`check`)."""
        return self.blocks * (self.stop - self.start)

    def check(self, n: int) -> str | None:
        """Why a source of ``n`` rows cannot be cut this way, or None."""
        if self.blocks <= 0 or n % self.blocks:
            return f"{n} rows do not split into {self.blocks} equal blocks"
        if not 0 <= self.start < self.stop <= n // self.blocks:
            return f"rows [{self.start}, {self.stop}) are not inside a block of {n // self.blocks}"
        return None

    def take(self, tensor: Any) -> Any:
        """The part of ``tensor`` (torch or numpy; dim 0 cut), as a view where possible."""
        n, rest = tensor.shape[0], tuple(tensor.shape[1:])
        viewed = tensor.reshape((self.blocks, n // self.blocks) + rest)[:, self.start:self.stop]
        return viewed.reshape((self.rows(n),) + rest)


@dataclass(frozen=True)
class Rule:
    """Target ``target`` is ``part(dims)`` (or all) of the first of ``sources`` the checkpoint has.
    Names may hold ``{i}``, the layer number; ``optional`` rules apply only where a source exists."""

    target: str
    sources: tuple[str, ...]
    part: Callable[[Mapping[str, int]], Part] | None = None
    optional: bool = False


@dataclass(frozen=True)
class NameMap:
    """Rules from one framework's names to a family of Hugging Face model types."""

    name: str
    applies: Callable[[Mapping[str, Any]], bool]  # to a source's universal names
    rules: tuple[Rule, ...]
    dims: Callable[[Mapping[str, Any]], dict[str, int]]  # from the target's config.json


@dataclass(frozen=True)
class Renamed:
    """One exported tensor: ``part`` of layer ``index`` (None: not stacked) of source ``source``."""

    target: str
    source: str  # the universal name
    index: int | None
    part: Part | None
    shape: tuple[int, ...]

    def take(self, tensor: Any) -> Any:
        """This tensor out of its source tensor (C-contiguous)."""
        t = tensor[self.index] if self.index is not None else tensor
        t = self.part.take(t) if self.part is not None else t
        return t.contiguous() if hasattr(t, "contiguous") else np.ascontiguousarray(t)


# --- Megatron-core GPT (torch_dist, legacy, stdlib:megatron_gpt) -> llama, mistral, qwen2 --------
def _llama_dims(config: Mapping[str, Any]) -> dict[str, int]:
    def field(*names: str) -> int:
        for n in names:
            v = config.get(n)
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                return v
        raise ForeignFormatError(f"the config has no positive integer {' or '.join(names)}, which the export needs to undo "
                     "Megatron's fused tensors", code="UCL503")

    heads, hidden = field("num_attention_heads"), field("hidden_size")
    kv = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    return dict(vocab=field("vocab_size"), heads=heads, kv_heads=int(kv), head_dim=int(head_dim),
                ffn=field("intermediate_size"), layers=field("num_hidden_layers"))


def _qkv(which: int) -> Callable[[Mapping[str, int]], Part]:
    """Q (0), K (1) or V (2) rows of Megatron's ``linear_qkv``: per query group, the group's query
    heads, then its key head, then its value head."""
    def part(d: Mapping[str, int]) -> Part:
        q = d["heads"] // d["kv_heads"] * d["head_dim"]
        start = (0, q, q + d["head_dim"])[which]
        return Part(d["kv_heads"], start, start + (q if which == 0 else d["head_dim"]))
    return part


def _glu(which: int) -> Callable[[Mapping[str, int]], Part]:
    return lambda d: Part(1, which * d["ffn"], (which + 1) * d["ffn"])  # [gate; up]


def _vocab(d: Mapping[str, int]) -> Part:
    return Part(1, 0, d["vocab"])  # Megatron pads the vocabulary; the tokenizer's rows come first


_L = "decoder.layers.{i}."
_H = "model.layers.{i}."
MEGATRON_GPT_TO_LLAMA = NameMap(
    name="megatron_gpt -> llama",
    applies=lambda names: "embedding.word_embeddings.weight" in names or any(n.startswith("decoder.layers.") for n in names),
    dims=_llama_dims,
    rules=(
        Rule("model.embed_tokens.weight", ("embedding.word_embeddings.weight",), _vocab),
        Rule(_H + "input_layernorm.weight", (_L + "self_attention.linear_qkv.layer_norm_weight", _L + "input_layernorm.weight")),
        *(Rule(_H + f"self_attn.{p}_proj.{w}", (_L + f"self_attention.linear_qkv.{w}",), _qkv(k), optional=w == "bias")
          for w in ("weight", "bias") for k, p in enumerate("qkv")),
        Rule(_H + "self_attn.o_proj.weight", (_L + "self_attention.linear_proj.weight",)),
        Rule(_H + "post_attention_layernorm.weight", (_L + "mlp.linear_fc1.layer_norm_weight", _L + "pre_mlp_layernorm.weight")),
        Rule(_H + "mlp.gate_proj.weight", (_L + "mlp.linear_fc1.weight",), _glu(0)),
        Rule(_H + "mlp.up_proj.weight", (_L + "mlp.linear_fc1.weight",), _glu(1)),
        Rule(_H + "mlp.down_proj.weight", (_L + "mlp.linear_fc2.weight",)),
        Rule("model.norm.weight", ("decoder.final_layernorm.weight",)),
        Rule("lm_head.weight", ("output_layer.weight",), _vocab, optional=True),  # absent when tied
    ),
)
# the Hugging Face model types whose tensors are llama's (qwen2 adds the q/k/v biases)
TARGETS = {"llama": MEGATRON_GPT_TO_LLAMA, "mistral": MEGATRON_GPT_TO_LLAMA, "qwen2": MEGATRON_GPT_TO_LLAMA}
_IGNORED = re.compile(r"(^|\.)_extra_state$")  # Transformer Engine's FP8 metadata, not weights


def config_from_megatron(args: Mapping[str, Any]) -> dict:
    """The Hugging Face config of the model a Megatron-LM run trained (its saved ``args``): ``llama``,
    or ``qwen2`` with ``--add-qkv-bias``. The vocabulary is Megatron's padded one (nothing is cut;
    pass a config with the tokenizer's ``vocab_size`` to cut it). Runs whose architecture no such
    model type has (LayerNorm, learned positions, linear biases, ...) are refused with the reasons."""
    def arg(name: str, default: Any = None) -> Any:
        return args.get(name, default)

    why = []
    wants = {"normalization": "RMSNorm", "position_embedding_type": "rope", "swiglu": True, "add_bias_linear": False}
    why += [f"{k} is {arg(k)!r} (Hugging Face llama needs {v!r})" for k, v in wants.items() if arg(k) != v]
    if arg("rotary_percent", 1.0) != 1.0:
        why.append(f"rotary_percent is {arg('rotary_percent')} (llama rotates whole heads)")
    for flag in ("qk_layernorm", "num_experts", "multi_latent_attention", "apply_layernorm_1p"):
        if arg(flag):
            why.append(f"{flag} is set")
    numbers = ("hidden_size", "num_attention_heads", "ffn_hidden_size", "num_layers", "padded_vocab_size")
    why += [f"{n} is missing" for n in numbers if not isinstance(arg(n), int) or isinstance(arg(n), bool)]
    if why:
        raise ForeignFormatError("cannot derive a Hugging Face config from the Megatron-LM arguments: " + "; ".join(why)
                     + ". Pass the config.json of the model to export to (--config)", code="UCL503")
    heads, hidden = arg("num_attention_heads"), arg("hidden_size")
    qwen = bool(arg("add_qkv_bias"))
    config = {
        "architectures": ["Qwen2ForCausalLM" if qwen else "LlamaForCausalLM"], "model_type": "qwen2" if qwen else "llama",
        "vocab_size": arg("padded_vocab_size"), "hidden_size": hidden, "intermediate_size": arg("ffn_hidden_size"),
        "num_hidden_layers": arg("num_layers"), "num_attention_heads": heads,
        "num_key_value_heads": arg("num_query_groups") if arg("group_query_attention") else heads,
        "hidden_act": "silu", "max_position_embeddings": arg("max_position_embeddings") or arg("seq_length"),
        "rms_norm_eps": float(arg("norm_epsilon", 1e-5)), "rope_theta": float(arg("rotary_base", 10000)),
        "tie_word_embeddings": not arg("untie_embeddings_and_output_weights", False),
    }
    if arg("kv_channels") and arg("kv_channels") != hidden // heads:
        config["head_dim"] = arg("kv_channels")
    if not qwen:
        config.update(attention_bias=False, mlp_bias=False)
    return config


def mapping_for(names: Mapping[str, tuple[int, ...]], config: Mapping[str, Any]) -> NameMap | None:
    """The mapping an export of tensors ``names`` (universal name -> shape) to ``config``'s model
    type needs; None when the names are already the target's. A framework's names with no mapping to
    that model type are refused."""
    megatron = MEGATRON_GPT_TO_LLAMA.applies(names)
    if not megatron:
        return None
    model_type = config.get("model_type")
    mapping = TARGETS.get(model_type) if isinstance(model_type, str) else None
    if mapping is None:
        raise ForeignFormatError(f"the checkpoint has Megatron's tensor names, and ucl maps them to the Hugging Face model types "
                     f"{', '.join(sorted(TARGETS))}, not to {model_type!r}; pass the config.json of such a model", code="UCL503")
    return mapping


def rename(mapping: NameMap, shapes: Mapping[str, tuple[int, ...]], config: Mapping[str, Any]) -> list[Renamed]:
    """The target tensors, in Hugging Face's order (embedding, layers in order, norm, head), each
    with where it comes from; every source weight used, shapes checked against the config."""
    dims = mapping.dims(config)
    out: list[Renamed] = []
    used: set[str] = set()
    problems: list[str] = []
    per_layer = [r for r in mapping.rules if _LAYER in r.target]
    first = [r for r in mapping.rules if _LAYER not in r.target and r.target.startswith("model.embed")]
    last = [r for r in mapping.rules if _LAYER not in r.target and r not in first]
    order = [(r, None) for r in first] + [(r, i) for i in range(dims["layers"]) for r in per_layer] + [(r, None) for r in last]
    for rule, layer in order:
        found = _find(rule, layer, shapes, dims["layers"])
        if found is None:
            if not rule.optional:
                names = " or ".join(s.replace(_LAYER, str(layer)) for s in rule.sources)
                problems.append(f"{rule.target.replace(_LAYER, str(layer))}: the checkpoint has no {names}")
            continue
        source, index, shape = found
        part = rule.part(dims) if rule.part is not None else None
        if part is not None:
            why = part.check(shape[0])
            if why:
                problems.append(f"{rule.target.replace(_LAYER, str(layer))} from {source} {list(shape)}: {why}")
                continue
            shape = (part.rows(shape[0]),) + tuple(shape[1:])
        used.add(source)
        out.append(Renamed(rule.target.replace(_LAYER, str(layer)), source, index, part, tuple(shape)))
    unused = sorted(n for n in shapes if n not in used and not _IGNORED.search(n))
    if unused:
        problems.append(f"{_grouped(unused)}: {config.get('model_type')} models have no such tensor (biases, LayerNorm "
                        "biases or learned position embeddings?); export to a model type that has them")
    if problems:
        raise ForeignFormatError(f"cannot map the checkpoint's {mapping.name.split(' ')[0]} tensors to Hugging Face "
                     f"{config.get('model_type')} with the config's {_dims_text(dims)} "
                     f"({len(problems)} problem{'s' * (len(problems) != 1)}):\n  "
                     + "\n  ".join(problems[:12]), code="UCL503")
    return out


def _find(rule: Rule, layer: int | None, shapes: Mapping[str, tuple[int, ...]], layers: int):
    """(universal name, layer index in a stacked tensor or None, shape of the layer) of the first of
    the rule's sources the checkpoint has."""
    for source in rule.sources:
        if layer is None:
            if source in shapes:
                return source, None, tuple(shapes[source])
            continue
        name = source.replace(_LAYER, str(layer))
        if name in shapes:
            return name, None, tuple(shapes[name])
        stacked = source.replace(_LAYER + ".", "")  # torch_dist: decoder.layers.x [layers, ...]
        shape = shapes.get(stacked)
        if shape is not None and len(shape) >= 1 and shape[0] == layers:
            return stacked, layer, tuple(shape[1:])
    return None


def _dims_text(dims: Mapping[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in dims.items())


def _grouped(names: list[str]) -> str:
    """Names with layer numbers folded: ``decoder.layers.{0..23}.x`` rather than 24 lines."""
    groups: dict[str, list[str]] = {}
    for n in names:
        groups.setdefault(re.sub(r"\.(\d+)\.", ".{N}.", n, count=1), []).append(n)
    return ", ".join(k if len(v) > 1 else v[0] for k, v in groups.items())
