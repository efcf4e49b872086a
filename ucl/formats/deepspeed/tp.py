"""Tensor-parallel DeepSpeed checkpoints (``mp_rank_TT`` files, no pipeline): the files, the ZeRO
state and the extents, shared by AutoTP (placed by DeepSpeed's ``affine_map``, here) and
Megatron-DeepSpeed style checkpoints (placed by the pattern table, ``mds.py``)."""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from typing import Any, Callable

from ...errors import ForeignFormatError
from ...store.extents import Extent
from ..base import Description
from ..torchzip.read import TensorRef, TorchFile
from ..torchzip.plain import plain
from .common import (ALIGN, as_dict, as_list, as_tensor, BULKY, DsFolder, extent, NAME, optimizer_dict,
                     optimizer_state, OPTIM, state_line, step_extents, weight_dtype, zero12_group)


@dataclass(frozen=True)
class Placement:
    """Where a parameter's tp shards lie: its global (unpadded) shape, the spec layout that says
    it, and the dim split over tp (None for a replica, or a split of a factor or parts)."""
    full: tuple[int, ...]
    layout: str
    split_dim: int | None


# (name, tp-local shape on every tp rank, is a buffer) -> its placement
Placer = Callable[[str, list[tuple], bool], Placement]


@dataclass(frozen=True)
class TpReader:
    """What differs between the flavours of tensor-parallel checkpoint: the name in messages and
    the spec's first line, where each shard lies, what the state adds, and a user's rules."""
    flavor: str
    spec_name: str
    place: Placer
    extra: Callable[[dict[str, Placement]], tuple[str, dict]]  # placements -> (state key, its value)
    user: tuple[str, dict] | None = None  # (spec text declaring the parameters' rules, its dims)


@dataclass(frozen=True)
class TpRun:
    """The files of a tensor-parallel checkpoint, read and checked: per tp rank ``t`` its model
    states and, per dp rank ``d``, its optimizer file."""
    at: DsFolder
    tp: int
    states_names: list[str]
    states: list[TorchFile]
    modules: list[dict]  # each tp rank's module (its shards)
    optim: dict[tuple[int, int], str]  # (d, t) -> file name
    optims: list[list[TorchFile]]  # [t][d]
    osd: list[list[dict]]
    stage: int
    groups: list[list[str]]  # trainable names per param group, in flattening order
    local: list[dict[str, tuple]]  # per tp rank, the tp-local shapes


def describe_autotp(f: DsFolder) -> Description:
    """An AutoTP checkpoint (``"tensor_parallel": {"autotp_size": tp}``, ZeRO-0/1/2, no pipeline).
    Where each shard lies in the full tensor is DeepSpeed's own
    ``universal_checkpoint_info['affine_map']`` (saved in every model states file since AutoTP's
    universal-checkpoint support): ucl reads one even contiguous split of one dim (column/row/vocab
    parallel) or a replica; anything else (sub-params such as a fused [gate; up], uneven shards) is
    refused."""
    uci, tp = f.ms["universal_checkpoint_info"], f.mp
    if uci.get("parameter_with_sub_params"):
        raise ForeignFormatError(f"{f.folder}: AutoTP split some parameters into sub-params "
                     f"({list(uci['parameter_with_sub_params'])[:4]}); ucl does not read that layout yet")
    amap = as_dict(uci["affine_map"].get("params"), "universal_checkpoint_info affine_map params")

    def place(n: str, shards: list[tuple], is_buffer: bool) -> Placement:
        hits = [v for k, v in amap.items() if re.fullmatch(str(k), n)]
        if not hits and is_buffer and len(set(shards)) == 1:
            return Placement(shards[0], "replicate", None)  # AutoTP does not split buffers
        if len(hits) != 1:
            raise ForeignFormatError(f"{n}: {len(hits)} entries of DeepSpeed's affine_map match it; ucl needs exactly one to "
                         "know where each tp rank's shard lies")
        dim, full = _affine_split(n, as_dict(hits[0], f"affine_map of {n}"), shards, tp)
        return Placement(full, "replicate" if dim is None else f"split {dim} over tp", dim)

    def extra(placements: dict[str, Placement]) -> tuple[str, dict]:
        return "autotp", {"tp": tp, "split_dims": {n: p.split_dim for n, p in placements.items()},
                          **plain({k: v for k, v in uci.items() if k != "affine_map"})}

    return describe_tp(f, TpReader("AutoTP", "deepspeed-autotp", place, extra))


