"""A Checkpointer left open when the program ends: the save in flight is finished, not dropped."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")

SCRIPT = textwrap.dedent("""
    import sys, torch, ucl
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(12)])  # 50 MB: a flush takes a while
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 1024)).sum().backward()
    opt.step()
    codec = sys.argv[2] if sys.argv[2] != "none" else None  # compressed: coded on threads kept between saves
    ck = ucl.Checkpointer(sys.argv[1], model, opt, compress=codec, compress_threads=2)
    ck.save(7)
    print("saved", flush=True)  # and exit at once: no wait(), no close()
""")


@pytest.mark.slow
@pytest.mark.parametrize("codec", ["none", "zstd"])
def test_a_checkpointer_left_open_at_exit_finishes_its_save(tmp_path, codec):
    root = tmp_path / "ck"
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(root), codec], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert "saved" in done.stdout
    from ucl.store import Checkpoint, CheckpointRoot
    assert CheckpointRoot(root).steps() == [7]
    with Checkpoint.open(CheckpointRoot(root).newest()) as ck:
        assert ck.verify() == []
