"""Static checks of a parsed spec. Collects every diagnostic before raising, never just the first."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from . import ast
from ..dtypes import LOGICAL_DTYPES
from ..errors import Diagnostic, SpecError, did_you_mean
from .expr import FUNCTIONS, LIMIT, ExprError, calls_in, check_extent, fold, names_in

PARAM = "param"  # the kind naming the model weights themselves
PLACEMENT = (ast.Place, ast.Index)


@dataclass
class Checked:
    """What the checker learns from a module; the Spec wraps it."""

    dims: list[str] = field(default_factory=list)
    config_keys: dict[str, tuple[str, ...]] = field(default_factory=dict)
    lets: list[tuple[str, ast.Expr]] = field(default_factory=list)
    axes: list[str] = field(default_factory=list)
    rules: list[ast.Rule] = field(default_factory=list)
    placements: list[ast.Rule] = field(default_factory=list)
    ignores: list[ast.Pattern] = field(default_factory=list)
    states: list[ast.StateDecl] = field(default_factory=list)
    kinds: list[str] = field(default_factory=lambda: [PARAM])


class _Checker:
    def __init__(self, module: ast.Module):
        self.m = module
        self.out = Checked()
        self.diags: list[Diagnostic] = []
        self.values: set[str] = set()  # dims and lets declared so far (sets, not lists: 20,000 lets stay linear)
        self.axis_names: set[str] = set()
        self.constants: dict[str, int] = {}  # lets whose value needs no dim: folded now, so errors show at check

    def error(self, code, message, span, hint=None):
        self.diags.append(Diagnostic(code, message, span, hint))

    # -- names ------------------------------------------------------------------------------
    def declared(self, name: str) -> bool:
        return name in self.values or name in self.axis_names

    def check_expr(self, expr: ast.Expr, *, allow_axes: bool = True,
                   why: str = "shapes are global and must not depend on the mesh",
                   extent: str | None = None, count: bool = False) -> int | None:
        """Report unknown names and functions in ``expr``, then what its constant parts already
        show (a division by zero, a value beyond the limit; for an ``extent``, a negative size or,
        for a ``count``, too many values). Returns its value where it needs no dim, else None."""
        before = len(self.diags)
        for var in names_in(expr):
            if var.name not in self.values and not (allow_axes and var.name in self.axis_names):
                if not allow_axes and var.name in self.axis_names:
                    self.error("UCL106", f"mesh axis {var.name!r} cannot be used here: {why}", var.span)
                else:
                    known = self.values | self.axis_names if allow_axes else self.values
                    self.error("UCL101", f"unknown name {var.name!r}", var.span, did_you_mean(var.name, known))
        for call in calls_in(expr):
            if call.func not in FUNCTIONS:
                self.error("UCL107", f"unknown function {call.func!r}", call.span,
                           did_you_mean(call.func, FUNCTIONS) or f"functions: {', '.join(FUNCTIONS)}")
            else:
                arity = FUNCTIONS[call.func][0]
                if arity is not None and len(call.args) != arity:
                    self.error("UCL107", f"{call.func} takes {arity} arguments, got {len(call.args)}", call.span)
        if len(self.diags) > before:
            return None
        try:
            value = fold(expr, self.constants)
            return check_extent(value, expr, extent, count) if extent is not None else value
        except ExprError as e:
            self.diags.append(e.diagnostic)
            return None

    def check_axis(self, ident: ast.Ident):
        if ident.name not in self.out.axes:
            hint = did_you_mean(ident.name, self.out.axes)
            if not self.out.axes:
                hint = "declare the axes first, e.g. `mesh pp, dp, tp`"
            self.error("UCL103", f"unknown mesh axis {ident.name!r}", ident.span, hint)

    def declare(self, ident: ast.Ident, what: str):
        if self.declared(ident.name):
            self.error("UCL102", f"{what} {ident.name!r} is already declared", ident.span)
            return False
        if ident.name in FUNCTIONS:
            self.error("UCL102", f"{ident.name!r} is a built-in function name", ident.span)
            return False
        return True

    # -- statements ---------------------------------------------------------------------------
    def run(self) -> Checked:
        for st in self.m.statements:
            getattr(self, "on_" + type(st).__name__)(st)
        return self.out

    def on_DimsDecl(self, st: ast.DimsDecl):
        for item in st.items:
            if self.declare(item.name, "dim"):
                self.out.dims.append(item.name.name)
                self.values.add(item.name.name)
                self.out.config_keys[item.name.name] = item.config_keys or (item.name.name,)

    def on_LetDecl(self, st: ast.LetDecl):
        value = self.check_expr(st.value)
        if self.declare(st.name, "name"):
            self.out.lets.append((st.name.name, st.value))
            self.values.add(st.name.name)
            if value is not None:
                self.constants[st.name.name] = value

    def on_MeshDecl(self, st: ast.MeshDecl):
        for ident in st.axes:
            if self.declare(ident, "mesh axis"):
                self.out.axes.append(ident.name)
                self.axis_names.add(ident.name)

    def on_IgnoreDecl(self, st: ast.IgnoreDecl):
        for p in st.patterns:
            self.check_pattern(p)
        self.out.ignores.extend(st.patterns)

    def on_StateDecl(self, st: ast.StateDecl):
        for p in st.patterns:
            self.check_pattern(p)
        for ident in st.kinds:
            if ident.name not in self.out.kinds:
                self.out.kinds.append(ident.name)
        layouts = [t for t in st.transforms if isinstance(t, (ast.Flat, ast.Scalar, ast.Follow))]
        if len(layouts) > 1:
            self.error("UCL110", "a state takes at most one of flat, scalar and follow", layouts[1].span)
        for t in st.transforms:
            if isinstance(t, ast.Dtype) and t.name.name not in LOGICAL_DTYPES:
                self.error("UCL111", f"unknown dtype {t.name.name!r}", t.name.span,
                           did_you_mean(t.name.name, LOGICAL_DTYPES) or f"dtypes: {', '.join(LOGICAL_DTYPES)}")
            if isinstance(t, ast.Scalar) and any(k.name == PARAM for k in st.kinds):
                self.error("UCL110", "the model weights (param) cannot be scalar", t.span)
            if isinstance(t, ast.Flat):
                for axis in t.axes:
                    self.check_axis(axis)
                for e in (t.align, t.pad_multiple, t.bucket):
                    if e is not None:
                        self.check_expr(e)
                if t.per_param and (t.bucket is not None or t.reverse):
                    self.error("UCL110", "per_param flat buffers take no bucket or reverse", t.span)
        self.out.states.append(st)

    def check_pattern(self, pattern: ast.Pattern):
        caps = pattern.captures
        for c in sorted({c for c in caps if caps.count(c) > 1}):
            self.error("UCL112", f"capture {{{c}}} appears twice in the pattern", pattern.span,
                       "give each capture its own name")

    def on_Rule(self, st: ast.Rule):
        self.check_pattern(st.pattern)
        if st.shape is not None:
            sizes = [self.check_expr(e, allow_axes=False, extent=f"dim {d} of the shape") for d, e in enumerate(st.shape)]
            if None not in sizes and math.prod(sizes) > LIMIT:  # more elements than bytes may be addressed
                self.error("UCL113", f"shape {sizes} has {math.prod(sizes):,} elements, beyond 2**62", st.pattern.span)
        placement_only = st.shape is None and all(isinstance(t, PLACEMENT) for t in st.transforms)
        self.check_transforms(st)
        (self.out.placements if placement_only else self.out.rules).append(st)

    # -- transforms ---------------------------------------------------------------------------
    def check_transforms(self, st: ast.Rule):
        """Each transform in order, then the rules that need the whole list."""
        scope = _RuleScope(st)
        for t in st.transforms:
            getattr(self, "transform_" + type(t).__name__)(scope, t)
        self.check_axes_split_once(scope)
        self.check_replicated_axes(scope)
        self.check_factor_split_order(scope)
        self.check_optional(scope)

    def resolve(self, scope: "_RuleScope", ref: ast.DimRef) -> bool:
        """Does ``ref`` name a dim, view factor or concat part declared so far? Reports it if not."""
        root = ref.path[0]
        if scope.ndim is not None and not (0 <= root < scope.ndim):
            self.error("UCL108", f"dim {root} does not exist: the declared shape has {scope.ndim} dims", ref.span)
            return False
        for depth in range(1, len(ref.path)):
            parent, step = ref.path[:depth], ref.path[depth]
            kind = scope.structure.get(parent)
            if kind is None:
                self.error("UCL108", f"dim {'.'.join(map(str, parent))} has no view or concat, so "
                           f"{ref} means nothing", ref.span, "declare `view` or `concat` before using it")
                return False
            if kind[0] == "view" and not (isinstance(step, int) and 0 <= step < kind[1]):
                self.error("UCL108", f"{ref}: the view has {kind[1]} factors (0..{kind[1] - 1})", ref.span)
                return False
            if kind[0] == "concat" and step not in kind[1]:
                self.error("UCL108", f"{ref}: the concat has no part {step!r}", ref.span, did_you_mean(str(step), kind[1]))
                return False
        return True

    def transform_View(self, scope: "_RuleScope", t):
        """view / concat: declare the structure of a dim, before any split of it."""
        if self.resolve(scope, t.dim):
            path = t.dim.path
            if path in scope.structure:
                self.error("UCL109", f"dim {t.dim} is already viewed or concatenated", t.dim.span)
            elif path in scope.split_paths:
                self.error("UCL109", f"view or concat of dim {t.dim} must come before its split", t.span)
            elif isinstance(t, ast.View):
                scope.structure[path] = ("view", len(t.factors))
            else:
                names = [p.name.name for p in t.parts]
                if len(set(names)) != len(names):
                    self.error("UCL109", "concat parts must have distinct names", t.span)
                scope.structure[path] = ("concat", names)
        if isinstance(t, ast.View):
            for k, e in enumerate(t.factors):
                self.check_expr(e, extent=f"view factor {k}")
        else:
            for p in t.parts:
                self.check_expr(p.size, extent=f"concat part {p.name.name!r}")

    transform_Concat = transform_View

    def transform_Split(self, scope: "_RuleScope", t: ast.Split):
        for axis in t.axes:
            self.check_axis(axis)
            if axis.name in scope.placed_axes:
                self.error("UCL109", f"axis {axis.name!r} already places this parameter; it cannot also split it", axis.span)
            scope.split_axes.setdefault(axis.name, t)
        if self.resolve(scope, t.dim):
            scope.split_paths.setdefault(t.dim.path, t)  # the first split of each path
            scope.split_order.append(t)

    def transform_Pad(self, scope: "_RuleScope", t: ast.Pad):
        if len(t.dim.path) != 1:
            self.error("UCL108", "pad applies to a whole dim (write `pad 0 ...`)", t.dim.span)
        elif self.resolve(scope, t.dim):
            if t.dim.root in scope.padded:
                self.error("UCL109", f"dim {t.dim} is padded twice", t.span)
            if t.dim.path in scope.structure or t.dim.path in scope.split_paths:
                self.error("UCL109", f"pad dim {t.dim} before viewing or splitting it", t.span)
            scope.padded.add(t.dim.root)
        self.check_expr(t.target, extent="the pad target")

    def transform_Replicate(self, scope: "_RuleScope", t: ast.Replicate):
        for axis in t.axes:
            self.check_axis(axis)

    def transform_Place(self, scope: "_RuleScope", t: ast.Place):
        self.check_axis(t.axis)
        for c in t.coords:
            if not isinstance(c, str):
                self.check_expr(c)
        self.placed(scope, t.axis, t)

    def transform_Index(self, scope: "_RuleScope", t: ast.Index):
        self.check_axis(t.axis)
        captures = scope.captures
        if t.capture.name not in captures:
            self.error("UCL112", f"the pattern has no capture {{{t.capture.name}}}", t.capture.span,
                       did_you_mean(t.capture.name, captures) or f"captures: {', '.join(sorted(captures)) or 'none'}")
        self.check_expr(t.count, extent=f"the count of {t.capture.name}", count=True)
        if t.virtual is not None:
            self.check_expr(t.virtual)
        for what, e in [("first", t.first), ("last", t.last)] + [(f"stage size {k}", e) for k, e in
                                                                  enumerate(t.sizes or ())]:
            if e is not None:
                self.check_expr(e, extent=what)
        if t.sizes is not None and (t.virtual or t.first or t.last) is not None:
            self.error("UCL110", "`sizes` cannot be combined with virtual, first or last", t.span)
        self.placed(scope, t.axis, t)

    def transform_OptionalMark(self, scope: "_RuleScope", t: ast.OptionalMark):
        if scope.optional is not None:
            self.error("UCL110", "a rule says `optional` at most once", t.span)
        scope.optional = t
        if t.condition is not None:
            self.check_expr(t.condition, allow_axes=False,
                            why="whether a parameter exists cannot depend on the mesh")

    def placed(self, scope: "_RuleScope", axis: ast.Ident, t):
        if axis.name in scope.split_axes:
            self.error("UCL109", f"axis {axis.name!r} already splits this parameter; it cannot also place it", axis.span)
        if axis.name in scope.placed_axes:
            self.error("UCL109", f"axis {axis.name!r} places this parameter twice", axis.span)
        scope.placed_axes[axis.name] = t

    def check_axes_split_once(self, scope: "_RuleScope"):
        """An axis may split a tensor once, except separately in sibling parts of a concat."""
        order = scope.split_order
        for i, a in enumerate(order):
            for b in order[i + 1:]:
                shared = {x.name for x in a.axes} & {x.name for x in b.axes}
                if not shared:
                    continue
                k = 0
                while k < min(len(a.dim.path), len(b.dim.path)) and a.dim.path[k] == b.dim.path[k]:
                    k += 1
                diverge_under_concat = k < min(len(a.dim.path), len(b.dim.path)) and \
                    scope.structure.get(a.dim.path[:k], ("",))[0] == "concat"
                if not diverge_under_concat:
                    self.error("UCL109", f"axis {sorted(shared)[0]!r} splits this parameter twice ({a.dim} and "
                               f"{b.dim}): ranks would hold only parts of the diagonal", b.span,
                               "split each dim over its own axis, or over a tuple of axes")

    def check_replicated_axes(self, scope: "_RuleScope"):
        for t in scope.rule.transforms:
            if isinstance(t, ast.Replicate):
                for axis in t.axes:
                    if axis.name in scope.split_axes:
                        self.error("UCL109", f"axis {axis.name!r} both splits and replicates this parameter", axis.span)

    def check_factor_split_order(self, scope: "_RuleScope"):
        """Splitting a viewed dim and then one of its factors is ambiguous; the other order is well
        defined (the later split cuts the rank-local extent: FSDP on top of TP)."""
        order = scope.split_order
        for i, t in enumerate(order):
            path = t.dim.path
            if scope.structure.get(path, ("",))[0] != "view":
                continue
            for later in order[i + 1:]:
                other = later.dim.path
                if other != path and other[:len(path)] == path:
                    self.error("UCL109", f"dim {t.dim} is split before its factor {later.dim}; split the factor "
                               "first (a later split of the whole dim then cuts each rank's local part)", later.span)

    def check_optional(self, scope: "_RuleScope"):
        """`optional` says which parameters a model may lack: it belongs to layout rules."""
        st = scope.rule
        others = [t for t in st.transforms if not isinstance(t, ast.OptionalMark)]
        if scope.optional is not None and st.shape is None and others and \
                all(isinstance(t, PLACEMENT) for t in others):
            self.error("UCL110", "a placement rule cannot be optional: mark the layout rules of the parameters "
                       "a model may lack", scope.optional.span)


class _RuleScope:
    """What the checker learns about one rule while it walks the rule's transforms in order."""

    def __init__(self, rule: ast.Rule):
        self.rule = rule
        self.ndim = len(rule.shape) if rule.shape is not None else None
        self.structure: dict[tuple, tuple] = {}  # path -> ("view", nfactors) | ("concat", names)
        self.split_paths: dict[tuple, ast.Split] = {}
        self.split_order: list[ast.Split] = []
        self.split_axes: dict[str, ast.Split] = {}
        self.placed_axes: dict[str, object] = {}
        self.padded: set[int] = set()
        self.captures = set(rule.pattern.captures)
        self.optional: ast.OptionalMark | None = None


def check(module: ast.Module) -> Checked:
    checker = _Checker(module)
    result = checker.run()
    if checker.diags:
        raise SpecError(checker.diags, module.source, module.filename)
    return result
