"""Hugging Face helpers: read tensor names from checkpoints, check a spec against a model, and
draft a spec for an unknown transformers model.

Library side of ``ucl check SPEC --dims CONFIG.json --against MODEL`` and ``ucl spec from-hf``:

* :func:`load_config` -- a config as a dict with class defaults filled in (``head_dim`` ...);
* :func:`read_tensor_names` -- ``{name: shape}`` of a ``.safetensors`` file, a ``save_pretrained``
  folder (single file or sharded with ``model.safetensors.index.json``) or a ucl checkpoint;
* :func:`check_against` -- which tensors a spec fails to match (empty list = all good); saved
  per-expert MoE names are mapped onto the fused in-memory tensors first;
* :func:`draft_spec_from_hf` -- a starting ``.ucl`` text built from the config's tensor-parallel
  plan and the model's parameter names and shapes (instantiated on the meta device).

Only :func:`draft_spec_from_hf` (and :func:`load_config`, when it can) imports torch/transformers.
"""
from __future__ import annotations

import json
import re
import struct
from collections import defaultdict
from pathlib import Path
from typing import Iterable, Mapping
from .errors import StoreError

__all__ = ["load_config", "read_tensor_names", "fuse_saved_experts", "check_against", "draft_spec_from_hf"]

Shapes = dict[str, tuple[int, ...]]


# ---- configs -------------------------------------------------------------------------------------
def _config_source(config) -> dict:
    """A plain dict from a dict, a PretrainedConfig, a config.json path or a folder holding one."""
    if isinstance(config, Mapping):
        return dict(config)
    if hasattr(config, "to_dict"):
        return config.to_dict()
    path = Path(config)
    if path.is_dir():
        path = path / "config.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise StoreError(f"cannot read config {path}: {e}", code="UCL404") from None


def load_config(config) -> dict:
    """``config`` (dict, ``PretrainedConfig``, ``config.json`` path or model folder) as a dict in
    which the fields a spec reads are filled in the way the model class fills them.

    With transformers installed the dict is ``AutoConfig.for_model(model_type, **fields).to_dict()``
    (class defaults, aliases such as gpt2's ``n_embd``, a derived ``head_dim``). Without it (or for
    an unknown ``model_type``) the fields are returned as they are, plus ``head_dim =
    hidden_size // num_attention_heads`` where it is missing or null.
    """
    raw = _config_source(config)
    out = dict(raw)
    full = not isinstance(config, Mapping) and hasattr(config, "to_dict")  # a PretrainedConfig already
    if not full and raw.get("model_type"):
        try:
            from transformers import AutoConfig
            fields = {k: v for k, v in raw.items() if k != "model_type"}
            out = AutoConfig.for_model(raw["model_type"], **fields).to_dict()
        except Exception:  # unknown model type, transformers missing or too old: keep the raw fields
            out = dict(raw)
    if out.get("head_dim") is None and out.get("hidden_size") and out.get("num_attention_heads"):
        out["head_dim"] = int(out["hidden_size"]) // int(out["num_attention_heads"])
    return out


# ---- reading tensor names ------------------------------------------------------------------------
def _safetensors_header(path: Path) -> Shapes:
    """Names and shapes from a .safetensors header (8-byte little-endian length + JSON), no data read."""
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) != 8:
            raise StoreError(f"{path}: not a safetensors file (too short)", code="UCL401")
        (n,) = struct.unpack("<Q", head)
        if n > 100 * 1024 * 1024:
            raise StoreError(f"{path}: not a safetensors file (header of {n} bytes)", code="UCL401")
        meta = json.loads(fh.read(n))
    return {k: tuple(int(x) for x in v["shape"]) for k, v in meta.items() if k != "__metadata__"}


def _ucl_checkpoint(path: Path) -> Shapes:
    manifest = json.loads((path / "manifest.json").read_text())
    params = manifest.get("params")
    if params:
        return {k: tuple(int(x) for x in v) for k, v in params.items()}
    if not manifest.get("mesh"):  # universal layout: the datasets of rank 0 are the global tensors
        out = {}
        for key, entry in manifest["datasets"][0].items():
            kind, _, name = key.partition("/")
            if kind == "param":
                out[name] = tuple(int(x) for x in entry["shape"])
        return out
    raise StoreError(f"{path}/manifest.json has no `params` (global shapes) and is not universal", code="UCL420")


