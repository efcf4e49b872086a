"""Restoring a module and its optimizer in place: from the snapshot still in host memory (tier 0),
or from a committed checkpoint of any layout (only this rank's hyperslabs are read, straight into
the live tensors where their shapes agree)."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..dtypes import logical_of_torch_dtype, to_torch
from ..errors import StoreError
from ..ops.dist import allgather_json, initialized_dist
from ..ops.load import load_rank
from ..ops.prepare import expected_datasets, open_checkpoint
from ..store.root import CheckpointRoot
from . import rng
from .derive import PARAM, TrainLayout, clean_name, unwrap
from .layouts import Layouts
from .optim import init_state, match_state, restore_hyperparameters
from .snapshot import Snapshots
from .trace import Trace


@dataclass(frozen=True)
class Target:
    """What is restored, on which process of how many; ``group`` is the checkpointer's own."""
    module: Any
    optimizer: Any
    layouts: Layouts
    rank: int
    world: int
    group: Any = None


def from_memory(target: Target, snapshots: Snapshots, root: CheckpointRoot, step: int | None,
                trace: Trace, usable: bool = True) -> tuple[int, Any] | None:
    """Restore tier 0 when it is what ``load`` asks for (``step``, or newer than every committed
    checkpoint: ``persist_every > 1`` keeps unwritten snapshots there) and the module still has its
    layout; on every rank or on none (ranks agree through ``target.group``). None: read from disk."""
    snap = snapshots.borrow()
    try:
        usable = usable and snap is not None and snap.copied.is_set()
        if usable:
            latest = root.latest_step()
            usable = snap.step == step if step is not None else latest is None or snap.step > latest
        layout = target.layouts.current(target.module, target.optimizer) if usable else None
        usable = usable and layout.signature == snap.layout.signature
        if target.world > 1:
            usable = all(allgather_json(bool(usable), group=target.group))
        if not usable:
            return None
        t0 = time.perf_counter()
        import torch
        with torch.no_grad():
            for e, off in zip(layout.entries, snap.offsets):
                e.tensor.copy_(snapshots.view(snap, e, off))
        if target.world > 1 and layout.mesh.is_universal:  # DDP: only process rank 0 holds the snapshot
            _broadcast(target.layouts.current(target.module, target.optimizer, reading=True).entries, target.group)
        if target.optimizer is not None:
            restore_hyperparameters(target.optimizer, snap.state.get("optimizer"))
        rng.restore_own(snap.state["rng"][str(target.rank)])  # each process's snapshot holds its own
        trace.add("restore", t0, time.perf_counter(), step=snap.step, tier=0)
        return snap.step, snap.state.get("extra")
    finally:
        if snap is not None:
            snapshots.drop(snap, "load")


def _broadcast(entries, group) -> None:
    """Every replica's tensors from process rank 0's (DDP, restored from its host snapshot), as
    bytes over the checkpointer's gloo group; CUDA and strided tensors go through a host copy."""
    import torch
    dist = initialized_dist()
    sender = dist.get_rank() == 0
    for e in entries:
        t = e.tensor
        direct = t.device.type == "cpu" and t.is_contiguous()
        if direct:
            buf = t.reshape(-1).view(torch.uint8)
        elif sender:
            buf = t.contiguous().cpu().reshape(-1).view(torch.uint8)
        else:
            buf = torch.empty(t.numel() * t.element_size(), dtype=torch.uint8)
        dist.broadcast(buf, src=0, group=group)
        if not direct and not sender:
            with torch.no_grad():
                t.copy_(buf.view(t.dtype).reshape(t.shape))


