"""Lowering: a bound Model on a Mesh -> ShardMap (which boxes of each tensor every rank holds).

Work is done per *distinct coordinate tuple on the axes that matter* for a tensor, never per rank:
the ranks sharing a tuple are replicas and are expanded with numpy only when a plan needs them.
"""
from __future__ import annotations

import gc
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import numpy as np

from ..lang.check import PARAM
from .algebra import DimLayout, DimSpec, dim_layout
from .bind import Model
from .boxes import Slot
from .context import LoweringContext, TensorFailure
from .derived import Derived
from .dims import dims_of, universal_dims
from .fit import mesh_report, note_shared, warn_loose_fit
from .flat import FlatBuffer, flat_geometry, members_at
from .local import coordinates, local_layouts, split_axes
from .mesh import Mesh
from ..errors import UclError
from .place import place


@dataclass(eq=False, slots=True)
class Holding:
    """What the ranks with coordinates ``fixed`` hold of one tensor: boxes (``pieces``) of it, stored
    in ``slot``."""

    fixed: dict[str, int]  # coordinates on the axes that matter; other axes hold replicas
    slot: Slot
    pieces: list[tuple[DimLayout, ...]]  # boxes of the slot's tensor, as per-dim runs

    def real_volume(self) -> int:
        return sum(int(np.prod([d.segs[:, 2].sum() for d in p], dtype=np.int64)) for p in self.pieces)


@dataclass(frozen=True, slots=True)
class FlatFill:
    """Elements ``[start, start + length)`` of a flat buffer that hold no tensor (alignment, padding)."""

    fixed: dict
    slot: Slot
    start: int
    length: int


@dataclass(frozen=True, slots=True)
class DatasetSlot:
    """A dataset that every rank with coordinates ``fixed`` holds."""

    fixed: dict
    key: str
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True, eq=False)
class FlatDatasets:
    """The partitions of one flat buffer as datasets ``key`` of ``(buffer.cut.part,)`` elements (see
    :class:`FlatBuffer`): one record per buffer, expanded per partition only where asked."""

    key: str
    dtype: str
    buffer: FlatBuffer

    @property
    def slot(self) -> Slot:
        part = self.buffer.cut.part
        return Slot(self.key, 0, (part,), (part,))


@dataclass(eq=False)
class ShardMap:
    """A model on a mesh: which boxes of each tensor the ranks hold, and which datasets they store."""

    mesh: Mesh
    model: Model
    holdings: list[list[Holding]]  # by tensor id
    whole_datasets: list[DatasetSlot] = field(default_factory=list)  # of tensors that are not flat
    flat_datasets: list[FlatDatasets] = field(default_factory=list)  # flat buffers, with their gaps
    # None: every tensor; else the ids of the tensors whose holdings are complete (``lower(tensors=)``;
    # with ``held``, a flat tensor's holdings are those of the partitions planned for only)
    focus: frozenset[int] | None = None
    # by tensor id, of the tensors in flat buffers: per member coordinate, (coordinates, [its rank-local
    # layouts]) before flattening, always complete (the target's proof of P1 is made on them: docs/ir.md)
    unflattened: dict[int, list[tuple[dict, list]]] = field(default_factory=dict)
    derived: Derived = field(default_factory=Derived, repr=False)  # caches over this map (plan.compile's)
    _expanded: dict = field(default_factory=dict, repr=False)  # ``datasets`` and ``flat_fills``, once built

    @property
    def datasets(self) -> list[DatasetSlot]:
        """Every dataset, one per partition of a flat buffer (built on first use)."""
        if "datasets" not in self._expanded:
            self._expanded["datasets"] = self.whole_datasets + [
                DatasetSlot(f.buffer.coords(j), f.key, (f.buffer.cut.part,), f.dtype)
                for f in self.flat_datasets for j in f.buffer.partitions]
        return self._expanded["datasets"]

    @property
    def flat_fills(self) -> list[FlatFill]:
        """Every gap of a flat buffer's partitions (built on first use)."""
        if "flat_fills" not in self._expanded:
            self._expanded["flat_fills"] = [
                FlatFill(f.buffer.coords(j), f.slot, start, length)
                for f in self.flat_datasets for j in f.buffer.partitions for start, length in f.buffer.cut.gaps(j)]
        return self._expanded["flat_fills"]

    def ranks(self, fixed: dict) -> np.ndarray:
        return self.mesh.ranks_where(fixed)

    def rank_datasets(self, rank: int, stored: bool = False) -> dict[str, tuple[tuple, str]]:
        """Every dataset rank ``rank`` holds: key -> (shape, logical dtype). ``stored``: only those it
        stores, the format-2 rule (docs/format.md): a dataset that several ranks hold (replicas: the
        ranks that differ only on axes it is not fixed on) is stored by the first of them, the one
        whose coordinates on those axes are all 0; that is the copy plans read."""
        c = self.mesh.coords(rank) if not self.mesh.is_universal else {}

        def mine(fixed) -> bool:
            return all(c.get(a, 0) == v for a, v in fixed.items()) and \
                (not stored or all(v == 0 for a, v in c.items() if a not in fixed))

        out = {d.key: (d.shape, d.dtype) for d in self.whole_datasets if mine(d.fixed)}
        for f in self.flat_datasets:  # the partition this rank holds, if any: found by its coordinates
            j = f.buffer.partition_of(c)
            if j is not None and (not stored or mine(f.buffer.coords(j))):
                out[f.key] = ((f.buffer.cut.part,), f.dtype)
        return out


