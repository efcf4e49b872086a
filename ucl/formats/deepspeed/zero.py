"""DeepSpeed ZeRO-1/2/3 checkpoints without pipeline or tensor parallelism, and the dispatch to
the pipeline and AutoTP readers (the package doc says what the files hold)."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace

from ...errors import ForeignFormatError, StoreError
from ...files import read_bounded
from ...store.extents import Extent
from ..base import Description, UserSpec
from ..torchzip.read import TensorRef, TorchFile
from ..torchzip.plain import plain
from .common import (ALIGN, as_dict, as_list, as_tensor, BULKY, check_world, DsFolder, extent, NAME, optimizer_dict,
                     optimizer_state, OPTIM, state_line, step_extents, TAG, weight_dtype, zero12_group, zero3_group)
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


@dataclass(frozen=True)
class ZeroRun:
    """A ZeRO-1/2/3 checkpoint without pipeline or tensor parallelism: its optimizer files (per dp
    rank) and the parameters the model states name."""
    at: DsFolder
    optim: tuple[str, ...]  # file name per dp rank
    optims: tuple[TorchFile, ...]
    osd: tuple[dict, ...]  # each file's optimizer_state_dict
    stage: int
    groups: list[list[str]]  # trainable names per param group, in flattening order
    shapes: dict[str, tuple[int, ...]]
    frozen_shapes: dict[str, tuple[int, ...]]
    buffers: list[str]
    module: dict
    weights: str  # the training dtype

    @property
    def untrained(self) -> list[str]:
        return list(self.frozen_shapes) + self.buffers

    def shape(self, n: str) -> tuple[int, ...]:
        return self.shapes.get(n) or self.frozen_shapes.get(n) or tuple(as_tensor(self.module.get(n), n).shape)


def describe(path: str, user: UserSpec | None = None) -> Description:
    """``user``: the parameter placements of a tensor-parallel checkpoint whose files do not say them."""
    f = _locate(path)
    if any(n.startswith("layer_") for n in f.names) and not any(EXPERT_FILE.match(n) for n in f.names):
        _no_user(user, f.folder, "a pipeline checkpoint")
        return describe_pipeline(f)
    f = _read_states(f)
    if is_moe(f.names, f.ms):
        _no_user(user, f.folder, "an MoE checkpoint")
        return describe_moe(f)
    if f.mp != 1:
        uci = f.ms.get("universal_checkpoint_info")
        if isinstance(uci, dict) and isinstance(uci.get("affine_map"), dict):
            _no_user(user, f.folder, "an AutoTP checkpoint (DeepSpeed's affine_map places its shards)")
            return describe_autotp(f)
        if is_pattern_form(uci):  # Megatron-DeepSpeed's pattern table
            _no_user(user, f.folder, "a checkpoint whose universal_checkpoint_info patterns place its shards")
            return describe_mds(f)
        if user is not None:
            return describe_user(f, user)
        raise ForeignFormatError(f"{f.folder} is tensor-parallel (mp_world_size={f.mp}) without a universal_checkpoint_info ucl "
                     "reads (AutoTP's affine_map, or Megatron-DeepSpeed's parameter patterns) saying where each "
                     "rank's shard lies; its parameters' split dims are not in DeepSpeed's files: give them as a spec "
                     "(ucl import --spec SPEC --dims DIMS)")
    _no_user(user, f.folder, f"not tensor-parallel (mp_world_size={f.mp})")
    return _describe_zero(_read_zero(f))


def _locate(path: str) -> DsFolder:
    tag = _tag_folder(path)
    if tag is None:
        raise StoreError(f"{path} is not a DeepSpeed checkpoint (no 'latest' naming a tag folder, no "
                         "*model_states.pt)", code="UCL501")
    return DsFolder(path, tag, tuple(sorted(os.listdir(os.path.join(path, tag)))))


def _read_states(f: DsFolder) -> DsFolder:
    """``f`` with its rank-0 model states read and checked."""
    states_name = "mp_rank_00_model_states.pt" if "mp_rank_00_model_states.pt" in f.names else \
        "zero_pp_rank_0_mp_rank_00_model_states.pt"
    if states_name not in f.names:
        raise ForeignFormatError(f"{f.folder} has no mp_rank_00_model_states.pt or zero_pp_rank_0_mp_rank_00_model_states.pt")
    states = f.open(states_name)
    ms = as_dict(states.obj, states_name)
    dp, mp = ms.get("dp_world_size"), ms.get("mp_world_size", 1)
    if not isinstance(dp, int) or dp < 1:
        raise ForeignFormatError(f"{states_name} has no usable dp_world_size ({dp!r})")
    if isinstance(mp, int) and mp >= 1:
        check_world(f.folder, f.names, dp, mp)
    config = ms.get("ds_config") if isinstance(ms.get("ds_config"), dict) else {}
    zero_config = config.get("zero_optimization")
    if isinstance(zero_config, dict) and zero_config.get("round_robin_gradients"):
        raise ForeignFormatError(f"{f.folder} was written with zero_optimization.round_robin_gradients, which reorders each group's "
                    "parameters in the flat buffer against the order DeepSpeed records (param_shapes); ucl does not "
                    "read that layout (DeepSpeed's own zero_to_fp32 misreads it)")
    return replace(f, states_name=states_name, states=states, ms=ms, dp=dp, mp=mp)


def _optimizer_files(f: DsFolder) -> tuple[str, ...]:
    """The optimizer file of each dp rank."""
    optim = {}
    for n in f.names:
        m = OPTIM.match(n)
        if m:
            if int(m.group(3)) != 0:
                raise ForeignFormatError(f"{n}: model-parallel optimizer files are not read yet")
            optim[int(m.group(2))] = n
    if not optim and f.ms.get("optimizer") is not None:
        raise ForeignFormatError(f"{f.folder} is a ZeRO stage 0 checkpoint (the whole optimizer state inside {f.states_name}, no "
                    "zero_pp_rank_*_optim_states.pt files); ucl reads ZeRO stages 1-3. Its weights are "
                    f"torch.load('{f.states_name}')['module']")
    if len(optim) != f.dp or sorted(optim) != list(range(f.dp)):
        raise ForeignFormatError(f"{f.folder} should hold optimizer files for dp ranks 0..{f.dp - 1} (dp_world_size={f.dp}), "
                     f"found ranks {sorted(optim)}")
    return tuple(optim[r] for r in range(f.dp))


def _read_zero(f: DsFolder) -> ZeroRun:
    """The optimizer files and the parameters the model states name, checked."""
    optim = _optimizer_files(f)
    optims = tuple(f.open(n) for n in optim)
    osd = tuple(optimizer_dict(o, optim[r]) for r, o in enumerate(optims))
    stage = int(osd[0].get("zero_stage", 0))
    if stage == 0 and "single_partition_of_fp32_groups" in osd[0]:
        stage = 1  # BF16_Optimizer (bf16 with fp32 gradient accumulation): ZeRO-1's flat layout
    ms = f.ms
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
    return ZeroRun(f, optim, optims, osd, stage, groups, shapes, frozen_shapes, buffers, module,
                   weight_dtype(module, shapes))


def _describe_zero(z: ZeroRun) -> Description:
    f = z.at
    extents: list[dict[str, Extent]] = [{} for _ in range(f.dp)]
    spec: list[str] = [f"# generated by ucl from the DeepSpeed ZeRO-{z.stage} checkpoint {os.path.basename(f.path)}",
                       "mesh dp"]
    if z.stage in (1, 2):
        _zero12(z, spec, extents)
    elif z.stage == 3:
        _zero3(z, spec, extents)
    else:
        raise ForeignFormatError(f"{z.optim[0]}: zero_stage {z.stage!r} is not a ZeRO checkpoint ucl reads (stages 1, 2, 3)")
    spec.append("state step : scalar")
    for g, names_g in enumerate(z.groups):
        step_extents(f, g, names_g, list(z.optims), list(z.osd), list(z.optim), extents)
    params = {n: z.shapes[n] for g in z.groups for n in g}
    for n in z.untrained:
        params[n] = z.shape(n)
    spec += [f"{n} [{', '.join(str(x) for x in shape)}] : replicate" for n, shape in params.items()]
    files = tuple(f.rel(n) for n in z.optim)
    read = f.latest + (f.rel(f.states_name),) + files
    if z.stage == 3:  # frozen fragments and buffers come from every rank's model states
        read += tuple(f.rel(f"zero_pp_rank_{r}_mp_rank_00_model_states.pt") for r in range(1, f.dp))
    return Description("deepspeed", "\n".join(spec) + "\n", f"deepspeed-zero{z.stage}", {}, (("dp", f.dp),), params,
                       tuple(z.untrained), tuple(extents), files, _state(z), read)


def _state(z: ZeroRun) -> dict:
    groups = as_dict(z.osd[0].get("base_optimizer_state") or z.osd[0].get("optimizer_state_dict"),
                     "base optimizer state").get("param_groups", [])
    return {"format": "deepspeed",
            "deepspeed": plain({k: v for k, v in z.at.ms.items() if k not in BULKY}, values=z.at.states),
            "optimizer": optimizer_state(z.stage, groups, z.groups, z.osd[0].get("loss_scaler"))}


def _zero12(z: ZeroRun, spec: list[str], extents: list[dict[str, Extent]]) -> None:
    """ZeRO-1/2: the weights from the module, each group one flat buffer padded to 2 * dp."""
    f = z.at
    kinds = (["fp32"] if z.weights != "float32" else []) + ["exp_avg", "exp_avg_sq"]
    by_dtype: dict[str, list[str]] = {}
    for n in list(z.shapes) + z.untrained:
        by_dtype.setdefault(as_tensor(z.module.get(n), n).dtype, []).append(n)
    for dtype, names_d in by_dtype.items():  # the training dtype for all, others named
        spec.append(f"state param : dtype {dtype}" if dtype == z.weights
                    else state_line(["param"], names_d, f"dtype {dtype}"))
    for g, names_g in enumerate(z.groups):
        spec.append(state_line(kinds, names_g, f"flat over dp pad to multiple_of({ALIGN} * dp)"))
        zero12_group(g, names_g, z.shapes, f.dp, list(z.optims), list(z.osd), kinds, extents,
                     os.path.dirname(f.rel(z.optim[0])))
    for r in range(f.dp):
        for n in list(z.shapes) + z.untrained:
            extents[r][f"param/{n}"] = extent(f.states, z.module.get(n), f.rel(f.states_name), n, z.shape(n))


def _zero3(z: ZeroRun, spec: list[str], extents: list[dict[str, Extent]]) -> None:
    """ZeRO-3: each parameter split on its own (the fp32 master is ``param``); frozen fragments and
    buffers from every rank's model states."""
    f = z.at
    spec.append(state_line(["param", "exp_avg", "exp_avg_sq"], list(z.shapes), "flat over dp per_param"))
    per_rank = [f.open(f"zero_pp_rank_{r}_mp_rank_00_model_states.pt") for r in range(f.dp)]
    for g, names_g in enumerate(z.groups):
        zero3_group(g, names_g, z.shapes, f.dp, list(z.optims), list(z.osd), extents, [f.rel(n) for n in z.optim])
    if z.frozen_shapes:
        spec.append(state_line(["param"], list(z.frozen_shapes), f"dtype {z.weights}; flat over dp per_param"))
    for r in range(f.dp):
        where = f.rel(f"zero_pp_rank_{r}_mp_rank_00_model_states.pt")
        frags = as_dict(per_rank[r].obj, "model states").get("frozen_param_fragments") or {}
        for n, shape in z.frozen_shapes.items():
            part = -(-math.prod(shape) // f.dp)
            extents[r][f"param/{n}"] = extent(per_rank[r], frags.get(n), where, f"frozen fragment of {n}", (part,),
                                              allow_longer=True)
        for n in z.buffers:
            t = as_tensor(as_dict(per_rank[r].obj, "model states").get("module", {}).get(n), n)
            extents[r][f"param/{n}"] = extent(per_rank[r], t, where, n, tuple(t.shape))
            if t.dtype != "float32":
                raise ForeignFormatError(f"buffer {n!r} is {t.dtype}; ucl reads ZeRO-3 buffers in float32 only")


def _no_user(user: UserSpec | None, folder: str, what: str) -> None:
    if user is not None:
        raise ForeignFormatError(f"{folder} is {what}: DeepSpeed's files say where every shard lies, so ucl reads them and takes "
                     "no spec for the parameters (--spec is for tensor-parallel checkpoints without "
                     "universal_checkpoint_info)")
