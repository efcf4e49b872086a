"""Megatron-style tensor parallelism for the parameters a transformers TP plan leaves out (or gives a
style the drafter does not know), derived from the module structure: vocab-parallel embedding and
head, attention and MLP column/row splits, fused tensors split part by part as the model's forward
reads them, MLA's low-rank ``*_a_proj`` replicated and ``*_b_proj`` split by heads, Mamba mixers split
by heads and channels, experts over ``ep``.

Each answer is (views, tp splits, the dim of a packed ``[2, n]`` view or None, a note for the comment)."""
from __future__ import annotations

import re
from typing import Callable

# module names (the last segment of a parameter's module path) and how a TP runtime splits them
_ROW = {"o_proj", "out_proj", "c_proj", "down_proj", "w2", "fc2", "dense_4h_to_h", "wo", "output_linear",
        "fc_out", "proj_out", "dense", "linear_out", "o_b_proj", "out_dense", "output_proj"}
_COL = {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "w1", "w3", "fc1", "c_fc", "dense_h_to_4h",
        "fc_in", "q_b_proj", "kv_b_proj", "query", "key", "value", "wq", "wk", "wv", "q_attn", "kv_proj",
        "linear_1", "fc_gate", "q_gate_proj", "k_b_proj", "v_b_proj"}
_PACKED = {"gate_up_proj", "input_linear", "w13", "fc1_glu"}  # [gate; up] rows, chunk(2) in the forward
# fused q/k/v: [Q; K; V] as consecutive blocks (GQA sizes), or per head [q_h, k_h, v_h] (bloom,
# gpt_neox, persimmon, minimax's linear attention: `.view(..., heads, 3 * head_dim)`), or per KV group
# (falcon's new decoder: `.view(..., kv_heads, heads / kv_heads + 2, head_dim)`)
_FUSED_QKV = {"qkv_proj", "query_key_value", "Wqkv", "c_attn", "qkv", "W_pack"}
_PER_HEAD = {"bloom", "gpt_neox", "gpt_neox_japanese", "persimmon", "minimax"}
_REPLICATED = re.compile(r"(^|_)a_proj|^gate$|router|^x_proj$|indexer|weights_proj|norm|^conv")
# the one linear of a router module is replicated whatever its own name (jetmoe's `router.layer`,
# longcat's `router.classifier`): top-k needs every expert's logit on every rank
_ROUTER = re.compile(r"router")

# the up projection of a low-rank pair (kimi_linear's f_b_proj, g_b_proj after f_a_proj, g_a_proj): by heads
_LOW_RANK_UP = re.compile(r"^[a-z]+_b_proj$")
Value = Callable[[object], int]  # a size read off a module (the model's or the perturbed one's)


