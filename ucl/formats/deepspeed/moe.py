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
from dataclasses import dataclass, field, replace

from ...errors import ForeignFormatError
from ...store.extents import Extent
from ..base import Description
from ..torchzip.read import TensorRef, TorchFile
from ..torchzip.plain import plain
from .common import (ALIGN, as_dict, as_list, as_tensor, BULKY, DsFolder, extent, group_state, NAME, optimizer_dict,
                     optimizer_state, OPTIM, state_line, weight_dtype, zero12_group)

EXPERT_FILE = re.compile(r"^layer_(\d+)_expert_(\d+)_mp_rank_(\d+)_model_states\.pt$")
_LOCAL = re.compile(r"^(.+\.deepspeed_moe\.experts\.deepspeed_experts\.)(\d+)\.(.+)$")
_GROUP = re.compile(r"^ep_size_(\d+)$")
MOE_BULKY = BULKY | {"num_experts"}


def is_moe(names: list[str], ms: dict) -> bool:
    return bool(ms.get("num_experts")) or any(EXPERT_FILE.match(n) for n in names)


@dataclass(frozen=True)
class MoeRun:
    """The files of a MoE checkpoint, read and checked: the optimizer files, the param groups (dense
    or expert), and each MoE layer's experts."""
    at: DsFolder
    optim: list[str]  # optimizer file per dp rank
    optims: list[TorchFile]
    osd: list[dict]
    stage: int
    opt_groups: list[dict]  # the base optimizer's param groups
    groups: list[list[str]]  # the rank-local names per group, in flattening order
    shapes: dict[str, tuple[int, ...]]
    is_expert: list[bool]  # per group
    counts: list[int]  # num_experts per MoE layer, in module order
    # the layers (_read_layers)
    prefixes: list[str] = field(default_factory=list)  # each MoE layer's expert prefix
    local: dict[str, int] = field(default_factory=dict)  # prefix -> its experts per ep rank
    experts_of: dict[str, int] = field(default_factory=dict)  # prefix -> its experts
    files_of: dict[str, int] = field(default_factory=dict)  # prefix -> L of its layer_L_expert_E files
    opened: dict[tuple[int, int], TorchFile] = field(default_factory=dict)  # files opened to tell the layers apart
    ep: int = 0
    edp: int = 0

    def global_name(self, n: str, e: int) -> str:
        """The name of local expert parameter ``n`` on ep rank ``e``."""
        m = _LOCAL.match(n)
        return f"{m.group(1)}{e * self.local[m.group(1)] + int(m.group(2))}.{m.group(3)}"


@dataclass(frozen=True)
class MoeParams:
    """Every tensor under its global name, and where each expert's weights lie."""
    global_groups: list[list[str]]  # per group, the global names (expert groups: every ep rank's)
    frozen: list[str]  # frozen parameters, then buffers
    params: dict[str, tuple]
    module: dict
    expert_refs: dict[str, tuple[TorchFile, TensorRef, str]]  # global name -> (file, tensor, rel path)
    expert_files: list[str]
    weights: str  # the training dtype


def describe_moe(f: DsFolder) -> Description:
    """A checkpoint with DeepSpeed MoE layers (see the module doc)."""
    _supported(f)
    run = _read_layers(_read_groups(f))
    p = _params(run)
    kinds = (["fp32"] if p.weights != "float32" else []) + ["exp_avg", "exp_avg_sq"]
    files = tuple(f.rel(n) for n in run.optim)
    read = f.latest + (f.rel(f.states_name),) + files + tuple(p.expert_files)
    return Description("deepspeed", _spec(run, p, kinds), f"deepspeed-moe-zero{run.stage}", {},
                       (("edp", run.edp), ("ep", run.ep)), p.params, tuple(p.frozen), _extents(run, p, kinds),
                       files, _state(run, p), read)


def _supported(f: DsFolder) -> None:
    ms = f.ms
    if ms.get("mp_world_size", 1) != 1 or (ms.get("checkpoint_parallel_dimensions") or {}).get("pp_degree", 1) != 1:
        raise ForeignFormatError(f"{f.folder}: MoE with tensor or pipeline parallelism (mp_world_size={ms.get('mp_world_size')!r}) "
                     "is not read yet")
    if (ms.get("ds_config") or {}).get("use_data_before_expert_parallelism"):
        raise ForeignFormatError(f"{f.folder}: use_data_before_expert_parallelism (D + E rank order) is not read yet")
    if ms.get("ds_autoep_layers"):
        raise ForeignFormatError(f"{f.folder}: AutoEP MoE layers (ds_autoep_layers) are not read yet")


