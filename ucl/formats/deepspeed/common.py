"""What every DeepSpeed layout reader shares: file names, checks of pickled values, the flat
ZeRO-1/2 and ZeRO-3 groups (checked against DeepSpeed's own fragment records) and extents."""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from typing import Any

from ...errors import ForeignFormatError
from ...store.extents import Extent
from ..torchzip.read import read_torch_file, TensorRef, TorchFile
from ..torchzip.plain import plain

TAG = re.compile(r"^[A-Za-z0-9_.-]+$")
OPTIM = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
NAME = re.compile(r"^[A-Za-z0-9_][\w\-]*(\.[\w\-]+)*$")  # names the spec language can spell
ALIGN = 2  # DeepSpeed pads each ZeRO-1/2 group to a multiple of 2 * dp (nccl_start_alignment_factor)


def check_world(folder: str, names: tuple[str, ...], dp: int, mp: int, optimizer: bool = False) -> None:
    """``dp`` x ``mp`` ranks, as a model-states file says, against the files the folder holds, before
    anything is named per rank (dp_world_size=10**12 listed every rank: a MemoryError): each model-
    parallel rank writes a file, and with ZeRO optimizer files (``optimizer``: a layout that needs
    them) each rank does. A few missing files are named by the reader's own checks."""
    optim = sum(1 for n in names if OPTIM.match(n))
    if mp > len(names) or ((optim or optimizer) and dp * mp > len(names)):
        raise ForeignFormatError(f"{folder}: dp_world_size={dp:,} x mp_world_size={mp:,} ranks, but the folder holds "
                                 f"{len(names):,} file(s) ({optim:,} zero_pp_rank_*_optim_states.pt); the files "
                                 f"contradict what the rank-0 file says")


BULKY = {"module", "param_shapes", "frozen_param_shapes", "frozen_param_fragments", "optimizer",
          "universal_checkpoint_info"}


@dataclass(frozen=True)
class DsFolder:
    """A DeepSpeed tag folder and what its rank-0 model-states file says (every reader's input)."""
    path: str  # the checkpoint as given (a root with 'latest', or the tag folder)
    tag: str  # the tag folder relative to ``path`` ('' when ``path`` is one)
    names: tuple[str, ...]  # the tag folder's files, sorted
    states_name: str = ""
    states: TorchFile | None = None
    ms: dict = field(default_factory=dict)  # the model states
    dp: int = 0
    mp: int = 1

    @property
    def folder(self) -> str:
        return os.path.join(self.path, self.tag)

    @property
    def latest(self) -> tuple[str, ...]:
        """What was read to find the tag folder."""
        return ("latest",) if self.tag else ()

    def rel(self, name: str) -> str:
        return os.path.join(self.tag, name) if self.tag else name

    def open(self, name: str) -> TorchFile:
        return read_torch_file(os.path.join(self.folder, name), inside=self.path)


def optimizer_dict(tf: TorchFile, what: str) -> dict:
    """An optimizer file's ``optimizer_state_dict``."""
    return as_dict(as_dict(tf.obj, what).get("optimizer_state_dict"), f"{what}: optimizer_state_dict")


def optimizer_state(stage: int, param_groups: list, names: list[list[str]], loss_scaler: Any) -> dict:
    """The manifest state's ``optimizer``: the hyperparameters of each group and the names it trains."""
    kept = plain({"groups": [{k: v for k, v in g.items() if k != "params"} for g in param_groups],
                  "loss_scaler": loss_scaler})  # one call: one budget for all of them
    return {"zero_stage": stage, "param_groups": [{**g, "names": names[i] if i < len(names) else []}
                                                  for i, g in enumerate(kept["groups"])],
            "loss_scaler": kept["loss_scaler"]}


def step_extents(f: DsFolder, g: int, names: list[str], optims: list[TorchFile], osd: list[dict],
                 optim_names: list[str], extents: list[dict]) -> None:
    """Every parameter of group ``g`` gets the group's ``step``, on each dp rank of ``optims``."""
    for r, o in enumerate(osd):
        step = group_state(o, g, optim_names[r]).get("step")
        for n in names:
            extents[r][f"step/{n}"] = extent(optims[r], step, f.rel(optim_names[r]), f"step of group {g}", ())


def state_line(kinds: list[str], names: list[str], layout: str) -> str:
    pattern = "\n      | ".join(names)
    return f"state {', '.join(kinds)} for {pattern}\n    : {layout}"


def weight_dtype(module: dict, shapes: dict) -> str:
    dtypes = {t.dtype for n, t in module.items() if n in shapes and isinstance(t, TensorRef)}
    if len(dtypes) > 1:
        raise ForeignFormatError(f"the module's parameters have several dtypes ({sorted(dtypes)}); ucl reads one training dtype")
    return dtypes.pop() if dtypes else "float32"


