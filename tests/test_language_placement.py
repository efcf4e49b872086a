"""Language additions: `index ... keep` (global layer names on every pipeline stage), `optional`
rules and synthesize_params, and syntax-error recovery (every bad statement reported once).

Expected values come from hand-written arithmetic or from tests/oracle.py (which imports nothing
from ucl), never from ucl itself; data movement is compared bit for bit.
"""
from __future__ import annotations

import numpy as np
import pytest

import oracle as O
import ucl
from ucl import Mesh, UNIVERSAL

# =================================================================================================
# index ... keep
# =================================================================================================
KEEP_SPEC = """\
dims layers, h
mesh pp, tp
layers.{i}.** : index i of layers over pp KEEP
embed.weight [h, h] : split 0 over tp; on pp = first
layers.{i}.attn.weight [h, h] : split 0 over tp
layers.{i}.norm.weight [h] : replicate
head.weight [h, h] : split 1 over tp; on pp = last
state exp_avg : follow
"""
LAYERS, H = 4, 4


def keep_params(layers=LAYERS, h=H):
    p = {"embed.weight": (h, h)}
    for i in range(layers):
        p[f"layers.{i}.attn.weight"] = (h, h)
        p[f"layers.{i}.norm.weight"] = (h,)
    p["head.weight"] = (h, h)
    return p


def keep_model(keep=True, options=""):
    text = KEEP_SPEC.replace("KEEP", ("keep " if keep else "") + options)
    return ucl.load_spec(text).bind({"layers": LAYERS, "h": H}, keep_params())


def truth_of(model, seed=0):
    """Distinct float32 values for every (kind, parameter)."""
    rng = np.random.default_rng(seed)
    out, start = {}, 1
    for t in model.tensors:
        n = int(np.prod(t.shape, dtype=np.int64))
        out[t.key] = (rng.permutation(n) + start).astype(np.float32).reshape(t.shape)
        start += n
    return out


def bits(a):
    return np.ascontiguousarray(a).view(np.uint32)


def assert_bit_equal(got: dict, want: dict, what=""):
    got = {r: d for r, d in got.items() if d}
    want = {r: d for r, d in want.items() if d}
    assert sorted(got) == sorted(want), what
    for r in want:
        assert sorted(got[r]) == sorted(want[r]), (what, r, sorted(got[r]), sorted(want[r]))
        for k in want[r]:
            assert got[r][k].shape == want[r][k].shape, (what, r, k)
            assert np.array_equal(bits(got[r][k]), bits(want[r][k])), (what, r, k)


def test_keep_parses_and_round_trips_through_the_checker():
    spec = ucl.load_spec(KEEP_SPEC.replace("KEEP", "keep virtual 2"))
    (index,) = spec.checked.placements[0].transforms
    assert index.keep is True and index.virtual is not None
    assert ucl.load_spec(KEEP_SPEC.replace("KEEP", "")).checked.placements[0].transforms[0].keep is False


def test_keep_scatter_to_pp2_stores_global_names_with_global_values():
    model = keep_model()
    truth = truth_of(model)
    shards = ucl.execute_memory(ucl.compile(model, UNIVERSAL, Mesh(pp=2)), {0: truth})
    # Written out by hand: 4 layers over 2 stages, blocks of 2; names stay global.
    want_layers = {0: [0, 1], 1: [2, 3]}
    for stage in (0, 1):
        keys = set(shards[stage])
        expected = {f"{kind}/layers.{i}.{w}" for i in want_layers[stage] for kind in ("param", "exp_avg")
                    for w in ("attn.weight", "norm.weight")}
        expected |= {f"{kind}/{'embed' if stage == 0 else 'head'}.weight" for kind in ("param", "exp_avg")}
        assert keys == expected
        for key in keys:
            assert np.array_equal(bits(shards[stage][key]), bits(truth[key])), key  # whole: tp=1


def test_keep_with_tp_keeps_names_and_splits_values():
    model = keep_model()
    truth = truth_of(model)
    shards = ucl.execute_memory(ucl.compile(model, UNIVERSAL, Mesh(pp=2, tp=2)), {0: truth})
    # rank = pp * 2 + tp; layers.3 lives on stage 1 (ranks 2, 3) under its own name
    for tp in (0, 1):
        got = shards[2 + tp]["param/layers.3.attn.weight"]
        assert np.array_equal(bits(got), bits(truth["param/layers.3.attn.weight"][2 * tp:2 * tp + 2]))
        assert "param/layers.1.attn.weight" not in shards[2 + tp]


