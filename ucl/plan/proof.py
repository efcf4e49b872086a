"""The proof behind every plan: the pieces of a tensor that a layout's ranks hold, replicas
removed, tile the tensor exactly once (P1), for the source (where each piece lies, to read it) and
for the target (elements counted only). Proofs are pure and kept on the model per mesh and tensor,
so the next plan of the same model and mesh (another rank's load) skips them."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from ..errors import PlanError
from ..layout.algebra import I64, DimLayout
from ..layout.lower import ShardMap
from ..layout.mesh import Mesh
from .geometry import PieceKeys, held_keys
from .ir import int_dtype


def piece_volume(piece) -> int:
    """Elements a piece holds."""
    v = 1
    for d in piece:
        s = d.segs
        v *= int(s[0, 2]) if len(s) == 1 else int(s[:, 2].sum())
    return v


class Proved(NamedTuple):
    """A tensor's pieces with replicas removed, which tile it exactly once, as columns: each
    piece, the rank that holds it and the index of its holding (whose slot differs by kind)."""

    pieces: list
    ranks: np.ndarray
    holdings: np.ndarray


class _ShareKey(NamedTuple):
    """Holdings that are the very same objects (the kinds of one flat statement), for one proof."""

    numel: int
    where: bool
    pieces: bytes  # ids of the holdings' piece lists, as int64 bytes (a tuple of 10^5 ints is 4 MB)
    fixed: bytes  # ids of the holdings' coordinates, likewise


@dataclass(frozen=True, eq=False)
class _Proofs:
    """What :func:`dedup_sources` keeps of one model, by mesh (lowering and the proof are pure):
    per tensor id, its deduplicated sources with where they lie (``sources``), or only proved (the
    target's proof: ``counted``); and per set of shared holdings, the one proof they share."""

    sources: dict[Mesh, dict[int, Proved]] = field(default_factory=dict)
    counted: dict[Mesh, dict[int, Proved]] = field(default_factory=dict)
    shared: dict[Mesh, dict[_ShareKey, tuple[list, Proved]]] = field(default_factory=dict)


def dedup_sources(S: ShardMap, t, role: str = "source", keys: PieceKeys | None = None) -> Proved:
    """:func:`_proved_pieces`, cached on the
    model per mesh and tensor: lowering and the proof are pure, so the next plan of the same
    model and mesh (another rank's load) skips them. The target's proof only counts elements:
    it keeps no pieces (a 131,072-rank target has some 400,000). ``keys``: a memo for
    :func:`held_keys`, shared by the proofs of one plan (piece lists recur across tensors)."""
    proofs = S.model.derived.of(_Proofs)
    full = proofs.sources.setdefault(S.mesh, {})
    if t.id in full:
        return full[t.id]
    where = role != "target"
    memo = full if where else proofs.counted.setdefault(S.mesh, {})
    if t.id not in memo:
        keys = PieceKeys() if keys is None else keys
        memo[t.id] = _shared_proof(S, t, role, where, keys) if where or t.id not in S.unflattened else \
            _unflattened_proof(S, t, role, keys)
    return memo[t.id]


class _Whole(NamedTuple):
    """A flat member's rank-local tensor before flattening, as a holding of one piece."""

    fixed: dict
    pieces: list


_COUNTED = Proved([], np.zeros(0, dtype=I64), np.zeros(0, dtype=I64))  # a target's proof keeps no pieces


def _unflattened_proof(S: ShardMap, t, role: str, keys: PieceKeys) -> Proved:
    """P1 for a target tensor in flat buffers, proved on its rank-local tensors before flattening
    (one per member coordinate, not one per partition): cutting a buffer into partitions tiles
    each member exactly (docs/ir.md), so the pieces tile the tensor exactly when these do."""
    wholes = [_Whole(fixed, layouts) for fixed, layouts in S.unflattened[t.id]]
    found = [held_keys(keys, w.pieces) for w in wholes]
    volume = sum([k.volume for k in {k.sig: k for k in found}.values()])  # equal ones once
    if volume > t.numel:  # replicas that only partly coincide: as for other tensors
        _, volume = _dedup_by_box(S, t, False, wholes)
    _check_volume(S, t, role, volume)
    return _COUNTED


def _shared_proof(S: ShardMap, t, role: str, where: bool, keys: PieceKeys) -> Proved:
    """The kinds of one flat statement (fp32, exp_avg, exp_avg_sq) share their pieces and
    coordinates (the very same objects), so one proof serves them all; entries name the holding
    (its index), whose slot differs by kind."""
    holdings = S.holdings[t.id]
    key = _ShareKey(t.numel, where, np.array([id(h.pieces) for h in holdings], dtype=np.uint64).tobytes(),
                    np.array([id(h.fixed) for h in holdings], dtype=np.uint64).tobytes())
    shared = S.model.derived.of(_Proofs).shared.setdefault(S.mesh, {})
    if key not in shared:  # the holdings are kept alive with the entry, so those ids stay theirs
        shared[key] = (holdings, _proved_pieces(S, t, role, where, keys))
    return shared[key][1]


def _proved_pieces(S: ShardMap, t, role: str, where: bool, keys: PieceKeys) -> Proved:
    """Source pieces of tensor ``t`` with replicas removed; proves they tile the tensor exactly once.
    Replicas are found per holding first; where holdings only partly coincide (a KV head shared by
    several TP ranks next to their own Q heads) the pieces are cut into boxes and equal boxes dropped."""
    out, volume = _dedup_holdings(S, t, where, keys)
    if volume > t.numel:
        out, volume = _dedup_by_box(S, t, where)
    _check_volume(S, t, role, volume)
    # int32 where ranks and holding indices fit (proofs stay cached with the model)
    return Proved([p for p, _, _ in out], np.array([r for _, r, _ in out], dtype=int_dtype(0, S.mesh.size)),
                  np.array([j for _, _, j in out], dtype=int_dtype(0, len(S.holdings[t.id]))))


def _check_volume(S: ShardMap, t, role: str, volume: int) -> None:
    if volume != t.numel:
        what = "overlapping, non-identical replicas" if volume > t.numel else "elements no rank holds"
        raise PlanError(f"{t.name} ({t.kind}) on {S.mesh}: the {role} layout holds {volume} elements of "
                        f"{t.numel}: {what}", code="UCL313" if volume > t.numel else "UCL314")


def _dedup_holdings(S: ShardMap, t, where: bool, keys: PieceKeys):
    """(pieces kept, as (piece, rank, holding index) where asked, volume): equal holdings once,
    each compared by its pieces' bytes (:func:`held_keys`, found once per piece list in ``keys``:
    runs, padding and extent of every dim)."""
    holdings = S.holdings[t.id]
    known = keys.lists.get  # held_keys' memo, looked up here: most lists recur
    found = [known(id(h.pieces)) or held_keys(keys, h.pieces) for h in holdings]
    # each distinct holding's first occurrence (a dict built backwards keeps the lowest index)
    kept = sorted(dict(zip([k.sig for k in reversed(found)], range(len(found) - 1, -1, -1))).values())
    volume = sum([found[j].volume for j in kept])
    out = []
    if where:
        strides = S.mesh.strides if not S.mesh.is_universal else None
        for j in kept:
            h = holdings[j]
            rank = sum(v * strides.get(a, 0) for a, v in h.fixed.items()) if strides is not None else 0
            vols = found[j].volumes  # None: no piece is empty
            if vols is None:
                out.extend((p, rank, j) for p in h.pieces)
            else:
                out.extend((p, rank, j) for p, vol in zip(h.pieces, vols) if vol)
    return out, volume


def _dedup_by_box(S: ShardMap, t, where: bool, holdings: list | None = None):
    """:func:`_dedup_holdings` where holdings only partly coincide: each holding keeps only the
    boxes earlier ones do not hold."""
    out, volume = [], 0
    kept: list[list[tuple[int, int, int]]] = []  # boxes accepted so far, as (g, l, n) per dim
    strides = S.mesh.strides if where and not S.mesh.is_universal else None
    for j, h in enumerate(S.holdings[t.id] if holdings is None else holdings):
        rank = sum(v * strides.get(a, 0) for a, v in h.fixed.items()) if strides is not None else 0
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
            vol = piece_volume(p)
            if vol == 0:
                continue
            volume += vol
            if where:
                out.append((p, rank, j))
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
