"""Lowering: a bound Model on a Mesh -> ShardMap (which boxes of each tensor every rank holds).

Work is done per *distinct coordinate tuple on the axes that matter* for a tensor, never per rank:
the ranks sharing a tuple are replicas and are expanded with numpy only when a plan needs them.
"""
from __future__ import annotations

import itertools
import warnings
from dataclasses import dataclass, field

import numpy as np

from ..errors import BindError, Diagnostic
from ..lang import ast
from ..lang.check import PARAM
from .algebra import DimLayout, DimSpec, LayoutError, SplitFailure, dim_layout, split_range
from .bind import Model
from .boxes import Slot, flat_boxes
from .dims import TensorFailure, build_dims, evaluate_in, fail, universal_dims
from .mesh import Mesh


class MeshFitWarning(UserWarning):
    """The mesh fits the model, but loosely: some ranks hold none of some parameters (a pipeline
    stage with no layers: ``sizes`` or ``first``/``last`` with a 0-size stage) or the same elements
    as their neighbours (a ``shared`` split over more ranks than elements: tp > KV heads)."""


@dataclass(eq=False)
class Holding:
    """What the ranks with coordinates ``fixed`` hold of one tensor: boxes (``pieces``) of it, stored
    in ``slot``."""

    fixed: dict[str, int]  # coordinates on the axes that matter; other axes hold replicas
    slot: Slot
    pieces: list[tuple[DimLayout, ...]]  # boxes of the slot's tensor, as per-dim runs

    def real_volume(self) -> int:
        return sum(int(np.prod([d.segs[:, 2].sum() for d in p], dtype=np.int64)) for p in self.pieces)


@dataclass(frozen=True)
class FlatFill:
    """Elements ``[start, start + length)`` of a flat buffer that hold no tensor (alignment, padding)."""

    fixed: dict
    slot: Slot
    start: int
    length: int


@dataclass(frozen=True)
class DatasetSlot:
    """A dataset that every rank with coordinates ``fixed`` holds."""

    fixed: dict
    key: str
    shape: tuple[int, ...]
    dtype: str


@dataclass(eq=False)
class ShardMap:
    """A model on a mesh: which boxes of each tensor the ranks hold, and which datasets they store."""

    mesh: Mesh
    model: Model
    holdings: list[list[Holding]]  # by tensor id
    flat_fills: list[FlatFill] = field(default_factory=list)
    datasets: list[DatasetSlot] = field(default_factory=list)

    def ranks(self, fixed: dict) -> np.ndarray:
        return self.mesh.ranks_where(fixed)

    def rank_datasets(self, rank: int) -> dict[str, tuple[tuple, str]]:
        """Every dataset rank ``rank`` holds: key -> (shape, logical dtype)."""
        c = self.mesh.coords(rank) if not self.mesh.is_universal else {}
        return {d.key: (d.shape, d.dtype) for d in self.datasets
                if all(c.get(a, 0) == v for a, v in d.fixed.items())}


def _layouts(model, tensor, dims, fixed, mesh):
    """Per-dim layouts on one coordinate; a split that does not fit is reported at its own span."""
    out = []
    for k, d in enumerate(dims):
        try:
            out.append(dim_layout(d, _coords_key(fixed, (d,), mesh)))
        except LayoutError as e:
            split = _split_transform(tensor.rule, e.split) if e.split is not None else None
            spans = [t.span for t in tensor.rule.transforms if isinstance(t, ast.Split) and t.dim.root == k]
            span = split.span if split is not None else spans[0] if spans else tensor.rule.span
            fail(model, tensor, span, LayoutError(e.code, f"dim {k}: {e}", e.hint, split=e.split), mesh)
    return tuple(out)


def _split_transform(rule: ast.Rule, failure: SplitFailure) -> ast.Split | None:
    """The split of ``rule`` that failed: over the same axes, of the failing node or of a concat
    above it (whose first split splits every part)."""
    path = failure.path
    for t in rule.transforms:
        if isinstance(t, ast.Split) and tuple(a.name for a in t.axes) == failure.axes \
                and path[:len(t.dim.path)] == t.dim.path:
            return t
    return None


