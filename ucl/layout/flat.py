"""Flat buffers (ZeRO / distributed-optimizer state): the members held on one coordinate laid out
in one buffer (aligned, padded, bucketed) and cut into partitions over the flat axes; each
partition's pieces as boxes of their tensors, its gaps, and its dataset. A cut is laid out once per
members' local shapes (a skeleton) and only its boxes mapped per tensor-parallel coordinate."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..dtypes import itemsize
from ..lang.expr import LIMIT
from .algebra import DimLayout, LayoutError
from .boxes import flat_boxes
from .context import LoweringContext
from .local import coordinates, local_layouts
from .mesh import Mesh


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


def _flat_options(ctx: LoweringContext, group) -> FlatOptions:
    flat, first, mesh = group.flat, group.members[0], ctx.mesh
    axes = tuple(a.name for a in flat.axes)

    def number(expr, default):
        return ctx.evaluate(first, expr) if expr is not None else default

    opts = FlatOptions(axes, int(np.prod([mesh.axis_size(a) for a in axes], dtype=np.int64)),
                       number(flat.align, 1), number(flat.pad_multiple, 1), number(flat.bucket, None))
    for what, v in (("align", opts.align), ("pad to multiple_of", opts.multiple),
                    ("bucket", opts.bucket if opts.bucket is not None else 1)):
        if v < 1:
            ctx.fail(first, flat.span, LayoutError("UCL210", f"flat {what} {v}: must be at least 1"))
    return opts


def _member_axes(ctx: LoweringContext, group, placed, opts: FlatOptions) -> list[str]:
    """Axes other than the flat ones over which the members' buffers differ."""
    axes = set()
    for t in group.members:
        p = placed[t.id]
        used = {a for axes in p.dim_axes for a in axes}
        clash = used & set(opts.axes)
        if clash:
            ctx.fail(t, group.flat.span, LayoutError(
                "UCL210", f"it is split over {', '.join(sorted(clash))} and also flattened over it"))
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


def flat_geometry(ctx: LoweringContext, group, placed) -> FlatGeometry:
    """The pieces, gaps and partitions of one flat group's buffers (only those holding a tensor of
    ``ctx.focus``, when given); ``placed``: tensor id -> ``lower.Placed``."""
    flat, mesh, focus = group.flat, ctx.mesh, ctx.focus
    opts = _flat_options(ctx, group)
    parts = opts.parts
    part_coords = [_unravel(j, list(opts.axes), mesh) for j in range(parts)]
    geo = FlatGeometry([], [], [])
    # Buffers with the same member layouts (the same DimLayout objects: dim_layout is cached) cut
    # the same way: pipeline stages of equal depth repeat one cut, which is computed once.
    cuts: dict | None = {} if ctx.memo is not None else None
    restricted: dict = {}  # (DimLayout, lo, hi) -> its restriction: cuts of other stages repeat many
    skeletons: dict = {}  # (dtype, members' local shapes) -> the cut as boxes of local tensors
    # Members placed alike (a pipeline stage's layers) are held on the same coordinates: test
    # each placement once per coordinate, not each member.
    alike: dict[tuple, list[int]] = {}
    for i, t in enumerate(group.members):
        alike.setdefault(tuple((a, tuple(c)) for a, c in placed[t.id].allowed.items()), []).append(i)
    for fixed in coordinates(_member_axes(ctx, group, placed, opts), mesh, {}):
        # The buffer on this coordinate: held members in order, each flattened, aligned.
        held = sorted(i for allowed, idx in alike.items()
                      if all(fixed.get(a) in c for a, c in allowed) for i in idx)
        if focus is not None and not any(group.members[i].id in focus for i in held):
            continue
        entries = []
        for i in held:
            t = group.members[i]
            p = placed[t.id]
            entries.append((t, local_layouts(ctx, t, p.dims, fixed, p.dim_axes), p.local))
        for b, members in enumerate(_buffers(entries, flat, opts) if entries else []):
            suffix = members[0][2] if flat.per_param else \
                f"@flat{group.number}" + (f".{b}" if opts.bucket is not None else "")
            if cuts is None:
                cut = _cut_buffer(_cut_skeleton(ctx, flat, opts, members), members, None)
            else:
                key = (members[0][0].dtype, tuple([layouts for _, layouts, _ in members]))
                cut = cuts.get(key)
                if cut is None:
                    shapes = (members[0][0].dtype, tuple([tuple([x.local for x in layouts])
                                                          for _, layouts, _ in members]))
                    skeleton = skeletons.get(shapes)
                    if skeleton is None:
                        skeleton = skeletons[shapes] = _cut_skeleton(ctx, flat, opts, members)
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


def _cut_skeleton(ctx: LoweringContext, flat, opts: FlatOptions, members) -> BufferCut:
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
        ctx.fail(members[0][0], flat.span, LayoutError(
            "UCL113", f"a flat buffer of {total:,} elements is beyond 2**62 bytes"))
    if total % parts:
        ctx.fail(members[0][0], flat.span, LayoutError(
            "UCL210", f"a flat buffer of {total} elements cannot be split evenly over {'x'.join(opts.axes)}={parts}",
            f"add `pad to multiple_of({' * '.join(opts.axes)})`"))
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
