"""``ucl spec from-hf``: draft a .ucl spec for a transformers causal LM from its config, its own
tensor-parallel plan and the parameter names/shapes of a meta-device instance."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping

from ...errors import StoreError, did_you_mean
from ...model_config import read_raw_config
from .names import Shapes


# ---- drafting a spec from a transformers model ---------------------------------------------------
# config field (canonical transformers name) -> dim name used in drafts
_KNOWN_DIMS = [
    ("vocab_size", "vocab"), ("hidden_size", "hidden"), ("num_attention_heads", "heads"),
    ("num_key_value_heads", "kv_heads"), ("head_dim", "head_dim"), ("intermediate_size", "ffn"),
    ("moe_intermediate_size", "moe_ffn"), ("shared_expert_intermediate_size", "shared_ffn"),
    ("num_local_experts", "experts"), ("num_experts", "experts"), ("n_routed_experts", "experts"),
    ("n_shared_experts", "shared_experts"), ("q_lora_rank", "q_lora_rank"),
    ("kv_lora_rank", "kv_lora_rank"), ("qk_nope_head_dim", "qk_nope"), ("qk_rope_head_dim", "qk_rope"),
    ("v_head_dim", "v_head"), ("max_position_embeddings", "positions"), ("n_inner", "ffn"),
    ("num_hidden_layers", "layers"),
]
# TP styles of transformers (distributed/tensor_parallel.py) -> what happens to a parameter
_COLWISE = {"colwise", "colwise_gather_output", "local_colwise", "embedding_rowwise", "vocab_parallel"}
_ROWWISE = {"rowwise", "rowwise_split_input", "local_rowwise"}
_PACKED = {"packed_colwise", "local_packed_colwise"}
_REPLICATED = {"replicated_with_grad_allreduce", "replicate", "isolated", "gather", "sequence_parallel",
               "moe_tp_experts", "ep_router", "ep_dispatch_experts"}


def _generic(name: str) -> str:
    """transformers' plan key for a parameter: layer numbers between dots replaced by ``*``."""
    return re.sub(r"\.\d+(?=\.|$)", ".*", name)


def _style(name: str, plan: Mapping[str, str]) -> str | None:
    g = _generic(name)
    if g in plan:
        return plan[g]
    parent = g.rsplit(".", 1)[0] if "." in g else None
    return plan.get(parent) if parent else None


class _Exprs:
    """Finds a short expression of config dims for a number. With a second, perturbed instance of
    the model (every recognised dim changed by its own factor) an expression must give the right
    value in both, which tells apart dims that happen to be equal in the given config."""

    def __init__(self, dims: dict[str, int], dims2: dict[str, int] | None = None):
        names = [n for n, v in dims.items() if v > 0 and n not in ("layers", "tied")]
        d2 = dims2 if dims2 is not None else dims
        cand: list[tuple[str, int, int]] = []

        def add(text, f):
            cand.append((text, f(dims), f(d2)))

        for n in names:
            add(n, lambda d, n=n: d[n])
        for k in (2, 3, 4):
            for n in names:
                add(f"{k} * {n}", lambda d, k=k, n=n: k * d[n])
        for x, a in enumerate(names):
            for b in names[x:]:
                add(f"{a} * {b}", lambda d, a=a, b=b: d[a] * d[b])
        for x, a in enumerate(names):
            for b in names[x + 1:]:
                add(f"{a} + {b}", lambda d, a=a, b=b: d[a] + d[b])
        for x, a in enumerate(names):
            for b in names[x + 1:]:
                for c in names:
                    add(f"{c} * ({a} + {b})", lambda d, a=a, b=b, c=c: d[c] * (d[a] + d[b]))
        for a in names:
            for b in names:
                for c in names:
                    if a != b:
                        add(f"({a} + 2 * {b}) * {c}", lambda d, a=a, b=b, c=c: (d[a] + 2 * d[b]) * d[c])
        self.by_pair: dict[tuple[int, int], str] = {}
        for text, v1, v2 in cand:
            self.by_pair.setdefault((v1, v2), text)

    def __call__(self, v: int, v2: int | None = None) -> str:
        return self.by_pair.get((v, v if v2 is None else v2), str(v))


