"""Fuzzing the front end and binding: whatever the input, only a ucl.UclError may escape.

* texts generated from the grammar itself (grammar/ucl.lark via hypothesis.extra.lark),
* arbitrary text,
* mutations (insertions, deletions, line shuffles) of valid specs,
* valid specs bound to random dims / parameter shapes and compiled to random meshes.

Spec errors must be rendered as ``file:line:col: error[UCLnnn]: message``.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import lark
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import note as _note
from hypothesis.control import _current_build_context
from hypothesis import strategies as st
from hypothesis.extra.lark import from_lark

import ucl
from tests.passes import examples

ROOT = Path(__file__).resolve().parent.parent
GRAMMAR = (ROOT / "grammar" / "ucl.lark").read_text()


SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                     HealthCheck.filter_too_much])
DIAG = re.compile(r":\d+:\d+: error\[UCL\d{3}\]: ")

AXES = ("pp", "dp", "tp", "ep")
NAMES = ("pp", "dp", "tp", "ep", "hidden", "heads", "kv_heads", "head_dim", "layers", "vocab", "ffn", "experts",
         "q", "k", "v", "i", "e", "float32", "bfloat16", "int64", "exp_avg", "step", "param", "fp32",
         "min", "max", "ceil_div", "lcm", "gcd", "split", "first", "mesh", "x")


def note(text):
    if _current_build_context.value is not None:
        _note(text)


class tolerate:
    """Context manager: UclError passes silently; anything else propagates."""

    def __init__(self, text: str, dims=None, spec_errors=True):
        self.text, self.dims, self.spec_errors = text, dims, spec_errors

    def __enter__(self):
        return self

    def __exit__(self, tp, exc, tb):
        if exc is None:
            return False
        if isinstance(exc, ucl.UclError):
            return self.spec_errors or not isinstance(exc, ucl.SpecError)
        return False


# ---- helpers ---------------------------------------------------------------------------------
def load(text: str):
    """load_spec that lets only UclError out, and checks how SpecErrors are rendered."""
    try:
        with tolerate(text, spec_errors=False):  # SpecErrors are inspected below
            return ucl.load_spec(text)
        return None
    except ucl.SpecError as e:
        msg = str(e)
        assert e.diagnostics, msg
        assert all(d.code.startswith("UCL") and len(d.code) == 6 for d in e.diagnostics), msg
        if text.startswith("stdlib:") or ("\n" not in text and (text.endswith(".ucl") or os.path.exists(text))):
            return None  # a file, folder or stdlib name, not spec text: no line/col to point at
        assert DIAG.search(msg), f"no file:line:col: error[UCLnnn] in:\n{msg}"
        for d in e.diagnostics:
            assert d.span is not None, f"diagnostic without a position: {d}"
            assert d.span.line >= 1 and d.span.col >= 1, d
        return None
    except ucl.UclError:
        return None


def example_name(pattern: str, draw) -> str:
    """A parameter name the pattern matches."""
    out = pattern
    out = re.sub(r"\{[A-Za-z_]\w*\}", lambda m: str(draw(st.integers(0, 5))), out)
    out = out.replace("**", "\0")
    out = re.sub(r"\*", lambda m: draw(st.sampled_from(["", "a", "w1"])), out)
    out = out.replace("\0", draw(st.sampled_from(["x", "a.b", "", "0.w"])))
    return out


def storage(dtype: str):
    return np.dtype({"bfloat16": "uint16", "float8_e4m3fn": "uint8", "float8_e5m2": "uint8"}.get(dtype, dtype))


def try_model(spec, draw, mesh_draws=2):
    """Bind ``spec`` to random dims / params, compile to random meshes, run: only UclError may escape."""
    rules = list(spec.checked.rules) + list(spec.checked.placements)
    dims = {d: draw(st.one_of(st.integers(0, 12), st.sampled_from([-1, 1, 2, 4, 8, 64, 2 ** 40])))
            for d in spec.dims}
    if draw(st.integers(0, 9)) == 0:
        dims[draw(st.sampled_from(["bogus", "hidden", "tp"]))] = draw(st.integers(-2, 5))
    params = {}
    for r in rules[:6]:
        name = example_name(r.pattern.text, draw)
        if name:
            params[name] = tuple(draw(st.lists(st.integers(0, 6), max_size=3)))
    if draw(st.integers(0, 5)) == 0:
        params["unmatched.thing"] = (2,)
    frozen = [p for p in params if draw(st.integers(0, 4)) == 0]
    note(f"dims={dims} params={params} frozen={frozen}")
    model = None
    with tolerate(spec.text, dims):
        model = spec.bind(dims=dims, params=params, frozen=frozen)
    if model is None:
        return
    event("model bound")
    for _ in range(mesh_draws):
        axes = draw(st.permutations(spec.axes))[:draw(st.integers(0, min(3, len(spec.axes))))] if spec.axes else []
        mesh = [(a, draw(st.sampled_from([1, 2, 3, 4]))) for a in axes]
        if draw(st.integers(0, 9)) == 0:
            mesh.append(("zz", 2))  # not declared by the spec
        note(f"mesh={mesh}")
        with tolerate(spec.text, dims):
            m = ucl.Mesh(mesh)
            plan = ucl.compile(model, ucl.UNIVERSAL, m)
            if sum(int(np.prod(t.shape)) for t in model.tensors) > 20000:
                continue
            src = {0: {t.key: np.ones(t.shape, dtype=storage(t.dtype)) for t in model.tensors}}
            shards = ucl.execute_memory(plan, src)
            event("plan executed")
            back = ucl.execute_memory(ucl.compile(model, m, ucl.UNIVERSAL), shards)
            for k, a in src[0].items():
                assert np.array_equal(back[0][k], a), k
            ucl.Plan.from_json(plan.to_json())
            plan.summary()


# ---- 1. texts from the grammar ---------------------------------------------------------------
def _pattern():
    seg = st.one_of(st.sampled_from(["layers", "w", "embed", "mlp", "fc1", "weight", "attn", "mesh_proj", "x-y",
                                     "state_in", "split"]),
                    st.just("*"), st.just("**"), st.sampled_from(["{i}", "{e}", "{j}"]),
                    st.sampled_from(["*_norm", "w*", "a{i}b"]))
    return st.lists(seg, min_size=1, max_size=4).map(".".join).filter(lambda s: re.fullmatch(
        r"(?:[A-Za-z_*]|\{[A-Za-z_]\w*\})(?:[\w*\-]|\{[A-Za-z_]\w*\}|\.(?=[\w*{]))*", s) is not None)


def _dimref():
    step = st.one_of(st.integers(0, 3).map(str), st.sampled_from(["q", "k", "v", "a"]))
    return st.tuples(st.integers(0, 3).map(str), st.lists(step, max_size=2)).map(lambda t: ".".join([t[0]] + t[1]))


def grammar_strategy(spaced: bool, start: str = "start", names=None):
    parser = lark.Lark(GRAMMAR, parser="lalr", start=["start", "rule", "state_decl", "let_decl"])
    sp = " " if spaced else ""
    terms, _, _ = parser.grammar.compile(["start"], ())
    explicit = {}
    for t in terms:
        if t.pattern.type == "str":
            explicit[t.name] = st.just(t.pattern.value + sp)
    name = st.one_of(st.sampled_from(NAMES), st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,5}", fullmatch=True)) \
        if names is None else st.sampled_from(names)
    explicit.update({
        "NAME": name.map(lambda s: s + sp),
        "PATTERN": _pattern().map(lambda s: s + sp),
        "DIMREF": _dimref().map(lambda s: s + sp),
        "INT": st.one_of(st.integers(0, 16), st.integers(0, 10 ** 20)).map(lambda i: str(i) + sp),
        "SPLIT_MODE": st.sampled_from(["uneven", "shared"]).map(lambda s: s + sp),
        "_NL": st.sampled_from(["\n", "\n", "\r\n", "  # comment\n"]),
        "COMMENT": st.just(""),
        "CONTINUATION": st.sampled_from(["\n  ", "\n\t", "\n# c\n    "]),
        "__IGNORE_0": st.sampled_from([" ", "\t"]),
    })
    _, rules, ignored = parser.grammar.compile([start], ())
    used = set(ignored) | {x.name for r in rules for x in r.expansion}
    return from_lark(parser, start=start, explicit={k: v for k, v in explicit.items() if k in used})


@settings(max_examples=examples(400), **SETTINGS)
@given(text=grammar_strategy(spaced=True), data=st.data())
def test_grammar_generated_spaced(text, data):
    note(text)
    spec = load(text)
    event("spec loaded" if spec is not None else "spec refused")
    if spec is not None:
        try_model(spec, data.draw, mesh_draws=1)


HEADER = "dims hidden, heads, layers, x\nmesh pp, dp, tp, ep\n"
DECLARED = ("pp", "dp", "tp", "ep", "hidden", "heads", "layers", "x", "i", "q", "k", "float32", "bfloat16",
            "exp_avg", "step", "min", "max", "ceil_div")


@settings(max_examples=examples(300), **SETTINGS)
@given(lines=st.lists(st.one_of(grammar_strategy(True, "rule", DECLARED), grammar_strategy(True, "rule", DECLARED),
                                grammar_strategy(True, "state_decl", DECLARED),
                                grammar_strategy(True, "let_decl", DECLARED)),
                      min_size=1, max_size=3), data=st.data())
def test_grammar_generated_statements(lines, data):
    """A header declaring dims and axes, then statements generated from the grammar's own rules."""
    text = HEADER + "".join(line + "\n" for line in lines)
    note(text)
    spec = load(text)
    event("spec loaded" if spec is not None else "spec refused")
    if spec is not None:
        try_model(spec, data.draw, mesh_draws=2)


