"""DeepSpeed ZeRO checkpoints (``engine.save_checkpoint``), described for reading in place.

A checkpoint folder is a root holding ``latest`` (the tag) or the tag folder itself
(``global_step3``). What the files say, and how it becomes a spec:

* ``mp_rank_00_model_states.pt`` (ZeRO-1/2; ZeRO-3: ``zero_pp_rank_R_mp_rank_00_model_states.pt``):
  ``module`` (the state dict in training dtype; ZeRO-3 leaves empty placeholders), ``param_shapes``
  (per optimizer param group, the trainable parameters in flattening order), ``buffer_names``,
  ``shared_params`` (tied aliases), ``frozen_param_shapes`` / ``frozen_param_fragments`` (ZeRO-3),
  ``dp_world_size``, ``mp_world_size``, client state.
* ``[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt``: ZeRO-1/2 keep, per group, one fp32 buffer of
  the group's parameters concatenated, padded to a multiple of ``2 * dp`` and split evenly over dp
  (``single_partition_of_fp32_groups``, the Adam moments in ``base_optimizer_state``), with
  ``param_slice_mappings`` saying where each parameter's fragment lies; ZeRO-3 splits each
  parameter on its own (ceil division) and concatenates the pieces (``fp32_flat_groups``).

The generated spec says exactly that with ``flat over dp pad to multiple_of(2 * dp)`` (ZeRO-1/2)
or ``flat over dp per_param`` (ZeRO-3), one ``state ... for`` statement per param group; the
fragments DeepSpeed recorded are checked against the layout the spec lowers to. Kinds: ``param``
(the module's weights; ZeRO-3 stores none, there ``param`` is the fp32 master), ``fp32`` (the fp32
master of a bf16/fp16 ZeRO-1/2 run), ``exp_avg``, ``exp_avg_sq``, ``step`` (per group; every
parameter of the group gets it). Tied aliases are not stored twice: ``state['deepspeed']['shared_params']``
names them. Tensor- and pipeline-parallel DeepSpeed checkpoints are not read yet (UCL502).
"""
from __future__ import annotations

import math
import os
import re
from typing import Any

from ..errors import StoreError
from ..files import read_bounded
from ..store.extents import Extent
from .foreign import Description
from .torchfile import TensorRef, TorchFile, plain, read_torch_file

_TAG = re.compile(r"^[A-Za-z0-9_.-]+$")
_OPTIM = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_NAME = re.compile(r"^[A-Za-z0-9_][\w\-]*(\.[\w\-]+)*$")  # names the spec language can spell
_ALIGN = 2  # DeepSpeed pads each ZeRO-1/2 group to a multiple of 2 * dp (nccl_start_alignment_factor)


def _error(msg: str) -> StoreError:
    return StoreError(msg, code="UCL502")


def _tag_folder(path: str) -> str | None:
    """The tag folder's path relative to ``path`` ('' when ``path`` is one), or None."""
    if _has_model_states(path):
        return ""
    latest = os.path.join(path, "latest")
    if os.path.isfile(latest):
        tag = read_bounded(latest, limit=4096, what="DeepSpeed 'latest' file", inside=path,
                           error=lambda m: StoreError(m, code="UCL500")).decode("utf-8", "replace").strip()
        if _TAG.match(tag) and tag not in (".", "..") and _has_model_states(os.path.join(path, tag)):
            return tag
    return None


def _has_model_states(folder: str) -> bool:
    try:
        return any(n.endswith("model_states.pt") for n in os.listdir(folder))
    except OSError:
        return False


def detect(path: str) -> bool:
    return _tag_folder(path) is not None


