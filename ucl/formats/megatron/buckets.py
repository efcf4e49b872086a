"""Megatron-core's ``dp_reshardable`` distributed-optimizer state in ``torch_dist`` folders, described
for reading in place (called by :mod:`ucl.formats.megatron.dist`).

What Megatron saves (megatron-core 0.16, ``DistributedOptimizer.sharded_param_state_dp_reshardable``):
the optimizer state lives in the DDP gradient buffer's layout. The buffer holds the trained
parameters in **reverse** module order, each starting at a multiple of **64** elements, cut into
buckets (a bucket closes once it holds ``bucket_size`` elements, padding included), each bucket
padded at its end to a multiple of ``lcm(dp, 128)`` (``lcm(dp, 128, 2**16)`` with
``pad_buckets_for_high_nccl_busbw``) and split evenly over the data-parallel ranks. Each bucket is one
1-D tensor per kind, ``optimizer.distributed.dp_group_idx_G.gbuf_idx_I.dtype_(P, G).bucket_idx_B.
{param,exp_avg,exp_avg_sq}``, of the bucket's *unpadded* size; every rank writes one chunk per
parameter range of its slice and one per padding gap (``torch.empty``: garbage). The bucket sizes
are saved too (``per_bucket_numel``, ``per_bucket_numel_unpadded`` objects); the parameters' names
and order are not: they are the model's.

How it is read: the model keys are unstacked into one parameter per layer
(``decoder.layers.3.self_attention.linear_qkv.weight``: a layer's chunks are their own items), each
with the TP rule its chunk grid shows (:mod:`ucl.formats.megatron.unstack`), put in Megatron's
module order (the local layer spec's or Transformer Engine's, whichever reproduces the saved
chunks). Data-parallel group ``G`` is model-parallel rank ``pp_rank * tp + tp_rank``: its stage's
parameters (Megatron's even stages), TP-local. Each group's buckets are recomputed from those
shapes with Megatron's rule, closed where the checkpoint records, and every bucket tensor's size
and every chunk's offset and size must equal the recomputation (and the TP ranks of a stage must
bucket the same parameters), else UCL502 names the group, the bucket and the first difference.
The spec says the same layout in the language, one statement per (stage, bucket), numbered in that
order, the layers placed with ``decoder.layers.{i}.** : index i of L over pp keep``::

    state fp32, exp_avg, exp_avg_sq for <the bucket's parameters>
        : dtype float32; flat over dp reverse align 64 pad to multiple_of(lcm(dp, 128))

so each rank ``(pp, dp, tp)``'s ``fp32/@flatB`` (Megatron's ``param``: the fp32 master),
``exp_avg/@flatB`` and ``exp_avg_sq/@flatB`` is its slice of bucket B: the parameter chunks' bytes
in place, the padding zeros (:data:`~ucl.store.extents.ZEROS`), never Megatron's garbage. Read:
tensor-, pipeline- and data-parallel runs (mesh ``pp, dp, tp`` in Megatron's rank order, axes of
size 1 left out) with one gradient buffer and even stages. Several buffers (parameter dtypes,
experts, virtual stages), a tied embedding across stages (its own bucket) and uneven stages are
UCL502. Adam's ``step`` is in the saved param groups (``state['megatron']['objects']``).
"""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from typing import Any

from ...dtypes import itemsize
from ...errors import ForeignFormatError
from ...store.extents import ZEROS, Extent, Piece
from ..dcp.metadata import METADATA, Metadata, TensorMeta
from ..base import Description
from .unstack import LAYERS, chunks_extent, infer_tp, stage_of, tensor_ref, unstack
from ..torchzip.read import read_torch_file
from ..torchzip.plain import plain
from ..torchzip.unpickle import brief

PREFIX = "optimizer.distributed."
BUCKET = re.compile(r"^optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)\.dtype_\(torch\.(\w+), "
                    r"torch\.(\w+)\)\.bucket_idx_(\d+)\.(\w+)$")
KINDS = {"param": "fp32", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}  # Megatron's -> ucl's
ALIGN = 64  # each parameter starts 128-byte aligned (_pad_start_of_param_if_needed)
BUCKET_MULTIPLE = 128