def derive(name: str, shape: tuple[int, ...], model, model2, size) -> tuple[list, list, int | None, str, bool]:
    """Layout of one parameter the TP plan does not cover: (views, splits, packed dim, note, ep).
    ``size(v, v2)`` writes a size as an expression of the dims."""
    path, leaf = name.rsplit(".", 1) if "." in name else ("", name)
    module = _submodule(model, path)
    module2 = _submodule(model2, path)
    mname = path.rsplit(".", 1)[-1]
    ndim = len(shape)
    if module is None or ndim == 0:
        return [], [], None, "", False
    if module is model.get_input_embeddings() or module is model.get_output_embeddings():
        return [], ["split 0 over tp uneven"], None, "vocab-parallel", False
    kind = type(module).__name__
    if "experts" in path.split(".") or mname == "experts" or kind.endswith("Experts"):
        return _experts(f"{mname}.{leaf}", shape, module2, size, _in_attention(model, path), module)
    parent = path.rsplit(".", 1)[0] if "." in path else ""
    for mixer_path, rest in ((path, leaf), (parent, f"{mname}.{leaf}")):
        mixer = _submodule(model, mixer_path)
        found = None if mixer is None else mixer_layout(rest, shape, mixer, _submodule(model2, mixer_path), size)
        if found is not None:
            return (*found, False)
    for found in (_short_conv(path, leaf, shape, model, model2, size),
                  _linear_attention(path, leaf, shape, model, model2, size)):
        if found is not None:
            return (*found, False)
    if kind == "Embedding" or ndim > 2:
        return [], [], None, "", False
    out_dim = 1 if kind == "Conv1D" else 0  # GPT-2's Conv1D stores [in, out]
    in_dim = 1 - out_dim
    is_bias = ndim == 1
    if mname in _FUSED_QKV:
        return _fused_qkv(model, model2, _submodule(model, parent), _submodule(model2, parent), module,
                          0 if is_bias else out_dim, size)
    if mname in _PACKED:
        d = 0 if is_bias else out_dim
        return _packed(shape, d, name, model2, size)
    if _REPLICATED.search(mname) or _router_logits(model, path):
        return [], [], None, "", False
    if mname == "kv_proj":
        return _kv_proj(model, model2, parent, module, is_bias, size, name)
    if _out_features(module, kind) == 1:  # a scalar gate per token (qwen2_moe's shared_expert_gate): nothing to split
        return [], [], None, "one output: replicated", False
    if mname in _ROW or (mname not in _COL and not _LOW_RANK_UP.search(mname) and _out_features(module, kind) == _hidden(model)
                         and _in_features(module, kind) != _hidden(model)):
        return [], ([] if is_bias else [f"split {in_dim} over tp uneven"]), None, "row-parallel", False
    if mname in _COL or _LOW_RANK_UP.search(mname) or _in_features(module, kind) == _hidden(model):
        if re.search(r"qkv|in_proj", mname):  # a fused input projection of unknown order: left whole
            return [], [], None, "fused projection of unknown order: replicated over tp", False
        return [], [f"split {0 if is_bias else out_dim} over tp uneven"], None, "column-parallel", False
    return [], [], None, "", False


def _submodule(model, path: str):
    if model is None:
        return None
    try:
        return model.get_submodule(path) if path else model
    except AttributeError:
        return None


def _hidden(model) -> int | None:
    return getattr(model.config, "hidden_size", None)


def _in_features(module, kind: str):
    return getattr(module, "nx", None) if kind == "Conv1D" else getattr(module, "in_features", None)


def _out_features(module, kind: str):
    return getattr(module, "nf", None) if kind == "Conv1D" else getattr(module, "out_features", None)


def _two(module, module2, get: Value) -> tuple[int, int | None]:
    v = int(get(module))
    try:
        return v, (int(get(module2)) if module2 is not None else None)
    except (AttributeError, TypeError):
        return v, None


def _fused_qkv(model, model2, attn, attn2, module, d: int, size):
    """A fused q/k/v projection, split by heads the way its forward splits it (``attn``: the module
    holding it, in the model and in the perturbed one)."""
    cfg = model.config

    def heads_of(a, c):
        h = getattr(a, "num_heads", None) or getattr(a, "n_heads", None) or getattr(c, "num_attention_heads", None)
        hd = getattr(a, "head_dim", None) or getattr(a, "head_size", None)
        if not hd and h:  # openai-gpt keeps only the width of one of q, k, v (split_size)
            width = getattr(a, "split_size", None)
            hd = width // h if isinstance(width, int) and width % h == 0 else None
        kv = getattr(a, "num_key_value_heads", None) or getattr(a, "num_kv_heads", None) \
            or getattr(a, "kv_n_heads", None)
        if kv is None:
            kv = 1 if getattr(c, "multi_query", False) else getattr(c, "num_key_value_heads", None) or h
        return h, kv, hd

    heads, kv, head_dim = heads_of(attn, cfg)
    if not heads or not head_dim:
        return [], [], None, "fused q/k/v without a known head count: replicated over tp", False
    other = heads_of(attn2, model2.config) if attn2 is not None else (None, None, None)
    h_, kv_, hd_ = (size(a, b or None) for a, b in zip((heads, kv, head_dim), other))
    model_type = getattr(cfg, "model_type", "")
    out = _out_features(module, type(module).__name__)
    per_head = model_type in _PER_HEAD or (model_type == "falcon" and not getattr(cfg, "new_decoder_architecture", False)
                                           and not getattr(cfg, "multi_query", False))
    if per_head and out == 3 * heads * head_dim:
        return [f"view {d} as [{h_}, 3 * {hd_}]"], [f"split {d}.0 over tp"], None, "fused per head [q_h; k_h; v_h]", False
    if model_type == "falcon" and getattr(cfg, "new_decoder_architecture", False):
        return [f"view {d} as [{kv_}, ({h_} / {kv_} + 2) * {hd_}]"], [f"split {d}.0 over tp"], None, \
            "fused per KV group [q..q k v]", False
    if out == (heads + 2 * kv) * head_dim:
        if kv == 1:  # multi-query: one K and one V head, on every rank
            return [f"concat {d} as [q = {h_} * {hd_}, kv = 2 * {hd_}]"], [f"split {d}.q over tp"], None, \
                "fused [Q; K; V], one KV head replicated", False
        return ([f"concat {d} as [q = {h_} * {hd_}, k = {kv_} * {hd_}, v = {kv_} * {hd_}]"],
                [f"split {d} over tp"], None, "fused [Q; K; V] split part by part", False)
    return [], [], None, "fused q/k/v of an unknown layout: replicated over tp", False


