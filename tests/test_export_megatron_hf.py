"""Megatron checkpoints exported as Hugging Face Llama folders (ucl/formats/hf/renames.py): names mapped,
``linear_qkv`` and ``linear_fc1`` unfused, the padded vocabulary cut to the config's.

Oracles, none of them ucl's: Megatron's own forward pass (the fixture's ``logits.safetensors``, made by
tests/fixtures/megatron_llama/make.py) against ``transformers``' ``LlamaForCausalLM`` loaded from the
export; torch's own ``dcp_to_torch_save`` of the Megatron folder, unfused in this file by explicit
per-head loops; numpy fancy indexing for the one cut the mapping knows (``Part``)."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402

import ucl  # noqa: E402
from ucl.errors import UclError  # noqa: E402
from ucl.ops.export import export_hf  # noqa: E402
from ucl.formats.hf.renames import Part  # noqa: E402
from tests.passes import examples

HERE = os.path.dirname(__file__)
FIX = os.path.join(HERE, "fixtures", "megatron_llama")
SRC = os.path.join(FIX, "tp2")
CONFIG = os.path.join(FIX, "config.json")


def _config(**edit) -> dict:
    with open(CONFIG) as fh:
        return dict(json.load(fh), **edit)


def _megatron_tensors(tmp_path) -> dict:
    """The Megatron folder's global tensors, as torch's own DCP tooling consolidates them."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = str(tmp_path / "consolidated.pt")
    dcp_to_torch_save(SRC, out)
    return {k: v for k, v in torch.load(out, weights_only=True).items() if torch.is_tensor(v)}


def _unfused(mt: dict, cfg: dict) -> dict:
    """The Llama tensors Megatron's layout implies, by per-group and per-layer loops."""
    heads, kv, hidden = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["hidden_size"]
    hd, ffn, vocab = hidden // heads, cfg["intermediate_size"], cfg["vocab_size"]
    per = heads // kv
    out = {"model.embed_tokens.weight": mt["embedding.word_embeddings.weight"][:vocab],
           "model.norm.weight": mt["decoder.final_layernorm.weight"],
           "lm_head.weight": mt["output_layer.weight"][:vocab]}
    for i in range(cfg["num_hidden_layers"]):
        qkv = mt["decoder.layers.self_attention.linear_qkv.weight"][i]
        q, k, v = [], [], []
        for g in range(kv):  # Megatron: per query group [its query heads | its key head | its value head]
            base = g * (per + 2) * hd
            q.append(qkv[base:base + per * hd])
            k.append(qkv[base + per * hd:base + (per + 1) * hd])
            v.append(qkv[base + (per + 1) * hd:base + (per + 2) * hd])
        fc1 = mt["decoder.layers.mlp.linear_fc1.weight"][i]
        p = f"model.layers.{i}."
        out.update({
            p + "self_attn.q_proj.weight": torch.cat(q), p + "self_attn.k_proj.weight": torch.cat(k),
            p + "self_attn.v_proj.weight": torch.cat(v),
            p + "self_attn.o_proj.weight": mt["decoder.layers.self_attention.linear_proj.weight"][i],
            p + "input_layernorm.weight": mt["decoder.layers.self_attention.linear_qkv.layer_norm_weight"][i],
            p + "post_attention_layernorm.weight": mt["decoder.layers.mlp.linear_fc1.layer_norm_weight"][i],
            p + "mlp.gate_proj.weight": fc1[:ffn], p + "mlp.up_proj.weight": fc1[ffn:2 * ffn],
            p + "mlp.down_proj.weight": mt["decoder.layers.mlp.linear_fc2.weight"][i],
        })
    return out


def _logits(folder: str, ids):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids).logits


def test_megatron_export_gives_megatrons_logits(tmp_path):
    out = str(tmp_path / "hf")
    export_hf(SRC, out, config=CONFIG)
    truth = load_file(os.path.join(FIX, "logits.safetensors"))
    got = _logits(out, truth["input_ids"])
    assert got.shape == truth["logits"].shape
    # the same model, two implementations of attention and RMSNorm: equal to fp32 rounding
    torch.testing.assert_close(got, truth["logits"], rtol=1e-5, atol=1e-5)


def test_megatron_export_is_bit_exact_against_torchs_consolidation(tmp_path):
    out = str(tmp_path / "hf")
    export_hf(SRC, out, config=CONFIG)
    got = load_file(os.path.join(out, "model.safetensors"))
    want = _unfused(_megatron_tensors(tmp_path), _config())
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert torch.equal(got[name], t.contiguous()), name


