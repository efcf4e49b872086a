"""Hugging Face ``save_pretrained`` folders read in place (ucl/formats/hf/read.py).

Oracles: safetensors' own reader (``safetensors.torch.load_file``) for the universal layout, and
tensors sliced by hand in the test for the TP split the stdlib spec declares (q_proj rows, o_proj
columns, vocab rows in torch.chunk sizes). Tiny seeded models come from tests/hf_models.py.
"""
from __future__ import annotations

import json
import os
import struct
import tracemalloc

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

import hf_models as H  # noqa: E402
import ucl  # noqa: E402
from ucl.errors import UclError  # noqa: E402
from ucl.formats import registry as foreign  # noqa: E402
from ucl.formats.hf import read as hf_store  # noqa: E402
from ucl.formats.hf.names import read_safetensors_entries  # noqa: E402
from bits import same_bits as _same  # noqa: E402


def _save(arch, folder, dtype=torch.float32, shard=None, edit=None):
    model = H.build(arch, dtype=dtype)
    if edit is not None:
        edit(model)
    kw = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(folder, safe_serialization=True, **kw)
    return folder


def _reference(folder):
    """Every saved tensor, by safetensors' own reader."""
    files = [f for f in os.listdir(folder) if f.endswith(".safetensors")]
    out = {}
    for f in files:
        out.update(load_file(os.path.join(folder, f)))
    return out


def _refused(call, code=None):
    with pytest.raises(UclError) as e:
        call()
    if code is not None:
        assert e.value.code == code, (e.value.code, str(e.value))
    return str(e.value)


# ---- reading in place: universal, TP slices, reshard round trips -------------------------------------
CASES = [("llama", torch.float32, None), ("llama", torch.bfloat16, "40KB"), ("qwen2", torch.bfloat16, None),
         ("qwen2", torch.float32, "30KB"), ("gpt2", torch.float32, None), ("gpt2", torch.float16, "50KB"),
         ("llama_tied", torch.float32, None), ("mistral", torch.bfloat16, None), ("qwen3", torch.float32, None),
         ("gemma", torch.float32, "40KB"), ("phi3", torch.bfloat16, None)]


@pytest.mark.parametrize("arch,dtype,shard", CASES, ids=[f"{a}-{str(d)[6:]}-{s or 'single'}" for a, d, s in CASES])
def test_universal_equals_safetensors(tmp_path, arch, dtype, shard):
    folder = _save(arch, tmp_path / "m", dtype, shard)
    if shard:
        assert (folder / "model.safetensors.index.json").is_file()
        assert len([f for f in os.listdir(folder) if f.endswith(".safetensors")]) > 1
    assert foreign.detect_format(str(folder)) == "hf"
    ref = _reference(folder)
    got = ucl.load_rank(folder, mesh="universal", rank=0, as_torch=True)
    assert sorted(got) == sorted(f"param/{n}" for n in ref)
    for n, t in ref.items():
        assert _same(got[f"param/{n}"], t), n
    desc = foreign.describe(folder)
    assert desc.spec_name == f"stdlib:{H.config(arch).model_type}" and desc.mesh == ()
    assert set(desc.frozen) == set(desc.params)  # weights only: no optimizer state expected


def _tp_half(t, dim, rank, tp=2):
    return torch.chunk(t, tp, dim=dim)[rank]


