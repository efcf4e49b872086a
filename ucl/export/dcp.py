"""Export to a PyTorch Distributed Checkpoint (DCP) folder, written by torch's own ``FileSystemWriter``.

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
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterator

from ..errors import StoreError
from ..layout.mesh import UNIVERSAL
from ..ops.load import iter_rank
from ..ops.prepare import expected_datasets, model_of, open_checkpoint
from ..ops.stats import IOStats
from ..store.atomic import TempDir, publish_dir

_WEIGHT_KINDS = ("param", "fp32")  # every other kind but step is optimizer state
_STYLES = {"state_dict": ("model.", "optim."), "torchtitan": ("", "optimizer.")}


@dataclass(frozen=True)
class ExportSource:
    """What an export needs to know about a checkpoint, from its manifest alone (no tensor read)."""

    path: str
    datasets: dict[str, tuple[tuple[int, ...], str]]  # universal key -> (shape, logical dtype)
    trainable: tuple[str, ...]  # parameters with optimizer state, in the checkpoint's order
    frozen: tuple[str, ...]  # frozen parameters and persistent buffers
    master: dict[str, str]  # trainable name -> key of its fp32 master ("fp32/N", else "param/N")
    moments: dict[str, tuple[str, ...]]  # trainable name -> its optimizer-state keys but step
    aliases: dict[str, str]  # tied alias -> the parameter it shares storage with
    hyperparameters: tuple[dict, ...]  # per optimizer param group, without "params"
    groups: tuple[tuple[str, ...], ...] | None  # trainable names per group, None when unknown
    state: dict = field(default_factory=dict)  # the manifest's non-tensor state

    def step_key(self, name: str) -> str | None:
        key = f"step/{name}"
        return key if key in self.datasets else None


def survey(path: str | os.PathLike) -> ExportSource:
    """The tensors of ``path`` (a ucl checkpoint or a foreign folder read in place) sorted into what
    exports write: weights, fp32 masters, optimizer state, frozen tensors, tied aliases, groups."""
    with open_checkpoint(path) as ckpt:
        model = model_of(ckpt)
        state = ckpt.manifest.state if isinstance(ckpt.manifest.state, dict) else {}
    datasets = {k: (tuple(s), d) for k, (s, d) in expected_datasets(model, UNIVERSAL, 0).items()}
    names = list(model.params)
    found: dict[str, list[str]] = {n: [] for n in names}
    for key in datasets:
        kind, name = key.split("/", 1)
        if kind not in _WEIGHT_KINDS + ("step",) and name in found:
            found[name].append(key)
    moments = {n: tuple(found[n]) for n in names}
    trainable = tuple(n for n in names if moments[n])
    frozen = tuple(n for n in names if not moments[n] and f"param/{n}" in datasets)
    master = {n: f"fp32/{n}" if f"fp32/{n}" in datasets else f"param/{n}" for n in trainable}
    missing = [n for n in trainable if master[n] not in datasets]
    if missing:
        raise StoreError(f"{path}: {missing[0]!r} has optimizer state but no weights (param/ or fp32/)",
                         code="UCL503")
    ds = state.get("deepspeed") if isinstance(state.get("deepspeed"), dict) else {}
    aliases = {str(a): str(t) for a, t in (ds.get("shared_params") or {}).items()
               if str(t) in model.params and str(a) not in model.params}
    optim = state.get("optimizer") if isinstance(state.get("optimizer"), dict) else {}
    raw = [g for g in (optim.get("param_groups") or []) if isinstance(g, dict)]
    hyper = tuple({k: v for k, v in g.items() if k not in ("params", "names")} for g in raw)
    return ExportSource(os.fspath(path), datasets, trainable, frozen, master,
                        {n: moments[n] for n in trainable}, aliases, hyper,
                        _groups(model, state, raw, trainable), state)


def _groups(model, state: dict, raw: list[dict], trainable: tuple[str, ...]):
    """Which trainable parameters each param group holds, where the checkpoint says so."""
    listed = [g.get("params", g.get("names")) for g in raw]
    if raw and all(isinstance(x, list) and all(isinstance(n, str) for n in x) for x in listed):
        return tuple(tuple(n for n in x if n in trainable) for x in listed)
    if len(raw) == 1:
        return (trainable,)
    optim = state.get("optimizer") or {}
    if raw and state.get("format") == "deepspeed" and optim.get("zero_stage") in (1, 2):
        # ucl's DeepSpeed reader writes one `state ... for` statement per ZeRO-1/2 param group, in order
        decls: dict[int, list[str]] = {}
        first = set(trainable)
        for t in model.tensors:
            if t.name in first and t.kind not in _WEIGHT_KINDS + ("step",) and t.state is not None:
                decls.setdefault(t.state.span.line, [])
                if t.name not in decls[t.state.span.line]:
                    decls[t.state.span.line].append(t.name)
        groups = [tuple(decls[line]) for line in sorted(decls)]
        if len(groups) == len(raw) and sorted(n for g in groups for n in g) == sorted(trainable):
            return tuple(groups)
    return None


def universal_tensors(src: ExportSource, keys: list[str], verify: bool, stats: IOStats) -> Iterator[tuple[str, Any]]:
    """``iter_rank`` over the universal layout as torch tensors, one at a time."""
    yield from iter_rank(src.path, mesh="universal", rank=0, keys=keys, as_torch=True, verify=verify, stats=stats)


def check_target(out: str | os.PathLike) -> str:
    """``out`` as an absolute path, refused (UCL503) when something is there already."""
    out = os.path.abspath(os.fspath(out))
    if os.path.lexists(out):
        raise StoreError(f"cannot export to {out}: it exists (exports never overwrite; remove it or pick "
                         "another name)", code="UCL503")
    return out


def export_dcp(ckpt: str | os.PathLike, out: str | os.PathLike, *, style: str = "state_dict",
               verify: bool = True) -> IOStats:
    """Write checkpoint ``ckpt`` (ucl, or a DeepSpeed/DCP/... folder read in place) as a PyTorch DCP
    checkpoint ``out`` (see the module doc for the keys), through ``torch.distributed.checkpoint``'s
    ``FileSystemWriter`` in this one process. ``out`` appears atomically; it must not exist."""
    import torch
    import torch.distributed.checkpoint as dcp

    if style not in _STYLES:
        raise StoreError(f"unknown DCP style {style!r}; choose {' or '.join(map(repr, _STYLES))}", code="UCL503")
    t0 = time.perf_counter()
    out = check_target(out)
    src = survey(ckpt)
    model_prefix, optim_prefix = _STYLES[style]
    stats = IOStats()
    wanted = [src.master[n] for n in src.trainable] + [f"param/{n}" for n in src.frozen]
    wanted += [k for n in src.trainable for k in src.moments[n]]
    wanted += [k for n in src.trainable if (k := src.step_key(n)) is not None]
    key_name = {src.master[n]: n for n in src.trainable}
    model_sd: dict[str, Any] = {}
    optim_sd: dict[str, Any] = {}
    for key, tensor in universal_tensors(src, wanted, verify, stats):
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
    tmp = TempDir(out)
    try:
        with warnings.catch_warnings():  # no_dist is what we ask for: torch's "assuming single process" note is noise
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            dcp.save(state_dict, storage_writer=dcp.FileSystemWriter(tmp.path), no_dist=True)
        written = _size(tmp.path)
        publish_dir(tmp.path, out)
    except BaseException:
        tmp.discard()
        raise
    tmp.release()
    stats.bytes_written = written
    stats.datasets_written = len(model_sd) + sum(1 for k in optim_sd if k.startswith("state."))
    stats.seconds = time.perf_counter() - t0
    stats.details.update(format="dcp", style=style, param_groups=src.groups is not None and bool(src.hyperparameters),
                         fp32_master=any(k.startswith("fp32/") for k in src.master.values()))
    return stats


def _nest(prefix: str, flat: dict[str, Any]) -> dict[str, Any]:
    """``{"model": {...}}`` for prefix ``model.``; the flat dict itself for an empty prefix."""
    return {prefix[:-1]: flat} if prefix else dict(flat)


def _size(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(folder) for f in fs)