@settings(max_examples=examples(150), **SETTINGS)
@given(text=grammar_strategy(spaced=False))
def test_grammar_generated_unspaced(text):
    note(text)
    load(text)


# ---- 2. arbitrary text ---------------------------------------------------------------------------
ALPHABET = "abdeilmnoprstuvxyz_0123456789 \t\n\r.,:;[](){}*#=+-/%|"


@settings(max_examples=examples(300), **SETTINGS)
@given(text=st.one_of(st.text(), st.text(alphabet=ALPHABET), st.binary().map(lambda b: b.decode("latin-1"))))
def test_arbitrary_text(text):
    note(repr(text))
    load(text)


def test_not_text():
    for bad in (None, b"mesh tp\n", 3):
        with pytest.raises(ucl.UclError):
            ucl.Spec.from_text(bad)


# ---- 3. mutated valid specs ------------------------------------------------------------------------
VALID_SPECS = [
    """# Llama-family decoder, Megatron-style TP/PP, ZeRO-1 optimizer state
dims vocab, hidden, heads, kv_heads, ffn, layers
let head_dim = hidden / heads
mesh pp, dp, tp

layers.{i}.**              : index i of layers over pp
embed.weight [vocab, hidden]
    : pad 0 to multiple_of(128 * tp); split 0 over tp; on pp = first
layers.{i}.attn.qkv.weight [(heads + 2 * kv_heads) * head_dim, hidden]
    : view 0 as [kv_heads, (heads / kv_heads + 2) * head_dim]; split 0.0 over tp
layers.{i}.mlp.fc1.weight [2 * ffn, hidden] : view 0 as [2, ffn]; split 0.1 over tp
layers.{i}.mlp.fc2.weight [hidden, ffn]     : split 1 over tp
layers.{i}.*_norm.weight  [hidden]          : replicate over tp
final_norm.weight         [hidden]          : on pp = last

state param                     : dtype bfloat16
state fp32, exp_avg, exp_avg_sq : dtype float32; flat over dp align 64 pad to multiple_of(dp)
state step                      : scalar
""",
    """dims heads, kv_heads, head_dim, hidden, experts
mesh pp, dp, tp, ep
ignore rotary.inv_freq
qkv [(heads + 2 * kv_heads) * head_dim, hidden]
    : concat 0 as [q = heads * head_dim, k = kv_heads * head_dim, v = kv_heads * head_dim]
    ; view 0.k as [kv_heads, head_dim]; split 0.q over tp; split 0.k.0 over tp shared
experts.{e}.w [hidden] : index e of experts over ep virtual 1; split 0 over dp uneven
blocks.{i}.** : index i of 4 over pp sizes [1, 3]
blocks.*.w [hidden] : split 0 over (dp, tp) uneven
state exp_avg for experts.** : flat over dp per_param
state m, v : flat over dp reverse bucket 16 pad to multiple_of(2 * dp)
state step : scalar
""",
]
LLAMA_PARAMS = {"embed.weight": (100, 16), "layers.0.attn.qkv.weight": (32, 16), "layers.0.mlp.fc1.weight": (48, 16),
                "layers.0.mlp.fc2.weight": (16, 24), "layers.0.in_norm.weight": (16,),
                "layers.1.attn.qkv.weight": (32, 16), "layers.1.mlp.fc1.weight": (48, 16),
                "layers.1.mlp.fc2.weight": (16, 24), "layers.1.in_norm.weight": (16,), "final_norm.weight": (16,)}
