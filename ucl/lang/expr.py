"""Integer expressions of the language: evaluation with exact division and clear errors.

The parser keeps expressions shallow (a chain of ``+`` or ``*`` of any length is one ``Chain`` node,
``- - a`` one ``Neg``, and nesting deeper than :data:`MAX_DEPTH` is a spec error), so the recursion
here is bounded by how deeply a spec nests parentheses and calls, never by how long it is."""
from __future__ import annotations

import math
from typing import Iterator, Mapping

from . import ast
from ..errors import Diagnostic, did_you_mean

FUNCTIONS = {
    "ceil_div": (2, lambda a, b: -(-a // b)),
    "min": (None, lambda *a: min(a)),
    "max": (None, lambda *a: max(a)),
    "lcm": (None, math.lcm),
    "gcd": (None, math.gcd),
}
LIMIT = 1 << 62  # values stay far inside int64: shapes, offsets and products are numpy int64
MAX_DEPTH = 100  # levels of parentheses, calls and operators of different precedence in one expression
MAX_COUNT = 1 << 20  # values of one `index c of N`: names are enumerated per value, so N must be sane
_DIVISIONS = ("/", "//", "%")


class ExprError(Exception):
    """Internal: carries a Diagnostic out of evaluation; callers turn it into a UclError. ``unknown``
    is the name an unknown-name error (UCL101) is about: callers skip errors about names they know
    to be missing for a reason reported elsewhere (a mesh axis, a broken ``let``)."""

    def __init__(self, diagnostic: Diagnostic, unknown: str | None = None):
        super().__init__(diagnostic.message)
        self.diagnostic = diagnostic
        self.unknown = unknown


def subexpressions(expr: ast.Expr) -> tuple[ast.Expr, ...]:
    """The direct operands of ``expr``, left to right."""
    if isinstance(expr, ast.Chain):
        return (expr.first,) + tuple(s.operand for s in expr.steps)
    if isinstance(expr, ast.Neg):
        return (expr.operand,)
    if isinstance(expr, ast.Call):
        return expr.args
    return ()


def _walk(expr: ast.Expr) -> Iterator[ast.Expr]:
    """Every node of ``expr``, pre-order, left to right (an explicit stack: no recursion)."""
    stack = [expr]
    while stack:
        e = stack.pop()
        yield e
        stack.extend(reversed(subexpressions(e)))


def names_in(expr: ast.Expr) -> Iterator[ast.Var]:
    """Yield every Var in an expression (for static checks)."""
    return (e for e in _walk(expr) if isinstance(e, ast.Var))


def calls_in(expr: ast.Expr) -> Iterator[ast.Call]:
    return (e for e in _walk(expr) if isinstance(e, ast.Call))


def evaluate(expr: ast.Expr, env: Mapping[str, int]) -> int:
    """The value of ``expr`` with the names in ``env``; any problem is an ExprError."""
    return _checked(expr, env, False)  # type: ignore[return-value]


def fold(expr: ast.Expr, env: Mapping[str, int]) -> int | None:
    """What can be known of ``expr`` before the dims are: its value when every name it uses is in
    ``env``, else None. Errors that no value of the unknown names can avoid (a division by a
    constant 0, a constant beyond the limit) are raised all the same, so a spec check finds them."""
    return _checked(expr, env, True)


def evaluate_extent(expr: ast.Expr, env: Mapping[str, int], what: str) -> int:
    """An expression that is a size (a shape's dim, a view factor, a concat part, an index count):
    a negative value is an error at the expression, never a silently empty or inverted range."""
    return check_extent(evaluate(expr, env), expr, what)  # type: ignore[return-value]


def check_extent(value: int | None, expr: ast.Expr, what: str, count: bool = False) -> int | None:
    """``value`` (None: not known yet) of the size ``expr``; raises ExprError when it is negative,
    or, for a ``count`` of values that are enumerated one by one, beyond :data:`MAX_COUNT`."""
    if value is not None and value < 0:
        raise ExprError(Diagnostic("UCL114", f"{what} is {value}: a size cannot be negative", expr.span))
    if count and value is not None and value > MAX_COUNT:
        raise ExprError(Diagnostic("UCL116", f"{what} is {value:,}, more than the {MAX_COUNT:,} (2**20) values "
                                   "an index may take", expr.span,
                                   "an index counts layers or experts; check the dims it is computed from"))
    return value


def _checked(expr: ast.Expr, env: Mapping[str, int], partial: bool) -> int | None:
    value = _value(expr, env, partial)
    if value is not None and not -LIMIT <= value <= LIMIT:
        raise ExprError(Diagnostic("UCL113", f"value {value} is too large (the limit is 2**62)", expr.span))
    return value


def _value(expr: ast.Expr, env: Mapping[str, int], partial: bool) -> int | None:
    if isinstance(expr, ast.Int):
        return expr.value
    if isinstance(expr, ast.Var):
        if expr.name in env:
            return env[expr.name]
        if partial:
            return None
        raise ExprError(Diagnostic("UCL101", f"unknown name {expr.name!r}", expr.span, did_you_mean(expr.name, env)),
                        unknown=expr.name)
    if isinstance(expr, ast.Neg):
        v = _checked(expr.operand, env, partial)
        return None if v is None else -v if expr.count % 2 else v
    if isinstance(expr, ast.Call):
        arity, fn = FUNCTIONS[expr.func]
        args = [_checked(a, env, partial) for a in expr.args]
        if expr.func == "ceil_div" and args[1] == 0:
            raise ExprError(Diagnostic("UCL105", "division by zero", expr.span))
        return None if None in args else int(fn(*args))
    acc = _checked(expr.first, env, partial)
    for step in expr.steps:
        b = _checked(step.operand, env, partial)
        if b == 0 and step.op in _DIVISIONS:
            raise ExprError(Diagnostic("UCL105", "division by zero", step.span))
        acc = None if acc is None or b is None else _apply(step, acc, b)
        if acc is not None and not -LIMIT <= acc <= LIMIT:
            raise ExprError(Diagnostic("UCL113", f"value {acc} is too large (the limit is 2**62)", step.span))
    return acc


def _apply(step: ast.Step, a: int, b: int) -> int:
    op = step.op
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    if op == "/":
        if a % b:
            raise ExprError(Diagnostic("UCL104", f"{a} / {b} is not exact", step.span,
                                       "use // to round down or ceil_div(a, b) to round up"))
        return a // b
    if op == "//":
        return a // b
    return a % b


def evaluate_lets(lets, env: Mapping[str, int]) -> tuple[dict[str, int], dict[str, ExprError]]:
    """The one evaluator of ``let`` statements, in order: ``(env extended by every let that could be
    evaluated, {name: error} for those that could not)``. A let that names an unknown value (a mesh
    axis not given yet, or an earlier broken let) is left out; callers decide what is an error (see
    :func:`root_causes`)."""
    out = dict(env)
    broken: dict[str, ExprError] = {}
    for name, expr in lets:
        try:
            out[name] = evaluate(expr, out)
        except ExprError as e:
            broken[name] = e
    return out, broken


def root_causes(broken: Mapping[str, ExprError], absent=()) -> list[Diagnostic]:
    """The diagnostics of the broken lets worth reporting: not those that only name an earlier
    broken let (its own error says what is wrong) or a name in ``absent`` (mesh axes not given)."""
    return [e.diagnostic for e in broken.values() if not _follows(e, broken, absent)]


def _follows(e: ExprError, broken: Mapping[str, ExprError], absent=()) -> bool:
    return e.unknown is not None and (e.unknown in broken or e.unknown in absent)


def reportable(e: ExprError, broken: Mapping[str, ExprError], absent=()) -> bool:
    """Whether an expression's error is news: not an unknown-name error about a broken let or an
    ``absent`` name, which would repeat (or wrongly restate) a problem reported once already."""
    return not _follows(e, broken, absent)
