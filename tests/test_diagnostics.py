"""Diagnostics: every user mistake is a UclError with a stable code that points at the culprit.

Spec problems render as ``file:line:col: error[UCLnnn]: message``, then the source line, a caret
under the culprit and a hint where one can be guessed. We assert on codes, spans, parameter names
and key substrings -- never on the full wording.
"""
from __future__ import annotations

import re

import pytest

import ucl
from ucl import Mesh, UNIVERSAL


# ---- helpers ------------------------------------------------------------------------------------
def spec_error(text: str, filename: str = "model.ucl") -> ucl.SpecError:
    with pytest.raises(ucl.SpecError) as info:
        ucl.Spec.from_text(text, filename)
    return info.value


def bind_error(text: str, dims: dict, params: dict, *, mesh: Mesh | None = None, frozen=(),
               filename: str = "model.ucl") -> ucl.BindError:
    spec = ucl.Spec.from_text(text, filename)
    with pytest.raises(ucl.BindError) as info:
        model = spec.bind(dims=dims, params=params, frozen=frozen)
        if mesh is not None:
            ucl.compile(model, UNIVERSAL, mesh)
    return info.value


def assert_points_at(err: ucl.UclError, filename: str, line: int, col: int, code: str, width: int | None = None):
    """The rendering has ``file:line:col: error[code]``, the source line and a caret at ``col``."""
    text = str(err)
    lines = text.splitlines()
    head = f"{filename}:{line}:{col}: error[{code}]: "
    hits = [i for i, l in enumerate(lines) if l.startswith(head)]
    assert hits, f"no line starting with {head!r} in:\n{text}"
    i = hits[0]
    source_line = err.source.splitlines()[line - 1]
    assert lines[i + 1] == "    " + source_line.expandtabs(1), text
    caret = lines[i + 2]
    assert set(caret.strip()) == {"^"}, text
    assert caret.index("^") == 4 + col - 1, f"caret at the wrong column:\n{text}"
    if width is not None:
        assert caret.count("^") == width, text


def diag(err, code):
    found = [d for d in err.diagnostics if d.code == code]
    assert found, f"no {code} in {[d.code for d in err.diagnostics]}:\n{err}"
    return found[0]


def assert_friendly(err: ucl.UclError):
    """No raw parser-library text leaks into what users read."""
    text = str(err)
    for raw in ("Token(", "Unexpected token", "UnexpectedCharacters", "UnexpectedToken", "lark", "Traceback",
                "Expected one of", "__ANON", "_NL", "$END"):
        assert raw not in text, f"{raw!r} leaks into:\n{text}"


# =================================================================================================
# Syntax errors
# =================================================================================================
def test_syntax_unexpected_token_points_at_it_with_a_hint():
    err = spec_error("dims a\nmesh tp\nw [a] : split 0 ovr tp\n")
    assert err.code == "UCL002" and len(err.diagnostics) == 1
    d = err.diagnostics[0]
    assert (d.span.line, d.span.col) == (3, 17)
    assert "'ovr'" in d.message and "over" in d.message  # what it found, what it expected
    assert d.hint and "over" in d.hint
    assert_points_at(err, "model.ucl", 3, 17, "UCL002", width=3)
    assert "hint: did you mean over?" in str(err)
    assert str(err).rstrip().endswith("1 error in model.ucl")
    assert_friendly(err)


def test_syntax_unexpected_character():
    err = spec_error("dims a\nmesh tp\nw [a] : split 0 over tp $\n")
    assert err.code == "UCL001"
    d = err.diagnostics[0]
    assert (d.span.line, d.span.col) == (3, 25) and "'$'" in d.message
    assert_points_at(err, "model.ucl", 3, 25, "UCL001", width=1)
    assert_friendly(err)


@pytest.mark.parametrize("text, line, col", [
    ("dims a\nmesh tp\nw [a] : split 0 over", 3, 21),           # file ends mid-statement, no newline
    ("dims a\nmesh tp\nw [a] : split 0 over\n", 3, 21),         # line ends mid-statement
    ("dims a\nmesh tp\nw [a] : view 0 as [2, a / 2\n", 3, 28),  # unclosed bracket
    ("dims a\nlet x = (a + 1\n", 2, 15),                        # unclosed parenthesis
    ("dims a\nmesh tp\nw [a] :\n", 3, 8),                       # no transform after ':'
])
def test_syntax_unterminated_statement(text, line, col):
    err = spec_error(text)
    assert err.code in ("UCL002", "UCL003")
    d = err.diagnostics[0]
    assert (d.span.line, d.span.col) == (line, col), str(err)
    assert re.search(r"end of (line|file)|ends in the middle", d.message), d.message
    assert "expected" in (d.message + (d.hint or "")), str(err)
    assert_points_at(err, "model.ucl", line, col, err.code)
    assert_friendly(err)


