"""DeepSpeed ZeRO-1/2/3 checkpoints without pipeline or tensor parallelism, and the dispatch to
the pipeline and AutoTP readers (the package doc says what the files hold)."""
from __future__ import annotations

import math
import os

from ...errors import ForeignFormatError, StoreError
from ...files import read_bounded
from ...store.extents import Extent
from ..base import Description, UserSpec
from ..torchzip.read import TensorRef, plain, read_torch_file
from .common import (ALIGN, as_dict, as_list, as_tensor, BULKY, extent, group_state, NAME, OPTIM,
                     state_line, TAG, weight_dtype, zero12_group, zero3_group)
from .mds import describe_mds, is_pattern_form
from .moe import describe_moe, EXPERT_FILE, is_moe
from .pipeline import describe_pipeline
from .tp import describe_autotp
from .user import describe_user


def _tag_folder(path: str) -> str | None:
    """The tag folder's path relative to ``path`` ('' when ``path`` is one), or None."""
    if _has_model_states(path):
        return ""
    latest = os.path.join(path, "latest")
    if os.path.isfile(latest):
        tag = read_bounded(latest, limit=4096, what="DeepSpeed 'latest' file", inside=path,
                           error=lambda m: StoreError(m, code="UCL500")).decode("utf-8", "replace").strip()
        if TAG.match(tag) and tag not in (".", "..") and _has_model_states(os.path.join(path, tag)):
            return tag
    return None


def _has_model_states(folder: str) -> bool:
    try:
        return any(n.endswith("model_states.pt") for n in os.listdir(folder))
    except OSError:
        return False


def detect(path: str) -> bool:
    return _tag_folder(path) is not None