def _read_groups(f: DsFolder) -> MoeRun:
    """The optimizer files and the param groups, each dense or expert."""
    counts = [int(n) for n in as_list(f.ms.get("num_experts"), f"{f.states_name}: num_experts")]
    optim = {int(m.group(2)): n for n in f.names if (m := OPTIM.match(n)) and int(m.group(3)) == 0}
    if len(optim) != f.dp or sorted(optim) != list(range(f.dp)):
        raise ForeignFormatError(f"{f.folder} should hold optimizer files for dp ranks 0..{f.dp - 1} (dp_world_size={f.dp}), "
                     f"found ranks {sorted(optim)}")
    names = [optim[r] for r in range(f.dp)]
    optims = [f.open(n) for n in names]
    osd = [optimizer_dict(o, names[r]) for r, o in enumerate(optims)]
    stage = int(osd[0].get("zero_stage", 0))
    if stage not in (1, 2) or any("single_partition_of_fp32_groups" not in o for o in osd):
        raise ForeignFormatError(f"{f.folder}: ucl reads MoE checkpoints with ZeRO-1/2 flat optimizer state only "
                     f"(zero_stage {stage})")
    base = as_dict(osd[0].get("base_optimizer_state"), f"{names[0]}: base_optimizer_state")
    opt_groups = [as_dict(g, "param group") for g in as_list(base.get("param_groups"), "param_groups")]
    groups = [list(g) for g in as_list(f.ms.get("param_shapes"), "param_shapes")]
    if len(groups) != len(opt_groups):
        raise ForeignFormatError(f"{f.states_name} has {len(groups)} param groups, {names[0]} {len(opt_groups)}")
    shapes = {n: tuple(int(x) for x in s) for g in f.ms["param_shapes"] for n, s in g.items()}
    is_expert = [bool(g.get("moe")) for g in opt_groups]
    for g, names_g in enumerate(groups):
        bad = [n for n in names_g if bool(_LOCAL.match(n)) != is_expert[g]]
        if bad:
            raise ForeignFormatError(f"{names[0]} group {g} ({'expert' if is_expert[g] else 'dense'}) holds {bad[0]!r}, which "
                         f"is {'not ' if is_expert[g] else ''}a DeepSpeed MoE expert parameter")
    return MoeRun(f, names, optims, osd, stage, opt_groups, groups, shapes, is_expert, counts)


