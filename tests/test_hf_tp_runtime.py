"""Drafted TP layouts against a TP runtime (issue #29, item 4; tests/hf_tp_runtime.py says how):
placements derived from ucl's lowering of the draft, torch's sharding of the full tensor as the
oracle for each rank's shard, and (slow, 2 gloo processes) DTensor ``parallelize_module`` with
those placements computing the unsharded model's logits."""
import os
import sys

import numpy as np
import pytest

# tiny models: a tp=2 split of one KV head or one SSM group is `shared` on purpose (a MeshFitWarning)
pytestmark = pytest.mark.filterwarnings("ignore::ucl.layout.fit.MeshFitWarning")

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


def test_jetmoe_kv_packed_router_whole_attention_experts_by_heads():
    """Known answers from JetMoe's forward: ``kv_proj(x).chunk(2)`` is [K; V], so rank 0 holds K's and
    V's first halves (a packed split, not the first half of the rows); the routers (``router.layer``)
    are replicated, since every rank routes every token; the mixture-of-attention experts
    ``input_linear`` [E, kv_heads * head_dim, hidden] are split by heads (dim 1, no [gate; up]) and
    ``output_linear`` by their input (dim 2); the MLP experts' ``input_linear`` is [gate; up] (chunk(2))."""
    placements = _torch_shards("jetmoe")
    cfg = R.Z.tiny_config("jetmoe")
    kv = cfg.kv_channels * cfg.num_key_value_heads
    layer = "model.layers.0."
    halves = [i for r in range(2) for part in range(2) for i in range(part * kv + r * kv // 2, part * kv + (r + 1) * kv // 2)]
    assert placements[layer + "self_attention.kv_proj.weight"] == R.Placement(0, tuple(halves))
    assert placements[layer + "mlp.router.layer.weight"] == R.Placement(None)
    assert placements[layer + "self_attention.experts.router.layer.weight"] == R.Placement(None)
    assert placements[layer + "self_attention.experts.input_linear.weight"] == R.Placement(1)
    assert placements[layer + "self_attention.experts.output_linear.weight"] == R.Placement(2)
    ffn = cfg.intermediate_size
    packed = [i for r in range(2) for part in range(2) for i in range(part * ffn + r * ffn // 2, part * ffn + (r + 1) * ffn // 2)]
    assert placements[layer + "mlp.input_linear.weight"] == R.Placement(1, tuple(packed))
    assert placements[layer + "mlp.output_linear.weight"] == R.Placement(2)


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
    _, jet, jet_local = R.ucl_layout("jetmoe")
    kv = "model.layers.0.self_attention.kv_proj.weight"  # [K; V] cut as one block: rank 0 gets K only
    jet_wrong = dict(jet, **{kv: R.Placement(0)})
    out = R.run(R.FAMILIES, str(tmp_path), extra=[("gpt2 plain-chunk qkv", "gpt2", wrong, local),
                                                  ("jetmoe plain-chunk kv", "jetmoe", jet_wrong, jet_local)])
    bad = {t: p for t, p in out.items() if p and "plain-chunk" not in t}
    assert not bad, bad
    tampered = out["gpt2 plain-chunk qkv"]
    assert any(p.startswith("logits differ") for p in tampered), tampered
    assert any("differs from ucl's" in p for p in tampered), tampered
    assert any(p.startswith("logits differ") for p in out["jetmoe plain-chunk kv"]), out["jetmoe plain-chunk kv"]
