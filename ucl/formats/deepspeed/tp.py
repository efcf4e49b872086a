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
from ..torchzip.read import TensorRef, plain, read_torch_file
from .common import (ALIGN, as_dict, as_list, as_tensor, BULKY, extent, group_state, NAME, OPTIM,
                     state_line, weight_dtype, zero12_group)


@dataclass(frozen=True)
class Placement:
    """Where a parameter's tp shards lie: its global (unpadded) shape, the spec layout that says
    it, and the dim split over tp (None for a replica, or a split of a factor or parts)."""
    full: tuple[int, ...]
    layout: str
    split_dim: int | None


# (name, tp-local shape on every tp rank, is a buffer) -> its placement
Placer = Callable[[str, list[tuple], bool], Placement]


def describe_autotp(path: str, folder: str, names: list[str], rel, first: dict, dp: int, tp: int) -> Description:
    """An AutoTP checkpoint (``"tensor_parallel": {"autotp_size": tp}``, ZeRO-0/1/2, no pipeline).
    Where each shard lies in the full tensor is DeepSpeed's own
    ``universal_checkpoint_info['affine_map']`` (saved in every model states file since AutoTP's
    universal-checkpoint support): ucl reads one even contiguous split of one dim (column/row/vocab
    parallel) or a replica; anything else (sub-params such as a fused [gate; up], uneven shards) is
    refused."""
    uci = first["universal_checkpoint_info"]
    if uci.get("parameter_with_sub_params"):
        raise ForeignFormatError(f"{folder}: AutoTP split some parameters into sub-params "
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
                          **{k: plain(v) for k, v in uci.items() if k != "affine_map"}}

    return describe_tp(path, folder, names, rel, first, dp, tp, place, "AutoTP", "deepspeed-autotp", extra)