def test_syntax_error_on_a_continuation_line_names_that_line():
    err = spec_error("dims a\nmesh tp\nw [a]\n    : split 0\n    ovr tp\n")
    assert err.code == "UCL002"
    assert (err.diagnostics[0].span.line, err.diagnostics[0].span.col) == (5, 5)
    assert_points_at(err, "model.ucl", 5, 5, "UCL002", width=3)


def test_several_syntax_errors_reported_at_once():
    err = spec_error("dims a\nmesh tp\nw [a] : split 0 ovr tp\nv [a] : replicat\nu [a] : split 0 over tp\n")
    assert [d.code for d in err.diagnostics] == ["UCL002", "UCL002"]
    assert [(d.span.line, d.span.col) for d in err.diagnostics] == [(3, 17), (4, 9)]
    assert err.diagnostics[1].hint and "replicate" in err.diagnostics[1].hint
    assert_points_at(err, "model.ucl", 3, 17, "UCL002")
    assert_points_at(err, "model.ucl", 4, 9, "UCL002", width=8)
    assert "2 errors in model.ucl" in str(err)
    assert_friendly(err)


def test_several_check_errors_reported_at_once():
    err = spec_error("dims hidden\nmesh dp, tp\nw [hiden] : split 0 over tp\nv [hidden] : split 0 over tpp\n"
                     "u [hidden] : split 0 over dp; replicate over dp\n")
    assert [d.code for d in err.diagnostics] == ["UCL101", "UCL103", "UCL109"]
    assert [d.span.line for d in err.diagnostics] == [3, 4, 5]
    assert "3 errors in model.ucl" in str(err)


@pytest.mark.parametrize("text", [
    "dims", "mesh", ":", "state : flat", "dims a\nmesh tp\nw [a] : split 0 over (tp",
    "dims a\nmesh tp\nw [a : split 0 over tp\n", "w [a] : split 0 over tp; ;", "dims a,\n", "let = 3",
    "dims a\nw [a] : split 0 over tp\x00\n", "mesh tp\nw : split 0.x. over tp\n", "w [1 +] : replicate",
    "dims a\n    mesh tp\n", "state exp_avg : flat over dp pad to 4\n", "mesh tp\nw : index of 4 over tp\n",
])
def test_malformed_specs_raise_friendly_spec_errors(text):
    err = spec_error(text)
    assert err.diagnostics and all(re.fullmatch(r"UCL\d{3}", d.code) for d in err.diagnostics)
    assert all(d.span is not None for d in err.diagnostics)
    assert re.match(r"model\.ucl:\d+:\d+: error\[UCL\d{3}\]: ", str(err))
    assert_friendly(err)


def test_spec_file_errors_name_the_file(tmp_path):
    path = tmp_path / "llama.ucl"
    path.write_text("dims a\nmesh tp\nw [a] : split 0 over tq\n")
    with pytest.raises(ucl.SpecError) as info:
        ucl.load_spec(path)
    assert str(info.value).startswith(f"{path}:3:22: error[UCL103]")
    assert_points_at(info.value, str(path), 3, 22, "UCL103", width=2)


# =================================================================================================
# Static checks
# =================================================================================================
def test_unknown_dim_in_expression_did_you_mean():
    err = spec_error("dims hidden, heads\nmesh tp\nw [hiden * 2] : split 0 over tp\n")
    d = diag(err, "UCL101")
    assert "'hiden'" in d.message and d.hint == "did you mean hidden?"
    assert_points_at(err, "model.ucl", 3, 4, "UCL101", width=5)


def test_unknown_mesh_axis_did_you_mean():
    err = spec_error("dims a\nmesh pp, dp, tp\nw [a] : split 0 over tpp\n")
    d = diag(err, "UCL103")
    assert "'tpp'" in d.message and d.hint == "did you mean tp?"
    assert_points_at(err, "model.ucl", 3, 22, "UCL103", width=3)
    # also in a flat state and in placements
    err = spec_error("dims a\nmesh pp, dp, tp\nw [a] : on ppp = first\nstate e : flat over dpx\n")
    assert [(d.code, d.span.line, d.hint) for d in err.diagnostics] == [
        ("UCL103", 3, "did you mean pp?"), ("UCL103", 4, "did you mean dp?")]