def test_keep_pp2_to_pp4_and_back_is_bit_exact_and_matches_renumbered_layout():
    keep, local = keep_model(keep=True), keep_model(keep=False)
    truth = truth_of(keep)
    assert truth.keys() == truth_of(local).keys()
    pp2 = ucl.execute_memory(ucl.compile(keep, UNIVERSAL, Mesh(pp=2, tp=2)), {0: truth})
    pp4 = ucl.execute_memory(ucl.compile(keep, Mesh(pp=2, tp=2), Mesh(pp=4)), pp2)
    # Independently: the renumbered layout on pp=4 holds the same data under stage-local names
    # (one layer per stage: layers.s -> layers.0).
    renumbered = ucl.execute_memory(ucl.compile(local, UNIVERSAL, Mesh(pp=4)), {0: truth})

    def rename(key: str, stage: int) -> str:
        return key.replace(f"layers.{stage}.", "layers.0.")

    assert_bit_equal({r: {rename(k, r): v for k, v in d.items()} for r, d in pp4.items()}, renumbered, "keep vs local")
    back = ucl.execute_memory(ucl.compile(keep, Mesh(pp=4), UNIVERSAL), pp4)
    assert_bit_equal(back, {0: truth}, "round trip")


@pytest.mark.parametrize("options, mesh", [
    ({}, [("pp", 2)]),
    ({}, [("pp", 4), ("tp", 2)]),
    ({"virtual": 2}, [("pp", 2)]),
    ({"first": 2}, [("pp", 3)]),
    ({"first": 1, "last": 1}, [("pp", 3), ("tp", 2)]),
    ({"sizes": (3, 1)}, [("pp", 2)]),
], ids=str)
def test_keep_agrees_with_the_oracle(options, mesh):
    """tests/oracle.py knows `keep` too; the ucl lowering must agree with it bit for bit, with and
    without `keep`, and scatter + gather must give the global tensors back."""
    for keep in (True, False):
        L = O.Layout(list(keep_params().items()),
                     [O.Rule("layers.{i}.**", [O.Index("i", LAYERS, "pp", keep=keep, **options)]),
                      O.Rule("embed.weight", [O.Split((0,), ("tp",)), O.On("pp", ("first",))], ["h", "h"]),
                      O.Rule("layers.{i}.attn.weight", [O.Split((0,), ("tp",))], ["h", "h"]),
                      O.Rule("layers.{i}.norm.weight", [O.Replicate()], ["h"]),
                      O.Rule("head.weight", [O.Split((1,), ("tp",)), O.On("pp", ("last",))], ["h", "h"])],
                     [O.State(("exp_avg",), "follow")], ("pp", "tp"), {"h": H})
        assert (" keep" in L.render()) == keep
        model = ucl.load_spec(L.render()).bind({"h": H}, list(L.params))
        values = truth_of(model, seed=3)
        want = L.shards(mesh, values)
        got = ucl.execute_memory(ucl.compile(model, UNIVERSAL, Mesh(mesh)), {0: values})
        assert_bit_equal(got, want, f"{options} keep={keep}")
        if keep:  # every local name is a global one
            assert all(k.split("/", 1)[1] in dict(L.params) for d in got.values() for k in d)
        back = ucl.execute_memory(ucl.compile(model, Mesh(mesh), UNIVERSAL), got)
        assert_bit_equal(back, {0: values}, "back")


def test_keep_stage_placement_equals_renumbered_placement():
    """With virtual stages the stage of each layer is the same with and without `keep`."""
    for keep in (True, False):
        model = keep_model(keep=keep, options="virtual 2")
        plan = ucl.compile(model, UNIVERSAL, Mesh(pp=2))
        shards = ucl.execute_memory(plan, {0: truth_of(model)})
        stage_of = {}
        for r, d in shards.items():
            for k in d:
                if k.startswith("param/layers.") and k.endswith("norm.weight"):
                    stage_of.setdefault(r, []).append(int(k.split(".")[1]))
        if keep:  # chunks of 1 layer: chunk q on stage q % 2
            assert {r: sorted(v) for r, v in stage_of.items()} == {0: [0, 2], 1: [1, 3]}
        else:  # local names 0, 1 (chunk_on_rank * 1 + 0)
            assert {r: sorted(v) for r, v in stage_of.items()} == {0: [0, 1], 1: [0, 1]}


