"""One error hierarchy for the whole library.

Every error a user can cause is a :class:`UclError`. Spec problems carry a list of
:class:`Diagnostic` s, each printed as ``file:line:col: error[UCLnnn]: message`` with the
source line, a caret under the culprit and, where we can guess, a hint. Diagnostics that repeat
one problem (the same code and message shape, e.g. once per layer) are grouped when printed:
see :func:`group_diagnostics`. :data:`ERROR_CODES` says which class raises each code; it is the
one truth that docs/errors.md and the tests check against.
"""
from __future__ import annotations

import difflib
import functools
import os
import re
import sys
from dataclasses import dataclass
from typing import Callable, Hashable, Iterable, Sequence


@dataclass(frozen=True)
class Span:
    """A region of a source text: 1-based line and column, end exclusive."""

    line: int
    col: int
    end_line: int
    end_col: int


@dataclass(frozen=True)
class Diagnostic:
    code: str
    message: str
    span: Span | None = None
    hint: str | None = None
    severity: str = "error"  # or "warning": reported, never raised (such a diagnostic has no code)

    def render(self, source: str | None = None, filename: str = "<spec>") -> str:
        where = f"{filename}:{self.span.line}:{self.span.col}" if self.span else filename
        label = f"{self.severity}[{self.code}]" if self.code else self.severity
        out = [f"{where}: {label}: {self.message}"]
        if self.span and source is not None:
            lines = _source_lines(source)
            if 0 < self.span.line <= len(lines):
                text = lines[self.span.line - 1].expandtabs(1)
                width = (self.span.end_col - self.span.col) if self.span.end_line == self.span.line else len(text) - self.span.col + 1
                out.append(f"    {text}")
                out.append("    " + " " * (self.span.col - 1) + "^" * max(1, width))
        if self.hint:
            out.append(f"    hint: {self.hint}")
        return "\n".join(out)


@functools.lru_cache(maxsize=4)
def _source_lines(source: str) -> list[str]:
    # split once per source, not once per diagnostic: a spec with many errors renders in linear time
    return source.splitlines()


class UclError(Exception):
    """Base of every error raised by ucl. ``code`` is stable and documented in docs/errors.md."""

    code = "UCL000"

    def __init__(self, message: str, *, code: str | None = None):
        super().__init__(message)
        if code is not None:
            self.code = code


def detach(error: UclError) -> UclError:
    """``error`` without the internal exception it was translated from: ``raise detach(e) from None``
    at an API boundary shows the UclError alone, not "During handling of the above exception"."""
    error.__cause__ = error.__context__ = None
    error.__suppress_context__ = True
    return error


class SpecError(UclError):
    """A .ucl spec is malformed; carries every diagnostic found, not just the first."""

    code = "UCL100"

    def __init__(self, diagnostics: Sequence[Diagnostic], source: str | None = None, filename: str = "<spec>"):
        self.diagnostics = list(diagnostics)
        self.source = source
        self.filename = filename
        self.code = self.diagnostics[0].code if self.diagnostics else self.code
        super().__init__(self.render())

    def render(self, limit: int = 3) -> str:
        """Every diagnostic with its source line; more than ``limit`` of one kind are grouped."""
        parts, n = [], 0
        for g in group_diagnostics(self.diagnostics, limit):
            parts += [d.render(self.source, self.filename) for d in g.shown]
            if g.more:
                parts.append("    " + g.more_line())
            n += len(g)
        parts.append(f"{n} error{'s' if n != 1 else ''} in {self.filename}")
        return "\n".join(parts)

    def __str__(self) -> str:  # keep str() readable after pickling-free copies
        return self.render()


class BindError(UclError):
    """A spec does not fit the model it is applied to (names, shapes, divisibility)."""

    code = "UCL200"

    def __init__(self, problems: Sequence[Diagnostic], source: str | None = None, filename: str = "<spec>"):
        self.diagnostics = list(problems)
        self.source = source
        self.filename = filename
        self.code = self.diagnostics[0].code if self.diagnostics else self.code
        super().__init__(SpecError.render(self))  # same layout as spec errors

    render = SpecError.render

    def __str__(self) -> str:
        return self.render()


