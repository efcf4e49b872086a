"""Hostile-input fuzzing (docs/security.md): hypothesis mutates spec text, manifest JSON and rank
files; each case runs in a forked child under a memory and a time limit and must end in a UclError
or in exactly the right bytes, with nothing published on failure. An output equal to the truth
holds no byte from outside the checkpoint (the outside files are filled with a marker pattern).

The default run tries a few examples of each; ``UCL_FUZZ_EXAMPLES=N`` runs more (``.ci/run`` does).
"""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import resource
import shutil
import traceback

import h5py
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ucl
from ucl.demo import universal_state
from ucl.errors import UclError
from ucl.layout import lower

EXAMPLES = int(os.environ.get("UCL_FUZZ_EXAMPLES", "10"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
CASE_SECONDS = 60
CASE_MEMORY = 1 << 30  # on top of what the test process already maps

SPEC = """\
dims n, vocab, layers
mesh pp, dp, tp
layers.{i}.** : index i of layers over pp
embed.weight [vocab, n] : pad 0 to multiple_of(8 * tp); split 0 over tp; on pp = first
layers.{i}.w [n, n] : split 1 over tp
layers.{i}.norm [n] : replicate over tp
head.weight [vocab, n] : split 0 over tp uneven; on pp = last
state param : dtype bfloat16
state fp32, exp_avg : dtype float32; flat over dp align 4 pad to multiple_of(4 * dp)
state step : dtype int64; scalar
"""
DIMS = dict(n=48, vocab=200, layers=2)
SRC, TARGETS = "pp=2,dp=2,tp=2", ("tp=4", "dp=2", "universal", "pp=2,tp=2")
MARKER = np.frombuffer(b"\xde\xad\xbe\xef" * 8, np.uint8)  # fills every file outside the checkpoint


def _params():
    p = {"embed.weight": (DIMS["vocab"], DIMS["n"])}
    for i in range(DIMS["layers"]):
        p[f"layers.{i}.w"] = (DIMS["n"], DIMS["n"])
        p[f"layers.{i}.norm"] = (DIMS["n"],)
    p["head.weight"] = (DIMS["vocab"], DIMS["n"])
    return p


@pytest.fixture(scope="module", params=[None, "zstd"], ids=["plain", "zstd"])
def world(tmp_path_factory, request):
    """The pristine source checkpoint (plain, or in the compressed encoding) and, as the oracle,
    every target's shards computed in memory."""
    model = ucl.Spec.from_text(SPEC, "fuzz.ucl").bind(DIMS, _params())
    truth = universal_state(model, seed=5)
    root = tmp_path_factory.mktemp("fuzz")
    src_shards = ucl.execute_memory(ucl.compile(model, ucl.UNIVERSAL, SRC), {0: truth})
    src = ucl.save(root / "src", src_shards, model=model, mesh=SRC, state={"step": 3}, compress=request.param)
    expected = {t: ucl.execute_memory(ucl.compile(model, ucl.UNIVERSAL, t), {0: truth}) for t in TARGETS}
    return {"src": src, "expected": expected, "model": model, "fuzz": FUZZ if request.param is None else
            settings(FUZZ, max_examples=max(3, EXAMPLES // 4))}  # the compressed source: a quarter as many


# ---------------------------------------------------------------- a case in a limited child

def _vm_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


def _child(conn, fn, args):
    try:
        limit = _vm_bytes() + CASE_MEMORY
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        out = ("ok", fn(*args))
    except UclError as e:
        out = ("ucl", e.code, str(e)[:3000])
    except BaseException as e:  # anything else is a bug: report it with its traceback
        out = ("bug", f"{type(e).__name__}: {str(e)[:500]}", traceback.format_exc()[-4000:])
    try:
        conn.send(out)
    finally:
        os._exit(0)


def run_limited(fn, *args):
    """``fn(*args)`` in a forked child under CASE_MEMORY and CASE_SECONDS: ("ok", result),
    ("ucl", code, message) or ("bug", what, traceback)."""
    ctx = mp.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)
    p = ctx.Process(target=_child, args=(send, fn, args))
    p.start()
    send.close()
    try:
        if not recv.poll(CASE_SECONDS):
            p.kill()
            return ("bug", f"took more than {CASE_SECONDS} s", "")
        try:
            return recv.recv()
        except EOFError:
            return ("bug", f"the child died (exit code {p.exitcode}): killed for memory?", "")
    finally:
        p.join(5)
        if p.is_alive():
            p.kill()


def _load_and_reshard(src, dst, target, rank):
    got = ucl.load_rank(src, mesh=target, rank=rank)
    ucl.reshard(src, dst, to=target, workers=1)
    with ucl.open(dst) as c:
        assert c.verify() == [], "a freshly written checkpoint does not verify"
        written = {r: {k: c.read(r, k).tobytes() for k in c.keys(r)} for r in range(c.nranks)}
    return {"load": {k: v.tobytes() for k, v in got.items()}, "reshard": written}


def assert_refused_or_exact(world, result, dst, target, rank, what):
    kind = result[0]
    assert kind != "bug", f"{what}: {result[1]}\n{result[2]}"
    if kind == "ucl":
        assert not os.path.exists(dst), f"{what}: refused ({result[1]}) but {dst} was published"
        leftovers = [n for n in os.listdir(os.path.dirname(dst)) if ".tmp-" in n]
        assert leftovers == [], f"{what}: temp dirs left behind: {leftovers}"
        return
    want = world["expected"][target]
    got = result[1]
    assert got["load"] == {k: np.asarray(v).tobytes() for k, v in want[rank].items()}, f"{what}: load_rank bytes differ"
    stored = {r: lower(world["model"], ucl.Mesh.parse(target)).rank_datasets(r, stored=True) for r in want}
    assert got["reshard"] == {r: {k: np.asarray(v).tobytes() for k, v in want[r].items() if k in stored[r]}
                              for r in want}, f"{what}: resharded bytes differ"


def _fresh_copy(world, tmp_path, n=[0]):
    n[0] += 1
    case = tmp_path / f"case{n[0]}"
    os.makedirs(case / "out")
    shutil.copytree(world["src"], case / "src")
    return str(case / "src"), str(case / "out" / "dst"), case


# ---------------------------------------------------------------- manifest JSON mutations

HOSTILE_VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-2 ** 70, 2 ** 70), st.sampled_from([0, -1, 2 ** 62, 2 ** 63, 10 ** 12]),
    st.floats(allow_nan=False), st.text(max_size=20), st.sampled_from(["../x.h5", "/etc/passwd", "rank_00000.h5",
                                                                         "xxh3_64:" + "0" * 16]),
    st.lists(st.integers(-3, 10 ** 12), max_size=4), st.dictionaries(st.text(max_size=5), st.integers(), max_size=2),
)


def _paths(value, prefix=()):
    """Every path into a JSON value (dict keys, list indices)."""
    yield prefix
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value[:6]):  # enough of each list to reach every kind of leaf
            yield from _paths(v, prefix + (i,))


@st.composite
def manifest_mutations(draw, doc):
    paths = [p for p in _paths(doc) if p]
    path = draw(st.sampled_from(paths))
    op = draw(st.sampled_from(["replace", "delete", "spec-edit"]))
    return path, op, draw(HOSTILE_VALUES), draw(st.integers(0, 10 ** 6)), draw(st.text(max_size=8))


def _apply_manifest_mutation(doc, mutation):
    path, op, value, pos, text = mutation
    if op == "spec-edit":
        spec = doc["spec"]
        i = pos % (len(spec) + 1)
        doc["spec"] = spec[:i] + text + spec[i + len(text):]
        return
    parent = doc
    for p in path[:-1]:
        parent = parent[p]
    last = path[-1]
    if op == "delete":
        if isinstance(parent, dict):
            del parent[last]
        else:
            parent.pop(last)
    else:
        parent[last] = value


def test_manifest_mutations(world, tmp_path):
    with open(os.path.join(world["src"], "manifest.json")) as f:
        pristine = json.load(f)

    @world["fuzz"]
    @given(data=st.data(), target=st.sampled_from(TARGETS), rank_seed=st.integers(0, 1000))
    def case(data, target, rank_seed):
        mutation = data.draw(manifest_mutations(pristine))
        src, dst, _ = _fresh_copy(world, tmp_path)
        doc = json.loads(json.dumps(pristine))
        _apply_manifest_mutation(doc, mutation)
        with open(os.path.join(src, "manifest.json"), "w") as f:
            json.dump(doc, f)
        rank = rank_seed % ucl.Mesh.parse(target).size
        result = run_limited(_load_and_reshard, src, dst, target, rank)
        assert_refused_or_exact(world, result, dst, target, rank, f"manifest mutation {mutation!r}")

    case()


# ---------------------------------------------------------------- rank file mutations

def _marker_file(path, like):
    """An HDF5 file outside the checkpoint with ``like``'s datasets, every byte the marker."""
    with h5py.File(like, "r") as src, h5py.File(path, "w") as out:
        for kind in src:
            if not isinstance(src[kind], h5py.Group):  # ucl_tables
                continue
            for name in src[kind]:
                d = src[kind][name]
                n = d.size * d.dtype.itemsize
                raw = np.resize(MARKER, n).view(d.dtype).reshape(d.shape)
                out.require_group(kind).create_dataset(name, data=raw)
                for k, v in d.attrs.items():
                    out[kind][name].attrs[k] = v


def _datasets(path):
    with h5py.File(path, "r") as f:
        return [f"{k}/{n}" for k in f if isinstance(f[k], h5py.Group) for n in f[k]]


FILE_OPS = ("external", "soft", "hard", "virtual", "swap", "reshape", "chunk_bytes", "chunk_table", "tile_table",
            "truncate", "flip", "symlink_outside", "extra_dataset")


def _mutate_rank_file(src, outside_dir, op, rank, other, pick, number):
    path = os.path.join(src, f"rank_{rank:05d}.h5")
    keys = sorted(_datasets(path))
    key = keys[pick % len(keys)]
    kind, name = key.split("/")
    outside = os.path.join(outside_dir, f"outside_{rank}.h5")
    _marker_file(outside, path)
    if op == "swap":
        o = os.path.join(src, f"rank_{other:05d}.h5")
        if o != path:
            os.rename(path, path + ".x"), os.rename(o, path), os.rename(path + ".x", o)
        return
    if op == "symlink_outside":
        os.unlink(path)
        os.symlink(outside, path)
        return
    if op in ("truncate", "flip"):
        size = os.path.getsize(path)
        at = number % size
        with open(path, "r+b") as fh:
            if op == "truncate":
                fh.truncate(at)
            else:
                fh.seek(at)
                b = fh.read(1)
                fh.seek(at)
                fh.write(bytes([b[0] ^ (1 + number % 255)]))
        return
    with h5py.File(path, "r+") as f:
        g, d = f[kind], f[key]
        if op in ("chunk_bytes", "chunk_table"):
            if op == "chunk_bytes":
                d.attrs["ucl_chunk_bytes"] = [0, 1, -4, 2 ** 40, number][number % 5]
            else:
                d.attrs["ucl_chunks"] = np.arange(number % 2000, dtype=np.uint64)
            return
        if op == "tile_table":  # one digest off, a flat table, or a grid of another shape
            table = d.attrs.get("ucl_tiles")
            if table is not None and number % 3 == 0:
                table = np.array(table, dtype=np.uint64)
                table.flat[number % table.size] ^= np.uint64(1 + number % 255)
                d.attrs["ucl_tiles"] = table
            elif number % 3 == 1:
                d.attrs["ucl_tiles"] = np.arange(number % 2000, dtype=np.uint64)
            else:
                d.attrs["ucl_tiles"] = np.zeros((1 + number % 40, 1 + pick % 40), dtype=np.uint64)
            return
        if op == "extra_dataset":
            g.create_dataset(name + "_extra", data=np.resize(MARKER, 64))
            return
        shape, dtype, attrs = d.shape, d.dtype, dict(d.attrs)
        other_key = keys[(pick + 1 + number) % len(keys)]
        del g[name]
        if op == "external":
            g[name] = h5py.ExternalLink(outside, "/" + key)
        elif op == "soft":
            g[name] = h5py.SoftLink("/" + other_key)
        elif op == "hard":
            if other_key != key:
                g[name] = f[other_key]
        elif op == "virtual":
            layout = h5py.VirtualLayout(shape=shape, dtype=dtype)
            layout[...] = h5py.VirtualSource(outside, key, shape=shape)
            g.create_virtual_dataset(name, layout)
        elif op == "reshape":
            new = tuple(max(0, s + (number % 3) - 1) for s in shape) or (1,)
            g.create_dataset(name, data=np.resize(MARKER, int(np.prod(new)) * dtype.itemsize).view(dtype).reshape(new))
            for k, v in attrs.items():
                g[name].attrs[k] = v


def test_rank_file_mutations(world, tmp_path):
    nsrc = ucl.Mesh.parse(SRC).size

    @world["fuzz"]
    @given(op=st.sampled_from(FILE_OPS), rank=st.integers(0, nsrc - 1), other=st.integers(0, nsrc - 1),
           pick=st.integers(0, 100), number=st.integers(0, 10 ** 6), target=st.sampled_from(TARGETS),
           rank_seed=st.integers(0, 1000))
    def case(op, rank, other, pick, number, target, rank_seed):
        src, dst, case_dir = _fresh_copy(world, tmp_path)
        _mutate_rank_file(src, str(case_dir), op, rank, other, pick, number)
        trank = rank_seed % ucl.Mesh.parse(target).size
        result = run_limited(_load_and_reshard, src, dst, target, trank)
        assert_refused_or_exact(world, result, dst, target, trank, f"{op} on rank {rank} ({pick}, {number}, {other})")

    case()


# ---------------------------------------------------------------- spec text mutations

def _parse_bind_compile(path):
    spec = ucl.load_spec(path)
    model = spec.bind(DIMS, _params())
    return ucl.compile(model, SRC, "tp=4").summary()


@FUZZ
@given(data=st.data())
def test_spec_text_mutations(tmp_path_factory, data):
    raw = SPEC.encode()
    op = data.draw(st.sampled_from(["bytes", "repeat", "number", "nest"]))
    i = data.draw(st.integers(0, len(raw)))
    if op == "bytes":
        raw = raw[:i] + data.draw(st.binary(max_size=12)) + raw[i + data.draw(st.integers(0, 12)):]
    elif op == "repeat":
        line = raw.splitlines(keepends=True)[i % len(raw.splitlines())]
        raw = raw + line * data.draw(st.sampled_from([2, 1000, 20000]))
    elif op == "number":
        raw = raw[:i] + str(data.draw(st.sampled_from([10 ** 12, 2 ** 63, 2 ** 64 + 1, 0, -1]))).encode() + raw[i:]
    else:
        depth = data.draw(st.sampled_from([100, 5000, 100000]))
        raw = raw.replace(b"[n, n] : split 1", b"[" + b"(" * depth + b"n" + b")" * depth + b", n] : split 1", 1)
    path = tmp_path_factory.mktemp("spec") / "fuzzed.ucl"
    path.write_bytes(raw)
    result = run_limited(_parse_bind_compile, str(path))
    assert result[0] != "bug", f"spec mutation {op} at {i}: {result[1]}\n{result[2]}"
