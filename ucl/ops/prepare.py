"""From a checkpoint's manifest to what the operations need: the bound model, its layout, and
plans, all cached the way einops caches a recipe. Repeated ``load_rank`` calls on one checkpoint
parse, bind and compile once."""
from __future__ import annotations

import json
import os
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Mapping, NamedTuple

import numpy as np
import xxhash

from ..dtypes import storage_dtype, to_numpy
from ..errors import Diagnostic, StoreError, UclError, detach, group_diagnostics
from ..lang.spec import Spec
from ..layout.bind import Model
from ..layout.lower import lower
from ..layout.mesh import Mesh
from ..plan.compile import compile, compile_between
from ..plan.ir import Plan
from ..store.like import CheckpointLike
from ..store.manifest import MANIFEST_NAME
from ..store.reader import Checkpoint
from ..store.root import follow_latest
from .machine import check_plan_fits

if TYPE_CHECKING:
    from ..formats.base import UserSpec

_MODELS: OrderedDict[str, Model] = OrderedDict()  # manifest digest -> bound model
_MAX_MODELS = 8
_MAX_PLANS = 256  # per model: one-rank plans of a load loop, whole plans of reshards


def open_checkpoint(path: str | os.PathLike, format: str | None = None,
                    user: UserSpec | None = None) -> CheckpointLike:
    """Open a committed checkpoint for reading (lazy: rank files open on first use). A folder
    another framework wrote (DeepSpeed, DCP, Megatron, Hugging Face; ``format`` detected when
    None) opens read in place (docs/interop.md): the same reads, from the framework's own files;
    ``user``: the parameter placements its files do not record (``ops.convert.user_spec``).
    A checkpoint root (``latest`` + ``step_*``, as ``Checkpointer`` writes) opens the step its
    ``latest`` names."""
    if format in (None, "ucl"):
        path = resolve_root(path)
    if format in (None, "ucl") and (format == "ucl" or os.path.lexists(os.path.join(os.fspath(path), MANIFEST_NAME))):
        return Checkpoint.open(path)
    from ..formats.registry import open_foreign  # the format readers load only when a foreign folder is met
    return open_foreign(path, format, user)


def resolve_root(path: str | os.PathLike) -> str:
    """``path`` itself, or the step a checkpoint root's ``latest`` names now. An operation that opens
    its source more than once (a reshard's workers, an export's survey and reads) resolves it once
    first, so a trainer committing the next step meanwhile cannot mix two steps."""
    return follow_latest(path) or os.fspath(path)


def model_of(ckpt: CheckpointLike) -> Model:
    """The bound model a checkpoint was written with (spec text, dims, parameter shapes, frozen);
    checkpoints with the same spec, dims and parameters share one cached model."""
    m = ckpt.manifest
    if not m.spec or m.params is None:
        raise StoreError(f"{ckpt.path} carries no spec or parameter list; it cannot be resharded", code="UCL420")
    key = xxhash.xxh3_128_hexdigest(json.dumps([m.spec, m.spec_name, m.dims, m.params, sorted(m.frozen)],
                                               sort_keys=True).encode())
    model = _MODELS.get(key)
    if model is None:
        spec = Spec.from_text(m.spec, filename=f"{ckpt.path}/manifest.json[spec]", name=m.spec_name,
                              params=len(m.params), cache=True)
        model = _MODELS[key] = spec.bind(m.dims, m.params, m.frozen)
        while len(_MODELS) > _MAX_MODELS:
            _MODELS.popitem(last=False)
    _MODELS.move_to_end(key)
    return model


def forget() -> None:
    """Drop every cached model and plan (they are also dropped least recently used first)."""
    _MODELS.clear()


def mesh_of(ckpt: CheckpointLike) -> Mesh:
    """The layout a checkpoint is stored in."""
    return Mesh([(str(a), int(s)) for a, s in ckpt.manifest.mesh])