class MeshError(UclError):
    """A mesh string or Mesh does not fit the spec (unknown axis, bad size)."""

    code = "UCL300"


class PlanError(UclError):
    """A plan cannot be built or fails its proof (coverage, overlapping replicas)."""

    code = "UCL310"


class StoreError(UclError):
    """A checkpoint store is missing, corrupt, of a newer format, or cannot be written."""

    code = "UCL400"


class ForeignFormatError(StoreError):
    """Another framework's checkpoint that ucl cannot read or write as asked (docs/interop.md): its
    layout cannot be described, its files contradict each other, or an export target is refused."""

    code = "UCL502"


# ---- the registry of error codes ---------------------------------------------------------------------
# code -> the classes that raise it, most usual first. docs/errors.md lists each code in the table
# of each of its classes; tests/test_error_codes.py checks the source, the docs and every error the
# test suite raises against this table. Expression errors (unknown name, inexact division...) are
# found while checking a spec (SpecError) and while evaluating it with a model's dims (BindError).
_SPEC_AND_BIND = (SpecError, BindError)
ERROR_CODES: dict[str, tuple[type[UclError], ...]] = {
    # UclError itself: generic, and the command line
    "UCL000": (UclError, SpecError),  # generic; a spec file that cannot be read (SpecError)
    "UCL009": (UclError,), "UCL011": (UclError,),
    # the live training checkpointer (ucl.train)
    "UCL430": (UclError,), "UCL431": (UclError,), "UCL432": (StoreError,),
    "UCL433": (StoreError,), "UCL434": (StoreError,), "UCL435": (StoreError,), "UCL436": (StoreError,),
    # reading and checking a spec
    "UCL001": (SpecError,), "UCL002": (SpecError,), "UCL003": (SpecError,), "UCL004": (SpecError,),
    "UCL010": (SpecError,),
    "UCL100": (SpecError,),
    "UCL101": _SPEC_AND_BIND, "UCL102": (SpecError,), "UCL103": (SpecError,), "UCL104": _SPEC_AND_BIND,
    "UCL105": _SPEC_AND_BIND, "UCL106": (SpecError,), "UCL107": (SpecError,), "UCL108": _SPEC_AND_BIND,
    "UCL109": _SPEC_AND_BIND, "UCL110": (SpecError,), "UCL111": (SpecError,), "UCL112": (SpecError,),
    "UCL113": _SPEC_AND_BIND, "UCL114": _SPEC_AND_BIND, "UCL115": (SpecError,), "UCL116": _SPEC_AND_BIND,
    "UCL212": (SpecError,),
    # binding a spec to a model and a mesh
    "UCL200": (BindError,), "UCL201": (BindError,), "UCL202": (BindError,), "UCL203": (BindError,),
    "UCL204": (BindError,), "UCL205": (BindError,), "UCL206": (BindError,), "UCL207": (BindError,),
    "UCL208": (BindError,), "UCL209": (BindError,), "UCL210": (BindError,), "UCL211": (BindError,),
    "UCL213": (BindError,),
    # meshes and plans
    "UCL300": (MeshError,), "UCL301": (MeshError,), "UCL302": (MeshError,), "UCL303": (MeshError,),
    "UCL304": (MeshError,), "UCL305": (MeshError,),
    "UCL310": (PlanError,), "UCL311": (PlanError,), "UCL312": (PlanError,), "UCL313": (PlanError,),
    "UCL314": (PlanError,), "UCL315": (PlanError,), "UCL316": (PlanError,), "UCL317": (PlanError,),
    # checkpoints
    **{f"UCL{n}": (StoreError,) for n in (400, 401, 402, 403, 404, 405, 406, 407, 408, 409, 410, 411, 412,
                                          413, 414, 416, 417, 418, 420, 421, 422, 423, 424, 425)},
    # other frameworks' checkpoints (ucl.formats)
    "UCL500": (StoreError,), "UCL501": (StoreError,), "UCL502": (ForeignFormatError,), "UCL503": (ForeignFormatError,),
}


def code_agrees(cls: type, code: str) -> bool:
    """Whether an error of class ``cls`` may carry ``code`` (it is, or derives from, a class the
    registry names for it)."""
    return any(issubclass(cls, c) for c in ERROR_CODES.get(code, ()))


