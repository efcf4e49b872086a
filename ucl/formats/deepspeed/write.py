"""The DeepSpeed universal-checkpoint writer: an export's tensors in the layout an engine configured
with ``"checkpoint": {"load_universal": true}`` resumes from at any data-parallel size
(``ucl.ops.export.export_deepspeed_universal`` feeds it).

The layout, as DeepSpeed 0.19.8 writes it (``deepspeed/checkpoint/ds_to_universal.py``) and reads it
(``DeepSpeedEngine.load_checkpoint``, ``base_optimizer.load_hp_checkpoint_state_from_checkpoint_dir``,
``checkpoint/universal_checkpoint.py::load_hp_checkpoint_state``, ZeRO-3:
``stage3.load_hp_checkpoint_state_from_checkpoint_dir_stage3``)::

    OUT/latest_universal                      the tag (the engine reads it when no tag is given)
    OUT/<tag>/mp_rank_00_model_states.pt      engine state: global_steps, skipped_steps, dp_world_size,
                                              mp_world_size, lr_scheduler, ds_config, client state ...
    OUT/<tag>/zero_pp_rank_0_mp_rank_00_model_states.pt   the same, under the name a ZeRO-3 engine globs
    OUT/<tag>/zero/optimizer_state.pt         ds_version, zero_stage, param_groups (hyperparameters per
                                              group, applied by index), optimizer_state_dict (ZeRO-3: step)
    OUT/<tag>/zero/<name>/fp32.pt             {"param": fp32 master, whole, global shape, "cat_dim": 0}
    OUT/<tag>/zero/<name>/exp_avg.pt          {"param": ..., "cat_dim": 0}   (every optimizer-state kind)
    OUT/<tag>/zero/<name>/exp_avg_sq.pt       {"param": ..., "cat_dim": 0}
    OUT/<tag>/zero/<name>/step.pt             a 0-d float32 tensor (not a dict)

The engine loads ``zero/<name>/*.pt`` for each parameter its optimizer holds, cuts its own ZeRO
partition out of the whole tensor, and copies the fp32 masters into the module's weights; it reads
neither the module's frozen parameters nor its buffers from a universal checkpoint (the resuming job
builds them). As ``ds_to_universal`` does, frozen parameters, buffers and tied aliases still get a
``fp32.pt`` (``{"param": tensor}``), and the model-states file keeps them under ``module`` (training
dtype) for whoever wants them. Each ``.pt`` holds plain tensors, numbers, strings, dicts and lists only.

From a checkpoint not imported from DeepSpeed (no ``state["deepspeed"]``), what DeepSpeed would have
recorded is defaulted: ``global_steps`` = ``state["step"]`` (else 0), ``skipped_steps`` 0,
``dp_world_size``/``mp_world_size`` 1, ``lr_scheduler`` None, no ds_config, no client state, no
buffer names; a trainable weight without an fp32 master is upcast to fp32; moments are written in fp32.
Always: ``param_groups`` lists the checkpoint's groups' hyperparameters (none when unrecorded) and then
empty groups up to the number of trainable parameters, because the ZeRO-1/2 loader pairs the engine's
groups with these by index and silently skips the state of every group past the end of the list; an
empty group overrides nothing. No loss-scaler state is written (the engine keeps its configured one).
ZeRO-3 engines apply ``optimizer_state_dict.param_groups[0]`` to every group, so it is left empty
(the resuming job's own hyperparameters stay) and its ``state[0].step`` is the first parameter's step.

DeepSpeed 0.19.8 issue (its own ``ds_to_universal`` output has it too): a ZeRO-3 engine's universal load
stores one step tensor object in every sub-group's optimizer state, and torch's AdamW bumps it in
place once per group, so with 2+ sub-groups the next step uses a too-large step. Resuming jobs can
un-share it after ``load_checkpoint``: ``for s in engine.optimizer.optimizer.state.values():
s["step"] = s["step"].clone()``. ZeRO-1/2 loads are not affected.

Streams: each tensor passes in pieces (``Pieces``, ``torchzip.write.PiecedTensor``: at most a piece of it in
memory at a time), plus the frozen parameters and buffers kept whole for ``module`` (bounded: UCL011).
"""
from __future__ import annotations

import os
import re
import warnings
from collections import OrderedDict
from typing import Any, Iterable

import numpy as np

from ...dtypes import FLOAT_DTYPES, itemsize, to_float32
from ...errors import ForeignFormatError, UclError
from ...memory import format_size
from ...store.atomic import fsync_dir, staged_dir
from ..base import ExportSource, Pieces, Written
from ..torchzip import write as torchsave
from ..torchzip.plain import MAX_KEPT_TENSOR_BYTES, kept_tensor

