"""Binding: a Spec applied to one model's parameter names and shapes (pure, no mesh yet)."""
from __future__ import annotations

import itertools
import numbers
import re
from dataclasses import dataclass, field
from typing import Iterable, Mapping

from ..dtypes import itemsize
from ..errors import BindError, Diagnostic, SpecError, closest, did_you_mean
from ..lang import ast
from ..lang.check import PARAM
from ..lang.expr import (LIMIT, ExprError, check_extent, evaluate, evaluate_extent, evaluate_lets,
                         reportable, root_causes)
from .derived import Derived
from .dims import build_dims
from .mesh import Mesh


@dataclass(eq=False)
class Tensor:
    """One logical tensor: a parameter (kind ``param``) or one of its optimizer states."""

    id: int
    name: str  # global parameter name
    kind: str
    shape: tuple[int, ...]
    dtype: str
    rule: ast.Rule
    placement: ast.Rule | None
    match: re.Match
    state: ast.StateDecl | None = None
    flat: ast.Flat | None = None
    scalar: bool = False
    flat_group: int = -1  # index into Model.flat_groups

    @property
    def key(self) -> str:
        return f"{self.kind}/{self.name}"

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def cuts_last_dim(self) -> bool:
        """Whether its rule splits or pads its last dim (of two or more), on any mesh: only then do
        layouts of this spec read a stored copy of it in column blocks, which tile digests serve
        (docs/format.md); its other cuts read whole rows, which flat chunks serve as finely."""
        last = len(self.shape) - 1
        return last >= 1 and any(
            isinstance(t, (ast.Split, ast.Pad)) and t.dim.root == last for t in self.rule.transforms)


@dataclass(eq=False)
class FlatGroup:
    """Tensors of one kind flattened together by one ``state ... : flat over ...`` statement."""

    id: int
    number: int  # index of its statement among flat statements: datasets are KIND/@flat<number>
    kind: str
    decl: ast.StateDecl
    flat: ast.Flat
    members: list[Tensor] = field(default_factory=list)


class PatternIndex:
    """Items keyed by patterns, looked up by name: a name tries only the patterns whose literal
    prefix (the text before the first capture or glob) it starts with, so matching n names against
    n rules is near-linear, not n x n regex matches. Every pattern that matches is found, in order."""

    def __init__(self, items: Iterable[tuple[ast.Pattern, object]]):
        self._by_prefix: dict[str, list[tuple[int, ast.Pattern, object]]] = {}
        for order, (pattern, item) in enumerate(items):
            prefix = re.split(r"[*{]", pattern.text, maxsplit=1)[0]
            self._by_prefix.setdefault(prefix, []).append((order, pattern, item))
        self._lengths = sorted({len(p) for p in self._by_prefix})

    def matches(self, name: str) -> list:
        """The items whose pattern matches ``name``, in the order they were given."""
        found = []
        for n in self._lengths:
            if n > len(name):
                break
            found += self._by_prefix.get(name[:n], ())
        found.sort(key=lambda x: x[0])
        return [item for _, pattern, item in found if pattern.match(name)]


def _shape_problem(shape) -> str | None:
    """Why ``shape`` (from a model, or a checkpoint written by anyone) is not a list of
    non-negative integers, or None."""
    if isinstance(shape, (str, bytes)) or not isinstance(shape, Iterable):
        return f"is {shape!r}, not a list of sizes"
    for x in shape:
        if isinstance(x, bool) or not isinstance(x, numbers.Integral):
            return f"has the size {x!r}, not an integer"
        if x < 0:
            return f"has the size {int(x)}: a size cannot be negative"
        if x > LIMIT:
            return f"has the size {int(x)}, beyond 2**62"
    return None


