"""Export to a Hugging Face ``save_pretrained`` folder (ucl/formats/hf/write.py, fed by ucl.ops.export).

Oracles, none of them ucl's: safetensors' own reader (``load_file``) and writer (``save_file``: every
exported file must be byte-identical to what it writes for the same tensors), torch's ``.to()`` for
dtype casts, ``transformers.AutoModelForCausalLM.from_pretrained`` (no missing or unexpected keys,
the same logits as the source folder loaded the same way), DeepSpeed's own module weights and fp32
masters of the fixtures (truth_module / truth_fp32.safetensors).
"""
from __future__ import annotations

import json
import os
import tracemalloc

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

import hf_models as H  # noqa: E402
import ucl  # noqa: E402
from ucl.errors import UclError  # noqa: E402
from ucl.formats.hf.write import parse_shard_size  # noqa: E402
from ucl.ops.export import export_hf  # noqa: E402
from bits import same_bits as _same  # noqa: E402

DS = os.path.join(os.path.dirname(__file__), "fixtures", "deepspeed")
TOKENS = torch.tensor([[1, 5, 17, 42, 98, 3, 64, 0, 7, 11]])


def _save(arch, folder, dtype=torch.float32, edit=None):
    model = H.build(arch, dtype=dtype)
    if edit is not None:
        edit(model)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def _files(folder):
    return sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))


def _tensors(folder):
    out = {}
    for f in _files(folder):
        out.update(load_file(os.path.join(folder, f)))
    return out


def _refused(call, code="UCL503"):
    with pytest.raises(UclError) as e:
        call()
    assert e.value.code == code, (e.value.code, str(e.value))
    return str(e.value)


def _check_files(out, tmp_path, limit=None):
    """Every file is what safetensors' save_file writes for its tensors; the index (when sharded)
    names each tensor's file and the total size, and the split is save_pretrained's rule."""
    files = _files(out)
    index_path = os.path.join(out, "model.safetensors.index.json")
    if len(files) == 1:
        assert files == ["model.safetensors"] and not os.path.exists(index_path)
    else:
        n = len(files)
        assert files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
        with open(index_path) as fh:
            index = json.load(fh)
        weight_map, total = {}, 0
        for f in files:
            tensors = load_file(os.path.join(out, f))
            weight_map.update({k: f for k in tensors})
            size = sum(t.numel() * t.element_size() for t in tensors.values())
            total += size
            assert limit is None or size <= limit or len(tensors) == 1, (f, size)
        assert index["weight_map"] == weight_map
        assert index["metadata"]["total_size"] == total
        assert index["metadata"]["total_parameters"] == sum(t.numel() for t in _tensors(out).values())
    for f in files:
        ref = tmp_path / f"ref-{f}"
        save_file(load_file(os.path.join(out, f)), ref, metadata={"format": "pt"})
        with open(os.path.join(out, f), "rb") as a, open(ref, "rb") as b:
            assert a.read() == b.read(), f


def _load(folder):
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert not info.get("mismatched_keys"), info
    return model.eval()


# ---- HF folder -> tp=2 ucl checkpoint -> HF folder ---------------------------------------------------
CASES = [("llama", torch.float32, None), ("qwen2", torch.bfloat16, "30KB"), ("gpt2", torch.float32, "50KB"),
         ("llama_tied", torch.bfloat16, None)]


@pytest.mark.parametrize("arch,dtype,shard", CASES, ids=[f"{a}-{str(d)[6:]}-{s or 'single'}" for a, d, s in CASES])
def test_round_trip_through_tp2(tmp_path, arch, dtype, shard):
    src = _save(arch, tmp_path / "src", dtype)
    ucl.reshard(src, tmp_path / "tp2", to="tp=2", workers=1, durable=False)
    out = tmp_path / "out"
    stats = export_hf(tmp_path / "tp2", out, **({"max_shard_size": shard} if shard else {}))
    assert (len(_files(out)) > 1) == bool(shard)
    _check_files(out, tmp_path, parse_shard_size(shard) if shard else None)

    ref, got = _tensors(src), _tensors(out)
    prefix = "transformer." if arch == "gpt2" and not any(n.startswith("transformer.") for n in ref) else ""
    assert sorted(got) == sorted(prefix + n for n in ref)  # tied: no lm_head.weight, as save_pretrained
    for n, t in ref.items():
        assert _same(got[prefix + n], t), n
    assert stats.datasets_written == len(ref) and stats.details["dtype"] == str(dtype)[6:]

    config = json.loads((out / "config.json").read_text())
    source_config = json.loads((src / "config.json").read_text())
    assert config["dtype"] == config["torch_dtype"] == str(dtype)[6:]
    assert {k: v for k, v in config.items() if k != "torch_dtype"} == source_config

    a, b = _load(src), _load(out)
    with torch.no_grad():
        assert torch.equal(a(TOKENS).logits, b(TOKENS).logits)