_PRE = ("embedding.word_embeddings.weight", "embedding.position_embeddings.weight")
_POST = ("decoder.final_layernorm.weight", "decoder.final_layernorm.bias", "output_layer.weight")
_ATTN = ("self_attention.linear_proj.weight", "self_attention.linear_proj.bias")
_QKV = ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias",
        "self_attention.q_layernorm.weight", "self_attention.q_layernorm.bias",
        "self_attention.k_layernorm.weight", "self_attention.k_layernorm.bias")
_IN_NORM = ("self_attention.linear_qkv.layer_norm_weight", "self_attention.linear_qkv.layer_norm_bias")
_MLP = ("mlp.linear_fc1.layer_norm_weight", "mlp.linear_fc1.layer_norm_bias", "mlp.linear_fc1.weight",
        "mlp.linear_fc1.bias", "mlp.linear_fc2.weight", "mlp.linear_fc2.bias")
# A layer's parameters in module order. The checkpoint names them the Transformer Engine way either
# way; the local spec registers input_layernorm before self_attention, TE has it inside linear_qkv.
ORDERS = {"local": _IN_NORM + _ATTN + _QKV + _MLP, "transformer_engine": _ATTN + _IN_NORM + _QKV + _MLP}



@dataclass(frozen=True)
class Bucket:
    """One bucket of the buffer: its parameters (buffer order) at their offsets in the bucket."""
    index: int
    names: tuple[str, ...]
    starts: tuple[int, ...]
    numel_unpadded: int
    numel: int


def has_buckets(md: Metadata) -> bool:
    return any(k.startswith(PREFIX) for k in md.tensors)


