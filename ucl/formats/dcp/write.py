"""The DCP writer: an export's tensors as a PyTorch Distributed Checkpoint folder, written by torch's
own ``FileSystemWriter`` (``ucl.ops.export.export_dcp`` feeds it).

Keys follow ``torch.distributed.checkpoint.state_dict.get_state_dict(model, optim,
options=StateDictOptions(flatten_optimizer_state_dict=True))`` saved as ``{"model": msd, "optim": osd}``
(checked against torch 2.13), so a job of any layout (plain, DDP, FSDP2, TP) loads it with
``dcp.load`` + ``set_state_dict``:

* ``model.<fqn>``: every parameter and persistent buffer, tied aliases included
  (``lm_head.weight`` next to ``embed.weight``, as ``get_state_dict`` lists both). A trainable
  parameter is its **fp32 master** when the checkpoint has one (``fp32/<fqn>``, bf16 runs): torch
  mixed precision (FSDP2 ``MixedPrecisionPolicy``, torchtitan) keeps fp32 parameters and casts per
  step, so the master is what such a resume wants; a bf16 module loading it gets it cast by DCP.
* ``optim.state.<fqn>.<kind>``: ``exp_avg``, ``exp_avg_sq`` (any optimizer-state kind), ``step`` as
  a 0-d float32 tensor (torch's own type for Adam's step).
* ``optim.param_groups.<fqn>.<hyperparameter>``: written when the checkpoint records the groups'
  hyperparameters and which parameters each group holds (one group; DeepSpeed ZeRO-1/2 imports; groups
  listing ``params``/``names``). Otherwise left out: load with
  ``DefaultLoadPlanner(allow_partial_load=True)`` and the job keeps its own hyperparameters.

``style="torchtitan"`` writes the same with model keys at the top level and the optimizer under
``optimizer.`` (torchtitan's ``CheckpointManager``); it writes no ``train_state``, ``lr_scheduler`` or
``dataloader``, so resume with ``exclude_from_loading`` naming them.

Memory: the state dict handed to DCP's writer holds placeholders (meta tensors); a planner
(``DefaultSavePlanner`` extended) cuts each tensor larger than a piece of the ``max_memory`` cap into
chunks of whole rows, saved as a sharded tensor's chunks are, and reads each chunk from the checkpoint
only when the writer resolves it. ``dcp.load`` and ``dcp_to_torch_save`` read chunked tensors as any.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import os
import warnings
from typing import Any, Callable

import numpy as np

from ...dtypes import FLOAT_DTYPES, itemsize, to_torch, torch_dtype
from ...errors import ForeignFormatError
from ...store.atomic import staged_dir
from ..base import ExportSource, Pieces, Written

STYLES = {"state_dict": ("model.", "optim."), "torchtitan": ("", "optimizer.")}


def check_style(style: str) -> tuple[str, str]:
    """The (model, optimizer) key prefixes of a DCP style; UCL503 for an unknown one."""
    if style not in STYLES:
        raise ForeignFormatError(f"unknown DCP style {style!r}; choose {' or '.join(map(repr, STYLES))}",
                                 code="UCL503")
    return STYLES[style]


def write_dcp(src: ExportSource, out: str, keys: list[str], pieces: Callable[[str], Pieces], *,
              style: str = "state_dict", piece_bytes: int | None = None) -> Written:
    """Write the tensors of ``src.training_keys()`` (``keys``), each read when DCP's writer asks for
    it as ``pieces(key)``, as the DCP folder ``out`` (see the module doc for the keys), through
    ``torch.distributed.checkpoint``'s ``FileSystemWriter`` in this one process. A tensor over
    ``piece_bytes`` is saved as several chunks of whole rows (as a sharded tensor is), each read and
    written on its own, so no more than a chunk of it is in memory. ``out`` appears atomically."""
    import torch
    import torch.distributed.checkpoint as dcp

    model_prefix, optim_prefix = check_style(style)
    key_name = {src.master[n]: n for n in src.trainable}
    model_sd: dict[str, Any] = {}
    optim_sd: dict[str, Any] = {}
    lazy: dict[str, tuple[str, Any]] = {}  # flattened DCP key -> (dataset key, dtype it is written in)
    for key in keys:
        kind, name = key.split("/", 1)
        shape, dtype = src.datasets[key]
        if key in key_name or kind == "param":
            want = "float32" if key in key_name and dtype in FLOAT_DTYPES and dtype != "float32" else dtype
            model_sd[name] = (key, want)  # a trainable weight without a master: fp32, as AdamW keeps it
        elif kind == "step":
            optim_sd[f"state.{name}.step"] = (key, "float32")  # torch Adam's step is a 0-d float32
        else:
            optim_sd[f"state.{name}.{kind}"] = (key, dtype)
    for alias, target in src.aliases.items():
        model_sd[alias] = model_sd[target]
    tensors = len(model_sd) + len(optim_sd)
    total = sum(math.prod(src.datasets[k][0]) * itemsize(w) for sd in (model_sd, optim_sd) for k, w in sd.values())
    for prefix, sd in ((model_prefix, model_sd), (optim_prefix, optim_sd)):
        for name, (key, want) in sd.items():
            lazy[prefix + name] = (key, want)
            sd[name] = torch.empty(src.datasets[key][0], dtype=torch_dtype(want), device="meta")
    if src.groups is not None and len(src.groups) == len(src.hyperparameters):
        for names, hyper in zip(src.groups, src.hyperparameters):
            for n in names:
                for k, v in hyper.items():
                    # JSON turned tuples (Adam's betas) into lists; torch optimizers hold tuples
                    optim_sd[f"param_groups.{n}.{k}"] = tuple(v) if isinstance(v, list) else v
    state_dict = _nest(model_prefix, model_sd) | _nest(optim_prefix, optim_sd)
    planner = _piece_planner(lazy, pieces, piece_bytes)
    with staged_dir(out) as folder:
        with warnings.catch_warnings():  # no_dist is what we ask for: torch's "assuming single process" note is noise
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            # torch's writer keeps every tensor of a file alive until that file is done (torch 2.13,
            # filesystem._write_files_from_queue): over the cap, one file per chunk instead of one file
            one_file = piece_bytes is None or total <= piece_bytes
            dcp.save(state_dict, storage_writer=dcp.FileSystemWriter(folder, single_file_per_rank=one_file,
                                                                            per_thread_copy_ahead=0),
                     planner=planner, no_dist=True)
        size = _size(folder)
    return Written(size, tensors,
                   dict(format="dcp", style=style, param_groups=src.groups is not None and bool(src.hyperparameters),
                        fp32_master=any(k.startswith("fp32/") for k in src.master.values())))


def chunks(shape: tuple[int, ...], step: int) -> list[tuple[tuple[int, ...], tuple[int, ...], int, int]]:
    """``shape`` cut into boxes of at most ``step`` elements, each a flat range of the row-major
    tensor: ``(offsets, sizes, first, stop)``. Whole rows of dim 0 where one fits in ``step``, else
    the first dim whose inner block fits is cut and the dims before it go one index at a time."""
    total = math.prod(shape)
    if not shape or total == 0 or total <= step:
        return [((0,) * len(shape), tuple(shape), 0, total)]
    k = 0
    while math.prod(shape[k + 1:]) > step:
        k += 1
    inner = math.prod(shape[k + 1:])
    per = max(1, step // inner)
    out = []
    for idx in itertools.product(*(range(n) for n in shape[:k])):
        base = sum(i * math.prod(shape[j + 1:]) for j, i in enumerate(idx))
        for a in range(0, shape[k], per):
            b = min(a + per, shape[k])
            out.append((tuple(idx) + (a,) + (0,) * (len(shape) - k - 1), (1,) * k + (b - a,) + tuple(shape[k + 1:]),
                        base + a * inner, base + b * inner))
    return out


def _piece_planner(lazy: dict[str, tuple[str, Any]], pieces: Callable[[str], Pieces], piece_bytes: int | None):
    """A ``DefaultSavePlanner`` whose tensors (meta placeholders in the state dict) are cut into
    chunks (:func:`chunks`) and read from ``pieces`` only when the writer resolves each chunk."""
    import torch
    from torch.distributed.checkpoint import DefaultSavePlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    class PiecePlanner(DefaultSavePlanner):
        def create_local_plan(self):
            plan = super().create_local_plan()
            items = []
            for item in plan.items:
                if item.index.fqn not in lazy:
                    items.append(item)
                    continue
                td = item.tensor_data
                step = max(1, (piece_bytes or 1 << 62) // max(1, td.properties.dtype.itemsize))
                cut = chunks(tuple(td.size), step)
                for offsets, sizes, _, _ in cut:
                    items.append(WriteItem(
                        index=MetadataIndex(item.index.fqn, torch.Size(offsets)),
                        type=WriteItemType.SHARD if len(cut) > 1 else item.type,
                        tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=torch.Size(offsets),
                                                                                sizes=torch.Size(sizes)),
                                                    properties=td.properties, size=td.size)))
            self.plan = dataclasses.replace(plan, items=items)
            return self.plan

        def resolve_data(self, write_item):
            fqn = write_item.index.fqn
            if fqn not in lazy:
                return super().resolve_data(write_item)
            key, want = lazy[fqn]
            chunk = write_item.tensor_data.chunk
            shape = tuple(write_item.tensor_data.size)
            p = pieces(key)
            first = sum(o * math.prod(shape[j + 1:]) for j, o in enumerate(chunk.offsets))
            piece = p.read(first, first + math.prod(chunk.sizes))
            if p.dtype != want:
                return to_torch(piece, p.dtype).to(torch_dtype(want)).reshape(tuple(chunk.sizes))
            # into a buffer of exactly its size, reused: torch's writer copies a tensor whose storage is
            # larger (the piece buffer is), and fresh buffers per chunk leave freed heap behind (PSS)
            if self._out is None or self._out.nbytes != piece.nbytes or self._out.dtype != piece.dtype:
                self._out = np.empty(piece.shape, piece.dtype)
            np.copyto(self._out, piece)
            return to_torch(self._out, p.dtype).reshape(tuple(chunk.sizes))

    PiecePlanner._out = None

    return PiecePlanner()


def _nest(prefix: str, flat: dict[str, Any]) -> dict[str, Any]:
    """``{"model": {...}}`` for prefix ``model.``; the flat dict itself for an empty prefix."""
    return {prefix[:-1]: flat} if prefix else dict(flat)


def _size(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(folder) for f in fs)