# ---- dtype casts --------------------------------------------------------------------------------------
def _ties(model):
    """Values whose bf16/fp16 rounding is a tie or special, in the first rows of the embedding."""
    w = model.get_input_embeddings().weight
    special = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 2**-130, -0.0, float("inf"), float("nan"),
                            65520.0, 3.4e38, 1 + 2**-11, 1 + 3 * 2**-11, 5.96e-8], dtype=torch.float32)
    with torch.no_grad():
        w.view(-1)[: special.numel()] = special


@pytest.mark.parametrize("target", [torch.bfloat16, torch.float16])
def test_cast_is_torch_cast(tmp_path, target):
    src = _save("llama", tmp_path / "src", torch.float32, edit=_ties)
    out = tmp_path / "out"
    name = str(target)[6:]
    export_hf(src, out, dtype=name, max_shard_size=100_000)
    _check_files(out, tmp_path, 100_000)
    ref, got = _tensors(src), _tensors(out)
    assert sorted(ref) == sorted(got)
    for n, t in ref.items():
        assert _same(got[n], t.to(target)), n
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == config["torch_dtype"] == name
    assert _load(out).dtype == target


def test_bf16_to_float32_is_exact(tmp_path):
    src = _save("qwen2", tmp_path / "src", torch.bfloat16)
    export_hf(src, tmp_path / "out", dtype="fp32")
    ref, got = _tensors(src), _tensors(tmp_path / "out")
    assert all(_same(got[n], t.float()) for n, t in ref.items())


# ---- a DeepSpeed folder (not a Hugging Face model) with an explicit config ----------------------------
def test_deepspeed_fixture_with_config(tmp_path):
    folder = os.path.join(DS, "z1_fp32_dp2")
    _refused(lambda: export_hf(folder, tmp_path / "none"))  # no config.json anywhere: say --config
    assert not os.path.exists(tmp_path / "none")
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"architectures": ["TinyLM"], "hidden_size": 15, "vocab_size": 61}))
    out = tmp_path / "out"
    stats = export_hf(folder, out, config=cfg)
    truth = load_file(os.path.join(DS, "z1_fp32_dp2", "truth_module.safetensors"))
    got = _tensors(out)
    # every param dataset, names as they are; the tied alias lm_head.weight is not a tensor of its own
    assert sorted(got) == sorted(n for n in truth if n != "lm_head.weight")
    assert all(_same(got[n], truth[n]) for n in got)
    assert stats.details["files"] == ["model.safetensors"]
    config = json.loads((out / "config.json").read_text())
    assert config == {"architectures": ["TinyLM"], "hidden_size": 15, "vocab_size": 61,
                      "dtype": "float32", "torch_dtype": "float32"}
    _check_files(out, tmp_path)


def test_deepspeed_bf16_exports_params_or_masters(tmp_path):
    folder = os.path.join(DS, "z1_bf16_dp4")
    config = {"hidden_size": 15}
    export_hf(folder, tmp_path / "as_stored", config=config)
    truth = load_file(os.path.join(folder, "truth_module.safetensors"))
    got = _tensors(tmp_path / "as_stored")
    assert sorted(got) == sorted(n for n in truth if n != "lm_head.weight")
    assert all(_same(got[n], truth[n]) for n in got)  # bf16 weights, the fp32 buffer as it is
    assert json.loads((tmp_path / "as_stored" / "config.json").read_text())["dtype"] == "bfloat16"
    _check_files(tmp_path / "as_stored", tmp_path)  # bf16 weights and an fp32 buffer in one file

    stats = export_hf(folder, tmp_path / "fp32", config=config, dtype=torch.float32)
    masters = load_file(os.path.join(folder, "truth_fp32.safetensors"))
    got = _tensors(tmp_path / "fp32")
    for n, t in got.items():
        # trainable weights come from their fp32 masters, not upcast bf16; pos.weight is frozen
        want = masters[n] if n in masters else truth[n].float()
        assert _same(t, want), n
    assert stats.details["fp32_master"]
    _check_files(tmp_path / "fp32", tmp_path)