@pytest.mark.parametrize("arch,dtype,shard", [("llama", torch.bfloat16, None), ("qwen2", torch.float32, "30KB")])
def test_tp_rank_is_the_specs_slice(tmp_path, arch, dtype, shard):
    folder = _save(arch, tmp_path / "m", dtype, shard)
    ref = _reference(folder)
    got = ucl.load_rank(folder, mesh="tp=2", rank=1, as_torch=True)
    q, o = "model.layers.1.self_attn.q_proj.weight", "model.layers.1.self_attn.o_proj.weight"
    assert _same(got[f"param/{q}"], ref[q][H.NH * H.HD // 2:])  # colwise: rows of rank 1
    assert _same(got[f"param/{o}"], ref[o][:, H.NH * H.HD // 2:])  # rowwise: columns of rank 1
    emb = "model.embed_tokens.weight"  # vocab 99 over tp=2, torch.chunk sizes 50 + 49
    assert got[f"param/{emb}"].shape[0] == 49 and _same(got[f"param/{emb}"], ref[emb][50:])
    norm = "model.norm.weight"
    assert _same(got[f"param/{norm}"], ref[norm])  # replicated
    assert not any(k.split("/")[0] != "param" for k in got)


@pytest.mark.parametrize("arch,dtype,shard", [("llama", torch.bfloat16, "40KB"), ("gpt2", torch.float32, None),
                                              ("qwen2", torch.float32, None)])
def test_reshard_to_tp2_and_back(tmp_path, arch, dtype, shard):
    folder = _save(arch, tmp_path / "m", dtype, shard)
    ref = _reference(folder)
    ucl.reshard(folder, tmp_path / "tp2", to="tp=2", workers=1, durable=False)
    ucl.reshard(tmp_path / "tp2", tmp_path / "back", to="universal", workers=1, durable=False)
    got = ucl.load_rank(tmp_path / "back", mesh="universal", rank=0, as_torch=True)
    prefix = "transformer." if arch == "gpt2" and not any(n.startswith("transformer.") for n in ref) else ""
    assert sorted(got) == sorted(f"param/{prefix}{n}" for n in ref)
    for n, t in ref.items():
        assert _same(got[f"param/{prefix}{n}"], t), n
    # the TP=2 checkpoint's rank 0 is what the HF folder gives rank 0 directly
    a = ucl.load_rank(tmp_path / "tp2", mesh="tp=2", rank=0, as_torch=True)
    b = ucl.load_rank(folder, mesh="tp=2", rank=0, as_torch=True)
    assert sorted(a) == sorted(b) and all(_same(a[k], b[k]) for k in a)


def test_mixed_dtypes_are_declared(tmp_path):
    """fp32 norms in a bf16 model: the description's spec gives each its stored dtype."""
    def fp32_norms(model):
        for name, mod in model.named_modules():
            if name.endswith("norm"):
                mod.float()
    folder = _save("llama", tmp_path / "m", torch.bfloat16, edit=fp32_norms)
    ref = _reference(folder)
    assert {t.dtype for t in ref.values()} == {torch.bfloat16, torch.float32}
    desc = foreign.describe(folder)
    assert "state param : dtype bfloat16" in desc.spec and "state param for model.layers.0.input_layernorm" \
        in desc.spec
    got = ucl.load_rank(folder, mesh="tp=2", rank=0, as_torch=True)
    assert got["param/model.norm.weight"].dtype == torch.float32
    assert got["param/model.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16
    got = ucl.load_rank(folder, mesh="universal", rank=0, as_torch=True)
    assert all(_same(got[f"param/{n}"], t) for n, t in ref.items())


def test_gpt2_without_base_prefix(tmp_path):
    """GPT-2 as on the Hub: names without ``transformer.``; they get it back, as from_pretrained does."""
    folder = _save("gpt2", tmp_path / "m")
    ref = _reference(folder)
    save_file({n.removeprefix("transformer."): t.contiguous() for n, t in ref.items()},
              str(folder / "model.safetensors"), metadata={"format": "pt"})
    got = ucl.load_rank(folder, mesh="universal", rank=0, as_torch=True)
    assert all(_same(got[f"param/{n}"], t) for n, t in ref.items())
    assert foreign.describe(folder).state["hf"]["renamed"]["h.0.attn.c_attn.weight"] == \
        "transformer.h.0.attn.c_attn.weight"


# ---- refusals -----------------------------------------------------------------------------------------
def _rewrite_header(path, edit):
    """Rewrite a .safetensors file's header through ``edit(header dict)``, data bytes unchanged."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    edit(header)
    new = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n:])


def _no_allocation(call, code):
    """``call`` is refused with ``code`` and allocates little on the way (nothing for the tensor)."""
    tracemalloc.start()
    try:
        msg = _refused(call, code)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, peak
    return msg


def _last(header):
    return max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][1])


def test_offsets_past_the_file_are_refused(tmp_path):
    folder = _save("llama", tmp_path / "m")

    def past(h):
        k = _last(h)
        b, e = h[k]["data_offsets"]
        h[k]["data_offsets"] = [b + (1 << 40), e + (1 << 40)]
    _rewrite_header(folder / "model.safetensors", past)
    msg = _no_allocation(lambda: ucl.load_rank(folder, mesh="universal", rank=0), "UCL406")
    assert "past the end" in msg


def test_huge_shape_is_refused(tmp_path):
    folder = _save("llama", tmp_path / "m")

    def huge(h):
        h["model.embed_tokens.weight"]["shape"] = [1 << 40, 1 << 20]
    _rewrite_header(folder / "model.safetensors", huge)
    msg = _no_allocation(lambda: ucl.load_rank(folder, mesh="universal", rank=0), "UCL401")
    assert "model.embed_tokens.weight" in msg and "needs" in msg


@pytest.mark.parametrize("bad", [{"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]},
                                 {"dtype": "Q4", "shape": [1], "data_offsets": [0, 4]},
                                 {"dtype": "F32", "shape": [1], "data_offsets": [8, 4]},
                                 {"dtype": "F32", "shape": [True], "data_offsets": [0, 4]},
                                 {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}])
def test_malformed_entries_are_refused(tmp_path, bad):
    path = tmp_path / "x.safetensors"
    header = json.dumps({"w": bad}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 16)
    _refused(lambda: read_safetensors_entries(path))


def test_overlapping_tensors_are_refused(tmp_path):
    path = tmp_path / "x.safetensors"
    header = json.dumps({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                         "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 16)
    assert "overlap" in _refused(lambda: read_safetensors_entries(path), "UCL401")


@pytest.mark.parametrize("name", ["../x.safetensors", "../x", "/etc/passwd", "sub/../../x.safetensors",
                                  "link.safetensors"])
def test_index_naming_outside_is_refused(tmp_path, name):
    folder = _save("llama", tmp_path / "m", shard="40KB")
    shard = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))[0]
    outside = tmp_path / "x.safetensors"  # a readable, valid file outside: must never be read
    outside.write_bytes((folder / shard).read_bytes())
    os.symlink(outside, folder / "link.safetensors")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["weight_map"] = {k: (name if v == shard else v) for k, v in index["weight_map"].items()}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    _refused(lambda: ucl.load_rank(folder, mesh="universal", rank=0), "UCL401")


def test_index_and_shards_must_agree(tmp_path):
    folder = _save("llama", tmp_path / "m", shard="40KB")
    path = folder / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    wm = index["weight_map"]
    name = next(n for n in wm if list(wm.values()).count(wm[n]) > 1)  # in a shard with others
    wm[name + ".missing"] = wm[name]
    path.write_text(json.dumps(index))
    assert "no such tensor" in _refused(lambda: foreign.describe(folder), "UCL401")
    del wm[name + ".missing"], wm[name]
    path.write_text(json.dumps(index))
    assert "does not map" in _refused(lambda: foreign.describe(folder), "UCL401")


@pytest.mark.parametrize("drop", ["lm_head.weight", "model.layers.1.mlp.down_proj.weight"])
def test_missing_tensors_are_refused(tmp_path, drop):
    folder = _save("llama", tmp_path / "m")
    ref = _reference(folder)
    del ref[drop]
    save_file(ref, str(folder / "model.safetensors"), metadata={"format": "pt"})
    assert drop in _refused(lambda: foreign.describe(folder), "UCL502")


def test_unknown_model_type(tmp_path):
    folder = _save("llama", tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    config["model_type"] = "no_such_model"  # no stdlib spec, and transformers cannot derive one
    (folder / "config.json").write_text(json.dumps(config))
    msg = _refused(lambda: ucl.load_rank(folder, mesh="universal", rank=0), "UCL423")
    assert "'no_such_model'" in msg
    config["model_type"] = "bert"  # derived from BertLMHeadModel: Llama's tensors do not fit it
    (folder / "config.json").write_text(json.dumps(config))
    foreign.forget()
    msg = _refused(lambda: ucl.load_rank(folder, mesh="universal", rank=0), "UCL502")
    assert "derived:bert" in msg


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "qwen2_moe"])  # qwen2_moe: layer 0 dense (mlp_only_layers)
def test_moe_experts_saved_one_by_one_read_as_the_fused_tensors(arch, tmp_path):
    """save_pretrained writes one tensor per expert; read in place they are the model's own fused
    in-memory tensors (oracle: the transformers model's state_dict), in place and resharded."""
    model = H.build(arch)
    model.save_pretrained(tmp_path / "m", safe_serialization=True, max_shard_size="60KB")
    saved = _reference(tmp_path / "m")
    assert any(".experts.0." in n for n in saved)  # really per-expert on disk
    memory = model.state_dict()
    got = ucl.load_rank(tmp_path / "m", mesh="universal", rank=0, as_torch=True)
    fused = [k for k in got if k.endswith("experts.gate_up_proj") or k.endswith("experts.down_proj")]
    assert fused
    for key, value in got.items():
        assert _same(value, memory[key.partition("/")[2]]), key
    ucl.reshard(tmp_path / "m", tmp_path / "ep", to="ep=2")
    back = ucl.load_rank(tmp_path / "ep", mesh="universal", rank=0, as_torch=True)
    assert all(_same(back[k], got[k]) for k in got)


def test_moe_experts_that_do_not_fuse_are_refused(tmp_path):
    model = H.build("qwen3_moe")
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    model.save_pretrained(tmp_path / "m", safe_serialization=True)
    st = load_file(str(tmp_path / "m" / "model.safetensors"))
    gone = next(k for k in st if ".experts.1.up_proj" in k)
    del st[gone]
    save_file(st, str(tmp_path / "m" / "model.safetensors"), metadata={"format": "pt"})
    msg = _refused(lambda: foreign.describe(tmp_path / "m"), "UCL502")
    assert "expert 1 has no up matrix" in msg and sd


def test_tensors_that_do_not_fit_the_spec(tmp_path):
    folder = _save("llama", tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    config["intermediate_size"] = 96  # the saved MLP is 128 wide
    (folder / "config.json").write_text(json.dumps(config))
    assert "stdlib:llama" in _refused(lambda: foreign.describe(folder), "UCL502")


def test_config_outside_is_refused(tmp_path):
    folder = _save("llama", tmp_path / "m")
    os.replace(folder / "config.json", tmp_path / "config.json")
    os.symlink(tmp_path / "config.json", folder / "config.json")
    assert "outside" in _refused(lambda: foreign.describe(folder), "UCL401")


def test_detect(tmp_path):
    folder = _save("llama", tmp_path / "m")
    assert hf_store.detect(str(folder))
    (folder / "manifest.json").write_text("{}")
    assert not hf_store.detect(str(folder))
    assert not hf_store.detect(str(tmp_path))
    assert "llama" in hf_store.known_model_types() and "megatron_gpt" not in hf_store.known_model_types()


def test_a_config_with_infinity_as_transformers_writes_it(tmp_path):
    """transformers writes floats JSON lacks as ``{"__float__": "Infinity"}`` (Mamba-2's default
    time_step_limit); the config reader takes them back as floats, so the class's defaults are filled
    in (before: transformers refused the tag, and the reader silently kept the raw fields only)."""
    import math
    transformers = pytest.importorskip("transformers")
    transformers.Mamba2Config(hidden_size=16, num_heads=4, head_dim=8, n_groups=2, num_hidden_layers=1,
                              vocab_size=32).save_pretrained(tmp_path)
    assert '"__float__"' in (tmp_path / "config.json").read_text()  # what transformers wrote
    from ucl.model_config import load_config
    config = load_config(tmp_path)
    assert config["time_step_limit"] == [0.0, math.inf] and config["n_groups"] == 2
    assert "state_size" in config  # a class default, not in the file
    # the same fields as a manifest keeps them (a dict, tags included: ``ucl export hf`` reads them so)
    import json
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # before: "transformers could not fill in the defaults"
        from_dict = load_config(json.loads((tmp_path / "config.json").read_text()))
    assert from_dict["time_step_limit"] == [0.0, math.inf] and "state_size" in from_dict
