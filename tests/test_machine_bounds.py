"""Requests the machine cannot hold are one error, before anything per rank or per worker is made
(issue #34 item 2): a plan's target ranks, --workers."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

import ucl
from ucl.demo import LLAMA_MEGATRON, SMALL, llama_model, universal_state
from ucl.errors import PlanError, UclError
from ucl.layout.mesh import Mesh
from ucl.ops import machine

DIMS = ",".join(f"{k}={v}" for k, v in SMALL.items())
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cli_limited(tmp_path, *argv: str, limit_gb: float = 1.5) -> subprocess.CompletedProcess:
    """``ucl ARGV`` in a child whose address space is capped (a MemoryError there, not here)."""
    code = textwrap.dedent(f"""
        import resource, sys
        limit = int({limit_gb} * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        import ucl.cli
        sys.exit(ucl.cli.main({list(argv)!r}))
    """)
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env,
                          cwd=tmp_path)


def test_a_plan_beyond_the_memory_is_one_line_not_a_memory_error(tmp_path):
    spec = tmp_path / "llama.ucl"
    spec.write_text(LLAMA_MEGATRON)
    r = _cli_limited(tmp_path, "plan", str(spec), "--dims", DIMS, "--from", "tp=1", "--to", "dp=4194304")
    assert r.returncode == 1, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and "MemoryError" not in r.stderr
    assert "needs at least" in r.stderr and "GiB" in r.stderr and "dp=4194304" in r.stderr


def test_plan_fits_refuses_in_python_too(monkeypatch):
    model = llama_model()
    monkeypatch.setattr(machine, "memory_bytes", lambda: 1 << 20)
    with pytest.raises(PlanError) as e:
        machine.check_plan_fits(model, Mesh.parse("tp=1"), Mesh.parse("dp=65536"))
    assert e.value.code == "UCL317"
    # a small plan still compiles under the same memory
    machine.check_plan_fits(model, Mesh.parse("tp=1"), Mesh.parse("tp=1"))


def test_reshard_refuses_a_plan_beyond_the_memory(monkeypatch, tmp_path):
    model = llama_model()
    src = tmp_path / "src"
    ucl.save(src, {0: universal_state(model)}, model=model, mesh=ucl.UNIVERSAL, durable=False)
    monkeypatch.setattr(machine, "memory_bytes", lambda: 1 << 16)
    with pytest.raises(PlanError) as e:
        ucl.reshard(src, tmp_path / "dst", "dp=8")
    assert e.value.code == "UCL317"


def test_a_billion_workers_is_one_line(tmp_path):
    r = _cli_limited(tmp_path, "reshard", "nowhere", "dst", "--to", "dp=2", "--workers", "1000000000")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "workers=1,000,000,000 is more than this machine can run" in r.stderr
    with pytest.raises(UclError) as e:
        ucl.reshard(tmp_path / "nowhere", tmp_path / "dst", "dp=2", workers=10**9)
    assert e.value.code == "UCL009"
