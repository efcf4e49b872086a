"""What a training job holds, as ucl sees it: every parameter (by FQN), buffer and optimizer state,
the spec that lays them out, the mesh and this process's rank in it.

Plain modules (one process, or DDP replicas) are stored in the universal layout: whole tensors, one
rank file, written by rank 0. DTensor modules (FSDP2 ``fully_shard``, TP ``parallelize_module``,
both with ``_StridedShard``) give their placements and ``DeviceMesh`` dim names; each rank writes
its ``to_local()`` shards. A user spec (Megatron-style manual layouts) names the module's own
parameters as rank-local tensors.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from ..dtypes import logical_of_torch_dtype
from ..errors import UclError
from ..layout.mesh import UNIVERSAL, Mesh
from ..ops.dist import initialized_dist

PARAM = "param"


@dataclass(frozen=True)
class Entry:
    """One dataset this rank stores: ``KIND/NAME`` and the live tensor it is copied from."""

    key: str
    tensor: Any  # a torch.Tensor (the local shard of a DTensor)
    eager: bool = False  # buffers may change in forward: copied inside save(), not lazily


@dataclass(frozen=True)
class TrainLayout:
    """The spec, dims, parameters and mesh of one snapshot, and this rank's entries."""

    spec_text: str
    dims: dict[str, int]
    params: dict[str, tuple[int, ...]]  # global FQN -> global shape, model order
    frozen: tuple[str, ...]
    mesh: Mesh
    rank: int  # this process's rank on ``mesh`` (-1: it stores nothing, e.g. a DDP replica)
    entries: tuple[Entry, ...]
    kinds: tuple[str, ...]
    signature: tuple = field(compare=False, default=())

    @property
    def writes(self) -> bool:
        return self.rank >= 0


def _is_dtensor(t) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    return isinstance(t, DTensor)


def generic(name: str) -> str:
    """A pattern for ``name`` with numbered segments (layer, expert) as ``*``."""
    return re.sub(r"(?<![^.])\d+(?=\.|$)", "*", name)


def _patterns(groups: dict[str, list[str]]) -> dict[str, list[str]]:
    """Patterns per group of names: ``**`` for a single group; else each name's generic form where
    that form covers names of its own group only, the exact name where it does not."""
    if len(groups) == 1:
        return {next(iter(groups)): ["**"]}
    owners: dict[str, set[str]] = {}
    for value, names in groups.items():
        for n in names:
            owners.setdefault(generic(n), set()).add(value)
    out = {}
    for value, names in groups.items():
        out[value] = sorted({generic(n) if len(owners[generic(n)]) == 1 else n for n in names})
    return out


