"""What each layer of a Hugging Face model holds, from its config: dense and MoE layers mixed
(DeepSeek's ``first_k_dense_replace``, Qwen's ``mlp_only_layers`` and ``decoder_sparse_step``), and
the tensors a spec's rules say a folder must have, layer by layer (the completeness check of
reading a folder in place: no fewer tensors than the config says, and none of the wrong kind).

A spec's rule is an *expert* rule when its pattern names a MoE block's experts, router or shared
experts (``mlp.experts.``, ``mlp.gate.``, ``mlp.shared_expert(s)``), a *dense-MLP* rule when it names
a dense MLP's projections (``mlp.gate_proj`` ...); any other rule applies to every layer.
"""
from __future__ import annotations

import re
from typing import Iterable, Mapping, Sequence

from ...lang import ast
from ...lang.expr import ExprError, evaluate, evaluate_lets

_BLOCK = r"\.(?:mlp|block_sparse_moe|feed_forward|moe)\."
_EXPERT = re.compile(_BLOCK + r"(?:experts|shared_experts?|shared_expert_gate|gate|router)(?:\.|$)")
_DENSE = re.compile(_BLOCK + r"(?:gate_proj|up_proj|down_proj|gate_up_proj|fc1|fc2|w1|w2|w3)(?:\.|$)")
_EXPERT_COUNTS = ("n_routed_experts", "num_experts", "num_local_experts", "moe_num_experts")


def rule_kind(pattern: str) -> str | None:
    """``"sparse"`` (a MoE block's tensors), ``"dense"`` (a dense MLP's) or None (every layer)."""
    if _EXPERT.search(pattern):
        return "sparse"
    if _DENSE.search(pattern):
        return "dense"
    return None


def layer_kinds(config: Mapping, layers: int) -> list[str] | None:
    """``"dense"`` or ``"sparse"`` per layer, as the model classes of transformers decide it, or None
    for a model without experts (every layer alike). ``config``: the fields (class defaults filled in
    where the file leaves them out)."""
    experts = next((config[k] for k in _EXPERT_COUNTS if isinstance(config.get(k), int)), None)
    if not experts:
        return None
    if isinstance(config.get("first_k_dense_replace"), int):  # DeepSeek-V2/V3, GLM-4-MoE, ...
        k = config["first_k_dense_replace"]
        return ["sparse" if i >= k else "dense" for i in range(layers)]
    only = config.get("mlp_only_layers") or []
    step = config.get("decoder_sparse_step")
    step = step if isinstance(step, int) and step > 0 else 1
    return ["dense" if i in only or (i + 1) % step else "sparse" for i in range(layers)]


def needs_defaults(config: Mapping) -> bool:
    """Does deciding the layer kinds need class defaults the file leaves out? (Then the reader asks
    transformers for them: save_pretrained writes every field, so only a hand-written config.json of a
    stdlib MoE type without ``first_k_dense_replace``/``mlp_only_layers`` costs that import; copying
    the classes' defaults here would go stale with transformers.)"""
    if not any(isinstance(config.get(k), int) for k in _EXPERT_COUNTS):
        return False
    mt = str(config.get("model_type", ""))
    if mt.startswith(("deepseek", "glm4_moe")):
        return "first_k_dense_replace" not in config
    if mt.startswith("qwen"):
        return "mlp_only_layers" not in config or "decoder_sparse_step" not in config
    return False


def _optional(rule, env: Mapping[str, int]) -> bool:
    for t in rule.transforms:
        if isinstance(t, ast.OptionalMark):
            return t.condition is None or evaluate(t.condition, env) != 0
    return False


def _layer_capture(spec) -> tuple[str | None, int]:
    """The capture the layers are indexed by (``index i of layers over pp``) and its count."""
    for r in list(spec.checked.placements) + list(spec.checked.rules):
        for t in r.transforms:
            if isinstance(t, ast.Index):
                return t.capture.name, t.count
    return None, 0


def completeness(spec, dims: Mapping[str, int], names: Iterable[str], kinds: Sequence[str] | None) -> list[str]:
    """Problems (empty: none) of the folder's tensor ``names`` against the rules of ``spec``: a
    tensor every such model has is missing (rules not ``optional``, without globs, per layer where
    the layer's kind has it), or a layer holds a tensor of the other kind (experts in a dense layer)."""
    present = set(names)
    env, _ = evaluate_lets(spec.checked.lets, dict(dims))
    cap, count_expr = _layer_capture(spec)
    try:
        layers = evaluate(count_expr, env) if cap is not None else 0
    except ExprError:
        layers = 0
    missing: list[str] = []
    wrong: list[str] = []
    for rule in spec.checked.rules:
        text = rule.pattern.text
        caps = rule.pattern.captures
        kind = rule_kind(text)
        if not caps:
            try:
                needed = "*" not in text and not _optional(rule, env)
            except ExprError:
                needed = False
            if needed and text not in present:
                missing.append(text)
            continue
        if caps != (cap,):
            continue  # a rule of several captures (per expert): its count is not the config's to say
        try:
            needed = "*" not in text and not _optional(rule, env)
        except ExprError:
            needed = False
        for i in range(layers):
            name = text.replace("{" + cap + "}", str(i))
            fits = kinds is None or kind is None or i >= len(kinds) or kinds[i] == kind
            if needed and fits and name not in present:
                missing.append(name)
        if kinds is not None and kind is not None:
            for n in present:
                m = rule.pattern.match(n)
                if m:
                    i = int(m.group(cap))
                    if i < len(kinds) and kinds[i] != kind:
                        wrong.append(f"{n} ({kind} tensor in layer {i}, which the config makes {kinds[i]})")
    out = []
    if missing:
        out.append(f"lacks {len(missing)} tensor(s) the spec with the dims of config.json expects "
                   f"(e.g. {missing[:3]})")
    if wrong:
        out.append(f"holds {len(wrong)} tensor(s) of the wrong layer kind (e.g. {sorted(wrong)[:2]})")
    return out