UC_VERSION = 0.4  # deepspeed.checkpoint.constants.UNIVERSAL_CHECKPOINT_VERSION_VALUE in 0.19.8
DS_VERSION = "0.19.8"  # written when the source does not say; DeepSpeed's loader requires some version
_TAG = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")


def write_deepspeed_universal(src: ExportSource, out: str, tensors: Iterable[tuple[str, Pieces]], *,
                              tag: str | None = None, durable: bool = True,
                              kept_bytes: int | None = None) -> Written:
    """Write ``tensors`` (:class:`~ucl.formats.base.Pieces` of ``src.training_keys()``, in that
    order, each read only while current) as the DeepSpeed universal checkpoint folder ``out`` (see
    the module doc), ``tag`` defaulting to ``global_step<global_steps>``. Names are checked before
    the first tensor is asked for. ``kept_bytes``: at most this many bytes of frozen tensors are
    kept for the model states (UCL011 beyond; None: no bound). ``out`` appears atomically."""
    ds = src.state.get("deepspeed") if isinstance(src.state.get("deepspeed"), dict) else {}
    steps = ds.get("global_steps", src.state.get("step", 0))
    tag = tag if tag is not None else f"global_step{steps if isinstance(steps, int) else 0}"
    if not _TAG.match(tag):
        raise ForeignFormatError(f"tag {tag!r} is not a plain folder name", code="UCL503")
    for name in src.trainable + src.frozen + tuple(src.aliases):
        if "/" in name or os.sep in name or name in (".", ".."):
            raise ForeignFormatError(f"parameter name {name!r} cannot be a folder name under zero/", code="UCL503")

    with staged_dir(out) as folder:
        zero = os.path.join(folder, tag, "zero")
        os.makedirs(zero)
        written = _Writer(durable)
        module, first_step = _write_tensors(src, zero, written, tensors,
                                            kept_bytes if kept_bytes is not None else 1 << 62)
        states = _model_states(src, ds, steps, module)
        for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt"):
            written.save(states, os.path.join(folder, tag, name))
        written.save(_optimizer_state(src, ds, first_step), os.path.join(zero, "optimizer_state.pt"))
        with open(os.path.join(folder, "latest_universal"), "w") as f:
            f.write(tag)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        if durable:
            for d, _, _ in os.walk(folder):
                fsync_dir(d)
    return Written(written.bytes, written.tensors,
                   dict(format="deepspeed-universal", tag=tag, from_deepspeed=bool(ds),
                        fp32_master=any(k.startswith("fp32/") for k in src.master.values())))


class _Writer:
    """A ``torch.save``-format file (written without torch), fsynced when durable; counts what it wrote."""

    def __init__(self, durable: bool):
        self.durable, self.bytes, self.tensors = durable, 0, 0

    def save(self, obj: Any, path: str, tensors: int = 0) -> None:
        self.bytes += torchsave.save(obj, path, durable=self.durable)
        self.tensors += tensors


def _write_tensors(src: ExportSource, zero: str, w: _Writer, tensors: Iterable[tuple[str, Pieces]],
                   kept_bytes: int):
    """Every ``zero/<name>/<kind>.pt``, one tensor at a time, each written piece by piece; returns
    (module of frozen tensors in training dtype, the first step seen). The module is written whole
    into the model states (DeepSpeed's format), so frozen tensors over ``kept_bytes`` in all are
    refused (UCL011)."""
    master_of = {k: n for n, k in src.master.items()}
    aliases_of: dict[str, list[str]] = {}
    for alias, target in src.aliases.items():
        aliases_of.setdefault(target, []).append(alias)
    module: dict[str, Any] = {}
    first_step = None
    kept = 0

    def put(name: str, kind: str, obj: Any) -> None:
        folder = os.path.join(zero, name)
        os.makedirs(folder, exist_ok=True)
        w.save(obj, os.path.join(folder, f"{kind}.pt"), tensors=1)

    for key, pieces in tensors:  # each written at once: its pieces are read only while it is current
        kind, name = key.split("/", 1)
        if key in master_of:
            fp32 = _float(pieces)
            put(name, "fp32", {"param": fp32, "cat_dim": 0})
            for alias in aliases_of.get(name, ()):  # ds_to_universal writes the tied alias's weight too
                put(alias, "fp32", {"param": fp32})
        elif kind == "param":  # frozen parameter or buffer: not restored by the engine, kept for users
            kept += pieces.size * itemsize(pieces.dtype)
            if kept > kept_bytes:
                raise UclError(f"the frozen parameters and buffers, which DeepSpeed's model states file holds "
                               f"whole, need {format_size(kept)} so far (at {name}), more than the max_memory "
                               "cap leaves for them; give a larger max_memory", code="UCL011")
            module[name] = torchsave.Tensor(pieces.whole().copy(), pieces.dtype)  # kept to the end
            put(name, "fp32", {"param": _float(pieces)})
        elif kind == "step":  # DeepSpeed's own type: a 0-d float32 tensor
            array, dtype = pieces.whole(), pieces.dtype
            value = float(to_float32(array, dtype)) if dtype in FLOAT_DTYPES else float(array)
            step = torchsave.Tensor(np.array(value, dtype=np.float32), "float32")
            first_step = step if first_step is None else first_step
            put(name, "step", step)
        else:
            put(name, kind, {"param": _float(pieces), "cat_dim": 0})
    return {n: module[n] for n in src.frozen if n in module}, first_step


