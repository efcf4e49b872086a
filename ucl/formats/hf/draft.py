"""``ucl spec from-hf``: draft a .ucl spec for a transformers causal LM from its config, its own
tensor-parallel plan and the parameter names/shapes of a meta-device instance."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping

from ...errors import StoreError, did_you_mean
from ...model_config import read_raw_config
from .draft_dims import ShapeWriter, layer_count_key, recognised_dims
from .draft_tp import derive
from .meta import meta_model


# ---- drafting a spec from a transformers model ---------------------------------------------------
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
    raw = None if hasattr(config_or_dir, "to_dict") else read_raw_config(config_or_dir)
    draft = _remember(_digest(raw if raw is not None else config_or_dir.to_dict(), name),
                      lambda: _draft(_build_model(config_or_dir, raw), name))
    return _assemble(draft, [*draft.lines, *_saved_dtypes(config_or_dir)])


def draft_with_model(config_file, *, name: str | None = None) -> tuple[str, object]:
    """The HF reader's draft of a folder's ``config.json``: the text without the folder's saved dtypes
    (the reader gives every tensor the dtype its header says, and caches the text by config, not by
    folder), and the meta-device model it is drafted from (the names it holds, how it saves them),
    built once for both."""
    raw = read_raw_config(config_file)
    built = _build_model(config_file, raw)
    draft = _remember(_digest(raw, name), lambda: _draft(built, name))
    return _assemble(draft, draft.lines), built[2]


def _remember(key: str, make) -> "_Draft":
    draft = _DRAFTS.pop(key, None) or make()
    _DRAFTS[key] = draft  # most recent last
    while len(_DRAFTS) > _DRAFTS_KEPT:
        del _DRAFTS[next(iter(_DRAFTS))]
    return draft


@dataclass(frozen=True)
class _Draft:
    """A draft before the saved dtypes of a folder are added (what the cache keeps)."""

    title: str
    class_name: str
    tied: bool
    layer_prefix: str | None
    decl: tuple[str, ...]
    lets: tuple[str, ...]
    axes: tuple[str, ...]
    lines: tuple[str, ...]


# drafts by config digest: the HF reader drafts on the fly, and a draft builds up to a dozen meta models
_DRAFTS: dict[str, _Draft] = {}
_DRAFTS_KEPT = 64


def _digest(fields: Mapping, name: str | None) -> str:
    import hashlib
    import json
    try:
        from transformers import __version__ as version
    except ImportError:
        version = None
    text = json.dumps({"fields": fields, "name": name, "transformers": version}, sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()


def _draft(built: tuple, name: str | None) -> _Draft:
    raw, config, model = built
    dims = recognised_dims(config)
    facts = _model_facts(config, model)
    shapes = ShapeWriter(config, dims)
    entries = _entries_by_pattern(facts, shapes.second_shapes)
    lines, uses_ep = [], False
    for pat, e in entries.items():
        line, ep = _rule_line(pat, e, facts, shapes)
        lines.append(line)
        uses_ep |= ep
    decl, lets = _declarations(dict(shapes.dims), shapes, raw, facts, config)
    return _Draft(name or getattr(config, "model_type", "model"), type(model).__name__, facts.tied,
                  facts.layer_prefix, tuple(decl), tuple(lets),
                  ("pp", "dp") + (("ep",) if uses_ep else ()) + ("tp",), tuple(lines))


# ---- the steps of a draft --------------------------------------------------------------------------
def _build_model(config_or_dir, raw: dict | None):
    """(the fields the user's config really has (``raw``, read by the caller) or None for a
    PretrainedConfig, the config, a meta-device model). A spec's ``--dims CONFIG`` reads only the raw
    fields, so the draft must know them."""
    if raw is not None:
        _check_model_type(raw, config_or_dir)
    try:
        config, model = meta_model(raw if raw is not None else config_or_dir)
    except Exception as e:  # transformers' own errors (bad fields, missing packages), on one short line
        text = " ".join(str(e).split()) or type(e).__name__
        text = text if len(text) <= 300 else text[:300] + "..."
        raise StoreError(f"transformers cannot build a model from {_where(config_or_dir)}: {text}",
                         code="UCL423") from None
    return raw, config, model


def _saved_dtypes(config_or_dir) -> list[str]:
    """``state param : dtype T`` for a folder whose saved tensors all have one dtype other than float32
    (a config alone says nothing reliable about the stored dtype); a comment when they are mixed."""
    if isinstance(config_or_dir, Mapping) or hasattr(config_or_dir, "to_dict"):
        return []
    from pathlib import Path
    from .names import read_saved_tensors
    folder = Path(config_or_dir)
    folder = folder.parent if folder.is_file() else folder
    try:
        dtypes = {e.dtype for _, e in read_saved_tensors(folder).values()}
    except StoreError:  # a config without weights next to it
        return []
    if len(dtypes) == 1 and dtypes != {"float32"}:
        return ["", f"state param : dtype {dtypes.pop()}  # as saved in {folder.name}"]
    if len(dtypes) > 1:
        return ["", f"# the saved tensors mix dtypes {sorted(dtypes)}: give each its `state param for ... : dtype`"]
    return []


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
    model: object  # the meta-device model (its modules say how to split what the TP plan leaves out)


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
                  bool(getattr(config, "tie_word_embeddings", False)), model)


def _pattern(name: str) -> str:
    """Numbered segments become captures: ``{i}`` for the layer, then ``{j}``, ``{k}``..."""
    caps = iter("ijklmn")
    return re.sub(r"(?<=\.)\d+(?=\.|$)", lambda m: "{" + next(caps) + "}", name)


# modules registered before the layers but applied after them (OPT's decoder registers
# final_layer_norm and project_out ahead of its layers): their stage is the last
_AFTER_LAYERS = re.compile(r"^final_|^project_out$")


def _entries_by_pattern(facts: _Facts, second_shapes) -> dict[str, dict]:
    """Parameters and persistent buffers grouped by pattern, in model order, with their stage."""
    entries: dict[str, dict] = {}
    seen_layers = False
    for n, shape in facts.params + facts.buffers:
        pat = _pattern(n)
        in_layers = facts.layer_prefix is not None and n.startswith(facts.layer_prefix) and pat != n
        seen_layers |= in_layers
        after = seen_layers or _AFTER_LAYERS.search(n.rsplit(".", 1)[0].rsplit(".", 1)[-1])
        e = entries.setdefault(pat, dict(names=[], shapes=set(), shapes2=set(), buffer=False, in_layers=in_layers,
                                         stage=None if in_layers else ("last" if after else "first")))
        e["names"].append(n)
        e["shapes"].add(shape)
        if n in second_shapes:
            e["shapes2"].add(second_shapes[n])
        e["buffer"] = e["buffer"] or (n, shape) in facts.buffers
    return entries


def _rule_line(pat: str, e: dict, facts: _Facts, shapes: ShapeWriter) -> tuple[str, bool]:
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
        view, splits, packed_dim, note = _tp_transforms(style, leaf, ndim, e, shapes)
        ep = False
        if style is None or note.startswith("unknown TP style"):
            view, splits, packed_dim, note, ep = derive(first, next(iter(e["shapes"])), facts.model,
                                                        shapes.second_model, shapes.value)
            if note and style is not None:
                note = f"not a style this drafter knows; derived: {note}"
        if (_generic(first) in facts.ep_keys or ep) and ndim >= 1 and not any("over ep" in x for x in splits):
            t.append("split 0 over ep")
            uses_ep = True
        uses_ep |= any("over ep" in x for x in splits)
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


def _tp_transforms(style, leaf: str, ndim: int, e: dict, shapes: ShapeWriter):
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


def _placement(e: dict, first: str, facts: _Facts, shapes: ShapeWriter) -> list[str]:
    """Pipeline stage of a parameter outside the layers: the embedding also on the last stage when tied."""
    if e["stage"] == "first":
        if first == facts.embed_name:
            shapes.used.add("tied")
            return ["on pp = first, (pp - 1) * tied"]
        return ["on pp = first"]
    if e["stage"] == "last":
        return ["on pp = last"]
    return []


def _declarations(dims: dict, shapes: ShapeWriter, raw: dict | None, facts: _Facts, config) \
        -> tuple[list[str], list[str]]:
    """The ``dims`` declarations and ``let`` lines. A dim the config file leaves to the class default
    cannot be read from it: it is derived (head_dim) or fixed by a ``let``."""
    used, values = shapes.used, shapes.values
    lets = []
    if facts.layer_prefix is not None:
        used.add("layers")
        count = len({n[len(facts.layer_prefix):].split(".", 1)[0] for n, _ in facts.params + facts.buffers
                     if n.startswith(facts.layer_prefix)})
        key = layer_count_key(config, count)
        fields = raw if raw is not None else config.to_dict()
        if key is None or (fields.get(key) is None and key != "num_hidden_layers"):
            lets.append(f"let layers = {count}  # no config field holds the number of layers")
        else:
            dims["layers"] = (key, count)
    if shapes.derived_head_dim and "head_dim" in used:
        used |= {"hidden", "heads"}
        lets.append("let head_dim = hidden / heads")
    missing = {d for d, (key, _) in dims.items() if d in used and raw is not None and raw.get(key) is None
               and d != "layers"}  # the config reader fills num_hidden_layers from the layer types
    if "tied" in used and (raw if raw is not None else config.to_dict()).get("tie_word_embeddings") is None:
        missing.add("tied")
    if "head_dim" in missing and values.get("hidden") and values.get("heads") \
            and values["hidden"] == values["heads"] * values["head_dim"]:
        missing.discard("head_dim")
        del dims["head_dim"]
        used |= {"hidden", "heads"}
        lets.append("let head_dim = hidden / heads  # config.json has no head_dim")
    for d in sorted(missing):
        value = int(facts.tied) if d == "tied" else dims.pop(d)[1]
        if d in ("tied", "layers") and any(x.startswith(f"let {d} =") for x in lets):
            continue
        lets.append(f"let {d} = {value}  # the class default: config.json does not set it")
    decl = [d if d == key else f"{d} from {key}" for d, (key, _) in dims.items() if d in used and d not in missing]
    if "tied" in used and "tied" not in missing:
        decl.append("tied from tie_word_embeddings")
    return decl, lets


def _assemble(d: _Draft, lines) -> str:
    out = [
        f"# Draft spec for {d.title} ({d.class_name}), written by `ucl spec from-hf`.",
        "# transformers names; tp from the model's tensor-parallel plan, FSDP2 over dp (dim 0 of the",
        "# TP-local tensor), layers in contiguous blocks over pp, optimizer states follow their parameter.",
        "# REVIEW IT: shapes were matched to config dims by value (on the model and on a perturbed copy),",
        "# fused tensors other than packed [gate|up] are split as plain blocks, and",
        "# everything docs/stdlib.md lists under `from-hf` limits still needs a human.",
        f"# Tied embeddings: {'yes' if d.tied else 'no'}.",
        "",
        "dims " + ",\n    ".join(d.decl) if d.decl else "",
        *d.lets,
        f"mesh {', '.join(d.axes)}",
        "",
    ]
    if d.layer_prefix is not None:
        out.append(f"{d.layer_prefix}{{i}}.** : index i of layers over pp first layers - (pp - 1) * (layers // pp)")
        out.append("")
    out += lines
    out += ["", "state exp_avg, exp_avg_sq : follow", "state step : scalar", ""]
    return "\n".join(out)
