"""Dims of a draft: which config fields a drafted spec declares, and shapes written as expressions
of them. A second meta-device instance, with every dim field changed by its own prime factor, tells
apart fields whose values happen to be equal; an expression must give the shape in both."""
from __future__ import annotations

import re
import warnings
from dataclasses import dataclass
from typing import Mapping

import numpy as np

from .meta import meta_model
from .names import Shapes

# canonical transformers field -> the short dim name drafts use for it
KNOWN_DIMS = [
    ("vocab_size", "vocab"), ("hidden_size", "hidden"), ("num_attention_heads", "heads"),
    ("num_key_value_heads", "kv_heads"), ("head_dim", "head_dim"), ("intermediate_size", "ffn"),
    ("moe_intermediate_size", "moe_ffn"), ("shared_expert_intermediate_size", "shared_ffn"),
    ("num_local_experts", "experts"), ("num_experts", "experts"), ("n_routed_experts", "experts"),
    ("n_shared_experts", "shared_experts"), ("q_lora_rank", "q_lora_rank"),
    ("kv_lora_rank", "kv_lora_rank"), ("qk_nope_head_dim", "qk_nope"), ("qk_rope_head_dim", "qk_rope"),
    ("v_head_dim", "v_head"), ("max_position_embeddings", "positions"), ("n_inner", "ffn"),
]
# perturbation of the known fields (keeping kv_heads | heads | hidden: heads grow x6 with hidden,
# kv_heads x2); every other dim field gets its own prime from _PRIMES
_PERTURB = {"vocab_size": lambda v: v + 1, "hidden_size": lambda v: 6 * v, "head_dim": lambda v: 5 * v,
            "intermediate_size": lambda v: 7 * v, "n_inner": lambda v: 7 * v,
            "moe_intermediate_size": lambda v: 11 * v, "shared_expert_intermediate_size": lambda v: 13 * v,
            "num_local_experts": lambda v: 19 * v, "num_experts": lambda v: 19 * v,
            "n_routed_experts": lambda v: 19 * v, "q_lora_rank": lambda v: 23 * v,
            "kv_lora_rank": lambda v: 29 * v, "qk_nope_head_dim": lambda v: 31 * v,
            "qk_rope_head_dim": lambda v: 37 * v, "v_head_dim": lambda v: 41 * v,
            "max_position_embeddings": lambda v: 43 * v, "n_shared_experts": lambda v: 2 * v + 1,
            "num_attention_heads": lambda v: 6 * v, "num_key_value_heads": lambda v: 2 * v}
_PRIMES = [47, 53, 59, 61, 67, 71, 73, 79, 83, 89, 97, 101, 103, 107, 109, 113, 127, 131, 137, 139, 149,
           151, 157, 163, 167, 173, 179, 181, 191, 193, 197, 199, 211, 223, 227, 229, 233, 239, 241, 251]
_RESERVED = {"pp", "dp", "tp", "ep", "tied", "layers", "first", "last"}
_NOT_A_DIM = re.compile(r"token_id|layer|seed|step|window|_id$|^num_labels$|chunk|cache|position_buckets|period|"
                        r"offset|top_?k|per_tok|group_size$|^n_group$|topk_group|version")


@dataclass
class Dim:
    name: str  # as the draft writes it
    key: str  # the config.json field
    value: int
    known: bool  # one of KNOWN_DIMS (else any other integer field of the config)


def recognised_dims(config) -> dict[str, Dim]:
    """Every integer field of the config that may size a tensor, by draft name: the known fields
    (under their short names, the first of synonyms present), then the other top-level integers."""
    cfg = config.to_dict()
    attr_map = dict(getattr(config, "attribute_map", {}) or {})
    out: dict[str, Dim] = {}
    taken_keys = set()
    for field, dim in KNOWN_DIMS:
        key = field if cfg.get(field) is not None else attr_map.get(field)
        if key is None or not _is_int(cfg.get(key)) or dim in out or key in taken_keys:
            continue
        out[dim] = Dim(dim, key, int(cfg[key]), True)
        taken_keys.add(key)
    for key, v in cfg.items():
        if key in taken_keys or not _is_int(v) or v < 2 or _NOT_A_DIM.search(key) \
                or not re.fullmatch(r"[A-Za-z_]\w*", key) or key in _RESERVED or key in out:
            continue
        out[key] = Dim(key, key, int(v), False)
        taken_keys.add(key)
    return out


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def layer_count_key(config, count: int) -> str | None:
    """The config field that holds the number of layers (``count`` numbered blocks in the model):
    ``num_hidden_layers`` (filled from ``layers_block_type``/``layer_types`` by the config reader
    where the config has none), else an integer field named like a layer count (``num_layers``)."""
    cfg = config.to_dict()
    if getattr(config, "num_hidden_layers", None) == count:
        if cfg.get("num_hidden_layers") == count or _layer_types_length(cfg) == count:
            return "num_hidden_layers"
    for key in ("num_layers", "n_layer", "n_layers", "num_decoder_layers"):
        if cfg.get(key) == count:
            return key
    return None