# ---- lowering -----------------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class _Lowered:
    """What :func:`lower` keeps of one model, by mesh (lowering is pure): the whole map; until it
    exists, the maps focused on some tensors; and each tensor's placement (:func:`_placement_of`)."""

    whole: dict[Mesh, ShardMap] = field(default_factory=dict)
    focused: dict[Mesh, dict[tuple, ShardMap]] = field(default_factory=dict)
    # until the whole map exists, per focus (tensor ids) what the ranks planned for do not change
    # (:func:`_stem`): the next rank of a stage only cuts its own flat partitions
    stems: dict[Mesh, dict[frozenset[int], "_Stem"]] = field(default_factory=dict)
    # (and ("noted", alike key) -> True where that placement notes an empty stage)
    placements: dict[Mesh, dict[int | tuple, tuple[dict[str, list[int]], str] | bool]] = field(default_factory=dict)
    # by mesh, equal placements (every layer of a stage's) as one dict: what is keyed by the id of a
    # placement below is then found once per stage, not once per parameter
    interned: dict[Mesh, dict[tuple, dict[str, list[int]]]] = field(default_factory=dict)


_FOCUSED_MAPS = 64  # focused maps kept per mesh before a process lowers the whole model once instead


def lower(model: Model, mesh: Mesh, *, reuse: bool = True, tensors: frozenset[int] | None = None,
          at: list[dict[str, int]] | None = None, held: bool = False) -> ShardMap:
    """The ShardMap of ``model`` on ``mesh`` (cached on the model: lowering is pure).
    ``reuse=False`` computes it afresh, every tensor and flat buffer on its own (for tests).
    ``tensors`` (ids): a map whose holdings are complete for those tensors at least (``focus`` says
    which), lowering only what they need (the flat buffers they lie in, and in those only their
    pieces): what a plan for a few ranks reads and proves. Only those tensors are checked against
    the mesh. ``at`` (with ``tensors``): the coordinates of the ranks planned for; the flat buffers'
    datasets and fills are those of these ranks only. ``held`` (with ``at``): flat members of
    ``tensors`` that no rank at ``at`` holds are left out (``tensors`` may come from placement
    alone, which cannot tell the partitions of a ZeRO buffer apart), and the flat members' holdings
    are those of the partitions at ``at`` only (their ``unflattened`` layouts are complete: a
    target's proof needs no more). The whole map is returned when it is cached."""
    if not reuse:
        with gc_paused():
            return _lower(model, mesh, False)
    cache = model.derived.of(_Lowered)
    whole = cache.whole.get(mesh)
    if whole is not None:
        return whole
    if tensors is not None:
        focused = cache.focused.setdefault(mesh, {})
        key = (tensors, None if at is None else tuple(tuple(sorted(c.items())) for c in at), held)
        # a process planning many ranks one at a time lowers the whole model once instead
        if key in focused or len(focused) < _FOCUSED_MAPS:
            sm = focused.get(key)
            if sm is None:
                with gc_paused():
                    sm = focused[key] = _lower(model, mesh, True, tensors, at, held)
            return sm
    with gc_paused():
        whole = cache.whole[mesh] = _lower(model, mesh, True)
    cache.focused.pop(mesh, None)  # the whole map serves every later plan
    cache.stems.pop(mesh, None)
    return whole


