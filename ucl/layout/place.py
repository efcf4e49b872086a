"""Placement: which coordinates of the placing axes (``on pp = last``, ``index i of N over pp``) hold
a tensor, and its rank-local name (layer ``i`` renumbered per stage unless ``keep``)."""
from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass


from ..errors import Diagnostic
from ..lang import ast
from .algebra import DimSpec, LayoutError
from .bind import Model
from .context import CallMemo, LoweringContext, TensorFailure
from .mesh import Mesh


def placement(model: Model, tensor, env: dict, mesh: Mesh, notes: dict | None = None,
              memo: CallMemo | None = None):
    """-> (fixed coords: axis -> allowed coords list, local name). Empty stages go to ``notes``.
    ``memo`` (one per ``env``) keeps what every layer of a rule shares: the count and stage sizes."""
    return place(LoweringContext(model, mesh, env, memo), tensor, notes)


def place(ctx: LoweringContext, tensor, notes: dict | None = None):
    """:func:`placement` in a lowering's context."""
    mesh, memo = ctx.mesh, ctx.memo
    allowed: dict[str, list[int]] = {}
    local_name = tensor.name
    replacements = []
    transforms = [(t, tensor.rule) for t in tensor.rule.transforms]
    if tensor.placement is not None:
        transforms += [(t, tensor.placement) for t in tensor.placement.transforms]
    for t, rule in transforms:
        if isinstance(t, ast.Place):
            size = mesh.axis_size(t.axis.name)
            coords = []
            for c in t.coords:
                v = 0 if c == "first" else size - 1 if c == "last" else ctx.evaluate(tensor, c)
                if not 0 <= v < size:
                    ctx.fail(tensor, t.span, LayoutError("UCL207", f"{t.axis.name} = {v} is outside the axis (size {size})"))
                coords.append(v)
            allowed[t.axis.name] = sorted(set(coords))
        elif isinstance(t, ast.Index):
            rule_match = rule.pattern.match(tensor.name)
            value = int(rule_match.group(t.capture.name))
            span = rule_match.span(t.capture.name)
            count = memo.counts.get(id(t)) if memo is not None else None
            if count is None:
                count = ctx.evaluate(tensor, t.count, f"the count of {t.capture.name}", count=True)
                if memo is not None:  # only successes: a failure is reported for every tensor
                    memo.counts[id(t)] = count
                    memo.nodes[id(t)] = t  # keeps the id taken
            size = mesh.axis_size(t.axis.name)
            if not 0 <= value < count:
                ctx.fail(tensor, t.span, LayoutError("UCL207", f"{t.capture.name} = {value} is not below {count}"))
            stage, local = stage_of(ctx, tensor, t, value, count, size, notes)
            allowed[t.axis.name] = [stage]
            if not t.keep:  # `keep`: the rank-local name keeps the global value
                replacements.append((span, str(local)))
    for (a, b), text in sorted(replacements, reverse=True):
        local_name = local_name[:a] + text + local_name[b:]
    return allowed, local_name


@dataclass(frozen=True)
class StageFailure:
    """``index c of N over AX`` cannot spread ``count`` values over the ``size`` coordinates of
    ``axis``: ``kind`` is "even" (N is not a multiple of size x virtual), "sizes" (the list has the
    wrong length or sum) or "first_last" (the middle stages cannot share the rest evenly)."""

    index: ast.Index
    axis: str
    size: int
    count: int
    virtual: int
    kind: str
    listed: int = 0  # how many stages `sizes [...]` lists


def stage_fail(ctx: LoweringContext, tensor, t: ast.Index, code, message, failure: StageFailure, hint=None):
    raise TensorFailure(ctx.model, tensor, Diagnostic(code, message, t.span, hint), ctx.mesh, failure)


def stage_of(ctx: LoweringContext, tensor, t: ast.Index, value, count, size, notes=None):
    """(stage, local value) of value ``value`` of ``index c of count over AX`` on an axis of ``size``."""
    memo = ctx.memo
    axis = t.axis.name
    if size > 1 and (t.sizes is not None or t.first is not None or t.last is not None):
        key = (id(t), count, size)
        found = memo.stage_sizes.get(key) if memo is not None else None
        if found is not None:
            sizes, bounds = found
        else:
            sizes, bounds = _stage_sizes(ctx, tensor, t, count, size)
            if memo is not None:
                memo.stage_sizes[key] = sizes, bounds
                memo.nodes[id(t)] = t
        if notes is not None and 0 in sizes:
            notes.setdefault(("stages", id(t)), []).append((tensor, (t, axis, tuple(sizes))))
        stage = bisect.bisect_right(bounds, value)
        return stage, value - (bounds[stage - 1] if stage else 0)
    virtual = ctx.evaluate(tensor, t.virtual) if t.virtual is not None else 1
    if virtual < 1:
        ctx.fail(tensor, t.span, LayoutError("UCL207", f"virtual {virtual}: needs at least 1 chunk per stage"))
    chunks = size * virtual
    if count % chunks:
        stage_fail(ctx, tensor, t, "UCL204",
                    f"{count} {t.capture.name}-values cannot be spread evenly over {axis}={size}"
                    + (f" x virtual {virtual}" if virtual > 1 else ""),
                    StageFailure(t, axis, size, count, virtual, "even"),
                    f"choose a {axis} size that divides {count}, or say how many values each {axis} coordinate "
                    "takes: `first`/`last` or `sizes [...]`")
    per = count // chunks
    chunk = value // per
    return chunk % size, (chunk // size) * per + value % per


def _stage_sizes(ctx: LoweringContext, tensor, t: ast.Index, count, size):
    """The stage sizes of ``index ... sizes [...]`` or ``first``/``last`` (checked), and their
    cumulative sums."""
    def ev(e, extent=None):
        return ctx.evaluate(tensor, e, extent)

    axis = t.axis.name
    if t.sizes is not None:
        sizes = [ev(e, f"stage size {k}") for k, e in enumerate(t.sizes)]
    else:  # Megatron's --decoder-first/last-pipeline-num-layers: the middle stages share the rest
        first = ev(t.first, "first") if t.first is not None else None
        last = ev(t.last, "last") if t.last is not None else None
        inner = size - (first is not None) - (last is not None)
        rest = count - (first or 0) - (last or 0)
        if (inner == 0 and rest != 0) or (inner > 0 and (rest < 0 or rest % inner)):
            stage_fail(ctx, tensor, t, "UCL204",
                        f"after first/last stages, {rest} {t.capture.name}-values cannot be spread evenly "
                        f"over {inner} stages of {axis}={size}",
                        StageFailure(t, axis, size, count, 1, "first_last"))
        mid = [rest // inner] * inner if inner else []
        sizes = ([first] if first is not None else []) + mid + ([last] if last is not None else [])
    if len(sizes) != size or sum(sizes) != count or min(sizes) < 0:
        stage_fail(ctx, tensor, t, "UCL207", f"stage sizes {sizes} must list {size} stages summing to {count}",
                    StageFailure(t, axis, size, count, 1, "sizes", len(sizes)))
    return sizes, list(itertools.accumulate(sizes))


def coords_key(fixed: dict, dims: tuple[DimSpec, ...], mesh: Mesh):
    axes = set()
    for d in dims:
        axes |= d.node.axes()
    return tuple((a, fixed[a], mesh.axis_size(a)) for a in sorted(axes))
