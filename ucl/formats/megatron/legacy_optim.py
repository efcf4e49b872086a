"""Megatron-LM legacy ``distrib_optim.pt`` (``--use-distributed-optimizer`` with ``--ckpt-format
torch``), described for reading in place (called by :mod:`ucl.formats.megatron.legacy`).

What the file is (megatron-core 0.16 ``DistributedOptimizer.save_parameter_state``, written by data-
parallel rank 0 beside each model-parallel rank's ``model_optim_rng.pt``): a ``torch.save`` dict
``{"buckets_coalesced": True, 0: {(param dtype, grad dtype): {"param": fp32 [N], "exp_avg": [N],
"exp_avg_sq": [N], "numel_unpadded": N}}}``: the rank's DDP gradient buffer gathered over the
data-parallel group, every bucket without its end padding, concatenated. With one bucket (the
default: ``--overlap-grad-reduce`` off) that is the buffer of ``stdlib:megatron_gpt``'s distributed-
optimizer statement (the rank's TP-local parameters in reverse model order, each at a multiple of 64
elements) up to its last parameter, the padding to ``lcm(dp, 128)`` left out. Megatron's ``param``
is the fp32 master (ucl kind ``fp32``).

Each model-parallel rank's ``fp32/@flat0``, ``exp_avg/@flat0`` and ``exp_avg_sq/@flat0`` (data-
parallel size 1: the file holds the whole buffer) is then that tensor's bytes in place followed by
zeros (:data:`~ucl.store.extents.ZEROS`) up to the padded size. ``N`` is checked against the
parameters the rank's file holds, laid out with Megatron's rule; anything else is UCL502: several
buckets, several buffers (parameter dtypes, experts, virtual pipeline chunks), a tied embedding on
several pipeline stages (Megatron gives it a bucket of its own), the uncoalesced older format.
"""
from __future__ import annotations

import os
from typing import Any

from ...dtypes import itemsize
from ...errors import ForeignFormatError
from ...store.extents import ZEROS, Extent, Piece
from ..torchzip.read import TensorRef, TorchFile, read_torch_file

DISTRIB_OPTIM = "distrib_optim.pt"
KINDS = {"param": "fp32", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}  # Megatron's -> ucl's
ALIGN = 64  # each parameter starts 128-byte aligned in the buffer
BUCKET_MULTIPLE = 128  # the buffer's end is padded to lcm(dp, 128)
BUCKET_DEFAULT = 40_000_000  # DDP's bucket_size when --ddp-bucket-size is not given: max(this, 1e6 * dp)



def refuse_unsupported(args: dict, folder: str, vpp: int, pp: int, tied: bool, spec_name: str) -> None:
    if spec_name != "stdlib:megatron_gpt":
        raise ForeignFormatError(f"{folder}: {DISTRIB_OPTIM} beside legacy module names (language_model.*) is not read: "
                     f"{spec_name} does not say how their older Megatron-LM aligned the buffer")
    if vpp > 1:
        raise ForeignFormatError(f"{folder}: {DISTRIB_OPTIM} of a run with virtual pipeline stages (one gradient buffer per "
                     "model chunk) is not read yet")
    if tied and pp > 1:
        raise ForeignFormatError(f"{folder}: {DISTRIB_OPTIM} of a run with a tied embedding on {pp} pipeline stages (Megatron "
                     "keeps it in a bucket of its own) is not read yet")


def unpadded_size(sizes: list[int]) -> int:
    """Megatron's buffer end for parameters of ``sizes`` (model order): laid out in reverse, each
    start rounded up to a multiple of 64."""
    pos = 0
    for n in reversed(sizes):
        pos = -(-pos // ALIGN) * ALIGN + n
    return pos


def read(path: str, rel: str, sizes: list[int], args: dict) -> tuple[dict[str, tuple[TorchFile, TensorRef]], int]:
    """The rank's ``distrib_optim.pt`` (relative path ``rel``): Megatron kind -> its 1-D tensor, and
    N, checked against the parameters' ``sizes`` in model order."""
    tf = read_torch_file(os.path.join(path, rel), inside=path)
    obj = tf.obj
    if not isinstance(obj, dict) or obj.get("buckets_coalesced") is not True:
        raise ForeignFormatError(f"{rel} is not Megatron's coalesced parameter state ({{'buckets_coalesced': True, 0: ...}}); "
                     "the older per-bucket format is not read")
    buffers = [k for k in obj if k != "buckets_coalesced"]
    if buffers != [0] or not isinstance(obj[0], dict) or len(obj[0]) != 1:
        raise ForeignFormatError(f"{rel} holds gradient buffers {buffers} with dtypes "
                     f"{list(obj[0]) if buffers == [0] and isinstance(obj[0], dict) else '?'}: several parameter "
                     "dtypes or experts; ucl reads one buffer of one dtype")
    state: Any = next(iter(obj[0].values()))
    n = state.get("numel_unpadded") if isinstance(state, dict) else None
    want = unpadded_size(sizes)
    if n != want:
        raise ForeignFormatError(f"{rel}: numel_unpadded is {n!r}, but the rank's {len(sizes)} parameters laid out Megatron's "
                     f"way (reverse order, each at a multiple of {ALIGN}) end at {want}")
    if args.get("overlap_grad_reduce"):
        dp = args.get("data_parallel_size") or 1
        size = args.get("ddp_bucket_size") or max(BUCKET_DEFAULT, 1_000_000 * int(dp))
        if want >= size:
            raise ForeignFormatError(f"{rel}: with --overlap-grad-reduce the buffer ({want:,} elements) is cut into buckets of "
                         f"{size:,} whose end padding the file leaves out; ucl reads the single-bucket layout")
    out = {}
    for mkind in KINDS:
        t = state.get(mkind)
        if not isinstance(t, TensorRef) or t.shape != (n,) or t.dtype != "float32" or not t.contiguous:
            raise ForeignFormatError(f"{rel}: {mkind!r} is {getattr(t, 'shape', type(t).__name__)} "
                         f"{getattr(t, 'dtype', '')}, not a contiguous float32 tensor of {n} elements")
        out[mkind] = (tf, t)
    return out, n


def extent(rel: str, tf: TorchFile, t: TensorRef, length: int) -> Extent:
    """The tensor ``t`` followed by zeros to ``length`` elements (the buffer's end padding)."""
    n, item = t.shape[0], itemsize(t.dtype)
    if length != -(-n // BUCKET_MULTIPLE) * BUCKET_MULTIPLE:  # dp = 1: padded to lcm(1, 128)
        raise ForeignFormatError(f"{rel}: a buffer of {n} elements pads to {-(-n // BUCKET_MULTIPLE) * BUCKET_MULTIPLE} at data-"
                     f"parallel size 1, but the spec's layout gives {length}")
    pieces = [Piece(rel, tf.byte_offset(t), n * item)]
    if length > n:
        pieces.append(Piece(ZEROS, 0, (length - n) * item))
    return Extent.joined(pieces, t.dtype, (length,))