def _placement_rule(t, axes: list[str]) -> str:
    """The transforms of a DTensor's placements: DTensor applies them in mesh-dim order, except that
    a ``_StridedShard`` (FSDP2 over TP) chunks the TP-local tensor, so it comes after the others."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard  # DTensor's own FSDP2xTP marker
    first, later = [], []
    for axis, p in zip(axes, t.placements):
        if isinstance(p, _StridedShard):
            later.append(f"split {p.dim} over {axis} uneven")
        elif isinstance(p, Shard):
            first.append(f"split {p.dim} over {axis} uneven")
        elif not isinstance(p, Replicate):
            raise UclError(f"cannot checkpoint a DTensor with placement {p} (reduce it first)", code="UCL430")
    return "; ".join(first + later) or "replicate"


def _dtype_lines(kind: str, dtypes: dict[str, list[str]]) -> list[str]:
    """``state KIND : dtype X`` lines: one general line for the commonest dtype, ``for PATTERN``
    lines for the others (a ``for`` line overrides the general one)."""
    if not dtypes:
        return []
    common = max(dtypes, key=lambda d: len(dtypes[d]))
    lines = [f"state {kind} : dtype {common}"] if common != "float32" else []
    rest = {d: names for d, names in dtypes.items() if d != common}
    if rest:
        pats = _patterns({**rest, common: dtypes[common]})
        lines += [f"state {kind} for {p} : dtype {d}" for d, ps in pats.items() if d != common for p in ps]
    return lines


def derive(model, optimizer, *, bound=None, mesh: Mesh | None = None, reading: bool = False) -> TrainLayout:
    """The layout of ``model``'s parameters and buffers and ``optimizer``'s state right now.
    ``bound`` (a ``ucl.layout.Model``: a spec bound to the global dims and parameters) with ``mesh``
    describes a manual layout whose module holds rank-local tensors under their local names.
    ``reading``: the layout to restore into, where every DDP replica has the entries (rank 0 of the
    universal layout) although only process rank 0 writes them."""
    import torch
    model = unwrap(model)
    params = {clean_name(n): p for n, p in model.named_parameters()}  # tied parameters once, first name
    state_dict = {clean_name(n) for n in model.state_dict(keep_vars=True)}
    buffers = {clean_name(n): b for n, b in model.named_buffers() if clean_name(n) in state_dict}  # persistent
    by_param = {id(p): n for n, p in params.items()}
    states: dict[str, dict[str, Any]] = {}
    if optimizer is not None:
        for group in optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in by_param:
                    raise UclError("the optimizer holds a parameter that is not a parameter of the model "
                                   f"({tuple(p.shape)}); give the optimizer the model's own parameters", code="UCL430")
                s = optimizer.state.get(p)
                if s:
                    states[by_param[id(p)]] = {k: v for k, v in s.items() if torch.is_tensor(v)}
    kinds = [PARAM] + sorted({k for s in states.values() for k in s})
    frozen = tuple(n for n in list(params) + list(buffers) if n not in states)
    tensors: dict[str, Any] = {**params, **buffers}
    dist = initialized_dist()
    world = dist.get_world_size() if dist else 1
    my_rank = dist.get_rank() if dist else 0
    if bound is not None:  # a manual layout: the module holds rank-local tensors named by the spec
        if mesh is None:
            raise UclError("spec= needs mesh= (the layout the module's local tensors have)", code="UCL430")
        if mesh.size != world:
            raise UclError(f"mesh {mesh} has {mesh.size} ranks but the world has {world} processes", code="UCL430")
        # a DTensor module described by hand: its local shards are what the spec places on this rank
        entries = tuple(Entry(f"{PARAM}/{n}", _local(t).detach(), eager=not _is_param(t)) for n, t in tensors.items()) \
            + tuple(Entry(f"{k}/{n}", _local(v).detach()) for n, s in states.items() for k, v in s.items())
        return TrainLayout(bound.spec.text, dict(bound.dims), dict(bound.params), tuple(sorted(bound.frozen)), mesh,
                           my_rank, entries, tuple(bound.spec.kinds), ("manual", id(bound), mesh, my_rank,
                                                                       tuple(e.key for e in entries)))

    dtensors = [t for t in tensors.values() if _is_dtensor(t)]
    if not dtensors:  # one process or DDP replicas: the universal layout, written once by rank 0
        text = _spec_text(tensors, states, kinds, axes=[], rules={n: "replicate" for n in tensors})
        return _layout(text, None, frozen, UNIVERSAL, 0 if my_rank == 0 or reading else -1, tensors, states, kinds)
    dmesh = _root_mesh([t.device_mesh for t in dtensors])
    axes = _axes(dmesh)
    ucl_mesh = Mesh(list(zip(axes, dmesh.mesh.shape)))
    coords = dmesh.get_coordinate()
    r = ucl_mesh.rank(**dict(zip(axes, coords))) if coords is not None else -1
    rules = {n: _placement_rule(t, _axes(t.device_mesh)) if _is_dtensor(t) else "replicate"
             for n, t in tensors.items()}
    text = _spec_text(tensors, states, kinds, axes=axes, rules=rules)
    global_shapes = {n: tuple(t.shape) for n, t in tensors.items()}  # DTensor .shape is global
    return _layout(text, global_shapes, frozen, ucl_mesh, r, tensors, states, kinds)


def _axes(dmesh) -> list[str]:
    return list(dmesh.mesh_dim_names or [f"d{i}" for i in range(dmesh.ndim)])


def _root_mesh(meshes: list):
    """The DeviceMesh every parameter's mesh is a slice of: FSDP2 over a (dp, tp) mesh puts the
    tensor-parallel parameters on it and the others (a norm TP leaves alone) on its ``dp`` slice,
    which is then replicated over ``tp``. UCL430 for meshes that are not slices of one mesh."""
    distinct = list({id(m): m for m in meshes}.values())
    root = max(distinct, key=lambda m: m.ndim)
    names = _axes(root)
    coords = root.get_coordinate()
    for m in distinct:
        if m is root or m == root:
            continue
        sub = _axes(m)
        if root.mesh_dim_names is None or m.mesh_dim_names is None or not set(sub) <= set(names) or coords is None:
            raise UclError(f"parameters live on different DeviceMeshes ({root} and {m}) that are not slices of one "
                           "named mesh; pass spec= and mesh= explicitly", code="UCL430")
        # the slice through this process: the root's ranks at its coordinates on the axes ``m`` lacks
        ranks = root.mesh[tuple(c if a not in sub else slice(None) for a, c in zip(names, coords))]
        order = [a for a in names if a in sub]
        if ranks.permute([order.index(a) for a in sub]).tolist() != m.mesh.tolist():
            raise UclError(f"parameters live on DeviceMesh {m}, which is not the slice of {root} through this "
                           "process; pass spec= and mesh= explicitly", code="UCL430")
    return root


def unwrap(model):
    """The module a DistributedDataParallel wrapper trains (its FQNs lack the ``module.`` prefix)."""
    from torch.nn.parallel import DistributedDataParallel
    return model.module if isinstance(model, DistributedDataParallel) else model


def clean_name(name: str) -> str:
    """An FQN without the segments wrappers insert (``torch.compile``, activation checkpointing),
    so checkpoints of wrapped and plain modules share names, as torch's own state-dict FQNs do."""
    return ".".join(p for p in name.split(".") if p not in ("_orig_mod", "_checkpoint_wrapped_module"))


