"""Compiling a plan: ``compile(model, src, dst)`` is pure. Before any byte moves it proves coverage: every element of
every target dataset has exactly one source element or is a declared fill (padding).
"""
from __future__ import annotations

import itertools
from array import array
from dataclasses import dataclass, field

import numpy as np

from ..errors import PlanError, UclError, detach
from ..layout.algebra import I64
from ..layout.bind import Model
from ..layout.boxes import Slot
from ..layout.lower import ShardMap, gc_paused, lower, tensors_on
from ..layout.mesh import Mesh, as_mesh
from .ir import DATASET_COLUMNS, Plan, int_dtype
from .geometry import Geometries, PieceKeys, Uses, fill_boxes, held_keys, piece_boxes, pieces_rows
from .proof import dedup_sources, piece_volume
from .ranksets import RankSetBuilder, sorted_distinct

# ---- compilation ---------------------------------------------------------------------------------
def compile(model: Model, src: Mesh | str, dst: Mesh | str, ranks=None) -> Plan:
    """Plan the move of every tensor of ``model`` from layout ``src`` to layout ``dst`` (only for the
    target ``ranks`` if given: what one rank needs to load, without planning every other rank)."""
    try:
        return _compile(model, as_mesh(src), as_mesh(dst), ranks)
    except UclError as e:
        # lowering translates internal exceptions (LayoutError, ExprError) inside `except` blocks
        raise detach(e) from None


def compile_between(src_model: Model, src: Mesh | str, dst_model: Model, dst: Mesh | str, ranks=None) -> Plan:
    """Plan the move of ``dst_model``'s tensors from ``src_model``'s layout on ``src`` to
    ``dst_model``'s layout on ``dst``: two specs describing the same tensors (same names, kinds,
    global shapes and dtypes), e.g. a checkpoint written by FSDP2 and a job that runs TP."""
    try:
        return _compile(src_model, as_mesh(src), as_mesh(dst), ranks, dst_model)
    except UclError as e:
        raise detach(e) from None


def _matching_source(src_model: Model, t):
    """The source tensor that holds target tensor ``t``."""
    try:
        s = src_model.tensor(t.key)
    except KeyError:
        raise PlanError(f"the source has no {t.key} {list(t.shape)} ({t.dtype}); it was written for other "
                        "parameters or optimizer states", code="UCL316") from None
    if tuple(s.shape) != tuple(t.shape) or s.dtype != t.dtype:
        hint = "" if tuple(s.shape) != tuple(t.shape) else (
            f": plans copy bytes and never convert; give the target tensor the source's dtype (e.g. cast the model "
            f"to {s.dtype} before loading it) and convert after the load")
        raise PlanError(f"{t.key}: the source holds {list(s.shape)} {s.dtype}, the target wants {list(t.shape)} "
                        f"{t.dtype}{hint}", code="UCL316")
    return s


def _compile(model: Model, src: Mesh, dst: Mesh, ranks, dst_model: Model | None = None) -> Plan:
    with gc_paused():
        return _compile_unpaused(model, src, dst, ranks, dst_model)


