"""Per-dim trees: how each dim of one tensor is padded, viewed, concatenated and split, before
any mesh coordinate is chosen. Used by binding (structural checks) and by lowering."""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..lang import ast
from .algebra import DimSpec, LayoutError, Node
from .context import LoweringContext
from .mesh import Mesh


def build_dims(model, tensor, env: dict, mesh: Mesh) -> tuple[DimSpec, ...]:
    """The DimSpec of every dim of ``tensor`` (``env``: dims, lets and the mesh's axis sizes)."""
    return dims_of(LoweringContext(model, mesh, env), tensor)


def dims_of(ctx: LoweringContext, tensor) -> tuple[DimSpec, ...]:
    """:func:`build_dims` in a lowering's context."""
    rule = tensor.rule
    shape = ctx.model.params[tensor.name]
    structure: dict[tuple, ast.Transform] = {}
    splits: dict[tuple, list] = {}  # path -> [(order, (axes, mode))]
    pads: dict[int, int] = {}
    for order, t in enumerate(rule.transforms):
        if isinstance(t, (ast.View, ast.Concat)):
            structure[t.dim.path] = t
        elif isinstance(t, ast.Split):
            splits.setdefault(t.dim.path, []).append((order, (tuple(a.name for a in t.axes), t.mode)))
        elif isinstance(t, ast.Pad):
            n = shape[t.dim.root]
            target = ctx.evaluate(tensor, t.target)
            if target <= 0:
                ctx.fail(tensor, t.span, LayoutError("UCL205", f"pad target {target} must be positive"))
            padded = -(-n // target) * target if t.multiple else target
            if padded < n:
                ctx.fail(tensor, t.span, LayoutError("UCL205", f"cannot pad dim {t.dim} of size {n} down to {padded}"))
            pads[t.dim.root] = padded

    builder = _TreeBuilder(ctx, tensor, structure, splits)
    dims = []
    for d, n in enumerate(shape):
        padded = pads.get(d, n)
        dims.append(DimSpec(n, padded, builder.build((d,), padded)))
    return tuple(dims)


@dataclass(frozen=True, eq=False)
class _TreeBuilder:
    """Builds one tensor's dim trees (a class rather than nested recursive closures, which would be
    reference cycles left for the cyclic collector: one per tensor lowered)."""

    ctx: LoweringContext
    tensor: object
    structure: dict
    splits: dict  # path -> [(order, (axes, mode))]

    def number(self, expr, extent: str):
        return self.ctx.evaluate(self.tensor, expr, extent)

    def first_below(self, path) -> float:
        """Order of the first split of a strict descendant of ``path`` (inf if none)."""
        orders = [o for p, xs in self.splits.items() if len(p) > len(path) and p[:len(path)] == path
                  for o, _ in xs]
        return min(orders, default=float("inf"))

    def build(self, path: tuple, size: int, inherited=()) -> Node:
        mine = self.splits.get(path, [])
        t = self.structure.get(path)
        if t is None:
            return Node("leaf", size, (), tuple(inherited) + tuple(x for _, x in mine), path=path)
        cut = self.first_below(path)
        if isinstance(t, ast.View):
            pre = tuple(inherited) + tuple(x for o, x in mine if o < cut)
            post = tuple(x for o, x in mine if o > cut)  # after a factor's split: cuts the local extent
        else:
            # The first split of a concat splits every part ([q_r; k_r; v_r]); any later one, or one
            # after a part's own split, cuts the rank-local extent (FSDP on top of TP).
            first = [x for o, x in mine[:1] if o < cut]
            pre = tuple(inherited) + tuple(first)
            post = tuple(x for x in (x for _, x in mine[len(first):]))
        if isinstance(t, ast.View):
            sizes = [self.number(f, f"view factor {k}") for k, f in enumerate(t.factors)]
            if math.prod(sizes) != size:  # Python ints: an int64 product could wrap around to `size`
                self.ctx.fail(self.tensor, t.span, LayoutError(
                    "UCL206", f"view {t.dim} as {sizes}: the factors multiply to {math.prod(sizes)}, not {size}"))
            if pre and cut == float("inf"):  # a split of the whole viewed dim: the view does not matter
                return Node("leaf", size, (), pre, path=path)
            if pre:
                self.ctx.fail(self.tensor, t.span, LayoutError(
                    "UCL109", f"dim {t.dim} is split as a whole before one of its factors is; split the factor "
                    "first (a later split of the whole then cuts each rank's local part)"))
            kids = tuple(self.build(path + (k,), s) for k, s in enumerate(sizes))
            return Node("view", size, kids, (), post, path=path)
        sizes = [self.number(p.size, f"concat part {p.name.name!r}") for p in t.parts]
        if sum(sizes) != size:
            self.ctx.fail(self.tensor, t.span, LayoutError(
                "UCL206", f"concat {t.dim} parts {sizes} sum to {sum(sizes)}, not {size}"))
        # A split of a concat splits every part: each rank holds [q_r; k_r; v_r].
        kids = tuple(self.build(path + (p.name.name,), s, pre) for p, s in zip(t.parts, sizes))
        return Node("concat", size, kids, (), post, path=path)


def universal_dims(shape) -> tuple[DimSpec, ...]:
    return tuple(DimSpec(n, n, Node("leaf", n)) for n in shape)