# perturbation factors of the second instance (config field -> new value), chosen to keep the
# usual divisibility constraints (kv_heads | heads, heads | hidden: heads grow x6 with hidden,
# kv_heads x2; n_group | experts; even rope dims)
_PERTURB = {"vocab_size": lambda v: v + 1, "hidden_size": lambda v: 6 * v, "head_dim": lambda v: 5 * v,
            "intermediate_size": lambda v: 7 * v, "n_inner": lambda v: 7 * v,
            "moe_intermediate_size": lambda v: 11 * v, "shared_expert_intermediate_size": lambda v: 13 * v,
            "num_local_experts": lambda v: 19 * v, "num_experts": lambda v: 19 * v,
            "n_routed_experts": lambda v: 19 * v, "q_lora_rank": lambda v: 23 * v,
            "kv_lora_rank": lambda v: 29 * v, "qk_nope_head_dim": lambda v: 31 * v,
            "qk_rope_head_dim": lambda v: 37 * v, "v_head_dim": lambda v: 41 * v,
            "max_position_embeddings": lambda v: 43 * v, "n_shared_experts": lambda v: 2 * v + 1}


def _meta_model(config):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

    if not isinstance(config, PretrainedConfig):
        if isinstance(config, Mapping):
            fields = dict(config)
            config = AutoConfig.for_model(fields.pop("model_type"), **fields)
        else:
            config = AutoConfig.from_pretrained(str(config))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return config, model


def _perturbed_shapes(config, keys: dict[str, str]) -> tuple[dict[str, int], Shapes] | None:
    """Dims and parameter shapes of a second meta instance whose recognised dims are perturbed
    (``keys``: canonical field -> key in ``config.to_dict()``); None if no variant instantiates."""
    import warnings
    cfg = config.to_dict()
    # heads x6 and kv_heads x2 (kv_heads | heads and heads | hidden (x6) stay true), else unchanged
    for scale_heads, scale_kv in ((6, 2), (1, 1)):
        fields = dict(cfg)
        for field, key in keys.items():
            if field in _PERTURB:
                fields[key] = _PERTURB[field](int(cfg[key]))
        for f, k in (("num_attention_heads", scale_heads), ("num_key_value_heads", scale_kv)):
            if f in keys:
                fields[keys[f]] = int(cfg[keys[f]]) * k
        fields.pop("model_type", None)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                _, model = _meta_model({"model_type": config.model_type, **fields})
        except Exception:
            continue
        sd = set(model.state_dict().keys())
        shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
        shapes.update({n: tuple(b.shape) for n, b in model.named_buffers() if n in sd})
        return {f: int(fields[k]) for f, k in keys.items()}, shapes
    return None


def draft_spec_from_hf(config_or_dir, *, name: str | None = None) -> str:
    """A starting ``.ucl`` for a transformers causal LM: ``config_or_dir`` is a ``PretrainedConfig``,
    a config dict (with ``model_type``) or a folder / ``config.json`` path.

    The model is instantiated on the meta device (no memory, no download) to list
    ``named_parameters()`` and persistent buffers. Layer numbers become ``{i}`` (further numbered
    segments ``{j}``, ``{k}``); shapes are written with the config dims whose values fit; the
    tensor-parallel plan (``model._tp_plan``, i.e. ``base_model_tp_plan`` plus embedding/lm_head)
    gives the ``tp`` splits; experts named in ``base_model_ep_plan`` split dim 0 over ``ep``; every
    parameter is then FSDP2-sharded over ``dp`` (dim 0 of the TP-local tensor); layers are indexed
    over ``pp``, parameters before them on the first stage and after them on the last; optimizer
    states follow their parameter. Review the result: see docs/stdlib.md for what cannot be inferred.
    """
    raw, config, model = _build_model(config_or_dir)
    dims, fields, field_of = _recognised_dims(config)
    facts = _model_facts(config, model)
    shapes = _ShapeWriter.for_model(config, dims, fields, field_of)
    entries = _entries_by_pattern(facts, shapes.second_shapes)
    lines, uses_ep = [], False
    for pat, e in entries.items():
        line, ep = _rule_line(pat, e, facts, shapes)
        lines.append(line)
        uses_ep |= ep
    decl, lets = _declarations(dict(dims), shapes, raw, facts)
    return _assemble(name or getattr(config, "model_type", "model"), type(model).__name__, facts, decl, lets,
                     ["pp", "dp"] + (["ep"] if uses_ep else []) + ["tp"], lines)


# ---- the steps of a draft --------------------------------------------------------------------------
def _build_model(config_or_dir):
    """(the fields the user's config really has or None for a PretrainedConfig, the config, a meta-device
    model). A spec's ``--dims CONFIG`` reads only the raw fields, so the draft must know them."""
    raw = None
    if not hasattr(config_or_dir, "to_dict"):
        raw = read_raw_config(config_or_dir)  # a missing or unreadable config is a StoreError
        _check_model_type(raw, config_or_dir)
    try:
        config, model = _meta_model(raw if raw is not None else config_or_dir)
    except Exception as e:  # transformers' own errors (bad fields, missing packages), on one short line
        text = " ".join(str(e).split()) or type(e).__name__
        text = text if len(text) <= 300 else text[:300] + "..."
        raise StoreError(f"transformers cannot build a model from {_where(config_or_dir)}: {text}",
                         code="UCL423") from None
    return raw, config, model


