"""DeepSpeed PipelineModule checkpoints (``layer_NN-model_states.pt`` files): ZeRO-0/1, tp=1.
``mp_rank_SS_model_states.pt`` per stage (its parameters per group, named ``<layer>.<name>`` or
``tied_modules.<key>.<name>``), ``layer_LL-model_states.pt`` per layer (the layer's own state
dict: the weights), and per (dp rank, stage) ``zero_pp_rank_R_mp_rank_SS_optim_states.pt``. Mesh
``pp, dp``; each parameter ``on pp =`` the stages that train it (a tied module: all of its stages,
each with its own optimizer state); each stage's groups are flat buffers as without a pipeline."""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

from ...errors import ForeignFormatError
from ...store.extents import Extent
from ..base import Description
from ..torchzip.read import TorchFile
from ..torchzip.plain import plain
from .common import (ALIGN, as_dict, as_list, as_tensor, BULKY, check_world, DsFolder, extent, optimizer_dict, optimizer_state,
                     state_line, step_extents, zero12_group)


_LAYER = re.compile(r"^layer_(\d+)-model_states\.pt$")


@dataclass(frozen=True)
class PipelineRun:
    """The files of a pipeline checkpoint, read and checked."""
    at: DsFolder
    first: dict  # mp_rank_00's model states
    dp: int
    pp: int
    stages: list[TorchFile]  # mp_rank_SS_model_states.pt per stage
    layers: dict[int, TorchFile]  # layer_LL-model_states.pt per layer
    optim_names: list[list[str]]  # [stage][dp rank]
    optims: list[list[TorchFile]]
    osd: list[list[dict]]
    groups_by_stage: list[list[list[str]]]  # each stage's param groups, in flattening order
    shapes: dict[str, tuple[int, ...]]


@dataclass(frozen=True)
class PipelineNames:
    """Every tensor's name, the layer file and local name that hold it, and the stages that train it."""
    order: list[str]  # the trained parameters, in a global flattening order
    frozen: list[str]  # what the layer files hold beyond them (frozen parameters, then buffers)
    where: dict[str, tuple[int, str]]  # name -> (layer, its name in the layer file)
    placed: dict[str, list[int]]  # name -> the stages that hold it
    dtype: str  # the training dtype

    @property
    def all(self) -> list[str]:
        return self.order + self.frozen


def describe_pipeline(f: DsFolder) -> Description:
    run = _read(f)
    names = _names(run)
    params = {n: tuple(_tensor(run, names, n).shape) for n in names.all}
    kinds = (["fp32"] if names.dtype != "float32" else []) + ["exp_avg", "exp_avg_sq"]
    read = tuple(f.rel(f"mp_rank_{s:02d}_model_states.pt") for s in range(run.pp)) + \
        tuple(f.rel(n) for n in f.names if _LAYER.match(n)) + tuple(f.rel(n) for row in run.optim_names for n in row)
    files = tuple(f.rel(run.optim_names[s][r]) for s in range(run.pp) for r in range(run.dp))
    return Description("deepspeed", _spec(run, names, params, kinds), "deepspeed-pipeline", {},
                       (("pp", run.pp), ("dp", run.dp)), params, tuple(names.frozen), _extents(run, names, kinds),
                       files, _state(run, names, params), read)