def _read_params(params, problems: list[Diagnostic]) -> dict[str, tuple[int, ...]]:
    """``{name: shape}`` from a mapping or (name, shape) pairs; malformed entries are problems."""
    out: dict[str, tuple[int, ...]] = {}
    try:
        items = list(params.items() if isinstance(params, Mapping) else params)
    except (TypeError, ValueError) as e:
        problems.append(Diagnostic("UCL213", f"the parameters must be a mapping of names to shapes: {e}"))
        return out
    for item in items:
        if not (isinstance(item, tuple) and len(item) == 2):
            problems.append(Diagnostic("UCL213", f"parameter entry {item!r} is not a (name, shape) pair"))
            continue
        name, shape = item
        if not isinstance(name, str):
            problems.append(Diagnostic("UCL213", f"parameter name {name!r} is not a string"))
            continue
        if hasattr(shape, "dtype") and len(getattr(shape, "shape", (0,))) != 1:  # a tensor, not its shape
            problems.append(Diagnostic("UCL213", f"parameter {name!r} is given as a {type(shape).__name__}; bind "
                                                 "takes shapes", hint="pass {name: tuple(t.shape) for name, t in ...}"))
            continue
        why = _shape_problem(shape)
        if why is not None:
            problems.append(Diagnostic("UCL213", f"parameter {name!r} {why}"))
            continue
        out[name] = tuple(int(x) for x in shape)
    return out