def test_memory_is_one_tensor_not_the_model(tmp_path):
    from transformers import AutoModelForCausalLM

    cfg = H.config("llama")
    cfg.num_hidden_layers, cfg.intermediate_size = 8, 4096
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "src")
    total = os.path.getsize(tmp_path / "src" / "model.safetensors")  # 25 MB, largest tensor 1 MB
    export_hf(tmp_path / "src", tmp_path / "warm")  # parse, bind and plan caches filled outside the measure
    tracemalloc.start()
    try:
        export_hf(tmp_path / "src", tmp_path / "out", dtype="bfloat16", max_shard_size="4MB")
        peak = tracemalloc.get_traced_memory()[1]  # numpy buffers count; metadata (bind, plan) ~1 MB
    finally:
        tracemalloc.stop()
    assert peak < total / 4, (peak, total)


# ---- tied embeddings ----------------------------------------------------------------------------------
def _tie_by_value(model):
    with torch.no_grad():
        model.lm_head.weight.copy_(model.get_input_embeddings().weight)


def test_tied_head_written_once(tmp_path):
    src = _save("llama", tmp_path / "src", edit=_tie_by_value)  # untied config, equal tensors
    cfg = json.loads((src / "config.json").read_text())
    stats = export_hf(src, tmp_path / "out", config=dict(cfg, tie_word_embeddings=True))
    got = _tensors(tmp_path / "out")
    assert "lm_head.weight" not in got and stats.details["tied_dropped"] == "lm_head.weight"
    b = _load(tmp_path / "out")
    assert b.lm_head.weight is b.get_input_embeddings().weight
    with torch.no_grad():
        assert torch.equal(_load(src)(TOKENS).logits, b(TOKENS).logits)


def test_ucl_save_of_a_live_tied_model(tmp_path):
    model = H.build("llama_tied")
    sd = model.state_dict()  # both names of the tied weight, as state_dict() lists them
    assert "lm_head.weight" in sd
    spec = ucl.load_spec("stdlib:llama")
    bound = spec.bind(spec.dims_from_config(model.config), {n: tuple(t.shape) for n, t in sd.items()}, frozen=list(sd))
    ucl.save(tmp_path / "ck", {0: {f"param/{n}": t for n, t in sd.items()}}, model=bound, mesh="universal")
    msg = _refused(lambda: export_hf(tmp_path / "ck", tmp_path / "out"))  # no HF config recorded
    assert "--config" in msg
    stats = export_hf(tmp_path / "ck", tmp_path / "out", config=model.config, max_shard_size="20KB")
    assert stats.details["tied_dropped"] == "lm_head.weight" and len(stats.details["files"]) > 1
    _check_files(tmp_path / "out", tmp_path, 20_000)
    with torch.no_grad():
        assert torch.equal(model(TOKENS).logits, _load(tmp_path / "out")(TOKENS).logits)


def test_tied_config_with_a_head_of_another_shape_keeps_it(tmp_path):
    """CPM-Ant: tie_word_embeddings is true, but its head (vocab rows) is a slice of a larger input
    embedding, so transformers ties nothing and the head must be written (refused before)."""
    import hf_every as E
    model = E.build("cpmant")
    assert model.config.tie_word_embeddings
    model.save_pretrained(tmp_path / "src")
    stats = export_hf(tmp_path / "src", tmp_path / "out")
    assert stats.details["tied_dropped"] is None and "lm_head.weight" in _tensors(tmp_path / "out")
    with torch.no_grad():
        assert torch.equal(model(TOKENS[:, :8]).logits, _load(tmp_path / "out")(TOKENS[:, :8]).logits)


def test_config_class_without_tie_field_keeps_the_head(tmp_path):
    """inkling_text's config class has no tie_word_embeddings (transformers 5 then ties nothing); its
    head equal to the embedding by value was dropped as tied before: reloaded, the head was
    left at random init and the logits differed."""
    import hf_every as E
    model = E.build("inkling_text")
    assert not hasattr(model.config, "tie_word_embeddings")
    with torch.no_grad():
        model.lm_head.weight.copy_(model.get_input_embeddings().weight)
    model.save_pretrained(tmp_path / "src")
    stats = export_hf(tmp_path / "src", tmp_path / "out")
    assert stats.details["tied_dropped"] is None and "lm_head.weight" in _tensors(tmp_path / "out")