def describe(path: str, user: UserSpec | None = None) -> Description:
    """``user``: the parameter placements of a tensor-parallel checkpoint whose files do not say them."""
    tag = _tag_folder(path)
    if tag is None:
        raise StoreError(f"{path} is not a DeepSpeed checkpoint (no 'latest' naming a tag folder, no "
                         "*model_states.pt)", code="UCL501")
    folder = os.path.join(path, tag)
    names = sorted(os.listdir(folder))
    rel = lambda n: os.path.join(tag, n) if tag else n  # noqa: E731
    if any(n.startswith("layer_") for n in names) and not any(EXPERT_FILE.match(n) for n in names):
        _no_user(user, folder, "a pipeline checkpoint")
        return describe_pipeline(path, folder, names, rel)
    states_name = "mp_rank_00_model_states.pt" if "mp_rank_00_model_states.pt" in names else \
        "zero_pp_rank_0_mp_rank_00_model_states.pt"
    if states_name not in names:
        raise ForeignFormatError(f"{folder} has no mp_rank_00_model_states.pt or zero_pp_rank_0_mp_rank_00_model_states.pt")
    states = read_torch_file(os.path.join(folder, states_name), inside=path)
    ms = as_dict(states.obj, states_name)
    dp, mp = ms.get("dp_world_size"), ms.get("mp_world_size", 1)
    if not isinstance(dp, int) or dp < 1:
        raise ForeignFormatError(f"{states_name} has no usable dp_world_size ({dp!r})")
    config = ms.get("ds_config") if isinstance(ms.get("ds_config"), dict) else {}
    zero_config = config.get("zero_optimization")
    if isinstance(zero_config, dict) and zero_config.get("round_robin_gradients"):
        raise ForeignFormatError(f"{folder} was written with zero_optimization.round_robin_gradients, which reorders each group's "
                    "parameters in the flat buffer against the order DeepSpeed records (param_shapes); ucl does not "
                    "read that layout (DeepSpeed's own zero_to_fp32 misreads it)")
    if is_moe(names, ms):
        _no_user(user, folder, "an MoE checkpoint")
        return describe_moe(path, folder, names, rel, ms, states, states_name, dp)
    if mp != 1:
        uci = ms.get("universal_checkpoint_info")
        if isinstance(uci, dict) and isinstance(uci.get("affine_map"), dict):
            _no_user(user, folder, "an AutoTP checkpoint (DeepSpeed's affine_map places its shards)")
            return describe_autotp(path, folder, names, rel, ms, dp, mp)
        if is_pattern_form(uci):  # Megatron-DeepSpeed's pattern table
            _no_user(user, folder, "a checkpoint whose universal_checkpoint_info patterns place its shards")
            return describe_mds(path, folder, names, rel, ms, dp, mp)
        if user is not None:
            return describe_user(path, folder, names, rel, ms, dp, mp, user)
        raise ForeignFormatError(f"{folder} is tensor-parallel (mp_world_size={mp}) without a universal_checkpoint_info ucl "
                     "reads (AutoTP's affine_map, or Megatron-DeepSpeed's parameter patterns) saying where each "
                     "rank's shard lies; its parameters' split dims are not in DeepSpeed's files: give them as a spec "
                     "(ucl import --spec SPEC --dims DIMS)")
    _no_user(user, folder, f"not tensor-parallel (mp_world_size={mp})")
    optim = {}
    for n in names:
        m = OPTIM.match(n)
        if m:
            if int(m.group(3)) != 0:
                raise ForeignFormatError(f"{n}: model-parallel optimizer files are not read yet")
            optim[int(m.group(2))] = n
    if not optim and ms.get("optimizer") is not None:
        raise ForeignFormatError(f"{folder} is a ZeRO stage 0 checkpoint (the whole optimizer state inside {states_name}, no "
                    "zero_pp_rank_*_optim_states.pt files); ucl reads ZeRO stages 1-3. Its weights are "
                    f"torch.load('{states_name}')['module']")
    if sorted(optim) != list(range(dp)):
        raise ForeignFormatError(f"{folder} should hold optimizer files for dp ranks 0..{dp - 1} (dp_world_size={dp}), "
                     f"found ranks {sorted(optim)}")
    optims = [read_torch_file(os.path.join(folder, optim[r]), inside=path) for r in range(dp)]
    osd = [as_dict(as_dict(o.obj, optim[r]).get("optimizer_state_dict"), f"{optim[r]}: optimizer_state_dict")
           for r, o in enumerate(optims)]
    stage = int(osd[0].get("zero_stage", 0))
    if stage == 0 and "single_partition_of_fp32_groups" in osd[0]:
        stage = 1  # BF16_Optimizer (bf16 with fp32 gradient accumulation): ZeRO-1's flat layout
    groups = [list(g) for g in as_list(ms.get("param_shapes"), "param_shapes")]
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
        if not NAME.match(n):
            raise ForeignFormatError(f"parameter name {n!r} cannot be written in a spec")

    weights = weight_dtype(module, shapes)
    state = {"format": "deepspeed", "deepspeed": {k: plain(v, values=states) for k, v in ms.items() if k not in BULKY},
             "optimizer": {"zero_stage": stage, "param_groups": [
                 {**{k: plain(v) for k, v in g.items() if k != "params"}, "names": groups[i] if i < len(groups) else []}
                 for i, g in enumerate(as_dict(osd[0].get("base_optimizer_state") or osd[0].get("optimizer_state_dict"),
                                             "base optimizer state").get("param_groups", []))],
                 "loss_scaler": plain(osd[0].get("loss_scaler"))}}
    extents: list[dict[str, Extent]] = [{} for _ in range(dp)]
    spec: list[str] = [f"# generated by ucl from the DeepSpeed ZeRO-{stage} checkpoint {os.path.basename(path)}",
                       "mesh dp"]
    if stage in (1, 2):
        kinds = (["fp32"] if weights != "float32" else []) + ["exp_avg", "exp_avg_sq"]
        by_dtype: dict[str, list[str]] = {}
        for n in list(shapes) + list(frozen_shapes) + buffers:
            by_dtype.setdefault(as_tensor(module.get(n), n).dtype, []).append(n)
        for dtype, names_d in by_dtype.items():  # the training dtype for all, others named
            if dtype == weights:
                spec.append(f"state param : dtype {dtype}")
            else:
                spec.append(state_line(["param"], names_d, f"dtype {dtype}"))
        for g, names_g in enumerate(groups):
            spec.append(state_line(kinds, names_g, f"flat over dp pad to multiple_of({ALIGN} * dp)"))
            zero12_group(g, names_g, shapes, dp, optims, osd, kinds, extents, os.path.dirname(rel(optim[0])))
        for r in range(dp):
            for n in list(shapes) + list(frozen_shapes) + buffers:
                extents[r][f"param/{n}"] = extent(states, module.get(n), rel(states_name), n, shapes.get(n) or
                                                   frozen_shapes.get(n) or tuple(as_tensor(module.get(n), n).shape))
    elif stage == 3:
        spec.append(state_line(["param", "exp_avg", "exp_avg_sq"], list(shapes), "flat over dp per_param"))
        # ZeRO-3's model states files are per rank; their module holds the buffers whole
        per_rank = [read_torch_file(os.path.join(folder, f"zero_pp_rank_{r}_mp_rank_00_model_states.pt"), inside=path)
                    for r in range(dp)]
        for g, names_g in enumerate(groups):
            zero3_group(g, names_g, shapes, dp, optims, osd, extents, [rel(optim[r]) for r in range(dp)])
        if frozen_shapes:
            spec.append(state_line(["param"], list(frozen_shapes), f"dtype {weights}; flat over dp per_param"))
        for r in range(dp):
            frags = as_dict(per_rank[r].obj, "model states").get("frozen_param_fragments") or {}
            for n, shape in frozen_shapes.items():
                part = -(-math.prod(shape) // dp)
                extents[r][f"param/{n}"] = extent(per_rank[r], frags.get(n), rel(f"zero_pp_rank_{r}_mp_rank_00_model_states.pt"),
                                                   f"frozen fragment of {n}", (part,), allow_longer=True)
            for n in buffers:
                t = as_tensor(as_dict(per_rank[r].obj, "model states").get("module", {}).get(n), n)
                extents[r][f"param/{n}"] = extent(per_rank[r], t, rel(f"zero_pp_rank_{r}_mp_rank_00_model_states.pt"),
                                                   n, tuple(t.shape))
                if t.dtype != "float32":
                    raise ForeignFormatError(f"buffer {n!r} is {t.dtype}; ucl reads ZeRO-3 buffers in float32 only")
    else:
        raise ForeignFormatError(f"{optim[0]}: zero_stage {stage!r} is not a ZeRO checkpoint ucl reads (stages 1, 2, 3)")
    spec.append("state step : scalar")
    for r in range(dp):
        for g, names_g in enumerate(groups):
            step = group_state(osd[r], g, optim[r]).get("step")
            for n in names_g:
                extents[r][f"step/{n}"] = extent(optims[r], step, rel(optim[r]), f"step of group {g}", ())
    frozen = list(frozen_shapes) + buffers
    params = {n: shapes[n] for g in groups for n in g}
    for n in frozen:
        params[n] = frozen_shapes.get(n) or tuple(as_tensor(module.get(n), n).shape)
    for n, shape in params.items():
        spec.append(f"{n} [{', '.join(str(x) for x in shape)}] : replicate")
    read = (("latest",) if tag else ()) + (rel(states_name),) + tuple(rel(optim[r]) for r in range(dp))
    if stage == 3:  # frozen fragments and buffers come from every rank's model states
        read += tuple(rel(f"zero_pp_rank_{r}_mp_rank_00_model_states.pt") for r in range(1, dp))
    return Description("deepspeed", "\n".join(spec) + "\n", f"deepspeed-zero{stage}", {}, (("dp", dp),), params,
                       tuple(frozen), tuple(extents), tuple(rel(optim[r]) for r in range(dp)), state, read)


def _no_user(user: UserSpec | None, folder: str, what: str) -> None:
    if user is not None:
        raise ForeignFormatError(f"{folder} is {what}: DeepSpeed's files say where every shard lies, so ucl reads them and takes "
                     "no spec for the parameters (--spec is for tensor-parallel checkpoints without "
                     "universal_checkpoint_info)")