def test_unknown_two_letter_mesh_axis_did_you_mean():
    err = spec_error("dims a\nmesh pp, dp, tp\nw [a] : split 0 over tq\n")
    assert diag(err, "UCL103").hint == "did you mean tp?"


def test_mesh_axis_in_a_shape_is_rejected():
    err = spec_error("dims a\nmesh tp\nw [a * tp] : replicate\n")
    d = diag(err, "UCL106")
    assert "'tp'" in d.message
    assert_points_at(err, "model.ucl", 3, 8, "UCL106", width=2)


def test_inexact_let_at_bind_time():
    text = "dims hidden, heads\nlet head_dim = hidden / heads\nmesh tp\nw [heads * head_dim] : split 0 over tp\n"
    spec = ucl.load_spec(text)  # fine statically: it depends on the dims
    assert spec.bind(dims=dict(hidden=12, heads=3), params={"w": (12,)})
    err = bind_error(text, dict(hidden=10, heads=3), {"w": (10,)})
    assert err.code == "UCL104"
    d = err.diagnostics[0]
    assert "10 / 3" in d.message and "not exact" in d.message
    assert d.hint and "//" in d.hint
    assert_points_at(err, "model.ucl", 2, 16, "UCL104", width=len("hidden / heads"))


def test_inexact_let_does_not_cascade_into_unknown_names():
    err = bind_error("dims hidden, heads\nlet head_dim = hidden / heads\nmesh tp\nw [head_dim] : replicate\n",
                     dict(hidden=10, heads=3), {"w": (3,)})
    assert [d.code for d in err.diagnostics] == ["UCL104"], str(err)


def test_inexact_let_using_a_mesh_axis_fails_at_compile():
    text = "dims heads\nmesh tp\nlet per = heads / tp\nw [heads] : view 0 as [tp, per]; split 0.0 over tp\n"
    err = bind_error(text, dict(heads=6), {"w": (6,)}, mesh=Mesh(tp=4))
    assert err.code == "UCL104" and "6 / 4" in err.diagnostics[0].message
    assert_points_at(err, "model.ucl", 3, 11, "UCL104")


def test_unknown_capture_in_index():
    err = spec_error("dims layers\nmesh pp\nlayers.{i}.** : index j of layers over pp\n")
    d = diag(err, "UCL112")
    assert "{j}" in d.message and "i" in (d.hint or "")
    assert_points_at(err, "model.ucl", 3, 23, "UCL112", width=1)


@pytest.mark.parametrize("rule, ref, what", [
    ("w [a] : view 0 as [2, a / 2]; split 0.2 over tp", "0.2", "2 factors"),  # factor 2 of a 2-factor view
    ("w [a] : split 0.1 over tp", "0.1", "no view or concat"),                 # no view at all
    ("w [a] : concat 0 as [q = 2, k = a - 2]; split 0.kk over tp", "0.kk", "'kk'"),
    ("w [a] : split 1 over tp", "1 over", "dim 1"),                            # beyond the declared shape
])
def test_dim_ref_to_a_missing_view_factor_or_part(rule, ref, what):
    err = spec_error(f"dims a\nmesh tp\n{rule}\n")
    d = diag(err, "UCL108")
    assert what in d.message, d.message
    width = len(ref.split()[0])
    assert_points_at(err, "model.ucl", 3, rule.index(ref) + 1, "UCL108", width=width)
    if "'kk'" in what:
        assert d.hint == "did you mean k?"


@pytest.mark.parametrize("rule, col", [
    ("w [a] : split 0 over tp; replicate over tp", 41),
    ("w [a] : replicate over tp; split 0 over tp", 24),
    ("w [a, a] : split 1 over dp; replicate over (tp, dp)", 49),
])
def test_conflicting_split_and_replicate_of_one_axis(rule, col):
    err = spec_error(f"dims a\nmesh dp, tp\n{rule}\n")
    d = diag(err, "UCL109")
    assert "splits and replicates" in d.message
    axis = rule[col - 1:col + 1]
    assert f"'{axis}'" in d.message
    assert_points_at(err, "model.ucl", 3, col, "UCL109", width=2)


def test_unknown_dtype_and_function_hints():
    err = spec_error("dims a\nlet b = ceildiv(a, 2)\nmesh tp\nw [a] : replicate\nstate exp_avg : dtype bfloat\n")
    assert [d.code for d in err.diagnostics] == ["UCL107", "UCL111"]
    assert "ceil_div" in err.diagnostics[0].hint and err.diagnostics[1].hint == "did you mean bfloat16?"


