"""A mesh that does not fit the model: blame the mesh (name the axis, the dim expression and the
sizes that would work), report each problem once for all layers, and only warn where the mesh
fits loosely (empty pipeline stages, `shared` splits over more ranks than elements).

The sizes "that would work" are checked against brute force (compiling every size), not taken
from the diagnostic.
"""
from __future__ import annotations

import re
import warnings

import numpy as np
import pytest

import ucl
from ucl import Mesh, UNIVERSAL
from ucl.demo import llama_model
from ucl.layout.fit import MeshFitWarning


def compile_error(model, mesh) -> ucl.BindError:
    with pytest.raises(ucl.BindError) as info:
        ucl.compile(model, UNIVERSAL, mesh)
    return info.value


def sizes_that_compile(model, axis, top=8, **others):
    ok = []
    for s in range(1, top + 1):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", MeshFitWarning)
                ucl.compile(model, UNIVERSAL, Mesh(**others, **{axis: s}))
            ok.append(s)
        except ucl.BindError:
            pass
    return ok


def listed_sizes(hint: str, axis: str) -> list[int]:
    m = re.search(rf"choose {axis} among ([\d, ]+)", hint)
    assert m, hint
    return [int(x) for x in m.group(1).replace(" ", "").strip(",").split(",")]


def no_fit_warnings(fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn()
    assert not [w for w in caught if issubclass(w.category, MeshFitWarning)], [str(w.message) for w in caught]
    return out


# =================================================================================================
# blame the mesh
# =================================================================================================
def test_tp3_on_the_demo_blames_the_mesh_once_per_rule():
    model = llama_model()  # 4 layers, kv_heads=4, heads=8, head_dim=32, ffn=704
    err = compile_error(model, Mesh(tp=3))
    assert err.code == "UCL204"
    # one diagnostic per rule that cannot be split 3 ways (not one per layer): qkv (kv_heads=4),
    # linear_proj (256 columns), linear_fc1 (ffn=704), linear_fc2 (ffn=704)
    assert len(err.diagnostics) == 4, str(err)
    qkv = err.diagnostics[0]
    assert "tp=3 does not divide kv_heads=4" in qkv.message
    assert "dim 0.0 of decoder.layers.0.self_attention.linear_qkv.weight [512, 256]" in qkv.message
    assert "and 3 more parameters like this" in qkv.message
    assert qkv.hint.startswith("choose tp among 1, 2, 4")
    assert listed_sizes(qkv.hint, "tp") == [s for s in sizes_that_compile(model, "tp") if s != 3]
    assert "tp=3 does not divide ffn=704" in err.diagnostics[2].message
    text = str(err)
    assert "split 0.0 over tp" in text and "4 errors in <demo:llama_megatron>" in text


def test_tp8_blames_the_kv_heads_only():
    model = llama_model()
    err = compile_error(model, Mesh(pp=2, dp=2, tp=8))
    assert len(err.diagnostics) == 1
    d = err.diagnostics[0]
    assert "tp=8 does not divide kv_heads=4" in d.message and "pp=2,dp=2,tp=8" in d.message
    assert listed_sizes(d.hint, "tp") == sizes_that_compile(model, "tp", pp=2, dp=2)


def test_pp8_with_4_layers_says_pp_must_divide_layers():
    model = llama_model()
    err = compile_error(model, Mesh(pp=8))
    assert len(err.diagnostics) == 1, str(err)  # not one per layer, nor one per parameter
    d = err.diagnostics[0]
    assert "pp=8 does not divide layers=4" in d.message
    assert "index i of layers over pp" in d.message and "places 24 parameters" in d.message
    assert listed_sizes(d.hint, "pp") == [s for s in sizes_that_compile(model, "pp") if s != 8]
    assert "first" in d.hint and "sizes" in d.hint
    assert (d.span.line, d.span.col) == (9, 25)  # the index transform


def test_virtual_stages_name_the_product():
    text = "mesh pp\nl.{i}.** : index i of 8 over pp virtual 2\nl.{i}.w : replicate\n"
    model = ucl.load_spec(text).bind({}, {f"l.{i}.w": (1,) for i in range(8)})
    d = compile_error(model, Mesh(pp=3)).diagnostics[0]
    assert "pp=3 x virtual 2 = 6 does not divide 8" in d.message
    assert listed_sizes(d.hint, "pp") == [1, 2, 4] == [s for s in sizes_that_compile(model, "pp") if s != 3]


def test_sizes_listing_the_wrong_number_of_stages_blames_the_mesh():
    text = "mesh pp\nl.{i}.** : index i of 4 over pp sizes [3, 1]\nl.{i}.w : replicate\n"
    model = ucl.load_spec(text).bind({}, {f"l.{i}.w": (1,) for i in range(4)})
    d = compile_error(model, Mesh(pp=4)).diagnostics[0]
    assert d.code == "UCL207" and "lists 2 stages" in d.message
    assert listed_sizes(d.hint, "pp") == [1, 2] == sizes_that_compile(model, "pp")


def test_the_spec_is_blamed_when_no_other_size_fits():
    # h=4 and g=3 over the same axis: only tp=1 fits both, so the spec needs `uneven` or padding
    text = "dims h, g\nmesh tp\na [h] : split 0 over tp\nb [g] : split 0 over tp\n"
    model = ucl.load_spec(text).bind({"h": 4, "g": 3}, {"a": (4,), "b": (3,)})
    assert sizes_that_compile(model, "tp") == [1]
    err = compile_error(model, Mesh(tp=2))
    d = err.diagnostics[0]
    assert "choose" not in (d.hint or "") and "uneven" in d.hint
    assert "b [3]" in d.message and "tp=2" in d.message


def test_one_diagnostic_for_a_parameter_and_its_states_in_every_layer():
    text = ("dims h, layers\nmesh pp, tp\nlayers.{i}.** : index i of layers over pp\n"
            "layers.{i}.w [h, h] : split 1 over tp\nstate exp_avg, exp_avg_sq : follow\n")
    params = {f"layers.{i}.w": (6, 6) for i in range(5)}
    model = ucl.load_spec(text).bind({"h": 6, "layers": 5}, params)
    err = compile_error(model, Mesh(tp=4))
    assert len(err.diagnostics) == 1
    d = err.diagnostics[0]
    assert "layers.0.w [6, 6]" in d.message and "tp=4 does not divide h=6" in d.message
    assert "and 4 more parameters like this (layers.1.w, layers.2.w, ...)" in d.message
    assert listed_sizes(d.hint, "tp") == [1, 2, 3, 6]
    assert [s for s in sizes_that_compile(model, "tp") if s != 4] == [1, 2, 3, 6]
    assert "uneven" in d.hint  # the spec-side alternative is still named


def test_a_split_over_a_tuple_names_the_product():
    text = "dims h\nmesh dp, tp\nw [h] : split 0 over (dp, tp)\n"
    model = ucl.load_spec(text).bind({"h": 4}, {"w": (4,)})
    d = compile_error(model, Mesh(dp=3, tp=1)).diagnostics[0]
    assert "dp=3 x tp=1 = 3 does not divide h=4" in d.message
    assert "1, 2, 4" in d.hint


def test_a_shared_split_that_is_neither_divisor_nor_multiple():
    text = "dims kv\nmesh tp\nk [kv, 2] : split 0 over tp shared\n"
    model = ucl.load_spec(text).bind({"kv": 4}, {"k": (4, 2)})
    d = compile_error(model, Mesh(tp=6)).diagnostics[0]
    assert "tp=6 is neither a divisor nor a multiple of kv=4" in d.message
    listed = listed_sizes(d.hint, "tp")
    assert listed[:6] == [1, 2, 4, 8, 12, 16]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MeshFitWarning)
        assert [s for s in sizes_that_compile(model, "tp", top=16) if s != 6] == [1, 2, 4, 8, 12, 16]


