"""The registry of error codes (``ucl.errors.ERROR_CODES``: code -> classes) is the one truth:
the source, docs/errors.md and the errors the test suite really raises must agree with it.

(a) every ``"UCLnnn"`` literal in ucl/ is registered and documented; (b) every
``XError(..., code="UCLnnn")`` call uses a class registered for its code (codes handed to a
``Diagnostic`` reach users inside several classes: the session check (d) covers those); (c) docs/errors.md lists
each code in the table of each of its classes and nowhere else; (d) tests/conftest.py records every
UclError raised during the session and fails the run at the end on a disagreement (tested here on
a small inner session).
"""
from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import ucl
import ucl.errors as errors
from ucl.errors import ERROR_CODES, BindError, SpecError, StoreError, UclError, code_agrees

REPO = Path(__file__).resolve().parent.parent
SOURCES = sorted((REPO / "ucl").rglob("*.py"))
DOCS = REPO / "docs" / "errors.md"
CODE = re.compile(r"""["'](UCL\d{3})["']""")
CLASSES = {c.__name__: c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, UclError)}


def _rel(path: Path) -> str:
    return str(path.relative_to(REPO))


def _doc_tables() -> dict[str, set[str]]:
    """Class name -> codes in the table under its ``## `Class` ...`` heading."""
    tables: dict[str, set[str]] = {}
    current = None
    for line in DOCS.read_text().splitlines():
        if line.startswith("## "):
            m = re.match(r"## `(\w+)`", line)
            current = m.group(1) if m else None
            if current is not None:
                tables.setdefault(current, set())
            continue
        m = re.match(r"\|\s*(UCL\d{3})\s*\|", line)
        if m:
            assert current is not None, f"docs/errors.md: {m.group(1)} is in a table outside a class section"
            tables[current].add(m.group(1))
    return tables


def _code_calls():
    """(file, line, class name, code) of every ``Name(..., code="UCLnnn")`` call in ucl/."""
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Call):
                continue
            name = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)
            for kw in node.keywords:
                if kw.arg == "code" and isinstance(kw.value, ast.Constant) and isinstance(kw.value.value, str):
                    yield path, node.lineno, name, kw.value.value


# ---- the registry itself ---------------------------------------------------------------------------
def test_registry_is_well_formed():
    assert ERROR_CODES, "empty registry"
    for code, classes in ERROR_CODES.items():
        assert re.fullmatch(r"UCL\d{3}", code), code
        assert classes and all(isinstance(c, type) and issubclass(c, UclError) for c in classes), code
        assert len(set(classes)) == len(classes), code
    # each class's default code is registered for it
    for cls in CLASSES.values():
        assert cls in ERROR_CODES.get(cls.code, ()), f"{cls.__name__}.code = {cls.code} is not registered for it"


def test_known_filings():
    assert ERROR_CODES["UCL211"] == (BindError,)  # Spec.dims_from_config
    assert ERROR_CODES["UCL212"] == (SpecError,)  # synthesize_params
    assert ERROR_CODES["UCL009"] == (UclError,)  # the command line
    assert code_agrees(BindError, "UCL204") and not code_agrees(StoreError, "UCL204")
    assert code_agrees(SpecError, "UCL000")  # a subclass of a registered class agrees
    assert not code_agrees(UclError, "UCL999")


# ---- (a) every code in the source is registered and documented -----------------------------------------
def test_every_code_in_the_source_is_registered_and_documented():
    documented = set(re.findall(r"UCL\d{3}", DOCS.read_text()))
    problems = []
    for path in SOURCES:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            for code in CODE.findall(line):
                if code not in ERROR_CODES:
                    problems.append(f"{_rel(path)}:{n}: {code} is not in ucl.errors.ERROR_CODES")
                if code not in documented:
                    problems.append(f"{_rel(path)}:{n}: {code} is not in docs/errors.md")
    assert not problems, "\n".join(problems)


