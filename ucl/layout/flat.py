"""Flat buffers (ZeRO / distributed-optimizer state): the members held on one coordinate laid out
in one buffer (aligned, padded, bucketed) and cut into partitions over the flat axes; each
partition's pieces as boxes of their tensors, its gaps, and its dataset. A cut is laid out once per
members' local shapes (a skeleton) and only its boxes mapped per tensor-parallel coordinate."""
from __future__ import annotations

import bisect
import functools
import math
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from ..dtypes import itemsize
from ..errors import PlanError
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


class FlatPiece(NamedTuple):
    """Part of one member tensor inside one partition of a flat buffer (a named tuple, not a frozen
    dataclass: a 131,072-rank layout makes some 400,000, and tuples are made several times faster)."""

    name: str
    coords: dict
    suffix: str  # dataset name after the kind: "@flat0", "@flat0.3" or the per_param local name
    base: int  # flat offset of the tensor's first element relative to the partition
    shape: tuple[int, ...]
    part: int  # partition length
    pieces: list


@dataclass(frozen=True, eq=False)
class FlatBuffer:
    """One buffer's partitions, held on member coordinates ``fixed``: partition ``j`` (``parts``
    of them, or only those listed in ``only``) is held by the ranks with ``fixed`` and ``j``
    unravelled over the flat ``axes``; ``cut.gaps(j)`` are its elements no member covers. Stored as
    one record, not one object per partition: a buffer on a 2,048-way dp axis has 2,048."""

    fixed: dict
    axes: tuple[str, ...]
    sizes: tuple[int, ...]  # the flat axes' sizes
    suffix: str
    cut: "BufferCut"
    only: tuple[int, ...] | None = None

    @property
    def partitions(self) -> range | tuple[int, ...]:
        return range(math.prod(self.sizes)) if self.only is None else self.only

    def coords(self, j: int) -> dict[str, int]:
        """Partition ``j``'s coordinates (the member coordinates and the flat axes')."""
        out = dict(self.fixed)
        for a, s in zip(reversed(self.axes), reversed(self.sizes)):
            out[a] = _numbers(s)[j % s]
            j //= s
        return out

    def partition_of(self, coords: dict[str, int]) -> int | None:
        """The partition ranks with ``coords`` hold, or None if they hold none of this buffer."""
        if not all(coords.get(a, 0) == v for a, v in self.fixed.items()):
            return None
        j = 0
        for a, s in zip(self.axes, self.sizes):
            j = j * s + coords.get(a, 0)
        return j if self.only is None or j in self.only else None


@dataclass(frozen=True)
class FlatGeometry:
    pieces: list[FlatPiece]
    buffers: list[FlatBuffer]
    # each member (those with pieces) before it is flattened, per member coordinate: (name,
    # coordinates, [its rank-local layouts]); the cut tiles it exactly (docs/ir.md, P1 on the target)
    wholes: list[tuple[str, dict, list]] = field(default_factory=list)


@functools.cache
def _numbers(n: int) -> tuple[int, ...]:
    """0..n-1 as shared int objects: a 2,048-way axis's partitions would otherwise each make their
    own (ints above 256 are not cached), some 130,000 per 131,072-rank map."""
    return tuple(range(n))


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
    axes, flat_axes = set(), set(opts.axes)
    seen = set()  # (split axes, placement) pairs already looked at: shared objects, a few per stage
    for t in group.members:
        p = placed[t.id]
        key = (id(p.dim_axes), id(p.allowed))  # both alive in ``placed``
        if key in seen:
            continue
        seen.add(key)
        used = {a for axes in p.dim_axes for a in axes}
        clash = used & flat_axes
        if clash:
            ctx.fail(t, group.flat.span, LayoutError(
                "UCL210", f"it is split over {', '.join(sorted(clash))} and also flattened over it"))
        axes |= used | set(p.allowed)
    return sorted(axes - flat_axes)


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


def _alike(group, placed) -> dict[tuple, list[int]]:
    """Members placed alike (a pipeline stage's layers) are held on the same coordinates: each
    placement is tested once per coordinate, not each member."""
    by_id: dict[int, list[int]] = {}  # placements are mostly shared objects (interned by lowering)
    allowed = {}
    for i, t in enumerate(group.members):
        a = placed[t.id].allowed
        found = by_id.get(id(a))
        if found is None:
            found = by_id[id(a)] = []
            allowed[id(a)] = a
        found.append(i)
    alike: dict[tuple, list[int]] = {}
    for k, idx in by_id.items():
        alike.setdefault(tuple((a, tuple(c)) for a, c in allowed[k].items()), []).extend(idx)
    return {key: sorted(idx) for key, idx in alike.items()}