def _compile_unpaused(model: Model, src: Mesh, dst: Mesh, ranks, dst_model: Model | None = None) -> Plan:
    src_model, model = model, (dst_model or model)
    wanted = None if ranks is None else sorted_distinct(list(ranks))
    # a few target ranks (one rank's load): test their coordinates instead of enumerating the mesh,
    # and lower only the tensors placed where they are (on both meshes)
    few = None if wanted is None or len(wanted) > 64 or dst.is_universal else \
        [(int(r), dst.coords(int(r))) for r in wanted]
    if few is None:
        S, T = lower(src_model, src), lower(model, dst)
    else:
        # the target map: the tensors placed where the ranks are, narrowed to those they hold (a
        # ZeRO partition holds a few of a stage's tensors), with the datasets of those ranks only
        at = [c for _, c in few]
        T = lower(model, dst, tensors=tensors_on(model, dst, at), at=at, held=True)
        focus = frozenset(tid for tid, _ in _matching(T, "holdings", lambda: _holding_ids(T),
                                                      lambda e: T.holdings[e[0]][e[1]].fixed, at))
        src_focus = focus if src_model is model else frozenset(
            _matching_source(src_model, model.tensors[i]).id for i in focus)
        S = lower(src_model, src, tensors=src_focus, at=[])  # sources only: no datasets

    def target_ranks(fixed) -> np.ndarray:
        if few is not None:
            return np.array([r for r, c in few if all(c.get(a, 0) == v for a, v in fixed.items())], dtype=I64)
        r = T.ranks(fixed)
        return r if wanted is None else r[np.isin(r, wanted)]

    # Rows go to the set of target ranks sharing the coordinates ``fixed`` (replicas), stored once.
    sets = RankSetBuilder(dst.size)
    set_of_fixed: dict[tuple, int] = {}

    strides = dst.strides if wanted is None and not dst.is_universal else {}

    def rank_set(fixed) -> int:
        """Id of the set of target ranks with coordinates ``fixed``; -1 if none is wanted."""
        if strides and len(fixed) >= len(strides):  # every axis fixed (a ZeRO partition): one rank
            try:
                r = sum([fixed[a] * s for a, s in strides.items()])  # as ranks_where: other axes ignored
            except KeyError:
                pass
            else:
                return sets.one(r)
        key = tuple(sorted(fixed.items()))
        i = set_of_fixed.get(key)
        if i is None:
            ranks = target_ranks(fixed)
            i = set_of_fixed[key] = -1 if not len(ranks) else sets.add(ranks)
        return i

    def buffer_sets(b, js: np.ndarray) -> np.ndarray:
        """:func:`rank_set` of partitions ``js`` of flat buffer ``b``, all at once where each is one rank."""
        if strides and set(strides) <= set(b.fixed) | set(b.axes):
            coords = np.unravel_index(js, b.sizes) if len(b.axes) else ()
            r = sum(int(v) * strides[a] for a, v in b.fixed.items() if a in strides) + \
                sum([c.astype(I64) * strides.get(a, 0) for a, c in zip(b.axes, coords)], np.zeros(len(js), dtype=I64))
            return sets.singles(r)
        return np.array([rank_set(b.coords(int(j))) for j in js], dtype=I64)

    K = max([len(t.shape) for t in model.tensors] + [1])
    slot_ids: dict[Slot, int] = {}

    def sid(slot: Slot) -> int:
        return slot_ids.setdefault(slot, len(slot_ids))

    geometry: dict[bytes, int] = {}  # target piece key + source boxes' id -> geometry id; layers repeat geometry
    # (id of a target piece list) << 32 | source boxes (one int, not a tuple: some 56,000 keys outlive
    # the loop) -> its geometries, as int64 bytes
    geos_of_list: dict[int, bytes] = {}
    piece_keys = PieceKeys()  # held_keys of this plan's piece lists (they recur across tensors)
    geos = Geometries(K)
    source_ids: dict[tuple, int] = {}
    source_of_list: dict[int, list] = {}  # id of a (cached, alive) proof -> [source key, ranks, holdings, proof]
    src_ranks, src_slots, src_base = [], [], 0  # every tensor's deduplicated sources, one after another
    uses = Uses()  # (geometry, tensor, rank set, target slot, sources) per target piece
    if few is None:
        todo = ((t, T.holdings[t.id]) for t in model.tensors)
    else:  # only the tensors the wanted ranks hold, found through an index (cached on the model)
        held_ids = _matching(T, "holdings", lambda: _holding_ids(T), lambda e: T.holdings[e[0]][e[1]].fixed,
                             [c for _, c in few])
        by_tensor: dict[int, list] = {}
        for tid, j in held_ids:
            by_tensor.setdefault(tid, []).append(T.holdings[tid][j])
        todo = ((model.tensors[tid], hs) for tid, hs in sorted(by_tensor.items()))
    # The kinds of one flat statement (fp32, exp_avg, exp_avg_sq) hold the very same pieces at the
    # very same coordinates (shared objects) and share their sources: their rows differ only by
    # tensor and slots, so each piece's geometry and rank set is found once, for the first of them.
    shared_uses: dict[tuple, tuple] = {}

    def slots_of(hs, js: np.ndarray) -> np.ndarray:
        """Slot ids of holdings ``hs[js]``; slots not numbered yet are numbered in order of first use
        (slots are shared objects: a flat buffer's recur on every coordinate)."""
        if not len(js):
            return np.zeros(0, dtype=I64)
        if len(js) <= 64:  # a few holdings (a parameter's tensor-parallel ranks): numpy calls cost more
            return np.array([sid(hs[j].slot) for j in js.tolist()], dtype=I64)
        objs = [h.slot for h in hs]
        k = np.array([id(o) for o in objs], dtype=I64)[js]
        order = np.argsort(k, kind="stable")
        ks = k[order]
        starts = np.flatnonzero(np.concatenate([[True], ks[1:] != ks[:-1]]))
        first = order[starts]  # each distinct slot's first use
        ids = np.empty(len(starts), dtype=I64)
        for u in np.argsort(first):
            ids[u] = sid(objs[js[first[u]]])
        out = np.empty(len(k), dtype=I64)
        out[order] = np.repeat(ids, np.diff(np.append(starts, len(ks))))
        return out

    set_of_obj: dict[int, int] = {}  # id of a holding's coordinates (alive in its ShardMap) -> rank set

    def set_of(fixed) -> int:
        """:func:`rank_set` of coordinates held by the target map (shared objects: found once)."""
        d = set_of_obj.get(id(fixed))
        if d is None:
            d = set_of_obj[id(fixed)] = rank_set(fixed)
        return d

    def sets_of_holdings(holdings) -> list[int]:
        """:func:`set_of` of each holding's coordinates. Where every one names every axis (a ZeRO
        partition's: one rank each, 131,072 on a 131,072-rank mesh) their sets are made in one call,
        numbered as one call each would (in order of first appearance), and not memoised: each
        coordinate dict is met about once, and a memo entry would outlive it to the table's peak."""
        axes = list(strides.items())
        fixed = [h.fixed for h in holdings]
        if axes and all([len(f) >= len(axes) and all([a in f for a, _ in axes]) for f in fixed]):
            return sets.singles(np.array([sum([f[a] * s for a, s in axes]) for f in fixed], dtype=I64)).tolist()
        return [set_of(f) for f in fixed]

    sets_by_holdings: dict[bytes, array] = {}  # the kinds of one flat statement: found once

    for t, holdings in todo:
        # as bytes (8 per holding and id, not a tuple of int objects: some 10^5 holdings a stage)
        target_key = array("Q", [id(h.pieces) for h in holdings] + [id(h.fixed) for h in holdings]).tobytes()
        sets_of = sets_by_holdings.get(target_key)
        if sets_of is None:
            sets_of = sets_by_holdings[target_key] = array("q", sets_of_holdings(holdings))
        if wanted is not None and max(sets_of, default=-1) < 0:
            continue  # a part of the plan (one rank's load) proves only the tensors it moves
        st = t if src_model is model else _matching_source(src_model, t)
        sources = dedup_sources(S, st, keys=piece_keys)
        if not T.mesh.is_universal:
            dedup_sources(T, t, "target", piece_keys)  # P1 for the target too
        found = source_of_list.get(id(sources))  # kinds of one flat statement share the list
        boxes = None  # the sources as boxes: made again where needed, not kept (some 10^4 pieces a list)
        if found is None:
            boxes = piece_boxes(sources.pieces, len(t.shape))
            found = source_of_list[id(sources)] = [
                source_ids.setdefault((boxes[1].shape, boxes[0].tobytes(), boxes[1].tobytes()), len(source_ids)),
                sources.ranks, sources.holdings, sources]
        src_key, ranks_of_sources, holding_of_sources = found[:3]
        src_suffix = src_key.to_bytes(8, "little")  # a geometry key: a piece's key (8 bytes a dim), then this
        src_ranks.append(ranks_of_sources)
        src_slots.append(slots_of(S.holdings[st.id], holding_of_sources))
        key = (id(sources), target_key)
        per_piece = shared_uses.get(key)
        if per_piece is None:
            hs, gs, ds, new = [], array("q"), [], []
            for j, (h, dset) in enumerate(zip(holdings, sets_of)):
                if dset < 0:
                    continue
                list_key = id(h.pieces) << 32 | src_key
                found_geos = geos_of_list.get(list_key)
                if found_geos is None:  # each distinct piece list once (alive in its ShardMap)
                    found_geos = array("q")  # (not a list of int objects: some 10^5 pieces)
                    for piece, pkey in zip(h.pieces, held_keys(piece_keys, h.pieces).keys(len(h.pieces))):
                        gkey = pkey + src_suffix
                        geo = geometry.get(gkey)
                        if geo is None:
                            geo = geometry[gkey] = geos.reserve()
                            new.append(piece)
                        found_geos.append(geo)
                    found_geos = geos_of_list[list_key] = found_geos.tobytes()
                n = len(found_geos) // 8
                hs.extend([j] * n)
                gs.frombytes(found_geos)
                ds.extend([dset] * n)
            if new:  # the new geometries of this tensor, found together
                if boxes is None:
                    boxes = piece_boxes(sources.pieces, len(t.shape))
                geos.add_batch(pieces_rows(t, new, [piece_volume(p) for p in new], boxes), len(new),
                               [fill_boxes(p) for p in new])
            # the key's holdings are kept alive with the entry, so the ids in it stay theirs
            # int32 where the ids fit (a full plan's uses are some 10^6 rows, alive until its table is built)
            per_piece = shared_uses[key] = (np.flatnonzero(np.array(sets_of, dtype=I64) >= 0),
                                            np.array(hs, dtype=int_dtype(0, len(holdings))),
                                            np.array(gs, dtype=int_dtype(0, geos.count)),
                                            np.array(ds, dtype=int_dtype(0, sets.count)), holdings)
        held_js, hs, gs, ds, _ = per_piece
        dst_slot = np.zeros(len(holdings), dtype=I64)
        dst_slot[held_js] = slots_of(holdings, held_js)
        uses.add_many(gs, t.id, ds, dst_slot[hs].astype(int_dtype(0, len(slot_ids)), copy=False), src_base)
        src_base += len(sources.pieces)
    flat_fills = Uses()
    if few is None:  # every buffer's gaps (a whole map's buffers have every partition), a buffer at a time
        for f in T.flat_datasets:
            gaps = list(f.buffer.cut.all_gaps())
            if gaps:
                slot = sid(f.slot)
                dsets = buffer_sets(f.buffer, np.array([j for j, _, _ in gaps], dtype=I64)).tolist()
                for (_, start, length), dset in zip(gaps, dsets):
                    flat_fills.add(geos.add_fill(start, length), -1, dset, slot, 0)
    else:
        for f in _matching(T, "flat_fills", lambda: T.flat_fills, lambda f: f.fixed, [c for _, c in few]):
            dset = set_of(f.fixed)
            if dset >= 0:
                flat_fills.add(geos.add_fill(f.start, f.length), -1, dset, sid(f.slot), 0)

    datasets, ds_set, ds_id, ds_index = [], [], [], {}

    def dataset_id(key, shape, dtype) -> int:
        i = ds_index.setdefault((key, shape, dtype), len(datasets))
        if i == len(datasets):
            datasets.append({"key": key, "shape": tuple(shape), "dtype": dtype})
        return i

    for d in (T.whole_datasets if few is None else
              _matching(T, "datasets", lambda: T.datasets, lambda d: d.fixed, [c for _, c in few])):
        dset = set_of(d.fixed)
        if dset >= 0:
            ds_set.append(dset)
            ds_id.append(dataset_id(d.key, d.shape, d.dtype))
    if few is None:  # every partition of every flat buffer, a buffer at a time
        for f in T.flat_datasets:
            js = np.asarray(f.buffer.partitions, dtype=I64)
            ds_set.append(buffer_sets(f.buffer, js))
            ds_id.append(np.full(len(js), dataset_id(f.key, (f.buffer.cut.part,), f.dtype), dtype=I64))
    for memo in (piece_keys.lists, piece_keys.dims, piece_keys.numbers, piece_keys.elements, piece_keys.shared,
                 geos_of_list, geometry, shared_uses, set_of_obj, set_of_fixed, sets_by_holdings, source_of_list,
                 source_ids):
        memo.clear()  # freed before the tables are built (their peak is the plan's)
    # (no other reference to the joined columns: freed in rows)
    c, f = geos.rows(uses, flat_fills, _joined(src_ranks, src.size), _joined(src_slots, len(slot_ids)))
    return Plan(src, dst, K,
                [{"name": t.name, "kind": t.kind, "shape": t.shape, "dtype": t.dtype} for t in model.tensors],
                list(slot_ids), sets.build(), c, f, datasets,
                dict(zip(DATASET_COLUMNS, (_column(ds_set), _column(ds_id)))))


