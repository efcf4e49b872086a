"""Property tests (DESIGN.md section 4, P1-P5) against the independent reference in tests/oracle.py.

Random models (1-6 parameters plus optional layer/expert groups, ndim 0..3, dims 0..12), random
layouts from a rich family (even / uneven / shared splits, splits over axis tuples, sequential
splits, views, concats with viewed parts, pads, on / index placement with virtual stages and
explicit sizes, follow / scalar / flat states with reverse, align, pad, bucket, per_param) and
random meshes (1-4 axes out of pp/dp/tp/ep in any order, sizes 1-8, at most 64 ranks).
"""
from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, event, given, reject, settings
from hypothesis import strategies as st

import ucl
from tests import oracle as O
from tests.passes import examples

# random meshes often fit a tensor loosely (more ranks than elements): the
# warning is expected; tests/test_mesh_diagnostics.py checks it
pytestmark = pytest.mark.filterwarnings("ignore::ucl.layout.fit.MeshFitWarning")

AXES = ("pp", "dp", "tp", "ep")
DTYPES = ("float32", "float16", "bfloat16", "int64", "float64", "int32")
KINDS = ("exp_avg", "exp_avg_sq", "fp32", "step", "master")
GLOBAL_NAMES = ("embed.weight", "head", "norm.w", "mesh_proj.weight", "lm-head.w", "state_in", "x_1")


SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                     HealthCheck.filter_too_much])


# ---- strategies ----------------------------------------------------------------------------
@st.composite
def meshes(draw, min_axes=1):
    k = draw(st.integers(min_axes, 4))
    names = draw(st.permutations(AXES))[:k]
    out, total = [], 1
    for n in names:
        s = draw(st.sampled_from([s for s in (1, 2, 2, 2, 3, 4, 4, 5, 6, 8) if total * s <= 64]))
        total *= s
        out.append((n, s))
    return out


def divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


