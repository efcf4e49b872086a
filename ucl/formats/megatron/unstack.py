"""The weights of a Megatron-core torch_dist folder as one parameter per layer, with their tensor-
parallel layout read from the chunk grid (for :mod:`ucl.formats.megatron.buckets`).

Megatron saves a layer's parameters stacked along a leading layer axis
(``decoder.layers.mlp.linear_fc1.weight [L, ...]``), each layer's TP shard its own item, while its
distributed optimizer keeps each layer's TP-local tensor on its own in the gradient buffer. So the
buffer is described over per-layer parameters (``decoder.layers.3.mlp.linear_fc1.weight``) whose
rule says how TP splits them, read from the chunks of that layer:

* one chunk: ``replicate`` (norms, row-parallel biases);
* ``tp`` equal pieces along one dim ``d``: ``split d over tp``, TP rank ``r`` holding piece ``r``
  (column- and row-parallel weights, the vocabulary; QKV's even split keeps whole query groups);
* ``2 * tp`` pieces along dim 0 of a ``linear_fc1`` tensor: SwiGLU's factory, TP rank ``r`` holding
  pieces ``r`` (gate) and ``tp + r`` (up), ``view 0 as [2, F]; split 0.1 over tp``.

Anything else is UCL502: a grid these do not describe, or pieces of another count than the run's
``tp`` (:func:`infer_tp`: the most pieces a tensor has). Pipeline stages are Megatron's even ones
(:func:`stage_of`); the buckets of every stage check that.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

from ...dtypes import itemsize
from ...errors import ForeignFormatError, StoreError
from ...store.extents import Extent, Piece
from ..dcp.metadata import METADATA, Chunk, Metadata, TensorMeta
from ..torchzip.read import TensorRef, read_torch_file

LAYERS = "decoder.layers."



@dataclass(frozen=True)
class Weight:
    """One per-layer parameter: global shape, the spec rule, TP-local shape, per TP rank the chunks
    holding its local tensor (in order)."""
    name: str
    shape: tuple[int, ...]
    rule: str
    local: tuple[int, ...]
    chunks: tuple[tuple[Chunk, ...], ...]
    split: int | None = None  # the dim split over tp (None: replicated)
    halves: bool = False  # SwiGLU's [gate; up] over tp

    @property
    def local_numel(self) -> int:
        return math.prod(self.local)

    def rule_after(self, lead: int) -> str:
        """The TP rule of this weight as a part of a tensor with ``lead`` more leading dims (the
        stacked layer axis), ``uneven`` so that it also reads at a tp that does not divide it;
        '' when replicated."""
        if self.halves:
            return f"view {lead} as [2, {self.shape[0] // 2}]; split {lead}.1 over tp uneven"
        return "" if self.split is None else f"split {self.split + lead} over tp uneven"


def unstack(md: Metadata, tp: int) -> tuple[list[Weight], str]:
    """The model tensors of ``md`` as per-layer :class:`Weight`\\ s (file order) and their dtype."""
    out, dtypes = [], set()
    for key, t in md.tensors.items():
        if key.startswith("optimizer."):
            continue
        dtypes.add(t.dtype)
        out += unstack_key(key, t, tp)
    if len(dtypes) > 1:
        raise ForeignFormatError(f"the model's tensors have several dtypes ({sorted(dtypes)}); ucl reads one training dtype")
    return out, dtypes.pop() if dtypes else "float32"


def unstack_key(key: str, t: TensorMeta, tp: int, name: str | None = None) -> list[Weight]:
    """The tensor ``key`` as per-layer :class:`Weight`\\ s (one when it is not stacked), named as
    ``name`` (default: ``key``) would be with the layer number put in."""
    name = key if name is None else name
    stacked = int(name.startswith(LAYERS))
    per_layer: dict[int, list[Chunk]] = {}
    for c in t.chunks:
        if stacked and c.sizes[0] != 1:
            raise ForeignFormatError(f"{key!r} {list(t.shape)} has a chunk of {c.sizes[0]} layers; Megatron saves one per layer")
        per_layer.setdefault(c.offsets[0] if stacked else 0, []).append(c)
    if sorted(per_layer) != list(range(t.shape[0] if stacked else 1)):
        raise ForeignFormatError(f"{key!r}: its layers are saved at {sorted(per_layer)}, not 0..{t.shape[0] - 1}")
    return [_weight(f"{LAYERS}{layer}.{name[len(LAYERS):]}" if stacked else name, key, tuple(t.shape[stacked:]),
                    [(c.offsets[stacked:], c.sizes[stacked:], c) for c in cs], tp)
            for layer, cs in sorted(per_layer.items())]


def _weight(name: str, key: str, shape: tuple[int, ...], boxes: list[tuple], tp: int) -> Weight:
    if len(boxes) == 1 and boxes[0][1] == shape:
        return Weight(name, shape, "replicate", shape, ((boxes[0][2],),) * tp)
    split = {d for _, size, _ in boxes for d, (z, n) in enumerate(zip(size, shape)) if z != n}
    pieces = sorted(boxes, key=lambda b: b[0])
    k = len(pieces)
    d = split.pop() if len(split) == 1 else None
    even = d is not None and shape[d] % k == 0 and all(
        off[d] == i * (shape[d] // k) and size[d] == shape[d] // k and not any(off[:d] + off[d + 1:])
        and size[:d] + size[d + 1:] == shape[:d] + shape[d + 1:] for i, (off, size, _) in enumerate(pieces))
    where = f"{key!r} {list(shape)} (its layer or tensor {name!r})"
    if not even:
        raise ForeignFormatError(f"{where} is saved in chunks at {[list(o) for o, _, _ in pieces][:8]}: not equal pieces along "
                     "one dim, which ucl reads for Megatron's dp_reshardable optimizer")
    local = tuple(n // tp if i == d else n for i, n in enumerate(shape))
    if k == tp:
        return Weight(name, shape, f"split {d} over tp", local, tuple((c,) for _, _, c in pieces), d)
    if k == 2 * tp and d == 0 and ".linear_fc1." in f".{name}" and tp == 1:  # SwiGLU [gate; up], whole
        return Weight(name, shape, "replicate", shape, ((pieces[0][2], pieces[1][2]),))
    if k == 2 * tp and d == 0 and ".linear_fc1." in f".{name}":  # SwiGLU: [gate_r; up_r] on rank r
        return Weight(name, shape, f"view 0 as [2, {shape[0] // 2}]; split 0.1 over tp", local,
                      tuple((pieces[r][2], pieces[tp + r][2]) for r in range(tp)), None, True)
    raise ForeignFormatError(f"{where} is saved in {k} pieces along dim {d}, but the run's tensor-parallel size is {tp}; "
                 "ucl reads a grid of tp equal pieces (SwiGLU's fc1: 2 * tp)")


def infer_tp(md: Metadata) -> int:
    """The tensor-parallel size the chunk grid shows: the most pieces a layer of a model tensor is
    saved in (SwiGLU's fc1: half of them); 1 when every tensor is whole."""
    tp = 1
    for key, t in md.tensors.items():
        if key.startswith("optimizer."):
            continue
        stacked = int(key.startswith(LAYERS))
        per_layer: dict[int, int] = {}
        for c in t.chunks:
            layer = c.offsets[0] if stacked else 0
            per_layer[layer] = per_layer.get(layer, 0) + 1
        k = max(per_layer.values(), default=1)
        tp = max(tp, k // 2 if ".linear_fc1." in f".{key}" else k)
    return tp


def stage_of(name: str, layers: int, pp: int) -> int:
    """The pipeline stage Megatron puts a parameter on with even stages: layer blocks in order,
    the embeddings first, the final norm and the output layer last."""
    if name.startswith(LAYERS):
        return int(name[len(LAYERS):].partition(".")[0]) // (layers // pp)
    return 0 if name.startswith("embedding.") else pp - 1


def tensor_ref(path: str, key: str, c: Chunk, dtype: str) -> tuple[TensorRef, object]:
    """The tensor of the saved item ``c`` (a torch.save archive inside a .distcp file) and its file."""
    tf = read_torch_file(os.path.join(path, c.file), inside=path, offset=c.offset, length=c.length)
    ref = tf.obj
    if not isinstance(ref, TensorRef) or ref.shape != c.sizes or ref.dtype != dtype:
        raise StoreError(f"{os.path.join(path, c.file)} item {key!r} at {list(c.offsets)} holds "
                         f"{getattr(ref, 'shape', type(ref).__name__)} {getattr(ref, 'dtype', '')}, but {METADATA} "
                         f"says {list(c.sizes)} {dtype}", code="UCL500")
    return ref, tf


def chunks_extent(path: str, key: str, chunks: tuple[Chunk, ...], dtype: str, shape: tuple[int, ...]) -> Extent:
    """The saved ``chunks`` of ``key`` joined in order, as the extent of a tensor of ``shape``."""
    pieces = []
    for c in chunks:
        ref, tf = tensor_ref(path, key, c, dtype)
        pieces.append(Piece(c.file, tf.byte_offset(ref), math.prod(c.sizes) * itemsize(dtype)))
    if len(pieces) == 1:
        return Extent(pieces[0].file, pieces[0].offset, dtype, shape)
    return Extent.joined(pieces, dtype, shape)