def layout(order: list[str], sizes: dict[str, int], unpadded: list[int], padded: list[int], dp: int
           ) -> tuple[list[Bucket], int] | str:
    """Megatron's buckets of ``order`` (model order; laid out reversed), closed where the checkpoint
    says (``unpadded``), with the bucket padding multiple that gives ``padded``; or why not."""
    for multiple in (math.lcm(dp, BUCKET_MULTIPLE), math.lcm(dp, BUCKET_MULTIPLE, 2 ** 16)):
        buckets, b, start, pos, names, starts = [], 0, 0, 0, [], []
        ok = True
        for n in reversed(order):
            pos = -(-pos // ALIGN) * ALIGN
            if b >= len(unpadded):
                ok = False
                break
            names.append(n)
            starts.append(pos - start)
            pos += sizes[n]
            if pos - start == unpadded[b]:
                end = -(-pos // multiple) * multiple
                if end - start != padded[b]:
                    ok = False
                    break
                buckets.append(Bucket(b, tuple(names), tuple(starts), unpadded[b], padded[b]))
                b, start, pos, names, starts = b + 1, end, end, [], []
            elif pos - start > unpadded[b]:
                ok = False
                break
        if ok and not names and b == len(unpadded):
            return buckets, multiple
    return (f"the parameters {', '.join(reversed(order[-3:]))}, ... laid out in reverse, each at a multiple of "
            f"{ALIGN}, do not close buckets of {unpadded} elements padded to {padded} (a multiple of "
            f"lcm(dp={dp}, {BUCKET_MULTIPLE}))")


def expected_chunks(bucket: Bucket, sizes: dict[str, int], dp: int) -> dict[int, tuple[int, str | None]]:
    """Offset -> (size, parameter or None for padding) of every chunk Megatron writes for ``bucket``:
    each rank's slice cut at its parameters' ranges, gaps before the unpadded end as padding."""
    part = bucket.numel // dp
    out: dict[int, tuple[int, str | None]] = {}
    for d in range(dp):
        lo, hi = d * part, (d + 1) * part
        ranges = [(max(s, lo), min(s + sizes[n], hi), n) for n, s in zip(bucket.names, bucket.starts)
                  if s < hi and s + sizes[n] > lo]
        pos = lo
        for a, z, n in ranges + [(hi, hi, None)]:
            if a > pos and pos < bucket.numel_unpadded:
                out[pos] = (a - pos, None)
            if n is not None:
                out[a] = (z - a, n)
            pos = z
    return out


def module_orders(names: list[str]) -> dict[str, list[str]]:
    """``names`` in each candidate module order (see :data:`ORDERS`); unknown names are UCL502."""
    layers: dict[int, set] = {}
    other = set()
    for n in names:
        if n.startswith(LAYERS):
            i, _, rest = n[len(LAYERS):].partition(".")
            layers.setdefault(int(i), set()).add(rest)
        else:
            other.add(n)
    known = set().union(*ORDERS.values())
    unknown = sorted(other - set(_PRE) - set(_POST)) + sorted({r for s in layers.values() for r in s} - known)
    if unknown:
        raise ForeignFormatError(f"the model has tensors ucl does not know Megatron's module order of ({', '.join(unknown[:4])}); "
                     "the dp_reshardable buckets follow that order, so they cannot be placed")
    out = {}
    for label, order in ORDERS.items():
        out[label] = [n for n in _PRE if n in other] + \
            [f"{LAYERS}{i}.{r}" for i in sorted(layers) for r in order if r in layers[i]] + \
            [n for n in _POST if n in other]
    return out


def _bucket_meta(md: Metadata, path: str) -> dict[int, dict[int, dict[str, TensorMeta]]]:
    """data-parallel group -> bucket index -> Megatron kind -> tensor; refuses what is not one
    buffer per group."""
    out: dict[int, dict[int, dict[str, TensorMeta]]] = {}
    buffers = set()
    for key, t in md.tensors.items():
        if not key.startswith(PREFIX):
            continue
        m = BUCKET.match(key)
        if m is None or m.group(6) not in KINDS:
            raise ForeignFormatError(f"{key!r} is not a dp_reshardable bucket tensor ucl knows "
                         f"(optimizer.distributed.dp_group_idx_G.gbuf_idx_I.dtype_(P, G).bucket_idx_B.{{param,"
                         "exp_avg,exp_avg_sq}})")
        buffers.add(int(m.group(2)))
        if len(t.shape) != 1:
            raise ForeignFormatError(f"{key!r} is {list(t.shape)}, not a 1-D bucket")
        out.setdefault(int(m.group(1)), {}).setdefault(int(m.group(5)), {})[m.group(6)] = t
    if buffers != {0}:
        raise ForeignFormatError(f"{path}: the dp_reshardable optimizer state has gradient buffers {sorted(buffers)}: several "
                     "parameter dtypes, experts or virtual pipeline chunks; ucl reads one buffer for now")
    if sorted(out) != list(range(len(out))):
        raise ForeignFormatError(f"{path}: the dp_reshardable data-parallel groups are {sorted(out)}, not 0..N")
    for g, buckets in out.items():
        if sorted(buckets) != list(range(len(buckets))) or any(set(k) != set(KINDS) for k in buckets.values()):
            raise ForeignFormatError(f"{path}: group {g}'s bucket tensors are not {{param, exp_avg, exp_avg_sq}} of buckets "
                         f"0..N (found buckets {sorted(buckets)})")
    return out


def _numels(objects: dict, group: str, what: str, nbuckets: int) -> list[int]:
    v = objects.get(f"{group}.{what}")
    # saved as [per gradient buffer: {(param dtype, grad dtype): [per bucket]}], possibly in a list
    for _ in range(4):
        if isinstance(v, list) and len(v) == 1 and isinstance(v[0], (list, dict)):
            v = v[0]
        elif isinstance(v, dict) and len(v) == 1:
            v = next(iter(v.values()))
    if not isinstance(v, list) or len(v) != nbuckets or not all(isinstance(x, int) and x > 0 for x in v):
        raise ForeignFormatError(f"{group}.{what} is {str(v)[:120]}, not one size per bucket ({nbuckets} buckets)")
    return v


def read_objects(path: str, md: Metadata) -> dict[str, Any]:
    """The distributed optimizer's saved objects (param groups, bucket sizes) by key, without the
    ``/shard_...`` suffix, read with the allow-list unpickler."""
    out = {}
    for key, (rel, offset, length) in md.objects.items():
        if key.startswith(PREFIX) and length <= 16 << 20:
            obj = read_torch_file(os.path.join(path, rel), inside=path, offset=offset, length=length).obj
            if isinstance(obj, list) and len(obj) == 1:  # a ShardedObject is saved as [its data]
                obj = obj[0]
            out[key.split("/", 1)[0]] = plain(obj, where=f"{os.path.join(path, rel)} ({brief(key)})")
    return out


@dataclass(frozen=True)
class BucketRun:
    """A torch_dist folder's dp_reshardable optimizer state, read: per data-parallel group (one per
    model-parallel rank, ``G = pp_rank * tp + tp_rank``) its bucket tensors and sizes, and the
    unstacked weights."""
    path: str
    md: Metadata
    groups: dict[int, dict[int, dict[str, TensorMeta]]]  # group -> bucket -> Megatron kind -> tensor
    numels: dict[int, tuple[list[int], list[int]]]  # group -> (unpadded, padded) bucket sizes
    objects: dict[str, Any]
    tp: int
    pp: int
    dp: int
    by_name: dict[str, Any]  # the unstacked weights by name
    dtype: str  # the weights' dtype
    layers: int
    stage: dict[str, int]  # name -> its pipeline stage

    @property
    def sizes(self) -> dict[str, int]:
        return {n: w.local_numel for n, w in self.by_name.items()}


@dataclass(frozen=True)
class BucketFit:
    """The module order whose buckets are the saved ones, and those buckets."""
    label: str
    order: list[str]
    got: dict[int, tuple[list[Bucket], int]]  # group -> (its buckets, the padding multiple)


def describe_buckets(path: str, md: Metadata, state: dict) -> Description:
    """The :class:`Description` of a torch_dist folder whose optimizer state is dp_reshardable."""
    run = _read(path, md)
    fit = _fit(run)
    # one flat statement per (stage, bucket), numbered in that order: @flat0, @flat1, ...
    statements = [(s, b) for s in range(run.pp) for b in fit.got[s * run.tp][0]]
    axes = [a for a, size in (("pp", run.pp), ("dp", run.dp), ("tp", run.tp)) if size > 1 or a == "dp"]
    st = dict(state)
    st["megatron"] = {**st.get("megatron", {}), "objects": run.objects, "dp_reshardable": {
        "module_order": fit.label, "dp": run.dp, "tp": run.tp, "pp": run.pp, "bucket_multiple": fit.got[0][1],
        "buckets": [{"stage": s, "params": list(b.names), "numel": b.numel, "numel_unpadded": b.numel_unpadded}
                    for s, b in statements]}}
    st["format"] = "megatron"
    files = sorted({c.file for t in md.tensors.values() for c in t.chunks} | {f for f, _, _ in md.objects.values()})
    mesh = tuple((a, {"pp": run.pp, "dp": run.dp, "tp": run.tp}[a]) for a in axes)
    return Description("megatron", _spec(run, fit, statements, axes), "megatron-torch_dist", {}, mesh,
                       {n: run.by_name[n].shape for n in fit.order}, (), _extents(run, fit, statements), (), st,
                       (METADATA, *files))


def _read(path: str, md: Metadata) -> BucketRun:
    groups = _bucket_meta(md, path)
    tp = infer_tp(md)
    if len(groups) % tp:
        raise ForeignFormatError(f"{path}: {len(groups)} data-parallel groups for tensor-parallel size {tp} (from the chunks)")
    pp = len(groups) // tp  # one group per model-parallel rank: G = pp_rank * tp + tp_rank
    objects = read_objects(path, md)
    numels = {g: (_numels(objects, f"{PREFIX}dp_group_idx_{g}", "per_bucket_numel_unpadded", len(b)),
                  _numels(objects, f"{PREFIX}dp_group_idx_{g}", "per_bucket_numel", len(b))) for g, b in groups.items()}
    writers = {g: {c.file.split("_")[2] for b in buckets.values() for t in b.values() for c in t.chunks
                   if c.file.startswith("__") and c.file.count("_") >= 3} for g, buckets in groups.items()}
    dp = len(writers[0])  # each data-parallel rank of a group writes its own slices
    if dp == 0 or any(len(w) != dp for w in writers.values()):
        raise ForeignFormatError(f"{path}: the data-parallel groups' bucket chunks were written by "
                     f"{sorted(len(w) for w in writers.values())} ranks; a group's ranks write its slices")
    weights, dtype = unstack(md, tp)
    by_name = {w.name: w for w in weights}
    layers = max((int(n[len(LAYERS):].partition(".")[0]) + 1 for n in by_name if n.startswith(LAYERS)), default=0)
    if layers % pp:
        raise ForeignFormatError(f"{path}: {layers} layers over {pp} pipeline stages: ucl reads even stages")
    return BucketRun(path, md, groups, numels, objects, tp, pp, dp, by_name, dtype, layers,
                     {n: stage_of(n, layers, pp) for n in by_name})


def _fit(run: BucketRun) -> BucketFit:
    """The module order (local or Transformer Engine) whose recomputed buckets every group saved."""
    tp, sizes = run.tp, run.sizes
    problems, found = [], []
    for label, order in module_orders(list(run.by_name)).items():
        got, bad = {}, None
        for g in range(len(run.groups)):
            s_order = [n for n in order if run.stage[n] == g // tp]
            got[g] = layout(s_order, sizes, *run.numels[g], run.dp)
            bad = got[g] if isinstance(got[g], str) else _check_chunks(got[g][0], run.groups[g], sizes, run.dp)
            if bad is None and [b.names for b in got[g][0]] != [b.names for b in got[g - g % tp][0]]:
                bad = "the TP ranks' buckets hold different parameters"
            if bad:
                problems.append(f"{label} module order, group {g} (stage {g // tp}, TP rank {g % tp}): {bad}")
                break
        if not bad:
            found.append(BucketFit(label, order, got))
    if not found:
        raise ForeignFormatError(f"{run.path}: Megatron's dp_reshardable buckets (dp={run.dp}, tp={tp}, pp={run.pp}) are not "
                     "the layout ucl recomputes from the parameter shapes; " + "; ".join(problems))
    if len(found) > 1 and len({tuple(b.names for g in f.got.values() for b in g[0]) for f in found}) > 1:
        raise ForeignFormatError(f"{run.path}: the buckets fit several module orders ({', '.join(f.label for f in found)}) "
                     "that place parameters differently; ucl cannot tell which one the model had")
    return found[0]


def _spec(run: BucketRun, fit: BucketFit, statements: list[tuple[int, Bucket]], axes: list[str]) -> str:
    # stages as the language says them for any pp: even blocks of layers (global names kept),
    # the embeddings first, the rest last
    pp, stage = run.pp, run.stage
    rules = {n: run.by_name[n].rule + ("" if pp == 1 or n.startswith(LAYERS) else
                                       f"; on pp = {'first' if stage[n] == 0 else 'last'}") for n in fit.order}
    return spec_text(f"the Megatron-core torch_dist checkpoint {os.path.basename(run.path)} (dp_reshardable "
                     f"distributed optimizer, {fit.label} module order)", fit.order,
                     {n: run.by_name[n].shape for n in fit.order}, run.dtype, run.groups[0][0]["param"].dtype,
                     [b for _, b in statements], all(m == math.lcm(run.dp, BUCKET_MULTIPLE) for _, m in fit.got.values()),
                     rules, axes, [f"{LAYERS}{{i}}.** : index i of {run.layers} over pp keep"] if pp > 1 else [])


def _extents(run: BucketRun, fit: BucketFit, statements: list[tuple[int, Bucket]]) -> tuple[dict[str, Extent], ...]:
    """Ranks row-major over (pp, dp, tp), Megatron's order, TP fastest: the stage's weights (the TP
    rank's chunks), then each bucket's slice of the data-parallel rank."""
    path, pp, dp, tp, sizes = run.path, run.pp, run.dp, run.tp, run.sizes
    extents: list[dict[str, Extent]] = []
    for s in range(pp):
        for d in range(dp):
            for t in range(tp):
                extents.append({f"param/{n}": chunks_extent(path, n, run.by_name[n].chunks[t], run.dtype,
                                                            run.by_name[n].local)
                                for n in fit.order if run.stage[n] == s})
    for number, (s, b0) in enumerate(statements):
        for t in range(tp):
            b = fit.got[s * tp + t][0][b0.index]
            for mkind, kind in KINDS.items():
                meta = run.groups[s * tp + t][b.index][mkind]
                for d, pieces in enumerate(_rank_pieces(path, meta, b, sizes, dp)):
                    extents[(s * dp + d) * tp + t][f"{kind}/@flat{number}"] = Extent.joined(pieces, meta.dtype,
                                                                                             (b.numel // dp,))
    return tuple(extents)


def spec_text(title: str, order: list[str], shapes: dict[str, tuple[int, ...]], weights: str, dtype: str,
              buckets: list[Bucket], plain_multiple: bool = True, rules: dict[str, str] | None = None,
              axes: list[str] | None = None, placements: list[str] = ()) -> str:
    """The spec of a data- (and tensor-) parallel run's weights (``order``: model order; ``rules``:
    each one's TP layout, default replicate) and its buckets: one flat statement per bucket,
    Megatron's rule in the language (the module doc)."""
    lcm = f"lcm(dp, {BUCKET_MULTIPLE})" if plain_multiple else f"lcm(dp, {BUCKET_MULTIPLE}, {2 ** 16})"
    spec = [f"# generated by ucl from {title}", f"mesh {', '.join(axes or ['dp'])}", f"state param : dtype {weights}"]
    position = {n: i for i, n in enumerate(order)}
    for b in buckets:
        pattern = "\n      | ".join(sorted(b.names, key=position.__getitem__))
        spec.append(f"state fp32, exp_avg, exp_avg_sq for {pattern}\n    : dtype {dtype}; flat over dp reverse "
                    f"align {ALIGN} pad to multiple_of({lcm})")
    spec += list(placements)
    spec += [f"{n} [{', '.join(str(x) for x in shapes[n])}] : {(rules or {}).get(n, 'replicate')}" for n in order]
    return "\n".join(spec) + "\n"


def _check_chunks(buckets: list[Bucket], meta: dict[int, dict[str, TensorMeta]], sizes: dict[str, int],
                  dp: int) -> str | None:
    for b in buckets:
        want = expected_chunks(b, sizes, dp)
        for mkind, t in sorted(meta[b.index].items()):
            if t.shape != (b.numel_unpadded,):
                return f"bucket {b.index} {mkind} holds {t.shape[0]} elements, the recorded unpadded size is " \
                       f"{b.numel_unpadded}"
            got = {c.offsets[0]: c.sizes[0] for c in t.chunks}
            if got != {o: z for o, (z, _) in want.items()}:
                o = min(set(got) ^ set(want) or {o for o in got if got[o] != want[o][0]})
                return (f"{t.key!r} has a chunk at {o} of {got.get(o)} elements where the recomputed layout has "
                        f"{want[o] if o in want else 'none'}")
    return None


def _rank_pieces(path: str, t: TensorMeta, b: Bucket, sizes: dict[str, int], dp: int) -> list[list[Piece]]:
    """Each rank's slice of bucket tensor ``t`` as byte pieces: parameter chunks in place, padding
    (gaps and the end past the unpadded size) as zeros."""
    part, item = b.numel // dp, itemsize(t.dtype)
    want = expected_chunks(b, sizes, dp)  # equal to the saved chunks (checked)
    chunks = {c.offsets[0]: c for c in t.chunks}
    out = []
    for d in range(dp):
        lo, hi = d * part, (d + 1) * part
        pieces, pos = [], lo
        for o in sorted(o for o, (_, n) in want.items() if n is not None and lo <= o < hi):
            c = chunks[o]
            if o > pos:
                pieces.append(Piece(ZEROS, 0, (o - pos) * item))
            ref, tf = tensor_ref(path, t.key, c, t.dtype)
            pieces.append(Piece(c.file, tf.byte_offset(ref), c.sizes[0] * item))
            pos = o + c.sizes[0]
        if hi > pos:
            pieces.append(Piece(ZEROS, 0, (hi - pos) * item))
        out.append(pieces)
    return out