# ---- (b) every raise uses the registered class ---------------------------------------------------------
# Misfilings known in code owned elsewhere, to be fixed there: (file, class, code). Strict: an entry
# that no longer occurs fails test_known_misfilings_are_still_present, so it is removed with the fix.
KNOWN_MISFILINGS: set = set()  # (file, class, code) raised against the registry, while being fixed


def _misfilings():
    """(file, line, class name, code, problem) of every code= call the registry does not allow."""
    for path, line, name, code in _code_calls():
        cls = CLASSES.get(name)
        if cls is None:
            yield _rel(path), line, name, code, "is not a UclError class"
        elif cls not in ERROR_CODES.get(code, ()):
            allowed = ", ".join(c.__name__ for c in ERROR_CODES.get(code, ())) or "nothing (unregistered)"
            yield _rel(path), line, name, code, f"but the registry gives {code} to {allowed}"


def test_every_code_keyword_uses_the_registered_class():
    assert sum(1 for _, _, name, _ in _code_calls() if name in CLASSES) > 50, \
        "the scan found too few raises: has the source layout changed?"
    problems = [f"{f}:{line}: {name}(..., code={code!r}) {why}" for f, line, name, code, why in _misfilings()
                if (f, name, code) not in KNOWN_MISFILINGS]
    assert not problems, "\n".join(problems)


def test_known_misfilings_are_still_present():
    found = {(f, name, code) for f, _, name, code, _ in _misfilings()}
    stale = KNOWN_MISFILINGS - found
    assert not stale, f"fixed, remove from KNOWN_MISFILINGS: {sorted(stale)}"


# ---- (c) the docs file each code under its classes -----------------------------------------------------
def test_docs_list_each_code_under_its_classes():
    tables = _doc_tables()
    assert set(tables) == set(CLASSES), f"docs/errors.md sections {sorted(tables)} != classes {sorted(CLASSES)}"
    problems = []
    for code, classes in sorted(ERROR_CODES.items()):
        want = {c.__name__ for c in classes}
        got = {name for name, codes in tables.items() if code in codes}
        if got != want:
            problems.append(f"{code}: documented under {sorted(got) or 'nothing'}, registered for {sorted(want)}")
    for name, codes in tables.items():
        for code in sorted(codes - set(ERROR_CODES)):
            problems.append(f"{code}: documented under {name} but not registered")
    assert not problems, "\n".join(problems)


# ---- (d) the errors really raised agree (recorded by tests/conftest.py) ---------------------------------
def test_the_session_records_raised_errors(ucl_errors_seen):
    with pytest.raises(SpecError):
        ucl.load_spec("dims a\nmesh tp\nw [b] : split 0 over tp\n")
    assert (SpecError, "UCL101") in ucl_errors_seen


INNER_TESTS = '''
from ucl.errors import Diagnostic, SpecError, StoreError

def test_a_misfiled_code():
    StoreError("made up", code="UCL204")  # registered for BindError only

def test_a_well_filed_code():
    SpecError([Diagnostic("UCL101", "unknown name 'x'")])
'''


@pytest.mark.parametrize("misfiled", [True, False], ids=["misfiled", "clean"])
def test_the_final_check_fails_the_run_on_a_misfiled_code(tmp_path, misfiled):
    """A session whose tests all pass still fails, in the final check, when an error disagrees with
    the registry; it names the class, the code and the registered class."""
    (tmp_path / "conftest.py").write_text((REPO / "tests" / "conftest.py").read_text())
    text = INNER_TESTS if misfiled else INNER_TESTS.replace('StoreError("made up", code="UCL204")', "pass")
    (tmp_path / "test_inner.py").write_text(text)
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", str(tmp_path)],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    out = p.stdout + p.stderr
    assert "2 passed" in out, out
    if misfiled:
        assert p.returncode == 1, out
        assert "ERROR CODES" in out and "StoreError with code UCL204" in out and "BindError" in out, out
        assert "test_inner.py:5" in out, out  # where it was raised
    else:
        assert p.returncode == 0 and "ERROR CODES" not in out, out