# =================================================================================================
# Spec vs model (bind)
# =================================================================================================
SPEC = """dims h
mesh dp, tp
layers.{i}.w [h] : replicate
embed.weight [h, h] : split 0 over tp
"""


def test_unmatched_parameter_is_named():
    err = bind_error(SPEC, {"h": 4}, {"layers.0.w": (4,), "embed.weight": (4, 4), "lm_head.weight": (4, 4)})
    assert err.code == "UCL201"
    d = diag(err, "UCL201")
    assert "'lm_head.weight'" in d.message
    assert "lm_head.weight" in str(err) and "error[UCL201]" in str(err)


def test_several_unmatched_parameters_reported_at_once():
    err = bind_error(SPEC, {"h": 4}, {"layers.0.w": (4,), "embed.weight": (4, 4), "a.b": (1,), "c.d": (2,)})
    assert [d.code for d in err.diagnostics] == ["UCL201", "UCL201"]
    assert "'a.b'" in err.diagnostics[0].message and "'c.d'" in err.diagnostics[1].message


def test_doubly_matched_parameter_names_both_rules():
    err = bind_error(SPEC + "layers.**.w [h] : replicate\n", {"h": 4}, {"layers.0.w": (4,), "embed.weight": (4, 4)})
    d = diag(err, "UCL202")
    assert "'layers.0.w'" in d.message
    assert "layers.{i}.w" in d.message and "layers.**.w" in d.message
    assert "line 3" in d.message and "line 5" in d.message
    assert_points_at(err, "model.ucl", 5, 1, "UCL202")


def test_declared_shape_mismatch_names_param_real_and_declared():
    err = bind_error(SPEC, {"h": 4}, {"layers.0.w": (5,), "embed.weight": (4, 4)})
    d = diag(err, "UCL203")
    assert "'layers.0.w'" in d.message and "[5]" in d.message and "4" in d.message
    assert_points_at(err, "model.ucl", 3, 15, "UCL203", width=1)
    err = bind_error(SPEC, {"h": 4}, {"layers.0.w": (4, 1), "embed.weight": (4, 4)})  # wrong rank
    d = diag(err, "UCL203")
    assert "'layers.0.w'" in d.message and "[4, 1]" in d.message


def test_dims_missing_or_unknown_at_bind():
    err = bind_error(SPEC, {}, {"layers.0.w": (4,), "embed.weight": (4, 4)})
    assert err.code == "UCL209" and "h" in err.diagnostics[0].message
    err = bind_error(SPEC, {"h": 4, "hh": 3}, {"layers.0.w": (4,), "embed.weight": (4, 4)})
    assert err.code == "UCL209" and "'hh'" in err.diagnostics[0].message


def test_frozen_name_that_is_not_a_parameter():
    err = bind_error(SPEC, {"h": 4}, {"layers.0.w": (4,), "embed.weight": (4, 4)}, frozen=["embed.wieght"])
    assert err.code == "UCL201" and "'embed.wieght'" in err.diagnostics[0].message


def test_split_not_divisible_by_mesh_names_param_shape_mesh_and_uneven():
    err = bind_error(SPEC, {"h": 6}, {"layers.0.w": (6,), "embed.weight": (6, 6)}, mesh=Mesh(dp=2, tp=4))
    assert err.code == "UCL204"
    d = diag(err, "UCL204")
    assert "embed.weight" in d.message and "[6, 6]" in d.message and "tp=4" in d.message
    assert d.hint and "uneven" in d.hint
    # points at the rule's line (the split itself, or the rule)
    assert d.span.line == 4 and d.span.col in (1, SPEC.splitlines()[3].index("split") + 1)
    assert_points_at(err, "model.ucl", 4, d.span.col, "UCL204")
    assert "uneven" in str(err)


def test_flat_buffer_not_divisible_without_pad():
    text = SPEC + "state exp_avg : flat over dp\n"
    err = bind_error(text, {"h": 3}, {"layers.0.w": (3,), "embed.weight": (3, 3)}, mesh=Mesh(dp=5))
    d = diag(err, "UCL210")
    assert "12" in d.message and "dp=5" in d.message
    assert d.hint and "pad to multiple_of(dp)" in d.hint
    assert_points_at(err, "model.ucl", 5, 17, "UCL210")
    # the hinted fix works
    spec = ucl.load_spec(text.replace("flat over dp", "flat over dp pad to multiple_of(dp)"))
    ucl.compile(spec.bind(dims={"h": 3}, params={"layers.0.w": (3,), "embed.weight": (3, 3)}), UNIVERSAL, Mesh(dp=5))


