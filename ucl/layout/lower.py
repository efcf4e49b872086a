"""Lowering: a bound Model on a Mesh -> ShardMap (which boxes of each tensor every rank holds).

Work is done per *distinct coordinate tuple on the axes that matter* for a tensor, never per rank:
the ranks sharing a tuple are replicas and are expanded with numpy only when a plan needs them.
"""
from __future__ import annotations

import gc
import itertools
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np

from ..dtypes import itemsize
from ..lang import ast
from ..lang.check import PARAM
from ..lang.expr import LIMIT
from .algebra import DimLayout, DimSpec, LayoutError, SplitFailure, dim_layout
from .bind import Model
from .boxes import Slot, flat_boxes
from .dims import TensorFailure, build_dims, evaluate_in, fail, universal_dims
from .fit import mesh_report, note_shared, warn_loose_fit
from .mesh import Mesh
from ..errors import UclError
from .place import placement


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
    # None: every tensor; else the ids of the tensors whose holdings are complete (``lower(tensors=)``)
    focus: frozenset[int] | None = None
    memo: dict = field(default_factory=dict)  # indexes built over this map (plan.compile)

    def ranks(self, fixed: dict) -> np.ndarray:
        return self.mesh.ranks_where(fixed)

    def rank_datasets(self, rank: int, stored: bool = False) -> dict[str, tuple[tuple, str]]:
        """Every dataset rank ``rank`` holds: key -> (shape, logical dtype). ``stored``: only those it
        stores, the format-2 rule (docs/format.md): a dataset that several ranks hold (replicas: the
        ranks that differ only on axes it is not fixed on) is stored by the first of them, the one
        whose coordinates on those axes are all 0; that is the copy plans read."""
        c = self.mesh.coords(rank) if not self.mesh.is_universal else {}
        return {d.key: (d.shape, d.dtype) for d in self.datasets
                if all(c.get(a, 0) == v for a, v in d.fixed.items())
                and (not stored or all(v == 0 for a, v in c.items() if a not in d.fixed))}


def _dim_axes(dims) -> tuple[tuple[str, ...], ...]:
    """Each dim's split axes, sorted: what ``place.coords_key`` looks at, found once per tensor."""
    return tuple(tuple(sorted(d.node.axes())) for d in dims)


def _layouts(model, tensor, dims, fixed, mesh, dim_axes=None, memo: dict | None = None):
    """Per-dim layouts on one coordinate; a split that does not fit is reported at its own span.
    ``memo`` maps (id of a DimSpec kept alive by the caller, coordinates) to its layout."""
    out = []
    for k, (d, axes) in enumerate(zip(dims, dim_axes if dim_axes is not None else _dim_axes(dims))):
        try:  # the key is place.coords_key(fixed, (d,), mesh), from the axes found beforehand
            coords = tuple((a, fixed[a], mesh.axis_size(a)) for a in axes)
            if memo is None:
                out.append(dim_layout(d, coords))
            else:  # dim_layout's own cache hashes the whole dim tree on every call
                key = (id(d), coords)
                got = memo.get(key)
                if got is None:
                    got = memo[key] = dim_layout(d, coords)
                out.append(got)
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


# ---- lowering -----------------------------------------------------------------------------------
def _enumerate(axes: list[str], mesh: Mesh, allowed: dict[str, list[int]]):
    names = sorted(set(axes) | set(allowed))
    ranges = [allowed.get(a, range(mesh.axis_size(a))) for a in names]
    for combo in itertools.product(*ranges):
        yield dict(zip(names, combo))