def _where(config_or_dir) -> str:
    return "the config" if isinstance(config_or_dir, Mapping) else str(config_or_dir)


def _check_model_type(raw: dict, source) -> None:
    """A clear UCL423 for a config without ``model_type`` or with one transformers does not know
    (transformers' own message lists every known type: kilobytes)."""
    model_type = raw.get("model_type")
    if not model_type:
        raise StoreError(f"{_where(source)} has no model_type, so transformers cannot tell which model it "
                         "describes; add one, e.g. \"model_type\": \"llama\"", code="UCL423")
    known = _known_model_types()
    if known is None or model_type in known:
        return
    guess = did_you_mean(str(model_type), known)
    examples = ", ".join(t for t in ("llama", "mistral", "qwen2", "gemma", "mixtral", "gpt2") if t in known)
    raise StoreError(f"{_where(source)}: unknown model_type {model_type!r}; this transformers knows "
                     f"{len(known)} model types" + (f"; {guess}" if guess else f" (e.g. {examples})"),
                     code="UCL423")


def _known_model_types() -> list[str] | None:
    """The model types of the installed transformers, or None without it (then transformers' error
    on building the model says what is wrong)."""
    try:
        from transformers import CONFIG_MAPPING
        return sorted(CONFIG_MAPPING.keys())
    except Exception:
        return None


def _recognised_dims(config):
    """Dims from the config fields we recognise (canonical name, or its alias key in ``to_dict()``):
    (dim -> (key, value), canonical field -> key, dim -> canonical field)."""
    cfg = config.to_dict()
    attr_map = dict(getattr(config, "attribute_map", {}) or {})
    dims: dict[str, tuple[str, int]] = {}
    fields: dict[str, str] = {}
    for field, dim in _KNOWN_DIMS:
        key = field if cfg.get(field) is not None else attr_map.get(field)
        if key is None or isinstance(cfg.get(key), bool) or not isinstance(cfg.get(key), int):
            continue
        if dim not in dims:
            dims[dim] = (key, int(cfg[key]))
            fields[field] = key
    field_of = {dim: field for field, dim in _KNOWN_DIMS if fields.get(field) == dims.get(dim, ("",))[0]}
    return dims, fields, field_of


@dataclass
class _Facts:
    """What the meta-device model says about its tensors and parallel plans."""

    params: list[tuple[str, tuple[int, ...]]]
    buffers: list[tuple[str, tuple[int, ...]]]  # persistent ones (in state_dict())
    plan: dict[str, str]  # generic parameter name -> TP style
    ep_keys: set[str]  # generic names of expert parameters split over ep
    embed_name: str | None
    layer_prefix: str | None  # ``model.layers.``: the first numbered module list
    tied: bool


def _model_facts(config, model) -> _Facts:
    params = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    sd_keys = set(model.state_dict().keys())
    buffers = [(n, tuple(b.shape)) for n, b in model.named_buffers() if n in sd_keys]
    plan = dict(getattr(model, "_tp_plan", None) or {})
    if not plan:
        base = getattr(config, "base_model_tp_plan", None) or {}
        prefix = model.base_model_prefix
        plan = {f"{prefix}.{k}": v for k, v in base.items()}
    ep_plan = getattr(config, "base_model_ep_plan", None) or {}
    ep_keys = {f"{model.base_model_prefix}.{k}" for k, v in ep_plan.items() if v == "grouped_gemm"}
    embed = model.get_input_embeddings()
    embed_name = next((n for n, p in model.named_parameters() if embed is not None and p is embed.weight), None)
    layer_prefix = None
    for n, _ in params:
        m = re.match(r"^(.*?\.)\d+\.", n)
        if m:
            layer_prefix = m.group(1)
            break
    return _Facts(params, buffers, plan, ep_keys, embed_name, layer_prefix,
                  bool(getattr(config, "tie_word_embeddings", False)))