def _read(f: DsFolder) -> PipelineRun:
    first = as_dict(f.open("mp_rank_00_model_states.pt").obj, "mp_rank_00_model_states.pt")
    dp, mp = first.get("dp_world_size"), first.get("mp_world_size", 1)
    pp = (first.get("checkpoint_parallel_dimensions") or {}).get("pp_degree", mp)
    if not all(isinstance(x, int) and x >= 1 for x in (dp, mp, pp)) or mp != pp:
        raise ForeignFormatError(f"{f.folder}: a pipeline checkpoint with dp={dp!r}, mp_world_size={mp!r}, pp_degree={pp!r}; ucl "
                     "reads pipeline checkpoints without tensor parallelism (mp_world_size == pp_degree)")
    check_world(f.folder, f.names, dp, pp, optimizer=True)
    stages = [f.open(f"mp_rank_{s:02d}_model_states.pt") for s in range(pp)]
    layers = {int(m.group(1)): f.open(n) for n in f.names if (m := _LAYER.match(n))}
    optim_names = [[f"zero_pp_rank_{r}_mp_rank_{s:02d}_optim_states.pt" for r in range(dp)] for s in range(pp)]
    for row in optim_names:
        for n in row:
            if n not in f.names:
                raise ForeignFormatError(f"{f.folder} lacks {n} (dp={dp}, pp={pp}); a pipeline checkpoint needs one optimizer file "
                             "per dp rank and stage")
    optims = [[f.open(n) for n in row] for row in optim_names]
    osd = [[optimizer_dict(o, o.path) for o in row] for row in optims]
    if any(int(o.get("zero_stage", 0)) not in (0, 1) or "single_partition_of_fp32_groups" not in o for row in osd for o in row):
        raise ForeignFormatError(f"{f.folder}: ucl reads pipeline checkpoints with ZeRO stage 0/1 flat optimizer state only")
    groups_by_stage = [[list(g) for g in as_list(as_dict(st.obj, st.path).get("param_shapes"), "param_shapes")]
                       for st in stages]
    shapes = {n: tuple(int(x) for x in sh) for st in stages for g in st.obj["param_shapes"] for n, sh in g.items()}
    return PipelineRun(f, first, dp, pp, stages, layers, optim_names, optims, osd, groups_by_stage, shapes)


def _names(run: PipelineRun) -> PipelineNames:
    folder = run.at.folder
    order: list[str] = []
    for groups in run.groups_by_stage:
        for g in groups:
            order += [n for n in g if n not in order]
    placed = {n: [s for s, gs in enumerate(run.groups_by_stage) if any(n in g for g in gs)] for n in order}
    where = _where(run, order)
    numbered = {int(n.split(".", 1)[0]) for n in order if n.split(".", 1)[0].isdigit()}
    buffers = list(dict.fromkeys(str(b) for st in run.stages for b in (st.obj.get("buffer_names") or [])))
    frozen: list[str] = []
    for i in sorted(run.layers):  # what the layer files hold beyond the trained parameters
        prefix = f"{i}." if i in numbered else next(
            (n[:-len(loc)] for n, (j, loc) in where.items() if j == i), None)
        if prefix is None:
            raise ForeignFormatError(f"{folder}: layer_{i:02d} holds no parameter any stage trains; ucl cannot place it")
        for local, t in as_dict(run.layers[i].obj, run.layers[i].path).items():
            name = prefix + local
            if name not in where:
                where[name] = (i, local)
                frozen.append(name) if name not in buffers else None
                owner = next(n for n, (j, _) in where.items() if j == i and n in placed)
                placed[name] = placed[owner]
    frozen += [b for b in buffers if b in where]
    weights = {where[n][0] for n in order}
    dtypes = {as_tensor(run.layers[where[n][0]].obj.get(where[n][1]), n).dtype for n in order}
    if len(dtypes) != 1 or not weights:
        raise ForeignFormatError(f"{folder}: the pipeline's parameters have several dtypes {sorted(dtypes)}")
    return PipelineNames(order, frozen, where, placed, dtypes.pop())