def lower(model: Model, mesh: Mesh, *, reuse: bool = True, tensors: frozenset[int] | None = None) -> ShardMap:
    """The ShardMap of ``model`` on ``mesh`` (cached on the model: lowering is pure).
    ``reuse=False`` computes it afresh, every tensor and flat buffer on its own (for tests).
    ``tensors`` (ids): a map whose holdings are complete for those tensors at least, lowering only
    what they need (the flat buffers they lie in): what a plan for a few ranks reads and proves. Only
    those tensors are checked against the mesh. The whole map is returned when it is cached."""
    key = ("shardmap", mesh)
    focused = model.memo.setdefault(("shardmap-focused", mesh), {}) if tensors is not None and reuse else {}
    # a process planning the ranks of several pipeline stages lowers the whole model once instead
    if tensors is not None and key not in model.memo and reuse and (tensors in focused or len(focused) < 2):
        sm = focused.get(tensors)
        if sm is None:
            with gc_paused():
                sm = focused[tensors] = _lower(model, mesh, True, tensors)
        return sm
    if not reuse:
        with gc_paused():
            return _lower(model, mesh, False)
    if key not in model.memo:
        with gc_paused():
            model.memo[key] = _lower(model, mesh, True)
        model.memo.pop(("shardmap-focused", mesh), None)  # the whole map serves every later plan
    return model.memo[key]


def tensors_on(model: Model, mesh: Mesh, coords: list[dict[str, int]]) -> frozenset[int]:
    """Ids of the tensors placed (``on``, ``index ... over``) where some rank with ``coords`` is, from
    placement alone: a superset of what those ranks hold. A tensor whose placement fails is included
    (its lowering reports it)."""
    env = model.env(mesh)
    memo: dict = {}
    out = []
    for t in model.tensors:
        try:
            allowed, _ = _placement_of(model, t, env, mesh, memo)
        except (TensorFailure, UclError):
            out.append(t.id)
            continue
        if any(all(c.get(a, 0) in v for a, v in allowed.items()) for c in coords):
            out.append(t.id)
    return frozenset(out)


def _placement_of(model: Model, t, env: dict, mesh: Mesh, memo: dict | None):
    """:func:`placement` without notes, cached on the model per mesh: planning one rank's load
    places every tensor to find its own (:func:`tensors_on`) and again to lay out the flat buffers
    they share (:func:`_place_other_members`). Callers do not change what it returns."""
    cache = model.memo.setdefault(("placement", mesh), {})
    found = cache.get(t.id)
    if found is None:
        found = cache[t.id] = placement(model, t, env, mesh, None, memo)
    return found