def test_padded_vocabulary_is_cut_to_the_config(tmp_path):
    out = str(tmp_path / "hf")
    export_hf(SRC, out, config=_config(vocab_size=90))
    got = load_file(os.path.join(out, "model.safetensors"))
    mt = _megatron_tensors(tmp_path)
    assert torch.equal(got["model.embed_tokens.weight"], mt["embedding.word_embeddings.weight"][:90])
    assert torch.equal(got["lm_head.weight"], mt["output_layer.weight"][:90])
    truth = load_file(os.path.join(FIX, "logits.safetensors"))
    ids = truth["input_ids"].clamp(max=89)
    same_ids = (ids == truth["input_ids"]).all(dim=1)  # rows whose tokens all exist in the cut vocabulary
    assert same_ids.any()
    torch.testing.assert_close(_logits(out, ids)[same_ids], truth["logits"][same_ids][..., :90], rtol=1e-5, atol=1e-5)


def _per_layer(tmp_path, mt: dict, state=None) -> str:
    """The Megatron tensors named per layer (as Megatron-LM legacy and stdlib:megatron_gpt do), saved by ucl."""
    tensors = {}
    for name, t in mt.items():
        if name.startswith("decoder.layers."):
            rest = name[len("decoder.layers."):].replace("self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight")
            for i in range(t.shape[0]):
                tensors[f"decoder.layers.{i}.{rest}"] = t[i].contiguous()
        else:
            tensors[name] = t
    spec = ucl.load_spec("mesh dp\n** : replicate\n")
    model = spec.bind({}, {n: tuple(t.shape) for n, t in tensors.items()})
    ckpt = str(tmp_path / "per_layer")
    ucl.save(ckpt, {0: {f"param/{n}": t.numpy() for n, t in tensors.items()}}, model=model, mesh="dp=1", state=state)
    return ckpt


# what Megatron-LM's arguments say of the fixture's model (pretrain_gpt.py names)
ARGS = {"num_layers": 2, "hidden_size": 32, "ffn_hidden_size": 48, "num_attention_heads": 4, "kv_channels": 8,
        "group_query_attention": True, "num_query_groups": 2, "max_position_embeddings": 16,
        "position_embedding_type": "rope", "rotary_percent": 1.0, "rotary_base": 10000, "padded_vocab_size": 96,
        "swiglu": True, "untie_embeddings_and_output_weights": True, "add_bias_linear": False, "add_qkv_bias": False,
        "normalization": "RMSNorm", "norm_epsilon": 1e-05, "qk_layernorm": False}


def test_megatron_lm_arguments_give_the_config(tmp_path):
    ckpt = _per_layer(tmp_path, _megatron_tensors(tmp_path), state={"megatron": {"args": ARGS}})
    out = str(tmp_path / "hf")
    export_hf(ckpt, out)  # no config: derived from the run's arguments
    with open(os.path.join(out, "config.json")) as fh:
        cfg = json.load(fh)
    assert cfg["model_type"] == "llama" and cfg["num_key_value_heads"] == 2 and cfg["tie_word_embeddings"] is False
    truth = load_file(os.path.join(FIX, "logits.safetensors"))
    torch.testing.assert_close(_logits(out, truth["input_ids"]), truth["logits"], rtol=1e-5, atol=1e-5)


def test_megatron_lm_arguments_of_another_architecture_are_refused(tmp_path):
    legacy = os.path.join(HERE, "fixtures", "megatron_legacy", "tp2")  # LayerNorm, biases
    with pytest.raises(UclError) as e:
        export_hf(legacy, str(tmp_path / "hf"))
    msg = str(e.value)
    assert e.value.code == "UCL503" and "normalization is 'LayerNorm'" in msg and "add_bias_linear" in msg
    assert "--config" in msg and not os.path.exists(tmp_path / "hf")


def test_per_layer_names_map_like_stacked_ones(tmp_path):
    """Megatron-LM legacy and stdlib:megatron_gpt checkpoints name each layer; cast on the way (bf16)."""
    mt = _megatron_tensors(tmp_path)
    ckpt = _per_layer(tmp_path, mt)
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    export_hf(ckpt, a, config=CONFIG, dtype="bfloat16")
    export_hf(SRC, b, config=CONFIG, dtype="bfloat16")
    ta, tb = load_file(os.path.join(a, "model.safetensors")), load_file(os.path.join(b, "model.safetensors"))
    assert sorted(ta) == sorted(tb) and all(torch.equal(ta[n], tb[n]) for n in ta)
    assert all(t.dtype == torch.bfloat16 for t in ta.values())
    want = _unfused(mt, _config())
    assert all(torch.equal(ta[n], want[n].to(torch.bfloat16)) for n in want)