def describe_tp(path: str, folder: str, names: list[str], rel, first: dict, dp: int, tp: int, place: Placer,
                flavor: str, spec_name: str, extra: Callable[[dict], tuple[str, dict]],
                user: tuple[str, dict] | None = None) -> Description:
    """``mp_rank_TT_model_states.pt`` per tp rank (``module``: that rank's shards; ``param_shapes``:
    the tp-local shapes), ``[bf16_]zero_pp_rank_D_mp_rank_TT_optim_states.pt`` per (dp, tp) rank:
    each tp rank's groups are flat buffers of its local shards as without TP; ``place`` says where
    each shard lies. Mesh ``tp, dp`` (sizes from ``mp_world_size`` and ``dp_world_size``); rank
    ``t * dp + d`` reads ``mp_rank_TT`` and ``zero_pp_rank_D_mp_rank_TT``. ``user``: (spec text
    declaring ``mesh tp, dp`` and the parameters' rules, its dims): its rules stand for the
    generated ones, the state lines are generated and appended."""
    pdims = first.get("checkpoint_parallel_dimensions") or {}
    if pdims.get("pp_degree", 1) != 1 or pdims.get("tp_degree", tp) != tp:
        raise ForeignFormatError(f"{folder}: mp_world_size={tp} with checkpoint_parallel_dimensions {pdims!r}; ucl reads {flavor} "
                     "checkpoints without a pipeline (tp_degree == mp_world_size, pp_degree == 1)")
    states_names = [f"mp_rank_{t:02d}_model_states.pt" for t in range(tp)]
    for n in states_names:
        if n not in names:
            raise ForeignFormatError(f"{folder} lacks {n} (mp_world_size={tp}); a {flavor} checkpoint has one per tp rank")
    states = [read_torch_file(os.path.join(folder, n), inside=path) for n in states_names]
    mss = [as_dict(st.obj, n) for st, n in zip(states, states_names)]
    for t, m in enumerate(mss):
        if m.get("mp_world_size") != tp or m.get("dp_world_size") != dp:
            raise ForeignFormatError(f"{states_names[t]}: mp_world_size {m.get('mp_world_size')!r}, dp_world_size "
                         f"{m.get('dp_world_size')!r}; mp_rank_00 says {tp} and {dp}")
    optim: dict[tuple[int, int], str] = {}
    for n in names:
        m = OPTIM.match(n)
        if m:
            optim[(int(m.group(2)), int(m.group(3)))] = n
    want = {(d, t) for d in range(dp) for t in range(tp)}
    if set(optim) != want:
        raise ForeignFormatError(f"{folder} should hold optimizer files for dp ranks 0..{dp - 1} x tp ranks 0..{tp - 1}, found "
                     f"(dp, tp) {sorted(optim)}")
    optims = [[read_torch_file(os.path.join(folder, optim[(d, t)]), inside=path) for d in range(dp)] for t in range(tp)]
    osd = [[as_dict(as_dict(o.obj, o.path).get("optimizer_state_dict"), f"{o.path}: optimizer_state_dict") for o in row]
           for row in optims]
    stage = int(osd[0][0].get("zero_stage", 0))
    if stage == 0 and "single_partition_of_fp32_groups" in osd[0][0]:
        stage = 1
    if stage not in (1, 2) or any("single_partition_of_fp32_groups" not in o for row in osd for o in row):
        raise ForeignFormatError(f"{folder}: ucl reads {flavor} checkpoints with ZeRO-1/2 flat optimizer state only "
                     f"(zero_stage {stage})")
    groups = [list(g) for g in as_list(mss[0].get("param_shapes"), "param_shapes")]
    local: list[dict[str, tuple]] = []
    for t, m in enumerate(mss):
        gs = [list(g) for g in as_list(m.get("param_shapes"), f"{states_names[t]}: param_shapes")]
        if gs != groups:
            raise ForeignFormatError(f"{states_names[t]}: its param groups differ from mp_rank_00's")
        local.append({n: tuple(int(x) for x in sh) for g in m["param_shapes"] for n, sh in g.items()})
    shared = {str(k): str(v) for k, v in (first.get("shared_params") or {}).items()}
    buffers = [str(b) for b in first.get("buffer_names") or []]
    modules = [m.get("module") or {} for m in mss]
    frozen_names = [n for n, t in modules[0].items()
                    if n not in local[0] and n not in shared and n not in buffers and isinstance(t, TensorRef)]
    for n in list(local[0]) + frozen_names + buffers:
        if not NAME.match(n):
            raise ForeignFormatError(f"parameter name {n!r} cannot be written in a spec")
    placements: dict[str, Placement] = {}
    for n in list(local[0]) + frozen_names + buffers:
        shards = [tuple(as_tensor(mod.get(n), f"{states_names[t]}: {n}").shape) for t, mod in enumerate(modules)]
        if n in local[0] and any(local[t][n] != shards[t] for t in range(tp)):
            raise ForeignFormatError(f"{n}: param_shapes and the module disagree on its tp-local shape")
        placements[n] = place(n, shards, n in buffers)
    weights = weight_dtype(modules[0], local[0])
    kinds = (["fp32"] if weights != "float32" else []) + ["exp_avg", "exp_avg_sq"]
    spec = [f"# generated by ucl from the DeepSpeed {flavor} ZeRO-{stage} checkpoint {os.path.basename(path)}",
            "mesh tp, dp"] if user is None else [user[0].rstrip("\n"), f"# ZeRO-{stage} state generated by ucl"]
    by_dtype: dict[str, list[str]] = {}
    for n in placements:
        by_dtype.setdefault(as_tensor(modules[0].get(n), n).dtype, []).append(n)
    for dtype, names_d in by_dtype.items():
        spec.append(f"state param : dtype {dtype}" if dtype == weights
                    else state_line(["param"], names_d, f"dtype {dtype}"))
    for g, names_g in enumerate(groups):
        spec.append(state_line(kinds, names_g, f"flat over dp pad to multiple_of({ALIGN} * dp)"))
    spec.append("state step : scalar")
    extents: list[dict[str, Extent]] = [{} for _ in range(tp * dp)]
    tagdir = os.path.dirname(rel("x"))
    for t in range(tp):
        mine = extents[t * dp:(t + 1) * dp]
        for g, names_g in enumerate(groups):
            zero12_group(g, names_g, local[t], dp, optims[t], osd[t], kinds, mine, tagdir)
            for d in range(dp):
                step = group_state(osd[t][d], g, optim[(d, t)]).get("step")
                for n in names_g:
                    mine[d][f"step/{n}"] = extent(optims[t][d], step, rel(optim[(d, t)]), f"step of group {g}", ())
        for n in placements:
            ref = as_tensor(modules[t].get(n), n)
            for d in range(dp):
                mine[d][f"param/{n}"] = extent(states[t], ref, rel(states_names[t]), n, tuple(ref.shape))
    if user is None:  # else the user's rules say it
        for n, p in placements.items():
            spec.append(f"{n} [{', '.join(str(x) for x in p.full)}] : {p.layout}")
    key, info = extra(placements)
    state = {"format": "deepspeed", "deepspeed": {k: plain(v, values=states[0]) for k, v in first.items()
                                                  if k not in BULKY},
             "optimizer": {"zero_stage": stage, "param_groups": [
                 {**{k: plain(v) for k, v in g.items() if k != "params"}, "names": groups[i] if i < len(groups) else []}
                 for i, g in enumerate(as_dict(osd[0][0].get("base_optimizer_state"), "base optimizer state")
                                       .get("param_groups", []))],
                 "loss_scaler": plain(osd[0][0].get("loss_scaler"))},
             key: info}
    files = tuple(rel(optim[(d, t)]) for t in range(tp) for d in range(dp))
    read = (("latest",) if rel("x") != "x" else ()) + tuple(rel(n) for n in states_names) + files
    frozen = tuple(frozen_names + buffers)
    params = {n: p.full for n, p in placements.items()}
    return Description("deepspeed", "\n".join(spec) + "\n", f"{spec_name}-zero{stage}", dict(user[1]) if user else {},
                       (("tp", tp), ("dp", dp)), params, frozen, tuple(extents), files, state, read)
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
