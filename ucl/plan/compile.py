"""Compiling a plan: ``compile(model, src, dst)`` is pure. Before any byte moves it proves coverage: every element of
every target dataset has exactly one source element or is a declared fill (padding).
"""
from __future__ import annotations

import itertools

import numpy as np

from ..errors import PlanError, UclError, detach
from ..layout.algebra import I64, DimLayout, intersect, product
from ..layout.bind import Model
from ..layout.boxes import Slot
from ..layout.lower import ShardMap, lower
from ..layout.mesh import Mesh, as_mesh
from .ir import BOX_COLUMNS, COPY_COLUMNS, FILL_COLUMNS, Plan

# ---- compilation ---------------------------------------------------------------------------------
class _Rows:
    def __init__(self):
        self.cols: dict[str, list[np.ndarray]] = {}

    def add(self, **cols):
        for k, v in cols.items():
            self.cols.setdefault(k, []).append(v)

    def build(self, names2d, names1d, K) -> dict[str, np.ndarray]:
        """Concatenate column by column, dropping each column's pieces as it goes (peak memory)."""
        out = {}
        for k in list(names1d) + list(names2d):
            pieces = self.cols.pop(k, None)
            if pieces:
                out[k] = np.concatenate(pieces).astype(I64, copy=False)
            else:
                out[k] = np.zeros((0, K) if k in names2d else 0, dtype=I64)
            del pieces
        return out


def _pad_cols(a: np.ndarray, K: int, fill: int) -> np.ndarray:
    """(rows, nd) -> (rows, K) with leading columns set to ``fill``."""
    rows, nd = a.shape
    if nd == K:
        return a
    return np.concatenate([np.full((rows, K - nd), fill, dtype=I64), a], axis=1)


def _bbox(piece) -> tuple[np.ndarray, np.ndarray]:
    lo = np.array([d.segs[:, 0].min() if len(d.segs) else 0 for d in piece], dtype=I64)
    hi = np.array([(d.segs[:, 0] + d.segs[:, 2]).max() if len(d.segs) else 0 for d in piece], dtype=I64)
    return lo, hi


def _fill_boxes(piece) -> np.ndarray:
    """Local boxes of a piece that are padding: (rows, nd, 2) of (local start, length)."""
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
        raise PlanError(f"{t.key}: the source holds {list(s.shape)} {s.dtype}, the target wants {list(t.shape)} "
                        f"{t.dtype}", code="UCL316")
    return s