def _buffers_where(ctx: LoweringContext, group, placed, opts: FlatOptions, want):
    """(member coordinate, suffix, members) of the buffers on every member coordinate ``fixed`` for
    which ``want(fixed, held member indices)`` is true; members are (tensor, layouts, local name)."""
    flat, mesh = group.flat, ctx.mesh
    alike = _alike(group, placed)
    placing = sorted({a for allowed in alike for a, _ in allowed})
    held_at: dict[tuple, list[int]] = {}  # coordinates on the placing axes -> the members held there
    for fixed in coordinates(_member_axes(ctx, group, placed, opts), mesh, {}):
        # The buffer on this coordinate: held members in order, each flattened, aligned (which
        # members depends on the placing axes only: found once per stage, not per tp coordinate).
        where = tuple([fixed.get(a) for a in placing])
        held = held_at.get(where)
        if held is None:
            held = held_at[where] = sorted(i for allowed, idx in alike.items()
                                           if all(fixed.get(a) in c for a, c in allowed) for i in idx)
        if not held or not want(fixed, held):
            continue
        entries = []
        shared: dict[int, tuple] = {}  # id of dim trees (interned: a stage's layers share them) -> layouts here
        for i in held:
            t = group.members[i]
            p = placed[t.id]
            layouts = shared.get(id(p.dims)) if ctx.memo is not None else None
            if layouts is None:
                layouts = shared[id(p.dims)] = local_layouts(ctx, t, p.dims, fixed, p.dim_axes)
            entries.append((t, layouts, p.local))
        for b, members in enumerate(_buffers(entries, flat, opts)):
            suffix = members[0][2] if flat.per_param else \
                f"@flat{group.number}" + (f".{b}" if opts.bucket is not None else "")
            yield fixed, suffix, members


def _parts_at(fixed: dict, at, opts: FlatOptions, mesh: Mesh) -> set[int]:
    """The partitions of the buffer on member coordinate ``fixed`` that ranks with coordinates
    ``at`` hold."""
    return {_ravel(c, opts.axes, mesh) for c in at if all(c.get(a, 0) == v for a, v in fixed.items())}


def members_at(ctx: LoweringContext, group, placed, at: list[dict]) -> set[int]:
    """Ids of the members of ``group`` of which ranks with coordinates ``at`` hold elements: only the
    buffers on those coordinates are laid out, and only as skeletons (no boxes)."""
    opts = _flat_options(ctx, group)
    out: set[int] = set()
    skeletons: dict = {}
    for fixed, _, members in _buffers_where(ctx, group, placed, opts,
                                            lambda fixed, held: bool(_parts_at(fixed, at, opts, ctx.mesh))):
        parts = _parts_at(fixed, at, opts, ctx.mesh)
        shapes = (members[0][0].dtype, tuple([tuple([x.local for x in layouts]) for _, layouts, _ in members]))
        skeleton = skeletons.get(shapes)
        if skeleton is None:
            skeleton = skeletons[shapes] = _cut_skeleton(ctx, group.flat, opts, members)
        out.update(m[0].id for i, m in enumerate(members) if any(j in skeleton.partitions_of(i) for j in parts))
    return out


