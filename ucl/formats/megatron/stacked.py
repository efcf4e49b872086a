"""A Megatron-core ``torch_dist`` folder's model tensors (and its ``fully_reshardable`` optimizer
state) described in Megatron's own axes, ``mesh pp, dp, tp`` (called by :mod:`ucl.formats.megatron.dist`).

The keys stay Megatron's: a layer's parameters stacked along a leading layer axis
(``decoder.layers.mlp.linear_fc1.weight [L, ...]``). That axis is not a mesh axis: each layer is
its own saved item, and a pipeline stage holds an even block of ``L / pp`` layers
(``split 0 over pp``). Each layer's TP split is read from its chunks
(:mod:`ucl.formats.megatron.unstack`: replicated, ``tp`` equal pieces along one dim, SwiGLU's
``2 * tp`` halves) and must be the same for every layer. The embeddings are on the first stage, the
final norm and the output layer on the last (``on pp = first|last``).

The sizes: from ``args`` in ``common.pt`` where the run saved them (Megatron-LM does:
``tensor_model_parallel_size``, ``pipeline_model_parallel_size``, ``data_parallel_size``); else
``tp`` from the chunk grid (:func:`~ucl.formats.megatron.unstack.infer_tp`), and ``pp`` and ``dp``
from the ranks that wrote the items (``__R_K.distcp``: Megatron's rank order puts TP fastest, then
DP, then PP, and a rank writes items of its own stage): the largest ``pp`` under which every
layer was written by a rank of the stage that holds it. ``state['megatron']['layout']`` says
where each size came from. A rank's dataset joins its layers' chunks in order.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

from ...errors import ForeignFormatError
from ...store.extents import Extent
from ..base import Description
from ..dcp.metadata import METADATA, Metadata
from .unstack import LAYERS, Weight, chunks_extent, infer_tp, stage_of, unstack_key

OPTIMIZER_STATE = "optimizer.state."
KINDS = {"param": "fp32"}  # Megatron's fully_reshardable kinds that ucl names otherwise (the fp32 master)
_WRITER = re.compile(r"^__(\d+)_\d+\.distcp$")


@dataclass(frozen=True)
class Layout:
    """The run's parallel sizes and where each was read."""
    pp: int
    dp: int
    tp: int
    source: tuple[tuple[str, str], ...]  # (axis, where its size came from)

    @property
    def axes(self) -> tuple[tuple[str, int], ...]:
        """Megatron's rank order (TP fastest); axes of size 1 kept, so the spec reshards to any of them."""
        return (("pp", self.pp), ("dp", self.dp), ("tp", self.tp))


@dataclass(frozen=True)
class Stacked:
    """One saved tensor: its key, global shape, per-layer weights (one when not stacked) and the
    ucl kind and parameter it is."""
    key: str
    kind: str
    param: str
    shape: tuple[int, ...]
    dtype: str
    layers: tuple[Weight, ...]

    @property
    def stacked(self) -> bool:
        return self.param.startswith(LAYERS)


def describe_stacked(path: str, md: Metadata, common: dict, state: dict) -> Description:
    """The :class:`Description` of a torch_dist folder without dp_reshardable buckets."""
    tp = _args_size(common, "tensor_model_parallel_size") or infer_tp(md)
    tensors = _tensors(md, tp)
    params = {t.param: t for t in tensors if t.kind == "param"}
    layers = max((t.shape[0] for t in params.values() if t.stacked), default=0)
    layout = _layout(md, common, tp, params, layers)
    spec = _spec(os.path.basename(os.path.normpath(path)), tensors, layout, layers)
    extents = _extents(path, tensors, layout, layers)
    trained = {t.param for t in tensors if t.kind != "param"}
    frozen = tuple(n for n in params if n not in trained)
    st = {**state, "format": "megatron"}
    st["megatron"] = {**st.get("megatron", {}), "layout": {
        "pp": layout.pp, "dp": layout.dp, "tp": layout.tp, "from": dict(layout.source)}}
    files = sorted({c.file for t in md.tensors.values() for c in t.chunks} | {f for f, _, _ in md.objects.values()})
    return Description("megatron", spec, "megatron-torch_dist", {}, layout.axes,
                       {n: t.shape for n, t in params.items()}, frozen, tuple(extents), (), st, (METADATA, *files))