def _holding_ids(T: ShardMap) -> list[tuple[int, int]]:
    """(tensor id, index) of every holding of ``T``, in order (a focused map's: of its few tensors)."""
    ids = range(len(T.holdings)) if T.focus is None else sorted(T.focus)
    return [(i, j) for i in ids for j in range(len(T.holdings[i]))]


def _joined(parts: list, bound: int) -> np.ndarray:
    """The int arrays ``parts`` (values in ``[0, bound]``) as one, int32 where that range fits; the
    list is emptied (its arrays freed)."""
    out = np.concatenate([np.zeros(0, dtype=I64)] + parts, dtype=int_dtype(0, bound))
    parts.clear()
    return out


def _column(parts: list) -> np.ndarray:
    """One int64 column from ints and int64 arrays, in order."""
    chunks, ints = [], []
    for p in parts:
        if isinstance(p, np.ndarray):
            if ints:
                chunks.append(np.array(ints, dtype=I64))
                ints = []
            chunks.append(p)
        else:
            ints.append(p)
    if ints:
        chunks.append(np.array(ints, dtype=I64))
    return np.concatenate(chunks) if chunks else np.zeros(0, dtype=I64)


@dataclass(frozen=True, eq=False)
class _CoordinateIndexes:
    """:func:`_matching`'s indexes over one ShardMap, by what they index ("holdings", "flat_fills",
    "datasets"): distinct coordinates -> (position, item), and every axis those coordinates name."""

    by_items: dict[str, tuple[dict[tuple, list], set[str]]] = field(default_factory=dict)


def _matching(T: ShardMap, name: str, items, fixed_of, coords: list[dict]) -> list:
    """The items of ``items()`` (in order) whose coordinates ``fixed_of(item)`` some rank with
    ``coords`` has: a plan for a few ranks looks at the distinct coordinates, not at every item.
    The index (distinct coordinates -> items) is cached on the ShardMap per ``name``."""
    memo = T.derived.of(_CoordinateIndexes).by_items
    if name not in memo:
        index: dict[tuple, list] = {}
        for i, item in enumerate(items()):
            index.setdefault(tuple(sorted(fixed_of(item).items())), []).append((i, item))
        memo[name] = index, {a for key in index for a, _ in key}
    index, axes = memo[name]
    if all(axes <= set(c) for c in coords) and all(len(c) <= 12 for c in coords):
        # the keys a rank matches are the subsets of its own coordinates: look those up
        keys = {sub for c in coords for k in range(len(c) + 1)
                for sub in itertools.combinations(sorted(c.items()), k)}
        hits = [e for key in keys for e in index.get(key, ())]
    else:
        hits = [e for key, found in index.items() if any(all(c.get(a, 0) == v for a, v in key) for c in coords)
                for e in found]
    return [item for _, item in sorted(hits, key=lambda e: e[0])]