def test_flattened_over_an_axis_it_is_split_over():
    text = "dims h\nmesh dp\nw [h] : split 0 over dp\nstate exp_avg : flat over dp\n"
    err = bind_error(text, {"h": 4}, {"w": (4,)}, mesh=Mesh(dp=2))
    d = diag(err, "UCL210")
    assert "w" in d.message and "dp" in d.message


# =================================================================================================
# Meshes
# =================================================================================================
def test_unknown_mesh_axis_in_a_mesh_passed_to_compile():
    model = ucl.load_spec(SPEC).bind(dims={"h": 4}, params={"layers.0.w": (4,), "embed.weight": (4, 4)})
    with pytest.raises(ucl.MeshError) as info:
        ucl.compile(model, UNIVERSAL, Mesh(pp=2, tp=2))
    assert info.value.code == "UCL304"
    assert "'pp'" in str(info.value) and "dp" in str(info.value) and "tp" in str(info.value)
    with pytest.raises(ucl.MeshError) as info:  # as source too, with a hint for a near miss
        ucl.compile(model, Mesh(tpp=2), UNIVERSAL)
    assert info.value.code == "UCL304" and "did you mean tp?" in str(info.value)


@pytest.mark.parametrize("text, code", [
    ("pp=2,dp=x", "UCL301"), ("pp=2,,tp=2", "UCL301"), ("pp=2,pp=2", "UCL301"),
    ("pp=0", "UCL302"), ("tp=-1", "UCL302"), ("dp=2.5", "UCL302"), ("2=pp", "UCL301"), ("pp:2", "UCL301"),
])
def test_mesh_parse_errors(text, code):
    with pytest.raises(ucl.MeshError) as info:
        Mesh.parse(text)
    assert info.value.code == code
    assert isinstance(info.value, ucl.UclError)
    if code == "UCL301" and "pp=2,pp" not in text:
        assert text in str(info.value) and "pp=2,dp=2,tp=2" in str(info.value)


@pytest.mark.parametrize("text, axis", [("tp=0", "tp=0"), ("tp=-1", "tp=-1"), ("pp=2,dp=2.5", "dp=2.5")])
def test_a_bad_mesh_size_gets_one_message_whatever_the_number(text, axis):
    """tp=-1 and dp=2.5 are read as sizes and refused as tp=0 is, not as unreadable text."""
    with pytest.raises(ucl.MeshError) as info:
        Mesh.parse(text)
    assert str(info.value) == f"mesh axis {axis}: a size must be a positive integer"


def test_an_axis_in_the_wrong_case_is_named_with_its_spelling():
    model = ucl.load_spec(SPEC).bind(dims={"h": 4}, params={"layers.0.w": (4,), "embed.weight": (4, 4)})
    with pytest.raises(ucl.MeshError) as info:
        ucl.compile(model, UNIVERSAL, Mesh.parse("TP=4"))
    assert info.value.code == "UCL304"
    assert "'TP'" in str(info.value) and "did you mean tp? (axis names are case-sensitive)" in str(info.value)


def test_mesh_parse_ok():
    assert Mesh.parse("pp=2, dp=2 ,tp=2") == Mesh(pp=2, dp=2, tp=2)
    assert Mesh.parse("universal") == UNIVERSAL


def test_bad_mesh_sizes_in_constructor():
    for bad in (dict(tp=0), dict(tp=-2), dict(tp=True), dict(tp=2.0)):
        with pytest.raises(ucl.MeshError):
            Mesh(**bad)


# =================================================================================================
# Never a raw Python exception
# =================================================================================================
def test_virtual_zero_is_a_ucl_error():
    model = ucl.load_spec("mesh pp\nl.{i}.** : index i of 4 over pp virtual 0\nl.{i}.w : replicate\n").bind(
        dims={}, params={f"l.{i}.w": (1,) for i in range(4)})
    with pytest.raises(ucl.UclError):
        ucl.compile(model, UNIVERSAL, Mesh(pp=2))


def test_flat_align_zero_is_a_ucl_error():
    model = ucl.load_spec("mesh dp\nw : replicate\nstate e : flat over dp align 0\n").bind(dims={}, params={"w": (4,)})
    with pytest.raises(ucl.UclError):
        ucl.compile(model, UNIVERSAL, Mesh(dp=2))


def test_division_by_zero_is_a_ucl_error():
    err = bind_error("dims a\nlet z = a - a\nw [a / z] : replicate\n", {"a": 4}, {"w": (4,)})
    assert "UCL105" in [d.code for d in err.diagnostics]