class Model:
    def __init__(self, spec, dims: Mapping[str, int], params, frozen: Iterable[str] = ()):
        self.spec = spec
        ck = spec.checked
        problems: list[Diagnostic] = []
        self.params: dict[str, tuple[int, ...]] = _read_params(params, problems)
        self.frozen = frozenset(frozen)

        missing = [d for d in ck.dims if d not in dims]
        extra = [d for d in dims if d not in ck.dims]
        if missing:
            problems.append(Diagnostic("UCL209", f"dims not given: {', '.join(missing)}", None,
                                       f"the spec declares: {', '.join(ck.dims)}"))
        for d in extra:
            problems.append(Diagnostic("UCL209", f"unknown dim {d!r}", None, did_you_mean(d, ck.dims)))
        for d, v in dims.items():
            if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= LIMIT:
                problems.append(Diagnostic("UCL209", f"dim {d}={v!r} must be a non-negative integer "
                                           "(at most 2**62)"))
        for f in self.frozen - set(self.params):
            problems.append(Diagnostic("UCL201", f"frozen parameter {f!r} is not a parameter of the model"))
        if problems:
            self._fail(problems)
        self.dims = {d: int(dims[d]) for d in ck.dims}
        # lets that need mesh sizes are evaluated per mesh (env); the others are errors now
        self.static_env, self._broken = evaluate_lets(ck.lets, self.dims)
        problems += root_causes(self._broken, ck.axes)  # lets naming a mesh axis wait for a mesh
        self._rules = PatternIndex((r.pattern, r) for r in ck.rules)
        self._placements = PatternIndex((r.pattern, r) for r in ck.placements)
        self._ignores = PatternIndex((p, p) for p in ck.ignores)
        self._states: dict[str, tuple[list, PatternIndex]] = {}  # kind -> (general decls, `for PATTERN` decls)
        for d in ck.states:
            for k in dict.fromkeys(k.name for k in d.kinds):
                general, specific = self._states.setdefault(k, ([], []))
                (specific if d.patterns else general).append(d)
        self._states = {k: (g, PatternIndex((p, d) for d in sp for p in d.patterns))
                        for k, (g, sp) in self._states.items()}

        self._reported: set[Diagnostic] = set()
        self.tensors: list[Tensor] = []
        self.flat_groups: list[FlatGroup] = []
        groups: dict[tuple[int, str], FlatGroup] = {}
        flat_decls = [d for d in ck.states if any(isinstance(x, ast.Flat) for x in d.transforms)]
        for name, shape in self.params.items():
            rule, placement = self._match(name, problems)
            if rule is None:
                continue
            self._check_shape(name, shape, rule, problems)
            m = rule.pattern.match(name)
            for kind in ck.kinds:
                decl = self._state_decl(name, kind, problems)
                if kind != PARAM and (decl is None or name in self.frozen):
                    continue
                t = Tensor(len(self.tensors), name, kind, shape, "float32", rule, placement, m, decl)
                for tr in (decl.transforms if decl else ()):
                    if isinstance(tr, ast.Dtype):
                        t.dtype = tr.name.name
                    elif isinstance(tr, ast.Flat):
                        t.flat = tr
                    elif isinstance(tr, ast.Scalar):
                        t.scalar, t.shape = True, ()
                if t.numel * itemsize(t.dtype) > LIMIT:
                    problems.append(Diagnostic("UCL113", f"{t.kind} {name!r} {list(shape)} ({t.dtype}) holds "
                                               f"{t.numel * itemsize(t.dtype):,} bytes, beyond 2**62", rule.pattern.span))
                    continue
                if t.flat is not None:
                    g = groups.get((id(decl), kind))
                    if g is None:
                        g = groups[(id(decl), kind)] = FlatGroup(len(self.flat_groups), flat_decls.index(decl), kind,
                                                                   decl, t.flat)
                        self.flat_groups.append(g)
                    t.flat_group = g.id
                    g.members.append(t)
                self.tensors.append(t)
        if not problems:
            problems += self._check_structure()
        if problems:
            self._fail(problems)
        for g in self.flat_groups:
            if g.flat.reverse:
                g.members.reverse()
        self._by_key = {t.key: t for t in self.tensors}
        self.derived = Derived()  # caches of later layers (lowering, proofs, plans), each its owner's

    # -- binding helpers -------------------------------------------------------------------
    def _fail(self, problems):
        raise BindError(problems, self.spec.text, self.spec.filename)

    def _match(self, name, problems):
        hits = self._rules.matches(name)
        ignored = bool(self._ignores.matches(name))
        places = self._placements.matches(name)
        if len(places) > 1:
            problems.append(Diagnostic("UCL202", f"parameter {name!r} is placed by {len(places)} rules (lines "
                                       f"{', '.join(str(r.span.line) for r in places)})", places[1].pattern.span,
                                       "one placement rule per parameter: merge them into one rule with every "
                                       "placement (`index i of layers over pp; index e of experts over ep`), or put "
                                       "one of them in the parameter's layout rule"))
        if len(hits) == 1 and not ignored:
            return hits[0], (places[0] if places else None)
        if ignored and not hits:
            return None, None
        if not hits:
            problems.append(Diagnostic("UCL201", f"parameter {name!r} {tuple(self.params[name])} matches no rule",
                                       None, "add a rule for it or `ignore` it"))
        else:
            lines = ", ".join(f"{r.pattern.text} (line {r.span.line})" for r in hits)
            problems.append(Diagnostic("UCL202", f"parameter {name!r} matches {len(hits) + ignored} rules: {lines}"
                                       + (" and an ignore" if ignored else ""), hits[-1].pattern.span,
                                       "make the patterns disjoint"))
        return None, None

    def _check_shape(self, name, shape, rule, problems):
        if rule.shape is not None:
            if len(rule.shape) != len(shape):
                problems.append(Diagnostic("UCL203", f"parameter {name!r} has shape {list(shape)} ({len(shape)} dims) "
                                           f"but the rule declares {len(rule.shape)} dims", rule.pattern.span))
                return
            for d, (expr, actual) in enumerate(zip(rule.shape, shape)):
                try:
                    want = evaluate_extent(expr, self.static_env, f"dim {d} of the shape")
                except ExprError as e:
                    # a broken let was reported once already; one rule's error is one problem
                    if reportable(e, self._broken) and e.diagnostic not in self._reported:
                        self._reported.add(e.diagnostic)
                        problems.append(e.diagnostic)
                    continue
                if want != actual:
                    problems.append(Diagnostic("UCL203", f"parameter {name!r} has shape {list(shape)}, but the rule "
                                               f"declares dim {d} = {want}", expr.span))
        for t in rule.transforms:
            ref = getattr(t, "dim", None)
            if ref is not None and ref.root >= len(shape):
                problems.append(Diagnostic("UCL108", f"parameter {name!r} has {len(shape)} dims; dim {ref.root} "
                                           "does not exist", ref.span))

    def _state_decl(self, name, kind, problems):
        general, specific = self._states.get(kind, ((), None))
        decls = list({id(d): d for d in specific.matches(name)}.values()) if specific is not None else []
        if not decls:  # a `for PATTERN` statement overrides a general one
            decls = list(general)
        if len(decls) > 1:
            problems.append(Diagnostic("UCL208", f"state {kind!r} of {name!r} is declared by {len(decls)} statements "
                                       f"(lines {', '.join(str(d.span.line) for d in decls)})", decls[1].span))
        return decls[0] if decls else None

    def _check_structure(self) -> list[Diagnostic]:
        """Views, concats and pads that cannot fit the real shapes are reported now, not only when
        some mesh is compiled (mesh axes count as size 1 here)."""
        env = self.env(Mesh())
        found, seen_rules = [], set()
        for t in self.tensors:
            if t.kind != PARAM or (id(t.rule), t.shape) in seen_rules:
                continue
            seen_rules.add((id(t.rule), t.shape))
            try:
                build_dims(self, t, env, Mesh())
            except BindError as e:
                found.extend(e.diagnostics)
        return found

    # -- queries -----------------------------------------------------------------------------
    def tensor(self, key: str) -> Tensor:
        return self._by_key[key]

    def env(self, mesh: Mesh) -> dict[str, int]:
        mesh.check_axes(self.spec.checked.axes)
        env, broken = evaluate_lets(self.spec.checked.lets, {**self.dims, **{a: mesh.axis_size(a) for a in self.spec.checked.axes}})
        if broken:  # the first that is not just a consequence of another
            self._fail(root_causes(broken)[:1] or [next(iter(broken.values())).diagnostic])
        return env

    def unmatched(self) -> list[Diagnostic]:
        """Warnings for the patterns that match no parameter of this model: layout rules not marked
        ``optional``, placement rules, ``ignore`` patterns and ``state ... for`` patterns. Binding
        allows them (one spec serves models with and without some parameters), but a misspelt
        pattern shows here: a ``state ... for`` pattern that matches nothing leaves those states to
        the general statement, which describes another layout."""
        ck = self.spec.checked
        indexes = [PatternIndex((r.pattern, r.pattern) for r in ck.rules),
                   PatternIndex((r.pattern, r.pattern) for r in ck.placements),
                   PatternIndex((p, p) for p in ck.ignores),
                   PatternIndex((p, p) for d in ck.states for p in d.patterns)]
        used: set[int] = set()
        for name in self.params:
            for index in indexes:
                used.update(id(p) for p in index.matches(name))
        found = []

        def warn(pattern: ast.Pattern, what: str, hint: str) -> None:
            if id(pattern) not in used:
                found.append(Diagnostic("", f"{what} matches no parameter of the model",
                                        pattern.span, hint + _closest(pattern.text, self.params), "warning"))

        for r in ck.rules:
            try:
                optional = _is_optional(r, self.static_env)
            except ExprError:
                optional = True  # its condition is an error reported where it is evaluated
            if not optional:
                warn(r.pattern, f"rule `{r.pattern.text}`", "mark it `optional` if some models lack these parameters")
        for r in ck.placements:
            warn(r.pattern, f"placement rule `{r.pattern.text}`", "check the pattern against the model's names")
        for p in ck.ignores:
            warn(p, f"`ignore {p.text}`", "check the pattern against the model's names")
        for d in ck.states:
            for p in d.patterns:
                kinds = ", ".join(k.name for k in d.kinds)
                warn(p, f"`state {kinds} for {p.text}`", f"the parameters it was meant for take {kinds} from the "
                     "statement without `for`, or have none")
        return sorted(found, key=lambda d: (d.span.line, d.span.col))

    def fingerprint(self) -> dict:
        return {"dims": self.dims, "params": {n: list(s) for n, s in self.params.items()},
                "frozen": sorted(self.frozen)}