LLAMA_DIMS = dict(vocab=100, hidden=16, heads=4, kv_heads=2, ffn=24, layers=2)


def test_valid_specs_are_valid():
    for text in VALID_SPECS:
        assert ucl.load_spec(text) is not None
    model = ucl.load_spec(VALID_SPECS[0]).bind(dims=LLAMA_DIMS, params=LLAMA_PARAMS)
    ucl.compile(model, ucl.Mesh(pp=2, dp=2, tp=2), ucl.UNIVERSAL)


@st.composite
def mutated(draw):
    text = draw(st.sampled_from(VALID_SPECS))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["insert", "delete", "replace", "dup_line", "drop_line", "swap_lines", "token"]))
        if not text:
            break
        pos = draw(st.integers(0, len(text)))
        if op == "insert":
            text = text[:pos] + draw(st.text(alphabet=ALPHABET + "é\x00\u2028", min_size=1, max_size=3)) + text[pos:]
        elif op == "delete":
            text = text[:pos] + text[pos + draw(st.integers(1, 8)):]
        elif op == "replace":
            text = text[:pos] + draw(st.sampled_from(list(ALPHABET))) + text[pos + 1:]
        else:
            lines = text.split("\n")
            i, j = draw(st.integers(0, len(lines) - 1)), draw(st.integers(0, len(lines) - 1))
            if op == "dup_line":
                lines.insert(j, lines[i])
            elif op == "drop_line":
                lines.pop(i)
            elif op == "swap_lines":
                lines[i], lines[j] = lines[j], lines[i]
            else:  # replace one word by a keyword / name / number
                words = re.split(r"(\W)", lines[i])
                k = draw(st.integers(0, len(words) - 1))
                words[k] = draw(st.sampled_from(["split", "over", "0", "99", "tp", "view", "as", "first", "flat",
                                                 "state", "-1", "0.9", "(", "]", "dims", "", "**", "{i}"]))
                lines[i] = "".join(words)
            text = "\n".join(lines)
    return text


