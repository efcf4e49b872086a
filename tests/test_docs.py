"""Every Python block in README.md and docs/*.md runs as written, and alone: each block in a fresh
namespace and a fresh temporary working directory, as a reader who copies just that block runs it."""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md"] + sorted((REPO / "docs").glob("*.md"))
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def _blocks(path: Path) -> list[tuple[int, str]]:
    text = path.read_text()
    return [(text.count("\n", 0, m.start()) + 2, m.group(1)) for m in BLOCK.finditer(text)]


BLOCKS = [(doc, line, code) for doc in DOCS for line, code in _blocks(doc)]


@pytest.mark.parametrize("doc, line, code", BLOCKS, ids=[f"{d.name}:{n}" for d, n, _ in BLOCKS])
def test_python_block_runs_alone(doc, line, code, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    env = dict(os.environ)  # a block may set torch.distributed's variables: not for the next one
    try:
        exec(compile(code, f"{doc.relative_to(REPO)}:{line}", "exec"), {"__name__": f"docs.{doc.stem}"})
    finally:
        os.environ.clear()
        os.environ.update(env)


def test_no_doc_block_or_test_uses_a_fixed_port():
    """Two runs on one machine (two CI jobs, two users) would collide on it: pick a free one."""
    fixed = re.compile(r"(MASTER_PORT|master_port|init_method=.tcp://[^:]+)\W{0,6}\d{4,5}")
    texts = [(f"{d.name}:{n}", code) for d, n, code in BLOCKS]
    texts += [(p.name, p.read_text()) for p in sorted((REPO / "tests").glob("*.py"))]
    assert [name for name, text in texts if fixed.search(text)] == []


def test_readme_has_the_two_setup_commands():
    text = (REPO / "README.md").read_text()
    assert ".venv/bin/ucl demo" in text
    assert ".venv/bin/python -m pytest tests" in text.replace(" -q", "")


def test_readme_says_how_to_get_the_cpu_torch_and_ci_runs_its_test_command():
    """A version pin does not pick torch's CPU build (plain PyPI serves the CUDA one): the README and
    pyproject give PyPI-independent commands, and CI runs the README's test command verbatim."""
    text = (REPO / "README.md").read_text()
    cpu = "pip install -q torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
    assert cpu in text and "pinned so a CPU machine gets the CPU wheel" not in text
    assert "--index-url https://download.pytorch.org/whl/cpu" in (REPO / "pyproject.toml").read_text()
    command = next(line for block in re.findall(r"```sh\n(.*?)```", text, re.S) for line in block.splitlines()
                   if "-m pytest" in line)
    assert command in (REPO / ".ci" / "run").read_text().splitlines()