def test_tied_config_with_a_different_head_is_refused(tmp_path):
    src = _save("llama", tmp_path / "src")  # untied, lm_head differs from the embedding
    cfg = json.loads((src / "config.json").read_text())
    msg = _refused(lambda: export_hf(src, tmp_path / "out", config=dict(cfg, tie_word_embeddings=True)))
    assert "tie_word_embeddings" in msg
    assert sorted(os.listdir(tmp_path)) == ["src"]  # nothing published, no temp folder left


# ---- refusals -----------------------------------------------------------------------------------------
def test_existing_out_is_refused(tmp_path):
    src = _save("llama", tmp_path / "src")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    _refused(lambda: export_hf(src, tmp_path / "out"))
    assert os.listdir(tmp_path / "out") == ["keep.txt"]
    (tmp_path / "file").write_text("x")
    _refused(lambda: export_hf(src, tmp_path / "file"))
    assert sorted(os.listdir(tmp_path)) == ["file", "out", "src"]


@pytest.mark.parametrize("kw", [{"max_shard_size": "5XB"}, {"max_shard_size": 0}, {"max_shard_size": True},
                                {"max_shard_size": "-1GB"}, {"dtype": "int8"}, {"dtype": "float8_e4m3fn"},
                                {"config": {"a": float("nan")}}])
def test_bad_arguments_are_refused(tmp_path, kw):
    src = _save("llama", tmp_path / "src")
    _refused(lambda: export_hf(src, tmp_path / "out", **kw))
    assert sorted(os.listdir(tmp_path)) == ["src"]


def test_wrong_config_is_refused(tmp_path):
    src = _save("llama", tmp_path / "src")
    _refused(lambda: export_hf(src, tmp_path / "out", config=tmp_path / "nope.json"))
    cfg = json.loads((src / "config.json").read_text())
    msg = _refused(lambda: export_hf(src, tmp_path / "out", config=dict(cfg, hidden_size=128)))
    assert "the config does not match the checkpoint" in msg and "hidden_size is 128 in the config, but 64" in msg
    msg = _refused(lambda: export_hf(src, tmp_path / "out", config=H.config("gpt2")))  # another model's config
    assert "stdlib:gpt2" in msg
    assert sorted(os.listdir(tmp_path)) == ["src"]


@pytest.mark.parametrize("edit,words", [
    ({"num_hidden_layers": 1}, "num_hidden_layers is 1 in the config, but 2 in the checkpoint"),  # was exported
    ({"num_attention_heads": 2}, "num_attention_heads x head_dim is 2 x 16 = 32 in the config, but 64"),
    ({"num_key_value_heads": 1}, "num_key_value_heads x head_dim is 1 x 16 = 16 in the config, but 32"),
    ({"intermediate_size": 7}, "intermediate_size is 7 in the config, but 128 in the checkpoint"),
])
def test_a_config_whose_dims_disagree_is_named_dim_by_dim(tmp_path, edit, words):
    src = _save("llama", tmp_path / "src")
    cfg = json.loads((src / "config.json").read_text())
    msg = _refused(lambda: export_hf(src, tmp_path / "out", config=dict(cfg, **edit)))
    assert msg.startswith("the config does not match the checkpoint") and words in msg, msg


def test_shard_sizes_parse_like_transformers():
    # huggingface_hub's parse_size_to_int: decimal units, a float value truncated to bytes
    for s, n in (("5GB", 5 * 10**9), ("500MB", 5 * 10**8), ("10KB", 10**4), ("1.5GB", 15 * 10**8),
                 ("2TB", 2 * 10**12), ("7kb", 7000), (" 3 MB ", 3 * 10**6)):
        assert parse_shard_size(s) == n, s
    assert parse_shard_size("1GiB") == 2**30 and parse_shard_size(12345) == 12345 and parse_shard_size("99") == 99


def test_moe_folder_read_in_place_exports_loadable_fused_experts(tmp_path):
    """An MoE save_pretrained folder (experts saved one by one) read in place and exported: the
    fused expert tensors load in transformers with no missing keys and the same logits."""
    from transformers import AutoModelForCausalLM
    model = H.build("qwen3_moe")
    model.save_pretrained(tmp_path / "src", safe_serialization=True)
    export_hf(tmp_path / "src", tmp_path / "out")
    back, info = AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not any(info.values())
    x = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(x).logits, back.eval()(x).logits)