class _PlanKey(NamedTuple):
    src: Mesh
    dst: Mesh
    ranks: tuple[int, ...] | None  # sorted; None: every rank
    target: str | None = None  # another target model's digest (compile_between); None: the same model


@dataclass(frozen=True, eq=False)
class _Plans:
    """The plans compiled from one (source) model, least recently used first (at most _MAX_PLANS)."""

    plans: OrderedDict[_PlanKey, Plan] = field(default_factory=OrderedDict)

    def get(self, key: _PlanKey, make) -> Plan:
        plans = self.plans
        plan = plans.get(key)
        if plan is None:
            plan = plans[key] = make()
            while len(plans) > _MAX_PLANS:
                plans.popitem(last=False)
        plans.move_to_end(key)
        return plan


def _ranks_key(ranks) -> tuple[int, ...] | None:
    return None if ranks is None else tuple(sorted(int(r) for r in ranks))


def _fits(model: Model, src: Mesh, dst: Mesh, ranks) -> Model:
    """``model``, once a whole plan between ``src`` and ``dst`` is known to fit this machine
    (``machine.check_plan_fits``; a plan cut down to ``ranks`` is smaller)."""
    if ranks is None:
        check_plan_fits(model, src, dst)
    return model


def plan_for(model: Model, src: Mesh, dst: Mesh, ranks=None) -> Plan:
    """``compile(model, src, dst, ranks)``, cached on the model."""
    return model.derived.of(_Plans).get(_PlanKey(src, dst, _ranks_key(ranks)),
                                        lambda: compile(_fits(model, src, dst, ranks), src, dst, ranks=ranks))


def plan_between(source: Model, src: Mesh, model: Model, dst: Mesh, ranks=None) -> Plan:
    """``compile_between(source, src, model, dst, ranks)``, cached on the source model by the target
    model's spec, dims, parameters and frozen set (a resume into another layout compiles once)."""
    if model.spec.text == source.spec.text and model.fingerprint() == source.fingerprint():
        return plan_for(source, src, dst, ranks)
    target = xxhash.xxh3_128_hexdigest(json.dumps([model.spec.text, model.fingerprint()], sort_keys=True).encode())
    return source.derived.of(_Plans).get(_PlanKey(src, dst, _ranks_key(ranks), target),
                                         lambda: compile_between(_fits(source, src, dst, ranks), src, model, dst,
                                                                 ranks=ranks))


def manifest_fields(model: Model, mesh: Mesh, state: Any = None) -> dict:
    """The Manifest fields that describe ``model`` on ``mesh``."""
    return dict(spec=model.spec.text, spec_name=model.spec.name, dims=dict(model.dims), mesh=mesh.to_json(),
                params={n: list(s) for n, s in model.params.items()}, frozen=sorted(model.frozen),
                state=state if state is not None else {})


def expected_datasets(model: Model, mesh: Mesh, rank: int, stored: bool = False) -> dict[str, tuple[tuple, str]]:
    """key -> (shape, logical dtype) of every dataset ``rank`` holds on ``mesh``; ``stored``: of those
    it stores (a replicated dataset only on its first replica, format version 2)."""
    try:
        return lower(model, mesh).rank_datasets(rank, stored)
    except UclError as e:  # lowering translates internal exceptions: show the UclError alone
        raise detach(e) from None


