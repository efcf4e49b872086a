"""``ucl check SPEC --against MODEL``: does a spec match a model's tensors?"""
from __future__ import annotations

from typing import Iterable, Mapping

from ...errors import Diagnostic, UclError, group_diagnostics, message_shape
from ...lang.spec import load_spec
from .names import fuse_saved_experts


def check_against(spec, dims: Mapping[str, int], tensors: Mapping[str, Iterable[int]],
                  frozen: Iterable[str] = ()) -> list[str]:
    """Problems binding ``spec`` (a Spec or anything ``ucl.load_spec`` takes) with ``dims`` to
    ``tensors`` (``{name: shape}``, e.g. from :func:`read_tensor_names`). An empty list means every
    tensor is matched by exactly one rule with the right shape.

    Each problem is one string: the message and its code, then (indented lines) the rule it
    concerns (``file:line`` and pattern) and a hint. The same problem repeated under one rule (once
    per layer) is one string ending in ``... and N more like this (examples)``.

    Saved per-expert MoE names are also tried mapped onto the fused in-memory tensors the specs
    describe (see :func:`fuse_saved_experts`), so both a ``state_dict()`` and a ``save_pretrained``
    folder can be checked, and a spec written for the per-expert names as saved passes too."""
    fused, problems = fuse_saved_experts(tensors)
    diags: list[Diagnostic] | None = None
    try:
        spec = load_spec(spec)
    except UclError as e:
        diags = list(getattr(e, "diagnostics", None) or [Diagnostic(e.code, str(e))])
    else:
        for names in [fused] + ([dict(tensors)] if set(fused) != set(tensors) else []):
            found = _bind_problems(spec, dims, names, frozen)
            if not found:
                return problems if names is fused else []
            # report against the names the spec was written for: the fewest unmatched, then fewest problems
            diags = found if diags is None or _badness(found) < _badness(diags) else diags
    if diags:
        rule_of = _rules_by_line(spec) if hasattr(spec, "checked") else {}
        filename = getattr(spec, "filename", "<spec>")

        def key(d: Diagnostic):
            return d.code, message_shape(d.message), d.span.line if d.span else None

        for g in group_diagnostics(diags, limit=1, key=key):
            for d in g.shown:
                lines = [f"{d.message} [{d.code}]"]
                rule = rule_of.get(d.span.line) if d.span else None
                if rule is not None:
                    lines.append(f"    rule `{rule}` at {filename}:{d.span.line}:{d.span.col}")
                elif d.span:
                    lines.append(f"    at {filename}:{d.span.line}:{d.span.col}")
                if d.hint:
                    lines.append(f"    hint: {d.hint}")
                problems.append("\n".join(lines))
            if g.more:
                problems[-1] += "\n    " + g.more_line()
    return problems


def unmatched_patterns(spec, dims: Mapping[str, int], tensors: Mapping[str, Iterable[int]],
                       frozen: Iterable[str] = ()) -> list[str]:
    """Warnings, rendered with the spec line and a caret, for the rules and patterns of ``spec``
    that match none of ``tensors`` (``Model.unmatched``), against the names the spec binds to (the
    fused MoE names or the names as saved); none when it binds to neither (``check_against`` says why)."""
    spec = load_spec(spec)
    fused, _ = fuse_saved_experts(tensors)
    for names in [fused] + ([dict(tensors)] if set(fused) != set(tensors) else []):
        try:
            model = spec.bind(dict(dims), names, frozen=[f for f in frozen if f in names])
        except UclError:
            continue
        return [d.render(spec.text, spec.filename) for d in model.unmatched()]
    return []


def _badness(diags: list[Diagnostic]) -> tuple[int, int]:
    return sum(d.code == "UCL201" for d in diags), len(diags)


def _bind_problems(spec, dims: Mapping[str, int], tensors: Mapping, frozen: Iterable[str]) -> list[Diagnostic]:
    """The diagnostics of binding ``spec`` to ``tensors`` (none: it binds)."""
    try:
        spec.bind(dict(dims), tensors, frozen=[f for f in frozen if f in tensors])
    except UclError as e:
        return list(getattr(e, "diagnostics", None) or [Diagnostic(e.code, str(e))])
    return []


def _rules_by_line(spec) -> dict[int, str]:
    """Source line -> pattern of the (layout or placement) rule written on it."""
    out: dict[int, str] = {}
    for r in list(spec.checked.rules) + list(spec.checked.placements):
        for line in range(r.span.line, r.span.end_line + 1):
            out.setdefault(line, r.pattern.text)
    return out
