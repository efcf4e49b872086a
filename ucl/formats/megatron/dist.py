"""Megatron-core ``dist_checkpointing`` folders in the ``torch_dist`` format, described for reading
in place.

Such a folder is a PyTorch DCP folder (``.metadata``, ``__R_K.distcp``) written by Megatron, plus
``metadata.json`` (``{"sharded_backend": "torch_dist", ...}``) and ``common.pt`` (the state every
rank shares: iteration, optimizer hyperparameters; a plain ``torch.save`` dict). Its tensor keys
are Megatron's sharded keys: global tensors, with a layer's parameters stacked along a prepended
axis in global layer numbering (``decoder.layers.self_attention.linear_qkv.weight [L, ...]``) and
the vocabulary stored padded. They are described in Megatron's own axes, ``mesh pp, dp, tp``
(:mod:`ucl.formats.megatron.stacked`), or, where the chunk grid is not Megatron's, as any DCP folder
(:func:`ucl.formats.dcp.read.describe_dcp`, axes named from the grid alone, as the state then says).
Which tensor is which:

* a model key -> kind ``param``, named by the key;
* ``optimizer.state.<kind>.<model key>`` (the ``fully_reshardable`` distributed optimizer) -> kind
  ``fp32`` for Megatron's ``param`` (the fp32 master), else ``<kind>`` (``exp_avg``, ``exp_avg_sq``),
  of that model key.

The default ``dp_reshardable`` distributed optimizer saves each data-parallel bucket as one 1-D
tensor per kind whose chunks are the ranks' irregular shard ranges
(``optimizer.distributed.dp_group_idx_G...bucket_idx_B.{param,exp_avg,exp_avg_sq}``): such a folder
is described by :mod:`ucl.formats.megatron.buckets` instead (one parameter per layer, mesh ``dp``,
Megatron's buffer layout as ``flat over dp reverse align 64 ...`` statements, checked against every
saved chunk). ``common.pt`` and ``metadata.json`` go into ``state['megatron']``.
"""
from __future__ import annotations

import json
import os

from ...errors import ForeignFormatError, StoreError
from ...files import parse_json, read_bounded
from ..dcp.read import describe_dcp
from ..dcp.metadata import METADATA, read_metadata
from ..base import Description
from .buckets import describe_buckets, has_buckets
from .stacked import describe_stacked
from ..torchzip.read import read_torch_file
from ..torchzip.plain import plain

META_JSON = "metadata.json"
COMMON = "common.pt"
_OPTIMIZER_STATE = "optimizer.state."
_BUCKETS = "optimizer.distributed."



def _metadata_json(path: str) -> dict | None:
    p = os.path.join(path, META_JSON)
    if not os.path.isfile(p):
        return None
    error = lambda m: StoreError(m, code="UCL500")  # noqa: E731
    data = parse_json(read_bounded(p, limit=1 << 20, what="Megatron metadata.json", inside=path, error=error),
                      f"Megatron metadata {p}", error)
    return data if isinstance(data, dict) else None


def detect(path: str) -> bool:
    meta = _metadata_json(path) if os.path.isfile(os.path.join(path, METADATA)) else None
    return meta is not None and "sharded_backend" in meta


def describe(path: str) -> Description:
    meta = _metadata_json(path)
    if meta is None or "sharded_backend" not in meta:
        raise StoreError(f"{path} is not a Megatron dist_checkpointing folder (no {META_JSON} naming a "
                         "sharded_backend)", code="UCL501")
    if meta.get("sharded_backend") != "torch_dist":
        raise ForeignFormatError(f"{path} was saved with the {meta.get('sharded_backend')!r} backend; ucl reads Megatron's "
                     "torch_dist format (the default)")
    common = {}
    if os.path.exists(os.path.join(path, COMMON)):
        common = plain(read_torch_file(os.path.join(path, COMMON), inside=path).obj, where=os.path.join(path, COMMON))
    state = {"megatron": {"metadata": meta, "common": common}}
    md = read_metadata(path)
    if has_buckets(md):  # the dp_reshardable distributed optimizer
        d = describe_buckets(path, md, state)
        return Description(d.format, d.spec, d.spec_name, d.dims, d.mesh, d.params, d.frozen, d.extents, d.files,
                           d.state, d.read + ((COMMON,) if common else ()) + (META_JSON,))
    try:
        d = describe_stacked(path, md, common, state)
    except ForeignFormatError as e:  # a grid Megatron's axes do not explain: the generic DCP reading
        d = describe_dcp(path, "megatron", state=state, classify=classify)
        d.state["megatron"]["layout"] = {"axes": "inferred from the chunk grid alone; they are not Megatron's "
                                                 f"tp/pp/dp ({e})"}
    return Description(d.format, d.spec, "megatron-torch_dist", d.dims, d.mesh, d.params, d.frozen, d.extents,
                       d.files, d.state, d.read + ((COMMON,) if common else ()) + (META_JSON,))


def classify(paths: dict[str, tuple]) -> dict[str, tuple[str, str] | None]:
    """(kind, parameter) of each tensor key of a torch_dist folder (see the module doc)."""
    buckets = sorted(k for k in paths if k.startswith(_BUCKETS))
    if buckets:  # describe() hands such folders to megatron_buckets; the DCP grid cannot say them
        raise ForeignFormatError(f"the distributed optimizer state is saved as data-parallel buckets ({len(buckets)} tensors, "
                     f"e.g. {json.dumps(buckets[0])}): Megatron's dp_reshardable format, which "
                     "ucl.formats.megatron.buckets describes, not a chunk grid")
    out: dict[str, tuple[str, str] | None] = {}
    for key in paths:
        if key.startswith(_OPTIMIZER_STATE):
            kind, _, name = key[len(_OPTIMIZER_STATE):].partition(".")
            out[key] = ("fp32" if kind == "param" else kind, name) if name else None
        elif key.startswith("optimizer."):
            out[key] = None
        else:
            out[key] = ("param", key)
    return out