def check_stored(ckpt: CheckpointLike, model: Model, ranks: Iterable[int] | None = None) -> None:
    """Before a byte of ``ranks`` (default: all) is read or anything is allocated for them: the
    datasets the manifest lists are exactly those the checkpoint's own spec and parameters put on
    each rank, with the same shapes and dtypes (an embedded spec edited to contradict the stored
    shapes, a parameter missing from ``params`` or a frozen one with optimizer state would
    otherwise be resharded into scrambled data or dropped), and each rank file really holds at
    least the bytes the manifest claims. Raises UCL417 naming every inconsistency, repeats grouped."""
    mesh = mesh_of(ckpt)
    ranks = range(ckpt.nranks) if ranks is None else sorted({int(r) for r in ranks})
    problems: list[Diagnostic] = []
    unaccounted: set[str] = set()
    once = stores_replicas_once(ckpt)
    for rank in ranks:
        # a replica is stored by its first holder only (version 2) or by every holder (1); an extra
        # replica is allowed either way (plans read the first holder's)
        held, have = expected_datasets(model, mesh, rank), ckpt.manifest.datasets[rank]
        want = expected_datasets(model, mesh, rank, stored=True) if once else held
        for key in sorted(set(have) - set(held)):
            problems.append(Diagnostic("UCL417", f"rank {rank} stores {key!r}, which the spec and parameter list "
                                                 "do not put there"))
            unaccounted.add(key)
        for key in sorted(set(want) - set(have)):
            problems.append(Diagnostic("UCL417", f"rank {rank} lacks {key!r} {list(want[key][0])} {want[key][1]} "
                                                 f"({_rule_of(model, key)})"))
        for key in sorted(set(held) & set(have)):
            shape, dtype = held[key]
            got = ckpt.info(rank, key)
            if got.shape != tuple(shape) or got.dtype != dtype:
                problems.append(Diagnostic("UCL417", f"rank {rank} stores {key!r} as {list(got.shape)} {got.dtype}, "
                                                     f"but the spec makes it {list(shape)} {dtype} "
                                                     f"({_rule_of(model, key)})"))
    if problems:
        lines = []
        for g in group_diagnostics(problems, limit=2):
            lines += [d.message for d in g.shown] + (["  " + g.more_line()] if g.more else [])
        frozen_with_state = sorted({k for k in unaccounted if k.partition("/")[0] != "param"
                                    and k.partition("/")[2] in model.frozen})
        if frozen_with_state:
            lines.append(f"hint: {frozen_with_state[0]!r} is optimizer state of a parameter the manifest marks "
                         "frozen; the manifest's 'frozen' list is wrong")
        elif unaccounted:
            lines.append("hint: a parameter missing from the manifest's 'params', or marked 'frozen' while it has "
                         "optimizer state, leaves stored datasets unaccounted for")
        n = len(problems)
        raise StoreError(f"{ckpt.path}: the stored datasets disagree with the checkpoint's own spec and parameter "
                         f"list ({n} problem{'s' * (n != 1)}); nothing was read:\n  " + "\n  ".join(lines),
                         code="UCL417")
    ckpt.check_files(ranks)


def stores_replicas_once(ckpt: CheckpointLike) -> bool:
    """Whether ``ckpt`` stores each replicated dataset on its first replica only (format version 2),
    rather than on every rank that holds it (version 1, and other frameworks' checkpoints read in place)."""
    return ckpt.manifest.version >= 2


def _tensor_of(model: Model, key: str):
    """A tensor of ``key``'s kind whose rule matches it (keys hold stage-local layer numbers)."""
    kind, _, local = key.partition("/")
    return next((t for t in model.tensors if t.kind == kind and (t.name == local or t.rule.pattern.match(local))),
                None)


def _flat_group_of(model: Model, key: str):
    kind, _, local = key.partition("/")
    number = local[len("@flat"):]
    return next((g for g in model.flat_groups if local.startswith("@flat") and g.kind == kind
                 and str(g.number) == number), None)


def _rule_of(model: Model, key: str) -> str:
    t = _tensor_of(model, key)
    if t is not None:
        return f"rule `{t.rule.pattern.text}` ({model.spec.filename}:{t.rule.span.line})"
    g = _flat_group_of(model, key)
    if g is not None:
        return f"the flat buffer of the `state` statement at {model.spec.filename}:{g.decl.span.line}"
    return "no rule"


def _state_line(model: Model, key: str) -> int | None:
    """Line of the ``state`` statement that gives ``key`` its dtype, if any."""
    t = _tensor_of(model, key)
    decl = t.state if t is not None else getattr(_flat_group_of(model, key), "decl", None)
    return decl.span.line if decl is not None else None


