"""Drafted TP layouts against a TP runtime (issue #29, item 4; tests/hf_tp_runtime.py says how):
placements derived from ucl's lowering of the draft, torch's sharding of the full tensor as the
oracle for each rank's shard, and (slow, 2 gloo processes) DTensor ``parallelize_module`` with
those placements computing the unsharded model's logits."""
import os
import sys

import numpy as np
import pytest

pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
sys.path.insert(0, os.path.dirname(__file__))
import hf_tp_runtime as R  # noqa: E402


@pytest.fixture(autouse=True)
def _quiet():
    import transformers
    transformers.logging.set_verbosity_error()


def _torch_shards(model_type):
    """ucl's shards of every parameter next to torch.chunk of the (rank-ordered) full tensor: what
    DTensor's Shard(d) gives each rank, without processes."""
    cfg, placements, local = R.ucl_layout(model_type)
    model = R.build(cfg)
    for name, p in model.named_parameters():
        pl = placements[name]
        want = [p.detach()] * R.TP if pl.dim is None else torch.chunk(R._global(p, pl), R.TP, dim=pl.dim)
        for r in range(R.TP):
            assert torch.equal(want[r], torch.from_numpy(local[r][name])), (model_type, name, r)
    return placements


def test_placements_of_a_fused_qkv_and_an_uneven_vocab():
    """Known answers: GPT-2's Conv1D c_attn [hidden, 3 * hidden] is split part by part, so rank 0
    holds columns q[:h/2], k[:h/2], v[:h/2] (a reordered Shard(1)); the 99-row embedding is a plain
    torch.chunk (50 and 49 rows); norms are replicated."""
    placements = _torch_shards("gpt2")
    h = R.Z.tiny_config("gpt2").hidden_size
    halves = [range(part * h + r * h // 2, part * h + (r + 1) * h // 2) for r in range(2) for part in range(3)]
    assert placements["transformer.h.0.attn.c_attn.weight"] == R.Placement(1, tuple(i for x in halves for i in x))
    assert placements["transformer.wte.weight"] == R.Placement(0)
    assert placements["transformer.h.0.attn.c_proj.weight"] == R.Placement(0)  # Conv1D [in, out]: row-parallel
    assert placements["transformer.ln_f.weight"] == R.Placement(None)


@pytest.mark.parametrize("model_type", ["llama", "bloom", "gpt_bigcode", "qwen2_moe"])
def test_each_rank_holds_torch_shard_of_the_full_tensor(model_type):
    placements = _torch_shards(model_type)
    assert any(p.dim is not None for p in placements.values())


def test_placement_refuses_what_no_shard_describes():
    """A split that leaves a rank empty is not a runtime layout (qwen2_moe's [1, hidden]
    shared_expert_gate split over tp: the draft replicates it now)."""
    full = np.arange(8).reshape(1, 8)
    with pytest.raises(AssertionError, match="torch.chunk"):
        R.placement(full, [full, full[:0]])
    assert R.placement(full, [full, full]) == R.Placement(None)


@pytest.mark.slow
def test_parallelized_models_compute_the_unsharded_logits(tmp_path):
    """Two gloo ranks: every family's shards equal ucl's, its logits the unsharded model's; a fused
    [Q; K; V] taken as a plain chunk (the mistake the draft avoids) gives other logits."""
    _, placements, local = R.ucl_layout("gpt2")
    name = "transformer.h.0.attn.c_attn.weight"
    wrong = dict(placements, **{name: R.Placement(1), name.replace("weight", "bias"): R.Placement(0)})
    out = R.run(R.FAMILIES, str(tmp_path), extra=[("gpt2 plain-chunk qkv", "gpt2", wrong, local)])
    bad = {t: p for t, p in out.items() if p and t != "gpt2 plain-chunk qkv"}
    assert not bad, bad
    tampered = out["gpt2 plain-chunk qkv"]
    assert any(p.startswith("logits differ") for p in tampered), tampered
    assert any("differs from ucl's" in p for p in tampered), tampered
