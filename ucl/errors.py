"""One error hierarchy for the whole library.

Every error a user can cause is a :class:`UclError`. Spec problems carry a list of
:class:`Diagnostic` s, each printed as ``file:line:col: error[UCLnnn]: message`` with the
source line, a caret under the culprit and, where we can guess, a hint.
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Iterable, Sequence


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

    def render(self, source: str | None = None, filename: str = "<spec>") -> str:
        where = f"{filename}:{self.span.line}:{self.span.col}" if self.span else filename
        out = [f"{where}: error[{self.code}]: {self.message}"]
        if self.span and source is not None:
            lines = source.splitlines()
            if 0 < self.span.line <= len(lines):
                text = lines[self.span.line - 1].expandtabs(1)
                width = (self.span.end_col - self.span.col) if self.span.end_line == self.span.line else len(text) - self.span.col + 1
                out.append(f"    {text}")
                out.append("    " + " " * (self.span.col - 1) + "^" * max(1, width))
        if self.hint:
            out.append(f"    hint: {self.hint}")
        return "\n".join(out)


class UclError(Exception):
    """Base of every error raised by ucl. ``code`` is stable and documented in docs/errors.md."""

    code = "UCL000"

    def __init__(self, message: str, *, code: str | None = None):
        super().__init__(message)
        if code is not None:
            self.code = code


class SpecError(UclError):
    """A .ucl spec is malformed; carries every diagnostic found, not just the first."""

    code = "UCL100"

    def __init__(self, diagnostics: Sequence[Diagnostic], source: str | None = None, filename: str = "<spec>"):
        self.diagnostics = list(diagnostics)
        self.source = source
        self.filename = filename
        self.code = self.diagnostics[0].code if self.diagnostics else self.code
        super().__init__(self.render())

    def render(self) -> str:
        parts = [d.render(self.source, self.filename) for d in self.diagnostics]
        n = len(self.diagnostics)
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


def did_you_mean(word: str, choices: Iterable[str]) -> str | None:
    # short names (tp, dp) differ by one letter at ratio 0.5, so accept that for them
    match = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.5 if len(word) <= 3 else 0.6)
    return f"did you mean {match[0]}?" if match else None