class _ShapeWriter:
    """Writes shapes as expressions of the recognised dims (checked on a perturbed second instance
    when one builds) and records which dims the draft uses."""

    def __init__(self, dims, values, dims2, second_shapes, derived_head_dim):
        self.dims = dims  # dim -> (config key, value)
        self.values = values  # dim -> value, with a derived head_dim
        self.dims2 = dims2  # the same dims in the perturbed instance, or None
        self.second_shapes = second_shapes  # parameter -> shape in the perturbed instance
        self.derived_head_dim = derived_head_dim  # written as `let head_dim = hidden / heads`
        self.ex = _Exprs(values, dims2)
        self.used: set[str] = set()

    @classmethod
    def for_model(cls, config, dims, fields, field_of) -> "_ShapeWriter":
        second = _perturbed_shapes(config, fields)
        dims2 = {d: second[0][field_of[d]] for d in dims} if second else None
        values = {d: v for d, (_, v) in dims.items()}
        derived_head_dim = bool("head_dim" not in values and values.get("hidden") and values.get("heads")
                                and values["hidden"] % values["heads"] == 0)
        if derived_head_dim:
            values["head_dim"] = values["hidden"] // values["heads"]
            if dims2 is not None:
                dims2["head_dim"] = dims2["hidden"] // dims2["heads"]
        return cls(dims, values, dims2, second[1] if second else {}, derived_head_dim)

    def use(self, text: str) -> str:
        self.used.update(re.findall(r"[A-Za-z_]\w*", text))
        return text

    def shape(self, shapes: set, shapes2: set) -> str | None:
        if len(shapes) != 1:
            return None
        (shape,) = shapes
        shape2 = next(iter(shapes2)) if len(shapes2) == 1 and self.dims2 else None
        if shape2 is None or len(shape2) != len(shape):
            parts = [self.ex(v) for v in shape] if self.dims2 is None else [str(v) for v in shape]
        else:
            parts = [self.ex(v, w) for v, w in zip(shape, shape2)]
        return "[" + ", ".join(self.use(p) for p in parts) + "]"

    def half(self, sizes: set, sizes2: set) -> str:
        """Half of a packed [gate|up] dim."""
        v = next(iter(sizes)) // 2
        if len(sizes) == 1 and len(sizes2) == 1 and self.dims2:
            return self.use(self.ex(v, next(iter(sizes2)) // 2))
        return self.use(str(v) if self.dims2 else self.ex(v))


def _pattern(name: str) -> str:
    """Numbered segments become captures: ``{i}`` for the layer, then ``{j}``, ``{k}``..."""
    caps = iter("ijklmn")
    return re.sub(r"(?<=\.)\d+(?=\.|$)", lambda m: "{" + next(caps) + "}", name)


def _entries_by_pattern(facts: _Facts, second_shapes) -> dict[str, dict]:
    """Parameters and persistent buffers grouped by pattern, in model order, with their stage."""
    entries: dict[str, dict] = {}
    seen_layers = False
    for n, shape in facts.params + facts.buffers:
        pat = _pattern(n)
        in_layers = facts.layer_prefix is not None and n.startswith(facts.layer_prefix) and pat != n
        seen_layers |= in_layers
        e = entries.setdefault(pat, dict(names=[], shapes=set(), shapes2=set(), buffer=False, in_layers=in_layers,
                                         stage=None if in_layers else ("last" if seen_layers else "first")))
        e["names"].append(n)
        e["shapes"].add(shape)
        if n in second_shapes:
            e["shapes2"].add(second_shapes[n])
        e["buffer"] = e["buffer"] or (n, shape) in facts.buffers
    return entries


def _rule_line(pat: str, e: dict, facts: _Facts, shapes: _ShapeWriter) -> tuple[str, bool]:
    """The layout rule of one pattern, and whether it splits over ep."""
    first = e["names"][0]
    ndim = len(next(iter(e["shapes"])))
    style = _style(first, facts.plan)
    leaf = first.rsplit(".", 1)[-1]
    t: list[str] = []
    note = ""
    uses_ep = False
    if e["buffer"]:
        t.append("replicate")
        note = "persistent buffer: not sharded by FSDP2; pass it to bind(frozen=...)"
    else:
        if _generic(first) in facts.ep_keys and ndim >= 1:
            t.append("split 0 over ep")
            uses_ep = True
        view, splits, packed_dim, note = _tp_transforms(style, leaf, ndim, e, shapes)
        t = view + t + splits
        if ndim >= 1:
            if packed_dim == 0:
                t.append("split 1 over dp uneven" if ndim >= 2 else "replicate over dp")
            else:
                # FSDP2: dim 0 of the (EP-, TP-local) tensor; after a split of dim 0 it splits again
                t.append("split 0 over dp uneven")
        else:
            t.append("replicate")
    t += _placement(e, first, facts, shapes)
    shp = shapes.shape(e["shapes"], e["shapes2"])
    line = f"{pat}{f' {shp}' if shp else ''} : " + "; ".join(t)
    if style is not None or note:
        line += f"    # {style or ''}{': ' if style and note else ''}{note}"
    return line, uses_ep


def _tp_transforms(style, leaf: str, ndim: int, e: dict, shapes: _ShapeWriter):
    """Tensor parallelism of one parameter from its TP style: (a view to put first, the tp split,
    the dim of a packed [gate|up] split or None, a note for the comment)."""
    if style in _COLWISE and ndim >= 1:
        return [], [f"split {max(ndim - 2, 0) if leaf != 'bias' else 0} over tp uneven"], None, ""
    if style in _ROWWISE and ndim >= 1:
        return [], ([f"split {ndim - 1} over tp uneven"] if leaf != "bias" else []), None, ""
    if style in _PACKED and ndim >= 1:
        d = max(ndim - 2, 0) if leaf != "bias" else 0
        half = shapes.half({s[d] for s in e["shapes"]}, {s[d] for s in e["shapes2"] if len(s) > d})
        return [f"view {d} as [2, {half}]"], [f"split {d}.1 over tp uneven"], d, ""
    if style is not None and style not in _REPLICATED:
        return [], [], None, f"unknown TP style {style!r}: replicated over tp here"
    return [], [], None, ""


def _placement(e: dict, first: str, facts: _Facts, shapes: _ShapeWriter) -> list[str]:
    """Pipeline stage of a parameter outside the layers: the embedding also on the last stage when tied."""
    if e["stage"] == "first":
        if first == facts.embed_name:
            shapes.used.add("tied")
            return ["on pp = first, (pp - 1) * tied"]
        return ["on pp = first"]
    if e["stage"] == "last":
        return ["on pp = last"]
    return []


def _declarations(dims: dict, shapes: _ShapeWriter, raw: dict | None, facts: _Facts) -> tuple[list[str], list[str]]:
    """The ``dims`` declarations and ``let`` lines. A dim the config file leaves to the class default
    cannot be read from it: it is derived (head_dim) or fixed by a ``let``."""
    used, values = shapes.used, shapes.values
    if facts.layer_prefix is not None:
        used.add("layers")
    lets = []
    if shapes.derived_head_dim and "head_dim" in used:
        used |= {"hidden", "heads"}
        lets.append("let head_dim = hidden / heads")
    missing = {d for d, (key, _) in dims.items() if d in used and raw is not None and raw.get(key) is None}
    if "tied" in used and raw is not None and raw.get("tie_word_embeddings") is None:
        missing.add("tied")
    if "head_dim" in missing and values.get("hidden") and values.get("heads") \
            and values["hidden"] == values["heads"] * values["head_dim"]:
        missing.discard("head_dim")
        del dims["head_dim"]
        used |= {"hidden", "heads"}
        lets.append("let head_dim = hidden / heads  # config.json has no head_dim")
    for d in sorted(missing):
        value = int(facts.tied) if d == "tied" else dims.pop(d)[1]
        lets.append(f"let {d} = {value}  # the class default: config.json does not set it")
    decl = [d if d == key else f"{d} from {key}" for d, (key, _) in dims.items() if d in used and d not in missing]
    if "tied" in used and "tied" not in missing:
        decl.append("tied from tie_word_embeddings")
    return decl, lets


def _assemble(title: str, class_name: str, facts: _Facts, decl: list[str], lets: list[str], axes: list[str],
              lines: list[str]) -> str:
    out = [
        f"# Draft spec for {title} ({class_name}), written by `ucl spec from-hf`.",
        "# transformers names; tp from the model's tensor-parallel plan, FSDP2 over dp (dim 0 of the",
        "# TP-local tensor), layers in contiguous blocks over pp, optimizer states follow their parameter.",
        "# REVIEW IT: shapes were matched to config dims by value (on the model and on a perturbed copy),",
        "# fused tensors other than packed [gate|up] are split as plain blocks, and",
        "# everything docs/stdlib.md lists under `from-hf` limits still needs a human.",
        f"# Tied embeddings: {'yes' if facts.tied else 'no'}.",
        "",
        "dims " + ",\n    ".join(decl) if decl else "",
        *lets,
        f"mesh {', '.join(axes)}",
        "",
    ]
    if facts.layer_prefix is not None:
        out.append(f"{facts.layer_prefix}{{i}}.** : index i of layers over pp first layers - (pp - 1) * (layers // pp)")
        out.append("")
    out += lines
    out += ["", "state exp_avg, exp_avg_sq : follow", "state step : scalar", ""]
    return "\n".join(out)