@settings(max_examples=examples(400), **SETTINGS)
@given(text=mutated(), data=st.data())
def test_mutated_specs(text, data):
    note(text)
    spec = load(text)
    if spec is None:
        return
    draw = data.draw
    # the intended model first (most mutations keep most rules), then random ones
    with tolerate(text):
        model = spec.bind(dims=LLAMA_DIMS, params=LLAMA_PARAMS)
        mesh = ucl.Mesh([(a, draw(st.sampled_from([1, 2, 4]))) for a in spec.axes if a in AXES])
        ucl.compile(model, ucl.UNIVERSAL, mesh)
        ucl.compile(model, mesh, ucl.UNIVERSAL)
    try_model(spec, draw, mesh_draws=1)


# ---- 4. bind-time fuzz of valid specs -----------------------------------------------------------------
@settings(max_examples=examples(300), **SETTINGS)
@given(text=st.sampled_from(VALID_SPECS), data=st.data())
def test_bind_fuzz(text, data):
    spec = ucl.load_spec(text)
    try_model(spec, data.draw, mesh_draws=2)


@settings(max_examples=examples(200), **SETTINGS)
@given(data=st.data())
def test_bind_fuzz_llama(data):
    """The Llama spec with the right parameter names and random (often inconsistent) dims/shapes/meshes."""
    draw = data.draw
    spec = ucl.load_spec(VALID_SPECS[0])
    dims = {k: draw(st.one_of(st.just(v), st.integers(-1, 40))) for k, v in LLAMA_DIMS.items()}
    if draw(st.integers(0, 5)) == 0:
        dims[draw(st.sampled_from(list(dims)))] = draw(st.sampled_from([True, 2.0, "4", None, 2 ** 70]))
    params = {}
    for name, shape in LLAMA_PARAMS.items():
        if draw(st.integers(0, 4)) == 0:
            shape = tuple(draw(st.lists(st.integers(-1, 40), max_size=3)))
        params[name] = shape
    note(f"dims={dims} params={params}")
    model = None
    with tolerate(spec.text, dims):
        model = spec.bind(dims=dims, params=params)
    if model is None:
        return
    mesh = ucl.Mesh([(a, draw(st.integers(1, 5))) for a in draw(st.permutations(["pp", "dp", "tp"]))])
    note(f"mesh={mesh}")
    with tolerate(spec.text, dims):
        ucl.compile(model, ucl.UNIVERSAL, mesh)
        ucl.compile(model, mesh, ucl.UNIVERSAL)