def describe_tp(f: DsFolder, how: TpReader) -> Description:
    """``mp_rank_TT_model_states.pt`` per tp rank (``module``: that rank's shards; ``param_shapes``:
    the tp-local shapes), ``[bf16_]zero_pp_rank_D_mp_rank_TT_optim_states.pt`` per (dp, tp) rank:
    each tp rank's groups are flat buffers of its local shards as without TP; ``how.place`` says where
    each shard lies. Mesh ``tp, dp`` (sizes from ``mp_world_size`` and ``dp_world_size``); rank
    ``t * dp + d`` reads ``mp_rank_TT`` and ``zero_pp_rank_D_mp_rank_TT``. ``how.user``: its rules
    stand for the generated ones, the state lines are generated and appended."""
    run = _read_tp(f, how)
    placements, frozen = _placements(run, how)
    weights = weight_dtype(run.modules[0], run.local[0])
    kinds = (["fp32"] if weights != "float32" else []) + ["exp_avg", "exp_avg_sq"]
    spec = _spec(run, how, placements, weights, kinds)
    extents = _extents(run, placements, kinds)
    files = tuple(f.rel(run.optim[(d, t)]) for t in range(run.tp) for d in range(f.dp))
    read = f.latest + tuple(f.rel(n) for n in run.states_names) + files
    params = {n: p.full for n, p in placements.items()}
    return Description("deepspeed", spec, f"{how.spec_name}-zero{run.stage}", dict(how.user[1]) if how.user else {},
                       (("tp", run.tp), ("dp", f.dp)), params, frozen, extents, files, _state(run, how, placements),
                       read)


def _read_tp(f: DsFolder, how: TpReader) -> TpRun:
    tp, dp, folder = f.mp, f.dp, f.folder
    pdims = f.ms.get("checkpoint_parallel_dimensions") or {}
    if pdims.get("pp_degree", 1) != 1 or pdims.get("tp_degree", tp) != tp:
        raise ForeignFormatError(f"{folder}: mp_world_size={tp} with checkpoint_parallel_dimensions {pdims!r}; ucl reads "
                                 f"{how.flavor} checkpoints without a pipeline (tp_degree == mp_world_size, pp_degree == 1)")
    states_names = [f"mp_rank_{t:02d}_model_states.pt" for t in range(tp)]
    for n in states_names:
        if n not in f.names:
            raise ForeignFormatError(f"{folder} lacks {n} (mp_world_size={tp}); a {how.flavor} checkpoint has one per tp rank")
    states = [f.open(n) for n in states_names]
    mss = [as_dict(st.obj, n) for st, n in zip(states, states_names)]
    for t, m in enumerate(mss):
        if m.get("mp_world_size") != tp or m.get("dp_world_size") != dp:
            raise ForeignFormatError(f"{states_names[t]}: mp_world_size {m.get('mp_world_size')!r}, dp_world_size "
                         f"{m.get('dp_world_size')!r}; mp_rank_00 says {tp} and {dp}")
    optim = {(int(m.group(2)), int(m.group(3))): n for n in f.names if (m := OPTIM.match(n))}
    if set(optim) != {(d, t) for d in range(dp) for t in range(tp)}:
        raise ForeignFormatError(f"{folder} should hold optimizer files for dp ranks 0..{dp - 1} x tp ranks 0..{tp - 1}, found "
                     f"(dp, tp) {sorted(optim)}")
    optims = [[f.open(optim[(d, t)]) for d in range(dp)] for t in range(tp)]
    osd = [[optimizer_dict(o, o.path) for o in row] for row in optims]
    stage = int(osd[0][0].get("zero_stage", 0))
    if stage == 0 and "single_partition_of_fp32_groups" in osd[0][0]:
        stage = 1
    if stage not in (1, 2) or any("single_partition_of_fp32_groups" not in o for row in osd for o in row):
        raise ForeignFormatError(f"{folder}: ucl reads {how.flavor} checkpoints with ZeRO-1/2 flat optimizer state only "
                     f"(zero_stage {stage})")
    groups = [list(g) for g in as_list(mss[0].get("param_shapes"), "param_shapes")]
    local: list[dict[str, tuple]] = []
    for t, m in enumerate(mss):
        gs = [list(g) for g in as_list(m.get("param_shapes"), f"{states_names[t]}: param_shapes")]
        if gs != groups:
            raise ForeignFormatError(f"{states_names[t]}: its param groups differ from mp_rank_00's")
        local.append({n: tuple(int(x) for x in sh) for g in m["param_shapes"] for n, sh in g.items()})
    return TpRun(f, tp, states_names, states, [m.get("module") or {} for m in mss], optim, optims, osd, stage,
                 groups, local)