def lowered(model: Model, mesh: Mesh) -> str | None:
    """What :func:`lower` holds of ``model`` on ``mesh``: "whole", "focused" (maps complete for some
    tensors only) or None."""
    cache = model.derived.of(_Lowered)
    return "whole" if mesh in cache.whole else "focused" if cache.focused.get(mesh) else None


def tensors_on(model: Model, mesh: Mesh, coords: list[dict[str, int]]) -> frozenset[int]:
    """Ids of the tensors placed (``on``, ``index ... over``) where some rank with ``coords`` is, from
    placement alone: a superset of what those ranks hold. A tensor whose placement fails is included
    (its lowering reports it)."""
    ctx = LoweringContext.of(model, mesh)
    out = []
    there: dict[int, bool] = {}  # id of a placement (shared by a parameter's kinds) -> where the ranks are
    cache = _placements(ctx)
    for t in model.tensors:
        try:
            allowed, _ = _placement_of(ctx, t, cache)
        except (TensorFailure, UclError):
            out.append(t.id)
            continue
        found = there.get(id(allowed))
        if found is None:
            found = there[id(allowed)] = any(all(c.get(a, 0) in v for a, v in allowed.items()) for c in coords)
        if found:
            out.append(t.id)
    return frozenset(out)


def _placement_of(ctx: LoweringContext, t, cache: dict | None = None):
    """:func:`place` without notes, cached on the model per mesh (``cache``: that cache, from
    :func:`_placements`): planning one rank's load places every tensor to find its own
    (:func:`tensors_on`) and again to lay out the flat buffers they share
    (:func:`_place_other_members`). Callers do not change what it returns."""
    if cache is None:
        cache = _placements(ctx)
    found = cache.get(t.id)
    if found is None:
        # the kinds of a parameter (fp32, exp_avg, ...) follow its rule: one placement for them all
        alike = (id(t.rule), id(t.placement), t.name)  # the rules live as long as the model
        found = cache.get(alike)
        if found is None:
            notes: dict = {}
            allowed, local = place(ctx, t, notes)
            found = cache[alike] = (_interned(ctx, allowed), local)
            if notes:  # an empty stage: :func:`_placed` notes it for each tensor placed so
                cache[("noted",) + alike] = True
        cache[t.id] = found
    return found


def _placed(ctx: LoweringContext, t, cache: dict, notes: dict) -> tuple[dict[str, list[int]], str]:
    """:func:`place` with ``notes``, from the cache where the placement notes nothing (the kinds of a
    parameter, and on the target mesh every tensor, were placed already)."""
    if ctx.memo is None:  # lower(reuse=False): every tensor on its own
        return place(ctx, t, notes)
    found = _placement_of(ctx, t, cache)
    if ("noted", id(t.rule), id(t.placement), t.name) in cache:
        place(ctx, t, notes)
    return found