def zero12_group(g: int, names: list[str], shapes: dict, dp: int, optims: list[TorchFile], osd: list[dict],
                  kinds: list[str], extents: list[dict], folder: str) -> None:
    sizes = [math.prod(shapes[n]) for n in names]
    total = sum(sizes)
    padded = -(-total // (ALIGN * dp)) * (ALIGN * dp)
    part = padded // dp
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    for r in range(dp):
        where = f"{os.path.basename(optims[r].path)} group {g}"
        o = osd[r]
        counts = o.get("partition_count")
        if counts is not None and as_list(counts, "partition_count")[g] != dp:
            raise ForeignFormatError(f"{where}: partition_count {counts[g]} is not dp_world_size {dp}")
        if any(any(int(x) for x in p) for p in [(o.get("param_alignment_paddings") or [[]] * (g + 1))[g]]):
            raise ForeignFormatError(f"{where}: parameters are aligned inside the flat buffer (param_alignment_paddings); "
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
                raise ForeignFormatError(f"{where}: DeepSpeed puts {bad!r} at (start, numel) {got.get(bad)} of the partition, "
                             f"but a buffer of the group's parameters in order, padded to a multiple of "
                             f"{ALIGN} * dp, puts it at {want.get(bad)}")
        base = group_state(o, g, where)
        rel = os.path.join(folder, os.path.basename(optims[r].path)) if folder else os.path.basename(optims[r].path)
        for kind in kinds:
            t = as_list(o.get("single_partition_of_fp32_groups"), "single_partition_of_fp32_groups")[g] \
                if kind == "fp32" else base.get(kind)
            # DeepSpeed saves the last partition's fp32 without its padding; the storage still has it
            extents[r][f"{kind}/@flat{g}"] = extent(optims[r], t, rel, f"{kind} of group {g}", (part,),
                                                     allow_longer=True)


def zero3_group(g: int, names: list[str], shapes: dict, dp: int, optims: list[TorchFile], osd: list[dict],
                 extents: list[dict], rels: list[str]) -> None:
    parts = [-(-math.prod(shapes[n]) // dp) for n in names]
    for r in range(dp):
        where = f"{rels[r]} group {g}"
        flat = as_list(osd[r].get("fp32_flat_groups"), "fp32_flat_groups")[g]
        base = group_state(osd[r], g, where)
        for kind, t in (("param", flat), ("exp_avg", base.get("exp_avg")), ("exp_avg_sq", base.get("exp_avg_sq"))):
            t = as_tensor(t, f"{kind} of group {g}")
            if t.shape != (sum(parts),):
                raise ForeignFormatError(f"{where}: {kind} holds {t.shape} elements, but the group's parameters split one by one "
                             f"over dp={dp} (ceil division) give {sum(parts)}")
            start = t.offset
            for n, p in zip(names, parts):
                piece = TensorRef(t.storage, start, (p,), (1,))
                extents[r][f"{kind}/{n}"] = extent(optims[r], piece, rels[r], f"{kind} of {n}", (p,))
                start += p


def group_state(o: dict, g: int, where: str) -> dict:
    base = o.get("base_optimizer_state") or o.get("optimizer_state_dict")
    state = as_dict(as_dict(base, f"{where}: base optimizer state").get("state"), f"{where}: optimizer state")
    return as_dict(state.get(g), f"{where}: optimizer state of group {g}")


def extent(tf: TorchFile, t: Any, rel: str, what: str, shape: tuple, allow_longer: bool = False) -> Extent:
    t = as_tensor(t, what)
    n = math.prod(shape)
    if tuple(t.shape) != tuple(shape):
        # a view shorter than the layout's piece is fine when its storage holds the rest (padding)
        if not (allow_longer and len(t.shape) == 1 and t.contiguous and t.offset + n <= t.storage.numel):
            raise ForeignFormatError(f"{tf.path}: {what} is {list(t.shape)}, the layout needs {list(shape)}")
        t = TensorRef(t.storage, t.offset, tuple(shape), (1,) * len(shape))
    return Extent(rel, tf.byte_offset(t), t.dtype, tuple(shape))


def as_tensor(t: Any, what: str) -> TensorRef:
    if not isinstance(t, TensorRef):
        raise ForeignFormatError(f"{what} is {type(t).__name__}, not a tensor")
    return t


def as_dict(x: Any, what: str) -> dict:
    if not isinstance(x, dict):
        raise ForeignFormatError(f"{what} is {type(x).__name__}, not a dict")
    return x


def as_list(x: Any, what: str) -> list:
    if not isinstance(x, (list, tuple)):
        raise ForeignFormatError(f"{what} is {type(x).__name__}, not a list")
    return list(x)