# ---- placement -------------------------------------------------------------------------------
def _placement(model: Model, tensor, env: dict, mesh: Mesh, notes: dict | None = None):
    """-> (fixed coords: axis -> allowed coords list, local name). Empty stages go to ``notes``."""
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
                v = 0 if c == "first" else size - 1 if c == "last" else evaluate_in(model, tensor, c, env, mesh)
                if not 0 <= v < size:
                    fail(model, tensor, t.span, LayoutError("UCL207", f"{t.axis.name} = {v} is outside the axis (size {size})"), mesh)
                coords.append(v)
            allowed[t.axis.name] = sorted(set(coords))
        elif isinstance(t, ast.Index):
            rule_match = rule.pattern.match(tensor.name)
            value = int(rule_match.group(t.capture.name))
            span = rule_match.span(t.capture.name)
            count = evaluate_in(model, tensor, t.count, env, mesh)
            size = mesh.axis_size(t.axis.name)
            if not 0 <= value < count:
                fail(model, tensor, t.span, LayoutError("UCL207", f"{t.capture.name} = {value} is not below {count}"), mesh)
            stage, local = _stage_of(model, tensor, t, value, count, size, env, mesh, notes)
            allowed[t.axis.name] = [stage]
            if not t.keep:  # `keep`: the rank-local name keeps the global value
                replacements.append((span, str(local)))
    for (a, b), text in sorted(replacements, reverse=True):
        local_name = local_name[:a] + text + local_name[b:]
    return allowed, local_name


@dataclass(frozen=True)
class StageFailure:
    """``index c of N over AX`` cannot spread ``count`` values over the ``size`` coordinates of
    ``axis``: ``kind`` is "even" (N is not a multiple of size x virtual), "sizes" (the list has the
    wrong length or sum) or "first_last" (the middle stages cannot share the rest evenly)."""

    index: ast.Index
    axis: str
    size: int
    count: int
    virtual: int
    kind: str
    listed: int = 0  # how many stages `sizes [...]` lists


def _stage_fail(model, tensor, t: ast.Index, mesh, code, message, failure: StageFailure, hint=None):
    raise TensorFailure(model, tensor, Diagnostic(code, message, t.span, hint), mesh, failure)


