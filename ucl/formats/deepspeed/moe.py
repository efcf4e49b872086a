"""DeepSpeed native MoE checkpoints (``deepspeed.moe.layer.MoE`` layers, ZeRO-1/2), read in place.

What ``engine._save_moe_checkpoint`` writes (DeepSpeed 0.19.8):

* ``mp_rank_00_model_states.pt``: as without MoE, but ``module`` lacks the experts (the gates
  ``*.deepspeed_moe.gate.wg.weight`` stay), ``num_experts`` lists each MoE layer's expert count,
  and ``param_shapes`` (written by rank 0) names rank 0's **local** experts
  (``<layer>.deepspeed_moe.experts.deepspeed_experts.<local>.<rest>``), the same names every
  expert-parallel rank uses for its own experts.
* ``layer_L_expert_E_mp_rank_00_model_states.pt``: the weights of global expert ``E`` of the L-th
  MoE layer (in module order), keyed by the **global** name (local id replaced by ``E``).
* ``[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt`` per rank R: the optimizer groups
  ``split_params_into_different_moe_groups_for_optimizer`` made, dense ones (partitioned over all
  dp ranks) and expert ones (``moe: True``: the rank's local experts flattened, partitioned over
  the expert-data-parallel group, ``partition_count`` = its size).

Ranks are E + D (the default): expert-parallel rank ``R % ep``, expert-data-parallel rank
``R // ep``, global expert ``ep_rank * local + l``. As a spec: ``mesh edp, ep``; each MoE layer's
experts ``index e of N over ep`` (the rank-local names are DeepSpeed's local names); dense
groups ``flat over (edp, ep) pad to multiple_of(2 * edp * ep)``, expert groups ``flat over edp pad
to multiple_of(2 * edp)``. ``ep`` is ``num_experts / local experts per rank`` (param_shapes),
``edp`` the expert groups' ``partition_count``; both are checked against ``dp_world_size`` and the
groups' ``ep_size_N`` names.
"""
from __future__ import annotations

import os
import re

from ...errors import ForeignFormatError
from ...store.extents import Extent
from ..base import Description
from ..torchzip.read import TensorRef, TorchFile, plain, read_torch_file
from .common import (ALIGN, as_dict, as_list, as_tensor, BULKY, extent, group_state, NAME, OPTIM,
                     state_line, weight_dtype, zero12_group)

EXPERT_FILE = re.compile(r"^layer_(\d+)_expert_(\d+)_mp_rank_(\d+)_model_states\.pt$")
_LOCAL = re.compile(r"^(.+\.deepspeed_moe\.experts\.deepspeed_experts\.)(\d+)\.(.+)$")
_GROUP = re.compile(r"^ep_size_(\d+)$")
MOE_BULKY = BULKY | {"num_experts"}


def is_moe(names: list[str], ms: dict) -> bool:
    return bool(ms.get("num_experts")) or any(EXPERT_FILE.match(n) for n in names)


