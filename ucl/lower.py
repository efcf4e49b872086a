"""Lowering: a bound Model on a Mesh -> ShardMap (which boxes of each tensor every rank holds).

Work is done per *distinct coordinate tuple on the axes that matter* for a tensor, never per rank:
the ranks sharing a tuple are replicas and are expanded with numpy only when a plan needs them.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np

from . import ast
from .errors import BindError, Diagnostic
from .expr import ExprError, evaluate
from .layout import DimLayout, DimSpec, LayoutError, Node, dim_layout, flat_boxes
from .mesh import Mesh
from .model import Model, Tensor


@dataclass(frozen=True)
class Slot:
    """A view of one dataset as a row-major tensor of ``shape`` starting at flat ``base``
    (``base`` may be negative: a flat partition can start inside a tensor)."""

    key: str
    base: int
    shape: tuple[int, ...]
    dataset_shape: tuple[int, ...]


@dataclass(eq=False)
class Holding:
    fixed: dict[str, int]  # coordinates on the axes that matter; other axes hold replicas
    slot: Slot
    pieces: list[tuple[DimLayout, ...]]  # boxes of the slot's tensor, as per-dim runs

    def real_volume(self) -> int:
        return sum(int(np.prod([d.segs[:, 2].sum() for d in p], dtype=np.int64)) for p in self.pieces)


@dataclass(eq=False)
class ShardMap:
    mesh: Mesh
    model: Model
    holdings: list[list[Holding]]  # by tensor id
    flat_fills: list[tuple[dict, Slot, int, int]] = field(default_factory=list)  # (fixed, slot, start, length)
    datasets: list[tuple[dict, str, tuple, str]] = field(default_factory=list)  # (fixed, key, shape, dtype)

    def ranks(self, fixed: dict) -> np.ndarray:
        return self.mesh.ranks_where(fixed)

    def rank_datasets(self, rank: int) -> dict[str, tuple[tuple, str]]:
        """Every dataset rank ``rank`` holds: key -> (shape, logical dtype)."""
        c = self.mesh.coords(rank) if not self.mesh.is_universal else {}
        return {k: (s, dt) for f, k, s, dt in self.datasets if all(c.get(a, 0) == v for a, v in f.items())}


def _fail(model: Model, tensor: Tensor, span, err: LayoutError | Diagnostic, mesh: Mesh):
    d = err if isinstance(err, Diagnostic) else Diagnostic(err.code, str(err), span, err.hint)
    where = "" if mesh.is_universal else f" on mesh {mesh}"
    msg = f"{tensor.name} {list(tensor.shape)} ({tensor.kind}){where}: {d.message}"
    raise BindError([Diagnostic(d.code, msg, d.span or span, d.hint)], model.spec.text, model.spec.filename)


def _layouts(model, tensor, dims, fixed, mesh):
    """Per-dim layouts on one coordinate; a split that does not fit is reported at its own span."""
    out = []
    for k, d in enumerate(dims):
        try:
            out.append(dim_layout(d, _coords_key(fixed, (d,), mesh)))
        except LayoutError as e:
            spans = [t.span for t in tensor.rule.transforms if isinstance(t, ast.Split) and t.dim.root == k]
            _fail(model, tensor, spans[0] if spans else tensor.rule.span,
                  LayoutError(e.code, f"dim {k}: {e}", e.hint), mesh)
    return tuple(out)


def _eval(model, tensor, expr, env, mesh):
    try:
        return evaluate(expr, env)
    except ExprError as e:
        _fail(model, tensor, expr.span, e.diagnostic, mesh)


# ---- per-dim trees ------------------------------------------------------------------------
def _build_dims(model: Model, tensor: Tensor, env: dict, mesh: Mesh) -> tuple[DimSpec, ...]:
    rule = tensor.rule
    shape = model.params[tensor.name]
    structure: dict[tuple, ast.Transform] = {}
    splits: dict[tuple, list] = {}  # path -> [(order, (axes, mode))]
    pads: dict[int, int] = {}
    for order, t in enumerate(rule.transforms):
        if isinstance(t, (ast.View, ast.Concat)):
            structure[t.dim.path] = t
        elif isinstance(t, ast.Split):
            splits.setdefault(t.dim.path, []).append((order, (tuple(a.name for a in t.axes), t.mode)))
        elif isinstance(t, ast.Pad):
            n = shape[t.dim.root]
            target = _eval(model, tensor, t.target, env, mesh)
            if target <= 0:
                _fail(model, tensor, t.span, LayoutError("UCL205", f"pad target {target} must be positive"), mesh)
            padded = -(-n // target) * target if t.multiple else target
            if padded < n:
                _fail(model, tensor, t.span, LayoutError("UCL205", f"cannot pad dim {t.dim} of size {n} down to {padded}"), mesh)
            pads[t.dim.root] = padded

    def first_below(path) -> float:
        """Order of the first split of a strict descendant of ``path`` (inf if none)."""
        orders = [o for p, xs in splits.items() if len(p) > len(path) and p[:len(path)] == path for o, _ in xs]
        return min(orders, default=float("inf"))

    def build(path: tuple, size: int, inherited=()) -> Node:
        mine = splits.get(path, [])
        t = structure.get(path)
        if t is None:
            return Node("leaf", size, (), tuple(inherited) + tuple(x for _, x in mine))
        cut = first_below(path)
        if isinstance(t, ast.View):
            pre = tuple(inherited) + tuple(x for o, x in mine if o < cut)
            post = tuple(x for o, x in mine if o > cut)  # after a factor's split: cuts the local extent
        else:
            # The first split of a concat splits every part ([q_r; k_r; v_r]); any later one, or one
            # after a part's own split, cuts the rank-local extent (FSDP on top of TP).
            first = [x for o, x in mine[:1] if o < cut]
            pre = tuple(inherited) + tuple(first)
            post = tuple(x for x in (x for _, x in mine[len(first):]))
        if isinstance(t, ast.View):
            sizes = [_eval(model, tensor, f, env, mesh) for f in t.factors]
            if int(np.prod(sizes, dtype=np.int64)) != size:
                _fail(model, tensor, t.span, LayoutError(
                    "UCL206", f"view {t.dim} as {sizes}: the factors multiply to {int(np.prod(sizes))}, not {size}"), mesh)
            if pre and cut == float("inf"):  # a split of the whole viewed dim: the view does not matter
                return Node("leaf", size, (), pre)
            if pre:
                _fail(model, tensor, t.span, LayoutError(
                    "UCL109", f"dim {t.dim} is split as a whole before one of its factors is; split the factor "
                    "first (a later split of the whole then cuts each rank's local part)"), mesh)
            kids = tuple(build(path + (k,), s) for k, s in enumerate(sizes))
            return Node("view", size, kids, (), post)
        sizes = [_eval(model, tensor, p.size, env, mesh) for p in t.parts]
        if sum(sizes) != size:
            _fail(model, tensor, t.span, LayoutError(
                "UCL206", f"concat {t.dim} parts {sizes} sum to {sum(sizes)}, not {size}"), mesh)
        # A split of a concat splits every part: each rank holds [q_r; k_r; v_r].
        kids = tuple(build(path + (p.name.name,), s, pre) for p, s in zip(t.parts, sizes))
        return Node("concat", size, kids, (), post)

    dims = []
    for d, n in enumerate(shape):
        padded = pads.get(d, n)
        dims.append(DimSpec(n, padded, build((d,), padded)))
    return tuple(dims)


def _universal_dims(shape) -> tuple[DimSpec, ...]:
    return tuple(DimSpec(n, n, Node("leaf", n)) for n in shape)


# ---- placement -------------------------------------------------------------------------------
def _placement(model: Model, tensor: Tensor, env: dict, mesh: Mesh):
    """-> (fixed coords: axis -> allowed coords list, local name)."""
    allowed: dict[str, list[int]] = {}
    local_name = tensor.name
    replacements = []
    transforms = [(t, tensor.rule) for t in tensor.rule.transforms]
    if tensor.placement is not None:
        transforms += [(t, tensor.placement) for t in tensor.placement.transforms]
    for t, rule in transforms:
        if isinstance(t, ast.Place):
            size = mesh.axis_size(t.axis.name)
            coords = []
            for c in t.coords:
                v = 0 if c == "first" else size - 1 if c == "last" else _eval(model, tensor, c, env, mesh)
                if not 0 <= v < size:
                    _fail(model, tensor, t.span, LayoutError("UCL207", f"{t.axis.name} = {v} is outside the axis (size {size})"), mesh)
                coords.append(v)
            allowed[t.axis.name] = sorted(set(coords))
        elif isinstance(t, ast.Index):
            rule_match = rule.pattern.match(tensor.name)
            value = int(rule_match.group(t.capture.name))
            span = rule_match.span(t.capture.name)
            count = _eval(model, tensor, t.count, env, mesh)
            size = mesh.axis_size(t.axis.name)
            if not 0 <= value < count:
                _fail(model, tensor, t.span, LayoutError("UCL207", f"{t.capture.name} = {value} is not below {count}"), mesh)
            stage, local = _stage_of(model, tensor, t, value, count, size, env, mesh)
            allowed[t.axis.name] = [stage]
            replacements.append((span, str(local)))
    for (a, b), text in sorted(replacements, reverse=True):
        local_name = local_name[:a] + text + local_name[b:]
    return allowed, local_name


def _stage_of(model, tensor, t: ast.Index, value, count, size, env, mesh):
    ev = (lambda e: _eval(model, tensor, e, env, mesh))
    if size > 1 and (t.sizes is not None or t.first is not None or t.last is not None):
        if t.sizes is not None:
            sizes = [ev(e) for e in t.sizes]
        else:  # Megatron's --decoder-first/last-pipeline-num-layers: the middle stages share the rest
            first = ev(t.first) if t.first is not None else None
            last = ev(t.last) if t.last is not None else None
            inner = size - (first is not None) - (last is not None)
            rest = count - (first or 0) - (last or 0)
            if (inner == 0 and rest != 0) or (inner > 0 and (rest < 0 or rest % inner)):
                _fail(model, tensor, t.span, LayoutError(
                    "UCL204", f"after first/last stages, {rest} {t.capture.name}-values cannot be spread evenly "
                    f"over {inner} stages of {t.axis.name}={size}"), mesh)
            mid = [rest // inner] * inner if inner else []
            sizes = ([first] if first is not None else []) + mid + ([last] if last is not None else [])
        if len(sizes) != size or sum(sizes) != count or min(sizes) < 0:
            _fail(model, tensor, t.span, LayoutError(
                "UCL207", f"stage sizes {sizes} must list {size} stages summing to {count}"), mesh)
        bounds = np.cumsum(sizes)
        stage = int(np.searchsorted(bounds, value, side="right"))
        return stage, value - (int(bounds[stage - 1]) if stage else 0)
    virtual = ev(t.virtual) if t.virtual is not None else 1
    if virtual < 1:
        _fail(model, tensor, t.span, LayoutError("UCL207", f"virtual {virtual}: needs at least 1 chunk per stage"), mesh)
    chunks = size * virtual
    if count % chunks:
        _fail(model, tensor, t.span, LayoutError(
            "UCL204", f"{count} {t.capture.name}-values cannot be spread evenly over {t.axis.name}={size}"
            + (f" x virtual {virtual}" if virtual > 1 else ""), "give `first`/`last` stage sizes or `sizes [...]`"), mesh)
    per = count // chunks
    chunk = value // per
    return chunk % size, (chunk // size) * per + value % per


# ---- lowering -----------------------------------------------------------------------------------
def _coords_key(fixed: dict, dims: tuple[DimSpec, ...], mesh: Mesh):
    axes = set()
    for d in dims:
        axes |= d.node.axes()
    return tuple((a, fixed[a], mesh.axis_size(a)) for a in sorted(axes))


def _enumerate(axes: list[str], mesh: Mesh, allowed: dict[str, list[int]]):
    names = sorted(set(axes) | set(allowed))
    ranges = [allowed.get(a, range(mesh.axis_size(a))) for a in names]
    for combo in itertools.product(*ranges):
        yield dict(zip(names, combo))


def lower(model: Model, mesh: Mesh) -> ShardMap:
    env = model.env(mesh)
    sm = ShardMap(mesh, model, [[] for _ in model.tensors])
    if mesh.is_universal:
        for t in model.tensors:
            dims = _universal_dims(t.shape)
            layouts = tuple(dim_layout(d, ()) for d in dims)
            slot = Slot(t.key, 0, t.shape, t.shape)
            sm.holdings[t.id].append(Holding({}, slot, [layouts]))
            sm.datasets.append(({}, t.key, t.shape, t.dtype))
        return sm

    info = {}  # tensor id -> (dims, allowed, local name)
    for t in model.tensors:
        dims = () if t.scalar else _build_dims(model, t, env, mesh)
        allowed, local = _placement(model, t, env, mesh)
        info[t.id] = (dims, allowed, local)
        if t.flat is not None:
            continue
        axes = sorted({a for d in dims for a in d.node.axes()})
        for fixed in _enumerate(axes, mesh, allowed):
            layouts = _layouts(model, t, dims, fixed, mesh)
            shape = tuple(x.local for x in layouts)
            key = f"{t.kind}/{local}"
            sm.holdings[t.id].append(Holding(fixed, Slot(key, 0, shape, shape), [layouts]))
            sm.datasets.append((fixed, key, shape, t.dtype))

    geometry_cache: dict = {}
    for g in model.flat_groups:
        _lower_flat(model, g, info, env, mesh, sm, geometry_cache)
    return sm


def _lower_flat(model, group, info, env, mesh, sm: ShardMap, cache: dict):
    """Place one flat group's tensors. The geometry is shared by every kind of the same statement
    with the same members (fp32, exp_avg, exp_avg_sq), so it is computed once."""
    if not group.members:
        return
    key = (group.number, tuple(t.name for t in group.members))
    if key not in cache:
        cache[key] = _flat_geometry(model, group, info, env, mesh)
    holdings, fills, datasets = cache[key]
    by_name = {t.name: t for t in group.members}
    prefix = f"{group.kind}/"
    for name, coords, suffix, base, shape, part, pieces in holdings:
        t = by_name[name]
        sm.holdings[t.id].append(Holding(coords, Slot(prefix + suffix, base, shape, (part,)), pieces))
    for coords, suffix, part, start, length in fills:
        sm.flat_fills.append((coords, Slot(prefix + suffix, 0, (part,), (part,)), start, length))
    for coords, suffix, part in datasets:
        sm.datasets.append((coords, prefix + suffix, (part,), group.members[0].dtype))


def _flat_geometry(model, group, info, env, mesh):
    flat = group.flat
    flat_axes = [a.name for a in flat.axes]
    parts = int(np.prod([mesh.axis_size(a) for a in flat_axes], dtype=np.int64))
    first = group.members[0]
    align = _eval(model, first, flat.align, env, mesh) if flat.align is not None else 1
    multiple = _eval(model, first, flat.pad_multiple, env, mesh) if flat.pad_multiple is not None else 1
    bucket = _eval(model, first, flat.bucket, env, mesh) if flat.bucket is not None else None
    for what, v in (("align", align), ("pad to multiple_of", multiple), ("bucket", bucket if bucket is not None else 1)):
        if v < 1:
            _fail(model, first, flat.span, LayoutError("UCL210", f"flat {what} {v}: must be at least 1"), mesh)
    member_axes = set()
    for t in group.members:
        dims, allowed, _ = info[t.id]
        used = {a for d in dims for a in d.node.axes()}
        clash = used & set(flat_axes)
        if clash:
            _fail(model, t, flat.span, LayoutError(
                "UCL210", f"it is split over {', '.join(sorted(clash))} and also flattened over it"), mesh)
        member_axes |= used | set(allowed)
    member_axes -= set(flat_axes)
    holdings, fills, datasets = [], [], []
    part_coords = [_unravel(j, flat_axes, mesh) for j in range(parts)]

    for fixed in _enumerate(sorted(member_axes), mesh, {}):
        # The buffer on this coordinate: held members in order, each flattened, aligned.
        entries = []
        for t in group.members:
            dims, allowed, local = info[t.id]
            if any(fixed.get(a) not in c for a, c in allowed.items()):
                continue
            layouts = _layouts(model, t, dims, fixed, mesh)
            entries.append((t, layouts, local))
        if not entries:
            continue
        if flat.per_param:
            buffers = [[e] for e in entries]
        elif bucket is not None:
            buffers, cur, size = [], [], 0
            for e in entries:
                cur.append(e)
                size += int(np.prod([x.local for x in e[1]], dtype=np.int64))
                if size >= bucket:
                    buffers.append(cur)
                    cur, size = [], 0
            if cur:
                buffers.append(cur)
        else:
            buffers = [entries]
        for b, members in enumerate(buffers):
            if flat.per_param:
                suffix = members[0][2]
            else:
                suffix = f"@flat{group.number}" + (f".{b}" if bucket is not None else "")
            offsets, pos = [], 0
            for t, layouts, _ in members:
                pos = -(-pos // align) * align
                offsets.append(pos)
                pos += int(np.prod([x.local for x in layouts], dtype=np.int64))
            unit = multiple * (parts if flat.per_param and flat.pad_multiple is None else 1)
            total = -(-pos // unit) * unit if unit > 1 else pos
            if total % parts:
                _fail(model, members[0][0], flat.span, LayoutError(
                    "UCL210", f"a flat buffer of {total} elements cannot be split evenly over {'x'.join(flat_axes)}={parts}",
                    f"add `pad to multiple_of({' * '.join(flat_axes)})`"), mesh)
            part = total // parts
            covered = [[] for _ in range(parts)]
            for (t, layouts, _), off in zip(members, offsets):
                shape = tuple(x.local for x in layouts)
                n = int(np.prod(shape, dtype=np.int64))
                if n == 0 or part == 0:
                    continue
                for j in range(off // part, (off + n - 1) // part + 1):
                    lo, hi = max(off, j * part), min(off + n, (j + 1) * part)
                    covered[j].append((lo - j * part, hi - lo))
                    pieces = [tuple(_box_dims(layouts, start, size)) for start, size in flat_boxes(shape, lo - off, hi - off)]
                    holdings.append((t.name, {**fixed, **part_coords[j]}, suffix, off - j * part, shape, part, pieces))
            for j in range(parts):
                coords = {**fixed, **part_coords[j]}
                datasets.append((coords, suffix, part))
                pos = 0
                for lo, n in sorted(covered[j]):
                    if lo > pos:
                        fills.append((coords, suffix, part, pos, lo - pos))
                    pos = lo + n
                if part > pos:
                    fills.append((coords, suffix, part, pos, part - pos))
    return holdings, fills, datasets


def _box_dims(layouts, start, size):
    for d, s, z in zip(layouts, start, size):
        yield d if (s == 0 and z == d.local) else d.restrict(s, s + z)


def _unravel(j: int, axes: list[str], mesh: Mesh) -> dict[str, int]:
    out = {}
    for a in reversed(axes):
        s = mesh.axis_size(a)
        out[a] = j % s
        j //= s
    return out
