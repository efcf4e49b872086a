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

Memory: DCP's writer takes the whole state dict at once, so the export holds every tensor of the
checkpoint (about 3-4x the fp32 model for Adam) in host memory; the DeepSpeed export streams instead.
"""
from __future__ import annotations

import os
import warnings
from typing import Any, Iterable

from ...errors import ForeignFormatError
from ...store.atomic import staged_dir
from ..base import ExportSource, Written

STYLES = {"state_dict": ("model.", "optim."), "torchtitan": ("", "optimizer.")}


def check_style(style: str) -> tuple[str, str]:
    """The (model, optimizer) key prefixes of a DCP style; UCL503 for an unknown one."""
    if style not in STYLES:
        raise ForeignFormatError(f"unknown DCP style {style!r}; choose {' or '.join(map(repr, STYLES))}",
                                 code="UCL503")
    return STYLES[style]


def write_dcp(src: ExportSource, out: str, tensors: Iterable[tuple[str, Any]], *,
              style: str = "state_dict") -> Written:
    """Write ``tensors`` (torch tensors of ``src.training_keys()``, each kept: DCP's writer takes the
    whole state dict at once) as the DCP folder ``out`` (see the module doc for the keys), through
    ``torch.distributed.checkpoint``'s ``FileSystemWriter`` in this one process. ``out`` appears
    atomically."""
    import torch
    import torch.distributed.checkpoint as dcp

    model_prefix, optim_prefix = check_style(style)
    key_name = {src.master[n]: n for n in src.trainable}
    model_sd: dict[str, Any] = {}
    optim_sd: dict[str, Any] = {}
    for key, tensor in tensors:
        kind, name = key.split("/", 1)
        if key in key_name or kind == "param":
            if key in key_name and tensor.dtype != torch.float32 and tensor.is_floating_point():
                tensor = tensor.float()  # a trainable weight without a master: fp32, as AdamW keeps it
            model_sd[name] = tensor
        elif kind == "step":
            optim_sd[f"state.{name}.step"] = tensor.to(torch.float32)  # torch Adam's step is a 0-d float32
        else:
            optim_sd[f"state.{name}.{kind}"] = tensor
    for alias, target in src.aliases.items():
        model_sd[alias] = model_sd[target]
    if src.groups is not None and len(src.groups) == len(src.hyperparameters):
        for names, hyper in zip(src.groups, src.hyperparameters):
            for n in names:
                for k, v in hyper.items():
                    # JSON turned tuples (Adam's betas) into lists; torch optimizers hold tuples
                    optim_sd[f"param_groups.{n}.{k}"] = tuple(v) if isinstance(v, list) else v
    state_dict = _nest(model_prefix, model_sd) | _nest(optim_prefix, optim_sd)
    with staged_dir(out) as folder:
        with warnings.catch_warnings():  # no_dist is what we ask for: torch's "assuming single process" note is noise
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            dcp.save(state_dict, storage_writer=dcp.FileSystemWriter(folder), no_dist=True)
        size = _size(folder)
    return Written(size, len(model_sd) + sum(1 for k in optim_sd if k.startswith("state.")),
                   dict(format="dcp", style=style, param_groups=src.groups is not None and bool(src.hyperparameters),
                        fp32_master=any(k.startswith("fp32/") for k in src.master.values())))


def _nest(prefix: str, flat: dict[str, Any]) -> dict[str, Any]:
    """``{"model": {...}}`` for prefix ``model.``; the flat dict itself for an empty prefix."""
    return {prefix[:-1]: flat} if prefix else dict(flat)


def _size(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(folder) for f in fs)
