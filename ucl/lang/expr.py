"""Integer expressions of the language: evaluation with exact division and clear errors."""
from __future__ import annotations

import math
from typing import Mapping

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


class ExprError(Exception):
    """Internal: carries a Diagnostic out of evaluation; callers turn it into a UclError."""

    def __init__(self, diagnostic: Diagnostic):
        super().__init__(diagnostic.message)
        self.diagnostic = diagnostic


def names_in(expr: ast.Expr):
    """Yield every Var in an expression (for static checks)."""
    if isinstance(expr, ast.Var):
        yield expr
    elif isinstance(expr, ast.BinOp):
        yield from names_in(expr.left)
        yield from names_in(expr.right)
    elif isinstance(expr, ast.Neg):
        yield from names_in(expr.operand)
    elif isinstance(expr, ast.Call):
        for a in expr.args:
            yield from names_in(a)


def calls_in(expr: ast.Expr):
    if isinstance(expr, ast.Call):
        yield expr
        for a in expr.args:
            yield from calls_in(a)
    elif isinstance(expr, ast.BinOp):
        yield from calls_in(expr.left)
        yield from calls_in(expr.right)
    elif isinstance(expr, ast.Neg):
        yield from calls_in(expr.operand)


def evaluate(expr: ast.Expr, env: Mapping[str, int]) -> int:
    value = _evaluate(expr, env)
    if not -LIMIT <= value <= LIMIT:
        raise ExprError(Diagnostic("UCL113", f"value {value} is too large (the limit is 2**62)", expr.span))
    return value


def _evaluate(expr: ast.Expr, env: Mapping[str, int]) -> int:
    if isinstance(expr, ast.Int):
        return expr.value
    if isinstance(expr, ast.Var):
        if expr.name not in env:
            raise ExprError(Diagnostic("UCL101", f"unknown name {expr.name!r}", expr.span, did_you_mean(expr.name, env)))
        return env[expr.name]
    if isinstance(expr, ast.Neg):
        return -evaluate(expr.operand, env)
    if isinstance(expr, ast.Call):
        arity, fn = FUNCTIONS[expr.func]
        args = [evaluate(a, env) for a in expr.args]
        if expr.func == "ceil_div" and args[1] == 0:
            raise ExprError(Diagnostic("UCL105", "division by zero", expr.span))
        return int(fn(*args))
    a, b = evaluate(expr.left, env), evaluate(expr.right, env)
    op = expr.op
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    if b == 0:
        raise ExprError(Diagnostic("UCL105", "division by zero", expr.span))
    if op == "/":
        if a % b:
            raise ExprError(Diagnostic("UCL104", f"{a} / {b} is not exact", expr.span,
                                       "use // to round down or ceil_div(a, b) to round up"))
        return a // b
    if op == "//":
        return a // b
    return a % b


def evaluate_lets(lets, env: Mapping[str, int]) -> tuple[dict[str, int], dict[str, ExprError]]:
    """The one evaluator of ``let`` statements, in order: ``(env extended by every let that could be
    evaluated, {name: error} for those that could not)``. A let that names an unknown value (a mesh
    axis not given yet, or an earlier broken let) is left out; callers decide what is an error."""
    out = dict(env)
    broken: dict[str, ExprError] = {}
    for name, expr in lets:
        try:
            out[name] = evaluate(expr, out)
        except ExprError as e:
            broken[name] = e
    return out, broken
