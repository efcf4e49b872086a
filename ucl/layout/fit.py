"""A mesh that does not fit a model: one diagnostic per problem, blaming the mesh (and naming the axis
sizes that would fit) where the spec is fine for other sizes; warnings for meshes that fit only
loosely (empty pipeline stages, ``shared`` splits over more ranks than elements)."""
from __future__ import annotations

import itertools
import warnings

import numpy as np

from ..errors import BindError, Diagnostic, MeshError
from ..lang import ast
from ..lang.check import PARAM
from .algebra import LayoutError, SplitFailure, dim_layout, split_range
from .context import TensorFailure
from .dims import build_dims
from .mesh import Mesh
from .place import StageFailure, coords_key, placement


class MeshFitWarning(UserWarning):
    """The mesh fits the model, but loosely: some ranks hold none of some parameters (a pipeline
    stage with no layers: ``sizes`` or ``first``/``last`` with a 0-size stage) or the same elements
    as their neighbours (a ``shared`` split over more ranks than elements: tp > KV heads)."""


# ---- a mesh that does not fit: one diagnostic per problem, blaming the mesh where it is to blame ----
_LARGEST_SUGGESTED = 128  # axis sizes up to this are tried when suggesting sizes that fit
_CANDIDATES = 16  # at most this many of them (each is checked against the whole model)


def mesh_report(model, mesh: Mesh, failures: list[TensorFailure]) -> BindError:
    """One diagnostic per distinct problem (the same rule failing the same way in every layer is one
    problem), naming the first tensor and counting the others."""
    groups: dict[tuple, list[TensorFailure]] = {}
    for f in failures:
        p = f.problem
        groups.setdefault((p.code, p.span, p.message, p.hint), []).append(f)
    fits: dict = {}  # (axis, size) -> does the whole model fit with it; shared by the groups
    diagnostics = []
    for members in groups.values():
        first = members[0]
        blamed = _blame_mesh(model, mesh, first, fits)
        message, hint = blamed if blamed else (first.diagnostics[0].message, first.problem.hint)
        names = list(dict.fromkeys(m.tensor.name for m in members))
        if blamed and isinstance(first.cause, StageFailure) and message.endswith(")"):  # how many it places
            message = message[:-1] + f", which places {len(names)} parameter{'s' if len(names) > 1 else ''})"
        elif len(names) > 1:
            shown = ", ".join(names[1:3]) + (", ..." if len(names) > 3 else "")
            message += f"; and {len(names) - 1} more parameter{'s' if len(names) > 2 else ''} like this ({shown})"
        diagnostics.append(Diagnostic(first.problem.code, message, first.problem.span, hint))
    return BindError(diagnostics, model.spec.text, model.spec.filename)


def _blame_mesh(model, mesh: Mesh, failure: TensorFailure, fits: dict):
    """(message, hint) saying which axis size is wrong and which would fit, when the spec is fine
    for other sizes of that axis; None when the spec itself is to blame."""
    cause = failure.cause
    if isinstance(cause, SplitFailure) and cause.mode != "uneven":
        return _blame_split(model, mesh, failure, cause, fits)
    if isinstance(cause, StageFailure):
        return _blame_stages(model, mesh, failure, cause, fits)
    return None


def _fitting_sizes(model, mesh: Mesh, axis: str, candidates, fits: dict) -> list[int]:
    """The candidate sizes of ``axis`` (the current one excluded) with which every parameter fits."""
    current = mesh.axis_size(axis)
    out = []
    for s in candidates:
        if s == current:
            continue
        if (axis, s) not in fits:
            try:
                fits[(axis, s)] = _fits(model, _resized(mesh, axis, s), axis)
            except MeshError:  # that size would make the mesh too large: not a suggestion
                fits[(axis, s)] = False
        if fits[(axis, s)]:
            out.append(s)
    return out


def _resized(mesh: Mesh, axis: str, size: int) -> Mesh:
    return Mesh([(n, size if n == axis else s) for n, s in mesh.axes])


def _fits(model, mesh: Mesh, axis: str) -> bool:
    """Do all parameters fit ``mesh`` as far as ``axis`` is concerned (its splits and placements)?"""
    try:
        env = model.env(mesh)
    except BindError:
        return False
    seen = set()
    for t in model.tensors:
        key = (id(t.rule), id(t.placement), t.shape)
        if t.kind != PARAM or key in seen:
            continue
        seen.add(key)
        try:
            dims = build_dims(model, t, env, mesh)
            placement(model, t, env, mesh)
            for d in dims:
                axes = sorted(d.node.axes())
                if axis in axes:
                    for fixed in _probe_coords(axes, mesh, axis):
                        dim_layout(d, coords_key(fixed, (d,), mesh))
        except LayoutError as e:
            if e.split is None or axis in e.split.axes:
                return False
        except TensorFailure as e:
            cause = e.cause
            axes = cause.axes if isinstance(cause, SplitFailure) else (cause.axis,) if cause is not None else None
            if axes is None or axis in axes:
                return False
    return True


