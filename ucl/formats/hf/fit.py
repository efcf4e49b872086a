"""Does a Hugging Face ``config.json`` describe a checkpoint's tensors? The numbers a decoder's config
gives (width, layers, heads x head size, key/value heads x head size, MLP width, vocabulary) read
back from the tensors, under Hugging Face's names (``model.layers.{i}.self_attn.q_proj.weight``) or
Megatron's (``decoder.layers[.{i}].self_attention.linear_qkv.weight``, the export's other source).
An export checks this first, so a wrong ``--config`` is named as such, dim by dim, with both values,
rather than as tensors that do not fit a spec or have no place in the model type."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping

Shapes = Mapping[str, tuple[int, ...]]


@dataclass(frozen=True)
class Measure:
    """The product of some of the config's fields against what the tensors say (``seen``)."""
    fields: tuple[str, ...]  # config.json fields (head_dim: as transformers derives it when absent)
    seen: Callable[[Shapes], tuple[int, str] | None]  # (value, the tensor it was read from) or None
    at_most: bool = False  # the config's value may be smaller (Megatron pads the vocabulary)
    not_for: tuple[str, ...] = ()  # model types whose tensors hold it otherwise

    def said(self, numbers: Mapping[str, int]) -> tuple[int, str] | None:
        """(the config's value, how it is made) or None when the config does not give every field."""
        if not all(f in numbers for f in self.fields):
            return None
        value = 1
        for f in self.fields:
            value *= numbers[f]
        parts = " x ".join(str(numbers[f]) for f in self.fields)
        return value, parts if len(self.fields) == 1 else f"{parts} = {value}"


def _dim(name: str, axis: int) -> Callable[[Shapes], tuple[int, str] | None]:
    def seen(shapes: Shapes):
        shape = shapes.get(name)
        return (int(shape[axis]), f"{name} {list(shape)}") if shape is not None and len(shape) > abs(axis) else None
    return seen


def _first_layer(shapes: Shapes, stem: str, rest: str) -> str | None:
    """The name of ``rest`` in the first layer under ``stem``, or the stacked tensor of all layers."""
    for name in (f"{stem}.0.{rest}", f"{stem}.{rest}"):
        if name in shapes:
            return name
    return None


def _layer_dim(stem: str, rest: str, axis: int, per_layer_rank: int):
    """Dim ``axis`` of a per-layer tensor (``per_layer_rank`` dims), named per layer or stacked."""
    def seen(shapes: Shapes):
        name = _first_layer(shapes, stem, rest)
        if name is None or len(shapes[name]) not in (per_layer_rank, per_layer_rank + 1):
            return None
        shape = shapes[name][len(shapes[name]) - per_layer_rank:]
        return int(shape[axis]), f"{name} {list(shapes[name])}"
    return seen


def _layers(stem: str, probe: str):
    def seen(shapes: Shapes):
        numbered = {int(m.group(1)) for n in shapes if (m := re.match(re.escape(stem) + r"\.(\d+)\.", n))}
        if numbered:
            return max(numbered) + 1, f"{stem}.0 ... {stem}.{max(numbered)}"
        stacked = shapes.get(f"{stem}.{probe}")  # megatron-core torch_dist: every layer in one tensor
        return (int(stacked[0]), f"{stem}.{probe} {list(stacked)}") if stacked else None
    return seen


def _kv_width(shapes: Shapes):
    """Megatron's ``linear_qkv`` rows are (heads + 2 kv heads) x head_dim; ``linear_proj`` takes the heads."""
    stem = "decoder.layers"
    qkv, proj = _first_layer(shapes, stem, "self_attention.linear_qkv.weight"), \
        _first_layer(shapes, stem, "self_attention.linear_proj.weight")
    if qkv is None or proj is None:
        return None
    rows, q = shapes[qkv][-2], shapes[proj][-1]
    return (rows - q) // 2, f"{qkv} {list(shapes[qkv])}: ({rows} rows - {q} for the queries) / 2"


_HEADS, _KV = ("num_attention_heads", "head_dim"), ("num_key_value_heads", "head_dim")
_MLA = ("deepseek_v3",)  # latent attention: q_proj is heads x (nope + rope) dims, and there is no k_proj
_HF = "model.layers"
HF_MEASURES = (
    Measure(("hidden_size",), _dim("model.embed_tokens.weight", 1)),
    Measure(("vocab_size",), _dim("model.embed_tokens.weight", 0)),
    Measure(("num_hidden_layers",), _layers(_HF, "")),
    Measure(("intermediate_size",), _layer_dim(_HF, "mlp.down_proj.weight", 1, 2)),
    Measure(_HEADS, _layer_dim(_HF, "self_attn.q_proj.weight", 0, 2), not_for=_MLA),
    Measure(_KV, _layer_dim(_HF, "self_attn.k_proj.weight", 0, 2), not_for=_MLA),
)
_MG = "decoder.layers"
MEGATRON_MEASURES = (
    Measure(("hidden_size",), _dim("embedding.word_embeddings.weight", 1)),
    Measure(("vocab_size",), _dim("embedding.word_embeddings.weight", 0), at_most=True),
    Measure(("num_hidden_layers",), _layers(_MG, "self_attention.linear_qkv.weight")),
    Measure(("intermediate_size",), _layer_dim(_MG, "mlp.linear_fc2.weight", 1, 2)),
    Measure(_HEADS, _layer_dim(_MG, "self_attention.linear_proj.weight", 1, 2)),
    Measure(_KV, _kv_width),
)


def config_numbers(config: Mapping[str, Any]) -> dict[str, int]:
    """The numbers of a decoder's config that :data:`HF_MEASURES` compare, where it gives them as
    positive integers (``num_key_value_heads`` defaulting to the heads, ``head_dim`` to
    ``hidden_size / num_attention_heads``, as transformers does)."""
    def field(name: str) -> int | None:
        v = config.get(name)
        return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None

    out = {f: field(f) for f in ("hidden_size", "vocab_size", "num_hidden_layers", "intermediate_size",
                                 "num_attention_heads")}
    out["num_key_value_heads"] = field("num_key_value_heads") or out["num_attention_heads"]
    hidden, heads = out["hidden_size"], out["num_attention_heads"]
    out["head_dim"] = field("head_dim") or (hidden // heads if hidden and heads else None)
    return {k: v for k, v in out.items() if v}


def mismatches(config: Mapping[str, Any], shapes: Shapes) -> list[str]:
    """Each number ``config`` gives that the tensors ``shapes`` (name -> shape) contradict, in words
    with both values; empty when they agree or the names are neither Hugging Face's nor Megatron's."""
    numbers = config_numbers(config)
    megatron = "embedding.word_embeddings.weight" in shapes or any(n.startswith(_MG + ".") for n in shapes)
    out = []
    for m in MEGATRON_MEASURES if megatron else HF_MEASURES:
        said, seen = m.said(numbers), m.seen(shapes)
        if said is None or seen is None or config.get("model_type") in m.not_for:
            continue
        (want, how), (value, where) = said, seen
        if want != value and not (m.at_most and want < value):
            out.append(f"{' x '.join(m.fields)} is {how} in the config, but {'at most ' * m.at_most}{value} in the "
                       f"checkpoint ({where})")
    return out
