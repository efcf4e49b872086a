"""From a checkpoint's manifest to what the operations need: the bound model, its layout, and
plans, all cached the way einops caches a recipe. Repeated ``load_rank`` calls on one checkpoint
parse, bind and compile once."""
from __future__ import annotations

import json
import os
from collections import OrderedDict
from typing import Any, Mapping

import numpy as np
import xxhash

from ..dtypes import storage_dtype, to_numpy
from ..errors import StoreError
from ..lang.spec import Spec
from ..layout.bind import Model
from ..layout.lower import lower
from ..layout.mesh import Mesh
from ..plan.compile import compile
from ..plan.ir import Plan
from ..store.reader import Checkpoint

_MODELS: OrderedDict[str, Model] = OrderedDict()  # manifest digest -> bound model
_MAX_MODELS = 8
_MAX_PLANS = 256  # per model: one-rank plans of a load loop, whole plans of reshards


def open_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """Open a committed checkpoint for reading (lazy: rank files open on first use)."""
    return Checkpoint.open(path)


def model_of(ckpt: Checkpoint) -> Model:
    """The bound model a checkpoint was written with (spec text, dims, parameter shapes, frozen);
    checkpoints with the same spec, dims and parameters share one cached model."""
    m = ckpt.manifest
    if not m.spec or m.params is None:
        raise StoreError(f"{ckpt.path} carries no spec or parameter list; it cannot be resharded", code="UCL420")
    key = xxhash.xxh3_128_hexdigest(json.dumps([m.spec, m.spec_name, m.dims, m.params, sorted(m.frozen)],
                                               sort_keys=True).encode())
    model = _MODELS.get(key)
    if model is None:
        spec = Spec.from_text(m.spec, filename=f"{ckpt.path}/manifest.json[spec]", name=m.spec_name)
        model = _MODELS[key] = spec.bind(m.dims, m.params, m.frozen)
        while len(_MODELS) > _MAX_MODELS:
            _MODELS.popitem(last=False)
    _MODELS.move_to_end(key)
    return model


def forget() -> None:
    """Drop every cached model and plan (they are also dropped least recently used first)."""
    _MODELS.clear()


def mesh_of(ckpt: Checkpoint) -> Mesh:
    """The layout a checkpoint is stored in."""
    return Mesh([(str(a), int(s)) for a, s in ckpt.manifest.mesh])


def plan_for(model: Model, src: Mesh, dst: Mesh, ranks=None) -> Plan:
    """``compile(model, src, dst, ranks)``, cached on the model."""
    key = ("plan", src, dst, None if ranks is None else tuple(sorted(int(r) for r in ranks)))
    plans = model.memo.setdefault("plans", OrderedDict())
    plan = plans.get(key)
    if plan is None:
        plan = plans[key] = compile(model, src, dst, ranks=ranks)
        while len(plans) > _MAX_PLANS:
            plans.popitem(last=False)
    plans.move_to_end(key)
    return plan


def manifest_fields(model: Model, mesh: Mesh, state: Any = None) -> dict:
    """The Manifest fields that describe ``model`` on ``mesh``."""
    return dict(spec=model.spec.text, spec_name=model.spec.name, dims=dict(model.dims), mesh=mesh.to_json(),
                params={n: list(s) for n, s in model.params.items()}, frozen=sorted(model.frozen),
                state=state if state is not None else {})


def expected_datasets(model: Model, mesh: Mesh, rank: int) -> dict[str, tuple[tuple, str]]:
    """key -> (shape, logical dtype) of every dataset ``rank`` must hold on ``mesh``."""
    return lower(model, mesh).rank_datasets(rank)


def _rule_of(model: Model, key: str) -> str:
    kind, _, local = key.partition("/")
    for t in model.tensors:
        if t.kind == kind and (t.name == local or t.rule.pattern.match(local)):
            r = t.rule
            return f"rule `{r.pattern.text}` ({model.spec.filename}:{r.span.line})"
    return "no rule"


def normalise(model: Model, mesh: Mesh, rank: int, tensors: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Arrays in storage form, checked against the layout: names, shapes and dtypes."""
    want = expected_datasets(model, mesh, rank)
    problems, out = [], {}
    for key in sorted(set(want) - set(tensors)):
        problems.append(f"missing {key} {list(want[key][0])} {want[key][1]} ({_rule_of(model, key)})")
    for key in sorted(set(tensors) - set(want)):
        problems.append(f"unexpected {key}: the spec puts no such tensor on rank {rank} of {mesh}")
    for key in sorted(set(tensors) & set(want)):
        shape, dtype = want[key]
        arr, logical = to_numpy(tensors[key], dtype if _is_raw(tensors[key], dtype) else None)
        if tuple(arr.shape) != tuple(shape) or logical != dtype:
            problems.append(f"{key}: expected {list(shape)} {dtype}, got {list(arr.shape)} {logical} "
                            f"({_rule_of(model, key)}, mesh {mesh}, rank {rank})")
        out[key] = arr
    if problems:
        raise StoreError(f"rank {rank}'s tensors do not match the spec:\n  " + "\n  ".join(problems), code="UCL421")
    return out


def _is_raw(value: Any, dtype: str) -> bool:
    # numpy arrays already in storage form (bf16/fp8 raw bits) are taken as the declared dtype
    return isinstance(value, np.ndarray) and value.dtype == storage_dtype(dtype)