def _read_layers(run: MoeRun) -> MoeRun:
    """``run`` with its layers: each expert prefix, its local experts, the layer_L files that hold
    it, and the expert-parallel sizes they make."""
    f, groups, is_expert, counts = run.at, run.groups, run.is_expert, run.counts
    local_ids: dict[str, set[int]] = {}
    for g, names_g in enumerate(groups):
        for n in names_g if is_expert[g] else ():
            m = _LOCAL.match(n)
            local_ids.setdefault(m.group(1), set()).add(int(m.group(2)))
    prefixes = list(local_ids)
    if len(prefixes) != len(counts):
        raise ForeignFormatError(f"{f.states_name}: num_experts lists {len(counts)} MoE layers, param_shapes has experts of "
                     f"{len(prefixes)}")
    local = {p: len(ids) for p, ids in local_ids.items()}
    if any(sorted(ids) != list(range(len(ids))) for ids in local_ids.values()):
        raise ForeignFormatError(f"{f.states_name}: local expert ids are not 0..n-1 in every MoE layer")
    experts_of, files_of, opened = {}, {}, {}
    for layer, count in enumerate(counts):
        first = opened[(layer, 0)] = _expert_file(f, layer, 0)
        hits = [p for p in prefixes if any(str(k).startswith(p + "0.") for k in as_dict(first.obj, first.path))]
        if len(hits) != 1 or hits[0] in experts_of:
            raise ForeignFormatError(f"{first.path}: its keys name {len(hits)} of the MoE layers in param_shapes, or one that "
                         "another layer's file names; each layer_L file should hold one layer's experts")
        experts_of[hits[0]], files_of[hits[0]] = count, layer
    eps = {experts_of[p] // local[p] for p in prefixes}
    if len(eps) != 1 or any(experts_of[p] % local[p] for p in prefixes):
        raise ForeignFormatError(f"{f.folder}: MoE layers with num_experts {counts} and local experts {list(local.values())} do "
                     "not share one expert-parallel size")
    ep = eps.pop()
    edps = sorted({int(as_list(run.osd[0].get("partition_count"), "partition_count")[g])
                   for g in range(len(groups)) if is_expert[g]})
    edp = edps[0] if len(edps) == 1 else 0
    if edp * ep != f.dp:
        raise ForeignFormatError(f"{f.folder}: expert groups partitioned over {edps} ranks (partition_count) with ep={ep} do not "
                     f"make dp_world_size={f.dp}")
    for g, og in enumerate(run.opt_groups):
        m = _GROUP.match(str(og.get("name", "")))
        if is_expert[g] and m and int(m.group(1)) != ep:
            raise ForeignFormatError(f"{run.optim[0]} group {g} is named {og['name']!r}, but the experts say ep={ep}")
    return replace(run, prefixes=prefixes, local=local, experts_of=experts_of, files_of=files_of, opened=opened,
                   ep=ep, edp=edp)


def _params(run: MoeRun) -> MoeParams:
    """Global names: in each expert group, ordered so that every ep rank's experts keep DeepSpeed's
    local order; the frozen parameters and buffers from the module."""
    ms = run.at.ms
    global_groups = [_global_order(names_g, run.ep, run.global_name) if run.is_expert[g] else names_g
                     for g, names_g in enumerate(run.groups)]
    local_of = {run.global_name(n, e): n for g, ns in enumerate(run.groups) if run.is_expert[g] for n in ns
                for e in range(run.ep)}
    buffers = [str(b) for b in ms.get("buffer_names") or []]
    shared = {str(k): str(v) for k, v in (ms.get("shared_params") or {}).items()}
    module = as_dict(ms.get("module") or {}, "module")
    frozen = [n for n, t in module.items() if n not in run.shapes and n not in shared and n not in buffers
              and isinstance(t, TensorRef)]
    params: dict[str, tuple] = {}
    for names_g in global_groups:
        for n in names_g:
            params[n] = run.shapes[local_of.get(n, n)]
    for n in frozen + buffers:
        params[n] = tuple(as_tensor(module.get(n), n).shape)
    for n in params:
        if not NAME.match(n):
            raise ForeignFormatError(f"parameter name {n!r} cannot be written in a spec")
    expert_refs, expert_files = _expert_refs(run)
    trained = {n: params[n] for ns in global_groups for n in ns}
    weights = weight_dtype({**module, **{k: v[1] for k, v in expert_refs.items()}}, trained)
    return MoeParams(global_groups, frozen + buffers, params, module, expert_refs, expert_files, weights)


def _expert_refs(run: MoeRun) -> tuple[dict[str, tuple[TorchFile, TensorRef, str]], list[str]]:
    """The expert files: each global expert's weights, under its global name."""
    f = run.at
    expert_refs: dict[str, tuple[TorchFile, TensorRef, str]] = {}
    expert_files = []
    for p in run.prefixes:
        suffixes = [m.group(3) for n in run.shapes if (m := _LOCAL.match(n)) and m.group(1) == p and m.group(2) == "0"]
        for e in range(run.experts_of[p]):
            name = f"layer_{run.files_of[p]}_expert_{e}_mp_rank_00_model_states.pt"
            tf = run.opened.get((run.files_of[p], e)) or _expert_file(f, run.files_of[p], e)
            sd = as_dict(tf.obj, name)
            want = {f"{p}{e}.{s}" for s in suffixes}
            if set(map(str, sd)) != want:
                extra = sorted(set(map(str, sd)) ^ want)
                raise ForeignFormatError(f"{name} should hold the trained parameters of expert {e} ({sorted(want)[:2]}...), "
                             f"it differs in {extra[:4]} (frozen expert parameters and expert buffers are not "
                             "read yet)")
            for k in want:
                expert_refs[k] = (tf, as_tensor(sd[k], f"{name}: {k}"), f.rel(name))
            expert_files.append(f.rel(name))
    return expert_refs, expert_files


def _spec(run: MoeRun, p: MoeParams, kinds: list[str]) -> str:
    spec = [f"# generated by ucl from the DeepSpeed MoE ZeRO-{run.stage} checkpoint {os.path.basename(run.at.path)}",
            "mesh edp, ep", f"state param : dtype {p.weights}"]
    by_dtype: dict[str, list[str]] = {}
    for n in p.frozen:
        by_dtype.setdefault(as_tensor(p.module.get(n), n).dtype, []).append(n)
    spec += [state_line(["param"], ns, f"dtype {dt}") for dt, ns in by_dtype.items() if dt != p.weights]
    for g, names_g in enumerate(p.global_groups):
        layout = f"flat over edp pad to multiple_of({ALIGN} * edp)" if run.is_expert[g] else \
            f"flat over (edp, ep) pad to multiple_of({ALIGN} * edp * ep)"
        spec.append(state_line(kinds, names_g, layout))
    spec.append("state step : scalar")
    spec += [f"{pre}{{e}}.** : index e of {run.experts_of[pre]} over ep" for pre in run.prefixes]
    spec += [f"{n} [{', '.join(str(x) for x in s)}] : replicate" for n, s in p.params.items()]
    return "\n".join(spec) + "\n"


def _extents(run: MoeRun, p: MoeParams, kinds: list[str]) -> tuple[dict[str, Extent], ...]:
    """Rank R = d * ep + e (E + D): the dense groups' part R of dp, the expert groups' part d of edp
    (ep rank e's experts), the module's weights, expert e's weights from its files."""
    f, dp, ep = run.at, run.at.dp, run.ep
    extents: list[dict[str, Extent]] = [{} for _ in range(dp)]
    tagdir = os.path.dirname(f.rel("x"))
    for g, names_g in enumerate(run.groups):
        if not run.is_expert[g]:
            zero12_group(g, names_g, run.shapes, dp, run.optims, run.osd, kinds, extents, tagdir)
            continue
        for e in range(ep):
            ranks = [d * ep + e for d in range(run.edp)]
            zero12_group(g, names_g, run.shapes, run.edp, [run.optims[r] for r in ranks], [run.osd[r] for r in ranks],
                         kinds, [extents[r] for r in ranks], tagdir)
    dense = [n for g, ns in enumerate(run.groups) if not run.is_expert[g] for n in ns] + p.frozen
    for r in range(dp):
        e = r % ep
        for g, names_g in enumerate(run.groups):
            step = group_state(run.osd[r], g, run.optim[r]).get("step")
            for n in names_g:
                extents[r][f"step/{n}"] = extent(run.optims[r], step, f.rel(run.optim[r]), f"step of group {g}", ())
                if run.is_expert[g]:
                    tf, ref, where = p.expert_refs[run.global_name(n, e)]
                    extents[r][f"param/{n}"] = extent(tf, ref, where, run.global_name(n, e), run.shapes[n])
        for n in dense:
            extents[r][f"param/{n}"] = extent(f.states, p.module.get(n), f.rel(f.states_name), n, p.params[n])
    return tuple(extents)


def _state(run: MoeRun, p: MoeParams) -> dict:
    return {"format": "deepspeed", "deepspeed": plain({k: v for k, v in run.at.ms.items() if k not in MOE_BULKY}),
            "optimizer": optimizer_state(run.stage, run.opt_groups, p.global_groups, run.osd[0].get("loss_scaler")),
            "moe": {"ep": run.ep, "edp": run.edp, "num_experts": run.counts,
                    "layers": {pre.rstrip("."): {"layer_file": run.files_of[pre], "num_experts": run.experts_of[pre],
                                                 "local_experts": run.local[pre]} for pre in run.prefixes}}}


def _expert_file(f: DsFolder, layer: int, expert: int) -> TorchFile:
    name = f"layer_{layer}_expert_{expert}_mp_rank_00_model_states.pt"
    if not os.path.isfile(os.path.join(f.folder, name)):
        raise ForeignFormatError(f"{f.folder} lacks {name}; num_experts in the model states says it is there")
    return f.open(name)


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