def _layer_types_length(cfg: Mapping) -> int | None:
    for key in ("layers_block_type", "layer_types"):
        if isinstance(cfg.get(key), list):
            return len(cfg[key])
    return None


def _build(model_type: str, fields: dict):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return meta_model({"model_type": model_type, **fields})[1]


def perturbed(config, dims: dict[str, Dim]) -> tuple[dict[str, int], Shapes, object] | None:
    """(dim -> value, parameter -> shape, model) of a second meta instance with the dims changed: all at
    once if that builds, else the known ones (heads scaled or not) plus, one at a time, each other
    field that still lets the model build; None if not even the known ones can change."""
    cfg = {k: v for k, v in config.to_dict().items() if k != "model_type"}
    new = {}
    for i, d in enumerate(dims.values()):
        new[d.key] = _PERTURB[_canonical(d)](d.value) if d.known and _canonical(d) in _PERTURB \
            else _PRIMES[i % len(_PRIMES)] * d.value
    known = [d for d in dims.values() if d.known]
    extra = [d for d in dims.values() if not d.known]

    def attempt(keys):
        fields = dict(cfg)
        fields.update({k: new[k] for k in keys})
        try:
            return fields, _build(config.model_type, fields)
        except Exception:  # transformers refuses that combination: try fewer changes
            return None

    got = attempt([d.key for d in dims.values()])
    if got is None:
        base = None
        for keys in ([d.key for d in known],
                     [d.key for d in known if d.key not in ("num_attention_heads", "num_key_value_heads")
                      and _canonical(d) not in ("num_attention_heads", "num_key_value_heads")]):
            base = attempt(keys)
            if base is not None:
                chosen = keys
                break
        if base is None:
            chosen = []
            base = attempt([])
            if base is None:
                return None
        for d in extra:
            trial = attempt(chosen + [d.key])
            if trial is not None:
                chosen, base = chosen + [d.key], trial
        got = base
    fields, model = got
    sd = set(model.state_dict().keys())
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    shapes.update({n: tuple(b.shape) for n, b in model.named_buffers() if n in sd})
    return {name: int(fields[d.key]) for name, d in dims.items()}, shapes, model


def _canonical(d: Dim) -> str:
    return next((f for f, dim in KNOWN_DIMS if dim == d.name), d.key)