def read_tensor_names(path) -> Shapes:
    """``{name: shape}`` of every tensor in a ``.safetensors`` file, a ``save_pretrained`` folder
    (``model.safetensors`` or shards listed by ``model.safetensors.index.json``; other
    ``*.safetensors`` files otherwise) or a ucl checkpoint folder (its manifest's ``params``)."""
    path = Path(path)
    if path.is_file():
        if path.name == "manifest.json":
            return _ucl_checkpoint(path.parent)
        if path.name.endswith(".index.json"):
            files = sorted(set(json.loads(path.read_text())["weight_map"].values()))
            return _merge(path.parent / f for f in files)
        return _safetensors_header(path)
    if not path.is_dir():
        raise StoreError(f"{path}: no such file or folder", code="UCL404")
    if (path / "manifest.json").is_file():
        return _ucl_checkpoint(path)
    index = sorted(path.glob("*.safetensors.index.json"))
    if index:
        files = sorted(set(json.loads(index[0].read_text())["weight_map"].values()))
        return _merge(path / f for f in files)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise StoreError(f"{path}: no .safetensors files, index or ucl manifest.json", code="UCL404")
    return _merge(files)


def _merge(files: Iterable[Path]) -> Shapes:
    out: Shapes = {}
    for f in files:
        out.update(_safetensors_header(f))
    return out


# ---- saved (per-expert) MoE names -> fused in-memory names ----------------------------------------
# transformers 5 holds experts as mlp.experts.gate_up_proj [E, 2I, H] (rows [:I] gate, [I:] up) and
# mlp.experts.down_proj [E, H, I]; save_pretrained writes one tensor per expert instead.
_EXPERT = re.compile(r"^(?P<pre>.*)\.(?P<blk>mlp|block_sparse_moe)\.experts\.(?P<e>\d+)\."
                     r"(?P<w>gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$")
_ROLE = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}


def fuse_saved_experts(tensors: Mapping[str, Iterable[int]]) -> tuple[Shapes, list[str]]:
    """Map saved per-expert names onto the fused in-memory tensors; returns (tensors, problems).

    ``PFX.{mlp|block_sparse_moe}.experts.{e}.{gate_proj|w1}.weight [I, H]`` + ``up_proj|w3 [I, H]``
    -> ``PFX.mlp.experts.gate_up_proj [E, 2I, H]``; ``down_proj|w2 [H, I]`` ->
    ``PFX.mlp.experts.down_proj [E, H, I]``; Mixtral's ``block_sparse_moe.gate.weight`` ->
    ``mlp.gate.weight``. Experts must be numbered 0..E-1 with all three matrices, of equal shapes.
    Names that are not per-expert pass through unchanged (in their order)."""
    out: Shapes = {}
    problems: list[str] = []
    groups: dict[str, dict[int, dict[str, tuple[int, ...]]]] = {}
    for name, shape in tensors.items():
        shape = tuple(int(x) for x in shape)
        m = _EXPERT.match(name)
        if m is None:
            if ".block_sparse_moe.gate." in name:
                name = name.replace(".block_sparse_moe.gate.", ".mlp.gate.")
            out[name] = shape
            continue
        pre = m.group("pre")
        if pre not in groups:
            groups[pre] = {}
            out[f"{pre}.mlp.experts.gate_up_proj"] = ()  # placeholder keeps model order
            out[f"{pre}.mlp.experts.down_proj"] = ()
        role = _ROLE[m.group("w")]
        per = groups[pre].setdefault(int(m.group("e")), {})
        if role in per:
            problems.append(f"{name}: expert {m.group('e')} of {pre} has two {role} matrices")
        per[role] = shape
    for pre, experts in groups.items():
        fused_gu, fused_d = f"{pre}.mlp.experts.gate_up_proj", f"{pre}.mlp.experts.down_proj"
        n = len(experts)
        if sorted(experts) != list(range(n)):
            problems.append(f"{pre}: experts are numbered {sorted(experts)}, expected 0..{n - 1}")
        shapes = defaultdict(set)
        for e, per in sorted(experts.items()):
            for role in ("gate", "up", "down"):
                if role not in per:
                    problems.append(f"{pre}: expert {e} has no {role} matrix")
                else:
                    shapes[role].add(per[role])
        bad = [r for r in ("gate", "up", "down") if len(shapes[r]) > 1]
        for r in bad:
            problems.append(f"{pre}: the experts' {r} matrices differ in shape: {sorted(shapes[r])}")
        if bad or any(len(shapes[r]) != 1 for r in ("gate", "up", "down")):
            del out[fused_gu], out[fused_d]
            continue
        (g,), (u,), (d,) = shapes["gate"], shapes["up"], shapes["down"]
        if len(g) != 2 or g != u or len(d) != 2 or d != (g[1], g[0]):
            problems.append(f"{pre}: expert shapes gate {list(g)}, up {list(u)}, down {list(d)} do not fit "
                            "gate = up = [I, H] and down = [H, I]")
            del out[fused_gu], out[fused_d]
            continue
        out[fused_gu] = (n, 2 * g[0], g[1])
        out[fused_d] = (n, d[0], d[1])
    return out, problems


