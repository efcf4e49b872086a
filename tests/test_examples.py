"""The scripts in examples/ run as a user runs them (their own processes), and do what their
docstrings say: a killed run resumes with the losses an uninterrupted one prints, bit for bit (the
oracle: that uninterrupted run); the offload script likewise; the DTensor one resumes on another
world size and placement with the losses of the first layout trained on (to float tolerance)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def run(*args: str, timeout: int = 300) -> list[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_"))}
    p = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout.splitlines()


def losses(lines: list[str]) -> dict[int, str]:
    return {int(m[1]): m[2] for line in lines if (m := re.fullmatch(r"step (\d+) loss (\S+)", line))}


def resumed_at(lines: list[str]) -> int | None:
    return next((int(m[1]) for line in lines if (m := re.match(r"resumed at step (\d+)", line))), None)


@pytest.mark.slow  # four processes importing torch; tests/test_train_crash.py covers kills in the default pass
def test_train_resume_after_a_kill_prints_the_uninterrupted_losses(tmp_path):
    script, args = str(EXAMPLES / "train_resume.py"), ["--steps", "12", "--save-every", "4"]
    whole = losses(run(script, str(tmp_path / "a"), *args))
    assert sorted(whole) == list(range(1, 13))
    killed = run(script, str(tmp_path / "b"), *args, "--kill-at", "10")
    assert losses(killed) == {s: whole[s] for s in range(1, 11)}  # it died after step 10
    again = run(script, str(tmp_path / "b"), *args)
    at = resumed_at(again)
    assert at in (4, 8)  # step 8's checkpoint may still have been in flight at the kill
    assert losses(again) == {s: whole[s] for s in range(at + 1, 13)}


@pytest.mark.slow  # three more processes importing torch: in .ci/run's slow pass
def test_offload_resumes_with_the_uninterrupted_losses(tmp_path):
    script = str(EXAMPLES / "offload.py")
    whole = losses(run(script, str(tmp_path / "a"), "--steps", "12"))
    first = run(script, str(tmp_path / "b"), "--steps", "10")
    again = run(script, str(tmp_path / "b"), "--steps", "12")
    assert resumed_at(again) == 10
    assert losses(first) | losses(again) == whole


@pytest.mark.slow
def test_fsdp2_tp_resumes_on_another_world_size_and_placement(tmp_path):
    script = str(EXAMPLES / "fsdp2_tp.py")
    torchrun = ["-m", "torch.distributed.run", "--standalone"]
    first = run(*torchrun, "--nproc_per_node", "4", script, str(tmp_path), "--tp", "2", "--steps", "6", timeout=600)
    assert sorted(losses(first)) == list(range(1, 7))
    again = run(*torchrun, "--nproc_per_node", "2", script, str(tmp_path), "--tp", "1", "--steps", "8", timeout=600)
    assert resumed_at(again) == 6 and sorted(losses(again)) == [7, 8]
    assert "on dp=2 x tp=1" in "\n".join(again)
    # the oracle: the first layout trained on without a break (other reduction orders: close, not equal)
    whole = losses(run(*torchrun, "--nproc_per_node", "4", script, str(tmp_path / "whole"), "--tp", "2",
                       "--steps", "8", timeout=600))
    for s in (7, 8):
        assert float(losses(again)[s]) == pytest.approx(float(whole[s]), rel=1e-4), s