def test_pad_target_zero_is_a_ucl_error():
    err = bind_error("dims a\nmesh tp\nw [a] : pad 0 to multiple_of(0); split 0 over tp\n", {"a": 4}, {"w": (4,)},
                     mesh=Mesh(tp=2))
    assert err.code == "UCL205"


def test_explain_unknown_parameter():
    model = ucl.load_spec(SPEC).bind(dims={"h": 4}, params={"layers.0.w": (4,), "embed.weight": (4, 4)})
    plan = ucl.compile(model, UNIVERSAL, Mesh(tp=2))
    assert "embed.weight" in plan.explain("embed.weight")
    with pytest.raises(ucl.PlanError) as info:
        plan.explain("embed.weigth")
    assert "did you mean embed.weight?" in str(info.value)


# =================================================================================================
# Repeated problems are grouped when printed
# =================================================================================================
def test_group_diagnostics_groups_by_code_and_message_shape():
    from ucl.errors import Diagnostic, group_diagnostics, message_shape
    assert message_shape("parameter 'l.0.w' has shape [4, 2], dim 1 = 3") == \
        message_shape("parameter 'l.17.w' has shape [8], dim 0 = 12")
    diags = [Diagnostic("UCL203", f"parameter 'l.{i}.w' has shape [{i}], but the rule declares dim 0 = 3")
             for i in range(10)]
    diags.insert(2, Diagnostic("UCL201", "parameter 'x' (3,) matches no rule"))
    diags.append(diags[0])  # the very same problem twice is one problem
    groups = group_diagnostics(diags, limit=2)
    assert [len(g) for g in groups] == [10, 1]
    g = groups[0]
    assert [d.message for d in g.shown] == [diags[0].message, diags[1].message]
    assert g.more_line() == "... and 8 more like this ('l.2.w', 'l.3.w', ...)"
    assert groups[1].shown == (diags[2],) and not groups[1].more
    # a group only one longer than the limit is shown whole
    assert [len(g.shown) for g in group_diagnostics(diags[:3] + diags[4:5], limit=2)] == [3, 1]
    # a key decides what is alike (check_against also groups by rule)
    assert len(group_diagnostics(diags, limit=1, key=lambda d: d.message)) == 11


def test_bind_error_groups_repeats_but_keeps_every_diagnostic():
    params = {"layers.0.w": (4,), "embed.weight": (4, 4), **{f"extra.{i}.w": (i + 1,) for i in range(10)}}
    err = bind_error(SPEC, {"h": 4}, params)
    assert [d.code for d in err.diagnostics] == ["UCL201"] * 10  # the API keeps them all
    text = str(err)
    assert text.count("error[UCL201]") == 3
    assert "'extra.0.w'" in text and "'extra.2.w'" in text and "'extra.3.w'" not in text.split("more like")[0]
    assert "    ... and 7 more like this ('extra.3.w', 'extra.4.w', ...)" in text.splitlines()
    assert text.rstrip().endswith("10 errors in model.ucl")


def test_spec_error_groups_unknown_names_naming_their_lines():
    rules = "".join(f"w{i} [d{i}] : replicate\n" for i in range(6))
    err = spec_error("dims a\nmesh tp\n" + rules)
    assert [d.code for d in err.diagnostics] == ["UCL101"] * 6
    text = str(err)
    assert text.count("error[UCL101]") == 3
    assert "... and 3 more like this ('d3' (line 6), 'd4' (line 7), ...)" in text, text
    assert_points_at(err, "model.ucl", 3, 5, "UCL101")


# =================================================================================================
# Errors from the Python API carry no internal exception chain
# =================================================================================================
def _assert_no_chain(e: BaseException):
    import traceback
    text = "".join(traceback.format_exception(e))
    assert "During handling of the above exception" not in text and "LayoutError" not in text, text
    assert e.__cause__ is None and (e.__context__ is None or e.__suppress_context__)


def test_compile_errors_have_no_internal_exception_chain():
    model = ucl.load_spec(SPEC).bind(dims={"h": 6}, params={"layers.0.w": (6,), "embed.weight": (6, 6)})
    with pytest.raises(ucl.BindError) as info:
        ucl.compile(model, UNIVERSAL, Mesh(dp=2, tp=4))
    assert info.value.code == "UCL204"
    _assert_no_chain(info.value)