def _placements(run: TpRun, how: TpReader) -> tuple[dict[str, Placement], tuple[str, ...]]:
    """(each parameter's and buffer's placement, the frozen parameters and buffers)."""
    first, local, modules = run.at.ms, run.local, run.modules
    shared = {str(k): str(v) for k, v in (first.get("shared_params") or {}).items()}
    buffers = [str(b) for b in first.get("buffer_names") or []]
    frozen_names = [n for n, t in modules[0].items()
                    if n not in local[0] and n not in shared and n not in buffers and isinstance(t, TensorRef)]
    for n in list(local[0]) + frozen_names + buffers:
        if not NAME.match(n):
            raise ForeignFormatError(f"parameter name {n!r} cannot be written in a spec")
    placements: dict[str, Placement] = {}
    for n in list(local[0]) + frozen_names + buffers:
        shards = [tuple(as_tensor(mod.get(n), f"{run.states_names[t]}: {n}").shape) for t, mod in enumerate(modules)]
        if n in local[0] and any(local[t][n] != shards[t] for t in range(run.tp)):
            raise ForeignFormatError(f"{n}: param_shapes and the module disagree on its tp-local shape")
        placements[n] = how.place(n, shards, n in buffers)
    return placements, tuple(frozen_names + buffers)


def _spec(run: TpRun, how: TpReader, placements: dict[str, Placement], weights: str, kinds: list[str]) -> str:
    spec = [f"# generated by ucl from the DeepSpeed {how.flavor} ZeRO-{run.stage} checkpoint "
            f"{os.path.basename(run.at.path)}", "mesh tp, dp"] if how.user is None else \
        [how.user[0].rstrip("\n"), f"# ZeRO-{run.stage} state generated by ucl"]
    by_dtype: dict[str, list[str]] = {}
    for n in placements:
        by_dtype.setdefault(as_tensor(run.modules[0].get(n), n).dtype, []).append(n)
    for dtype, names_d in by_dtype.items():
        spec.append(f"state param : dtype {dtype}" if dtype == weights
                    else state_line(["param"], names_d, f"dtype {dtype}"))
    for g, names_g in enumerate(run.groups):
        spec.append(state_line(kinds, names_g, f"flat over dp pad to multiple_of({ALIGN} * dp)"))
    spec.append("state step : scalar")
    if how.user is None:  # else the user's rules say it
        for n, p in placements.items():
            spec.append(f"{n} [{', '.join(str(x) for x in p.full)}] : {p.layout}")
    return "\n".join(spec) + "\n"