# =================================================================================================
# optional rules and synthesize_params
# =================================================================================================
LLAMA_DIMS = dict(vocab=99, hidden=64, heads=4, kv_heads=2, head_dim=16, ffn=128, layers=4, tied=0)


def llama_expected_by_hand(d=LLAMA_DIMS) -> dict:
    """The parameters of LlamaForCausalLM (attention_bias = mlp_bias = false, untied), in order."""
    h, hd = d["hidden"], d["head_dim"]
    out = {"model.embed_tokens.weight": (d["vocab"], h)}
    for i in range(d["layers"]):
        p = f"model.layers.{i}."
        out[p + "self_attn.q_proj.weight"] = (d["heads"] * hd, h)
        out[p + "self_attn.k_proj.weight"] = (d["kv_heads"] * hd, h)
        out[p + "self_attn.v_proj.weight"] = (d["kv_heads"] * hd, h)
        out[p + "self_attn.o_proj.weight"] = (h, d["heads"] * hd)
        out[p + "mlp.gate_proj.weight"] = (d["ffn"], h)
        out[p + "mlp.up_proj.weight"] = (d["ffn"], h)
        out[p + "mlp.down_proj.weight"] = (h, d["ffn"])
        out[p + "input_layernorm.weight"] = (h,)
        out[p + "post_attention_layernorm.weight"] = (h,)
    out["model.norm.weight"] = (h,)
    if not d["tied"]:
        out["lm_head.weight"] = (d["vocab"], h)
    return out


def test_llama_synthesizes_exactly_the_39_parameters_of_a_real_model():
    spec = ucl.load_spec("stdlib:llama")
    got = spec.synthesize_params(LLAMA_DIMS)
    want = llama_expected_by_hand()
    assert len(want) == 39
    assert list(got.items()) == list(want.items())  # names, shapes and model order


def test_llama_synthesis_agrees_with_transformers_on_the_meta_device():
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    d = LLAMA_DIMS
    config = transformers.LlamaConfig(vocab_size=d["vocab"], hidden_size=d["hidden"], num_attention_heads=d["heads"],
                                      num_key_value_heads=d["kv_heads"], head_dim=d["head_dim"],
                                      intermediate_size=d["ffn"], num_hidden_layers=d["layers"],
                                      tie_word_embeddings=False)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    real = {n: tuple(p.shape) for n, p in model.named_parameters()}
    spec = ucl.load_spec("stdlib:llama")
    assert spec.synthesize_params(spec.dims_from_config(config.to_dict())) == real
    assert len(real) == 39


def test_optional_if_tied_leaves_out_the_head_only_when_tied():
    spec = ucl.load_spec("stdlib:llama")
    tied = spec.synthesize_params({**LLAMA_DIMS, "tied": 1})
    assert list(tied.items()) == list(llama_expected_by_hand({**LLAMA_DIMS, "tied": 1}).items())
    assert "lm_head.weight" not in tied and len(tied) == 38


def test_optional_rules_still_bind_and_lay_out_their_parameters():
    spec = ucl.load_spec("stdlib:llama")
    params = dict(llama_expected_by_hand())
    params["model.layers.0.self_attn.q_proj.bias"] = (64,)  # attention_bias = true on one layer
    model = spec.bind(LLAMA_DIMS, params)
    bias = np.arange(64, dtype=np.float32)
    values = {t.key: np.zeros(t.shape, np.float32) for t in model.tensors}
    values["param/model.layers.0.self_attn.q_proj.bias"] = bias
    shards = ucl.execute_memory(ucl.compile(model, UNIVERSAL, Mesh(tp=2)), {0: values})
    assert np.array_equal(shards[1]["param/model.layers.0.self_attn.q_proj.bias"], bias[32:])