def flat_geometry(ctx: LoweringContext, group, placed, at: list[dict] | None = None,
                  held: bool = False) -> FlatGeometry:
    """The pieces, gaps and partitions of one flat group's buffers; ``placed``: tensor id ->
    ``lower.Placed``. With ``ctx.focus``, only the pieces of those tensors (every one of them), and
    only the buffers holding one; with ``at`` (coordinates), the gaps and partitions that ranks with
    those coordinates hold, and only those (else every buffer's); with ``held`` too, only the
    pieces of those partitions (the members' ``wholes`` are every coordinate's all the same)."""
    flat, mesh, focus = group.flat, ctx.mesh, ctx.focus
    opts = _flat_options(ctx, group)
    geo = FlatGeometry([], [])
    # Buffers with the same member layouts (the same DimLayout objects: dim_layout is cached) cut
    # the same way: pipeline stages of equal depth repeat one cut, which is computed once.
    cuts: dict | None = {} if ctx.memo is not None else None
    restricted: dict = {}  # (DimLayout, lo, hi) -> its restriction: cuts of other stages repeat many
    skeletons: dict = {}  # (dtype, members' local shapes) -> the cut as boxes of local tensors
    skeleton_pieces: dict = {}  # (id of a skeleton above, member) -> its pieces as boxes of its local tensor

    holds_focus: dict[int, bool] = {}  # id of a list of held members (shared per stage, kept alive) -> any focused

    def want(fixed, held) -> bool:
        if focus is None:
            return True
        found = holds_focus.get(id(held))
        if found is None:
            found = holds_focus[id(held)] = any(group.members[i].id in focus for i in held)
        if found:
            return True
        return at is not None and bool(_parts_at(fixed, at, opts, mesh))

    for fixed, suffix, members in _buffers_where(ctx, group, placed, opts, want):
        keep = None if focus is None else frozenset(i for i, m in enumerate(members) if m[0].id in focus)
        parts = None if at is None else _parts_at(fixed, at, opts, mesh)
        only = frozenset(parts) if held and parts is not None else None  # the partitions whose pieces are cut
        if cuts is None:
            cut = _cut_buffer(_cut_skeleton(ctx, flat, opts, members), members, None, keep, None, only)
        else:
            key = (members[0][0].dtype, tuple([layouts for _, layouts, _ in members]), keep, only)
            cut = cuts.get(key)
            if cut is None:
                shapes = (members[0][0].dtype, tuple([tuple([x.local for x in layouts])
                                                      for _, layouts, _ in members]))
                skeleton = skeletons.get(shapes)
                if skeleton is None:
                    skeleton = skeletons[shapes] = _cut_skeleton(ctx, flat, opts, members)
                cut = cuts[key] = _cut_buffer(skeleton, members, restricted, keep, skeleton_pieces, only)
        _place_cut(cut, members, fixed, opts, mesh, suffix, geo, parts)
        geo.wholes.extend((t.name, fixed, [layouts]) for k, (t, layouts, _) in enumerate(members)
                          if keep is None or k in keep)
    return geo