def _interned(ctx: LoweringContext, allowed: dict[str, list[int]]) -> dict[str, list[int]]:
    """``allowed`` as the one dict of its value on this mesh (placements are never changed)."""
    if ctx.memo is None:  # lower(reuse=False): every tensor on its own
        return allowed
    key = tuple([(a, tuple(v)) for a, v in allowed.items()])
    return ctx.model.derived.of(_Lowered).interned.setdefault(ctx.mesh, {}).setdefault(key, allowed)


def _placements(ctx: LoweringContext) -> dict:
    return ctx.model.derived.of(_Lowered).placements.setdefault(ctx.mesh, {})


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
            if gc.get_count()[0] > _PROMOTE_AFTER and not gc.get_freeze_count():
                # what was made is cached (it lives as long as the model): put it in the oldest
                # generation at once (freeze + unfreeze moves lists, scans nothing) instead of
                # having the next young collection walk every object (0.3 s at 131,072 ranks)
                gc.freeze()
                gc.unfreeze()
            gc.enable()


_PROMOTE_AFTER = 100_000  # objects made while paused


def _lower(model: Model, mesh: Mesh, reuse: bool, focus: frozenset[int] | None = None,
           at: list[dict] | None = None, held: bool = False) -> ShardMap:
    sm = ShardMap(mesh, model, [[] for _ in model.tensors], focus=focus)
    if mesh.is_universal:
        for t in model.tensors:
            layouts = tuple(dim_layout(d, ()) for d in universal_dims(t.shape))
            sm.holdings[t.id].append(Holding({}, Slot(t.key, 0, t.shape, t.shape), [layouts]))
            sm.whole_datasets.append(DatasetSlot({}, t.key, t.shape, t.dtype))
        return sm
    if reuse and focus is not None:  # one rank's plan after another's: placed once per focus
        stems = model.derived.of(_Lowered).stems.setdefault(mesh, {})
        stem = stems.get(focus)
        if stem is None:
            stem = _stem(model, mesh, reuse, focus)
            if len(stems) < _FOCUSED_MAPS:
                stems[focus] = stem
    else:
        stem = _stem(model, mesh, reuse, focus)
    ctx, placed, in_focus = stem.ctx, stem.placed, stem.in_focus
    for tid, hs in stem.holdings.items():  # shared Holding objects: nothing changes them
        sm.holdings[tid].extend(hs)
    sm.whole_datasets.extend(stem.whole_datasets)

    groups = [g for g in model.flat_groups if focus is None or g.id in in_focus]
    if held and focus is not None and at is not None:
        # ZeRO partitions: of the flat members placed where the ranks are, those they hold
        kept = {i for i in focus if model.tensors[i].flat is None}
        probed: dict[tuple, set[str]] = {}  # the kinds of one statement hold alike: probed once
        for g in groups:
            key = (g.number, tuple(t.name for t in g.members))
            names = probed.get(key)
            if names is None:
                names = probed[key] = {model.tensors[i].name for i in members_at(ctx, g, placed, at)}
            kept |= {t.id for t in g.members if t.name in names}
        focus = sm.focus = frozenset(kept)
        ctx = replace(ctx, focus=focus)
    geometry_cache: dict = {}
    for g in groups:
        _lower_flat(ctx, g, placed, sm, geometry_cache, at, held and focus is not None and at is not None)
    return sm


@dataclass(frozen=True, eq=False)
class _Stem:
    """Lowering ``focus`` (tensor ids; None: every tensor) up to the flat buffers, which is all the
    coordinates planned for do not change: each tensor placed, the holdings and datasets of those
    that are not flat."""

    ctx: LoweringContext
    placed: dict  # tensor id -> Placed (the other members of their flat groups too)
    in_focus: set  # flat groups with a member in ``focus``, by index
    holdings: dict[int, list[Holding]]
    whole_datasets: list[DatasetSlot]