def _extents(run: TpRun, placements: dict[str, Placement], kinds: list[str]) -> tuple[dict[str, Extent], ...]:
    """Rank ``t * dp + d``: tp rank t's flat groups as dp rank d holds them, and its shards."""
    f, dp = run.at, run.at.dp
    extents: list[dict[str, Extent]] = [{} for _ in range(run.tp * dp)]
    for t in range(run.tp):
        mine = extents[t * dp:(t + 1) * dp]
        names_t = [run.optim[(d, t)] for d in range(dp)]
        for g, names_g in enumerate(run.groups):
            zero12_group(g, names_g, run.local[t], dp, run.optims[t], run.osd[t], kinds, mine,
                         os.path.dirname(f.rel("x")))
            step_extents(f, g, names_g, run.optims[t], run.osd[t], names_t, mine)
        for n in placements:
            ref = as_tensor(run.modules[t].get(n), n)
            for d in range(dp):
                mine[d][f"param/{n}"] = extent(run.states[t], ref, f.rel(run.states_names[t]), n, tuple(ref.shape))
    return tuple(extents)


def _state(run: TpRun, how: TpReader, placements: dict[str, Placement]) -> dict:
    key, info = how.extra(placements)
    groups = as_dict(run.osd[0][0].get("base_optimizer_state"), "base optimizer state").get("param_groups", [])
    return {"format": "deepspeed", "deepspeed": plain({k: v for k, v in run.at.ms.items() if k not in BULKY},
                                                      values=run.states[0]),
            "optimizer": optimizer_state(run.stage, groups, run.groups, run.osd[0][0].get("loss_scaler")),
            key: info}


def _affine_split(name: str, entry: dict, shards: list[tuple], tp: int) -> tuple[int | None, tuple]:
    """(the dim AutoTP split evenly over tp, or None for a replica; the full shape) from DeepSpeed's
    affine_map entry: per rank one piece, its shard whole, at ``t * shard[dim]`` along ``dim``."""
    full = tuple(int(x) for x in as_list(entry.get("logical_shape"), f"logical_shape of {name}"))
    ranks = as_dict(entry.get("ranks"), f"affine_map ranks of {name}")
    diff = [i for i, (a, b) in enumerate(zip(full, shards[0])) if a != b]
    if len(full) != len(shards[0]) or len(diff) > 1 or any(s != shards[0] for s in shards):
        raise ForeignFormatError(f"{name}: tp shards {shards} of the full {list(full)} are not one even split of one dim")
    dim = diff[0] if diff else None
    if dim is not None and full[dim] != tp * shards[0][dim]:
        raise ForeignFormatError(f"{name}: dim {dim} is {full[dim]} in full and {shards[0][dim]} per tp rank; ucl reads even "
                     f"splits over tp={tp} only")
    strides = [math.prod(full[i + 1:]) for i in range(len(full))]
    local_strides = [math.prod(shards[0][i + 1:]) for i in range(len(full))]
    for t in range(tp):
        r = as_dict(ranks.get(t), f"affine_map of {name}, rank {t}")
        pieces = as_list(r.get("pieces"), f"affine_map pieces of {name}, rank {t}")
        start = 0 if dim is None else t * shards[0][dim] * strides[dim]
        ok = len(pieces) == 1 and isinstance(pieces[0], dict) and \
            tuple(r.get("shard_shape") or ()) == shards[t] and tuple(pieces[0].get("shape") or ()) == shards[t]
        if ok:
            src, dst = pieces[0].get("source"), pieces[0].get("dest")
            ok = _affine(src) == (start, strides) and _affine(dst) == (0, local_strides)
        if not ok:
            raise ForeignFormatError(f"{name}: DeepSpeed's affine_map places tp rank {t}'s shard in a way ucl does not read "
                         f"(one contiguous piece at {start} of the full tensor expected): {plain(r)}")
    return dim, full


def _affine(x: Any) -> tuple | None:
    try:
        return int(x[0]), [int(v) for v in x[1]]
    except (TypeError, ValueError, IndexError, KeyError):
        return None
