"""Exports: a ucl checkpoint (or a foreign folder read in place) written in another framework's own
resumable format, from the universal layout (every tensor whole under its global name).

    export_dcp("ckpt/step_100", "dcp/step_100")                       # torch.distributed.checkpoint
    export_deepspeed_universal("ds_run/", "ds_universal/")            # DeepSpeed load_universal
    export_hf("ckpt/step_100", "hf/step_100", dtype="bfloat16")       # save_pretrained folders

Each entry point opens the checkpoint, sorts its tensors into what exports write (:func:`survey`,
from the manifest alone), and feeds them one at a time, each in pieces under the ``max_memory`` cap
(``ucl.ops.pieces``), to the format's writer (``ucl.formats.{hf,dcp,deepspeed}.write``), which writes into a hidden temp folder beside
``out`` and renames it at the end, so ``out`` appears whole or not at all; an existing ``out`` is
refused (UCL503). See docs/interop.md.
"""
from __future__ import annotations

import os
import time
from typing import Any

from ..errors import ForeignFormatError
from ..formats.base import ExportSource, Pieces, UserSpec, Written, check_target
from ..formats.dcp.write import check_style, write_dcp
from ..formats.deepspeed.write import write_deepspeed_universal
from ..formats.hf.write import export_dtype, parse_shard_size, plan_hf, write_hf
from ..layout.mesh import UNIVERSAL
from ..memory import MemoryCap, memory_cap
from .load import tied_aliases
from .pieces import UniversalReader, universal_pieces
from .prepare import expected_datasets, model_of, open_checkpoint, resolve_root
from .stats import IOStats

_WEIGHT_KINDS = ("param", "fp32")  # every other kind but step is optimizer state


def export_hf(ckpt: str | os.PathLike, out: str | os.PathLike, *, dtype: Any = None,
              max_shard_size: int | str = "5GB", config: Any = None, verify: bool = True,
              durable: bool = True, user: UserSpec | None = None,
              max_memory: int | str | MemoryCap | None = None) -> IOStats:
    """Write checkpoint ``ckpt`` (ucl, or a Hugging Face/DeepSpeed/... folder read in place) as a
    Hugging Face ``save_pretrained`` folder ``out`` (see ``ucl.formats.hf.write``). ``out`` appears
    atomically and must not exist. ``max_memory``: the host memory the export may add (bytes,
    ``"2GB"``, a :class:`~ucl.memory.MemoryCap`; default 2 GB; docs/memory.md). Returns the
    statistics; ``details`` names the files and what was left out."""
    t0 = time.perf_counter()
    cap = memory_cap(max_memory)
    target = export_dtype(dtype)
    limit = parse_shard_size(max_shard_size)
    out = check_target(out)
    src = survey(ckpt, user)
    plan = plan_hf(src, dtype=target, max_shard_size=limit, config=config)
    stats = IOStats()
    written = write_hf(plan, out, universal_pieces(src.path, list(plan.keys), cap, verify=verify, stats=stats,
                                                   user=src.user), durable=durable, whole_bytes=cap.total // 2)
    return _done(stats, written, t0)


def export_dcp(ckpt: str | os.PathLike, out: str | os.PathLike, *, style: str = "state_dict",
               verify: bool = True, user: UserSpec | None = None,
               max_memory: int | str | MemoryCap | None = None) -> IOStats:
    """Write checkpoint ``ckpt`` (ucl, or a DeepSpeed/DCP/... folder read in place) as a PyTorch DCP
    checkpoint ``out`` (see ``ucl.formats.dcp.write`` for the keys), through
    ``torch.distributed.checkpoint``'s ``FileSystemWriter`` in this one process; tensors larger
    than a piece of ``max_memory`` (as for :func:`export_hf`) are saved as several chunks. ``out``
    appears atomically; it must not exist."""
    t0 = time.perf_counter()
    cap = memory_cap(max_memory)
    check_style(style)
    out = check_target(out)
    src = survey(ckpt, user)
    stats = IOStats()
    keys = src.training_keys()
    with UniversalReader(src.path, cap, verify=verify, user=src.user) as reader:
        ties = reader.aliases(keys)
        made: dict[str, Pieces] = {}

        def pieces(key: str) -> Pieces:
            if key not in made:
                made[key] = reader.pieces(key, ties.get(key, key))
            return made[key]
        # chunks of an eighth: the piece read, the chunk handed to DCP and torch.save's copy of it
        # (three buffers) stay under half the cap, the rest is the interpreter's slack
        written = write_dcp(src, out, keys, pieces, style=style, piece_bytes=cap.split(2).piece_bytes())
        stats.bytes_read, stats.bytes_needed = reader.bytes_read, reader.bytes_needed
    return _done(stats, written, t0)


def export_deepspeed_universal(ckpt: str | os.PathLike, out: str | os.PathLike, *, tag: str | None = None,
                               verify: bool = True, durable: bool = True, user: UserSpec | None = None,
                               max_memory: int | str | MemoryCap | None = None) -> IOStats:
    """Write checkpoint ``ckpt`` (ucl, or a DeepSpeed/DCP/... folder read in place) as a DeepSpeed
    universal checkpoint folder ``out`` (see ``ucl.formats.deepspeed.write``), ``tag`` defaulting to
    ``global_step<global_steps>``. Resume with ``engine.load_checkpoint(out)`` and
    ``"checkpoint": {"load_universal": true}``. ``max_memory``: as for :func:`export_hf`. ``out``
    appears atomically; it must not exist."""
    t0 = time.perf_counter()
    cap = memory_cap(max_memory)
    out = check_target(out)
    src = survey(ckpt, user)
    stats = IOStats()
    tensors = universal_pieces(src.path, src.training_keys(), cap, verify=verify, stats=stats, user=src.user)
    written = write_deepspeed_universal(src, out, tensors, tag=tag, durable=durable, kept_bytes=cap.total // 2)
    return _done(stats, written, t0)


def _done(stats: IOStats, written: Written, t0: float) -> IOStats:
    stats.bytes_written = written.bytes
    stats.datasets_written = written.tensors
    stats.seconds = time.perf_counter() - t0
    stats.details.update(written.details)
    return stats


def survey(path: str | os.PathLike, user: UserSpec | None = None) -> ExportSource:
    """The tensors of ``path`` (a ucl checkpoint or a foreign folder read in place) sorted into what
    exports write: weights, fp32 masters, optimizer state, frozen tensors, tied aliases, groups.
    A checkpoint root is resolved to its latest step here, once: ``ExportSource.path`` is that step.
    ``user``: the placements a foreign folder's files do not record (``ops.convert.user_spec``)."""
    path = resolve_root(path)
    with open_checkpoint(path, user=user) as ckpt:
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
        raise ForeignFormatError(f"{path}: {missing[0]!r} has optimizer state but no weights (param/ or fp32/)",
                         code="UCL503")
    aliases = tied_aliases(state, model.params)
    optim = state.get("optimizer") if isinstance(state.get("optimizer"), dict) else {}
    raw = [g for g in (optim.get("param_groups") or []) if isinstance(g, dict)]
    hyper = tuple({k: v for k, v in g.items() if k not in ("params", "names")} for g in raw)
    return ExportSource(os.fspath(path), datasets, trainable, frozen, master,
                        {n: moments[n] for n in trainable}, aliases, hyper,
                        _groups(model, state, raw, trainable), state, user)


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