def _packed(shape, d: int, name: str, model2, size):
    v = shape[d] // 2
    v2 = None
    if model2 is not None:
        p = dict(model2.named_parameters()).get(name)
        v2 = None if p is None else int(p.shape[d]) // 2
    return [f"view {d} as [2, {size(v, v2)}]"], [f"split {d}.1 over tp uneven"], d, "packed [gate; up]", False


def _glu_experts(shape, module, module2, size):
    """dbrx's ``experts.mlp.w1/v1/w2``: [E * ffn, hidden] each, read per expert as ``view(E, ffn, hidden)``
    (w1, v1 as ``x @ w[e].T``, w2 as ``h @ w2[e]``): experts over ep, each expert's ffn rows over tp
    (column-parallel w1, v1; row-parallel w2, whose input is the ffn)."""
    experts, ffn = getattr(module, "moe_num_experts", None), getattr(module, "ffn_hidden_size", None)
    if not experts or not ffn or len(shape) != 2 or shape[0] != experts * ffn:
        return None
    e_ = size(*_two(module, module2, lambda m: m.moe_num_experts))
    f_ = size(*_two(module, module2, lambda m: m.ffn_hidden_size))
    return [f"view 0 as [{e_}, {f_}]"], ["split 0.0 over ep", "split 0.1 over tp uneven"], 0, \
        "experts [E * ffn, hidden]: ep by experts, tp by ffn rows", True


def _experts(leaf: str, shape, module2, size, attention: bool, module=None):
    """Experts stacked as [E, ...]: over ep on dim 0; gate_up column-parallel (packed), down row-parallel.
    ``leaf`` is ``module.param``. Experts of an attention module (jetmoe's mixture of attention heads)
    project to heads, with no [gate; up] halves: their input projection is column-parallel by heads."""
    glu = _glu_experts(shape, module, module2, size)
    if glu is not None:
        return glu
    if len(shape) != 3:
        return [], [], None, "", False
    if re.search(r"gate_up|w13|input|w1|fc1", leaf):
        v = shape[1] // 2
        p2 = module2 if module2 is None else getattr(module2, leaf.rsplit(".", 1)[-1], None)
        v2 = int(p2.shape[1]) // 2 if p2 is not None and getattr(p2, "ndim", 0) == 3 else None
        if attention:
            return [], ["split 1 over tp uneven"], None, "attention experts: column-parallel by heads", True
        if shape[1] % 2 == 0:
            return [f"view 1 as [2, {size(v, v2)}]"], ["split 1.1 over tp uneven"], 1, "experts: packed [gate; up]", True
        return [], ["split 1 over tp uneven"], None, "experts: column-parallel", True
    if re.search(r"down|w2|output|fc2", leaf):
        return [], ["split 2 over tp uneven"], None, "experts: row-parallel", True
    return [], [], None, "experts", True