class Exprs:
    """Finds a short expression of dims for a number: the value must come out right in the model and
    (given ``dims2``) in the perturbed one. Simple forms first (a dim, ``k * a``, ``a * b``,
    ``a + b``, ``c * (a + b)``, ``(a + 2 * b) * c``), then sums of two or three terms ``k * a * b``."""

    def __init__(self, dims: dict[str, int], dims2: dict[str, int] | None = None):
        names = [n for n, v in dims.items() if v > 0]
        d2 = dims2 if dims2 is not None else dims
        self.two = dims2 is not None
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
        small = names[:24]  # the cubic forms over the known dims (listed first) and a few others
        for x, a in enumerate(small):
            for b in small[x + 1:]:
                for c in small:
                    add(f"{c} * ({a} + {b})", lambda d, a=a, b=b, c=c: d[c] * (d[a] + d[b]))
        for a in small:
            for b in small:
                for c in small:
                    if a != b:
                        add(f"({a} + 2 * {b}) * {c}", lambda d, a=a, b=b, c=c: (d[a] + 2 * d[b]) * d[c])
        self.by_pair: dict[tuple[int, int], str] = {}
        for text, v1, v2 in cand:
            self.by_pair.setdefault((v1, v2), text)
        # terms k * a * b for the sums
        terms = [(n, dims[n], d2[n]) for n in names]
        terms += [(f"{a} * {b}", dims[a] * dims[b], d2[a] * d2[b]) for x, a in enumerate(names) for b in names[x:]]
        terms = [(f"{k} * {t}" if k > 1 else t, k * v1, k * v2) for k in (1, 2, 3, 4) for t, v1, v2 in terms]
        terms = [t for t in terms if t[1] < 1 << 30 and t[2] < 1 << 30]
        self.terms = terms
        self.keys = np.array([v1 << 31 | v2 for _, v1, v2 in terms], dtype=np.int64)
        self._sums: tuple[np.ndarray, np.ndarray] | None = None

    def _pair_sums(self):
        if self._sums is None:
            n = len(self.keys)
            if n > 2600:  # keep the table of sums of two terms to a few million entries
                self._sums = (np.zeros(0, np.int64), np.zeros(0, np.int64))
            else:
                s = (self.keys[:, None] + self.keys[None, :]).ravel()
                order = np.argsort(s, kind="stable")
                self._sums = (s[order], order)
        return self._sums

    def _sum_of_terms(self, v: int, v2: int) -> str | None:
        if not self.two or v == v2:  # without a second value sums match by accident
            return None
        target = v << 31 | v2
        index = {int(k): i for i, k in reversed(list(enumerate(self.keys)))}
        for i, k in enumerate(self.keys):  # two terms
            j = index.get(target - int(k))
            if j is not None:
                return f"{self.terms[i][0]} + {self.terms[j][0]}"
        sums, order = self._pair_sums()
        if not len(sums):
            return None
        need = target - self.keys
        pos = np.searchsorted(sums, need)
        ok = (pos < len(sums)) & (sums[np.minimum(pos, len(sums) - 1)] == need)
        hits = np.nonzero(ok)[0]
        if not len(hits):
            return None
        i = int(hits[0])
        a, b = divmod(int(order[pos[i]]), len(self.keys))
        return " + ".join(self.terms[t][0] for t in (i, a, b))

    def __call__(self, v: int, v2: int | None = None) -> str:
        w = v if v2 is None else v2
        text = self.by_pair.get((v, w))
        if text is None and v > 1:
            text = self._sum_of_terms(v, w)
        return text if text is not None else str(v)


class ShapeWriter:
    """Writes shapes as expressions of the dims (checked on the perturbed instance when one builds)
    and records which dims the draft uses."""

    def __init__(self, config, dims: dict[str, Dim]):
        self.dims = {n: (d.key, d.value) for n, d in dims.items()}  # dim -> (config key, value)
        second = perturbed(config, dims)
        dims2 = second[0] if second else None
        self.second_shapes: Shapes = second[1] if second else {}
        self.second_model = second[2] if second else None
        values = {n: d.value for n, d in dims.items()}
        # written as `let head_dim = hidden / heads`
        self.derived_head_dim = bool("head_dim" not in values and values.get("hidden") and values.get("heads")
                                     and values["hidden"] % values["heads"] == 0)
        if self.derived_head_dim:
            values["head_dim"] = values["hidden"] // values["heads"]
            if dims2 is not None:
                dims2["head_dim"] = dims2["hidden"] // dims2["heads"]
        self.values, self.dims2 = values, dims2
        self.ex = Exprs(values, dims2)
        self.used: set[str] = set()

    def use(self, text: str) -> str:
        self.used.update(re.findall(r"[A-Za-z_]\w*", text))
        return text

    def value(self, v: int, v2: int | None = None) -> str:
        """One size: an expression when one fits (both instances, when there are two)."""
        if self.dims2 is not None and v2 is None:
            return str(v)
        return self.use(self.ex(v, v2))

    def shape(self, shapes: set, shapes2: set) -> str | None:
        if len(shapes) != 1:
            return None
        (shape,) = shapes
        shape2 = next(iter(shapes2)) if len(shapes2) == 1 and self.dims2 else None
        if shape2 is None or len(shape2) != len(shape):
            parts = [self.value(v) for v in shape]
        else:
            parts = [self.value(v, w) for v, w in zip(shape, shape2)]
        return "[" + ", ".join(parts) + "]"

    def half(self, sizes: set, sizes2: set) -> str:
        """Half of a packed [gate|up] dim."""
        v = next(iter(sizes)) // 2
        return self.value(v, next(iter(sizes2)) // 2 if len(sizes) == 1 and len(sizes2) == 1 else None)