# expressions are evaluated at bind / compile time: every corner of the arithmetic must be a UclError
EXPRS = ["0", "1 / 0", "1 // 0", "1 % 0", "7 / 2", "ceil_div(4, 0)", "min(3)", "max(2)", "lcm(4)", "gcd(4)",
         "min(1, 2, 3)", "lcm(0, 4)", "-3", "0 - 5", "ceil_div(-3, 2)", "2 * tp", "tp - 1", "99999999999999999999",
         "hidden / heads", "unknown_fn(2)", "ceil_div(1)", "ceil_div(1, 2, 3)", "tp / 0"]


@pytest.mark.parametrize("expr", EXPRS)
@pytest.mark.parametrize("where", ["let", "pad", "pad_exact", "view", "index", "virtual", "flat_align",
                                   "flat_pad", "bucket", "on", "shape", "concat"])
def test_expression_corners(expr, where):
    heads = "(" + expr + ")"
    rules = {
        "let": f"let z = {expr}\nw [4] : replicate",
        "pad": f"w [4] : pad 0 to multiple_of({expr}); split 0 over tp",
        "pad_exact": f"w [4] : pad 0 to {heads}",
        "view": f"w [4] : view 0 as [{expr}, 2]; split 0.0 over tp",
        "index": f"layers.{{i}}.** : index i of {expr} over pp\nw [4] : replicate\nlayers.*.w [2] : replicate",
        "virtual": f"layers.{{i}}.** : index i of 4 over pp virtual {expr}\nw [4] : replicate\nlayers.*.w [2] : replicate",
        "flat_align": f"w [4] : replicate\nstate m : flat over dp align {expr}",
        "flat_pad": f"w [4] : replicate\nstate m : flat over dp pad to multiple_of({expr})",
        "bucket": f"w [4] : replicate\nstate m : flat over dp bucket {expr}",
        "on": f"w [4] : on pp = {expr}",
        "shape": f"w [{expr}] : replicate",
        "concat": f"w [4] : concat 0 as [a = {expr}, b = 2]; split 0 over tp",
    }[where]
    text = f"dims hidden, heads\nmesh pp, dp, tp\n{rules}\n"
    spec = load(text)
    if spec is None:
        return
    params = {"w": (4,), "layers.0.w": (2,), "layers.1.w": (2,)} if "layers" in text else {"w": (4,)}
    with tolerate(text):
        model = spec.bind(dims={"hidden": 8, "heads": 2}, params=params)
        for mesh in (ucl.Mesh(pp=2, dp=2, tp=2), ucl.Mesh(tp=3), ucl.UNIVERSAL):
            plan = ucl.compile(model, ucl.UNIVERSAL, mesh)
            ucl.execute_memory(plan, {0: {t.key: np.zeros(t.shape, dtype=storage(t.dtype)) for t in model.tensors}})