def check_against(spec, dims: Mapping[str, int], tensors: Mapping[str, Iterable[int]],
                  frozen: Iterable[str] = ()) -> list[str]:
    """Problems binding ``spec`` (a Spec or anything ``ucl.load_spec`` takes) with ``dims`` to
    ``tensors`` (``{name: shape}``, e.g. from :func:`read_tensor_names`). An empty list means every
    tensor is matched by exactly one rule with the right shape.

    Saved per-expert MoE names are first mapped onto the fused in-memory tensors the specs describe
    (see :func:`fuse_saved_experts`), so both a ``state_dict()`` and a ``save_pretrained`` folder
    can be checked."""
    from . import load_spec
    from .errors import UclError

    fused, problems = fuse_saved_experts(tensors)
    try:
        spec = load_spec(spec)
        spec.bind(dict(dims), fused, frozen=[f for f in frozen if f in fused])
    except UclError as e:
        diags = getattr(e, "diagnostics", None)
        if diags:
            problems += [f"error[{d.code}]: {d.message}" + (f" ({d.hint})" if d.hint else "") for d in diags]
        else:
            problems.append(f"error[{e.code}]: {e}")
    return problems


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
    raw = None  # the fields the user's config really has (a spec's `--dims CONFIG` reads only those)
    if not hasattr(config_or_dir, "to_dict"):
        raw = _config_source(config_or_dir)  # a missing or unreadable config is a StoreError
    try:
        config, model = _meta_model(raw if raw is not None else config_or_dir)
    except Exception as e:  # transformers' own errors (unknown model_type, bad fields)
        raise StoreError(f"transformers cannot build a model from {config_or_dir}: {e}", code="UCL423") from None
    cfg = config.to_dict()
    attr_map = dict(getattr(config, "attribute_map", {}) or {})
    # dims from the config fields we recognise (canonical name or its alias key in to_dict())
    dims: dict[str, tuple[str, int]] = {}
    fields: dict[str, str] = {}  # canonical field -> key in cfg, for the recognised dims
    for field, dim in _KNOWN_DIMS:
        key = field if cfg.get(field) is not None else attr_map.get(field)
        if key is None or isinstance(cfg.get(key), bool) or not isinstance(cfg.get(key), int):
            continue
        if dim not in dims:
            dims[dim] = (key, int(cfg[key]))
            fields[field] = key
    field_of = {dim: field for field, dim in _KNOWN_DIMS if fields.get(field) == dims.get(dim, ("",))[0]}
    tied = bool(getattr(config, "tie_word_embeddings", False))

    params: list[tuple[str, tuple[int, ...]]] = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
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

    # pattern per parameter; the layer list is the first numbered module list
    def pattern(n: str) -> str:
        caps = iter("ijklmn")
        return re.sub(r"(?<=\.)\d+(?=\.|$)", lambda m: "{" + next(caps) + "}", n)

    layer_prefix = None
    for n, _ in params:
        m = re.match(r"^(.*?\.)\d+\.", n)
        if m:
            layer_prefix = m.group(1)
            break
    second = _perturbed_shapes(config, fields)
    dims2 = {d: second[0][field_of[d]] for d in dims} if second else None
    shapes2_of = second[1] if second else {}
    values = {d: v for d, (_, v) in dims.items()}
    derived_head_dim = ("head_dim" not in values and values.get("hidden") and values.get("heads")
                        and values["hidden"] % values["heads"] == 0)
    if derived_head_dim:  # written as `let head_dim = hidden / heads`
        values["head_dim"] = values["hidden"] // values["heads"]
        if dims2 is not None:
            dims2["head_dim"] = dims2["hidden"] // dims2["heads"]
    ex = _Exprs(values, dims2)
    used: set[str] = set()

    def shape_expr(shapes: set, shapes2: set) -> str | None:
        if len(shapes) != 1:
            return None
        (shape,) = shapes
        shape2 = next(iter(shapes2)) if len(shapes2) == 1 and dims2 else None
        if shape2 is None or len(shape2) != len(shape):
            parts = [ex(v) for v in shape] if dims2 is None else [str(v) for v in shape]
        else:
            parts = [ex(v, w) for v, w in zip(shape, shape2)]
        for p in parts:
            used.update(w for w in re.findall(r"[A-Za-z_]\w*", p))
        return "[" + ", ".join(parts) + "]"

    entries: dict[str, dict] = {}
    seen_layers = False
    for n, shape in params + buffers:
        pat = pattern(n)
        in_layers = layer_prefix is not None and n.startswith(layer_prefix) and pat != n
        seen_layers |= in_layers
        e = entries.setdefault(pat, dict(names=[], shapes=set(), shapes2=set(), buffer=False, in_layers=in_layers,
                                         stage=None if in_layers else ("last" if seen_layers else "first")))
        e["names"].append(n)
        e["shapes"].add(shape)
        if n in shapes2_of:
            e["shapes2"].add(shapes2_of[n])
        e["buffer"] = e["buffer"] or (n, shape) in buffers

    uses_ep = False
    lines = []
    for pat, e in entries.items():
        first = e["names"][0]
        shapes = e["shapes"]
        ndim = len(next(iter(shapes)))
        style = _style(first, plan)
        leaf = first.rsplit(".", 1)[-1]
        t: list[str] = []
        note = ""
        tp_dim = None
        if e["buffer"]:
            t.append("replicate")
            note = "persistent buffer: not sharded by FSDP2; pass it to bind(frozen=...)"
        else:
            if _generic(first) in ep_keys and ndim >= 1:
                t.append("split 0 over ep")
                uses_ep = True
            if style in _COLWISE and ndim >= 1:
                tp_dim = max(ndim - 2, 0) if leaf != "bias" else 0
                t.append(f"split {tp_dim} over tp uneven")
            elif style in _ROWWISE and ndim >= 1:
                if leaf != "bias":
                    tp_dim = ndim - 1
                    t.append(f"split {tp_dim} over tp uneven")
            elif style in _PACKED and ndim >= 1:
                d = max(ndim - 2, 0) if leaf != "bias" else 0
                sizes = {s[d] for s in shapes}
                sizes2 = {s[d] for s in e["shapes2"] if len(s) > d}
                v = next(iter(sizes)) // 2
                if len(sizes) == 1 and len(sizes2) == 1 and dims2:
                    half = ex(v, next(iter(sizes2)) // 2)
                else:
                    half = str(v) if dims2 else ex(v)
                used.update(re.findall(r"[A-Za-z_]\w*", half))
                t.insert(0, f"view {d} as [2, {half}]")
                t.append(f"split {d}.1 over tp uneven")
                tp_dim = ("packed", d)
            elif style is not None and style not in _REPLICATED:
                note = f"unknown TP style {style!r}: replicated over tp here"
            if ndim >= 1:
                if tp_dim == ("packed", 0):
                    t.append("split 1 over dp uneven" if ndim >= 2 else "replicate over dp")
                else:
                    # FSDP2: dim 0 of the (EP-, TP-local) tensor; after a split of dim 0 it splits again
                    t.append("split 0 over dp uneven")
            else:
                t.append("replicate")
        if e["stage"] == "first":
            t.append("on pp = first, (pp - 1) * tied" if first == embed_name else "on pp = first")
            if first == embed_name:
                used.add("tied")
        elif e["stage"] == "last":
            t.append("on pp = last")
        shp = shape_expr(shapes, e["shapes2"])
        head = pat + (f" {shp}" if shp else "")
        line = f"{head} : " + "; ".join(t)
        if style is not None or note:
            line += f"    # {style or ''}{': ' if style and note else ''}{note}"
        lines.append(line)

    if layer_prefix is not None:
        used.add("layers")
    lets = []
    if derived_head_dim and "head_dim" in used:
        used |= {"hidden", "heads"}
        lets.append("let head_dim = hidden / heads")
    # a dim the config file leaves to the class default cannot be read from it: derive or fix it
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
        value = int(tied) if d == "tied" else dims.pop(d)[1]
        lets.append(f"let {d} = {value}  # the class default: config.json does not set it")
    consts = {d for d in missing}
    decl = []
    for d, (key, _) in dims.items():
        if d in used and d not in consts:
            decl.append(d if d == key else f"{d} from {key}")
    if "tied" in used and "tied" not in consts:
        decl.append("tied from tie_word_embeddings")
    axes = ["pp", "dp"] + (["ep"] if uses_ep else []) + ["tp"]
    title = name or getattr(config, "model_type", "model")
    out = [
        f"# Draft spec for {title} ({type(model).__name__}), written by `ucl spec from-hf`.",
        "# transformers names; tp from the model's tensor-parallel plan, FSDP2 over dp (dim 0 of the",
        "# TP-local tensor), layers in contiguous blocks over pp, optimizer states follow their parameter.",
        "# REVIEW IT: shapes were matched to config dims by value (on the model and on a perturbed copy),",
        "# fused tensors other than packed [gate|up] are split as plain blocks, and",
        "# everything docs/stdlib.md lists under `from-hf` limits still needs a human.",
        f"# Tied embeddings: {'yes' if tied else 'no'}.",
        "",
        "dims " + ",\n    ".join(decl) if decl else "",
        *lets,
        f"mesh {', '.join(axes)}",
        "",
    ]
    if layer_prefix is not None:
        out.append(f"{layer_prefix}{{i}}.** : index i of layers over pp first layers - (pp - 1) * (layers // pp)")
        out.append("")
    out += lines
    out += ["", "state exp_avg, exp_avg_sq : follow", "state step : scalar", ""]
    return "\n".join(x for x in out if x is not None)
