"""A Checkpointer root (``latest`` + ``step_*``) given to the Python API is resolved to one step,
once: a reshard's workers and an export's reads see the step its survey saw, even when the trainer
commits the next step meanwhile (before: the plan from step 1, the tensors from step 2)."""
from __future__ import annotations

import importlib

import numpy as np
import pytest

import ucl
reshard_module = importlib.import_module("ucl.ops.reshard")  # ucl.ops.reshard is also the function
from ucl.store.root import CheckpointRoot


@pytest.fixture()
def root(tmp_path):
    spec = ucl.Spec.from_text("dims n\nmesh tp\nw [n] : split 0 over tp\n")
    model = spec.bind({"n": 8}, {"w": (8,)}, frozen=("w",))
    path = tmp_path / "root"
    path.mkdir()
    for step, value in ((1, 1.0), (2, 2.0)):
        ucl.save(path / f"step_{step:08d}", {0: {"param/w": np.full(8, value, np.float32)}}, model=model,
                 mesh="tp=1", state={"step": step})
    CheckpointRoot(path).set_latest(1)
    return path


def test_a_reshard_reads_the_step_latest_named_when_it_started(root, tmp_path, monkeypatch):
    prepare = reshard_module._prepare

    def trainer_commits_meanwhile(*args, **kwargs):
        prepared = prepare(*args, **kwargs)
        CheckpointRoot(root).set_latest(2)  # the trainer commits step 2 while the reshard plans
        return prepared

    monkeypatch.setattr(reshard_module, "_prepare", trainer_commits_meanwhile)
    ucl.reshard(root, tmp_path / "out", "universal", workers=1)
    out = ucl.open(tmp_path / "out")
    assert out.manifest.state["step"] == 1
    assert np.array_equal(out.read(0, "param/w"), np.full(8, 1.0, np.float32))


def test_an_export_survey_names_the_step_it_read(root):
    from ucl.ops.export import survey
    src = survey(root)
    assert src.path.endswith("step_00000001")
    CheckpointRoot(root).set_latest(2)
    assert survey(root).path.endswith("step_00000002")
