"""AST of a .ucl spec: plain dataclasses, each carrying the Span it came from."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import cached_property
from typing import Union

from ..errors import Span


@dataclass(frozen=True)
class Ident:
    name: str
    span: Span


# ---- expressions -----------------------------------------------------------------------
@dataclass(frozen=True)
class Int:
    value: int
    span: Span


@dataclass(frozen=True)
class Var:
    name: str
    span: Span


@dataclass(frozen=True)
class Step:
    """One operator of a Chain and its right operand; ``span`` covers the chain up to here."""

    op: str  # + - * / // %
    operand: "Expr"
    span: Span


@dataclass(frozen=True)
class Chain:
    """Left-associative operators of one precedence level as one node: ``a - b + c`` is
    ``Chain(a, (Step("-", b), Step("+", c)))``. A sum of any length is one level deep, so checking
    and evaluating it is a loop, never a recursion as deep as the sum is long."""

    first: "Expr"
    steps: tuple[Step, ...]
    span: Span


@dataclass(frozen=True)
class Neg:
    """``count`` unary minuses in a row (``- - a``: 2), one node for the same reason as Chain."""

    operand: "Expr"
    span: Span
    count: int = 1


@dataclass(frozen=True)
class Call:
    func: str
    args: tuple["Expr", ...]
    span: Span


Expr = Union[Int, Var, Chain, Neg, Call]


# ---- names ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Pattern:
    """A parameter-name pattern: dotted segments, ``{capture}`` (digits), ``*`` (within one
    segment) and ``**`` (any run of characters, dots included)."""

    text: str
    span: Span

    @cached_property
    def captures(self) -> tuple[str, ...]:
        return tuple(re.findall(r"\{([A-Za-z_]\w*)\}", self.text))

    @cached_property
    def regex(self) -> re.Pattern:
        out, i, t = [], 0, self.text
        while i < len(t):
            if t.startswith("**", i):
                out.append(".*")
                i += 2
            elif t[i] == "*":
                out.append(r"[^.]*")
                i += 1
            elif t[i] == "{":
                j = t.index("}", i)
                out.append(f"(?P<{t[i + 1:j]}>\\d+)")
                i = j + 1
            else:
                out.append(re.escape(t[i]))
                i += 1
        return re.compile("".join(out))

    def match(self, name: str) -> re.Match | None:
        return self.regex.fullmatch(name)


@dataclass(frozen=True)
class DimRef:
    """``0``, ``0.1`` (factor 1 of a view of dim 0), ``0.q`` (part q of a concat), ``0.k.0``."""

    path: tuple[Union[int, str], ...]
    span: Span

    @property
    def root(self) -> int:
        return self.path[0]  # type: ignore[return-value]

    def __str__(self) -> str:
        return ".".join(str(p) for p in self.path)


# ---- parameter transforms ------------------------------------------------------------
@dataclass(frozen=True)
class Split:
    dim: DimRef
    axes: tuple[Ident, ...]
    mode: str  # even | uneven | shared
    span: Span


@dataclass(frozen=True)
class Replicate:
    axes: tuple[Ident, ...]  # empty: every axis
    span: Span


@dataclass(frozen=True)
class View:
    dim: DimRef
    factors: tuple[Expr, ...]
    span: Span


@dataclass(frozen=True)
class Part:
    name: Ident
    size: Expr


@dataclass(frozen=True)
class Concat:
    dim: DimRef
    parts: tuple[Part, ...]
    span: Span


@dataclass(frozen=True)
class Pad:
    dim: DimRef
    target: Expr
    multiple: bool  # pad to a multiple of target, else to exactly target
    span: Span


@dataclass(frozen=True)
class Place:
    axis: Ident
    coords: tuple[Union[str, Expr], ...]  # "first" | "last" | Expr
    span: Span


@dataclass(frozen=True)
class Index:
    capture: Ident
    count: Expr
    axis: Ident
    virtual: Expr | None
    sizes: tuple[Expr, ...] | None
    first: Expr | None
    last: Expr | None
    span: Span
    keep: bool = False  # `keep`: the local name keeps the global value of the capture


@dataclass(frozen=True)
class OptionalMark:
    """``optional`` / ``optional if e``: the rule's parameters may be missing from a model, so
    ``synthesize_params`` leaves them out (with a condition: only where ``e`` is nonzero)."""

    condition: Expr | None
    span: Span


Transform = Union[Split, Replicate, View, Concat, Pad, Place, Index, OptionalMark]


# ---- state transforms ------------------------------------------------------------------
@dataclass(frozen=True)
class Dtype:
    name: Ident
    span: Span


@dataclass(frozen=True)
class Scalar:
    span: Span


@dataclass(frozen=True)
class Follow:
    span: Span


@dataclass(frozen=True)
class Flat:
    axes: tuple[Ident, ...]
    per_param: bool
    reverse: bool
    align: Expr | None
    pad_multiple: Expr | None
    bucket: Expr | None
    span: Span


StateTransform = Union[Dtype, Scalar, Follow, Flat]


# ---- statements --------------------------------------------------------------------------
@dataclass(frozen=True)
class DimItem:
    name: Ident
    config_keys: tuple[str, ...]  # Hugging Face config.json fields to read it from (first present wins)


@dataclass(frozen=True)
class DimsDecl:
    items: tuple[DimItem, ...]
    span: Span

    @property
    def names(self) -> tuple[Ident, ...]:
        return tuple(i.name for i in self.items)


@dataclass(frozen=True)
class LetDecl:
    name: Ident
    value: Expr
    span: Span


@dataclass(frozen=True)
class MeshDecl:
    axes: tuple[Ident, ...]
    span: Span


@dataclass(frozen=True)
class IgnoreDecl:
    patterns: tuple[Pattern, ...]
    span: Span


@dataclass(frozen=True)
class StateDecl:
    kinds: tuple[Ident, ...]
    patterns: tuple[Pattern, ...]  # `for P | Q`: the parameters it is for; () = all
    transforms: tuple[StateTransform, ...]
    span: Span


@dataclass(frozen=True)
class Rule:
    pattern: Pattern
    shape: tuple[Expr, ...] | None
    transforms: tuple[Transform, ...]
    span: Span


Statement = Union[DimsDecl, LetDecl, MeshDecl, IgnoreDecl, StateDecl, Rule]


@dataclass(frozen=True)
class Module:
    statements: tuple[Statement, ...]
    source: str = field(repr=False)
    filename: str