@dataclass(frozen=True)
class BufferCut:
    """One flat buffer cut into partitions, independent of where it is held: ``pieces`` are
    (member index, partition, member's offset relative to the partition, member's local shape,
    boxes); ``holes`` the (start, stop) runs of the buffer that no member covers, ascending. A
    skeleton (:func:`_cut_skeleton`) has no pieces (:func:`_skeleton_pieces` finds a member's); a
    cut (:func:`_cut_buffer`) has them with boxes as per-dim layouts."""

    part: int  # partition length
    pieces: list[tuple[int, int, int, tuple[int, ...], list]]
    holes: tuple[tuple[int, int], ...]
    offsets: tuple[int, ...] = ()  # each member's first element in the buffer
    shapes: tuple[tuple[int, ...], ...] = ()  # each member's local shape

    def gaps(self, j: int) -> list[tuple[int, int]]:
        """The (start, length) runs of partition ``j`` that no member covers, ascending."""
        lo, hi = j * self.part, (j + 1) * self.part
        k = bisect.bisect_right(self.holes, (lo, lo))
        if k and self.holes[k - 1][1] > lo:
            k -= 1
        out = []
        for start, stop in self.holes[k:]:
            if start >= hi:
                break
            a, b = max(start, lo), min(stop, hi)
            if b > a:
                out.append((a - lo, b - a))
        return out

    def all_gaps(self):
        """Every partition's gaps, as (partition, start, length), in buffer order."""
        part = self.part
        if not part:
            return
        for start, stop in self.holes:
            for j in range(start // part, (stop - 1) // part + 1):
                a, b = max(start, j * part), min(stop, (j + 1) * part)
                yield j, a - j * part, b - a

    def partitions_of(self, i: int) -> range:
        """The partitions holding elements of member ``i``."""
        off, n = self.offsets[i], math.prod(self.shapes[i])
        return range(0) if n == 0 or self.part == 0 else range(off // self.part, (off + n - 1) // self.part + 1)


def _cut_skeleton(ctx: LoweringContext, flat, opts: FlatOptions, members) -> BufferCut:
    """Lay ``members`` out in one flat buffer (aligned, padded) and cut it into ``opts.parts``
    partitions: where each member lies and the holes no member covers; each member's boxes come
    from :func:`_skeleton_pieces`. Only the members' local shapes matter: the ranks of a
    tensor-parallel group share one skeleton."""
    parts = opts.parts
    offsets, shapes, holes, pos = [], [], [], 0
    for t, layouts, _ in members:
        start = -(-pos // opts.align) * opts.align
        if start > pos:
            holes.append((pos, start))
        offsets.append(start)
        shapes.append(tuple(x.local for x in layouts))
        pos = start + math.prod(shapes[-1])
    unit = opts.multiple * (parts if flat.per_param and flat.pad_multiple is None else 1)
    total = -(-pos // unit) * unit if unit > 1 else pos
    if total * itemsize(members[0][0].dtype) > LIMIT:  # each member is bounded, their sum is not
        ctx.fail(members[0][0], flat.span, LayoutError(
            "UCL113", f"a flat buffer of {total:,} elements is beyond 2**62 bytes"))
    if total % parts:
        ctx.fail(members[0][0], flat.span, LayoutError(
            "UCL210", f"a flat buffer of {total} elements cannot be split evenly over {'x'.join(opts.axes)}={parts}",
            f"add `pad to multiple_of({' * '.join(opts.axes)})`"))
    if total > pos:
        holes.append((pos, total))
    return BufferCut(total // parts, [], tuple(holes), tuple(offsets), tuple(shapes))


def _skeleton_pieces(skeleton: BufferCut, i: int) -> list:
    """Member ``i``'s pieces of a skeleton, one per partition it reaches, with boxes as (starts,
    sizes) in its local tensor."""
    part, off, shape = skeleton.part, skeleton.offsets[i], skeleton.shapes[i]
    n = math.prod(shape)
    out, at = [], 0  # post-condition, checked as it goes: the boxes tile the member once, in order
    for j in skeleton.partitions_of(i):
        lo, hi = max(off, j * part) - off, min(off + n, (j + 1) * part) - off
        boxes = []
        for flat, start, size in flat_boxes(shape, lo, hi):
            if flat != at:
                break
            boxes.append((start, size))
            at += math.prod(size)
        if at != hi:
            break
        out.append((i, j, off - j * part, shape, boxes))
    if at != n:  # the plan's target proof counts members before the cut, so this is the cut's own check
        raise PlanError(f"flat buffer member {i} of shape {shape}: its pieces over partitions of {part} elements "
                        f"cover {at:,} of its {n:,} elements in order (a bug in the flat cut; please report it)",
                        code="UCL314")
    return out


def _cut_buffer(skeleton: BufferCut, members, restricted: dict | None, keep=None,
                found: dict | None = None, only: frozenset[int] | None = None) -> BufferCut:
    """``skeleton`` with each member's boxes as per-dim layouts (only of members ``keep``, and only
    in partitions ``only``, if given); ``found``: (id of a skeleton kept alive by the caller, member)
    -> its :func:`_skeleton_pieces`, for the cuts of a skeleton's other tensor-parallel coordinates."""
    def pieces_of(k):
        if found is None:
            return _skeleton_pieces(skeleton, k)
        got = found.get((id(skeleton), k))
        if got is None:
            got = found[(id(skeleton), k)] = _skeleton_pieces(skeleton, k)
        return got

    pieces = [(i, j, base, shape, [_box_dims(members[i][1], start, size, restricted) for start, size in boxes])
              for k in range(len(members)) if keep is None or k in keep
              for i, j, base, shape, boxes in pieces_of(k) if only is None or j in only]
    return BufferCut(skeleton.part, pieces, skeleton.holes, skeleton.offsets, skeleton.shapes)


def _place_cut(cut: BufferCut, members, fixed, opts: FlatOptions, mesh: Mesh, suffix, geo: FlatGeometry,
               parts: set[int] | None) -> None:
    """The pieces of a cut buffer held by the ranks at ``fixed``, and the buffer (its partitions and
    their gaps: ``parts`` only, if given)."""
    part = cut.part
    buffer = FlatBuffer(fixed, opts.axes, tuple(mesh.axis_size(a) for a in opts.axes), suffix, cut,
                        None if parts is None else tuple(sorted(parts)))
    coords: dict[int, dict] = {}  # partition -> its coordinates, made once: its pieces share them
    names = [m[0].name for m in members]
    append = geo.pieces.append
    for i, j, base, shape, boxes in cut.pieces:
        c = coords.get(j)
        if c is None:
            c = coords[j] = buffer.coords(j)
        append(FlatPiece(names[i], c, suffix, base, shape, part, boxes))
    geo.buffers.append(buffer)


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


def _ravel(coords: dict, axes, mesh: Mesh) -> int:
    """The partition of a rank with ``coords``: its coordinates on the flat ``axes``, row-major."""
    j = 0
    for a in axes:
        j = j * mesh.axis_size(a) + coords.get(a, 0)
    return j