def _compile(model: Model, src: Mesh, dst: Mesh, ranks, dst_model: Model | None = None) -> Plan:
    src_model, model = model, (dst_model or model)
    S, T = lower(src_model, src), lower(model, dst)
    wanted = None if ranks is None else np.unique(np.asarray(list(ranks), dtype=I64))
    # a few target ranks (one rank's load): test their coordinates instead of enumerating the mesh
    few = None if wanted is None or len(wanted) > 64 or T.mesh.is_universal else \
        [(int(r), T.mesh.coords(int(r))) for r in wanted]

    def target_ranks(fixed) -> np.ndarray:
        if few is not None:
            return np.array([r for r, c in few if all(c.get(a, 0) == v for a, v in fixed.items())], dtype=I64)
        r = T.ranks(fixed)
        return r if wanted is None else r[np.isin(r, wanted)]

    K = max([len(t.shape) for t in model.tensors] + [1])
    slot_ids: dict[Slot, int] = {}

    def sid(slot: Slot) -> int:
        return slot_ids.setdefault(slot, len(slot_ids))

    copies, fills = _Rows(), _Rows()
    geometry: dict[tuple, tuple] = {}  # (target piece, source pieces) -> rows; layers repeat geometry
    source_ids: dict[tuple, int] = {}
    for t in model.tensors:
        sources = _dedup_sources(S, t if src_model is model else _matching_source(src_model, t))
        if not T.mesh.is_universal:
            _dedup_sources(T, t, "target")  # P1 for the target too: no element may be dropped
        src_key = source_ids.setdefault(tuple(_sig(p) for _, _, p, _, _ in sources), len(source_ids))
        src_rank = np.array([r for _, _, _, r, _ in sources], dtype=I64)
        src_slot = np.array([sid(s) for _, _, _, _, s in sources], dtype=I64)
        src_lo = src_hi = None
        for h in T.holdings[t.id]:
            ranks = target_ranks(h.fixed)
            nr = len(ranks)
            if not nr:
                continue
            dslot = sid(h.slot)
            for piece in h.pieces:
                key = (_sig(piece), src_key)
                geo = geometry.get(key)
                if geo is None:
                    if src_lo is None:
                        src_lo = np.array([lo for lo, _, _, _, _ in sources], dtype=I64).reshape(len(sources), len(t.shape))
                        src_hi = np.array([hi for _, hi, _, _, _ in sources], dtype=I64).reshape(len(sources), len(t.shape))
                    g, dl, sl, n, idx = _coalesce(*_piece_rows(t, piece, sources, src_lo, src_hi))
                    fb = _fill_boxes(piece)
                    geo = geometry[key] = (_pad_cols(g, K, 0), _pad_cols(dl, K, 0), _pad_cols(sl, K, 0),
                                           _pad_cols(n, K, 1), idx, _pad_cols(fb[:, :, 0], K, 0), _pad_cols(fb[:, :, 1], K, 1))
                g, dl, sl, n, idx, fstart, fsize = geo
                m = len(g)
                if m:
                    copies.add(tensor=np.full(m * nr, t.id), src_rank=np.tile(src_rank[idx], nr),
                               src_slot=np.tile(src_slot[idx], nr), dst_rank=np.repeat(ranks, m),
                               dst_slot=np.full(m * nr, dslot), src_start=np.tile(sl, (nr, 1)),
                               dst_start=np.tile(dl, (nr, 1)), global_start=np.tile(g, (nr, 1)),
                               size=np.tile(n, (nr, 1)))
                m = len(fstart)
                if m:
                    fills.add(tensor=np.full(m * nr, t.id), dst_rank=np.repeat(ranks, m),
                              dst_slot=np.full(m * nr, dslot), dst_start=np.tile(fstart, (nr, 1)),
                              size=np.tile(fsize, (nr, 1)))
    for f in T.flat_fills:
        ranks = target_ranks(f.fixed)
        m = len(ranks)
        fills.add(tensor=np.full(m, -1), dst_rank=ranks, dst_slot=np.full(m, sid(f.slot)),
                  dst_start=_pad_cols(np.full((m, 1), f.start, dtype=I64), K, 0),
                  size=_pad_cols(np.full((m, 1), f.length, dtype=I64), K, 1))

    datasets, ds_rank, ds_id, ds_index = [], [], [], {}
    for d in T.datasets:
        ranks = target_ranks(d.fixed)
        if not len(ranks):
            continue
        i = ds_index.setdefault((d.key, d.shape, d.dtype), len(datasets))
        if i == len(datasets):
            datasets.append({"key": d.key, "shape": tuple(d.shape), "dtype": d.dtype})
        ds_rank.append(ranks)
        ds_id.append(np.full(len(ranks), i, dtype=I64))
    c = copies.build(BOX_COLUMNS, COPY_COLUMNS, K)
    # Sequential reads: group by source rank (file), then dataset, then position.
    order = np.lexsort(tuple(c["src_start"][:, k] for k in range(K - 1, -1, -1)) + (c["src_slot"], c["src_rank"]))
    for k in list(c):  # one column at a time, so only one extra column is alive
        c[k] = c[k][order]
    return Plan(src, dst, K,
                [{"name": t.name, "kind": t.kind, "shape": t.shape, "dtype": t.dtype} for t in model.tensors],
                list(slot_ids), c, fills.build(("dst_start", "size"), FILL_COLUMNS, K), datasets,
                {"rank": np.concatenate(ds_rank) if ds_rank else np.zeros(0, dtype=I64),
                 "dataset": np.concatenate(ds_id) if ds_id else np.zeros(0, dtype=I64)})


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