def test_optional_condition_and_a_plain_optional():
    text = ("dims h, flag\nmesh tp\nlet off = 1 - flag\n"
            "a [h] : split 0 over tp\nb [h] : optional\nc [h] : optional if flag\nd [h] : optional if off\n")
    spec = ucl.load_spec(text)
    assert list(spec.synthesize_params({"h": 2, "flag": 1})) == ["a", "d"]
    assert list(spec.synthesize_params({"h": 2, "flag": 0})) == ["a", "c"]


@pytest.mark.parametrize("text, code, where", [
    ("mesh pp\nl.{i}.** : index i of 4 over pp; optional\nl.{i}.w : replicate\n", "UCL110", (2, 34)),
    ("dims h\nmesh tp\nw [h] : optional if tp\n", "UCL106", (3, 21)),
    ("dims h\nmesh tp\nw [h] : optional; optional\n", "UCL110", (3, 19)),
    ("dims h\nmesh tp\nw [h] : optional if hh\n", "UCL101", (3, 21)),
])
def test_optional_misuse_is_reported_at_its_place(text, code, where):
    with pytest.raises(ucl.SpecError) as info:
        ucl.Spec.from_text(text, "m.ucl")
    d = next(d for d in info.value.diagnostics if d.code == code)
    assert (d.span.line, d.span.col) == where, str(info.value)


def test_globbed_rules_give_one_grouped_ucl212_with_the_fix():
    text = ("dims h, layers\nmesh pp, tp\n"
            "layers.{i}.** : index i of layers over pp\n"
            "layers.{i}.*_norm.weight [h] : replicate\n"
            "layers.{i}.attn.weight [h, h] : split 0 over tp\n"
            "layers.{i}.mlp.*.weight [h, h] : split 0 over tp\n"
            "final.* [h] : replicate\n")
    spec = ucl.Spec.from_text(text, "glob.ucl")
    with pytest.raises(ucl.SpecError) as info:
        spec.synthesize_params({"h": 4, "layers": 2})
    err = info.value
    assert [d.code for d in err.diagnostics] == ["UCL212"]
    d = err.diagnostics[0]
    for rule in ("layers.{i}.*_norm.weight", "layers.{i}.mlp.*.weight", "final.*"):
        assert rule in d.message
    assert "attn.weight" not in d.message
    assert "--params MODEL" in d.hint and "spec.bind(dims, params)" in d.hint
    assert (d.span.line, d.span.col) == (4, 1)
    assert "glob.ucl:4:1: error[UCL212]" in str(err) and "1 error in glob.ucl" in str(err)
    # an optional globbed rule is not in the way
    ok = ucl.load_spec(text.replace("*_norm.weight [h] : ", "*_norm.weight [h] : optional; ")
                       .replace("mlp.*.weight [h, h] : ", "mlp.*.weight [h, h] : optional; ")
                       .replace("final.* [h] : ", "final.* [h] : optional; "))
    assert list(ok.synthesize_params({"h": 4, "layers": 2})) == ["layers.0.attn.weight", "layers.1.attn.weight"]


def test_every_stdlib_spec_still_loads_and_marks_no_core_weight_optional():
    from ucl.lang import stdlib_names
    for name in stdlib_names():
        spec = ucl.load_spec(f"stdlib:{name}")
        for rule in spec.checked.rules:
            optional = any(type(t).__name__ == "OptionalMark" for t in rule.transforms)
            text = rule.pattern.text
            if (name, text) == ("deepseek_v3", "model.layers.{i}.self_attn.q_proj.weight"):
                assert optional  # MLA: q_proj exists only without q LoRA (q_lora_rank null), else q_a/q_b_proj
                continue
            if any(core in text for core in ("q_proj.weight", "embed_tokens.weight", "input_layernorm.weight",
                                             "word_embeddings.weight", "wte.weight", "model.norm.weight")):
                assert not optional, (name, text)


# =================================================================================================
# syntax errors: every bad statement once
# =================================================================================================
def syntax_error(text):
    with pytest.raises(ucl.SpecError) as info:
        ucl.Spec.from_text(text, "s.ucl")
    return info.value