def _router_logits(model, path: str) -> bool:
    """Whether the module on ``path`` is the only linear of a router around it (a router that is an
    MLP (zaya's ``router_mlp``) is split column then row like any MLP: its logits come out whole)."""
    parts = path.split(".")
    for i in range(len(parts) - 1, 0, -1):
        if _ROUTER.search(parts[i - 1]):
            router = _submodule(model, ".".join(parts[:i]))
            linears = [m for m in router.modules() if type(m).__name__ in ("Linear", "Conv1D")]
            return len(linears) == 1
    return False


def _in_attention(model, path: str) -> bool:
    """Whether a module on ``path`` lies inside an attention module (by class name)."""
    parts = path.split(".")
    return any("Attention" in type(_submodule(model, ".".join(parts[:i]))).__name__ for i in range(1, len(parts)))


def _kv_proj(model, model2, parent: str, module, is_bias: bool, size, name: str):
    """A fused ``kv_proj``: ``[K; V]`` read with ``.chunk(2)`` (jetmoe) is packed like [gate; up], so each
    rank holds its heads of both; one shared head (deepseek_v4's K = V) is replicated like multi-query."""
    attn = _submodule(model, parent)
    head_dim = getattr(attn, "head_dim", None)
    kv = getattr(attn, "num_key_value_heads", None)
    out = module.out_features
    if head_dim and out == head_dim:
        return [], [], None, "one K/V head shared by every rank's heads: replicated", False
    if head_dim and kv and out == 2 * kv * head_dim:
        return _packed((out, module.in_features), 0, name, model2, size)[:3] + ("packed [K; V] (chunk(2))", False)
    return [], ["split 0 over tp uneven"], None, "column-parallel", False


def _short_conv(path: str, leaf: str, shape, model, model2, size):
    """LFM's short convolution (``*ShortConv``): ``in_proj`` = [B; C; x] read with ``.chunk(3)``, a
    depthwise ``conv`` and the products per channel, ``out_proj`` back: every channel on one rank, so
    ``in_proj`` is split packed (each rank its channels of B, C and x), ``conv`` by channels."""
    parts = path.rsplit(".", 1)
    for block_path, child in ((path, ""), (parts[0], parts[-1])) if len(parts) == 2 else ((path, ""),):
        block = _submodule(model, block_path)
        if block is not None and type(block).__name__.endswith("ShortConv"):
            break
    else:
        return None
    channels = size(*_two(block, _submodule(model2, block_path), lambda m: m.conv.in_channels))
    if child == "in_proj" and shape[0] == 3 * block.conv.in_channels:
        return [f"view 0 as [3, {channels}]"], ["split 0.1 over tp uneven"], 0, "packed [B; C; x] (chunk(3))"
    if child == "conv" and shape[0] == block.conv.in_channels:
        return [], ["split 0 over tp uneven"], None, "depthwise, by channels"
    return None