def _dedup_sources(S: ShardMap, t, role: str = "source") -> list:
    """:func:`_proved_pieces`, cached on the model per mesh and tensor: lowering and the proof are
    pure, so the next plan of the same model and mesh (another rank's load) skips them."""
    memo = S.model.memo.setdefault(("dedup", S.mesh), {})
    if t.id not in memo:
        memo[t.id] = _proved_pieces(S, t, role)
    return memo[t.id]


def _proved_pieces(S: ShardMap, t, role: str) -> list:
    """Source pieces of tensor ``t`` with replicas removed; proves they tile the tensor exactly once.
    Replicas are found per holding first; where holdings only partly coincide (a KV head shared by
    several TP ranks next to their own Q heads) the pieces are cut into boxes and equal boxes dropped."""
    out, volume = _dedup(S, t, by_box=False)
    if volume > t.numel:
        out, volume = _dedup(S, t, by_box=True)
    if volume != t.numel:
        what = "overlapping, non-identical replicas" if volume > t.numel else "elements no rank holds"
        raise PlanError(f"{t.name} ({t.kind}) on {S.mesh}: the {role} layout holds {volume} elements of "
                        f"{t.numel}: {what}", code="UCL313" if volume > t.numel else "UCL314")
    return out


def _dedup(S: ShardMap, t, by_box: bool):
    seen, out, volume = set(), [], 0
    kept: list[list[tuple[int, int, int]]] = []  # by_box: boxes accepted so far, as (g, l, n) per dim
    for h in S.holdings[t.id]:
        rank = S.mesh.rank(**h.fixed) if not S.mesh.is_universal else 0
        if not by_box:
            sig = tuple(_sig(p) for p in h.pieces)
            if sig in seen:
                continue
            seen.add(sig)
            pieces = h.pieces
        else:  # keep only what earlier ranks do not already hold
            pieces = []
            for p in h.pieces:
                for box in _boxes(p):
                    rest = [box]
                    for k in kept:
                        rest = [r for b in rest for r in _subtract(b, k)]
                    kept.extend(rest)
                    pieces += [tuple(DimLayout(d.local, np.array([seg], dtype=I64), d.fills[:0])
                                     for d, seg in zip(p, r)) for r in rest]
        for p in pieces:
            vol = int(np.prod([d.segs[:, 2].sum() for d in p], dtype=np.int64))
            if vol == 0:
                continue
            volume += vol
            lo, hi = _bbox(p)
            out.append((lo, hi, p, rank, h.slot))
    return out, volume


def _boxes(piece) -> list[list[tuple[int, int, int]]]:
    """A piece as single boxes: one (global start, local start, length) run per dim."""
    per_dim = [[tuple(int(x) for x in seg) for seg in d.segs] for d in piece]
    return [list(c) for c in itertools.product(*per_dim)]


def _subtract(box, other) -> list:
    """``box`` minus ``other`` as at most 2*ndim boxes (runs keep their global->local offsets)."""
    if any(g + n <= og or og + on <= g for (g, _, n), (og, _, on) in zip(box, other)):
        return [box]
    out, core = [], list(box)
    for d, ((g, l, n), (og, _, on)) in enumerate(zip(box, other)):
        lo, hi = max(g, og), min(g + n, og + on)
        if g < lo:
            out.append(core[:d] + [(g, l, lo - g)] + core[d + 1:])
        if hi < g + n:
            out.append(core[:d] + [(hi, l + hi - g, g + n - hi)] + core[d + 1:])
        core[d] = (lo, l + lo - g, hi - lo)
    return out


def _sig(piece) -> tuple:
    return tuple(d.sig for d in piece)


def _piece_rows(t, piece, sources, src_lo, src_hi):
    """Rows (global start, dst local start, src local start, size, source index) covering one
    target piece; proves the piece is covered exactly once."""
    nd = len(t.shape)
    want = int(np.prod([d.segs[:, 2].sum() for d in piece], dtype=np.int64))
    empty = np.zeros((0, nd), dtype=I64)
    if want == 0:
        return empty, empty, empty, empty, np.zeros(0, dtype=I64)
    lo, hi = _bbox(piece)
    cand = np.flatnonzero(np.all((src_lo < hi) & (src_hi > lo), axis=1))
    found, idx = [], []
    got = 0
    for i in cand:
        sp = sources[i][2]
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