# =================================================================================================
# warn, do not fail
# =================================================================================================
def test_empty_pipeline_stage_from_sizes_warns_and_works():
    text = "mesh pp\nl.{i}.** : index i of 4 over pp sizes [4, 0]\nl.{i}.w : replicate\n"
    model = ucl.load_spec(text).bind({}, {f"l.{i}.w": (1,) for i in range(4)})
    values = {f"param/l.{i}.w": np.array([i], np.float32) for i in range(4)}
    with pytest.warns(MeshFitWarning, match=r"pp stage 1 gets none of the 4 i-values"):
        plan = ucl.compile(model, UNIVERSAL, Mesh(pp=2))
    shards = ucl.execute_memory(plan, {0: values})
    assert sorted(shards[0]) == sorted(values) and not shards.get(1)
    assert all(shards[0][k].tolist() == v.tolist() for k, v in values.items())


def test_empty_stages_of_the_stdlib_first_form_warn_once():
    spec = ucl.load_spec("stdlib:llama")
    dims = dict(vocab=99, hidden=64, heads=4, kv_heads=2, head_dim=16, ffn=128, layers=4, tied=0)
    model = spec.bind(dims, spec.synthesize_params(dims))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ucl.compile(model, UNIVERSAL, Mesh(pp=8))
        ucl.compile(model, UNIVERSAL, Mesh(pp=8))  # lowering is cached: no second warning
    fit = [w for w in caught if issubclass(w.category, MeshFitWarning)]
    assert len(fit) == 1, [str(w.message) for w in fit]
    assert "stages 1, 2, 3, 4, 5, 6, 7" in str(fit[0].message) and "llama.ucl:" in str(fit[0].message)


def test_tp_larger_than_kv_heads_with_shared_warns_and_moves_data_right():
    text = ("dims kv, hd\nmesh tp\n"
            "k [kv * hd, 2] : view 0 as [kv, hd]; split 0.0 over tp shared\n")
    model = ucl.load_spec(text).bind({"kv": 2, "hd": 3}, {"k": (6, 2)})
    value = np.arange(12, dtype=np.float32).reshape(6, 2)
    with pytest.warns(MeshFitWarning, match=r"tp=8 is more than kv=2 \(dim 0\.0\) of k"):
        shards = ucl.execute_memory(ucl.compile(model, UNIVERSAL, Mesh(tp=8)), {0: {"param/k": value}})
    for r in range(8):  # rank r holds head r // 4
        head = r // 4
        assert shards[r]["param/k"].tolist() == value[3 * head:3 * head + 3].tolist()


def test_a_mesh_that_fits_warns_nothing():
    model = llama_model()
    no_fit_warnings(lambda: ucl.compile(model, UNIVERSAL, Mesh(pp=2, dp=2, tp=2)))


def test_the_warning_class_is_a_user_warning():
    assert issubclass(MeshFitWarning, UserWarning)
