"""The stdlib spec a Megatron-LM legacy checkpoint fits (:mod:`ucl.formats.megatron.legacy`): which
one its names say, its dims from the run's ``args``, each tensor's global shape, and ``dtype``
lines for tensors stored in another dtype than the spec gives them."""
from __future__ import annotations

from typing import Any

from ...errors import ForeignFormatError, UclError
from ...lang.expr import ExprError, evaluate_extent, evaluate_lets
from ...lang.spec import Spec

# per spec: the layer prefix, the embedding, and the tied embedding's name on the last stage
_CORE = ("stdlib:megatron_gpt", "decoder.layers.", "embedding.word_embeddings.weight", "output_layer.weight")
_LEGACY = ("stdlib:megatron_legacy_gpt", "language_model.encoder.layers.",
           "language_model.embedding.word_embeddings.weight", "word_embeddings_for_head.weight")


def arg(args: dict, name: str, default: Any = None) -> Any:
    v = args.get(name, default)
    return default if v is None else v


def int_arg(args: dict, name: str, default: int | None = None) -> int:
    v = arg(args, name, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ForeignFormatError(f"args.{name} is {v!r}: not a usable whole number")
    return v


def dims_from_args(args: dict, spec: Spec) -> dict[str, int]:
    """The spec's dims from Megatron-LM's argument names (as ``validate_args`` leaves them)."""
    heads, hidden = int_arg(args, "num_attention_heads"), int_arg(args, "hidden_size")
    layers, pp = int_arg(args, "num_layers"), int_arg(args, "pipeline_model_parallel_size", 1)
    vpp = arg(args, "virtual_pipeline_model_parallel_size")
    if vpp is None and arg(args, "num_layers_per_virtual_pipeline_stage") is not None:
        vpp = layers // max(1, pp * int_arg(args, "num_layers_per_virtual_pipeline_stage"))
    experts = int_arg(args, "num_experts", 0)
    ffn = int_arg(args, "ffn_hidden_size")
    dims = {
        "vocab": int_arg(args, "padded_vocab_size"),  # the stored rows (see the module doc)
        "hidden": hidden, "heads": heads,
        # num_query_groups counts only with group_query_attention (it defaults to 1 otherwise)
        "kv_heads": int_arg(args, "num_query_groups") if arg(args, "group_query_attention", False) else heads,
        "head_dim": int_arg(args, "kv_channels", hidden // heads if heads else 0),
        "ffn": ffn, "swiglu": int(bool(arg(args, "swiglu", False))), "layers": layers,
        "vpp": int(vpp or 1), "experts": experts,
        "moe_ffn": int_arg(args, "moe_ffn_hidden_size", ffn if experts else 0),
        "shared_ffn": int_arg(args, "moe_shared_expert_intermediate_size", 0),
        "untied": int(bool(arg(args, "untie_embeddings_and_output_weights", False))),
    }
    return {d: dims[d] for d in spec.dims if d in dims}


def which_spec(modules: list[list[dict]]) -> tuple[str, str, str, str]:
    names = {n for chunks in modules for m in chunks for n in m}
    if any(n.startswith("language_model.") for n in names):
        return _LEGACY
    if any(n.startswith(("decoder.", "embedding.")) for n in names):
        return _CORE
    sample = sorted(names)[:3]
    raise ForeignFormatError(f"the module state dicts hold neither megatron-core GPTModel names (decoder.layers...) nor legacy "
                 f"GPT names (language_model...); e.g. {sample}")


def global_shapes(spec: Spec, dims: dict, local: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """Each tensor's global shape: the one its rule declares; a rule declaring none replicates it
    (the stdlib Megatron specs declare a shape wherever they split), so the stored one. The
    lowering then proves every rank's stored shape."""
    env, _ = evaluate_lets(spec.checked.lets, dims)
    out = {}
    for name, shape in local.items():
        rules = [r for r in spec.checked.rules if r.pattern.match(name)]
        if len(rules) != 1 or rules[0].shape is None:
            out[name] = shape  # no rule or several: bind names the problem
            continue
        try:
            out[name] = tuple(evaluate_extent(e, env, f"dim {d} of {name}") for d, e in enumerate(rules[0].shape))
        except ExprError:
            out[name] = shape  # bind reports the broken expression at its span
    return out


def with_dtypes(base: Spec, spec_name: str, dims: dict, params: dict, stored: dict, path: str) -> tuple[str, Spec]:
    """The spec text plus ``state param for ... : dtype`` lines for tensors stored in another dtype
    than the spec gives them (fp32 or fp16 runs; fp32 norms in a bf16 model)."""
    try:
        declared = {t.name: t.dtype for t in base.bind(dims, params, frozen=tuple(params)).tensors}
    except UclError as e:
        raise ForeignFormatError(f"{path}: the tensors of the Megatron-LM files do not fit {spec_name} with the dims of args "
                     f"({', '.join(f'{k}={v}' for k, v in dims.items())}):\n{e}") from None
    other: dict[str, list[str]] = {}
    for name, dtype in stored.items():
        if declared.get(name) != dtype:
            other.setdefault(dtype, []).append(name)
    if not other:
        return base.text, base
    lines = ["# added by ucl: the dtypes the Megatron-LM files hold"]
    if len(other) == 1 and sum(map(len, other.values())) == len(stored):
        lines.append(f"state param for ** : dtype {next(iter(other))}")  # one dtype throughout (fp32, fp16 runs)
    else:
        for dtype, names in sorted(other.items()):
            lines.append(f"state param for {' | '.join(names)}\n    : dtype {dtype}")
    text = base.text.rstrip("\n") + "\n" + "\n".join(lines) + "\n"
    return text, Spec.from_text(text, filename=f"{path} [{spec_name} + dtypes]", name=spec_name)
