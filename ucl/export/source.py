"""What an export writes, sorted from a checkpoint's manifest before any tensor is read
(:func:`survey`: weights, fp32 masters, optimizer state, frozen tensors, tied aliases, param
groups), and the tensors streamed one at a time in the universal layout."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Iterator

from ..errors import ForeignFormatError
from ..layout.mesh import UNIVERSAL
from ..ops.load import iter_rank, tied_aliases
from ..ops.prepare import expected_datasets, model_of, open_checkpoint
from ..ops.stats import IOStats

_WEIGHT_KINDS = ("param", "fp32")  # every other kind but step is optimizer state


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
        raise ForeignFormatError(f"{path}: {missing[0]!r} has optimizer state but no weights (param/ or fp32/)",
                         code="UCL503")
    aliases = tied_aliases(state, model.params)
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


def universal_tensors(src: ExportSource, keys: list[str], verify: bool, stats: IOStats,
                      reuse: bool = False, as_torch: bool = True) -> Iterator[tuple[str, Any]]:
    """``iter_rank`` over the universal layout, one tensor at a time (torch tensors, or storage arrays
    when not ``as_torch``; with ``reuse``, each valid only until the next: see ``iter_rank``)."""
    yield from iter_rank(src.path, mesh="universal", rank=0, keys=keys, as_torch=as_torch, verify=verify,
                         stats=stats, reuse=reuse)


def check_target(out: str | os.PathLike) -> str:
    """``out`` as an absolute path, refused (UCL503) when something is there already."""
    out = os.path.abspath(os.fspath(out))
    if os.path.lexists(out):
        raise ForeignFormatError(f"cannot export to {out}: it exists (exports never overwrite; remove it or pick "
                         "another name)", code="UCL503")
    return out