def _probe_coords(axes, mesh: Mesh, axis: str):
    """Every coordinate of ``axis``, the first and last of the other axes: enough to find a split
    that cannot cut what it is given, without visiting every rank."""
    ranges = [range(mesh.axis_size(a)) if a == axis else sorted({0, mesh.axis_size(a) - 1}) for a in axes]
    for combo in itertools.product(*ranges):
        yield dict(zip(axes, combo))


def _source_text(model, span) -> str | None:
    lines = model.spec.text.splitlines()
    if span is None or not 0 < span.line <= len(lines) or span.end_line != span.line:
        return None
    return lines[span.line - 1][span.col - 1:span.end_col - 1].strip() or None


def _size_text(model, rule: ast.Rule, path: tuple) -> str | None:
    """The spec's expression for the size of node ``path`` of a dim: a declared shape entry (not
    when the dim is padded), a view factor or a concat part."""
    if len(path) == 1:
        padded = any(isinstance(t, ast.Pad) and t.dim.root == path[0] for t in rule.transforms)
        if padded or rule.shape is None or path[0] >= len(rule.shape):
            return None
        return _source_text(model, rule.shape[path[0]].span)
    for t in rule.transforms:
        if isinstance(t, ast.View) and t.dim.path == path[:-1] and isinstance(path[-1], int):
            return _source_text(model, t.factors[path[-1]].span) if path[-1] < len(t.factors) else None
        if isinstance(t, ast.Concat) and t.dim.path == path[:-1]:
            return next((_source_text(model, p.size.span) for p in t.parts if p.name.name == path[-1]), None)
    return None


def _quantity(text: str | None, value: int) -> str:
    """``kv_heads=4``, ``heads * head_dim = 256`` or ``4 elements``."""
    if text is None or text.isdigit():
        return f"{value} element{'' if value == 1 else 's'}"
    return f"{text}={value}" if text.isidentifier() else f"{text} = {value}"


def _among(axis: str, sizes: list[int], shown: int = 10) -> str:
    listed = ", ".join(map(str, sizes[:shown])) + (", ..." if len(sizes) > shown else "")
    return f"choose {axis} among {listed}"


def _blame_split(model, mesh, failure: TensorFailure, sf: SplitFailure, fits):
    n, parts = sf.size, sf.parts
    tensor = failure.tensor
    if sf.mode == "shared":
        local = (lambda p: n % p == 0 if p <= n else p % n == 0) if n else (lambda p: True)
        top = _LARGEST_SUGGESTED
    else:
        local = (lambda p: n % p == 0)
        top = min(n, _LARGEST_SUGGESTED)
    dim = ".".join(map(str, sf.path))
    if sf.whole:
        what, where = _quantity(_size_text(model, tensor.rule, sf.path), n), f"dim {dim} of {tensor.name} {list(tensor.shape)}"
    else:
        what, where = f"the {n} elements earlier splits leave of dim {dim}", f"{tensor.name} {list(tensor.shape)}"
    verb = "is neither a divisor nor a multiple of" if sf.mode == "shared" and parts > n else "does not divide"
    if len(sf.axes) > 1:  # a split over several axes: their product must fit
        product = " x ".join(f"{a}={mesh.axis_size(a)}" for a in sf.axes)
        ok = [p for p in range(1, top + 1) if local(p) and p != parts]
        if not any(p > 1 for p in ok):
            return None
        return (f"the mesh {mesh} does not fit: {product} = {parts} {verb} {what} ({where})",
                _among(f"sizes whose product ({' * '.join(sf.axes)}) is", ok)
                + ("; or, to keep them, make the split `uneven` (torch.chunk semantics) or pad the dim"
                   if sf.mode == "even" else ""))
    axis = sf.axes[0]
    ok = _fitting_sizes(model, mesh, axis, [p for p in range(1, top + 1) if local(p)][:_CANDIDATES], fits)
    if not any(p > 1 for p in ok):
        return None
    hint = _among(axis, ok)
    if sf.mode == "even":
        hint += f"; or, to allow {axis}={parts}, make the split `uneven` (torch.chunk semantics) or pad the dim"
    return f"the mesh {mesh} does not fit: {axis}={parts} {verb} {what} ({where})", hint