def _args_size(common: dict, name: str) -> int | None:
    args = common.get("args") if isinstance(common, dict) else None
    if isinstance(args, dict) and isinstance(args.get("state"), dict):  # argparse.Namespace, as plain() keeps it
        args = args["state"]
    value = args.get(name) if isinstance(args, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else None


def _tensors(md: Metadata, tp: int) -> list[Stacked]:
    """Every tensor as a :class:`Stacked`; an optimizer state must be chunked like its parameter."""
    out: list[Stacked] = []
    model = {}
    for key, t in md.tensors.items():
        kind, param = _classify(key)
        weights = tuple(unstack_key(key, t, tp, param))
        if kind == "param":
            model[param] = weights
        out.append(Stacked(key, kind, param, tuple(t.shape), t.dtype, weights))
    for s in out:
        own = model.get(s.param)
        if own is None:
            raise ForeignFormatError(f"{s.key!r} is optimizer state of {s.param!r}, which the checkpoint does not hold")
        if [(w.rule, w.local) for w in s.layers] != [(w.rule, w.local) for w in own]:
            raise ForeignFormatError(f"{s.key!r} is chunked unlike its parameter {s.param!r}; ucl reads optimizer state "
                                     "laid out like the model")
        if len({w.rule for w in s.layers}) != 1:
            raise ForeignFormatError(f"{s.key!r}: its layers are split over tp in different ways "
                                     f"({sorted({w.rule for w in s.layers})})")
    dtypes = {s.dtype for s in out if s.kind == "param"}
    if len(dtypes) > 1:
        raise ForeignFormatError(f"the model's tensors have several dtypes ({sorted(dtypes)}); ucl reads one training dtype")
    return out


def _classify(key: str) -> tuple[str, str]:
    """(ucl kind, parameter) of a saved tensor key (see :mod:`ucl.formats.megatron.dist`)."""
    if key.startswith(OPTIMIZER_STATE):
        kind, _, name = key[len(OPTIMIZER_STATE):].partition(".")
        if name:
            return KINDS.get(kind, kind), name
    if key.startswith("optimizer."):
        raise ForeignFormatError(f"{key!r} is optimizer state in a form ucl does not read with the model's axes")
    return "param", key


def _layout(md: Metadata, common: dict, tp: int, params: dict[str, Stacked], layers: int) -> Layout:
    pp, dp = _args_size(common, "pipeline_model_parallel_size"), _args_size(common, "data_parallel_size")
    source = [("tp", "args" if _args_size(common, "tensor_model_parallel_size") else "chunk grid")]
    if pp is not None and dp is not None:
        return Layout(pp, dp, tp, tuple(source + [("pp", "args"), ("dp", "args")]))
    writers = {t.param: [(c, _writer(c.file)) for w in t.layers for rank_chunks in w.chunks for c in rank_chunks]
               for t in params.values()}
    wrote = 1 + max((r for ws in writers.values() for _, r in ws if r is not None), default=0)
    world = md.ranks if md.ranks and md.ranks >= wrote else wrote  # only main replicas write
    if world % tp:
        raise ForeignFormatError(f"{world} ranks wrote the items, not a multiple of tensor-parallel size {tp}")
    if pp is None:
        pp = next(p for p in range(world // tp, 0, -1) if (world // tp) % p == 0 and _stages_fit(writers, p, world, layers))
        source.append(("pp", "the ranks that wrote each layer"))
    else:
        source.append(("pp", "args"))
    if layers % pp:
        raise ForeignFormatError(f"{layers} layers over {pp} pipeline stages: ucl reads even stages")
    seen = "args" if dp else "the save plans (all_local_plans)" if md.ranks else "the ranks that wrote"
    return Layout(pp, dp or world // (tp * pp), tp, tuple(source + [("dp", seen)]))


def _writer(file: str) -> int | None:
    m = _WRITER.match(file)
    return int(m.group(1)) if m else None


def _stages_fit(writers: dict, pp: int, world: int, layers: int) -> bool:
    """Every chunk written by a rank of the stage Megatron's even stages put it on."""
    if pp > 1 and (not layers or layers % pp):
        return False
    per_stage = world // pp
    for name, ws in writers.items():
        for c, r in ws:
            want = stage_of(f"{LAYERS}{c.offsets[0]}." if name.startswith(LAYERS) else name, layers or 1, pp)
            if r is None or r // per_stage != want:
                return False
    return True


def _spec(folder: str, tensors: list[Stacked], layout: Layout, layers: int) -> str:
    params = [t for t in tensors if t.kind == "param"]
    lines = [f"# generated by ucl from the Megatron-core torch_dist checkpoint {folder}",
             f"mesh {', '.join(a for a, _ in layout.axes)}", f"state param : dtype {params[0].dtype}"]
    kinds = list(dict.fromkeys(t.kind for t in tensors if t.kind != "param"))
    for kind in kinds:  # fully_reshardable: every trained parameter's state, laid out like it
        own = [t.param for t in tensors if t.kind == kind]
        dtypes = {t.dtype for t in tensors if t.kind == kind}
        if len(dtypes) != 1:
            raise ForeignFormatError(f"optimizer state {kind!r} is saved in several dtypes {sorted(dtypes)}")
        names = "" if len(own) == len(params) else " for " + "\n      | ".join(own)
        lines.append(f"state {kind}{names} : dtype {dtypes.pop()}")
    for t in params:
        lines.append(f"{t.param} [{', '.join(map(str, t.shape))}] : {_rule(t, layout.pp, layers) or 'replicate'}")
    return "\n".join(lines) + "\n"


def _rule(t: Stacked, pp: int, layers: int) -> str:
    parts = [t.layers[0].rule_after(1 if t.stacked else 0)]
    if t.stacked:
        parts.insert(0, "split 0 over pp")
    else:  # also at pp=1: a reshard to several stages puts them where Megatron would
        parts.append(f"on pp = {'first' if stage_of(t.param, layers, 2) == 0 else 'last'}")  # Megatron's first or last
    return "; ".join(p for p in parts if p)


def _extents(path: str, tensors: list[Stacked], layout: Layout, layers: int) -> list[dict[str, Extent]]:
    """Per rank (Megatron's order), each dataset as its layers' chunks joined, shared by DP replicas."""
    out: list[dict[str, Extent]] = []
    per_stage = layers // layout.pp if layers else 0
    for s in range(layout.pp):
        row = [{} for _ in range(layout.tp)]
        for t in tensors:
            if t.stacked:
                mine = t.layers[s * per_stage:(s + 1) * per_stage]
                shape = (per_stage,) + mine[0].local
            elif stage_of(t.param, layers or 1, layout.pp) == s:
                mine, shape = t.layers, t.layers[0].local
            else:
                continue
            for r in range(layout.tp):
                chunks = tuple(c for w in mine for c in w.chunks[r])
                row[r][f"{t.kind}/{t.param}"] = chunks_extent(path, t.key, chunks, t.dtype, shape)
        out += [dict(row[r]) for _ in range(layout.dp) for r in range(layout.tp)]
    return out
