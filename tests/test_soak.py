"""Long-run resources: a Checkpointer gives back what it took when closed, and the soak
(bench/soak.py: thousands of checkpoints across processes, rollbacks, a failing tier, ring pools)
stays flat after warm-up, never hangs, and every committed checkpoint verifies and loads."""
from __future__ import annotations

import datetime
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import ucl  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def _settled(baseline) -> tuple[int, int]:
    """Threads and open descriptors of this process, once those that are ending have ended (up to
    a few seconds: threads of a pool shut down without waiting exit a little later)."""
    deadline = time.monotonic() + 5
    while True:
        now = len(os.listdir("/proc/self/task")), len(os.listdir("/proc/self/fd"))
        if baseline is None or (now[0] <= baseline[0] and now[1] <= baseline[1]) or time.monotonic() > deadline:
            return now
        time.sleep(0.05)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_closing_a_checkpointer_gives_back_its_process_group(tmp_path):
    """Each Checkpointer makes its own gloo group; before close() destroyed it, every reopened
    checkpointer left its group's threads and sockets behind."""
    import torch.distributed as dist
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    try:
        model = torch.nn.Linear(8, 8)
        opt = torch.optim.AdamW(model.parameters())
        counts = []
        for i in range(4):
            model(torch.randn(2, 8)).sum().backward()
            opt.step()
            with ucl.Checkpointer(tmp_path, model, opt) as ck:
                ck.save(i)
            counts.append(_settled(counts[0] if counts else None))
        assert counts[-1][0] <= counts[0][0] and counts[-1][1] <= counts[0][1], counts  # threads, fds
    finally:
        dist.destroy_process_group()


def soak(tmp_path, *extra: str, limit: float = 900) -> dict:
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "soak.py"), "--json", "--workdir", str(tmp_path),
                        "--timeout", "120", *extra], capture_output=True, text=True, timeout=limit,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    lines = [x for x in p.stdout.splitlines() if x.startswith("{")]
    assert lines, p.stderr[-3000:]
    return json.loads(lines[-1])


@pytest.mark.slow
def test_soak_stays_flat_and_every_checkpoint_verifies(tmp_path):
    report = soak(tmp_path, "--checkpoints", "1000", "--procs", "2", "--rollback-every", "50",
                  "--tier-fails-every", "150", "--reopen-every", "250")
    assert not report["hung"]
    for r in report["ranks"]:
        assert r["errors"] == [] and r["grew"] == [], r
        assert r["stats"]["saves"] == 1000 and r["stats"]["rollbacks"] == 20
    zero = report["ranks"][0]["stats"]
    assert zero["tier_failures"] >= 6 and zero["tier_errors_raised"] >= 1
    assert zero["verified"] >= 900 and zero["loads_checked"] >= 10
    assert report["ok"]


def _soak_module():
    import importlib.util
    spec = importlib.util.spec_from_file_location("ucl_bench_soak", ROOT / "bench" / "soak.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_soak_verified_set_stays_bounded_as_checkpoints_are_pruned(tmp_path):
    """Rank 0's record of verified checkpoints keeps only those still on disk: it kept a key per
    checkpoint ever committed, so it grew with the run (keep=3 here, 200 checkpoints)."""
    from ucl.store import CheckpointRoot
    unverified = _soak_module().unverified
    cr, verified, fresh = CheckpointRoot(tmp_path), set(), 0
    for step in range(200):
        path = Path(cr.path_for(step))
        path.mkdir()
        (path / "manifest.json").write_text("{}")
        if step >= 3:  # keep=3: the oldest goes
            old = Path(cr.path_for(step - 3))
            (old / "manifest.json").unlink()
            old.rmdir()
        todo = unverified([tmp_path], verified)
        fresh += len(todo)
        verified.update(todo)
        assert len(verified) <= 3, len(verified)
    assert fresh == 200  # each checkpoint came up for verification once