def describe_moe(path: str, folder: str, names: list[str], rel, ms: dict, states: TorchFile, states_name: str,
                 dp: int) -> Description:
    """A checkpoint with DeepSpeed MoE layers (see the module doc)."""
    if ms.get("mp_world_size", 1) != 1 or (ms.get("checkpoint_parallel_dimensions") or {}).get("pp_degree", 1) != 1:
        raise ForeignFormatError(f"{folder}: MoE with tensor or pipeline parallelism (mp_world_size={ms.get('mp_world_size')!r}) "
                     "is not read yet")
    if (ms.get("ds_config") or {}).get("use_data_before_expert_parallelism"):
        raise ForeignFormatError(f"{folder}: use_data_before_expert_parallelism (D + E rank order) is not read yet")
    if ms.get("ds_autoep_layers"):
        raise ForeignFormatError(f"{folder}: AutoEP MoE layers (ds_autoep_layers) are not read yet")
    counts = [int(n) for n in as_list(ms.get("num_experts"), f"{states_name}: num_experts")]
    optim = {}
    for n in names:
        if (m := OPTIM.match(n)) and int(m.group(3)) == 0:
            optim[int(m.group(2))] = n
    if sorted(optim) != list(range(dp)):
        raise ForeignFormatError(f"{folder} should hold optimizer files for dp ranks 0..{dp - 1} (dp_world_size={dp}), "
                     f"found ranks {sorted(optim)}")
    optims = [read_torch_file(os.path.join(folder, optim[r]), inside=path) for r in range(dp)]
    osd = [as_dict(as_dict(o.obj, optim[r]).get("optimizer_state_dict"), f"{optim[r]}: optimizer_state_dict")
           for r, o in enumerate(optims)]
    stage = int(osd[0].get("zero_stage", 0))
    if stage not in (1, 2) or any("single_partition_of_fp32_groups" not in o for o in osd):
        raise ForeignFormatError(f"{folder}: ucl reads MoE checkpoints with ZeRO-1/2 flat optimizer state only "
                     f"(zero_stage {stage})")
    base = as_dict(osd[0].get("base_optimizer_state"), f"{optim[0]}: base_optimizer_state")
    opt_groups = [as_dict(g, "param group") for g in as_list(base.get("param_groups"), "param_groups")]
    groups = [list(g) for g in as_list(ms.get("param_shapes"), "param_shapes")]
    if len(groups) != len(opt_groups):
        raise ForeignFormatError(f"{states_name} has {len(groups)} param groups, {optim[0]} {len(opt_groups)}")
    shapes = {n: tuple(int(x) for x in s) for g in ms["param_shapes"] for n, s in g.items()}
    is_expert = [bool(g.get("moe")) for g in opt_groups]
    for g, names_g in enumerate(groups):
        bad = [n for n in names_g if bool(_LOCAL.match(n)) != is_expert[g]]
        if bad:
            raise ForeignFormatError(f"{optim[0]} group {g} ({'expert' if is_expert[g] else 'dense'}) holds {bad[0]!r}, which "
                         f"is {'not ' if is_expert[g] else ''}a DeepSpeed MoE expert parameter")

    # the layers: each expert prefix, its local experts, and the layer_L files that hold it
    local_ids: dict[str, set[int]] = {}
    for g, names_g in enumerate(groups):
        for n in names_g if is_expert[g] else ():
            m = _LOCAL.match(n)
            local_ids.setdefault(m.group(1), set()).add(int(m.group(2)))
    prefixes = list(local_ids)
    if len(prefixes) != len(counts):
        raise ForeignFormatError(f"{states_name}: num_experts lists {len(counts)} MoE layers, param_shapes has experts of "
                     f"{len(prefixes)}")
    local = {p: len(ids) for p, ids in local_ids.items()}
    if any(sorted(ids) != list(range(len(ids))) for ids in local_ids.values()):
        raise ForeignFormatError(f"{states_name}: local expert ids are not 0..n-1 in every MoE layer")
    experts_of, files_of, opened = {}, {}, {}
    for layer, count in enumerate(counts):
        first = opened[(layer, 0)] = _expert_file(path, folder, layer, 0)
        hits = [p for p in prefixes if any(str(k).startswith(p + "0.") for k in as_dict(first.obj, first.path))]
        if len(hits) != 1 or hits[0] in experts_of:
            raise ForeignFormatError(f"{first.path}: its keys name {len(hits)} of the MoE layers in param_shapes, or one that "
                         "another layer's file names; each layer_L file should hold one layer's experts")
        experts_of[hits[0]], files_of[hits[0]] = count, layer
    eps = {experts_of[p] // local[p] for p in prefixes}
    if len(eps) != 1 or any(experts_of[p] % local[p] for p in prefixes):
        raise ForeignFormatError(f"{folder}: MoE layers with num_experts {counts} and local experts {list(local.values())} do "
                     "not share one expert-parallel size")
    ep = eps.pop()
    edps = sorted({int(as_list(osd[0].get("partition_count"), "partition_count")[g])
                   for g in range(len(groups)) if is_expert[g]})
    edp = edps[0] if len(edps) == 1 else 0
    if edp * ep != dp:
        raise ForeignFormatError(f"{folder}: expert groups partitioned over {edps} ranks (partition_count) with ep={ep} do not "
                     f"make dp_world_size={dp}")
    for g in range(len(groups)):
        m = _GROUP.match(str(opt_groups[g].get("name", "")))
        if is_expert[g] and m and int(m.group(1)) != ep:
            raise ForeignFormatError(f"{optim[0]} group {g} is named {opt_groups[g]['name']!r}, but the experts say ep={ep}")

    # global names: in each expert group, ordered so that every ep rank's experts keep DeepSpeed's local order
    def global_name(n: str, e: int) -> str:
        m = _LOCAL.match(n)
        return f"{m.group(1)}{e * local[m.group(1)] + int(m.group(2))}.{m.group(3)}"

    global_groups = [_global_order(names_g, ep, global_name) if is_expert[g] else names_g
                     for g, names_g in enumerate(groups)]
    local_of = {global_name(n, e): n for g, ns in enumerate(groups) if is_expert[g] for n in ns for e in range(ep)}
    buffers = [str(b) for b in ms.get("buffer_names") or []]
    shared = {str(k): str(v) for k, v in (ms.get("shared_params") or {}).items()}
    module = as_dict(ms.get("module") or {}, "module")
    frozen = [n for n, t in module.items() if n not in shapes and n not in shared and n not in buffers
              and isinstance(t, TensorRef)]
    params: dict[str, tuple] = {}
    for g, names_g in enumerate(global_groups):
        for n in names_g:
            params[n] = shapes[local_of.get(n, n)]
    for n in frozen + buffers:
        params[n] = tuple(as_tensor(module.get(n), n).shape)
    for n in params:
        if not NAME.match(n):
            raise ForeignFormatError(f"parameter name {n!r} cannot be written in a spec")

    # the expert files: each global expert's weights, under its global name
    expert_refs: dict[str, tuple[TorchFile, TensorRef, str]] = {}
    expert_files = []
    for p in prefixes:
        suffixes = [m.group(3) for n in shapes if (m := _LOCAL.match(n)) and m.group(1) == p and m.group(2) == "0"]
        for e in range(experts_of[p]):
            name = f"layer_{files_of[p]}_expert_{e}_mp_rank_00_model_states.pt"
            tf = opened.get((files_of[p], e)) or _expert_file(path, folder, files_of[p], e)
            sd = as_dict(tf.obj, name)
            want = {f"{p}{e}.{s}" for s in suffixes}
            if set(map(str, sd)) != want:
                extra = sorted(set(map(str, sd)) ^ want)
                raise ForeignFormatError(f"{name} should hold the trained parameters of expert {e} ({sorted(want)[:2]}...), "
                             f"it differs in {extra[:4]} (frozen expert parameters and expert buffers are not "
                             "read yet)")
            for k in want:
                expert_refs[k] = (tf, as_tensor(sd[k], f"{name}: {k}"), rel(name))
            expert_files.append(rel(name))

    trained = {n: params[n] for ns in global_groups for n in ns}
    weights = weight_dtype({**module, **{k: v[1] for k, v in expert_refs.items()}}, trained)
    kinds = (["fp32"] if weights != "float32" else []) + ["exp_avg", "exp_avg_sq"]
    spec = [f"# generated by ucl from the DeepSpeed MoE ZeRO-{stage} checkpoint {os.path.basename(path)}",
            "mesh edp, ep", f"state param : dtype {weights}"]
    by_dtype: dict[str, list[str]] = {}
    for n in frozen + buffers:
        by_dtype.setdefault(as_tensor(module.get(n), n).dtype, []).append(n)
    spec += [state_line(["param"], ns, f"dtype {dt}") for dt, ns in by_dtype.items() if dt != weights]
    for g, names_g in enumerate(global_groups):
        layout = f"flat over edp pad to multiple_of({ALIGN} * edp)" if is_expert[g] else \
            f"flat over (edp, ep) pad to multiple_of({ALIGN} * edp * ep)"
        spec.append(state_line(kinds, names_g, layout))
    spec.append("state step : scalar")
    spec += [f"{p}{{e}}.** : index e of {experts_of[p]} over ep" for p in prefixes]
    spec += [f"{n} [{', '.join(str(x) for x in s)}] : replicate" for n, s in params.items()]

    extents: list[dict[str, Extent]] = [{} for _ in range(dp)]
    tagdir = os.path.dirname(rel("x"))
    for g, names_g in enumerate(groups):
        if not is_expert[g]:
            zero12_group(g, names_g, shapes, dp, optims, osd, kinds, extents, tagdir)
            continue
        for e in range(ep):  # E + D: rank d * ep + e
            ranks = [d * ep + e for d in range(edp)]
            zero12_group(g, names_g, shapes, edp, [optims[r] for r in ranks], [osd[r] for r in ranks], kinds,
                         [extents[r] for r in ranks], tagdir)
    for r in range(dp):
        e = r % ep
        for g, names_g in enumerate(groups):
            step = group_state(osd[r], g, optim[r]).get("step")
            for n in names_g:
                extents[r][f"step/{n}"] = extent(optims[r], step, rel(optim[r]), f"step of group {g}", ())
                if is_expert[g]:
                    tf, ref, where = expert_refs[global_name(n, e)]
                    extents[r][f"param/{n}"] = extent(tf, ref, where, global_name(n, e), shapes[n])
        for n in [n for g, ns in enumerate(groups) if not is_expert[g] for n in ns] + frozen + buffers:
            extents[r][f"param/{n}"] = extent(states, module.get(n), rel(states_name), n, params[n])
    state = {"format": "deepspeed", "deepspeed": {k: plain(v) for k, v in ms.items() if k not in MOE_BULKY},
             "optimizer": {"zero_stage": stage, "param_groups": [
                 {**{k: plain(v) for k, v in g.items() if k != "params"}, "names": global_groups[i]}
                 for i, g in enumerate(opt_groups)], "loss_scaler": plain(osd[0].get("loss_scaler"))},
             "moe": {"ep": ep, "edp": edp, "num_experts": counts,
                     "layers": {p.rstrip("."): {"layer_file": files_of[p], "num_experts": experts_of[p],
                                                "local_experts": local[p]} for p in prefixes}}}
    read = (("latest",) if rel("x") != "x" else ()) + (rel(states_name),) + tuple(rel(optim[r]) for r in range(dp)) \
        + tuple(expert_files)
    return Description("deepspeed", "\n".join(spec) + "\n", f"deepspeed-moe-zero{stage}", {}, (("edp", edp), ("ep", ep)),
                       params, tuple(frozen + buffers), tuple(extents), tuple(rel(optim[r]) for r in range(dp)), state,
                       read)


def _expert_file(path: str, folder: str, layer: int, expert: int) -> TorchFile:
    name = f"layer_{layer}_expert_{expert}_mp_rank_00_model_states.pt"
    if not os.path.isfile(os.path.join(folder, name)):
        raise ForeignFormatError(f"{folder} lacks {name}; num_experts in the model states says it is there")
    return read_torch_file(os.path.join(folder, name), inside=path)


def _global_order(names: list[str], ep: int, global_name) -> list[str]:
    """An expert group's global names in an order that, restricted to any ep rank's experts, is
    that rank's local (flattening) order: by layer and global expert where that works, else rank by rank."""
    pos = {n: i for i, n in enumerate(names)}
    layer_pos: dict[str, int] = {}
    for n in names:
        layer_pos.setdefault(_LOCAL.match(n).group(1), len(layer_pos))
    key = {}
    for e in range(ep):
        for n in names:
            m = _LOCAL.match(global_name(n, e))
            key[global_name(n, e)] = (layer_pos[m.group(1)], int(m.group(2)), pos[n], n)
    nice = sorted(key, key=key.get)
    ok = all([key[g][3] for g in nice if g in {global_name(n, e) for n in names}] == names for e in range(ep))
    return nice if ok else [global_name(n, e) for e in range(ep) for n in names]
