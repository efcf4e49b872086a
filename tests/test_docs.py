"""Every Python block in README.md and docs/*.md runs as written. The blocks of one file run in
order in one namespace (like a notebook), in a fresh temporary working directory."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md"] + sorted((REPO / "docs").glob("*.md"))
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def _blocks(path: Path) -> list[tuple[int, str]]:
    text = path.read_text()
    return [(text.count("\n", 0, m.start()) + 2, m.group(1)) for m in BLOCK.finditer(text)]


@pytest.mark.parametrize("doc", [d for d in DOCS if _blocks(d)], ids=lambda p: p.name)
def test_python_blocks_run(doc, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": f"docs.{doc.stem}"}
    for line, code in _blocks(doc):
        exec(compile(code, f"{doc.relative_to(REPO)}:{line}", "exec"), namespace)


def test_readme_has_the_two_setup_commands():
    text = (REPO / "README.md").read_text()
    assert ".venv/bin/ucl demo" in text
    assert ".venv/bin/python -m pytest tests" in text.replace(" -q", "")