def normalise(model: Model, mesh: Mesh, rank: int, tensors: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """The arrays ``rank`` stores, in storage form, checked against the layout: names, shapes and
    dtypes. Every dataset the rank stores must be given; a replica it holds but another rank stores
    (format version 2) may be given, and is checked, not returned. Problems are
    reported at once, repeats grouped, with a hint for the usual causes (weights saved without
    optimizer state; a parameter dtype the spec does not declare)."""
    held, want = expected_datasets(model, mesh, rank), expected_datasets(model, mesh, rank, stored=True)
    problems: list[Diagnostic] = []
    missing = sorted(set(want) - set(tensors))
    retyped: list[tuple[str, str, str]] = []  # (key, got, expected): right shape, other dtype
    out = {}
    for key in missing:
        problems.append(Diagnostic("UCL421", f"missing {key!r} {list(want[key][0])} {want[key][1]} "
                                             f"({_rule_of(model, key)})"))
    for key in sorted(set(tensors) - set(held)):
        problems.append(Diagnostic("UCL421", f"unexpected {key!r}: the spec puts no such tensor on this rank"))
    for key in sorted(set(tensors) & set(held)):
        shape, dtype = held[key]
        if getattr(tensors[key], "is_meta", False):
            problems.append(Diagnostic("UCL421", f"{key!r} is on the meta device: it holds no data (materialise "
                                                 "the module, e.g. module.to_empty(device=...), and fill it first)"))
            continue
        arr, logical = to_numpy(tensors[key], dtype if _is_raw(tensors[key], dtype) else None)
        if tuple(arr.shape) != tuple(shape) or logical != dtype:
            problems.append(Diagnostic("UCL421", f"{key!r}: expected {list(shape)} {dtype}, got {list(arr.shape)} "
                                                 f"{logical} ({_rule_of(model, key)})"))
            if tuple(arr.shape) == tuple(shape):
                retyped.append((key, logical, dtype))
        if key in want:  # a replica another rank stores is checked, not kept
            out[key] = arr
    if problems:
        lines = []
        for g in group_diagnostics(problems, limit=1):
            lines += [d.message for d in g.shown] + (["  " + g.more_line()] if g.more else [])
        lines += [f"hint: {h}" for h in _hints(model, tensors, missing, retyped)]
        n = len(problems)
        raise StoreError(f"rank {rank} of {mesh}: the tensors do not match the spec ({n} problem{'s' * (n != 1)}):"
                         "\n  " + "\n  ".join(lines), code="UCL421")
    return out


def _hints(model: Model, tensors: Mapping[str, Any], missing: list[str], retyped: list[tuple[str, str, str]]):
    kinds_given = {k.partition("/")[0] for k in tensors}
    state_missing = sorted({k.partition("/")[0] for k in missing} - {"param"})
    if kinds_given <= {"param"} and state_missing:
        yield (f"only parameters were given, but the spec also expects optimizer state ({', '.join(state_missing)}). "
               "To save weights alone, bind with the parameters frozen so that no optimizer state is expected: "
               "spec.bind(dims, params, frozen=names)")
    found = {(key.partition("/")[0], got, expected) for key, got, expected in retyped}
    if len(found) == 1:
        (kind, got, expected), = found
        line = _state_line(model, retyped[0][0])
        if line is None:
            yield (f"the spec stores {kind} as {expected} (the default); if yours are {got}, declare it in the "
                   f"spec: `state {kind} : dtype {got}`")
        else:
            yield (f"the spec stores {kind} as {expected} (the `state` statement at {model.spec.filename}:{line}); "
                   f"to store {got}, write `dtype {got}` there, or convert the tensors to {expected}")
    elif found:
        yield "each kind's dtype comes from the spec's `state KIND : dtype DTYPE` statements (float32 when none)"


def _is_raw(value: Any, dtype: str) -> bool:
    # numpy arrays already in storage form (bf16/fp8 raw bits) are taken as the declared dtype
    return isinstance(value, np.ndarray) and value.dtype == storage_dtype(dtype)