# ---- deterministic repros of the bugs the fuzzers found (all fixed; kept as regressions) ----------
def _bind_compile(text, params, dims=None, mesh=ucl.Mesh(tp=2)):
    model = ucl.load_spec(text).bind(dims=dims or {}, params=params)
    ucl.compile(model, ucl.UNIVERSAL, mesh)


def test_regression_min_single_argument():
    """min/max of one value once raised TypeError; it is that value."""
    _bind_compile("mesh tp\nlet z = min(3)\nw [z + 1] : replicate\n", {"w": (4,)})


def test_regression_ceil_div_by_zero():
    with pytest.raises(ucl.UclError):
        _bind_compile("mesh tp\nw [4] : pad 0 to multiple_of(ceil_div(4, 0))\n", {"w": (4,)})


def test_regression_virtual_zero():
    """Was ZeroDivisionError in lower._stage_of (fixed in 47dd34f)."""
    with pytest.raises(ucl.UclError):
        _bind_compile("mesh pp\nlayers.{i}.** : index i of 4 over pp virtual 0\nlayers.*.w [2] : replicate\n",
                      {f"layers.{i}.w": (2,) for i in range(4)}, mesh=ucl.Mesh(pp=2))


def test_regression_flat_align_zero():
    """Was ZeroDivisionError in lower._lower_flat (fixed in 47dd34f)."""
    with pytest.raises(ucl.UclError):
        _bind_compile("mesh dp\nw [4] : replicate\nstate m : flat over dp align 0\n", {"w": (4,)},
                      mesh=ucl.Mesh(dp=2))


def test_virtual_negative_is_an_error():
    """`virtual -1` once produced a meaningless layout (negative chunk sizes)."""
    with pytest.raises(ucl.UclError):
        _bind_compile("mesh pp\nlayers.{i}.** : index i of 4 over pp virtual -1\nlayers.*.w [2] : replicate\n",
                      {f"layers.{i}.w": (2,) for i in range(4)}, mesh=ucl.Mesh(pp=2))


def test_regression_huge_integer():
    with pytest.raises(ucl.UclError):
        _bind_compile("mesh tp\nw [4] : pad 0 to 99999999999999999999\n", {"w": (4,)}, mesh=ucl.Mesh(tp=2))


def test_regression_long_single_line_text():
    """One line of spec text longer than a file name once raised OSError from the path probe."""
    assert ucl.load_spec("mesh tp" + " " * 300).axes == ["tp"]


def test_regression_duplicate_capture():
    with pytest.raises(ucl.UclError):
        ucl.load_spec("mesh pp\nlayers.{i}.{i} : replicate\n").bind(dims={}, params={"layers.0.0": (2,)})