class _Gen:
    """Builds one rule's transforms for a shape; ``avoid`` are axes the rule may not split over."""

    def __init__(self, draw, shape, avoid, reuse):
        self.draw, self.shape, self.avoid, self.reuse = draw, shape, set(avoid), reuse
        self.used: set = set()

    def axes(self):
        free = [a for a in AXES if a not in self.avoid and (self.reuse or a not in self.used)]
        if not free:
            return None
        if self.reuse and self.used and self.draw(st.booleans()):  # reuse an axis already splitting
            return (self.draw(st.sampled_from(sorted(self.used))),)
        k = self.draw(st.sampled_from([1, 1, 1, 2])) if len(free) > 1 else 1
        picked = tuple(self.draw(st.permutations(free))[:k])
        self.used |= set(picked)
        return picked

    def split(self, path, modes=("even", "even", "uneven", "uneven", "shared")):
        axes = self.axes()
        if axes is None:
            return []
        return [O.Split(path, axes, self.draw(st.sampled_from(modes)))]

    def splits(self, path, max_n=2):
        out = []
        for _ in range(self.draw(st.integers(1, max_n))):
            out += self.split(path)
        return out

    def dim(self, d, n):
        draw = self.draw
        choice = draw(st.sampled_from(["none", "split", "split", "split2", "pad", "view", "concat"]))
        if choice == "none":
            return []
        if choice == "split":
            return self.split((d,))
        if choice == "split2":
            return self.splits((d,), 2)
        if choice == "pad":
            kind = draw(st.sampled_from(["const", "axis", "exact", "let"]))
            if kind == "const":
                pad = O.Pad(d, draw(st.integers(1, 8)))
            elif kind == "axis":
                pad = O.Pad(d, O.axis_ex(draw(st.sampled_from(AXES)), draw(st.integers(1, 3))))
            elif kind == "let":
                pad = O.Pad(d, O.Ex("tp2", lambda s: 2 * s.get("tp", 1)))
            else:
                pad = O.Pad(d, n + draw(st.integers(0, 4)), multiple=False)
            return [pad] + (self.splits((d,), 2) if draw(st.integers(0, 4)) else [])
        if choice == "view":
            if n < 1:
                return self.split((d,))
            f0 = draw(st.sampled_from(divisors(n)))
            factors = [f0, n // f0]
            if draw(st.booleans()):
                f1 = draw(st.sampled_from(divisors(factors[1])))
                factors = [f0, f1, factors[1] // f1]
            out = [O.View((d,), tuple(factors))]
            if draw(st.integers(0, 3)) == 0:
                return out + self.splits((d,), 2)  # split the whole viewed dim
            ks = draw(st.lists(st.integers(0, len(factors) - 1), min_size=1, max_size=2, unique=True))
            for k in ks:
                out += self.splits((d, k), 2)
            if draw(st.integers(0, 2)) == 0:  # then cut each rank's local part (FSDP on top of TP)
                out += self.split((d,), ("uneven", "uneven", "even"))
            return out
        # concat
        nparts = draw(st.integers(2, 3))
        cuts = sorted(draw(st.lists(st.integers(0, n), min_size=nparts - 1, max_size=nparts - 1)))
        sizes = [b - a for a, b in zip([0] + cuts, cuts + [n])]
        names = draw(st.permutations(["q", "k", "v", "gate", "up"]))[:nparts]
        out = [O.Concat((d,), tuple(zip(names, sizes)))]
        whole = draw(st.booleans())
        if whole:
            out += self.split((d,))  # the first split of a concat splits every part
        for name, size in zip(names, sizes):
            r = draw(st.integers(0, 3))
            if r == 0 and not whole and size >= 1:  # view the part and split one factor
                f0 = draw(st.sampled_from(divisors(size)))
                out.append(O.View((d, name), (f0, size // f0)))
                out += self.split((d, name, draw(st.integers(0, 1))))
            elif r == 1:
                out += self.split((d, name))
        if draw(st.integers(0, 2)) == 0:  # a later split of the whole dim cuts each rank's local part
            out += self.split((d,), ("uneven", "uneven", "even", "shared"))
        return out


def interleave(draw, lists):
    """Merge lists keeping each list's order (order between dims does not matter)."""
    lists = [list(x) for x in lists if x]
    out = []
    while lists:
        i = draw(st.integers(0, len(lists) - 1))
        out.append(lists[i].pop(0))
        if not lists[i]:
            lists.pop(i)
    return out


@st.composite
def shapes(draw):
    nd = draw(st.integers(0, 3))
    dims = []
    for _ in range(nd):
        dims.append(draw(st.one_of(st.integers(1, 12), st.integers(0, 12), st.sampled_from([1, 2, 4, 6, 8, 12]))))
    if int(np.prod(dims)) > 400:
        dims = [min(x, 6) for x in dims]
    return tuple(dims)


def render_shape(draw, shape, dims):
    out = []
    for v in shape:
        form = draw(st.sampled_from(["lit", "dim", "expr"]))
        if form == "lit":
            out.append(str(v))
        elif form == "dim" or v % 2:
            dims[f"n{v}"] = v
            out.append(f"n{v}")
        else:
            dims[f"n{v // 2}"] = v // 2
            out.append(f"2 * n{v // 2}")
    return out


def on_transform(draw, axis):
    coords = draw(st.lists(st.sampled_from(["first", "last", "first", "last", 0, 1, 2, "ax-1"]),
                           min_size=1, max_size=2))
    coords = tuple(O.Ex(f"{axis} - 1", lambda s, a=axis: s.get(a, 1) - 1) if c == "ax-1" else c for c in coords)
    return O.On(axis, coords)


@st.composite
def rule_for(draw, pattern, shape, avoid=(), placement=True, reuse=False, dims=None, force_shape=False):
    g = _Gen(draw, shape, avoid, reuse)
    per_dim = [g.dim(d, n) for d, n in enumerate(shape)]
    transforms = interleave(draw, per_dim)
    free = [a for a in AXES if a not in g.used and a not in avoid]
    if placement and free and draw(st.integers(0, 3)) == 0:
        ax = draw(st.sampled_from(free))
        free.remove(ax)
        transforms.insert(draw(st.integers(0, len(transforms))), on_transform(draw, ax))
    if free and draw(st.integers(0, 4)) == 0:
        transforms.insert(draw(st.integers(0, len(transforms))), O.Replicate((draw(st.sampled_from(free)),)))
    if not transforms:
        transforms = [O.Replicate()]
    rshape = None
    placement_only = all(isinstance(t, (O.On, O.Index)) for t in transforms)
    if force_shape or placement_only or draw(st.booleans()):
        rshape = render_shape(draw, shape, dims)
    return O.Rule(pattern, transforms, rshape)


@st.composite
def layouts(draw, reuse=False, max_globals=4):
    dims: dict = {}
    params, rules = [], []
    nglob = draw(st.integers(0, max_globals))
    names = draw(st.permutations(GLOBAL_NAMES))[:nglob]
    placement_axes = set()
    # an axis no parameter is split or placed over, kept free for flat states (ZeRO's dp)
    reserved = draw(st.sampled_from([None, "dp", "dp", "ep", "pp"]))
    res = () if reserved is None else (reserved,)
    for name in names:
        shape = draw(shapes())
        params.append((name, shape))
        rules.append(draw(rule_for(name, shape, avoid=res, reuse=reuse, dims=dims)))
    # a group of indexed parameters: layers.{i}.a (placement rule) or experts.{e}.w (index in the rule)
    if not names or draw(st.booleans()):
        prefix, cap = draw(st.sampled_from([("layers", "i"), ("experts", "e"), ("blocks", "b")]))
        L = draw(st.integers(1, 4))
        iax = draw(st.sampled_from([a for a in AXES if a != reserved]))
        placement_axes.add(iax)
        opt = draw(st.sampled_from(["plain", "plain", "virtual", "sizes", "first", "last", "firstlast"]))
        count = O.Ex("nl", lambda s, L=L: L) if draw(st.booleans()) else L
        dims["nl"] = L
        index = O.Index(cap, count, iax,
                        virtual=2 if opt == "virtual" else None,
                        sizes=tuple(draw(st.lists(st.integers(0, L), min_size=2, max_size=2)))
                        if opt == "sizes" else None)
        if opt in ("first", "last", "firstlast"):
            f = draw(st.sampled_from([0, 1, 2, O.Ex(f"ceil_div(nl, {iax})", lambda s, a=iax, L=L: -(-L // s.get(a, 1)))]))
            index = O.Index(cap, count, iax, first=f if opt != "last" else None,
                            last=draw(st.integers(0, 2)) if opt != "first" else None)
        if opt == "sizes" and draw(st.booleans()):  # mostly a consistent list
            a = draw(st.integers(0, L))
            index = O.Index(cap, count, iax, sizes=(a, L - a))
        subs = draw(st.lists(st.sampled_from(["a", "b", "norm", "w_2"]), min_size=1, max_size=2, unique=True))
        separate = draw(st.booleans())
        if separate:
            rules.append(O.Rule(f"{prefix}.{{{cap}}}.**", [index]))
        sub_shapes = {s: draw(shapes()) for s in subs}
        for i in range(L):
            for s in subs:
                params.append((f"{prefix}.{i}.{s}", sub_shapes[s]))
        for s in subs:
            if separate:
                pat = draw(st.sampled_from([f"{prefix}.*.{s}", f"{prefix}.{{{cap}}}.{s}", f"{prefix}.{{j}}.{s}"]))
                r = draw(rule_for(pat, sub_shapes[s], avoid=(iax,) + res, placement=False, reuse=reuse, dims=dims))
            else:
                r = draw(rule_for(f"{prefix}.{{{cap}}}.{s}", sub_shapes[s], avoid=(iax,) + res, placement=False,
                                  reuse=reuse, dims=dims))
                r.transforms.insert(draw(st.integers(0, len(r.transforms))), index)
                if r.shape is None and all(isinstance(t, (O.On, O.Index)) for t in r.transforms):
                    r.shape = render_shape(draw, sub_shapes[s], dims)
            rules.append(r)
        # experts nested in the group: prefix.{i}.experts.{e}.w, e spread over another axis
        free_e = [a for a in AXES if a not in (iax, reserved)]
        if free_e and draw(st.integers(0, 3)) == 0:
            E = draw(st.integers(1, 3))
            eax = draw(st.sampled_from(free_e))
            placement_axes.add(eax)
            dims["ne"] = E
            eshape = draw(shapes())
            for i in range(L):
                for e in range(E):
                    params.append((f"{prefix}.{i}.experts.{e}.w", eshape))
            eindex = O.Index("ex", O.Ex("ne", lambda s, E=E: E), eax)
            if separate:
                pat = f"{prefix}.*.experts.{{ex}}.w"
                extra = [eindex]
            else:
                pat = f"{prefix}.{{{cap}}}.experts.{{ex}}.w"
                extra = [index, eindex]
            r = draw(rule_for(pat, eshape, avoid=(iax, eax) + res, placement=False, reuse=reuse, dims=dims,
                              force_shape=True))
            for t in extra:
                r.transforms.insert(draw(st.integers(0, len(r.transforms))), t)
            rules.append(r)
        # keep model order interesting: groups may come first
        if draw(st.booleans()):
            k = len(names)
            params = params[k:] + params[:k]
    for r in rules:
        for t in r.transforms:
            if isinstance(t, O.On):
                placement_axes.add(t.axis)
    ignores = []
    if draw(st.integers(0, 4)) == 0:
        params.insert(draw(st.integers(0, len(params))), ("rotary.inv_freq", (draw(st.integers(1, 4)),)))
        ignores.append("rotary.*")
    layout = O.Layout(params, rules, [], AXES, dims, lets=[("tp2", "2 * tp")], ignores=ignores)
    live = [n for n, _ in layout.live_params()]
    frozen = tuple(n for n in live if draw(st.integers(0, 5)) == 0)
    layout.frozen = frozen
    # states
    kinds = list(draw(st.permutations(KINDS)))
    split_axes = {}
    for n in live:
        r = layout._layout_rule(n)
        split_axes[n] = {a for t in r.transforms if isinstance(t, O.Split) for a in t.axes}
    states = []
    r = draw(st.integers(0, 7))
    if r <= 1:
        states.append(O.State(("param",), "", draw(st.sampled_from(DTYPES))))
    elif r == 2 and reserved is not None:  # the weights themselves flat (ZeRO-3 / FSDP1)
        states.append(O.State(("param",), O.Flat((reserved,), per_param=draw(st.booleans()),
                                                 pad_multiple=draw(st.sampled_from([None, O.axis_ex(reserved)]))),
                              draw(st.sampled_from((None,) + DTYPES))))
    for _ in range(draw(st.integers(0, 3))):
        if not kinds:
            break
        k = draw(st.integers(1, min(2, len(kinds))))
        ks, kinds = tuple(kinds[:k]), kinds[k:]
        pattern = None
        if draw(st.integers(0, 3)) == 0:
            pattern = draw(st.sampled_from([r.pattern for r in rules] + ["layers.**", "*", "**"]))
        dtype = draw(st.sampled_from((None,) + DTYPES))
        lay = draw(st.sampled_from(["follow", "scalar", "flat", "flat", "flat", ""]))
        if lay == "flat":
            members = [n for n in live if pattern is None or O.match(pattern, n)]
            used = set().union(*[split_axes[n] for n in members]) if members else set()
            cands = [a for a in AXES if a not in placement_axes and (a not in used or draw(st.integers(0, 9)) == 0)]
            if reserved is not None and draw(st.integers(0, 3)):
                cands = [reserved] + [a for a in cands if a != reserved]
            if not cands:
                lay = "follow"
            else:
                k = draw(st.sampled_from([1, 1, 1, 2])) if len(cands) > 1 else 1
                fax = tuple(cands[:1]) if k == 1 and cands[0] == reserved else tuple(draw(st.permutations(cands))[:k])
                per_param = draw(st.integers(0, 3)) == 0
                bucket = None if per_param or draw(st.integers(0, 3)) else draw(st.integers(1, 40))
                align = None if bucket is not None or draw(st.booleans()) else \
                    draw(st.sampled_from([1, 2, 3, 4, 8, O.axis_ex(fax[0])]))
                pad = draw(st.sampled_from([None, 2, 4, O.axis_ex(fax[0]), O.axis_ex(fax[-1], 2)] +
                                           ([O.Ex(" * ".join(fax), lambda s, f=fax: int(np.prod([s.get(a, 1) for a in f])))]
                                            if len(fax) > 1 else [])))
                lay = O.Flat(fax, reverse=not per_param and draw(st.booleans()), align=align, pad_multiple=pad,
                             per_param=per_param, bucket=bucket)
        states.append(O.State(ks, lay, dtype, pattern))
    layout.states = states
    return layout


# ---- values and comparison -----------------------------------------------------------------
def make_values(layout: O.Layout, seed: int) -> dict:
    """Distinct raw bit patterns for every element of every tensor (per item size), never 0."""
    rng = np.random.default_rng(seed)
    counters: dict = {}
    out = {}
    for kind, name, shape, dtype, _ in layout.tensors():
        sd = O.storage_dtype(dtype)
        n = int(np.prod(shape, dtype=np.int64))
        start = counters.get(sd.itemsize, 1)
        counters[sd.itemsize] = start + n
        raw_dt = np.dtype(f"uint{8 * sd.itemsize}")
        raw = (rng.permutation(n) + start).astype(raw_dt)
        out[f"{kind}/{name}"] = raw.view(sd).reshape(shape)
    return out


def raw(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    return a.view(np.dtype(f"uint{8 * a.dtype.itemsize}")) if a.dtype.itemsize in (1, 2, 4, 8) else a


def norm(shards):
    return {int(r): d for r, d in shards.items() if d}


def assert_same(got, want, what=""):
    got, want = norm(got), norm(want)
    assert sorted(got) == sorted(want), f"{what}: ranks differ: got {sorted(got)}, want {sorted(want)}"
    for r in want:
        assert sorted(got[r]) == sorted(want[r]), f"{what}: rank {r} keys: got {sorted(got[r])}, want {sorted(want[r])}"
        for k in want[r]:
            g, w = np.asarray(got[r][k]), np.asarray(want[r][k])
            assert g.shape == w.shape, f"{what}: rank {r} {k}: shape {g.shape} != {w.shape}"
            assert g.dtype == w.dtype, f"{what}: rank {r} {k}: dtype {g.dtype} != {w.dtype}"
            if not np.array_equal(raw(g), raw(w)):
                raise AssertionError(f"{what}: rank {r} {k}: values differ\n got  {raw(g).tolist()}\n want {raw(w).tolist()}")


def note(text):
    from hypothesis import note as _note
    from hypothesis.control import _current_build_context
    if _current_build_context.value is not None:
        _note(text)


def mesh_of(m) -> ucl.Mesh:
    return ucl.Mesh(list(m))


def bind(layout: O.Layout):
    text = layout.render()
    note(text)
    spec = ucl.load_spec(text)
    return spec.bind(dims=dict(layout.dims), params=list(layout.params), frozen=layout.frozen)


def oracle_shards(layout, mesh, values):
    try:
        return layout.shards(mesh, values)
    except O.Invalid as e:
        note(f"oracle: invalid on {mesh}: {e}")
        try:
            event("invalid: " + re.sub(r"[0-9]+", "N", str(e))[:40])
        except Exception:
            pass
        return None


def check_tensors(model, layout):
    got = [(t.kind, t.name, tuple(t.shape), t.dtype) for t in model.tensors]
    want = [(k, n, tuple(s), d) for k, n, s, d, _ in layout.tensors()]
    assert sorted(got) == sorted(want)


def compile_from(model, layout, src, dst):
    return ucl.compile(model, mesh_of(src) if isinstance(src, list) else src,
                       mesh_of(dst) if isinstance(dst, list) else dst)


def bind_or_reject(layout):
    """Bind; a layout refused at bind time (e.g. a pad target of 0) is not an example for this test."""
    try:
        return bind(layout)
    except ucl.UclError:
        reject()


def scatter(model, mesh, universal):
    plan = ucl.compile(model, ucl.UNIVERSAL, mesh_of(mesh))
    return plan, ucl.execute_memory(plan, universal)


# ---- P5: plan vs oracle ------------------------------------------------------------------------
@settings(max_examples=examples(250), **SETTINGS)
@given(layout=layouts(), mesh=meshes(), seed=st.integers(0, 2 ** 16))
def test_scatter_matches_oracle(layout, mesh, seed):
    note(f"mesh {mesh}")
    values = make_values(layout, seed)
    universal = layout.universal(values)
    want = oracle_shards(layout, mesh, values)
    try:
        model = bind(layout)
    except ucl.UclError:  # refused before any mesh is known: invalid on every mesh
        event("bind error")
        assert want is None, "ucl refuses to bind a layout the reference finds valid"
        return
    check_tensors(model, layout)
    event("invalid" if want is None else "valid")
    if want is None:
        with pytest.raises(ucl.UclError):
            scatter(model, mesh, universal)
        return
    plan, got = scatter(model, mesh, universal)
    event(f"ranks holding data: {min(len(norm(got)), 9)}")
    event(f"flat datasets: {sum('@' in k for d in got.values() for k in d) > 0}")
    assert_same(got, want, f"universal -> {mesh}")
    # every real (non-padding) element a rank holds is read exactly once: values are never raw 0
    per_rank = np.zeros(mesh_of(mesh).size, dtype=np.int64)
    for r, d in want.items():
        per_rank[r] = sum(int(np.count_nonzero(raw(a))) * a.dtype.itemsize for a in d.values())
    assert plan.bytes_read_per_rank().tolist() == per_rank.tolist()
    assert plan.bytes_read == int(per_rank.sum())
    # JSON round trip executes identically
    again = ucl.Plan.from_json(plan.to_json())
    assert_same(ucl.execute_memory(again, universal), want, "from_json")


# ---- P1/P2/P3: gather(scatter(x)) == x, coverage, replicas -------------------------------------
@settings(max_examples=examples(120), **SETTINGS)
@given(layout=layouts(), seed=st.integers(0, 2 ** 16), data=st.data())
def test_gather_scatter_roundtrip(layout, seed, data):
    model = bind_or_reject(layout)
    values = make_values(layout, seed)
    universal = layout.universal(values)
    mesh = data.draw(valid_mesh(layout, values), label="mesh")
    assume(mesh is not None)
    note(f"mesh {mesh}")
    want = oracle_shards(layout, mesh, values)
    _, shards = scatter(model, mesh, universal)
    # P1: every element of every tensor appears somewhere (values are distinct raw bits)
    present: dict = {}
    for d in shards.values():
        for k, a in d.items():
            present.setdefault((k.split("/")[0], a.dtype.itemsize), []).append(raw(a).reshape(-1))
    for key, g in values.items():
        kind = key.split("/")[0]
        pool = present.get((kind, g.dtype.itemsize))
        have = np.concatenate(pool) if pool else np.zeros(0, dtype=raw(g).dtype)
        assert np.isin(raw(g).reshape(-1), have).all(), f"{key}: some elements are held by no rank"
    # P2: every copy of a global element holds the same value: a value appears only where the
    # oracle puts that element, so equal to the oracle's shards (which place exactly one value per element)
    assert_same(shards, want, "scatter")
    # P3: gather(scatter(x)) == x and scatter(gather(s)) == s
    gathered = ucl.execute_memory(compile_from(model, layout, mesh, ucl.UNIVERSAL), shards)
    assert_same(gathered, universal, "gather(scatter(x))")
    _, rescattered = scatter(model, mesh, gathered)
    assert_same(rescattered, shards, "scatter(gather(s))")


# ---- P4: composability -----------------------------------------------------------------------
@st.composite
def valid_mesh(draw, layout, values, tries=6):
    """A mesh the layout is valid on (None when a few draws all fail)."""
    for _ in range(tries):
        m = draw(meshes())
        if oracle_shards(layout, m, values) is not None:
            return m
    return None


@settings(max_examples=examples(80), **SETTINGS)
@given(layout=layouts(max_globals=3), seed=st.integers(0, 2 ** 16), data=st.data())
def test_reshard_composes(layout, seed, data):
    model = bind_or_reject(layout)
    values = make_values(layout, seed)
    a = data.draw(valid_mesh(layout, values), label="A")
    b = data.draw(valid_mesh(layout, values), label="B")
    c = data.draw(meshes(), label="C")
    assume(a is not None and b is not None)
    note(f"A={a} B={b} C={c}")
    sa, sb, sc = (oracle_shards(layout, m, values) for m in (a, b, c))
    A, B, C = mesh_of(a), mesh_of(b), mesh_of(c)
    ab = ucl.execute_memory(compile_from(model, layout, A, B), sa)
    assert_same(ab, sb, "A->B vs oracle")
    aba = ucl.execute_memory(compile_from(model, layout, B, A), ab)
    assert_same(aba, sa, "A->B->A")
    aub = ucl.execute_memory(ucl.compile(model, ucl.UNIVERSAL, B),
                             ucl.execute_memory(compile_from(model, layout, A, ucl.UNIVERSAL), sa))
    assert_same(aub, ab, "A->universal->B vs A->B")
    if sc is None:
        with pytest.raises(ucl.UclError):
            ucl.compile(model, A, C)
        return
    ac = ucl.execute_memory(compile_from(model, layout, A, C), sa)
    assert_same(ac, sc, "A->C vs oracle")
    abc = ucl.execute_memory(compile_from(model, layout, B, C), ab)
    assert_same(abc, ac, "A->B->C vs A->C")


# ---- P1 negative: layouts that leave elements unheld must not be gathered silently ----------------
@settings(max_examples=examples(60), **SETTINGS)
@given(layout=layouts(reuse=True, max_globals=3), mesh=meshes(), seed=st.integers(0, 2 ** 16))
def test_axis_reuse_is_refused(layout, mesh, seed):
    """An axis splitting one tensor twice (outside sibling concat parts) would leave elements held by
    no rank: ucl must refuse such a layout (UclError), never lose data silently; everything else the
    oracle accepts must scatter and gather exactly."""
    note(f"mesh {mesh}")
    values = make_values(layout, seed)
    want = oracle_shards(layout, mesh, values)
    if want is None:
        with pytest.raises(ucl.UclError):
            model = bind(layout)
            scatter(model, mesh, layout.universal(values))
        return
    model = bind(layout)
    universal = layout.universal(values)
    _, got = scatter(model, mesh, universal)
    assert_same(got, want, "scatter")
    back = ucl.execute_memory(compile_from(model, layout, mesh, ucl.UNIVERSAL), got)
    assert_same(back, universal, "gather")


# ---- known answers: checks of the oracle itself against the examples of docs/language.md ----------
def _ucl_scatter(layout, mesh, values):
    model = bind_or_reject(layout)
    plan = ucl.compile(model, ucl.UNIVERSAL, ucl.Mesh(mesh))
    return ucl.execute_memory(plan, layout.universal(values))


def test_known_swiglu_view():
    L = O.Layout([("w", (8, 2))], [O.Rule("w", [O.View((0,), (2, 4)), O.Split((0, 1), ("tp",))])])
    vals = {"param/w": np.arange(16, dtype=np.float32).reshape(8, 2)}
    got = L.shards([("tp", 2)], vals)
    # rank r holds [gate_r; up_r]: rows 0,1 + 4,5 on rank 0; rows 2,3 + 6,7 on rank 1
    assert got[0]["param/w"][:, 0].tolist() == [0, 2, 8, 10]
    assert got[1]["param/w"][:, 0].tolist() == [4, 6, 12, 14]
    assert_same(_ucl_scatter(L, [("tp", 2)], vals), got)


def test_known_uneven_shared_index():
    L = O.Layout([("u", (5,)), ("s", (2,)), ("layers.5.w", (3,))],
                 [O.Rule("u", [O.Split((0,), ("tp",), "uneven")]),
                  O.Rule("s", [O.Split((0,), ("tp",), "shared")]),
                  O.Rule("layers.{i}.**", [O.Index("i", 8, "pp")]),
                  O.Rule("layers.*.w", [O.Replicate()])])
    vals = {"param/u": np.arange(5.0, dtype=np.float32), "param/s": np.arange(2.0, dtype=np.float32) + 10,
            "param/layers.5.w": np.arange(3.0, dtype=np.float32)}
    mesh = [("pp", 4), ("tp", 4)]
    got = L.shards(mesh, vals)
    assert [got[r]["param/u"].tolist() for r in range(4)] == [[0, 1], [2, 3], [4], []]
    assert [got[r]["param/s"].tolist() for r in range(4)] == [[10], [10], [11], [11]]
    # 8 layers over 4 stages: blocks of 2, layers.5 is on stage 2 and stored as layers.1
    # (docs/language.md says "stage 1 of 4 stages", which only holds for 2 stages; the local name agrees)
    assert [r for r in got if "param/layers.1.w" in got[r]] == [8, 9, 10, 11]
    assert_same(_ucl_scatter(L, mesh, vals), got)


def test_known_virtual_stages():
    params = [(f"layers.{i}.w", (1,)) for i in range(8)]
    L = O.Layout(params, [O.Rule("layers.{i}.**", [O.Index("i", 8, "pp", virtual=2)]),
                          O.Rule("layers.*.w", [O.Replicate()])])
    vals = {f"param/layers.{i}.w": np.array([i], dtype=np.float32) for i in range(8)}
    got = L.shards([("pp", 2)], vals)
    assert {k: v.tolist() for k, v in got[0].items()} == {
        "param/layers.0.w": [0], "param/layers.1.w": [1], "param/layers.2.w": [4], "param/layers.3.w": [5]}
    assert {k: v.tolist() for k, v in got[1].items()} == {
        "param/layers.0.w": [2], "param/layers.1.w": [3], "param/layers.2.w": [6], "param/layers.3.w": [7]}
    assert_same(_ucl_scatter(L, [("pp", 2)], vals), got)


def test_known_flat_zero1():
    # two params on dp=2: buffer [a(3) | pad | b(4)] aligned to 2 -> 3 + 1 + 4 = 8, 4 per rank
    L = O.Layout([("a", (3,)), ("b", (2, 2))], [O.Rule("a", [O.Replicate()]), O.Rule("b", [O.Replicate()])],
                 [O.State(("exp_avg",), O.Flat(("dp",), align=2)), O.State(("step",), "scalar")])
    vals = {"param/a": np.arange(3.0, dtype=np.float32), "param/b": np.arange(4.0, dtype=np.float32).reshape(2, 2),
            "exp_avg/a": np.array([1, 2, 3], dtype=np.float32), "exp_avg/b": np.array([[4, 5], [6, 7]], dtype=np.float32),
            "step/a": np.array(9, dtype=np.float32), "step/b": np.array(8, dtype=np.float32)}
    got = L.shards([("dp", 2)], vals)
    assert got[0]["exp_avg/@flat0"].tolist() == [1, 2, 3, 0]
    assert got[1]["exp_avg/@flat0"].tolist() == [4, 5, 6, 7]
    assert got[1]["step/a"].shape == ()
    assert_same(_ucl_scatter(L, [("dp", 2)], vals), got)


# ---- regressions and bugs found by these properties --------------------------------------------------
def _roundtrip(L, mesh):
    values = make_values(L, 7)
    want = L.shards(mesh, values)
    model = bind(L)
    got = ucl.execute_memory(ucl.compile(model, ucl.UNIVERSAL, ucl.Mesh(mesh)), L.universal(values))
    assert_same(got, want, "scatter")
    back = ucl.execute_memory(ucl.compile(model, ucl.Mesh(mesh), ucl.UNIVERSAL), got)
    assert_same(back, L.universal(values), "gather")
    other = [(a, s) for a, s in reversed(mesh)]
    assert_same(ucl.execute_memory(ucl.compile(model, ucl.Mesh(mesh), ucl.Mesh(other)), got),
                L.shards(other, values), "reshard")


def test_regression_gqa_fused_qkv_shared_kv_heads():
    """HF-style fused [Q; K; V] with fewer KV heads than TP ranks: K/V replicated, Q split. Ranks hold the
    same K/V elements but different Q elements (was: PlanError UCL313 'overlapping, non-identical replicas'
    when used as a source; fixed in 47dd34f)."""
    L = O.Layout([("qkv", (6, 2))], [O.Rule("qkv", [
        O.Concat((0,), (("q", 4), ("k", 1), ("v", 1))), O.View((0, "k"), (1, 1)), O.View((0, "v"), (1, 1)),
        O.Split((0, "q"), ("tp",)), O.Split((0, "k", 0), ("tp",), "shared"), O.Split((0, "v", 0), ("tp",), "shared")])])
    _roundtrip(L, [("dp", 2), ("tp", 2)])


def test_flat_state_of_fused_qkv_with_shared_kv_heads():
    """The same fused [Q; K; V] with its Adam state flattened over dp: on the target, its rank-local
    tensors before flattening only partly coincide (same K/V, other Q), so their proof cuts them
    into boxes (docs/ir.md: P1 on the target, for flat tensors)."""
    L = O.Layout([("qkv", (6, 2))], [O.Rule("qkv", [
        O.Concat((0,), (("q", 4), ("k", 1), ("v", 1))), O.View((0, "k"), (1, 1)), O.View((0, "v"), (1, 1)),
        O.Split((0, "q"), ("tp",)), O.Split((0, "k", 0), ("tp",), "shared"), O.Split((0, "v", 0), ("tp",), "shared")])],
                 [O.State(("exp_avg",), O.Flat(("dp",)))])
    _roundtrip(L, [("dp", 2), ("tp", 2)])


def test_regression_partially_split_concat():
    L = O.Layout([("w", (4,))], [O.Rule("w", [O.Concat((0,), (("a", 2), ("b", 2))), O.Split((0, "a"), ("tp",))])])
    _roundtrip(L, [("tp", 2)])


def test_regression_tied_embedding_zero1_pp():
    """Tied embedding on the first and last stage, ZeRO-1 over dp: the stage buffers differ in size, so the
    embedding's optimizer state is cut differently on each stage (was: PlanError UCL313; fixed in 47dd34f)."""
    L = O.Layout([("embed", (4,)), ("layers.0.w", (4,)), ("layers.1.w", (2,))],
                 [O.Rule("embed", [O.On("pp", ("first", "last"))], ["4"]),
                  O.Rule("layers.{i}.**", [O.Index("i", 2, "pp")]),
                  O.Rule("layers.*.w", [O.Replicate()])],
                 [O.State(("exp_avg",), O.Flat(("dp",)))])
    _roundtrip(L, [("pp", 2), ("dp", 2)])


def test_fsdp_on_top_of_swiglu_tp():
    """`view 0 as [2, ffn]; split 0.1 over tp; split 0 over dp uneven`: dp cuts each TP rank's [gate_r; up_r]."""
    L = O.Layout([("fc1", (12, 2))], [O.Rule("fc1", [O.View((0,), (2, 6)), O.Split((0, 1), ("tp",)),
                                                      O.Split((0,), ("dp",), "uneven")])])
    vals = {"param/fc1": np.arange(24, dtype=np.float32).reshape(12, 2)}
    got = L.shards([("tp", 2), ("dp", 4)], vals)
    # tp rank 0 holds rows [0, 1, 2, 6, 7, 8]; dp=4 uneven chunks of 2: [0, 1], [2, 6], [7, 8], []
    assert [got[r]["param/fc1"][:, 0].tolist() for r in range(4)] == [[0, 2], [4, 12], [14, 16], []]
    _roundtrip(L, [("tp", 2), ("dp", 4)])


def test_regression_concat_split_then_factor_split_is_refused_or_honoured():
    """Once silently dropped the tp split of a viewed part; now refused like the direct form."""
    text = ("mesh dp, tp\n"
            "w [12] : concat 0 as [a = 4, b = 8]; view 0.b as [2, 4]; split 0 over tp; split 0.b.1 over dp\n")
    try:
        model = ucl.load_spec(text).bind(dims={}, params={"w": (12,)})
        plan = ucl.compile(model, ucl.UNIVERSAL, ucl.Mesh(dp=2, tp=2))
    except ucl.UclError:
        return  # refusing it is a fix
    got = ucl.execute_memory(plan, {0: {"param/w": np.arange(12, dtype=np.float32)}})
    # a split over tp (of every part) then over dp: every rank holds a quarter of the tensor
    assert all(d["param/w"].size == 3 for d in got.values()), {r: d["param/w"].tolist() for r, d in got.items()}


def test_fsdp_on_top_of_tp_fused_qkv():
    """`concat 0 as [q = 4, k = 2]; split 0 over tp; split 0 over dp uneven`: the first split of a concat
    splits every part ([q_r; k_r]); the second applies "to what the previous left" (docs: split D twice),
    i.e. it cuts each TP rank's local [q_r; k_r] like FSDP2's torch.chunk."""
    L = O.Layout([("qkv", (6,))], [O.Rule("qkv", [O.Concat((0,), (("q", 4), ("k", 2))), O.Split((0,), ("tp",)),
                                                   O.Split((0,), ("dp",), "uneven")])])
    vals = {"param/qkv": np.arange(6, dtype=np.float32)}
    got = L.shards([("tp", 2), ("dp", 2)], vals)
    # tp0 holds [q0, q1, k0] = [0, 1, 4]; tp1 holds [q2, q3, k1] = [2, 3, 5]; dp cuts chunks of 2
    assert [got[r]["param/qkv"].tolist() for r in range(4)] == [[0, 1], [4], [2, 3], [5]]
    _roundtrip(L, [("tp", 2), ("dp", 2)])


def test_regression_axis_splitting_twice_is_refused():
    """`split 0 over tp; split 1 over tp` would keep only the diagonal blocks (P1)."""
    with pytest.raises(ucl.UclError):
        model = ucl.load_spec("mesh tp\nw [2, 2] : split 0 over tp; split 1 over tp\n").bind(dims={}, params={"w": (2, 2)})
        ucl.compile(model, ucl.UNIVERSAL, ucl.Mesh(tp=2))