def _linear_attention(path: str, leaf: str, shape, model, model2, size):
    """A linear attention with separate q/k/v projections whose outputs a depthwise ``conv1d`` reads
    concatenated (kimi_linear: ``cat([q, k, v])``), split by heads like them: ``conv1d`` part by part,
    per-head parameters (``dt_bias`` [heads * head_dim], ``A_log`` [1, 1, heads, 1]) on their heads' rank."""
    parts = path.split(".")
    for cut in (len(parts), len(parts) - 1):
        attn_path = ".".join(parts[:cut])
        attn = _submodule(model, attn_path)
        q, k, v, conv = (getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj", "conv1d"))
        if None not in (q, k, v, conv) and hasattr(attn, "num_heads"):
            break
    else:
        return None
    widths = [getattr(m, "out_features", None) for m in (q, k, v)]
    if getattr(conv, "groups", None) != conv.out_channels or sum(w or 0 for w in widths) != conv.out_channels:
        return None
    attn2 = _submodule(model2, attn_path)
    rest = path[len(attn_path) + 1:] if len(path) > len(attn_path) else ""
    if rest == "conv1d":
        names = ("q", "k", "v")
        sizes = [size(*_two(getattr(attn, n + "_proj"), getattr(attn2, n + "_proj", None), lambda m: m.out_features))
                 for n in names]
        concat = ", ".join(f"{n} = {s}" for n, s in zip(names, sizes))
        return [f"concat 0 as [{concat}]"], ["split 0 over tp"], None, "depthwise conv of [q; k; v] by heads"
    if leaf in ("weight", "bias"):
        return None
    heads = attn.num_heads
    if len(shape) == 1 and shape[0] in (heads, widths[0]):
        return [], ["split 0 over tp"], None, "per head"
    big = [d for d, n in enumerate(shape) if n != 1]
    if len(big) == 1 and shape[big[0]] == heads:
        return [], [f"split {big[0]} over tp"], None, "per head"
    return None


def mixer_layout(path_leaf: str, shape, mixer, mixer2, size):
    """A Mamba mixer's tensors, split the way Megatron's Mamba layer splits them: by heads (Mamba-2:
    ``in_proj`` = [z; x; B; C; dt] part by part, ``conv1d`` = [x; B; C], B and C by groups, shared
    when there are fewer groups than ranks) or by channels (Mamba-1: ``in_proj`` = [x; z]).
    Layout of ``mixer``'s own parameter ``path_leaf`` (``in_proj.weight``, ``A_log``, ...) or None."""
    if not (hasattr(mixer, "ssm_state_size") and hasattr(mixer, "intermediate_size")):
        return None

    def sz(get):
        return size(*_two(mixer, mixer2, get))

    inter = sz(lambda m: m.intermediate_size)
    groups = getattr(mixer, "n_groups", None)
    heads = getattr(mixer, "num_heads", None)
    head, leaf = path_leaf.rsplit(".", 1) if "." in path_leaf else ("", path_leaf)
    if groups is not None and heads is not None:  # Mamba-2
        gs = sz(lambda m: m.n_groups * m.ssm_state_size)
        nh = sz(lambda m: m.num_heads)
        state = sz(lambda m: m.ssm_state_size)
        ng = sz(lambda m: m.n_groups)
        bc = [f"view 0.b as [{ng}, {state}]", f"view 0.c as [{ng}, {state}]"]
        bc_split = ["split 0.b.0 over tp shared", "split 0.c.0 over tp shared"]
        if head == "in_proj" and shape[0] == 2 * mixer.intermediate_size + 2 * groups * mixer.ssm_state_size + heads:
            return ([f"concat 0 as [z = {inter}, x = {inter}, b = {gs}, c = {gs}, dt = {nh}]"] + bc,
                    ["split 0.z over tp", "split 0.x over tp"] + bc_split + ["split 0.dt over tp"],
                    None, "Mamba-2 in_proj [z; x; B; C; dt] by heads and groups")
        if head == "conv1d" and shape[0] == mixer.intermediate_size + 2 * groups * mixer.ssm_state_size:
            return ([f"concat 0 as [x = {inter}, b = {gs}, c = {gs}]"] + bc,
                    ["split 0.x over tp"] + bc_split, None, "Mamba-2 conv1d [x; B; C]")
        if head == "" and leaf in ("A_log", "D", "dt_bias") and shape == (heads,):
            return [], ["split 0 over tp"], None, "by heads"
        if head == "norm" and shape == (mixer.intermediate_size,):
            return [], ["split 0 over tp"], None, "gated norm by heads"
        if head == "out_proj" and leaf == "weight":
            return [], ["split 1 over tp"], None, "row-parallel"
        return None
    # Mamba-1: in_proj = [x; z] (chunk 2), everything else by channel
    if head == "in_proj" and shape[0] == 2 * mixer.intermediate_size:
        return [f"view 0 as [2, {inter}]"], ["split 0.1 over tp"], None, "Mamba in_proj [x; z] by channels"
    if head in ("conv1d", "dt_proj") or (head == "" and leaf in ("A_log", "D")):
        if shape and shape[0] == mixer.intermediate_size:
            return [], ["split 0 over tp"], None, "by channels"
    if head in ("x_proj", "out_proj") and leaf == "weight":
        return [], ["split 1 over tp"], None, "row-parallel"
    return None
