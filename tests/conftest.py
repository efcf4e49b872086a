"""Session-wide checks shared by every test module.

Error codes: every ``UclError`` constructed in this process during the session is recorded as
(class, code) pairs -- its own code and the code of each of its diagnostics. When the session ends,
each pair must agree with the registry ``ucl.errors.ERROR_CODES`` (the class is, or derives from, a
class registered for the code); otherwise the run fails, listing the offenders and where they were
raised. Errors raised in subprocesses (CLI runs, reshard workers) are not seen here; the static
checks of tests/test_error_codes.py cover their source.
"""
from __future__ import annotations

import functools
import traceback

import pytest

from ucl.errors import ERROR_CODES, UclError, code_agrees

# (class name, code) -> one place that raised it, for the report
_SEEN: dict[tuple[type, str], str] = {}


def _where() -> str:
    """file:line of the innermost frame that constructed the error, past ucl/errors.py and this file."""
    for frame in reversed(traceback.extract_stack()):
        name = frame.filename.replace("\\", "/")
        if not name.endswith(("/ucl/errors.py", "/conftest.py")):
            return f"{frame.filename}:{frame.lineno}"
    return "?"


def _record(error: UclError) -> None:
    codes = {error.code} | {d.code for d in getattr(error, "diagnostics", None) or ()}
    for code in codes:
        key = (type(error), code)
        if key not in _SEEN:
            _SEEN[key] = _where()


@pytest.fixture(scope="session", autouse=True)
def ucl_cache_dir(tmp_path_factory):
    """ucl's on-disk cache (``ucl.cache``: parsed specs, derived HF specs) in a folder of this session,
    never the user's ``~/.cache/ucl``; subprocesses (CLI runs) inherit it."""
    import os
    before = os.environ.get("UCL_CACHE_DIR")
    os.environ["UCL_CACHE_DIR"] = str(tmp_path_factory.mktemp("ucl-cache"))
    yield os.environ["UCL_CACHE_DIR"]
    if before is None:
        os.environ.pop("UCL_CACHE_DIR", None)
    else:
        os.environ["UCL_CACHE_DIR"] = before


@pytest.fixture(scope="session", autouse=True)
def ucl_errors_seen():
    """Record every UclError constructed during the session: {(class, code): where}."""
    original = UclError.__init__

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        _record(self)

    UclError.__init__ = __init__
    try:
        yield _SEEN
    finally:
        UclError.__init__ = original


def error_code_offenders(seen: dict[tuple[type, str], str]) -> list[str]:
    """Recorded (class, code) pairs the registry does not allow."""
    out = []
    for (cls, code), where in sorted(seen.items(), key=lambda kv: (kv[0][1], kv[0][0].__name__)):
        if code not in ERROR_CODES:
            out.append(f"{cls.__name__} with unregistered code {code} (raised at {where})")
        elif not code_agrees(cls, code):
            allowed = ", ".join(c.__name__ for c in ERROR_CODES[code])
            out.append(f"{cls.__name__} with code {code}, which the registry gives to {allowed} (raised at {where})")
    return out


def pytest_sessionfinish(session, exitstatus):
    offenders = error_code_offenders(_SEEN)
    if not offenders:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    lines = ["", "ERROR CODES: errors raised during the tests disagree with ucl.errors.ERROR_CODES:"]
    lines += [f"  {o}" for o in offenders]
    lines.append("  fix the raise (class or code) or the registry, and docs/errors.md with it")
    for line in lines:
        if reporter is not None:
            reporter.write_line(line, red=True, bold=True)
        else:
            print(line)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_collection_modifyitems(config, items):
    """``@pytest.mark.slow`` tests run only with UCL_SLOW_TESTS=1 (.ci/run's second pass, after it has
    installed the frameworks they check against); the default run stays fast."""
    import os
    if os.environ.get("UCL_SLOW_TESTS"):
        return
    skip = pytest.mark.skip(reason="slow: set UCL_SLOW_TESTS=1")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