def _blame_stages(model, mesh, failure: TensorFailure, sf: StageFailure, fits):
    t, axis, count = sf.index, sf.axis, sf.count
    top = max(1, min(count, _LARGEST_SUGGESTED))
    if sf.kind == "even":
        candidates = [s for s in range(1, top + 1) if count % (s * sf.virtual) == 0]
    elif sf.kind == "sizes":
        candidates = sorted({1, sf.listed})
    else:
        candidates = list(range(1, min(top, 64) + 1))
    ok = _fitting_sizes(model, mesh, axis, candidates, fits)
    if not any(s > 1 for s in ok):
        return None
    what = _quantity(_source_text(model, t.count.span), count)
    tensor = failure.tensor
    rule = tensor.placement if tensor.placement is not None and t in tensor.placement.transforms else tensor.rule
    where = f"`{rule.pattern.text} : {_source_text(model, t.span) or 'index'}`"
    if sf.kind == "even":
        size = f"{axis}={sf.size}" + (f" x virtual {sf.virtual} = {sf.size * sf.virtual}" if sf.virtual > 1 else "")
        return (f"the mesh {mesh} does not fit: {size} does not divide {what} ({where})",
                _among(axis, ok) + f", or say how many values each {axis} coordinate takes: "
                "`first`/`last` or `sizes [...]`")
    if sf.kind == "sizes":
        return (f"the mesh {mesh} does not fit: {axis}={sf.size}, but `sizes [...]` lists {sf.listed} stages ({where})",
                _among(axis, ok))
    return f"the mesh {mesh} does not fit: {failure.problem.message} ({where})", _among(axis, ok)


# ---- a mesh that fits only loosely: warnings -----------------------------------------------------
def note_shared(tensor, dims, mesh: Mesh, notes: dict) -> None:
    """Record `shared` splits over more ranks than elements (tp > KV heads): legal, but worth a word."""
    for d in dims:
        stack = [d.node]
        while stack:
            node = stack.pop()
            stack.extend(reversed(node.children))
            n = node.size
            for axes, mode in node.splits:
                parts = int(np.prod([mesh.axis_size(a) for a in axes], dtype=np.int64))
                if mode == "shared" and 0 < n < parts:
                    notes.setdefault(("shared", id(tensor.rule), axes), []).append((tensor, (n, parts, node.path)))
                try:
                    lo, hi = split_range(n, parts, 0, mode)
                except LayoutError:
                    break  # reported as an error by the lowering itself
                n = hi - lo


def warn_loose_fit(model, mesh: Mesh, notes: dict) -> None:
    for key, entries in notes.items():
        tensor, info = entries[0]
        names = list(dict.fromkeys(e[0].name for e in entries))
        if key[0] == "stages":
            t, axis, sizes = info
            empty = [str(i) for i, s in enumerate(sizes) if s == 0]
            rule = tensor.placement if tensor.placement is not None and t in tensor.placement.transforms else tensor.rule
            message = (f"mesh {mesh}: {axis} stage{'s' if len(empty) > 1 else ''} {', '.join(empty)} "
                       f"get{'s' if len(empty) == 1 else ''} none of the {sum(sizes)} {t.capture.name}-values of "
                       f"`{rule.pattern.text}` (stage sizes {list(sizes)}): those ranks hold none of its parameters")
            line = t.span.line
        else:
            axes = key[2]
            parts = info[1]
            by_size: dict[str, list[str]] = {}  # "kv_heads=2" -> ["0.k.0", "0.v.0"]
            for _, (n, _, path) in entries:
                dims = by_size.setdefault(_quantity(_size_text(model, tensor.rule, path), n), [])
                if ".".join(map(str, path)) not in dims:
                    dims.append(".".join(map(str, path)))
            held = " and ".join(f"{q} (dim{'s' if len(d) > 1 else ''} {', '.join(d)})" for q, d in by_size.items())
            more = f" and {len(names) - 1} more parameter{'s' if len(names) > 2 else ''}" if len(names) > 1 else ""
            message = (f"mesh {mesh}: {' x '.join(axes)}={parts} is more than {held} of {tensor.name}{more}: "
                       f"`shared` gives each element to several consecutive ranks")
            line = tensor.rule.span.line
        warnings.warn(MeshFitWarning(f"{model.spec.filename}:{line}: {message}"), stacklevel=6)