# ---- grouping repeated diagnostics ---------------------------------------------------------------------
_QUOTED = re.compile(r"'[^']*'|\"[^\"]*\"|`[^`]*`")
_SHAPE = re.compile(r"\[[\d,\s]*\]|\(\d+(?:,\s*\d+)*,?\)")  # [64, 128], (4,), (4, 4)
_NUMBER = re.compile(r"\d+")
_TOKEN = re.compile(r"'[^']*'|\"[^\"]*\"|`[^`]*`|\[[^\]]*\]|[^\s,;()]+")


def message_shape(message: str) -> str:
    """A message with quoted names, shapes and numbers masked: the per-layer copies of one problem
    (``'layers.0.w' has shape [4]`` and ``'layers.1.w' has shape [5]``) have the same shape."""
    return _NUMBER.sub("#", _SHAPE.sub("[…]", _QUOTED.sub("'…'", message)))


@dataclass(frozen=True)
class DiagnosticGroup:
    """Diagnostics of one kind: ``shown`` in full, ``more`` summed up by :meth:`more_line`."""

    shown: tuple[Diagnostic, ...]
    more: tuple[Diagnostic, ...] = ()

    def __len__(self) -> int:
        return len(self.shown) + len(self.more)

    def more_line(self, examples: int = 2) -> str:
        """``... and N more like this (a, b, ...)``, naming what differs in the first few."""
        first = self.shown[0]
        shown = {_example(d, first)[0] for d in self.shown[1:]}
        names: dict[str, str] = {}  # what differs -> its first example (with its line)
        for d in self.more:
            word, text = _example(d, first)
            names.setdefault(word, text)
        # names not already shown in full first
        texts = [t for w, t in names.items() if w not in shown] + [t for w, t in names.items() if w in shown]
        listed = ", ".join(texts[:examples]) + (", ..." if len(texts) > examples else "")
        return f"... and {len(self.more)} more like this ({listed})"


def group_diagnostics(diagnostics: Iterable[Diagnostic], limit: int = 3,
                      key: Callable[[Diagnostic], Hashable] | None = None) -> list[DiagnosticGroup]:
    """Group diagnostics of the same code and message shape (:func:`message_shape`), in order of
    first appearance; each group shows its first ``limit`` in full and sums up the rest (a group of
    ``limit + 1`` is shown whole: one summary line would save nothing). ``key`` overrides what
    makes two diagnostics alike (e.g. also their rule). The very same diagnostic reported twice
    counts once."""
    groups: dict[Hashable, list[Diagnostic]] = {}
    for d in dict.fromkeys(diagnostics):
        groups.setdefault((d.code, message_shape(d.message)) if key is None else key(d), []).append(d)
    limit = max(1, limit)
    return [DiagnosticGroup(tuple(m)) if len(m) <= limit + 1 else DiagnosticGroup(tuple(m[:limit]), tuple(m[limit:]))
            for m in groups.values()]


def _example(d: Diagnostic, first: Diagnostic) -> tuple[str, str]:
    """What tells ``d`` apart from ``first`` (the first word that differs, else its line), and that
    as an example to print, with the line where it differs from the first one's."""
    word = next((a for a, b in zip(_TOKEN.findall(d.message), _TOKEN.findall(first.message)) if a != b), None)
    line = f"line {d.span.line}" if d.span and (first.span is None or d.span.line != first.span.line) else None
    if word is None:
        return line or d.message[:60], line or d.message[:60]
    return word, f"{word} ({line})" if line else word


def closest(word: str, choices: Iterable[str]) -> str | None:
    """The choice nearest to ``word``, or None when none is near."""
    # short names (tp, dp) differ by one letter at ratio 0.5, so accept that for them
    match = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.5 if len(word) <= 3 else 0.6)
    return match[0] if match else None


def did_you_mean(word: str, choices: Iterable[str]) -> str | None:
    match = closest(word, choices)
    return f"did you mean {match}?" if match else None


_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def caller_stacklevel() -> int:
    """The ``stacklevel`` for ``warnings.warn`` in the function calling this one that names the
    first frame outside ucl: a warning points at the user's line (``ck.load()``), however deep in
    ucl it is raised and however the call chain changes."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    return level