def _stem(model: Model, mesh: Mesh, reuse: bool, focus: frozenset[int] | None) -> _Stem:
    ctx = LoweringContext.of(model, mesh, reuse, focus)
    todo, members, in_focus = range(len(model.tensors)), [], set()
    if focus is not None:  # a flat buffer is laid out from all its members: they are placed too (after)
        todo = sorted(focus)
        in_focus = {model.tensors[i].flat_group for i in focus} - {-1}  # flat groups, by index
        members = sorted({m.id for g in in_focus for m in model.flat_groups[g].members} - focus)
    holdings: dict[int, list[Holding]] = {}
    whole_datasets: list[DatasetSlot] = []
    placed = {}  # tensor id -> Placed
    failures: list[TensorFailure] = []  # every tensor that does not fit, reported together
    notes: dict = {}  # what fits only loosely (empty stages, shared elements): warned about once
    axes_of: dict[int, tuple] = {}  # id of dim trees (kept by the memo: a parameter's kinds share them) -> split axes
    # (id of dim trees, id of a placement; both interned) -> every coordinate's (coordinates, local
    # shape, pieces): the tensors of one shape on one stage (every layer's) hold alike, so they share
    # these objects and what later layers find from them by identity (proofs, rows: one per shape)
    template: dict[tuple[int, int], list] = {}
    cache = _placements(ctx)
    for t in (model.tensors[i] for i in todo):
        try:
            dims = _dims(ctx, t)
            allowed, local = _placed(ctx, t, cache, notes)
            dim_axes = axes_of.get(id(dims)) if ctx.memo is not None else None
            if dim_axes is None:
                dim_axes = axes_of[id(dims)] = split_axes(dims)
            placed[t.id] = Placed(dims, allowed, local, dim_axes)
            if t.kind == PARAM:
                note_shared(t, dims, mesh, notes)
            if t.flat is not None:
                continue
            held = template.get((id(dims), id(allowed))) if ctx.memo is not None else None
            if held is None:
                axes = sorted({a for axes in dim_axes for a in axes})
                held = []
                for fixed in coordinates(axes, mesh, allowed):
                    layouts = local_layouts(ctx, t, dims, fixed, dim_axes)
                    held.append((fixed, tuple(x.local for x in layouts), [layouts]))
                template[(id(dims), id(allowed))] = held
            key = f"{t.kind}/{local}"
            for fixed, shape, pieces in held:
                holdings.setdefault(t.id, []).append(Holding(fixed, Slot(key, 0, shape, shape), pieces))
                whole_datasets.append(DatasetSlot(fixed, key, shape, t.dtype))
        except TensorFailure as e:
            failures.append(e)
    if members and not failures:
        try:
            _place_other_members(ctx, members, placed)
        except TensorFailure as e:
            failures.append(e)
    if failures:
        raise mesh_report(model, mesh, failures)
    warn_loose_fit(model, mesh, notes)
    return _Stem(ctx, placed, in_focus, holdings, whole_datasets)


def _dims(ctx: LoweringContext, t) -> tuple[DimSpec, ...]:
    """``t``'s dim trees; with a memo, equal trees (every layer's) as one object, kept alive by it."""
    memo = ctx.memo
    if memo is None:
        return () if t.scalar else dims_of(ctx, t)
    key = (id(t.rule), t.name, t.scalar)
    found = memo.dims.get(key)
    if found is None:
        if t.scalar:
            found = ()
        else:
            trees = [memo.tree(d) for d in dims_of(ctx, t)]
            found = memo.dim_tuples.setdefault(tuple(map(id, trees)), tuple(trees))  # equal trees, one tuple
        memo.dims[key] = found
    return found


@dataclass(frozen=True)
class Placed:
    """One tensor on a mesh before flattening: its dim trees, the coordinates it is placed on
    (axis -> allowed coordinates) and its rank-local name."""

    dims: tuple[DimSpec, ...]
    allowed: dict[str, list[int]]
    local: str
    dim_axes: tuple[tuple[str, ...], ...]  # each dim's split axes, sorted