def test_two_syntax_errors_on_continuation_lines_are_two_diagnostics_without_cascades():
    text = ("dims a\nmesh tp\n"
            "w [a]\n    : split 0\n    ovr tp\n"          # statement 3-5: error on its 3rd line
            "v [a] : replicate\n"                          # fine
            "u [a]\n    : view 0 as [2, a / 2\n"           # unclosed bracket at the end of line 8
            "x [a] : split 0 over tp\n")                   # fine
    err = syntax_error(text)
    assert [(d.code, d.span.line, d.span.col) for d in err.diagnostics] == [("UCL002", 5, 5), ("UCL002", 8, 26)]
    rendered = str(err)
    assert "s.ucl:5:5: error[UCL002]" in rendered and "s.ucl:8:26: error[UCL002]" in rendered
    lines = rendered.splitlines()
    i = lines.index(next(l for l in lines if l.startswith("s.ucl:8:26")))
    assert lines[i + 1] == "        : view 0 as [2, a / 2" and lines[i + 2].index("^") == 4 + 25
    assert "2 errors in s.ucl" in rendered


def test_syntax_errors_of_every_kind_are_all_reported_in_order():
    text = ("dims a\nmesh tp\n"
            "w [a] : split 0 over tp $ q\n"       # unexpected character
            "v [a] : replicat\n"                   # unknown transform
            "let = 3\n"                            # missing name
            "u [a] : split 0 over\n"               # ends early
            "x [a] : split 0 over tp\n")
    err = syntax_error(text)
    assert [(d.code, d.span.line) for d in err.diagnostics] == [
        ("UCL001", 3), ("UCL002", 4), ("UCL002", 5), ("UCL002", 6)]
    assert err.diagnostics[1].hint == "did you mean replicate?"


def test_expected_tokens_are_exactly_what_the_parser_accepts():
    err = syntax_error("dims a\nmesh tp\nw [a] : split 0 over tp\n  ovr x\n")
    msg = err.diagnostics[0].message
    assert "uneven or shared" in msg and "';'" in msg
    for wrong in ("align", "bucket", "per_param"):  # flat options are not valid after a split
        assert wrong not in msg


def test_a_valid_spec_after_many_errors_still_parses_the_rest():
    bad = "".join(f"w{i} [a] : splitt 0 over tp\n" for i in range(5))
    err = syntax_error("dims a\nmesh tp\n" + bad + "ok [a] : replicate\n")
    assert [d.span.line for d in err.diagnostics] == [3, 4, 5, 6, 7]


@pytest.mark.parametrize("newline", ["\n", "\r\n"])
def test_recovery_with_either_newline(newline):
    text = newline.join(["dims a", "mesh tp", "w [a] : split 0 ovr tp", "    ; replicate", "v [a] : replicat", ""])
    err = syntax_error(text)
    assert [(d.span.line, d.span.col) for d in err.diagnostics] == [(3, 17), (5, 9)]


def test_check_transforms_is_split_into_named_steps():
    from ucl.lang import check
    import inspect
    source = inspect.getsource(check._Checker.check_transforms)
    assert len(source.splitlines()) < 20
    for step in ("transform_Split", "transform_View", "transform_Pad", "transform_Index", "transform_Place",
                 "check_axes_split_once", "check_replicated_axes", "check_factor_split_order"):
        assert hasattr(check._Checker, step), step


def test_keywords_stay_usable_as_names():
    spec = ucl.load_spec("dims keep, optional\nmesh tp\nkeep.weight [keep] : replicate\n"
                         "optional.if.weight [optional] : split 0 over tp\n")
    assert [r.pattern.text for r in spec.checked.rules] == ["keep.weight", "optional.if.weight"]


def test_all_index_options_combine_with_keep():
    for options in ("keep virtual 2", "virtual 2 keep", "first 1 keep", "keep last 1", "sizes [1, 3] keep"):
        spec = ucl.load_spec(f"mesh pp\nl.{{i}}.** : index i of 4 over pp {options}\nl.{{i}}.w : replicate\n")
        model = spec.bind({}, {f"l.{i}.w": (1,) for i in range(4)})
        shards = ucl.execute_memory(ucl.compile(model, UNIVERSAL, Mesh(pp=2)),
                                    {0: {f"param/l.{i}.w": np.array([i], np.float32) for i in range(4)}})
        for r, d in shards.items():
            for k, v in d.items():
                assert int(k.split(".")[1]) == int(v[0]), (options, r, k)  # the name is the global index