def _local(t):
    return t.to_local() if _is_dtensor(t) else t


def _spec_text(tensors, states, kinds, *, axes: list[str], rules: dict[str, str]) -> str:
    by_rule: dict[str, list[str]] = {}
    for n in tensors:
        by_rule.setdefault(rules[n], []).append(n)
    lines = ["# derived by ucl.train from the module's parameters, buffers and optimizer state"]
    if axes:
        lines.append(f"mesh {', '.join(axes)}")
    for rule, pats in _patterns(by_rule).items():
        lines += [f"{p} : {rule}" for p in pats]
    dtypes: dict[str, list[str]] = {}
    for n, t in tensors.items():
        dtypes.setdefault(logical_of_torch_dtype(t.dtype), []).append(n)
    lines += _dtype_lines(PARAM, dtypes)
    for kind in kinds[1:]:
        have = {n: s[kind] for n, s in states.items() if kind in s}
        scalar = all(v.dim() == 0 for v in have.values())
        shaped = all(tuple(v.shape) == tuple(tensors[n].shape) for n, v in have.items())
        if not (scalar or shaped) or len(have) != len(states):
            raise UclError(f"optimizer state {kind!r} is neither a scalar nor shaped like its parameter for every "
                           "parameter; pass spec= and mesh= explicitly", code="UCL430")
        kdt: dict[str, list[str]] = {}
        for n, v in have.items():
            kdt.setdefault(logical_of_torch_dtype(v.dtype), []).append(n)
        dl = _dtype_lines(kind, kdt)
        if scalar:
            lines.append(f"state {kind} : scalar" if not dl or " for " in dl[0] else dl.pop(0) + "; scalar")
            lines += [x + "; scalar" for x in dl]
        else:  # the general statement declares the kind for every parameter; `for` lines only change dtypes
            lines += ([f"state {kind} : follow"] if not dl or " for " in dl[0] else []) + dl
    return "\n".join(lines) + "\n"


def _layout(text, global_shapes, frozen, mesh, rank, tensors, states, kinds) -> TrainLayout:
    """A derived layout: this rank's entries are its local tensors under their global names."""
    entries = []
    if rank >= 0:
        for n, t in tensors.items():
            entries.append(Entry(f"{PARAM}/{n}", _local(t).detach(), eager=not _is_param(t)))
        for n, s in states.items():
            for kind, v in s.items():
                entries.append(Entry(f"{kind}/{n}", _local(v).detach()))
    shapes = global_shapes or {n: tuple(t.shape) for n, t in tensors.items()}
    sig = (text, tuple(shapes.items()), frozen, mesh, rank)
    return TrainLayout(text, {}, shapes, frozen, mesh, rank, tuple(entries), tuple(kinds), sig)


def _is_param(t) -> bool:
    import torch
    return isinstance(t, torch.nn.Parameter)