def test_save_on_a_mesh_that_does_not_fit_has_no_internal_exception_chain(tmp_path):
    model = ucl.load_spec(SPEC).bind(dims={"h": 6}, params={"layers.0.w": (6,), "embed.weight": (6, 6)})
    with pytest.raises(ucl.BindError) as info:
        ucl.save(tmp_path / "x", {r: {} for r in range(4)}, model=model, mesh=Mesh(tp=4))
    _assert_no_chain(info.value)
    assert list(tmp_path.iterdir()) == []


# =================================================================================================
# save / save_rank: tensors that do not match the spec (UCL421)
# =================================================================================================
@pytest.fixture(scope="module")
def demo_shards():
    from ucl.demo import llama_model, universal_state
    model = llama_model()
    mesh = Mesh.parse("pp=2,tp=2")
    return model, mesh, ucl.execute_memory(ucl.compile(model, UNIVERSAL, mesh), {0: universal_state(model)})


def test_weights_only_save_is_grouped_and_hints_at_frozen(demo_shards, tmp_path):
    model, mesh, shards = demo_shards
    weights = {r: {k: v for k, v in s.items() if k.startswith("param/")} for r, s in shards.items()}
    with pytest.raises(ucl.StoreError) as info:
        ucl.save(tmp_path / "w", weights, model=model, mesh=mesh)
    e = info.value
    assert e.code == "UCL421"
    text = str(e)
    lines = text.splitlines()
    assert lines[0].startswith("rank 0 of pp=2,tp=2: the tensors do not match the spec (")
    assert len(lines) < 10, text  # not one line per missing optimizer tensor
    assert "more like this ('step/" in text and "missing 'exp_avg/@flat0'" in text, text
    assert "the flat buffer of the `state` statement at <demo:llama_megatron>:" in text
    hint = next(l for l in lines if "hint:" in l)
    assert "optimizer state (exp_avg, exp_avg_sq, fp32, step)" in hint and "frozen=" in hint, text
    assert "spec.bind(dims, params, frozen=names)" in hint
    # the hinted fix works: parameters frozen, weights alone are saved
    frozen = model.spec.bind(model.dims, model.params, frozen=list(model.params))
    ucl.save(tmp_path / "w", weights, model=frozen, mesh=mesh)
    with ucl.open(tmp_path / "w") as c:
        assert all(k.startswith("param/") for r in range(c.nranks) for k in c.keys(r))


def test_dtype_mismatch_is_grouped_and_hints_the_state_line(demo_shards, tmp_path):
    torch = pytest.importorskip("torch")
    import numpy as np
    from ucl.demo import LLAMA_MEGATRON
    model, mesh, shards = demo_shards
    # the same model under a spec that leaves param at the default float32
    spec = ucl.load_spec(LLAMA_MEGATRON.replace("state param : dtype bfloat16\n", ""))
    fp32 = spec.bind(model.dims, model.params)
    bf16 = {r: {k: torch.from_numpy(v.view(np.int16)).view(torch.bfloat16) if k.startswith("param/") else v
                for k, v in s.items()} for r, s in shards.items()}
    with pytest.raises(ucl.StoreError) as info:
        ucl.save(tmp_path / "b", bf16, model=fp32, mesh=mesh)
    text = str(info.value)
    lines = text.splitlines()
    assert len(lines) < 6, text
    assert "expected [" in text and "float32, got [" in text and "bfloat16" in text and "more like this" in text
    assert lines[-1] == ("  hint: the spec stores param as float32 (the default); if yours are bfloat16, declare it "
                         "in the spec: `state param : dtype bfloat16`"), text
    # and the other way round: the statement exists, the tensors are float32
    f32 = {r: {k: torch.zeros(v.shape, dtype=torch.float32) if k.startswith("param/") else v for k, v in s.items()}
           for r, s in shards.items()}
    with pytest.raises(ucl.StoreError) as info:
        ucl.save(tmp_path / "c", f32, model=model, mesh=mesh)
    assert "the spec stores param as bfloat16 (the `state` statement at <demo:llama_megatron>:" in str(info.value)
    assert "write `dtype float32` there, or convert the tensors to bfloat16" in str(info.value)


def test_bind_given_tensors_instead_of_shapes_says_so():
    """Not the tensor's values in the message: what to pass instead."""
    torch = pytest.importorskip("torch")
    spec = ucl.load_spec("w [4, 4] : replicate\n")
    with pytest.raises(ucl.BindError) as e:
        spec.bind({}, {"w": torch.full((4, 4), 0.8557)})
    assert "given as a Tensor; bind takes shapes" in str(e.value) and "0.8557" not in str(e.value)
    assert spec.bind({}, {"w": torch.Size([4, 4])}).params == {"w": (4, 4)}