def _place_other_members(ctx: LoweringContext, ids: list[int], placed: dict) -> None:
    """Place flat members outside a focused lowering's tensors. One that no coordinate shares with a
    focused tensor (another pipeline stage) lies in no buffer the focus needs: only its placement and
    split axes matter (the axes buffers differ over), and those come from its rule, its dims are built
    once per rule. The others are placed in full."""
    # placements are interned (:func:`_interned`): the distinct ones are a few per stage
    near = [[(a, set(c)) for a, c in allowed.items()]
            for allowed in {id(p.allowed): p.allowed for p in placed.values()}.values()]
    by_rule: dict[int, tuple] = {}
    shares: dict[int, bool] = {}  # id of a placement -> near a focused one
    far: dict[int, Placed] = {}  # id of a placement found by _placement_of (a parameter's kinds share it) -> its Placed
    axes_of: dict[int, tuple] = {}  # id of dim trees (kept by the memo) -> split axes
    cache = _placements(ctx)
    for t in (ctx.model.tensors[i] for i in ids):
        found = _placement_of(ctx, t, cache)
        p = far.get(id(found))
        if p is not None:
            placed[t.id] = p
            continue
        allowed, local = found
        near_one = shares.get(id(allowed))
        if near_one is None:
            near_one = shares[id(allowed)] = any(all(set(allowed.get(a, c)) & c for a, c in other) for other in near)
        if near_one:
            dims = _dims(ctx, t)
            axes = axes_of.get(id(dims))
            if axes is None:
                axes = axes_of[id(dims)] = split_axes(dims)
            placed[t.id] = Placed(dims, allowed, local, axes)
            continue
        axes = by_rule.get(id(t.rule))
        if axes is None:
            axes = by_rule[id(t.rule)] = split_axes(() if t.scalar else dims_of(ctx, t))
        placed[t.id] = far[id(found)] = Placed((), allowed, local, axes)


def _lower_flat(ctx: LoweringContext, group, placed, sm: ShardMap, cache: dict, at: list[dict] | None,
                held: bool = False):
    """Place one flat group's tensors. The geometry is shared by every kind of the same statement
    with the same members (fp32, exp_avg, exp_avg_sq), so it is computed once. ``ctx.focus``: only
    the buffers holding one of those tensors, and only their pieces; ``at``: only the datasets and
    gaps of ranks at those coordinates."""
    if not group.members:
        return
    focus = ctx.focus
    key = (group.number, tuple(t.name for t in group.members),
           None if focus is None else frozenset(t.name for t in group.members if t.id in focus))
    if key not in cache:
        geo = flat_geometry(ctx, group, placed, at, held)
        # equal slots recur on every coordinate: each piece's (distinct slot, its holder), found once
        # for every kind sharing the geometry
        distinct: dict[tuple, int] = {}
        slot_of = [distinct.setdefault((p.suffix, p.base, p.shape, p.part), len(distinct)) for p in geo.pieces]
        wholes: dict[str, list] = {}  # shared by the kinds, as their pieces are
        for name, fixed, layouts in geo.wholes:
            wholes.setdefault(name, []).append((fixed, layouts))
        cache[key] = geo, list(distinct), slot_of, [p.name for p in geo.pieces], wholes
    geo, distinct, slot_of, names, wholes = cache[key]
    for t in group.members:
        if t.name in wholes:
            sm.unflattened[t.id] = wholes[t.name]
    prefix = f"{group.kind}/"
    slots = [Slot(prefix + suffix, base, shape, (part,)) for suffix, base, shape, part in distinct]
    held = {t.name: sm.holdings[t.id] for t in group.members}
    for p, name, s in zip(geo.pieces, names, slot_of):
        held[name].append(Holding(p.coords, slots[s], p.pieces))
    for b in geo.buffers:
        sm.flat_datasets.append(FlatDatasets(prefix + b.suffix, group.members[0].dtype, b))