def _is_optional(rule: ast.Rule, env: Mapping[str, int]) -> bool:
    """Does ``rule`` say the model may lack its parameters (``optional``, or ``optional if e`` with
    ``e`` nonzero in ``env``)? Raises ExprError if the condition cannot be evaluated."""
    for t in rule.transforms:
        if isinstance(t, ast.OptionalMark):
            return t.condition is None or evaluate(t.condition, env) != 0
    return False


MAX_PARAMS = 1 << 22  # parameter names synthesize_params makes at most (MAX_COUNT bounds each index)


def _closest(pattern: str, names: Iterable[str]) -> str:
    """``; did you mean NAME?`` for the parameter name nearest to ``pattern`` (captures and digit
    runs compared as 0), or nothing."""
    shapes: dict[str, str] = {}
    for n in names:
        shapes.setdefault(re.sub(r"\d+", "0", n), n)
    near = closest(re.sub(r"\{\w+\}", "0", pattern).replace("*", ""), shapes)
    return f"; did you mean `{shapes[near]}`?" if near else ""


def _rule_list(rules) -> str:
    return ", ".join(f"`{r.pattern.text}` (line {r.span.line})" for r in rules)


def synthesize_params(spec, dims: Mapping[str, int]) -> dict[str, tuple[int, ...]]:
    """Parameter names and shapes from the spec alone, for planning from metadata: every layout
    rule must declare its shape and use no globs, and each capture must be spread by an
    ``index c of N`` so its values are known. Rules marked ``optional`` (or ``optional if e`` with
    ``e`` nonzero) are left out: the model may lack their parameters. Order: rules before the first
    rule with captures, then the captured rules index-major (layer 0's rules, then layer 1's...),
    then the remaining rules."""
    axes = spec.checked.axes
    env, broken = evaluate_lets(spec.checked.lets, dims)
    problems = root_causes(broken, axes)  # a let naming a mesh axis is fine until a shape needs it
    seen = set(problems)

    def report(e: ExprError):
        if reportable(e, broken) and e.diagnostic not in seen:  # once, and not again through a broken let
            seen.add(e.diagnostic)
            problems.append(e.diagnostic)

    counts: dict[str, int] = {}
    refused: set[str] = set()  # captures whose count is an error already: not also "uncounted"
    for rule in spec.checked.rules + spec.checked.placements:
        for t in rule.transforms:
            if isinstance(t, ast.Index):
                try:  # bounded before a single name is made: `index i of 10**12` is refused, not enumerated
                    counts[t.capture.name] = check_extent(evaluate(t.count, env), t.count,
                                                          f"the count of {t.capture.name}", count=True)
                except ExprError as e:
                    refused.add(t.capture.name)
                    report(e)
    head, body, tail = [], [], []
    globbed, shapeless, uncounted = [], [], {}
    total = 0
    for order, rule in enumerate(spec.checked.rules):
        try:
            if _is_optional(rule, env):
                continue
        except ExprError as e:
            report(e)
            continue
        if "*" in rule.pattern.text:
            globbed.append(rule)
            continue
        if rule.shape is None:
            shapeless.append(rule)
            continue
        try:
            shape = tuple(evaluate_extent(e, env, f"dim {d} of the shape") for d, e in enumerate(rule.shape))
        except ExprError as e:
            report(e)
            continue
        caps = rule.pattern.captures
        if not caps:
            (tail if body else head).append((rule.pattern.text, shape))
            continue
        missing = [c for c in caps if c not in counts]
        if missing:
            if not refused.intersection(missing):
                uncounted.setdefault(missing[0], []).append(rule)
            continue
        many = 1
        for c in caps:
            many *= counts[c]
        total += many
        if total > MAX_PARAMS:
            problems.append(Diagnostic("UCL116", f"the spec makes more than {MAX_PARAMS:,} (2**22) parameter names "
                                       f"(`{rule.pattern.text}` alone makes {many:,})", rule.pattern.span,
                                       "check the dims the `index` counts are computed from"))
            break
        for values in itertools.product(*(range(counts[c]) for c in caps)):
            name = rule.pattern.text
            for c, v in zip(caps, values):
                name = name.replace("{" + c + "}", str(v))
            body.append((values, order, name, shape))
    if globbed or shapeless:
        reasons = []
        if globbed:
            reasons.append(f"{len(globbed)} rule{'s' if len(globbed) > 1 else ''} with globs ({_rule_list(globbed)}): "
                           "the names they match are not known")
        if shapeless:
            reasons.append(f"{len(shapeless)} rule{'s' if len(shapeless) > 1 else ''} without a declared shape "
                           f"({_rule_list(shapeless)})")
        first = min(globbed + shapeless, key=lambda r: (r.span.line, r.span.col))
        problems.append(Diagnostic(
            "UCL212", "cannot synthesize the parameters from the spec alone: " + "; ".join(reasons), first.pattern.span,
            "pass the parameters: `--params MODEL` (ucl plan) or `--against MODEL` (ucl check) on the command "
            "line, or `spec.bind(dims, params)` with the model's names and shapes; mark rules whose parameters a "
            "model may lack `optional`"))
    for cap, rules in uncounted.items():
        problems.append(Diagnostic("UCL212", f"capture {{{cap}}} has no `index {cap} of N` saying how many values "
                                   f"it takes (used by {_rule_list(rules)})", rules[0].pattern.span))
    if problems:
        raise SpecError(problems, spec.text, spec.filename)
    body.sort(key=lambda x: (x[0], x[1]))
    return dict(head + [(n, s) for _, _, n, s in body] + tail)
