"""DeepSpeed PipelineModule checkpoints (``layer_NN-model_states.pt`` files)."""
from __future__ import annotations

import os
import re

from ...errors import ForeignFormatError
from ...store.extents import Extent
from ..base import Description
from ..torchzip.read import plain, read_torch_file
from .common import ALIGN, as_dict, as_list, as_tensor, BULKY, extent, group_state, state_line, zero12_group


_LAYER = re.compile(r"^layer_(\d+)-model_states\.pt$")


def describe_pipeline(path: str, folder: str, names: list[str], rel) -> Description:
    """A PipelineModule checkpoint (ZeRO-0/1, tp=1): ``mp_rank_SS_model_states.pt`` per stage (its
    parameters per group, named ``<layer>.<name>`` or ``tied_modules.<key>.<name>``),
    ``layer_LL-model_states.pt`` per layer (the layer's own state dict: the weights), and per
    (dp rank, stage) ``zero_pp_rank_R_mp_rank_SS_optim_states.pt``. Mesh ``pp, dp``; each
    parameter ``on pp =`` the stages that train it (a tied module: all of its stages, each with its
    own optimizer state); each stage's groups are flat buffers as without a pipeline."""
    first = as_dict(read_torch_file(os.path.join(folder, "mp_rank_00_model_states.pt"), inside=path).obj,
                  "mp_rank_00_model_states.pt")
    dp, mp = first.get("dp_world_size"), first.get("mp_world_size", 1)
    dims = first.get("checkpoint_parallel_dimensions") or {}
    pp = dims.get("pp_degree", mp)
    if not all(isinstance(x, int) and x >= 1 for x in (dp, mp, pp)) or mp != pp:
        raise ForeignFormatError(f"{folder}: a pipeline checkpoint with dp={dp!r}, mp_world_size={mp!r}, pp_degree={pp!r}; ucl "
                     "reads pipeline checkpoints without tensor parallelism (mp_world_size == pp_degree)")
    stages = [read_torch_file(os.path.join(folder, f"mp_rank_{s:02d}_model_states.pt"), inside=path) for s in range(pp)]
    layers = {int(m.group(1)): read_torch_file(os.path.join(folder, n), inside=path)
              for n in names if (m := _LAYER.match(n))}
    optim_names = [[f"zero_pp_rank_{r}_mp_rank_{s:02d}_optim_states.pt" for r in range(dp)] for s in range(pp)]
    for row in optim_names:
        for n in row:
            if n not in names:
                raise ForeignFormatError(f"{folder} lacks {n} (dp={dp}, pp={pp}); a pipeline checkpoint needs one optimizer file "
                             "per dp rank and stage")
    optims = [[read_torch_file(os.path.join(folder, n), inside=path) for n in row] for row in optim_names]
    osd = [[as_dict(as_dict(o.obj, o.path).get("optimizer_state_dict"), f"{o.path}: optimizer_state_dict") for o in row]
           for row in optims]
    if any(int(o.get("zero_stage", 0)) not in (0, 1) or "single_partition_of_fp32_groups" not in o for row in osd for o in row):
        raise ForeignFormatError(f"{folder}: ucl reads pipeline checkpoints with ZeRO stage 0/1 flat optimizer state only")
    groups_by_stage = [[list(g) for g in as_list(as_dict(st.obj, st.path).get("param_shapes"), "param_shapes")]
                       for st in stages]
    shapes = {n: tuple(int(x) for x in sh) for st in stages for g in st.obj["param_shapes"] for n, sh in g.items()}
    order: list[str] = []
    for groups in groups_by_stage:
        for g in groups:
            order += [n for n in g if n not in order]
    placed = {n: [s for s, gs in enumerate(groups_by_stage) if any(n in g for g in gs)] for n in order}
    # each weight's bytes: numbered layers in layer_NN, tied modules in the one layer file holding them
    numbered = {int(n.split(".", 1)[0]) for n in order if n.split(".", 1)[0].isdigit()}
    tied_files = [i for i in sorted(layers) if i not in numbered]
    where: dict[str, tuple[int, str]] = {}
    for n in order:
        head, _, rest = n.partition(".")
        if head.isdigit():
            where[n] = (int(head), rest)
        elif head == "tied_modules":
            key, _, local = rest.partition(".")
            hits = [i for i in tied_files if local in as_dict(layers[i].obj, layers[i].path)]
            if len(hits) != 1:
                raise ForeignFormatError(f"{folder}: cannot tell which layer file holds the tied parameter {n!r} (candidates: "
                             f"{[f'layer_{i:02d}' for i in hits]})")
            where[n] = (hits[0], local)
        else:
            raise ForeignFormatError(f"{folder}: pipeline parameter {n!r} is neither '<layer>.<name>' nor 'tied_modules.<key>.<name>'")
    buffers = list(dict.fromkeys(str(b) for st in stages for b in (st.obj.get("buffer_names") or [])))
    frozen: list[str] = []
    for i in sorted(layers):  # what the layer files hold beyond the trained parameters
        prefix = f"{i}." if i in numbered else next(
            (n[:-len(loc)] for n, (j, loc) in where.items() if j == i), None)
        if prefix is None:
            raise ForeignFormatError(f"{folder}: layer_{i:02d} holds no parameter any stage trains; ucl cannot place it")
        for local, t in as_dict(layers[i].obj, layers[i].path).items():
            name = prefix + local
            if name not in where:
                where[name] = (i, local)
                frozen.append(name) if name not in buffers else None
                owner = next(n for n, (j, _) in where.items() if j == i and n in placed)
                placed[name] = placed[owner]
    frozen += [b for b in buffers if b in where]
    extents: list[dict[str, Extent]] = [{} for _ in range(pp * dp)]
    weights = {where[n][0] for n in order}
    dtypes = {as_tensor(layers[where[n][0]].obj.get(where[n][1]), n).dtype for n in order}
    if len(dtypes) != 1 or not weights:
        raise ForeignFormatError(f"{folder}: the pipeline's parameters have several dtypes {sorted(dtypes)}")
    dtype = dtypes.pop()
    kinds = (["fp32"] if dtype != "float32" else []) + ["exp_avg", "exp_avg_sq"]
    spec = [f"# generated by ucl from the DeepSpeed pipeline checkpoint {os.path.basename(path)}", "mesh pp, dp",
            f"state param : dtype {dtype}"]
    for n in frozen:
        t = as_tensor(layers[where[n][0]].obj.get(where[n][1]), n)
        if t.dtype != dtype:
            spec.append(state_line(["param"], [n], f"dtype {t.dtype}"))
    ngroups = max(len(g) for g in groups_by_stage)
    for g in range(ngroups):
        members = [n for n in order if any(g < len(gs) and n in gs[g] for gs in groups_by_stage)]
        spec.append(state_line(kinds, members, f"flat over dp pad to multiple_of({ALIGN} * dp)"))
    spec.append("state step : scalar")
    for s in range(pp):
        mine = extents[s * dp:(s + 1) * dp]
        for g, names_g in enumerate(groups_by_stage[s]):
            if [n for n in order if n in names_g] != names_g:
                raise ForeignFormatError(f"{folder}: stage {s} flattens group {g} in an order no global parameter order gives")
            zero12_group(g, names_g, shapes, dp, optims[s], osd[s], kinds, mine, os.path.dirname(rel("x")))
            for r in range(dp):
                step = group_state(osd[s][r], g, optim_names[s][r]).get("step")
                for n in names_g:
                    mine[r][f"step/{n}"] = extent(optims[s][r], step, rel(optim_names[s][r]), f"step of group {g}", ())
        for n in list(order) + frozen:
            if s in placed[n]:
                i, local = where[n]
                t = as_tensor(layers[i].obj.get(local), n)
                for r in range(dp):
                    mine[r][f"param/{n}"] = extent(layers[i], t, rel(f"layer_{i:02d}-model_states.pt"), n, tuple(t.shape))
    params: dict[str, tuple] = {}
    for n in list(order) + frozen:
        i, local = where[n]
        params[n] = tuple(as_tensor(layers[i].obj.get(local), n).shape)
        # first/last rather than 0/pp-1: the spec then also describes a layout with fewer stages
        stages_n = ", ".join("first" if s == 0 else "last" if s == pp - 1 else str(s) for s in placed[n])
        spec.append(f"{n} [{', '.join(str(x) for x in params[n])}] : on pp = {stages_n}")
    state = {"format": "deepspeed", "deepspeed": {k: plain(v) for k, v in first.items() if k not in BULKY},
             "optimizer": {"zero_stage": 1, "param_groups": [
                 {**{k: plain(v) for k, v in g.items() if k != "params"},
                  "names": [n for n in order if any(i < len(gs) and n in gs[i] for gs in groups_by_stage)]}
                 for i, g in enumerate(as_dict(osd[0][0].get("base_optimizer_state"), "base optimizer state")
                                       .get("param_groups", []))],
                 "loss_scaler": plain(osd[0][0].get("loss_scaler"))},
             "pipeline": {"layer_files": {n: f"layer_{where[n][0]:02d}" for n in params}}}
    read = tuple(rel(f"mp_rank_{s:02d}_model_states.pt") for s in range(pp)) + \
        tuple(rel(n) for n in names if _LAYER.match(n)) + tuple(rel(n) for row in optim_names for n in row)
    files = tuple(rel(optim_names[s][r]) for s in range(pp) for r in range(dp))
    return Description("deepspeed", "\n".join(spec) + "\n", "deepspeed-pipeline", {}, (("pp", pp), ("dp", dp)),
                       params, tuple(frozen), tuple(extents), files, state, read)