def _stage_of(model, tensor, t: ast.Index, value, count, size, env, mesh, notes=None):
    ev = (lambda e: evaluate_in(model, tensor, e, env, mesh))
    axis = t.axis.name
    if size > 1 and (t.sizes is not None or t.first is not None or t.last is not None):
        if t.sizes is not None:
            sizes = [ev(e) for e in t.sizes]
        else:  # Megatron's --decoder-first/last-pipeline-num-layers: the middle stages share the rest
            first = ev(t.first) if t.first is not None else None
            last = ev(t.last) if t.last is not None else None
            inner = size - (first is not None) - (last is not None)
            rest = count - (first or 0) - (last or 0)
            if (inner == 0 and rest != 0) or (inner > 0 and (rest < 0 or rest % inner)):
                _stage_fail(model, tensor, t, mesh, "UCL204",
                            f"after first/last stages, {rest} {t.capture.name}-values cannot be spread evenly "
                            f"over {inner} stages of {axis}={size}",
                            StageFailure(t, axis, size, count, 1, "first_last"))
            mid = [rest // inner] * inner if inner else []
            sizes = ([first] if first is not None else []) + mid + ([last] if last is not None else [])
        if len(sizes) != size or sum(sizes) != count or min(sizes) < 0:
            _stage_fail(model, tensor, t, mesh, "UCL207", f"stage sizes {sizes} must list {size} stages summing to {count}",
                        StageFailure(t, axis, size, count, 1, "sizes", len(sizes)))
        if notes is not None and 0 in sizes:
            notes.setdefault(("stages", id(t)), []).append((tensor, (t, axis, tuple(sizes))))
        bounds = np.cumsum(sizes)
        stage = int(np.searchsorted(bounds, value, side="right"))
        return stage, value - (int(bounds[stage - 1]) if stage else 0)
    virtual = ev(t.virtual) if t.virtual is not None else 1
    if virtual < 1:
        fail(model, tensor, t.span, LayoutError("UCL207", f"virtual {virtual}: needs at least 1 chunk per stage"), mesh)
    chunks = size * virtual
    if count % chunks:
        _stage_fail(model, tensor, t, mesh, "UCL204",
                    f"{count} {t.capture.name}-values cannot be spread evenly over {axis}={size}"
                    + (f" x virtual {virtual}" if virtual > 1 else ""),
                    StageFailure(t, axis, size, count, virtual, "even"), "give `first`/`last` stage sizes or `sizes [...]`")
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
    """The ShardMap of ``model`` on ``mesh`` (cached on the model: lowering is pure)."""
    key = ("shardmap", mesh)
    if key not in model.memo:
        model.memo[key] = _lower(model, mesh)
    return model.memo[key]


def _lower(model: Model, mesh: Mesh) -> ShardMap:
    env = model.env(mesh)
    sm = ShardMap(mesh, model, [[] for _ in model.tensors])
    if mesh.is_universal:
        for t in model.tensors:
            layouts = tuple(dim_layout(d, ()) for d in universal_dims(t.shape))
            sm.holdings[t.id].append(Holding({}, Slot(t.key, 0, t.shape, t.shape), [layouts]))
            sm.datasets.append(DatasetSlot({}, t.key, t.shape, t.dtype))
        return sm

    placed = {}  # tensor id -> Placed
    failures: list[TensorFailure] = []  # every tensor that does not fit, reported together
    notes: dict = {}  # what fits only loosely (empty stages, shared elements): warned about once
    for t in model.tensors:
        try:
            dims = () if t.scalar else build_dims(model, t, env, mesh)
            allowed, local = _placement(model, t, env, mesh, notes)
            placed[t.id] = Placed(dims, allowed, local)
            if t.kind == PARAM:
                _note_shared(t, dims, mesh, notes)
            if t.flat is not None:
                continue
            axes = sorted({a for d in dims for a in d.node.axes()})
            for fixed in _enumerate(axes, mesh, allowed):
                layouts = _layouts(model, t, dims, fixed, mesh)
                shape = tuple(x.local for x in layouts)
                key = f"{t.kind}/{local}"
                sm.holdings[t.id].append(Holding(fixed, Slot(key, 0, shape, shape), [layouts]))
                sm.datasets.append(DatasetSlot(fixed, key, shape, t.dtype))
        except TensorFailure as e:
            failures.append(e)
    if failures:
        raise _report(model, mesh, failures)
    _warn(model, mesh, notes)

    geometry_cache: dict = {}
    for g in model.flat_groups:
        _lower_flat(model, g, placed, env, mesh, sm, geometry_cache)
    return sm


@dataclass(frozen=True)
class Placed:
    """One tensor on a mesh before flattening: its dim trees, the coordinates it is placed on
    (axis -> allowed coordinates) and its rank-local name."""

    dims: tuple[DimSpec, ...]
    allowed: dict[str, list[int]]
    local: str


@dataclass(frozen=True)
class FlatOptions:
    """A flat statement's numbers, evaluated on one mesh."""

    axes: tuple[str, ...]
    parts: int  # product of the flat axes' sizes: partitions per buffer
    align: int
    multiple: int
    bucket: int | None


@dataclass(frozen=True)
class FlatPiece:
    """Part of one member tensor inside one partition of a flat buffer."""

    name: str
    coords: dict
    suffix: str  # dataset name after the kind: "@flat0", "@flat0.3" or the per_param local name
    base: int  # flat offset of the tensor's first element relative to the partition
    shape: tuple[int, ...]
    part: int  # partition length
    pieces: list


@dataclass(frozen=True)
class FlatGap:
    coords: dict
    suffix: str
    part: int
    start: int
    length: int


@dataclass(frozen=True)
class FlatPartition:
    coords: dict
    suffix: str
    part: int


@dataclass(frozen=True)
class FlatGeometry:
    pieces: list[FlatPiece]
    gaps: list[FlatGap]
    partitions: list[FlatPartition]


def _lower_flat(model, group, placed, env, mesh, sm: ShardMap, cache: dict):
    """Place one flat group's tensors. The geometry is shared by every kind of the same statement
    with the same members (fp32, exp_avg, exp_avg_sq), so it is computed once."""
    if not group.members:
        return
    key = (group.number, tuple(t.name for t in group.members))
    if key not in cache:
        cache[key] = _flat_geometry(model, group, placed, env, mesh)
    geo: FlatGeometry = cache[key]
    by_name = {t.name: t for t in group.members}
    prefix = f"{group.kind}/"
    for p in geo.pieces:
        sm.holdings[by_name[p.name].id].append(Holding(p.coords, Slot(prefix + p.suffix, p.base, p.shape, (p.part,)),
                                                       p.pieces))
    for g in geo.gaps:
        sm.flat_fills.append(FlatFill(g.coords, Slot(prefix + g.suffix, 0, (g.part,), (g.part,)), g.start, g.length))
    for d in geo.partitions:
        sm.datasets.append(DatasetSlot(d.coords, prefix + d.suffix, (d.part,), group.members[0].dtype))


def _flat_options(model, group, mesh, env) -> FlatOptions:
    flat, first = group.flat, group.members[0]
    axes = tuple(a.name for a in flat.axes)

    def number(expr, default):
        return evaluate_in(model, first, expr, env, mesh) if expr is not None else default

    opts = FlatOptions(axes, int(np.prod([mesh.axis_size(a) for a in axes], dtype=np.int64)),
                       number(flat.align, 1), number(flat.pad_multiple, 1), number(flat.bucket, None))
    for what, v in (("align", opts.align), ("pad to multiple_of", opts.multiple),
                    ("bucket", opts.bucket if opts.bucket is not None else 1)):
        if v < 1:
            fail(model, first, flat.span, LayoutError("UCL210", f"flat {what} {v}: must be at least 1"), mesh)
    return opts


def _member_axes(model, group, placed, mesh, opts: FlatOptions) -> list[str]:
    """Axes other than the flat ones over which the members' buffers differ."""
    axes = set()
    for t in group.members:
        p = placed[t.id]
        used = {a for d in p.dims for a in d.node.axes()}
        clash = used & set(opts.axes)
        if clash:
            fail(model, t, group.flat.span, LayoutError(
                "UCL210", f"it is split over {', '.join(sorted(clash))} and also flattened over it"), mesh)
        axes |= used | set(p.allowed)
    return sorted(axes - set(opts.axes))


def _buffers(entries, flat, opts: FlatOptions) -> list[list]:
    """The members held on one coordinate, cut into buffers: one per parameter, by bucket size, or one."""
    if flat.per_param:
        return [[e] for e in entries]
    if opts.bucket is None:
        return [entries]
    buffers, cur, size = [], [], 0
    for e in entries:
        cur.append(e)
        size += int(np.prod([x.local for x in e[1]], dtype=np.int64))
        if size >= opts.bucket:
            buffers.append(cur)
            cur, size = [], 0
    if cur:
        buffers.append(cur)
    return buffers


def _flat_geometry(model, group, placed, env, mesh) -> FlatGeometry:
    flat = group.flat
    opts = _flat_options(model, group, mesh, env)
    parts = opts.parts
    part_coords = [_unravel(j, list(opts.axes), mesh) for j in range(parts)]
    geo = FlatGeometry([], [], [])
    for fixed in _enumerate(_member_axes(model, group, placed, mesh, opts), mesh, {}):
        # The buffer on this coordinate: held members in order, each flattened, aligned.
        entries = []
        for t in group.members:
            p = placed[t.id]
            if any(fixed.get(a) not in c for a, c in p.allowed.items()):
                continue
            entries.append((t, _layouts(model, t, p.dims, fixed, mesh), p.local))
        for b, members in enumerate(_buffers(entries, flat, opts) if entries else []):
            suffix = members[0][2] if flat.per_param else \
                f"@flat{group.number}" + (f".{b}" if opts.bucket is not None else "")
            _partition_buffer(model, mesh, flat, opts, fixed, part_coords, suffix, members, geo)
    return geo


def _partition_buffer(model, mesh, flat, opts: FlatOptions, fixed, part_coords, suffix, members,
                      geo: FlatGeometry) -> None:
    """Lay ``members`` out in one flat buffer (aligned, padded) and cut it into ``opts.parts``
    partitions: the pieces each partition holds, its gaps, and the partition datasets."""
    parts = opts.parts
    offsets, pos = [], 0
    for t, layouts, _ in members:
        pos = -(-pos // opts.align) * opts.align
        offsets.append(pos)
        pos += int(np.prod([x.local for x in layouts], dtype=np.int64))
    unit = opts.multiple * (parts if flat.per_param and flat.pad_multiple is None else 1)
    total = -(-pos // unit) * unit if unit > 1 else pos
    if total % parts:
        fail(model, members[0][0], flat.span, LayoutError(
            "UCL210", f"a flat buffer of {total} elements cannot be split evenly over {'x'.join(opts.axes)}={parts}",
            f"add `pad to multiple_of({' * '.join(opts.axes)})`"), mesh)
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
            pieces = [tuple(_box_dims(layouts, start, size)) for _, start, size in flat_boxes(shape, lo - off, hi - off)]
            geo.pieces.append(FlatPiece(t.name, {**fixed, **part_coords[j]}, suffix, off - j * part, shape, part, pieces))
    for j in range(parts):
        coords = {**fixed, **part_coords[j]}
        geo.partitions.append(FlatPartition(coords, suffix, part))
        pos = 0
        for lo, n in sorted(covered[j]):
            if lo > pos:
                geo.gaps.append(FlatGap(coords, suffix, part, pos, lo - pos))
            pos = lo + n
        if part > pos:
            geo.gaps.append(FlatGap(coords, suffix, part, pos, part - pos))


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


# ---- a mesh that does not fit: one diagnostic per problem, blaming the mesh where it is to blame ----
_LARGEST_SUGGESTED = 128  # axis sizes up to this are tried when suggesting sizes that fit
_CANDIDATES = 16  # at most this many of them (each is checked against the whole model)


def _report(model, mesh: Mesh, failures: list[TensorFailure]) -> BindError:
    """One diagnostic per distinct problem (the same rule failing the same way in every layer is one
    problem), naming the first tensor and counting the others."""
    groups: dict[tuple, list[TensorFailure]] = {}
    for f in failures:
        p = f.problem
        groups.setdefault((p.code, p.span, p.message, p.hint), []).append(f)
    fits: dict = {}  # (axis, size) -> does the whole model fit with it; shared by the groups
    diagnostics = []
    for members in groups.values():
        first = members[0]
        blamed = _blame_mesh(model, mesh, first, fits)
        message, hint = blamed if blamed else (first.diagnostics[0].message, first.problem.hint)
        names = list(dict.fromkeys(m.tensor.name for m in members))
        if blamed and isinstance(first.cause, StageFailure) and message.endswith(")"):  # how many it places
            message = message[:-1] + f", which places {len(names)} parameter{'s' if len(names) > 1 else ''})"
        elif len(names) > 1:
            shown = ", ".join(names[1:3]) + (", ..." if len(names) > 3 else "")
            message += f"; and {len(names) - 1} more parameter{'s' if len(names) > 2 else ''} like this ({shown})"
        diagnostics.append(Diagnostic(first.problem.code, message, first.problem.span, hint))
    return BindError(diagnostics, model.spec.text, model.spec.filename)


def _blame_mesh(model, mesh: Mesh, failure: TensorFailure, fits: dict):
    """(message, hint) saying which axis size is wrong and which would fit, when the spec is fine
    for other sizes of that axis; None when the spec itself is to blame."""
    cause = failure.cause
    if isinstance(cause, SplitFailure) and cause.mode != "uneven":
        return _blame_split(model, mesh, failure, cause, fits)
    if isinstance(cause, StageFailure):
        return _blame_stages(model, mesh, failure, cause, fits)
    return None


def _fitting_sizes(model, mesh: Mesh, axis: str, candidates, fits: dict) -> list[int]:
    """The candidate sizes of ``axis`` (the current one excluded) with which every parameter fits."""
    current = mesh.axis_size(axis)
    out = []
    for s in candidates:
        if s == current:
            continue
        if (axis, s) not in fits:
            fits[(axis, s)] = _fits(model, _resized(mesh, axis, s), axis)
        if fits[(axis, s)]:
            out.append(s)
    return out


def _resized(mesh: Mesh, axis: str, size: int) -> Mesh:
    return Mesh([(n, size if n == axis else s) for n, s in mesh.axes])


def _fits(model, mesh: Mesh, axis: str) -> bool:
    """Do all parameters fit ``mesh`` as far as ``axis`` is concerned (its splits and placements)?"""
    try:
        env = model.env(mesh)
    except BindError:
        return False
    seen = set()
    for t in model.tensors:
        key = (id(t.rule), id(t.placement), t.shape)
        if t.kind != PARAM or key in seen:
            continue
        seen.add(key)
        try:
            dims = build_dims(model, t, env, mesh)
            _placement(model, t, env, mesh)
            for d in dims:
                axes = sorted(d.node.axes())
                if axis in axes:
                    for fixed in _probe_coords(axes, mesh, axis):
                        dim_layout(d, _coords_key(fixed, (d,), mesh))
        except LayoutError as e:
            if e.split is None or axis in e.split.axes:
                return False
        except TensorFailure as e:
            cause = e.cause
            axes = cause.axes if isinstance(cause, SplitFailure) else (cause.axis,) if cause is not None else None
            if axes is None or axis in axes:
                return False
    return True


def _probe_coords(axes, mesh: Mesh, axis: str):
    """Every coordinate of ``axis``, the first and last of the other axes: enough to find a split
    that cannot cut what it is given, without visiting every rank."""
    ranges = [range(mesh.axis_size(a)) if a == axis else sorted({0, mesh.axis_size(a) - 1}) for a in axes]
    for combo in itertools.product(*ranges):
        yield dict(zip(axes, combo))


def _source_text(model, span) -> str | None:
    lines = model.spec.text.splitlines()
    if span is None or not 0 < span.line <= len(lines) or span.end_line != span.line:
        return None
    return lines[span.line - 1][span.col - 1:span.end_col - 1].strip() or None


def _size_text(model, rule: ast.Rule, path: tuple) -> str | None:
    """The spec's expression for the size of node ``path`` of a dim: a declared shape entry (not
    when the dim is padded), a view factor or a concat part."""
    if len(path) == 1:
        padded = any(isinstance(t, ast.Pad) and t.dim.root == path[0] for t in rule.transforms)
        if padded or rule.shape is None or path[0] >= len(rule.shape):
            return None
        return _source_text(model, rule.shape[path[0]].span)
    for t in rule.transforms:
        if isinstance(t, ast.View) and t.dim.path == path[:-1] and isinstance(path[-1], int):
            return _source_text(model, t.factors[path[-1]].span) if path[-1] < len(t.factors) else None
        if isinstance(t, ast.Concat) and t.dim.path == path[:-1]:
            return next((_source_text(model, p.size.span) for p in t.parts if p.name.name == path[-1]), None)
    return None


def _quantity(text: str | None, value: int) -> str:
    """``kv_heads=4``, ``heads * head_dim = 256`` or ``4 elements``."""
    if text is None or text.isdigit():
        return f"{value} element{'' if value == 1 else 's'}"
    return f"{text}={value}" if text.isidentifier() else f"{text} = {value}"


def _among(axis: str, sizes: list[int], shown: int = 10) -> str:
    listed = ", ".join(map(str, sizes[:shown])) + (", ..." if len(sizes) > shown else "")
    return f"choose {axis} among {listed}"


def _blame_split(model, mesh, failure: TensorFailure, sf: SplitFailure, fits):
    n, parts = sf.size, sf.parts
    tensor = failure.tensor
    if sf.mode == "shared":
        local = (lambda p: n % p == 0 if p <= n else p % n == 0) if n else (lambda p: True)
        top = _LARGEST_SUGGESTED
    else:
        local = (lambda p: n % p == 0)
        top = min(n, _LARGEST_SUGGESTED)
    dim = ".".join(map(str, sf.path))
    if sf.whole:
        what, where = _quantity(_size_text(model, tensor.rule, sf.path), n), f"dim {dim} of {tensor.name} {list(tensor.shape)}"
    else:
        what, where = f"the {n} elements earlier splits leave of dim {dim}", f"{tensor.name} {list(tensor.shape)}"
    verb = "is neither a divisor nor a multiple of" if sf.mode == "shared" and parts > n else "does not divide"
    if len(sf.axes) > 1:  # a split over several axes: their product must fit
        product = " x ".join(f"{a}={mesh.axis_size(a)}" for a in sf.axes)
        ok = [p for p in range(1, top + 1) if local(p) and p != parts]
        if not any(p > 1 for p in ok):
            return None
        return (f"the mesh {mesh} does not fit: {product} = {parts} {verb} {what} ({where})",
                _among(f"sizes whose product ({' * '.join(sf.axes)}) is", ok)
                + ("; or, to keep them, make the split `uneven` (torch.chunk semantics) or pad the dim"
                   if sf.mode == "even" else ""))
    axis = sf.axes[0]
    ok = _fitting_sizes(model, mesh, axis, [p for p in range(1, top + 1) if local(p)][:_CANDIDATES], fits)
    if not any(p > 1 for p in ok):
        return None
    hint = _among(axis, ok)
    if sf.mode == "even":
        hint += f"; or, to allow {axis}={parts}, make the split `uneven` (torch.chunk semantics) or pad the dim"
    return f"the mesh {mesh} does not fit: {axis}={parts} {verb} {what} ({where})", hint


def _blame_stages(model, mesh, failure: TensorFailure, sf: StageFailure, fits):
    t, axis, count = sf.index, sf.axis, sf.count
    top = max(1, min(count, _LARGEST_SUGGESTED))
    if sf.kind == "even":
        candidates = [s for s in range(1, top + 1) if count % (s * sf.virtual) == 0]
    elif sf.kind == "sizes":
        candidates = sorted({1, sf.listed})
    else:
        candidates = list(range(1, min(top, 64) + 1))
    ok = _fitting_sizes(model, mesh, axis, candidates, fits)
    if not any(s > 1 for s in ok):
        return None
    what = _quantity(_source_text(model, t.count.span), count)
    tensor = failure.tensor
    rule = tensor.placement if tensor.placement is not None and t in tensor.placement.transforms else tensor.rule
    where = f"`{rule.pattern.text} : {_source_text(model, t.span) or 'index'}`"
    if sf.kind == "even":
        size = f"{axis}={sf.size}" + (f" x virtual {sf.virtual} = {sf.size * sf.virtual}" if sf.virtual > 1 else "")
        return (f"the mesh {mesh} does not fit: {size} does not divide {what} ({where})",
                _among(axis, ok) + ", or give the stage sizes: `first`/`last` or `sizes [...]`")
    if sf.kind == "sizes":
        return (f"the mesh {mesh} does not fit: {axis}={sf.size}, but `sizes [...]` lists {sf.listed} stages ({where})",
                _among(axis, ok))
    return f"the mesh {mesh} does not fit: {failure.problem.message} ({where})", _among(axis, ok)


# ---- a mesh that fits only loosely: warnings -----------------------------------------------------
def _note_shared(tensor, dims, mesh: Mesh, notes: dict) -> None:
    """Record `shared` splits over more ranks than elements (tp > KV heads): legal, but worth a word."""
    for d in dims:
        stack = [d.node]
        while stack:
            node = stack.pop()
            stack.extend(reversed(node.children))
            n = node.size
            for axes, mode in node.splits:
                parts = int(np.prod([mesh.axis_size(a) for a in axes], dtype=np.int64))
                if mode == "shared" and 0 < n < parts:
                    notes.setdefault(("shared", id(tensor.rule), axes), []).append((tensor, (n, parts, node.path)))
                try:
                    lo, hi = split_range(n, parts, 0, mode)
                except LayoutError:
                    break  # reported as an error by the lowering itself
                n = hi - lo


def _warn(model, mesh: Mesh, notes: dict) -> None:
    for key, entries in notes.items():
        tensor, info = entries[0]
        names = list(dict.fromkeys(e[0].name for e in entries))
        if key[0] == "stages":
            t, axis, sizes = info
            empty = [str(i) for i, s in enumerate(sizes) if s == 0]
            rule = tensor.placement if tensor.placement is not None and t in tensor.placement.transforms else tensor.rule
            message = (f"mesh {mesh}: {axis} stage{'s' if len(empty) > 1 else ''} {', '.join(empty)} "
                       f"get{'s' if len(empty) == 1 else ''} none of the {sum(sizes)} {t.capture.name}-values of "
                       f"`{rule.pattern.text}` (stage sizes {list(sizes)}): those ranks hold none of its parameters")
            line = t.span.line
        else:
            axes = key[2]
            parts = info[1]
            by_size: dict[str, list[str]] = {}  # "kv_heads=2" -> ["0.k.0", "0.v.0"]
            for _, (n, _, path) in entries:
                dims = by_size.setdefault(_quantity(_size_text(model, tensor.rule, path), n), [])
                if ".".join(map(str, path)) not in dims:
                    dims.append(".".join(map(str, path)))
            held = " and ".join(f"{q} (dim{'s' if len(d) > 1 else ''} {', '.join(d)})" for q, d in by_size.items())
            more = f" and {len(names) - 1} more parameter{'s' if len(names) > 2 else ''}" if len(names) > 1 else ""
            message = (f"mesh {mesh}: {' x '.join(axes)}={parts} is more than {held} of {tensor.name}{more}: "
                       f"`shared` gives each element to several consecutive ranks")
            line = tensor.rule.span.line
        warnings.warn(MeshFitWarning(f"{model.spec.filename}:{line}: {message}"), stacklevel=6)