def from_checkpoint(target: Target, path: str, read=None, manifest=None) -> tuple[int, Any]:
    """Restore the committed checkpoint at ``path``, written on any layout. A checkpoint of another
    model is refused before anything changes; the optimizer then holds state for exactly the
    parameters the checkpoint has it for. ``read(layout)``, with the checkpoint's ``manifest``: the
    arrays of this rank in ``layout`` from elsewhere than ``path``'s files (``train.recover``)."""
    if manifest is None:
        with open_checkpoint(path) as ck:
            manifest = ck.manifest
    saved = manifest.state or {}
    optimizer = target.optimizer
    layout = target.layouts.current(target.module, optimizer, reading=True)
    _check_model(path, manifest, layout.params if target.layouts.bound is None else
                 target.layouts.model_of(layout).params)
    kept = dict(optimizer.state) if optimizer is not None else {}  # references: put back on refusal
    if optimizer is not None and target.layouts.bound is None:
        params = {clean_name(n): p for n, p in unwrap(target.module).named_parameters()}
        frozen = set(manifest.frozen or ())
        match_state(optimizer, params, {n for n in params if n in (manifest.params or {}) and n not in frozen})
        layout = target.layouts.current(target.module, optimizer, reading=True)
    elif optimizer is not None and not optimizer.state and {k.split("/", 1)[0] for ds in manifest.datasets
                                                           for k in ds} - {"param"}:
        # a manual layout: its spec says which parameters have state; a fresh optimizer gets it all
        init_state(optimizer, [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad])
        layout = target.layouts.current(target.module, optimizer, reading=True)
    try:
        _check_optimizer(path, manifest, saved.get("optimizer"), optimizer, layout)
    except StoreError:
        optimizer.state.clear()  # the state created for it above goes: the optimizer is as it was
        optimizer.state.update(kept)
        raise
    arrays = read(layout) if read is not None else read_layout(target.layouts, path, layout)
    import torch
    with torch.no_grad():
        for e in layout.entries if layout.rank >= 0 or layout.mesh.is_universal else ():
            if e.key not in arrays:
                raise StoreError(f"{path} has no {e.key}: it was saved from a different model or optimizer",
                                 code="UCL434")
            if arrays[e.key] is e.tensor:  # filled in place
                continue
            src = to_torch(arrays[e.key], logical_of_torch_dtype(e.tensor.dtype))
            e.tensor.copy_(src.reshape(e.tensor.shape))
    if optimizer is not None:
        restore_hyperparameters(optimizer, saved.get("optimizer"))
    rng.restore(saved.get("rng"), target.rank, target.world)
    return int(saved.get("step", -1)), saved.get("extra")


def _check_model(path: str, manifest, params) -> None:
    """UCL434 when the checkpoint holds other parameters (names or global shapes) than the job."""
    saved = {n: tuple(s) for n, s in (manifest.params or {}).items()}
    live = {n: tuple(s) for n, s in params.items()}
    if saved != live:
        missing = sorted(set(live) - set(saved))
        extra = sorted(set(saved) - set(live))
        differ = sorted(n for n in set(saved) & set(live) if saved[n] != live[n])
        parts = [f"the job's {_few(missing)} not in it" if missing else "",
                 f"it has {_few(extra)} the job lacks" if extra else "",
                 "other shapes: " + ", ".join(f"{n} {list(saved[n])} saved, {list(live[n])} now" for n in differ[:5])
                 + (f" and {len(differ) - 5} more" if len(differ) > 5 else "") if differ else ""]
        raise StoreError(f"{path} holds another model ({'; '.join(p for p in parts if p)}); nothing was changed",
                         code="UCL434")


def _check_optimizer(path: str, manifest, saved: dict | None, optimizer, layout: TrainLayout) -> None:
    """UCL434 before anything changes when the job's optimizer keeps state the checkpoint lacks
    (saved with SGD, loaded with AdamW), naming both optimizers; a plan would say only which
    dataset the source lacks."""
    live = sorted({e.key.split("/", 1)[0] for e in layout.entries} - {PARAM})
    held = {k.split("/", 1)[0] for ds in manifest.datasets for k in ds} - {PARAM}
    if optimizer is None or set(live) <= held:
        return
    was = (saved or {}).get("type") or ("no optimizer" if not held else "another optimizer")
    now = type(optimizer).__name__
    raise StoreError(f"{path} was saved with {was} (state: {', '.join(sorted(held)) or 'none'}), this job's "
                     f"optimizer is {now} (state: {', '.join(live)}); nothing was changed: load it with "
                     f"the optimizer it was saved with, or load the model alone (a Checkpointer without "
                     f"an optimizer) and start {now} afresh", code="UCL434")


def _few(names: list[str]) -> str:
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def read_layout(layouts: Layouts, path, layout: TrainLayout, source=None, stats=None) -> dict[str, np.ndarray]:
    """This rank's datasets in the current layout, from a checkpoint of any layout (``path``, or an
    open ``CheckpointLike`` read through ``source``: see ``load_rank``)."""
    rank = max(layout.rank, 0)
    model = layouts.model_of(layout)
    want = expected_datasets(model, layout.mesh, rank) if layout.rank >= 0 or layout.mesh.is_universal else {}
    into = {e.key: e.tensor for e in layout.entries
            if e.key in want and tuple(e.tensor.shape) == tuple(want[e.key][0])}
    return load_rank(path, mesh=layout.mesh, rank=rank, model=model, out=into, source=source, stats=stats)


def reads(layout: TrainLayout) -> int | None:
    """The rank of the layout this process restores (a DDP replica: rank 0 of the universal layout),
    or None when it restores nothing."""
    return max(layout.rank, 0) if layout.rank >= 0 or layout.mesh.is_universal else None