# ---- patterns that match no parameter: warnings, not errors ------------------------------------------
UNMATCHED = """dims n, has_head
mesh dp, tp
layers.{i}.** : index i of 2 over dp
layers.{i}.w [n, n] : split 0 over tp
layers.{i}.bias [n] : optional
head.weight [n, n] : optional if has_head
tail.weight [n, n] : replicate
extra.** : on dp = 0
layers.{i}.ww [n, n] : optional
extra.* : optional
ignore buffers.**, rotary.*
state exp_avg : follow
state exp_avg for layers.*.ww | layers.*.w : flat over dp
"""


def test_unmatched_patterns_are_warnings_pointing_at_each_pattern():
    spec = ucl.Spec.from_text(UNMATCHED, "m.ucl")
    # binding allows every one of them (one spec serves models with and without some parameters)
    model = spec.bind({"n": 4, "has_head": 0}, {"layers.0.w": (4, 4), "layers.1.w": (4, 4), "rotary.f": (2,)})
    found = [(d.span.line, d.span.col, d.severity, d.code) for d in model.unmatched()]
    # `optional` bias: quiet; `optional if has_head` with has_head = 0 says the head exists: warned
    assert found == [(6, 1, "warning", ""), (7, 1, "warning", ""), (8, 1, "warning", ""), (11, 8, "warning", ""),
                     (13, 19, "warning", "")], found
    text = [d.render(spec.text, spec.filename) for d in model.unmatched()]
    assert text[0].startswith("m.ucl:6:1: warning: rule `head.weight` matches no parameter of the model"), text[0]
    assert text[2].startswith("m.ucl:8:1: warning: placement rule `extra.**` matches"), text[2]
    assert text[3].startswith("m.ucl:11:8: warning: `ignore buffers.**` matches"), text[3]  # rotary.* is matched
    assert text[4].splitlines()[0] == "m.ucl:13:19: warning: `state exp_avg for layers.*.ww` matches no parameter of the model"
    assert text[4].splitlines()[2] == " " * 22 + "^" * len("layers.*.ww")
    assert "did you mean `layers.0.w`?" in text[4]  # the nearest real name, digits compared as 0
    with_head = spec.bind({"n": 4, "has_head": 1}, {"layers.0.w": (4, 4), "layers.1.w": (4, 4)})
    assert [d.span.line for d in with_head.unmatched()] == [7, 8, 11, 11, 13]
    full = spec.bind({"n": 4, "has_head": 0}, {"layers.0.w": (4, 4), "layers.1.w": (4, 4), "layers.1.ww": (4, 4),
                                               "head.weight": (4, 4), "tail.weight": (4, 4), "extra.x": (1,),
                                               "buffers.y": (1,), "rotary.f": (2,)})
    assert full.unmatched() == []


def test_a_manual_checkpointer_spec_warns_about_a_state_pattern_that_matches_nothing():
    from ucl.train.layouts import bind_manual
    text = "mesh tp\nw [4, 4] : split 0 over tp\nstate exp_avg : follow\nstate exp_avg for ww : flat over tp\n"
    with pytest.warns(UserWarning, match=r"<spec>:4:19: warning: `state exp_avg for ww` matches no parameter"):
        bind_manual(text, {"tp": 2})


# =================================================================================================
# Naming a spec
# =================================================================================================
@pytest.mark.parametrize("word, hint", [
    ("llama", "did you mean stdlib:llama?"), ("lama", "did you mean stdlib:llama?"),
    ("mixtral", "did you mean stdlib:mixtral?"), ("nothing_like_it", "a spec is a .ucl file, stdlib:NAME or spec text"),
])
def test_a_spec_named_by_a_bare_word_is_no_file_not_a_parse_error(tmp_path, monkeypatch, word, hint):
    monkeypatch.chdir(tmp_path)  # no file of that name here
    with pytest.raises(ucl.UclError) as info:
        ucl.load_spec(word)
    assert info.value.code == "UCL000"
    assert str(info.value) == f"no file {word!r}; {hint}"


def test_ucl_check_of_a_bare_stdlib_name_says_one_line(tmp_path, monkeypatch, capsys):
    import ucl.cli
    monkeypatch.chdir(tmp_path)
    assert ucl.cli.main(["check", "llama"]) == 1
    err = capsys.readouterr().err
    assert err == "ucl: no file 'llama'; did you mean stdlib:llama?\n", err


def test_a_bare_word_that_is_a_file_is_still_read(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "llama").write_text("dims h\nw [h] : replicate\n")
    assert ucl.load_spec("llama").dims == ["h"]