def _float(pieces: Pieces) -> torchsave.PiecedTensor:
    """As torch's ``.float()`` on a floating tensor, piece by piece; other dtypes as they are."""
    if pieces.dtype not in FLOAT_DTYPES:
        return torchsave.PiecedTensor(pieces.shape, pieces.dtype, lambda: (a for _, a in pieces))
    return torchsave.PiecedTensor(pieces.shape, "float32",
                                  lambda: (to_float32(a, pieces.dtype) for _, a in pieces))


def _client_value(value: Any, path: str, dropped: list[str]) -> Any:
    """A client-state value as the import kept it, tensors back as tensors (bit for bit); a tensor
    kept as a description only (too large) goes to ``dropped`` by its path and is left out."""
    kept = kept_tensor(value)
    if kept is not None:
        return torchsave.Tensor(*kept)
    if isinstance(value, dict) and set(value) == {"tensor", "dtype"}:
        dropped.append(path)
        return None
    if isinstance(value, dict):
        out = {k: _client_value(v, f"{path}.{k}", dropped) for k, v in value.items()}
        return {k: v for k, v in out.items() if f"{path}.{k}" not in dropped}
    if isinstance(value, list):
        out = [_client_value(v, f"{path}[{i}]", dropped) for i, v in enumerate(value)]
        return [v for i, v in enumerate(out) if f"{path}[{i}]" not in dropped]
    return value


def _model_states(src: ExportSource, ds: dict, steps: Any, module: dict) -> dict:
    """What DeepSpeed's engine reads from ``mp_rank_00_model_states.pt`` on a universal load (global_steps,
    skipped_steps, dp/mp world sizes, lr_scheduler; everything else comes back as client state)."""
    groups = src.groups if src.groups is not None else (src.trainable,)
    shapes = {n: torchsave.Size(src.datasets[src.master[n]][0]) for n in src.trainable}
    dropped: list[str] = []
    states = {k: _client_value(v, k, dropped) for k, v in ds.items()
              if k not in ("module", "optimizer", "param_shapes")}
    states = {k: v for k, v in states.items() if k not in dropped}
    if dropped:
        warnings.warn(f"client state {', '.join(dropped[:5])}{', ...' if len(dropped) > 5 else ''}: tensors over "
                      f"{MAX_KEPT_TENSOR_BYTES // 1024} KiB, which the import described without their values; left "
                      "out of the export (DeepSpeed's load_checkpoint returns the client state without them)",
                      stacklevel=3)
    states.update(
        module=OrderedDict(module),
        optimizer=None,
        param_shapes=[OrderedDict((n, shapes[n]) for n in g) for g in groups],
        shared_params=dict(src.aliases),
        universal_checkpoint_info={"universal_checkpoint_version": UC_VERSION},
    )
    defaults = dict(buffer_names=[], frozen_param_shapes=None, frozen_param_fragments=None, lr_scheduler=None,
                    data_sampler=None, random_ltd=None, skipped_steps=0,
                    global_steps=steps if isinstance(steps, int) else 0, dp_world_size=1, mp_world_size=1,
                    checkpoint_parallel_dimensions={"pp_degree": 1, "tp_degree": 1}, ds_version=DS_VERSION)
    for k, v in defaults.items():
        states.setdefault(k, v)
    return states


def _optimizer_state(src: ExportSource, ds: dict, first_step) -> dict:
    """``zero/optimizer_state.pt``: the global optimizer state both loaders read (see the module doc)."""
    hyper = [_hyper(g) for g in src.hyperparameters]
    hyper += [{} for _ in range(max(0, len(src.trainable) - len(hyper)))]
    stage = (src.state.get("optimizer") or {}).get("zero_stage")
    sd: dict[str, Any] = {
        "ds_version": str(ds.get("ds_version") or DS_VERSION),
        "param_groups": hyper,
        "optimizer_state_dict": {"state": {0: {"step": first_step if first_step is not None else
                                                  torchsave.Tensor(np.array(0.0, np.float32), "float32")}},
                                 "param_groups": [{}]},
    }
    if isinstance(stage, int):
        sd["zero_stage"] = stage
    return sd


def _hyper(group: dict) -> dict:
    # JSON turned tuples (Adam's betas) into lists; torch optimizers hold tuples
    return {k: tuple(v) if isinstance(v, list) else v for k, v in group.items()}
