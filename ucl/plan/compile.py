"""Compiling a plan: ``compile(model, src, dst)`` is pure. Before any byte moves it proves coverage: every element of
every target dataset has exactly one source element or is a declared fill (padding).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np

from ..errors import PlanError, UclError, detach
from ..layout.algebra import I64, intersect, product
from ..layout.bind import Model
from ..layout.boxes import Slot
from ..layout.lower import ShardMap, gc_paused, lower, tensors_on
from ..layout.mesh import Mesh, as_mesh
from .ir import DATASET_COLUMNS, FILL_BOX_COLUMNS, FILL_COLUMNS, Plan
from .proof import dedup_sources, piece_bbox, piece_sig, piece_volume
from .ranksets import RankSets, sorted_distinct

# ---- compilation ---------------------------------------------------------------------------------
def _pad_cols(a: np.ndarray, K: int, fill: int) -> np.ndarray:
    """(rows, nd) -> (rows, K) with leading columns set to ``fill``."""
    rows, nd = a.shape
    if nd == K:
        return a
    return np.concatenate([np.full((rows, K - nd), fill, dtype=I64), a], axis=1)


def _fill_boxes(piece) -> np.ndarray:
    """Local boxes of a piece that are padding: (rows, nd, 2) of (local start, length)."""
    if not any(len(d.fills) for d in piece):  # the common case: no padding at all
        return np.zeros((0, len(piece), 2), dtype=I64)
    per_dim, any_fill = [], False
    for d in piece:
        runs = [np.concatenate([d.segs[:, 1:3], np.zeros((len(d.segs), 1), dtype=I64)], axis=1),
                np.concatenate([d.fills, np.ones((len(d.fills), 1), dtype=I64)], axis=1)]
        per_dim.append(np.concatenate(runs))
        any_fill |= len(d.fills) > 0
    if not any_fill:
        return np.zeros((0, len(piece), 2), dtype=I64)
    prod = product(per_dim)  # (rows, nd, 3)
    is_fill = prod[:, :, 2].any(axis=1)
    return prod[is_fill][:, :, :2]


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
        focus = tensors_on(model, dst, [c for _, c in few])
        src_focus = focus if src_model is model else frozenset(
            _matching_source(src_model, model.tensors[i]).id for i in focus)
        S, T = lower(src_model, src, tensors=src_focus), lower(model, dst, tensors=focus)

    def target_ranks(fixed) -> np.ndarray:
        if few is not None:
            return np.array([r for r, c in few if all(c.get(a, 0) == v for a, v in fixed.items())], dtype=I64)
        r = T.ranks(fixed)
        return r if wanted is None else r[np.isin(r, wanted)]

    # Rows go to the set of target ranks sharing the coordinates ``fixed`` (replicas), stored once.
    sets: list[np.ndarray] = []
    set_of_fixed: dict[tuple, int] = {}
    set_of_ranks: dict[bytes, int] = {}

    def rank_set(fixed) -> int:
        """Id of the set of target ranks with coordinates ``fixed``; -1 if none is wanted."""
        key = tuple(sorted(fixed.items()))
        i = set_of_fixed.get(key)
        if i is None:
            ranks = target_ranks(fixed)
            i = -1 if not len(ranks) else set_of_ranks.setdefault(ranks.tobytes(), len(sets))
            if i == len(sets):
                sets.append(ranks)
            set_of_fixed[key] = i
        return i

    K = max([len(t.shape) for t in model.tensors] + [1])
    slot_ids: dict[Slot, int] = {}

    def sid(slot: Slot) -> int:
        return slot_ids.setdefault(slot, len(slot_ids))

    geometry: dict[tuple, int] = {}  # (target piece, source pieces) -> geometry id; layers repeat geometry
    geos = _Geometries(K)
    source_ids: dict[tuple, int] = {}
    source_of_list: dict[int, int] = {}  # id of a (cached, alive) source list -> its source_ids entry
    sig_of: dict[int, tuple] = {}  # id of a target piece -> its signature
    src_ranks, src_slots, src_base = [], [], 0  # every tensor's deduplicated sources, one after another
    uses = _Uses()  # (geometry, tensor, rank set, target slot, sources) per target piece
    if few is None:
        todo = ((t, T.holdings[t.id]) for t in model.tensors)
    else:  # only the tensors the wanted ranks hold, found through an index (cached on the model)
        held_ids = _matching(T, "holdings",
                             lambda: [(t.id, j) for t in model.tensors for j in range(len(T.holdings[t.id]))],
                             lambda e: T.holdings[e[0]][e[1]].fixed, [c for _, c in few])
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

    def held_set(h) -> int:
        d = set_of_obj.get(id(h.fixed))
        if d is None:
            d = set_of_obj[id(h.fixed)] = rank_set(h.fixed)
        return d

    for t, holdings in todo:
        sets_of = [held_set(h) for h in holdings]
        if wanted is not None and max(sets_of, default=-1) < 0:
            continue  # a part of the plan (one rank's load) proves only the tensors it moves
        st = t if src_model is model else _matching_source(src_model, t)
        sources = dedup_sources(S, st)
        if not T.mesh.is_universal:
            dedup_sources(T, t, "target")  # P1 for the target too: no element may be dropped
        found = source_of_list.get(id(sources))  # kinds of one flat statement share the list
        if found is None:
            found = source_of_list[id(sources)] = (
                source_ids.setdefault(tuple([piece_sig(p) for _, _, p, _, _ in sources]), len(source_ids)),
                np.array([r for _, _, _, r, _ in sources], dtype=I64),
                np.array([j for _, _, _, _, j in sources], dtype=I64), sources)
        src_key, ranks_of_sources, holding_of_sources, _ = found
        src_ranks.append(ranks_of_sources)
        src_slots.append(slots_of(S.holdings[st.id], holding_of_sources))
        key = (id(sources), tuple([id(h.pieces) for h in holdings]), tuple([id(h.fixed) for h in holdings]))
        per_piece = shared_uses.get(key)
        if per_piece is None:
            hs, gs, ds = [], [], []
            src_lo = src_hi = None
            for j, (h, dset) in enumerate(zip(holdings, sets_of)):
                if dset < 0:
                    continue
                for piece in h.pieces:
                    psig = sig_of.get(id(piece))  # pieces outlive the compile (the ShardMap holds them)
                    if psig is None:
                        psig = sig_of[id(piece)] = piece_sig(piece)
                    gkey = (psig, src_key)
                    geo = geometry.get(gkey)
                    if geo is None:
                        if src_lo is None:
                            src_lo = np.array([lo for lo, _, _, _, _ in sources], dtype=I64).reshape(len(sources), len(t.shape))
                            src_hi = np.array([hi for _, hi, _, _, _ in sources], dtype=I64).reshape(len(sources), len(t.shape))
                        geo = geometry[gkey] = geos.add(_coalesce(*_piece_rows(t, piece, sources, src_lo, src_hi)),
                                                        _fill_boxes(piece))
                    hs.append(j)
                    gs.append(geo)
                    ds.append(dset)
            # the key's holdings are kept alive with the entry, so the ids in it stay theirs
            per_piece = shared_uses[key] = (np.flatnonzero(np.array(sets_of, dtype=I64) >= 0), np.array(hs, dtype=I64),
                                            np.array(gs, dtype=I64), np.array(ds, dtype=I64), holdings)
        held_js, hs, gs, ds, _ = per_piece
        dst_slot = np.zeros(len(holdings), dtype=I64)
        dst_slot[held_js] = slots_of(holdings, held_js)
        uses.add_many(gs, t.id, ds, dst_slot[hs], src_base)
        src_base += len(sources)
    flat_fills = _Uses()
    for f in (T.flat_fills if few is None else
              _matching(T, "flat_fills", lambda: T.flat_fills, lambda f: f.fixed, [c for _, c in few])):
        dset = rank_set(f.fixed)
        if dset >= 0:
            flat_fills.add(geos.add_fill(f.start, f.length), -1, dset, sid(f.slot), 0)

    datasets, ds_set, ds_id, ds_index = [], [], [], {}
    for d in (T.datasets if few is None else
              _matching(T, "datasets", lambda: T.datasets, lambda d: d.fixed, [c for _, c in few])):
        dset = rank_set(d.fixed)
        if dset < 0:
            continue
        i = ds_index.setdefault((d.key, d.shape, d.dtype), len(datasets))
        if i == len(datasets):
            datasets.append({"key": d.key, "shape": tuple(d.shape), "dtype": d.dtype})
        ds_set.append(dset)
        ds_id.append(i)
    c, f = geos.rows(uses, flat_fills, np.concatenate(src_ranks or [np.zeros(0, dtype=I64)]),
                     np.concatenate(src_slots or [np.zeros(0, dtype=I64)]))
    # Sequential reads: group by source rank (file), then dataset, then position.
    order = np.lexsort(tuple(c["src_start"][:, k] for k in range(K - 1, -1, -1)) + (c["src_slot"], c["src_rank"]))
    c = {k: v[order] for k, v in c.items()}
    return Plan(src, dst, K,
                [{"name": t.name, "kind": t.kind, "shape": t.shape, "dtype": t.dtype} for t in model.tensors],
                list(slot_ids), RankSets.of(sets), c, f, datasets,
                dict(zip(DATASET_COLUMNS, (np.array(ds_set, dtype=I64), np.array(ds_id, dtype=I64)))))


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


class _Uses:
    """Where geometries are used: one entry per target piece, as plain int lists (cheap to append)."""

    def __init__(self):
        self.geo, self.tensor, self.dst_set, self.dst_slot, self.src_base = [], [], [], [], []
        self.chunks: list[tuple] = []  # uses added by :meth:`add_many`, as arrays

    def add(self, geo: int, tensor: int, dst_set: int, dst_slot: int, src_base: int) -> None:
        self.geo.append(geo)
        self.tensor.append(tensor)
        self.dst_set.append(dst_set)
        self.dst_slot.append(dst_slot)
        self.src_base.append(src_base)

    def add_many(self, geo: np.ndarray, tensor: int, dst_set: np.ndarray, dst_slot: np.ndarray, src_base: int) -> None:
        n = len(geo)
        self.chunks.append((geo, np.full(n, tensor, dtype=I64), dst_set, dst_slot, np.full(n, src_base, dtype=I64)))

    def columns(self) -> tuple[np.ndarray, ...]:
        """(geo, tensor, dst_set, dst_slot, src_base): every use, those of :meth:`add` first."""
        cols = [np.asarray(c, dtype=I64) for c in (self.geo, self.tensor, self.dst_set, self.dst_slot, self.src_base)]
        return tuple(np.concatenate([c] + [ch[k] for ch in self.chunks]) for k, c in enumerate(cols))


class _Geometries:
    """The rows of each distinct geometry (copies relative to the tensor's source list, and fills),
    stored once; :meth:`rows` lays them out for every use in a few numpy operations."""

    def __init__(self, K: int):
        self.K = K
        self.copy_parts: list[tuple] = []  # per geometry: (global, dst, src starts, size, source index)
        self.fill_parts: list[tuple] = []  # per geometry: (dst start, size)

    def add(self, rows, fill_boxes) -> int:
        K = self.K
        g, dl, sl, n, idx = rows
        self.copy_parts.append((_pad_cols(g, K, 0), _pad_cols(dl, K, 0), _pad_cols(sl, K, 0), _pad_cols(n, K, 1), idx))
        self.fill_parts.append((_pad_cols(fill_boxes[:, :, 0], K, 0), _pad_cols(fill_boxes[:, :, 1], K, 1)))
        return len(self.copy_parts) - 1

    def add_fill(self, start: int, length: int) -> int:
        """A geometry of one flat-buffer gap (no copies)."""
        return self.add((np.zeros((0, 1), dtype=I64),) * 4 + (np.zeros(0, dtype=I64),),
                        np.array([[[start, length]]], dtype=I64))

    def rows(self, uses: _Uses, flat_fills: _Uses, src_rank: np.ndarray, src_slot: np.ndarray):
        K = self.K
        uses, flat_fills = uses.columns(), flat_fills.columns()
        empty = np.zeros((0, K), dtype=I64)
        cols = list(zip(*self.copy_parts)) or [[empty]] * 4 + [[np.zeros(0, dtype=I64)]]
        g, dl, sl, n = (np.concatenate(x) for x in cols[:4])
        idx = np.concatenate(cols[4])
        geo, tensor, dst_set, dst_slot, src_base = uses
        row, use = _gather([len(p[4]) for p in self.copy_parts], geo)
        base = src_base[use]
        copies = {"tensor": tensor[use], "src_rank": src_rank[base + idx[row]],
                  "src_slot": src_slot[base + idx[row]], "dst_set": dst_set[use], "dst_slot": dst_slot[use],
                  "src_start": sl[row], "dst_start": dl[row], "global_start": g[row], "size": n[row]}
        fcols = list(zip(*self.fill_parts)) or [[empty]] * 2
        fstart, fsize = (np.concatenate(x) for x in fcols)
        fills = {k: [] for k in FILL_COLUMNS + FILL_BOX_COLUMNS}
        for u_geo, u_tensor, u_set, u_slot, _ in (uses, flat_fills):
            row, use = _gather([len(p[0]) for p in self.fill_parts], u_geo)
            for k, v in (("tensor", u_tensor), ("dst_set", u_set), ("dst_slot", u_slot)):
                fills[k].append(v[use])
            fills["dst_start"].append(fstart[row])
            fills["size"].append(fsize[row])
        return copies, {k: np.concatenate(v) for k, v in fills.items()}


def _gather(counts: list[int], geo: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """For uses of geometries ``geo`` whose row counts are ``counts``: (row of the concatenated
    geometry tables, use) for every output row, uses in order and each geometry's rows in order."""
    counts_a = np.asarray(counts, dtype=I64)
    offsets = np.concatenate([np.zeros(1, dtype=I64), np.cumsum(counts_a, dtype=I64)])
    geo_a = np.asarray(geo, dtype=I64)
    m = counts_a[geo_a] if len(geo_a) else np.zeros(0, dtype=I64)
    use = np.repeat(np.arange(len(geo_a), dtype=I64), m)
    within = np.arange(len(use), dtype=I64) - np.repeat(np.cumsum(m) - m, m)
    return offsets[geo_a][use] + within, use


def _coalesce(g, dl, sl, n, idx):
    """Merge rows of one target piece that continue each other along a dim in global, target and
    source coordinates alike (same source, same extent in the other dims): fewer, larger I/O calls.
    Done per geometry, before rows are repeated over replicas, so it costs little."""
    nd = g.shape[1]
    for d in range(nd):
        if len(idx) < 2:
            break
        others = [k for k in range(nd) if k != d]
        keys = [idx] + [a[:, k] for a in (g, dl, sl, n) for k in others]
        order = np.lexsort([g[:, d]] + keys[::-1])
        g, dl, sl, n, idx = g[order], dl[order], sl[order], n[order], idx[order]
        same = idx[1:] == idx[:-1]
        for a in (g, dl, sl, n):
            for k in others:
                same &= a[1:, k] == a[:-1, k]
        for a in (g, dl, sl):
            same &= a[1:, d] == a[:-1, d] + n[:-1, d]
        if not same.any():
            continue
        group = np.concatenate([[0], np.cumsum(~same)])
        first = np.concatenate([[0], np.flatnonzero(~same) + 1])
        g, dl, sl, idx = g[first], dl[first], sl[first], idx[first]
        size = n[first].copy()
        size[:, d] = np.bincount(group, weights=n[:, d]).astype(I64)
        n = size
    return g, dl, sl, n, idx


def _single_overlap(piece, source):
    """:func:`intersect` and :func:`product` for the common case of a few runs per dim on both
    sides, in plain Python (numpy's per-call cost dominates arrays this small); None otherwise."""
    per_dim = []
    for d, s in zip(piece, source):
        a, b = d.segs, s.segs
        if len(a) * len(b) > 16:
            return None
        hits = []
        for ag, al, an in a.tolist():
            for bg, bl, bn in b.tolist():
                lo, hi = max(ag, bg), min(ag + an, bg + bn)
                if lo < hi:
                    hits.append((lo, al + lo - ag, bl + lo - bg, hi - lo))
        if not hits:
            return _NO_ROWS
        per_dim.append(sorted(hits))
    rows = list(itertools.product(*per_dim))
    return np.array(rows, dtype=I64).reshape(len(rows), len(per_dim), 4)


_NO_ROWS = np.zeros((0, 0, 4), dtype=I64)


def _piece_rows(t, piece, sources, src_lo, src_hi):
    """Rows (global start, dst local start, src local start, size, source index) covering one
    target piece; proves the piece is covered exactly once."""
    nd = len(t.shape)
    want = piece_volume(piece)
    empty = np.zeros((0, nd), dtype=I64)
    if want == 0:
        return empty, empty, empty, empty, np.zeros(0, dtype=I64)
    lo, hi = piece_bbox(piece)
    cand = np.flatnonzero(np.all((src_lo < hi) & (src_hi > lo), axis=1))
    found, idx = [], []
    got = 0
    for i in cand:
        sp = sources[i][2]
        rows = _single_overlap(piece, sp)
        if rows is None:
            per_dim = [intersect(d.segs, s.segs) for d, s in zip(piece, sp)]
            rows = product(per_dim)  # (rows, nd, 4): global, dst local, src local, length
        if not len(rows):
            continue
        found.append(rows)
        got += int(np.prod(rows[:, :, 3], axis=1).sum())
        idx.append(np.full(len(rows), i, dtype=I64))
    if got != want:
        raise PlanError(f"{t.name} ({t.kind}): a target box of {want} elements found {got} source elements",
                        code="UCL314")
    rows = np.concatenate(found)
    return rows[:, :, 0], rows[:, :, 1], rows[:, :, 2], rows[:, :, 3], np.concatenate(idx)
