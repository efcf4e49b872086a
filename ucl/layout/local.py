"""A tensor's rank-local layout at one set of mesh coordinates: each dim's runs of the global tensor
(``algebra.dim_layout``), with a split that does not fit reported at its own span; and the
coordinates lowering walks (per distinct tuple on the axes that matter, never per rank)."""
from __future__ import annotations

import itertools

from ..lang import ast
from .algebra import LayoutError, SplitFailure, dim_layout
from .context import LoweringContext
from .mesh import Mesh


def split_axes(dims) -> tuple[tuple[str, ...], ...]:
    """Each dim's split axes, sorted: what ``place.coords_key`` looks at, found once per tensor."""
    return tuple(tuple(sorted(d.node.axes())) for d in dims)


def local_layouts(ctx: LoweringContext, tensor, dims, fixed, dim_axes=None):
    """Per-dim layouts on one coordinate; a split that does not fit is reported at its own span.
    With a memo, each is looked up by (id of a DimSpec kept alive by the call, coordinates)."""
    out = []
    mesh, memo = ctx.mesh, (ctx.memo.layouts if ctx.memo is not None else None)
    for k, (d, axes) in enumerate(zip(dims, dim_axes if dim_axes is not None else split_axes(dims))):
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
            ctx.fail(tensor, span, LayoutError(e.code, f"dim {k}: {e}", e.hint, split=e.split))
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


def coordinates(axes: list[str], mesh: Mesh, allowed: dict[str, list[int]]):
    """Every combination of coordinates on ``axes`` and the placing axes (``allowed``: the
    coordinates a placement permits), as dicts."""
    names = sorted(set(axes) | set(allowed))
    ranges = [allowed.get(a, range(mesh.axis_size(a))) for a in names]
    for combo in itertools.product(*ranges):
        yield dict(zip(names, combo))