def test_sharded_export_places_each_tensor_where_the_index_says(tmp_path):
    out = str(tmp_path / "hf")
    export_hf(SRC, out, config=CONFIG, max_shard_size="20KB")
    with open(os.path.join(out, "model.safetensors.index.json")) as fh:
        index = json.load(fh)["weight_map"]
    want = _unfused(_megatron_tensors(tmp_path), _config())
    assert sorted(index) == sorted(want) and len(set(index.values())) > 2
    for file in set(index.values()):
        for name, t in load_file(os.path.join(out, file)).items():
            assert index[name] == file and torch.equal(t, want[name])


def test_tensors_llama_has_no_place_for_are_refused_by_name(tmp_path):
    # the other Megatron fixtures use LayerNorm with biases, linear biases and learned positions
    src = os.path.join(HERE, "fixtures", "megatron", "tp2")
    cfg = dict(_config(), hidden_size=16, num_attention_heads=4, num_key_value_heads=2, intermediate_size=32,
               vocab_size=64, num_hidden_layers=2)
    with pytest.raises(UclError) as e:
        export_hf(src, str(tmp_path / "hf"), config=cfg)
    msg = str(e.value)
    assert e.value.code == "UCL503" and "position_embeddings" in msg and "linear_proj.bias" in msg
    assert not os.path.exists(tmp_path / "hf")


def test_a_config_that_does_not_fit_names_the_tensor_and_the_dims(tmp_path):
    with pytest.raises(UclError) as e:
        export_hf(SRC, str(tmp_path / "hf"), config=_config(num_key_value_heads=4))  # Megatron has 2 groups
    assert e.value.code == "UCL503" and "linear_qkv" in str(e.value)
    assert "num_key_value_heads x head_dim is 4 x 8 = 32 in the config, but 16 in the checkpoint" in str(e.value)
    with pytest.raises(UclError) as e:
        export_hf(SRC, str(tmp_path / "hf"), config=_config(model_type="gpt2"))
    assert "gpt2" in str(e.value)
    with pytest.raises(UclError) as e:
        export_hf(SRC, str(tmp_path / "hf"))  # a Megatron folder carries no Hugging Face config
    assert "config" in str(e.value)


@pytest.mark.parametrize("edit,words", [
    ({"hidden_size": 64}, ["hidden_size is 64 in the config, but 32 in the checkpoint",
                           "embedding.word_embeddings.weight [96, 32]"]),
    ({"num_hidden_layers": 1}, ["num_hidden_layers is 1 in the config, but 2 in the checkpoint"]),
    ({"num_attention_heads": 8}, ["num_key_value_heads x head_dim is 2 x 4 = 8 in the config, but 16"]),  # was exported
    ({"intermediate_size": 40}, ["intermediate_size is 40 in the config, but 48 in the checkpoint"]),
    ({"vocab_size": 200}, ["vocab_size is 200 in the config, but at most 96 in the checkpoint"]),
])
def test_cli_says_a_config_does_not_match_the_checkpoint(tmp_path, capsys, edit, words):
    """Not "llama models have no such tensor" or rows outside a block: the config is wrong, dim by dim."""
    from ucl.cli import main
    (tmp_path / "c.json").write_text(json.dumps(_config(**edit)))
    assert main(["export", "hf", SRC, str(tmp_path / "hf"), "--config", str(tmp_path / "c.json")]) != 0
    err = capsys.readouterr().err
    assert "the config does not match the checkpoint" in err and all(w in err for w in words), err
    assert "no such tensor" not in err and "Traceback" not in err and not os.path.exists(tmp_path / "hf")


@settings(max_examples=examples(60), deadline=None)
@given(blocks=st.integers(1, 5), per=st.integers(1, 6), cols=st.integers(1, 3), data=st.data())
def test_part_takes_the_rows_of_every_block(blocks, per, cols, data):
    start = data.draw(st.integers(0, per - 1))
    stop = data.draw(st.integers(start + 1, per))
    x = np.arange(blocks * per * cols).reshape(blocks * per, cols)
    part = Part(blocks, start, stop)
    assert part.check(x.shape[0]) is None
    rows = [b * per + r for b in range(blocks) for r in range(start, stop)]  # brute force: row indices
    np.testing.assert_array_equal(part.take(x), x[rows])
    assert part.rows(x.shape[0]) == len(rows)
    assert Part(blocks, start, per + 1).check(x.shape[0]) is not None
    if blocks > 1:
        assert Part(blocks, 0, 1).check(x.shape[0] + 1) is not None