def _where(run: PipelineRun, order: list[str]) -> dict[str, tuple[int, str]]:
    """Each trained weight's bytes: numbered layers in layer_NN, tied modules in the one layer file
    holding them."""
    numbered = {int(n.split(".", 1)[0]) for n in order if n.split(".", 1)[0].isdigit()}
    tied_files = [i for i in sorted(run.layers) if i not in numbered]
    where: dict[str, tuple[int, str]] = {}
    for n in order:
        head, _, rest = n.partition(".")
        if head.isdigit():
            where[n] = (int(head), rest)
        elif head == "tied_modules":
            key, _, local = rest.partition(".")
            hits = [i for i in tied_files if local in as_dict(run.layers[i].obj, run.layers[i].path)]
            if len(hits) != 1:
                raise ForeignFormatError(f"{run.at.folder}: cannot tell which layer file holds the tied parameter {n!r} "
                                         f"(candidates: {[f'layer_{i:02d}' for i in hits]})")
            where[n] = (hits[0], local)
        else:
            raise ForeignFormatError(f"{run.at.folder}: pipeline parameter {n!r} is neither '<layer>.<name>' nor "
                                     "'tied_modules.<key>.<name>'")
    return where


def _tensor(run: PipelineRun, names: PipelineNames, n: str):
    i, local = names.where[n]
    return as_tensor(run.layers[i].obj.get(local), n)


def _group_members(run: PipelineRun, names: PipelineNames, g: int) -> list[str]:
    """The parameters of param group ``g`` on any stage, in the global order."""
    return [n for n in names.order if any(g < len(gs) and n in gs[g] for gs in run.groups_by_stage)]


def _spec(run: PipelineRun, names: PipelineNames, params: dict, kinds: list[str]) -> str:
    spec = [f"# generated by ucl from the DeepSpeed pipeline checkpoint {os.path.basename(run.at.path)}", "mesh pp, dp",
            f"state param : dtype {names.dtype}"]
    for n in names.frozen:
        t = _tensor(run, names, n)
        if t.dtype != names.dtype:
            spec.append(state_line(["param"], [n], f"dtype {t.dtype}"))
    for g in range(max(len(g) for g in run.groups_by_stage)):
        spec.append(state_line(kinds, _group_members(run, names, g), f"flat over dp pad to multiple_of({ALIGN} * dp)"))
    spec.append("state step : scalar")
    for n in names.all:
        # first/last rather than 0/pp-1: the spec then also describes a layout with fewer stages
        stages_n = ", ".join("first" if s == 0 else "last" if s == run.pp - 1 else str(s) for s in names.placed[n])
        spec.append(f"{n} [{', '.join(str(x) for x in params[n])}] : on pp = {stages_n}")
    return "\n".join(spec) + "\n"


def _extents(run: PipelineRun, names: PipelineNames, kinds: list[str]) -> tuple[dict[str, Extent], ...]:
    f, dp = run.at, run.dp
    extents: list[dict[str, Extent]] = [{} for _ in range(run.pp * dp)]
    for s in range(run.pp):
        mine = extents[s * dp:(s + 1) * dp]
        for g, names_g in enumerate(run.groups_by_stage[s]):
            if [n for n in names.order if n in names_g] != names_g:
                raise ForeignFormatError(f"{f.folder}: stage {s} flattens group {g} in an order no global parameter order gives")
            zero12_group(g, names_g, run.shapes, dp, run.optims[s], run.osd[s], kinds, mine, os.path.dirname(f.rel("x")))
            step_extents(f, g, names_g, run.optims[s], run.osd[s], run.optim_names[s], mine)
        for n in names.all:
            if s in names.placed[n]:
                i, _ = names.where[n]
                t = _tensor(run, names, n)
                for r in range(dp):
                    mine[r][f"param/{n}"] = extent(run.layers[i], t, f.rel(f"layer_{i:02d}-model_states.pt"), n,
                                                   tuple(t.shape))
    return tuple(extents)


def _state(run: PipelineRun, names: PipelineNames, params: dict) -> dict:
    groups = as_dict(run.osd[0][0].get("base_optimizer_state"), "base optimizer state").get("param_groups", [])
    return {"format": "deepspeed", "deepspeed": plain({k: v for k, v in run.first.items() if k not in BULKY}),
            "optimizer": optimizer_state(1, groups, [_group_members(run, names, i) for i in range(len(groups))],
                                         run.osd[0][0].get("loss_scaler")),
            "pipeline": {"layer_files": {n: f"layer_{names.where[n][0]:02d}" for n in params}}}