@contextmanager
def gc_paused():
    """Lowering (and compiling from it) builds some 10^5 long-lived objects and no cycles: the
    cyclic collector's passes over them (about 40% of the time of a 405B model's lowering) would
    find nothing to free."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _lower(model: Model, mesh: Mesh, reuse: bool, focus: frozenset[int] | None = None) -> ShardMap:
    env = model.env(mesh)
    todo, members = range(len(model.tensors)), []
    if focus is not None:  # a flat buffer is laid out from all its members: they are placed too (after)
        todo = sorted(focus)
        members = sorted({m.id for g in model.flat_groups if any(m.id in focus for m in g.members)
                          for m in g.members} - focus)
    sm = ShardMap(mesh, model, [[] for _ in model.tensors], focus=focus)
    if mesh.is_universal:
        for t in model.tensors:
            layouts = tuple(dim_layout(d, ()) for d in universal_dims(t.shape))
            sm.holdings[t.id].append(Holding({}, Slot(t.key, 0, t.shape, t.shape), [layouts]))
            sm.datasets.append(DatasetSlot({}, t.key, t.shape, t.dtype))
        return sm

    placed = {}  # tensor id -> Placed
    failures: list[TensorFailure] = []  # every tensor that does not fit, reported together
    notes: dict = {}  # what fits only loosely (empty stages, shared elements): warned about once
    shared: dict | None = {} if reuse else None  # what every layer of a rule shares (stage sizes)
    one: dict[DimSpec, DimSpec] = {}  # equal dim trees (every layer's) as one object, kept alive
    layout_memo: dict | None = {} if reuse else None
    for t in (model.tensors[i] for i in todo):
        try:
            dims = () if t.scalar else build_dims(model, t, env, mesh)
            if reuse:
                dims = tuple([one.setdefault(d, d) for d in dims])
            allowed, local = placement(model, t, env, mesh, notes, shared)
            dim_axes = _dim_axes(dims)
            placed[t.id] = Placed(dims, allowed, local, dim_axes)
            if t.kind == PARAM:
                note_shared(t, dims, mesh, notes)
            if t.flat is not None:
                continue
            axes = sorted({a for axes in dim_axes for a in axes})
            for fixed in _enumerate(axes, mesh, allowed):
                layouts = _layouts(model, t, dims, fixed, mesh, dim_axes, layout_memo)
                shape = tuple(x.local for x in layouts)
                key = f"{t.kind}/{local}"
                sm.holdings[t.id].append(Holding(fixed, Slot(key, 0, shape, shape), [layouts]))
                sm.datasets.append(DatasetSlot(fixed, key, shape, t.dtype))
        except TensorFailure as e:
            failures.append(e)
    if members and not failures:
        try:
            _place_other_members(model, mesh, env, members, placed, shared, one if reuse else None)
        except TensorFailure as e:
            failures.append(e)
    if failures:
        raise mesh_report(model, mesh, failures)
    warn_loose_fit(model, mesh, notes)

    geometry_cache: dict = {}
    for g in model.flat_groups:
        if focus is None or any(m.id in focus for m in g.members):
            _lower_flat(model, g, placed, env, mesh, sm, geometry_cache, reuse, layout_memo, focus)
    return sm


@dataclass(frozen=True)
class Placed:
    """One tensor on a mesh before flattening: its dim trees, the coordinates it is placed on
    (axis -> allowed coordinates) and its rank-local name."""

    dims: tuple[DimSpec, ...]
    allowed: dict[str, list[int]]
    local: str
    dim_axes: tuple[tuple[str, ...], ...]  # each dim's split axes, sorted


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


def _place_other_members(model, mesh, env, ids: list[int], placed: dict, shared, one: dict | None) -> None:
    """Place flat members outside a focused lowering's tensors. One that no coordinate shares with a
    focused tensor (another pipeline stage) lies in no buffer the focus needs: only its placement and
    split axes matter (the axes buffers differ over), and those come from its rule, its dims are built
    once per rule. The others are placed in full."""
    near = {tuple(sorted((a, tuple(c)) for a, c in p.allowed.items())) for p in placed.values()}
    by_rule: dict[int, tuple] = {}
    for t in (model.tensors[i] for i in ids):
        allowed, local = _placement_of(model, t, env, mesh, shared)
        if any(all(set(allowed.get(a, c)) & set(c) for a, c in other) for other in near):
            dims = () if t.scalar else build_dims(model, t, env, mesh)
            if one is not None:
                dims = tuple([one.setdefault(d, d) for d in dims])
            placed[t.id] = Placed(dims, allowed, local, _dim_axes(dims))
            continue
        axes = by_rule.get(id(t.rule))
        if axes is None:
            axes = by_rule[id(t.rule)] = _dim_axes(() if t.scalar else build_dims(model, t, env, mesh))
        placed[t.id] = Placed((), allowed, local, axes)


def _lower_flat(model, group, placed, env, mesh, sm: ShardMap, cache: dict, reuse: bool, layout_memo,
                focus: frozenset[int] | None = None):
    """Place one flat group's tensors. The geometry is shared by every kind of the same statement
    with the same members (fp32, exp_avg, exp_avg_sq), so it is computed once. ``focus``: only the
    buffers holding one of those tensors."""
    if not group.members:
        return
    key = (group.number, tuple(t.name for t in group.members))
    if key not in cache:
        cache[key] = _flat_geometry(model, group, placed, env, mesh, reuse, layout_memo, focus)
    geo: FlatGeometry = cache[key]
    held = {t.name: sm.holdings[t.id] for t in group.members}
    prefix = f"{group.kind}/"
    slots: dict[tuple, Slot] = {}  # equal slots recur on every coordinate: build each once
    for p in geo.pieces:
        k = (p.suffix, p.base, p.shape, p.part)
        slot = slots.get(k)
        if slot is None:
            slot = slots[k] = Slot(prefix + p.suffix, p.base, p.shape, (p.part,))
        held[p.name].append(Holding(p.coords, slot, p.pieces))
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
        used = {a for axes in p.dim_axes for a in axes}
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


def _flat_geometry(model, group, placed, env, mesh, reuse: bool, layout_memo: dict | None,
                   focus: frozenset[int] | None = None) -> FlatGeometry:
    flat = group.flat
    opts = _flat_options(model, group, mesh, env)
    parts = opts.parts
    part_coords = [_unravel(j, list(opts.axes), mesh) for j in range(parts)]
    geo = FlatGeometry([], [], [])
    # Buffers with the same member layouts (the same DimLayout objects: dim_layout is cached) cut
    # the same way: pipeline stages of equal depth repeat one cut, which is computed once.
    cuts: dict | None = {} if reuse else None
    restricted: dict = {}  # (DimLayout, lo, hi) -> its restriction: cuts of other stages repeat many
    skeletons: dict = {}  # (dtype, members' local shapes) -> the cut as boxes of local tensors
    # Members placed alike (a pipeline stage's layers) are held on the same coordinates: test
    # each placement once per coordinate, not each member.
    alike: dict[tuple, list[int]] = {}
    for i, t in enumerate(group.members):
        alike.setdefault(tuple((a, tuple(c)) for a, c in placed[t.id].allowed.items()), []).append(i)
    for fixed in _enumerate(_member_axes(model, group, placed, mesh, opts), mesh, {}):
        # The buffer on this coordinate: held members in order, each flattened, aligned.
        held = sorted(i for allowed, idx in alike.items()
                      if all(fixed.get(a) in c for a, c in allowed) for i in idx)
        if focus is not None and not any(group.members[i].id in focus for i in held):
            continue
        entries = []
        for i in held:
            t = group.members[i]
            p = placed[t.id]
            entries.append((t, _layouts(model, t, p.dims, fixed, mesh, p.dim_axes, layout_memo), p.local))
        for b, members in enumerate(_buffers(entries, flat, opts) if entries else []):
            suffix = members[0][2] if flat.per_param else \
                f"@flat{group.number}" + (f".{b}" if opts.bucket is not None else "")
            if cuts is None:
                cut = _cut_buffer(_cut_skeleton(model, mesh, flat, opts, members), members, None)
            else:
                key = (members[0][0].dtype, tuple([layouts for _, layouts, _ in members]))
                cut = cuts.get(key)
                if cut is None:
                    shapes = (members[0][0].dtype, tuple([tuple([x.local for x in layouts])
                                                          for _, layouts, _ in members]))
                    skeleton = skeletons.get(shapes)
                    if skeleton is None:
                        skeleton = skeletons[shapes] = _cut_skeleton(model, mesh, flat, opts, members)
                    cut = cuts[key] = _cut_buffer(skeleton, members, restricted)
            _place_cut(cut, members, fixed, part_coords, suffix, geo)
    return geo


@dataclass(frozen=True)
class BufferCut:
    """One flat buffer cut into partitions, independent of where it is held: ``pieces`` are
    (member index, partition, member's offset relative to the partition, member's local shape,
    boxes), ``gaps[j]`` the (start, length) of partition ``j`` that no member covers. A skeleton
    (:func:`_cut_skeleton`) has boxes as (starts, sizes) in the member's local tensor; a cut
    (:func:`_cut_buffer`) has them as per-dim layouts."""

    part: int  # partition length
    pieces: list[tuple[int, int, int, tuple[int, ...], list]]
    gaps: list[list[tuple[int, int]]]


def _cut_skeleton(model, mesh, flat, opts: FlatOptions, members) -> BufferCut:
    """Lay ``members`` out in one flat buffer (aligned, padded) and cut it into ``opts.parts``
    partitions: the pieces each partition holds, as boxes of local shapes, and its gaps. Only the
    members' local shapes matter: the ranks of a tensor-parallel group share one skeleton."""
    parts = opts.parts
    offsets, pos = [], 0
    for t, layouts, _ in members:
        pos = -(-pos // opts.align) * opts.align
        offsets.append(pos)
        pos += int(np.prod([x.local for x in layouts], dtype=np.int64))
    unit = opts.multiple * (parts if flat.per_param and flat.pad_multiple is None else 1)
    total = -(-pos // unit) * unit if unit > 1 else pos
    if total * itemsize(members[0][0].dtype) > LIMIT:  # each member is bounded, their sum is not
        fail(model, members[0][0], flat.span, LayoutError(
            "UCL113", f"a flat buffer of {total:,} elements is beyond 2**62 bytes"), mesh)
    if total % parts:
        fail(model, members[0][0], flat.span, LayoutError(
            "UCL210", f"a flat buffer of {total} elements cannot be split evenly over {'x'.join(opts.axes)}={parts}",
            f"add `pad to multiple_of({' * '.join(opts.axes)})`"), mesh)
    part = total // parts
    covered = [[] for _ in range(parts)]
    pieces = []
    for i, ((t, layouts, _), off) in enumerate(zip(members, offsets)):
        shape = tuple(x.local for x in layouts)
        n = int(np.prod(shape, dtype=np.int64))
        if n == 0 or part == 0:
            continue
        for j in range(off // part, (off + n - 1) // part + 1):
            lo, hi = max(off, j * part), min(off + n, (j + 1) * part)
            covered[j].append((lo - j * part, hi - lo))
            boxes = [(start, size) for _, start, size in flat_boxes(shape, lo - off, hi - off)]
            pieces.append((i, j, off - j * part, shape, boxes))
    gaps = []
    for j in range(parts):
        pos, mine = 0, []
        for lo, n in sorted(covered[j]):
            if lo > pos:
                mine.append((pos, lo - pos))
            pos = lo + n
        if part > pos:
            mine.append((pos, part - pos))
        gaps.append(mine)
    return BufferCut(part, pieces, gaps)


def _cut_buffer(skeleton: BufferCut, members, restricted: dict | None) -> BufferCut:
    """``skeleton`` with each box as per-dim layouts of its member."""
    pieces = [(i, j, base, shape, [_box_dims(members[i][1], start, size, restricted) for start, size in boxes])
              for i, j, base, shape, boxes in skeleton.pieces]
    return BufferCut(skeleton.part, pieces, skeleton.gaps)


def _place_cut(cut: BufferCut, members, fixed, part_coords, suffix, geo: FlatGeometry) -> None:
    """The pieces, gaps and partition datasets of a cut buffer held by the ranks at ``fixed``."""
    part = cut.part
    coords = [{**fixed, **c} for c in part_coords]
    for i, j, base, shape, boxes in cut.pieces:
        geo.pieces.append(FlatPiece(members[i][0].name, coords[j], suffix, base, shape, part, boxes))
    for j, mine in enumerate(cut.gaps):
        geo.partitions.append(FlatPartition(coords[j], suffix, part))
        for start, length in mine:
            geo.gaps.append(FlatGap(coords[j], suffix, part, start, length))


def _box_dims(layouts, start, size, restricted: dict | None) -> tuple[DimLayout, ...]:
    """The box ``start:start+size`` of a local tensor as per-dim layouts; restrictions are looked
    up in ``restricted`` (keyed by the DimLayout object itself) when given."""
    out = []
    for d, s, z in zip(layouts, start, size):
        if s == 0 and z == d.local:
            out.append(d)
        elif restricted is None:
            out.append(d.restrict(s, s + z))
        else:
            key = (d, s, s + z)
            r = restricted.get(key)
            if r is None:
                r = restricted[key] = d.restrict(s, s + z)
            out.append(r)
    return tuple(out)


def _unravel(j: int, axes: list[str], mesh: Mesh) -> dict[str, int]:
    out = {}
    for a in reversed(axes):
        s = mesh.axis_size(a)
        out[a] = j % s
        j //= s
    return out