def describe(path: str) -> Description:
    tag = _tag_folder(path)
    if tag is None:
        raise StoreError(f"{path} is not a DeepSpeed checkpoint (no 'latest' naming a tag folder, no "
                         "*model_states.pt)", code="UCL501")
    folder = os.path.join(path, tag)
    names = sorted(os.listdir(folder))
    rel = lambda n: os.path.join(tag, n) if tag else n  # noqa: E731
    if any(n.startswith("layer_") for n in names):
        return _describe_pipeline(path, folder, names, rel)
    states_name = "mp_rank_00_model_states.pt" if "mp_rank_00_model_states.pt" in names else \
        "zero_pp_rank_0_mp_rank_00_model_states.pt"
    if states_name not in names:
        raise _error(f"{folder} has no mp_rank_00_model_states.pt or zero_pp_rank_0_mp_rank_00_model_states.pt")
    states = read_torch_file(os.path.join(folder, states_name), inside=path)
    ms = _dict(states.obj, states_name)
    dp, mp = ms.get("dp_world_size"), ms.get("mp_world_size", 1)
    if not isinstance(dp, int) or dp < 1:
        raise _error(f"{states_name} has no usable dp_world_size ({dp!r})")
    if mp != 1:
        raise _error(f"{folder} is tensor-parallel (mp_world_size={mp}); its parameters' split dims are not in "
                     "DeepSpeed's files, so ucl cannot import it without a spec yet")
    optim = {}
    for n in names:
        m = _OPTIM.match(n)
        if m:
            if int(m.group(3)) != 0:
                raise _error(f"{n}: model-parallel optimizer files are not read yet")
            optim[int(m.group(2))] = n
    if sorted(optim) != list(range(dp)):
        raise _error(f"{folder} should hold optimizer files for dp ranks 0..{dp - 1} (dp_world_size={dp}), "
                     f"found ranks {sorted(optim)}")
    optims = [read_torch_file(os.path.join(folder, optim[r]), inside=path) for r in range(dp)]
    osd = [_dict(_dict(o.obj, optim[r]).get("optimizer_state_dict"), f"{optim[r]}: optimizer_state_dict")
           for r, o in enumerate(optims)]
    stage = int(osd[0].get("zero_stage", 0))
    if stage == 0 and "single_partition_of_fp32_groups" in osd[0]:
        stage = 1  # BF16_Optimizer (bf16 with fp32 gradient accumulation): ZeRO-1's flat layout
    groups = [list(g) for g in _list(ms.get("param_shapes"), "param_shapes")]
    shapes = {n: tuple(int(x) for x in s) for g in ms["param_shapes"] for n, s in g.items()}
    shared = {str(k): str(v) for k, v in (ms.get("shared_params") or {}).items()}
    buffers = [str(b) for b in ms.get("buffer_names") or []]
    module = ms.get("module") or {}
    if stage == 3:
        frozen_shapes = {n: tuple(int(x) for x in s) for n, s in (ms.get("frozen_param_shapes") or {}).items()}
    else:
        frozen_shapes = {n: tuple(t.shape) for n, t in module.items()
                         if n not in shapes and n not in shared and n not in buffers and isinstance(t, TensorRef)}
    for n in list(shapes) + list(frozen_shapes) + buffers:
        if not _NAME.match(n):
            raise _error(f"parameter name {n!r} cannot be written in a spec")

    weights = _weight_dtype(module, shapes)
    state = {"format": "deepspeed", "deepspeed": {k: plain(v) for k, v in ms.items() if k not in _BULKY},
             "optimizer": {"zero_stage": stage, "param_groups": [
                 {**{k: plain(v) for k, v in g.items() if k != "params"}, "names": groups[i] if i < len(groups) else []}
                 for i, g in enumerate(_dict(osd[0].get("base_optimizer_state") or osd[0].get("optimizer_state_dict"),
                                             "base optimizer state").get("param_groups", []))],
                 "loss_scaler": plain(osd[0].get("loss_scaler"))}}
    extents: list[dict[str, Extent]] = [{} for _ in range(dp)]
    spec: list[str] = [f"# generated by ucl from the DeepSpeed ZeRO-{stage} checkpoint {os.path.basename(path)}",
                       "mesh dp"]
    if stage in (1, 2):
        kinds = (["fp32"] if weights != "float32" else []) + ["exp_avg", "exp_avg_sq"]
        by_dtype: dict[str, list[str]] = {}
        for n in list(shapes) + list(frozen_shapes) + buffers:
            by_dtype.setdefault(_tensor(module.get(n), n).dtype, []).append(n)
        for dtype, names_d in by_dtype.items():  # the training dtype for all, others named
            if dtype == weights:
                spec.append(f"state param : dtype {dtype}")
            else:
                spec.append(_state_line(["param"], names_d, f"dtype {dtype}"))
        for g, names_g in enumerate(groups):
            spec.append(_state_line(kinds, names_g, f"flat over dp pad to multiple_of({_ALIGN} * dp)"))
            _zero12_group(g, names_g, shapes, dp, optims, osd, kinds, extents, os.path.dirname(rel(optim[0])))
        for r in range(dp):
            for n in list(shapes) + list(frozen_shapes) + buffers:
                extents[r][f"param/{n}"] = _extent(states, module.get(n), rel(states_name), n, shapes.get(n) or
                                                   frozen_shapes.get(n) or tuple(_tensor(module.get(n), n).shape))
    elif stage == 3:
        spec.append(_state_line(["param", "exp_avg", "exp_avg_sq"], list(shapes), "flat over dp per_param"))
        # ZeRO-3's model states files are per rank; their module holds the buffers whole
        per_rank = [read_torch_file(os.path.join(folder, f"zero_pp_rank_{r}_mp_rank_00_model_states.pt"), inside=path)
                    for r in range(dp)]
        for g, names_g in enumerate(groups):
            _zero3_group(g, names_g, shapes, dp, optims, osd, extents, [rel(optim[r]) for r in range(dp)])
        if frozen_shapes:
            spec.append(_state_line(["param"], list(frozen_shapes), f"dtype {weights}; flat over dp per_param"))
        for r in range(dp):
            frags = _dict(per_rank[r].obj, "model states").get("frozen_param_fragments") or {}
            for n, shape in frozen_shapes.items():
                part = -(-math.prod(shape) // dp)
                extents[r][f"param/{n}"] = _extent(per_rank[r], frags.get(n), rel(f"zero_pp_rank_{r}_mp_rank_00_model_states.pt"),
                                                   f"frozen fragment of {n}", (part,), allow_longer=True)
            for n in buffers:
                t = _tensor(_dict(per_rank[r].obj, "model states").get("module", {}).get(n), n)
                extents[r][f"param/{n}"] = _extent(per_rank[r], t, rel(f"zero_pp_rank_{r}_mp_rank_00_model_states.pt"),
                                                   n, tuple(t.shape))
                if t.dtype != "float32":
                    raise _error(f"buffer {n!r} is {t.dtype}; ucl reads ZeRO-3 buffers in float32 only")
    else:
        raise _error(f"{optim[0]}: zero_stage {stage!r} is not a ZeRO checkpoint ucl reads (stages 1, 2, 3)")
    spec.append("state step : scalar")
    for r in range(dp):
        for g, names_g in enumerate(groups):
            step = _group_state(osd[r], g, optim[r]).get("step")
            for n in names_g:
                extents[r][f"step/{n}"] = _extent(optims[r], step, rel(optim[r]), f"step of group {g}", ())
    frozen = list(frozen_shapes) + buffers
    params = {n: shapes[n] for g in groups for n in g}
    for n in frozen:
        params[n] = frozen_shapes.get(n) or tuple(_tensor(module.get(n), n).shape)
    for n, shape in params.items():
        spec.append(f"{n} [{', '.join(str(x) for x in shape)}] : replicate")
    read = (("latest",) if tag else ()) + (rel(states_name),) + tuple(rel(optim[r]) for r in range(dp))
    if stage == 3:  # frozen fragments and buffers come from every rank's model states
        read += tuple(rel(f"zero_pp_rank_{r}_mp_rank_00_model_states.pt") for r in range(1, dp))
    return Description("deepspeed", "\n".join(spec) + "\n", f"deepspeed-zero{stage}", {}, (("dp", dp),), params,
                       tuple(frozen), tuple(extents), tuple(rel(optim[r]) for r in range(dp)), state, read)


_LAYER = re.compile(r"^layer_(\d+)-model_states\.pt$")


def _describe_pipeline(path: str, folder: str, names: list[str], rel) -> Description:
    """A PipelineModule checkpoint (ZeRO-0/1, tp=1): ``mp_rank_SS_model_states.pt`` per stage (its
    parameters per group, named ``<layer>.<name>`` or ``tied_modules.<key>.<name>``),
    ``layer_LL-model_states.pt`` per layer (the layer's own state dict: the weights), and per
    (dp rank, stage) ``zero_pp_rank_R_mp_rank_SS_optim_states.pt``. Mesh ``pp, dp``; each
    parameter ``on pp =`` the stages that train it (a tied module: all of its stages, each with its
    own optimizer state); each stage's groups are flat buffers as without a pipeline."""
    first = _dict(read_torch_file(os.path.join(folder, "mp_rank_00_model_states.pt"), inside=path).obj,
                  "mp_rank_00_model_states.pt")
    dp, mp = first.get("dp_world_size"), first.get("mp_world_size", 1)
    dims = first.get("checkpoint_parallel_dimensions") or {}
    pp = dims.get("pp_degree", mp)
    if not all(isinstance(x, int) and x >= 1 for x in (dp, mp, pp)) or mp != pp:
        raise _error(f"{folder}: a pipeline checkpoint with dp={dp!r}, mp_world_size={mp!r}, pp_degree={pp!r}; ucl "
                     "reads pipeline checkpoints without tensor parallelism (mp_world_size == pp_degree)")
    stages = [read_torch_file(os.path.join(folder, f"mp_rank_{s:02d}_model_states.pt"), inside=path) for s in range(pp)]
    layers = {int(m.group(1)): read_torch_file(os.path.join(folder, n), inside=path)
              for n in names if (m := _LAYER.match(n))}
    optim_names = [[f"zero_pp_rank_{r}_mp_rank_{s:02d}_optim_states.pt" for r in range(dp)] for s in range(pp)]
    for row in optim_names:
        for n in row:
            if n not in names:
                raise _error(f"{folder} lacks {n} (dp={dp}, pp={pp}); a pipeline checkpoint needs one optimizer file "
                             "per dp rank and stage")
    optims = [[read_torch_file(os.path.join(folder, n), inside=path) for n in row] for row in optim_names]
    osd = [[_dict(_dict(o.obj, o.path).get("optimizer_state_dict"), f"{o.path}: optimizer_state_dict") for o in row]
           for row in optims]
    if any(int(o.get("zero_stage", 0)) not in (0, 1) or "single_partition_of_fp32_groups" not in o for row in osd for o in row):
        raise _error(f"{folder}: ucl reads pipeline checkpoints with ZeRO stage 0/1 flat optimizer state only")
    groups_by_stage = [[list(g) for g in _list(_dict(st.obj, st.path).get("param_shapes"), "param_shapes")]
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
            hits = [i for i in tied_files if local in _dict(layers[i].obj, layers[i].path)]
            if len(hits) != 1:
                raise _error(f"{folder}: cannot tell which layer file holds the tied parameter {n!r} (candidates: "
                             f"{[f'layer_{i:02d}' for i in hits]})")
            where[n] = (hits[0], local)
        else:
            raise _error(f"{folder}: pipeline parameter {n!r} is neither '<layer>.<name>' nor 'tied_modules.<key>.<name>'")
    buffers = list(dict.fromkeys(str(b) for st in stages for b in (st.obj.get("buffer_names") or [])))
    frozen: list[str] = []
    for i in sorted(layers):  # what the layer files hold beyond the trained parameters
        prefix = f"{i}." if i in numbered else next(
            (n[:-len(loc)] for n, (j, loc) in where.items() if j == i), None)
        if prefix is None:
            raise _error(f"{folder}: layer_{i:02d} holds no parameter any stage trains; ucl cannot place it")
        for local, t in _dict(layers[i].obj, layers[i].path).items():
            name = prefix + local
            if name not in where:
                where[name] = (i, local)
                frozen.append(name) if name not in buffers else None
                owner = next(n for n, (j, _) in where.items() if j == i and n in placed)
                placed[name] = placed[owner]
    frozen += [b for b in buffers if b in where]
    extents: list[dict[str, Extent]] = [{} for _ in range(pp * dp)]
    weights = {where[n][0] for n in order}
    dtypes = {_tensor(layers[where[n][0]].obj.get(where[n][1]), n).dtype for n in order}
    if len(dtypes) != 1 or not weights:
        raise _error(f"{folder}: the pipeline's parameters have several dtypes {sorted(dtypes)}")
    dtype = dtypes.pop()
    kinds = (["fp32"] if dtype != "float32" else []) + ["exp_avg", "exp_avg_sq"]
    spec = [f"# generated by ucl from the DeepSpeed pipeline checkpoint {os.path.basename(path)}", "mesh pp, dp",
            f"state param : dtype {dtype}"]
    for n in frozen:
        t = _tensor(layers[where[n][0]].obj.get(where[n][1]), n)
        if t.dtype != dtype:
            spec.append(_state_line(["param"], [n], f"dtype {t.dtype}"))
    ngroups = max(len(g) for g in groups_by_stage)
    for g in range(ngroups):
        members = [n for n in order if any(g < len(gs) and n in gs[g] for gs in groups_by_stage)]
        spec.append(_state_line(kinds, members, f"flat over dp pad to multiple_of({_ALIGN} * dp)"))
    spec.append("state step : scalar")
    for s in range(pp):
        mine = extents[s * dp:(s + 1) * dp]
        for g, names_g in enumerate(groups_by_stage[s]):
            if [n for n in order if n in names_g] != names_g:
                raise _error(f"{folder}: stage {s} flattens group {g} in an order no global parameter order gives")
            _zero12_group(g, names_g, shapes, dp, optims[s], osd[s], kinds, mine, os.path.dirname(rel("x")))
            for r in range(dp):
                step = _group_state(osd[s][r], g, optim_names[s][r]).get("step")
                for n in names_g:
                    mine[r][f"step/{n}"] = _extent(optims[s][r], step, rel(optim_names[s][r]), f"step of group {g}", ())
        for n in list(order) + frozen:
            if s in placed[n]:
                i, local = where[n]
                t = _tensor(layers[i].obj.get(local), n)
                for r in range(dp):
                    mine[r][f"param/{n}"] = _extent(layers[i], t, rel(f"layer_{i:02d}-model_states.pt"), n, tuple(t.shape))
    params: dict[str, tuple] = {}
    for n in list(order) + frozen:
        i, local = where[n]
        params[n] = tuple(_tensor(layers[i].obj.get(local), n).shape)
        # first/last rather than 0/pp-1: the spec then also describes a layout with fewer stages
        stages_n = ", ".join("first" if s == 0 else "last" if s == pp - 1 else str(s) for s in placed[n])
        spec.append(f"{n} [{', '.join(str(x) for x in params[n])}] : on pp = {stages_n}")
    state = {"format": "deepspeed", "deepspeed": {k: plain(v) for k, v in first.items() if k not in _BULKY},
             "optimizer": {"zero_stage": 1, "param_groups": [
                 {**{k: plain(v) for k, v in g.items() if k != "params"},
                  "names": [n for n in order if any(i < len(gs) and n in gs[i] for gs in groups_by_stage)]}
                 for i, g in enumerate(_dict(osd[0][0].get("base_optimizer_state"), "base optimizer state")
                                       .get("param_groups", []))],
                 "loss_scaler": plain(osd[0][0].get("loss_scaler"))},
             "pipeline": {"layer_files": {n: f"layer_{where[n][0]:02d}" for n in params}}}
    read = tuple(rel(f"mp_rank_{s:02d}_model_states.pt") for s in range(pp)) + \
        tuple(rel(n) for n in names if _LAYER.match(n)) + tuple(rel(n) for row in optim_names for n in row)
    files = tuple(rel(optim_names[s][r]) for s in range(pp) for r in range(dp))
    return Description("deepspeed", "\n".join(spec) + "\n", "deepspeed-pipeline", {}, (("pp", pp), ("dp", dp)),
                       params, tuple(frozen), tuple(extents), files, state, read)


_BULKY = {"module", "param_shapes", "frozen_param_shapes", "frozen_param_fragments", "optimizer"}


def _state_line(kinds: list[str], names: list[str], layout: str) -> str:
    pattern = "\n      | ".join(names)
    return f"state {', '.join(kinds)} for {pattern}\n    : {layout}"


def _weight_dtype(module: dict, shapes: dict) -> str:
    dtypes = {t.dtype for n, t in module.items() if n in shapes and isinstance(t, TensorRef)}
    if len(dtypes) > 1:
        raise _error(f"the module's parameters have several dtypes ({sorted(dtypes)}); ucl reads one training dtype")
    return dtypes.pop() if dtypes else "float32"


def _zero12_group(g: int, names: list[str], shapes: dict, dp: int, optims: list[TorchFile], osd: list[dict],
                  kinds: list[str], extents: list[dict], folder: str) -> None:
    sizes = [math.prod(shapes[n]) for n in names]
    total = sum(sizes)
    padded = -(-total // (_ALIGN * dp)) * (_ALIGN * dp)
    part = padded // dp
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    for r in range(dp):
        where = f"{os.path.basename(optims[r].path)} group {g}"
        o = osd[r]
        counts = o.get("partition_count")
        if counts is not None and _list(counts, "partition_count")[g] != dp:
            raise _error(f"{where}: partition_count {counts[g]} is not dp_world_size {dp}")
        if any(any(int(x) for x in p) for p in [(o.get("param_alignment_paddings") or [[]] * (g + 1))[g]]):
            raise _error(f"{where}: parameters are aligned inside the flat buffer (param_alignment_paddings); "
                         "ucl does not read that layout yet")
        # DeepSpeed's own record of where each fragment is must be the layout the spec lowers to
        mapping = (o.get("param_slice_mappings") or [None] * (g + 1))[g]
        if mapping is not None:
            lo, hi = r * part, (r + 1) * part
            want = {n: (max(s, lo) - lo, min(s + z, hi) - max(s, lo)) for n, s, z in zip(names, starts, sizes)
                    if s < hi and s + z > lo}
            got = {str(n): (int(a.get("start")), int(a.get("numel"))) for n, a in mapping.items()}
            if got != want:
                bad = next(n for n in sorted(set(got) | set(want)) if got.get(n) != want.get(n))
                raise _error(f"{where}: DeepSpeed puts {bad!r} at (start, numel) {got.get(bad)} of the partition, "
                             f"but a buffer of the group's parameters in order, padded to a multiple of "
                             f"{_ALIGN} * dp, puts it at {want.get(bad)}")
        base = _group_state(o, g, where)
        rel = os.path.join(folder, os.path.basename(optims[r].path)) if folder else os.path.basename(optims[r].path)
        for kind in kinds:
            t = _list(o.get("single_partition_of_fp32_groups"), "single_partition_of_fp32_groups")[g] \
                if kind == "fp32" else base.get(kind)
            # DeepSpeed saves the last partition's fp32 without its padding; the storage still has it
            extents[r][f"{kind}/@flat{g}"] = _extent(optims[r], t, rel, f"{kind} of group {g}", (part,),
                                                     allow_longer=True)


def _zero3_group(g: int, names: list[str], shapes: dict, dp: int, optims: list[TorchFile], osd: list[dict],
                 extents: list[dict], rels: list[str]) -> None:
    parts = [-(-math.prod(shapes[n]) // dp) for n in names]
    for r in range(dp):
        where = f"{rels[r]} group {g}"
        flat = _list(osd[r].get("fp32_flat_groups"), "fp32_flat_groups")[g]
        base = _group_state(osd[r], g, where)
        for kind, t in (("param", flat), ("exp_avg", base.get("exp_avg")), ("exp_avg_sq", base.get("exp_avg_sq"))):
            t = _tensor(t, f"{kind} of group {g}")
            if t.shape != (sum(parts),):
                raise _error(f"{where}: {kind} holds {t.shape} elements, but the group's parameters split one by one "
                             f"over dp={dp} (ceil division) give {sum(parts)}")
            start = t.offset
            for n, p in zip(names, parts):
                piece = TensorRef(t.storage, start, (p,), (1,))
                extents[r][f"{kind}/{n}"] = _extent(optims[r], piece, rels[r], f"{kind} of {n}", (p,))
                start += p


def _group_state(o: dict, g: int, where: str) -> dict:
    base = o.get("base_optimizer_state") or o.get("optimizer_state_dict")
    state = _dict(_dict(base, f"{where}: base optimizer state").get("state"), f"{where}: optimizer state")
    return _dict(state.get(g), f"{where}: optimizer state of group {g}")


def _extent(tf: TorchFile, t: Any, rel: str, what: str, shape: tuple, allow_longer: bool = False) -> Extent:
    t = _tensor(t, what)
    n = math.prod(shape)
    if tuple(t.shape) != tuple(shape):
        # a view shorter than the layout's piece is fine when its storage holds the rest (padding)
        if not (allow_longer and len(t.shape) == 1 and t.contiguous and t.offset + n <= t.storage.numel):
            raise _error(f"{tf.path}: {what} is {list(t.shape)}, the layout needs {list(shape)}")
        t = TensorRef(t.storage, t.offset, tuple(shape), (1,) * len(shape))
    return Extent(rel, tf.byte_offset(t), t.dtype, tuple(shape))


def _tensor(t: Any, what: str) -> TensorRef:
    if not isinstance(t, TensorRef):
        raise _error(f"{what} is {type(t).__name__}, not a tensor")
    return t


def _dict(x: Any, what: str) -> dict:
    if not isinstance(x, dict):
        raise _error(f"{what} is {type(x).__name__}, not a dict")
    return x


def _list(x: Any, what: str) -> list:
    if not isinstance(x, (list, tuple)):
        raise _error(f"{what} is {type(x).__name__}, not a list")
    return list(x)
