"""Checkpoints on disk, end to end: save a layout, reshard it to other layouts (and to the universal
form) bit-exactly, load one rank of any layout straight from any other, and refuse bad input without
leaving anything half-written behind.

Uses the built-in Llama-style model (``ucl.demo``): bf16 weights, fp32 master + Adam moments in
ZeRO-1 flat buffers over dp (padded to a multiple of 64 * dp), int64 step scalars; heads=8,
kv_heads=4, vocab=1000, layers=4, ffn=704.
"""
from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import h5py
import numpy as np
import pytest
import torch

import ucl
from tests.corrupt import flip_byte, without_offsets
import ucl.store.writer as store_writer
from ucl.ops import IOStats, expected_datasets
from ucl.demo import llama_model, universal_state
from ucl.errors import BindError, StoreError, UclError
from ucl.dtypes import to_numpy, to_torch
from ucl.store import FORMAT_VERSION, READ_VERSION, Checkpoint, cleanup_stale

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
U = ucl.UNIVERSAL
M = ucl.Mesh.parse


# ---------------------------------------------------------------- helpers

@pytest.fixture(scope="module")
def demo():
    model = llama_model()
    return model, universal_state(model, seed=0)


_SHARDS: dict = {}


def shards_for(model, truth, mesh):
    """Expected rank -> key -> storage array of ``truth`` in layout ``mesh`` (in memory, no I/O)."""
    k = (id(model), id(truth), mesh)
    if k not in _SHARDS:
        _SHARDS[k] = ucl.execute_memory(ucl.compile(model, U, mesh), {0: truth})
    return _SHARDS[k]


def stored_for(model, truth, mesh):
    """What a checkpoint of ``truth`` in layout ``mesh`` stores per rank: every rank's shards, less the
    replicas another rank stores (format 2: a dataset several ranks hold alike, on the first of them)."""
    shards = shards_for(model, truth, mesh)
    return {r: {k: v for k, v in shards[r].items() if k in expected_datasets(model, mesh, r, stored=True)}
            for r in shards}


@pytest.fixture(scope="module")
def saved(demo, tmp_path_factory):
    """Committed source checkpoints of the demo model, one per mesh, written once per module."""
    model, truth = demo
    root = tmp_path_factory.mktemp("sources")
    cache: dict[str, str] = {}

    def get(mesh_text: str, state=None) -> str:
        if mesh_text not in cache:
            mesh = M(mesh_text)
            name = mesh_text.replace(",", "_").replace("=", "") or "universal"
            cache[mesh_text] = ucl.save(root / name, shards_for(model, truth, mesh), model=model, mesh=mesh,
                                        state=state if state is not None else {"step": 1000})
        return cache[mesh_text]

    return get


def read_all(path) -> dict[int, dict[str, np.ndarray]]:
    with ucl.open(path) as c:
        return {r: {k: c.read(r, k) for k in c.keys(r)} for r in range(c.nranks)}


def assert_same_shards(got: dict, want: dict, what: str = "") -> None:
    assert sorted(got) == sorted(want), f"{what}: ranks differ"
    for r in want:
        assert sorted(got[r]) == sorted(want[r]), f"{what}: rank {r} keys differ"
        for k, w in want[r].items():
            g = np.asarray(got[r][k])
            assert g.dtype == w.dtype and g.shape == w.shape, f"{what}: rank {r} {k}: {g.dtype}{g.shape} != {w.dtype}{w.shape}"
            assert g.tobytes() == w.tobytes(), f"{what}: rank {r} {k}: bytes differ"


def visible(parent) -> list[str]:
    return sorted(n for n in os.listdir(parent) if not n.startswith("."))


def temps(parent) -> list[str]:
    return sorted(n for n in os.listdir(parent) if ".tmp-" in n)


def assert_nothing_left(parent, before: list[str]) -> None:
    """No new visible checkpoint and no temp directory in ``parent``."""
    assert visible(parent) == before
    assert temps(parent) == []


def assert_intact(path, model, truth, mesh) -> None:
    """A committed checkpoint that verifies clean, stores exactly the expected shards (replicas once)
    and gives every rank all it holds."""
    with ucl.open(path) as c:
        assert c.verify() == []
    assert_same_shards(read_all(path), stored_for(model, truth, mesh), f"{path}")
    want = shards_for(model, truth, mesh)
    for r in range(mesh.size):
        assert_same_shards({r: ucl.load_rank(path, mesh=mesh, rank=r)}, {r: want[r]}, f"{path} load_rank {r}")


def snapshot(path) -> dict[str, tuple[int, bytes]]:
    out = {}
    for dirpath, _, files in os.walk(path):
        for f in files:
            p = os.path.join(dirpath, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, path)] = (os.stat(p).st_mtime_ns, fh.read())
    return out


# ---------------------------------------------------------------- resharding is bit-exact

CHAINS = [
    ("pp=2,dp=2,tp=2", "pp=1,dp=2,tp=4"),
    ("pp=4,dp=1,tp=1", "dp=3"),               # flat buffers padded to multiple_of(64 * 3)
    ("dp=3,tp=2", "pp=2,dp=1,tp=4"),
    ("universal", "pp=2,dp=3,tp=2"),          # scatter from the consolidated form
]


@pytest.mark.parametrize("a,b", CHAINS, ids=[f"{a}->{b}" for a, b in CHAINS])
def test_reshard_a_to_b_to_universal_is_bit_exact(demo, saved, tmp_path, a, b):
    model, truth = demo
    A, B = M(a), M(b)
    src = saved(a)
    assert_intact(src, model, truth, A)

    stats = ucl.reshard(src, tmp_path / "B", B)
    assert isinstance(stats, IOStats) and stats.bytes_written > 0 and stats.datasets_written > 0
    assert_intact(tmp_path / "B", model, truth, B)
    with ucl.open(tmp_path / "B") as c:
        assert ucl.Mesh.from_json(c.manifest.mesh) == B and c.nranks == B.size
        assert c.manifest.spec == model.spec.text and c.manifest.dims == model.dims

    ucl.reshard(tmp_path / "B", tmp_path / "U", U)
    got = read_all(tmp_path / "U")
    assert list(got) == [0]
    assert_same_shards(got, {0: truth}, "B -> universal")
    assert sorted(visible(tmp_path)) == ["B", "U"] and temps(tmp_path) == []


def test_dp3_flat_buffers_are_padded_to_64_dp(demo, saved, tmp_path):
    model, truth = demo
    ucl.reshard(saved("pp=4,dp=1,tp=1"), tmp_path / "dp3", M("dp=3"))
    numel = sum(int(np.prod(s)) for s in model.params.values())
    with ucl.open(tmp_path / "dp3") as c:
        sizes = {c.info(r, k).shape for r in range(3) for k in ("fp32/@flat0", "exp_avg/@flat0", "exp_avg_sq/@flat0")}
        assert len(sizes) == 1
        (n,), = sizes
        assert (3 * n) % (64 * 3) == 0 and 3 * n >= numel
        # padding is zeros: the buffers hold numel real values, at most 3n - numel zeros more
        flat = np.concatenate([c.read(r, "fp32/@flat0") for r in range(3)])
        assert np.count_nonzero(flat) == numel


def test_direct_reshard_equals_reshard_through_universal(demo, saved, tmp_path):
    model, truth = demo
    src = saved("pp=2,dp=2,tp=2")
    B = M("dp=2,tp=4")
    ucl.reshard(src, tmp_path / "direct", B)
    ucl.reshard(src, tmp_path / "U", U)
    ucl.reshard(tmp_path / "U", tmp_path / "via", B)
    assert_same_shards(read_all(tmp_path / "direct"), read_all(tmp_path / "via"), "A->B vs A->U->B")


def test_reshard_to_the_same_layout_is_identity(demo, saved, tmp_path):
    model, truth = demo
    src = saved("pp=2,dp=2,tp=2")
    ucl.reshard(src, tmp_path / "same", M("pp=2,dp=2,tp=2"))
    assert_same_shards(read_all(tmp_path / "same"), read_all(src), "A->A")


def test_workers_1_and_2_write_identical_content(demo, saved, tmp_path):
    model, truth = demo
    src = saved("pp=2,dp=2,tp=2")
    B = M("pp=1,dp=2,tp=4")
    s1 = ucl.reshard(src, tmp_path / "w1", B, workers=1)
    s2 = ucl.reshard(src, tmp_path / "w2", B, workers=2)
    assert s1.bytes_written == s2.bytes_written and s1.datasets_written == s2.datasets_written
    m1 = json.loads((tmp_path / "w1" / "manifest.json").read_text())
    m2 = json.loads((tmp_path / "w2" / "manifest.json").read_text())
    for k in set(m1) | set(m2):
        if k != "created":
            assert m1.get(k) == m2.get(k), k  # checksums included
    assert_same_shards(read_all(tmp_path / "w1"), read_all(tmp_path / "w2"), "workers=1 vs 2")
    for f in m1["files"]:  # the rank files themselves are byte-identical
        assert (tmp_path / "w1" / f).read_bytes() == (tmp_path / "w2" / f).read_bytes(), f
    assert_same_shards(read_all(tmp_path / "w1"), stored_for(model, truth, B), "workers=1 vs truth")


def test_forked_workers_leave_the_callers_gc_as_it_was(saved, tmp_path):
    """The heap is frozen while workers fork from it (no copy-on-write by their collections), then
    thawed; a heap the caller froze stays frozen."""
    import gc
    src = saved("pp=2,dp=2,tp=2")
    assert gc.get_freeze_count() == 0
    ucl.reshard(src, tmp_path / "a", M("pp=1,dp=2,tp=4"), workers=2)
    assert gc.get_freeze_count() == 0
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        ucl.reshard(src, tmp_path / "b", M("pp=1,dp=2,tp=4"), workers=2)
        assert gc.get_freeze_count() == frozen
    finally:
        gc.unfreeze()


def test_progress_callback_counts_bytes(saved, tmp_path):
    seen = []
    stats = ucl.reshard(saved("pp=2,dp=2,tp=2"), tmp_path / "p", M("tp=2"), workers=1, progress=seen.append)
    assert sum(seen) == stats.bytes_written > 0


# ---------------------------------------------------------------- loading one rank

def test_load_rank_every_rank_equals_resharded_checkpoint(demo, saved, tmp_path):
    model, truth = demo
    src = saved("pp=2,dp=2,tp=2")
    B = M("pp=1,dp=2,tp=4")
    ucl.reshard(src, tmp_path / "B", B)
    for r in range(B.size):
        stats = IOStats()
        got = ucl.load_rank(src, mesh=B, rank=r, stats=stats)
        assert_same_shards({r: got}, {r: ucl.load_rank(tmp_path / "B", mesh=B, rank=r)}, f"load_rank {r}")
        assert 0 < stats.bytes_needed <= stats.bytes_read <= 2 * stats.bytes_needed, (r, stats)


def test_load_rank_reads_only_what_its_rank_needs(demo, saved, tmp_path, monkeypatch):
    """One rank of tp=4 from a tp=2 checkpoint: its split tensors come from the one source rank that
    holds them, as hyperslabs, and it reads far less than the whole checkpoint."""
    model, truth = demo
    src = saved("tp=2")
    with ucl.open(src) as c:
        whole = sum(c.info(r, k).size * c.info(r, k).storage_dtype.itemsize for r in range(c.nranks) for k in c.keys(r))
    log = []
    for name in ("read", "read_box", "read_flat", "read_runs"):
        orig = getattr(Checkpoint, name, None)
        if orig is None:
            continue

        def wrap(self, rank, key, *a, _orig=orig, _name=name, **k):
            out = _orig(self, rank, key, *a, **k)
            log.append((_name, int(rank), key, out.nbytes))
            return out
        monkeypatch.setattr(Checkpoint, name, wrap)

    T = M("tp=4")
    want = shards_for(model, truth, T)
    for r in range(4):
        log.clear()
        stats = IOStats()
        got = ucl.load_rank(src, mesh=T, rank=r, stats=stats)
        assert_same_shards({r: got}, {r: want[r]}, f"load_rank {r}")
        # verified partial reads round out to the checksum chunks around each box (docs/format.md)
        assert sum(x[3] for x in log) <= stats.bytes_read <= 2 * stats.bytes_needed
        plain = IOStats()
        ucl.load_rank(src, mesh=T, rank=r, stats=plain, verify=False)
        assert plain.bytes_read == plain.bytes_needed  # unverified: exactly the hyperslabs
        assert stats.bytes_read < 0.4 * whole, (stats.bytes_read, whole)
        with ucl.open(src) as c:
            for _, srank, key, nbytes in log:
                info = c.info(srank, key)
                if key.startswith("param/") and len(info.shape) == 2:  # tensors split over tp
                    assert srank == r // 2, (r, srank, key)
                    assert nbytes <= info.size * info.storage_dtype.itemsize // 2, (r, key, nbytes)


def test_load_rank_as_torch_is_bit_exact(demo, saved):
    model, truth = demo
    src = saved("pp=2,dp=2,tp=2")
    B = M("pp=1,dp=2,tp=4")
    want = shards_for(model, truth, B)
    got = ucl.load_rank(src, mesh=B, rank=5, as_torch=True)
    assert sorted(got) == sorted(want[5])
    kinds = set()
    for k, t in got.items():
        assert isinstance(t, torch.Tensor)
        kind = k.split("/")[0]
        kinds.add(kind)
        expect_dtype = {"param": torch.bfloat16, "step": torch.int64}.get(kind, torch.float32)
        assert t.dtype == expect_dtype, (k, t.dtype)
        arr, logical = to_numpy(t)
        assert arr.dtype == want[5][k].dtype and arr.tobytes() == want[5][k].tobytes(), k
    assert kinds == {"param", "fp32", "exp_avg", "exp_avg_sq", "step"}
    # and the bf16 values are the uint16 bits' top halves of float32
    k = "param/decoder.layers.0.self_attention.linear_qkv.weight"
    as_f32 = (want[5][k].astype(np.uint32) << 16).view(np.float32)
    assert torch.equal(got[k].float(), torch.from_numpy(as_f32))


def test_load_rank_of_universal(demo, saved):
    model, truth = demo
    got = ucl.load_rank(saved("dp=3,tp=2"), mesh=U, rank=0)
    assert_same_shards({0: got}, {0: truth}, "load universal")


@pytest.mark.parametrize("rank", [2, -1])
def test_load_rank_outside_the_mesh_is_an_error(saved, rank):
    with pytest.raises(UclError) as e:
        ucl.load_rank(saved("dp=3,tp=2"), mesh=M("tp=2"), rank=rank)
    assert str(rank) in str(e.value)


def test_save_accepts_torch_tensors(demo, tmp_path):
    model, truth = demo
    A = M("dp=2,tp=2")
    shards = shards_for(model, truth, A)
    plan = ucl.compile(model, U, A)
    dtypes = {d["key"]: d["dtype"] for d in plan.datasets}
    as_torch = {r: {k: to_torch(v, dtypes[k]) for k, v in d.items()} for r, d in shards.items()}
    ucl.save(tmp_path / "t", as_torch, model=model, mesh=A)
    assert_intact(tmp_path / "t", model, truth, A)


# ---------------------------------------------------------------- non-tensor state, frozen params

def test_non_tensor_state_survives_reshards(demo, tmp_path):
    import random
    model, truth = demo
    random.seed(7)
    py = random.getstate()
    np_state = np.random.RandomState(3).get_state()
    state = {
        "step": 1234,
        "rng": {"python": [py[0], list(py[1]), py[2]],
                "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
                "torch": torch.Generator().manual_seed(5).get_state().tolist()},
        "scheduler": {"last_epoch": 1233, "base_lrs": [3e-4], "_step_count": 1234, "warmup": 100},
        "data_position": {"epoch": 2, "sample": 123456, "shard": "part-00017"},
        "note": "ünïcode ok",
    }
    A = M("pp=2,dp=2,tp=2")
    ucl.save(tmp_path / "A", shards_for(model, truth, A), model=model, mesh=A, state=state)
    ucl.reshard(tmp_path / "A", tmp_path / "B", M("dp=3"))
    ucl.reshard(tmp_path / "B", tmp_path / "U", U)
    for name in ("A", "B", "U"):
        with ucl.open(tmp_path / name) as c:
            assert c.manifest.state == state, name
            assert c.state == state
        assert json.loads((tmp_path / name / "manifest.json").read_text())["state"] == state
    # the RNG states restore
    rs = state["rng"]
    random.setstate((rs["python"][0], tuple(rs["python"][1]), rs["python"][2]))
    random.seed(7)
    a = random.random()
    random.setstate((rs["python"][0], tuple(rs["python"][1]), rs["python"][2]))
    assert random.random() == a
    g = torch.Generator()
    g.set_state(torch.tensor(rs["torch"], dtype=torch.uint8))
    assert torch.equal(torch.rand(3, generator=g), torch.rand(3, generator=torch.Generator().manual_seed(5)))


def test_non_json_state_is_refused_before_writing(demo, tmp_path):
    model, truth = demo
    A = M("tp=2")
    with pytest.raises(UclError):
        ucl.save(tmp_path / "x", shards_for(model, truth, A), model=model, mesh=A, state={"bad": object()})
    assert_nothing_left(tmp_path, [])


TINY = """\
dims n, vocab, layers
mesh pp, dp, tp
layers.{i}.** : index i of layers over pp
embed.weight [vocab, n] : pad 0 to multiple_of(8 * tp); split 0 over tp; on pp = first
layers.{i}.w [n, n] : split 0 over tp
layers.{i}.lora_a [4, n] : split 1 over tp
layers.{i}.norm [n] : replicate over tp
head.weight [vocab, n] : split 0 over tp UNEVEN; on pp = last
state param : dtype bfloat16
state fp32, exp_avg, exp_avg_sq : dtype float32; flat over dp align 4 pad to multiple_of(4 * dp)
state step : dtype int64; scalar
"""


def tiny_model(uneven=True, frozen=(), n=12, vocab=10, layers=4):
    text = TINY.replace(" UNEVEN", " uneven" if uneven else "")
    params = {"embed.weight": (vocab, n)}
    for i in range(layers):
        params.update({f"layers.{i}.w": (n, n), f"layers.{i}.lora_a": (4, n), f"layers.{i}.norm": (n,)})
    params["head.weight"] = (vocab, n)
    spec = ucl.Spec.from_text(text, "tiny.ucl")
    return spec.bind(dict(n=n, vocab=vocab, layers=layers), params, frozen)


def test_frozen_params_are_stored_without_optimizer_state(tmp_path):
    frozen = ["embed.weight"] + [f"layers.{i}.w" for i in range(4)]
    model = tiny_model(frozen=frozen)
    truth = universal_state(model, seed=3)
    for f in frozen:
        assert f"param/{f}" in truth and not any(k.endswith("/" + f) and not k.startswith("param/") for k in truth)
    assert "exp_avg/layers.0.lora_a" in truth and "step/head.weight" in truth

    A, B = M("pp=2,dp=2,tp=2"), M("pp=1,dp=3,tp=2")
    ucl.save(tmp_path / "A", shards_for(model, truth, A), model=model, mesh=A, state={"step": 9})
    ucl.reshard(tmp_path / "A", tmp_path / "B", B)
    ucl.reshard(tmp_path / "B", tmp_path / "U", U)
    for name in ("A", "B", "U"):
        with ucl.open(tmp_path / name) as c:
            assert c.manifest.frozen == sorted(frozen), name
            assert c.verify() == []
    assert_intact(tmp_path / "B", model, truth, B)
    assert_same_shards(read_all(tmp_path / "U"), {0: truth}, "tiny universal")
    # the frozen weights are there (as bf16 params), and their optimizer states are nowhere
    with ucl.open(tmp_path / "A") as c:
        keys = {k for r in range(c.nranks) for k in c.keys(r)}
        assert "param/embed.weight" in keys and "param/layers.1.w" in keys
        assert c.info(0, "param/embed.weight").dtype == "bfloat16"
        assert not [k for k in keys if k.startswith("step/") and (k.endswith(".w") or "embed" in k)]
    # flat buffers hold only the trainable tensors
    trainable = sum(int(np.prod(s)) for p, s in model.params.items() if p not in frozen)
    got = ucl.load_rank(tmp_path / "A", mesh=M("pp=1,dp=1,tp=1"), rank=0)
    assert trainable <= got["fp32/@flat0"].size < trainable + 4 * (len(model.params) - len(frozen)) + 4


def test_uneven_split_allows_an_indivisible_mesh(tmp_path):
    model = tiny_model(uneven=True)   # head.weight [10, 12] over tp=3: torch.chunk pieces 4, 4, 2
    truth = universal_state(model, seed=4)
    A = M("pp=2,dp=2,tp=3")
    shards = shards_for(model, truth, A)
    assert [shards[A.rank(pp=1, dp=0, tp=t)]["param/head.weight"].shape[0] for t in range(3)] == [4, 4, 2]
    ucl.save(tmp_path / "A", shards, model=model, mesh=A)
    ucl.reshard(tmp_path / "A", tmp_path / "B", M("tp=2"))
    ucl.reshard(tmp_path / "B", tmp_path / "U", U)
    assert_same_shards(read_all(tmp_path / "U"), {0: truth}, "uneven round trip")


def test_uneven_split_with_flat_state_and_replicated_param_can_be_resharded(tmp_path):
    spec = ucl.Spec.from_text("dims n, v\nmesh dp, tp\na [v, n] : split 0 over tp uneven\n"
                              "b [n] : replicate over tp\nstate fp32 : flat over dp pad to multiple_of(dp)\n", "mini.ucl")
    model = spec.bind(dict(n=2, v=2), {"a": (2, 2), "b": (2,)})
    truth = universal_state(model, seed=0)
    A = M("dp=2,tp=3")
    # a replicated parameter's flat state sits at other flat offsets (and straddles other dp ranks) on
    # each tp coordinate, since the uneven split makes the tp-local buffers differ in size
    ucl.save(tmp_path / "A", shards_for(model, truth, A), model=model, mesh=A)
    ucl.reshard(tmp_path / "A", tmp_path / "U", U)
    assert_same_shards(read_all(tmp_path / "U"), {0: truth}, "uneven + flat")


# ---------------------------------------------------------------- bad input: nothing half-written

def _bad_shards(shards, how):
    out = {r: dict(v) for r, v in shards.items()}
    key = "param/decoder.layers.0.mlp.linear_fc2.weight"
    if how == "missing":
        del out[1][key]
    elif how == "extra":
        out[1]["param/decoder.layers.0.mlp.bogus"] = np.zeros((3,), np.float32)
    elif how == "mis-shaped":
        out[1][key] = out[1][key][:-1]
    elif how == "mis-dtyped":
        out[1][key] = out[1][key].astype(np.float32)
    elif how == "mis-dtyped-torch":
        out[1][key] = torch.zeros(out[1][key].shape, dtype=torch.float16)
    elif how == "missing-rank":
        del out[3]
    return out, key


@pytest.mark.parametrize("how,needles", [
    ("missing", ["rank 1", "missing", "param/decoder.layers.0.mlp.linear_fc2.weight", "[256, 352]", "bfloat16",
                 "rule `decoder.layers.{i}.mlp.linear_fc2.weight`"]),
    ("extra", ["rank 1", "unexpected", "param/decoder.layers.0.mlp.bogus", "pp=2,dp=2,tp=2"]),
    ("mis-shaped", ["rank 1", "param/decoder.layers.0.mlp.linear_fc2.weight", "expected [256, 352] bfloat16",
                    "got [255, 352]", "rule `decoder.layers.{i}.mlp.linear_fc2.weight`", "pp=2,dp=2,tp=2"]),
    ("mis-dtyped", ["param/decoder.layers.0.mlp.linear_fc2.weight", "expected [256, 352] bfloat16",
                    "got [256, 352] float32", "rule `decoder.layers.{i}.mlp.linear_fc2.weight`"]),
    ("mis-dtyped-torch", ["param/decoder.layers.0.mlp.linear_fc2.weight", "bfloat16", "float16"]),
    ("missing-rank", ["ranks 0..7"]),
])
def test_save_rejects_bad_tensors_and_writes_nothing(demo, tmp_path, how, needles):
    model, truth = demo
    A = M("pp=2,dp=2,tp=2")
    bad, _ = _bad_shards(shards_for(model, truth, A), how)
    (tmp_path / "older").mkdir()
    before = visible(tmp_path)
    with pytest.raises(UclError) as e:
        ucl.save(tmp_path / "ckpt", bad, model=model, mesh=A)
    msg = str(e.value)
    for n in needles:
        assert n in msg, (n, msg)
    assert e.value.code.startswith("UCL")
    assert_nothing_left(tmp_path, before)


def test_mesh_not_dividing_a_split_dim_names_param_shape_mesh(demo, saved, tmp_path):
    model, truth = demo
    with pytest.raises(BindError) as e:
        ucl.compile(model, U, M("tp=3"))
    msg = str(e.value)
    for n in ("decoder.layers.0.self_attention.linear_qkv.weight", "[512, 256]", "tp=3", "split 0.0 over tp",
              "uneven", "error[UCL204]", "^^^"):
        assert n in msg, (n, msg)
    before = visible(tmp_path)
    with pytest.raises(UclError) as e:
        ucl.reshard(saved("pp=2,dp=2,tp=2"), tmp_path / "t3", M("pp=2,dp=1,tp=3"))
    assert "linear_qkv.weight" in str(e.value) and "tp=3" in str(e.value)
    with pytest.raises(UclError):
        ucl.load_rank(saved("pp=2,dp=2,tp=2"), mesh=M("tp=8"), rank=0)   # kv_heads=4 < 8
    assert_nothing_left(tmp_path, before)


def test_indivisible_split_without_uneven_is_refused(tmp_path):
    model = tiny_model(uneven=False)
    with pytest.raises(BindError) as e:
        ucl.compile(model, U, M("tp=3"))
    msg = str(e.value)
    for n in ("head.weight", "[10, 12]", "tp=3", "uneven", "tiny.ucl:8:"):
        assert n in msg, (n, msg)
    with pytest.raises(UclError):
        ucl.save(tmp_path / "x", {0: {}, 1: {}, 2: {}}, model=model, mesh=M("tp=3"))
    assert_nothing_left(tmp_path, [])


def test_unknown_mesh_axis_is_refused(saved, tmp_path):
    with pytest.raises(UclError) as e:
        ucl.reshard(saved("pp=2,dp=2,tp=2"), tmp_path / "x", M("ep=2"))
    assert "ep" in str(e.value)
    assert_nothing_left(tmp_path, [])


def _copy(src, dst):
    shutil.copytree(src, dst)
    return str(dst)


def test_truncated_rank_file_is_named(demo, saved, tmp_path):
    bad = _copy(saved("dp=2,tp=2"), tmp_path / "src")
    f = os.path.join(bad, "rank_00001.h5")
    with open(f, "r+b") as fh:
        fh.truncate(os.path.getsize(f) // 2)
    out = tmp_path / "out"
    out.mkdir()
    for workers in (1, 2):
        with pytest.raises(StoreError) as e:
            ucl.reshard(bad, out / "x", U, workers=workers)
        assert "rank_00001.h5" in str(e.value) and ("truncated" in str(e.value) or "corrupt" in str(e.value))
        assert_nothing_left(out, [])
    with ucl.open(bad) as c:
        problems = c.verify()
    assert len(problems) == 1 and "rank_00001.h5" in problems[0]


def test_verify_names_a_corrupted_dataset(saved, tmp_path):
    bad = _copy(saved("dp=2,tp=2"), tmp_path / "src")
    flip_byte(os.path.join(bad, "rank_00002.h5"), "fp32/@flat0")
    with ucl.open(bad) as c:
        problems = c.verify()
    assert len(problems) == 1 and "fp32/@flat0" in problems[0] and "rank_00002.h5" in problems[0]
    assert "checksum mismatch" in problems[0]


@pytest.mark.parametrize("workers", [1, 2])
def test_reshard_detects_a_corrupted_dataset_it_reads_whole(saved, tmp_path, workers):
    bad = _copy(saved("dp=2,tp=2"), tmp_path / "src")
    key = "param/decoder.layers.0.mlp.linear_fc2.weight"
    flip_byte(os.path.join(bad, "rank_00000.h5"), key)  # its only copy: rank 2, its dp replica, stores none
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(StoreError) as e:
        ucl.reshard(bad, out / "x", U, workers=workers)
    msg = str(e.value)
    assert e.value.code == "UCL407" and "checksum" in msg and key in msg and ".h5" in msg, msg
    assert_nothing_left(out, [])


@pytest.mark.parametrize("to", ["universal", "tp=4"])
def test_reshard_detects_a_corrupted_flat_buffer(saved, tmp_path, to):
    bad = _copy(saved("dp=2,tp=2"), tmp_path / "src")
    flip_byte(os.path.join(bad, "rank_00002.h5"), "fp32/@flat0")
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(StoreError) as e:
        ucl.reshard(bad, out / "x", M(to), workers=1)
    msg = str(e.value)
    assert "checksum" in msg and "fp32/@flat0" in msg and "rank_00002.h5" in msg, msg
    assert_nothing_left(out, [])


def test_damaged_hdf5_header_is_named(saved, tmp_path):
    """Reads go by the manifest's byte offsets, so a damaged HDF5 header costs no data (every byte
    is still verified against its checksum); `verify` names it. A checkpoint without offsets (written
    before they existed) is read through HDF5's metadata, and then the damage is the error."""
    good = saved("dp=2,tp=2")
    bad = _copy(good, tmp_path / "src")
    with open(os.path.join(bad, "rank_00000.h5"), "r+b") as fh:
        fh.write(b"\0" * 64)
    want = ucl.load_rank(good, mesh=M("tp=2"), rank=0)
    got = ucl.load_rank(bad, mesh=M("tp=2"), rank=0)
    assert want.keys() == got.keys() and all(np.array_equal(want[k], got[k]) for k in want)
    problems = ucl.open(bad).verify()
    assert len(problems) == 1 and "rank_00000.h5" in problems[0], problems
    without_offsets(bad)
    with pytest.raises(StoreError) as e:
        ucl.reshard(bad, tmp_path / "x", U, workers=1)
    assert "rank_00000.h5" in str(e.value)
    with pytest.raises(StoreError):
        ucl.load_rank(bad, mesh=M("tp=2"), rank=0)
    assert not (tmp_path / "x").exists() and temps(tmp_path) == []


def test_manifest_of_a_newer_version_is_refused(saved, tmp_path):
    bad = _copy(saved("dp=2,tp=2"), tmp_path / "src")
    mpath = os.path.join(bad, "manifest.json")
    m = json.loads(open(mpath).read())
    m["version"] = READ_VERSION + 1
    open(mpath, "w").write(json.dumps(m))
    for call in (lambda: ucl.open(bad), lambda: ucl.reshard(bad, tmp_path / "x", U),
                 lambda: ucl.load_rank(bad, mesh=M("tp=2"), rank=0)):
        with pytest.raises(StoreError) as e:
            call()
        assert "newer" in str(e.value) and e.value.code == "UCL402"
    assert visible(tmp_path) == ["src"] and temps(tmp_path) == []


def test_missing_source_is_a_clear_error(tmp_path):
    with pytest.raises(StoreError) as e:
        ucl.reshard(tmp_path / "nope", tmp_path / "x", U)
    assert "nope" in str(e.value)
    assert_nothing_left(tmp_path, [])


@pytest.mark.parametrize("existing", ["checkpoint", "empty-dir", "file"])
def test_existing_target_is_refused_and_untouched(demo, saved, tmp_path, existing):
    src = saved("dp=2,tp=2")
    dst = tmp_path / "dst"
    if existing == "checkpoint":
        shutil.copytree(saved("pp=4,dp=1,tp=1"), dst)
    elif existing == "empty-dir":
        dst.mkdir()
    else:
        dst.write_text("keep me")
    before = snapshot(tmp_path)
    with pytest.raises(StoreError) as e:
        ucl.reshard(src, dst, U)
    assert "already exists" in str(e.value)
    demo_model, truth = demo
    with pytest.raises(StoreError):
        ucl.save(dst, shards_for(demo_model, truth, M("tp=2")), model=demo_model, mesh=M("tp=2"))
    assert snapshot(tmp_path) == before and temps(tmp_path) == []
    if existing == "checkpoint":
        assert_intact(dst, demo_model, truth, M("pp=4,dp=1,tp=1"))


# ---- disk full / killed mid-way

def _enospc():
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _fail_after(n, real):
    calls = [0]

    def fn(*a, **k):
        calls[0] += 1
        if calls[0] > n:
            raise _enospc()
        return real(*a, **k)
    fn.calls = calls
    return fn


@pytest.mark.parametrize("where,after", [
    ("h5py.create_dataset", 0), ("h5py.create_dataset", 7), ("h5py.create_dataset", 60),
    ("CheckpointWriter.write", 5), ("manifest", 0), ("fsync", 3),
])
def test_disk_full_mid_reshard_leaves_source_intact_and_no_target(demo, saved, tmp_path, monkeypatch, where, after):
    model, truth = demo
    src = saved("pp=2,dp=2,tp=2")
    out = tmp_path / "out"
    out.mkdir()
    if where == "h5py.create_dataset":
        monkeypatch.setattr(h5py.Group, "create_dataset", _fail_after(after, h5py.Group.create_dataset))
    elif where == "CheckpointWriter.write":
        monkeypatch.setattr(store_writer.CheckpointWriter, "write", _fail_after(after, store_writer.CheckpointWriter.write))
    elif where == "manifest":
        monkeypatch.setattr(store_writer, "write_atomic", _fail_after(after, store_writer.write_atomic))
    elif where == "fsync":
        monkeypatch.setattr(store_writer, "fsync_path", _fail_after(after, store_writer.fsync_path))
    # a raw OSError from a patched CheckpointWriter.write bypasses the writer's own translation; every
    # real disk error (h5py, fsync, manifest) must come back as a StoreError
    expected = (UclError, OSError) if where == "CheckpointWriter.write" else StoreError
    before = snapshot(src)
    with pytest.raises(expected) as e:
        ucl.reshard(src, out / "target", M("pp=1,dp=2,tp=4"), workers=1)
    if isinstance(e.value, UclError):
        assert "No space left on device" in str(e.value), str(e.value)
        # named by the checkpoint it was writing, not by the hidden temp folder a worker wrote into
        assert str(out / "target") in str(e.value) and ".tmp-" not in str(e.value), str(e.value)
    else:
        assert e.value.errno == errno.ENOSPC
    monkeypatch.undo()
    assert not (out / "target").exists()
    assert_nothing_left(out, [])
    # the source is untouched, verifies clean and loads
    assert snapshot(src) == before
    with ucl.open(src) as c:
        assert c.verify() == []
    got = ucl.load_rank(src, mesh=M("pp=1,dp=2,tp=4"), rank=3)
    assert_same_shards({3: got}, {3: shards_for(model, truth, M("pp=1,dp=2,tp=4"))[3]}, "load after failure")
    if (where, after) == ("h5py.create_dataset", 7):
        # once the disk has room again the same reshard goes through
        ucl.reshard(src, out / "target", M("pp=1,dp=2,tp=4"), workers=1)
        assert_intact(out / "target", model, truth, M("pp=1,dp=2,tp=4"))


def test_disk_full_during_save_writes_nothing(demo, tmp_path, monkeypatch):
    model, truth = demo
    A = M("pp=2,dp=2,tp=2")
    monkeypatch.setattr(h5py.Group, "create_dataset", _fail_after(30, h5py.Group.create_dataset))
    with pytest.raises(StoreError) as e:
        ucl.save(tmp_path / "ckpt", shards_for(model, truth, A), model=model, mesh=A)
    assert e.value.code == "UCL410"
    assert_nothing_left(tmp_path, [])


SLOW_RESHARD = """
import os, sys, time
import ucl.store.writer as h
marker = sys.argv[1]
real = h.CheckpointWriter.write
n = [0]
def slow(self, *a, **k):
    real(self, *a, **k)
    n[0] += 1
    if n[0] == 10:
        open(marker + ".%d" % os.getpid(), "w").close()
    time.sleep(0.05)
h.CheckpointWriter.write = slow
from ucl.cli import main
sys.exit(main(sys.argv[2:]))
"""


def test_a_killed_worker_fails_the_reshard_at_once_and_publishes_nothing(demo, saved, tmp_path):
    """A worker process the OOM killer (here: SIGKILL) takes mid-reshard is an error naming it, raised
    as soon as it dies; nothing appears and the temp dir is gone. (multiprocessing.Pool, used before,
    waits forever for the dead worker's result.)"""
    import multiprocessing
    src = saved("pp=2,dp=2,tp=2")
    out = tmp_path / "out"
    out.mkdir()
    killed = []

    def kill_one(n):  # called in this process as the workers report bytes
        if not killed:
            victim = multiprocessing.active_children()[0]
            os.kill(victim.pid, signal.SIGKILL)
            killed.append(victim.pid)
    t0 = time.monotonic()
    with pytest.raises(StoreError, match=r"worker process (\d+) died \(killed by SIGKILL") as e:
        ucl.reshard(src, out / "target", M("pp=1,dp=2,tp=4"), workers=2, progress=kill_one)
    assert e.value.code == "UCL410" and f"process {killed[0]} died" in str(e.value)
    assert time.monotonic() - t0 < 30
    assert os.listdir(out) == []
    assert multiprocessing.active_children() == []  # the other worker was stopped too


@pytest.mark.parametrize("workers", [1, 2])
def test_sigkill_mid_reshard_leaves_source_intact_and_no_target(demo, saved, tmp_path, workers):
    """`ucl reshard` killed with SIGKILL half-way: the target never appears, the source still verifies;
    the killed writer's temp dir is hidden, not openable, and removed by cleanup_stale."""
    model, truth = demo
    src = saved("pp=2,dp=2,tp=2")
    out = tmp_path / "out"
    out.mkdir()
    marker = str(tmp_path / "marker")
    before = snapshot(src)
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-c", SLOW_RESHARD, marker, "reshard", src, str(out / "target"),
                             "--to", "pp=1,dp=2,tp=4", "--workers", str(workers), "--quiet"],
                            env=env, cwd=str(tmp_path), start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.time() + 60
        while not any(n.startswith("marker.") for n in os.listdir(tmp_path)):
            assert proc.poll() is None, proc.communicate()
            assert time.time() < deadline, "reshard never got going"
            time.sleep(0.01)
        assert temps(out), "a write in progress lives in a temp dir"
        assert visible(out) == []
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)   # the whole session we started: parent + forked workers
        proc.communicate()
    assert proc.returncode == -signal.SIGKILL
    time.sleep(0.1)
    assert visible(out) == [] and not (out / "target").exists()
    leftovers = temps(out)
    for name in leftovers:
        with pytest.raises(StoreError):
            ucl.open(out / name)
    assert snapshot(src) == before
    with ucl.open(src) as c:
        assert c.verify() == []
    removed = cleanup_stale(str(out))
    assert sorted(os.path.basename(p) for p in removed) == leftovers
    assert os.listdir(out) == []
    if workers == 1:
        ucl.reshard(src, out / "target", M("pp=1,dp=2,tp=4"))
        assert_intact(out / "target", model, truth, M("pp=1,dp=2,tp=4"))


def test_compile_for_some_ranks_equals_the_full_plan_restricted(demo):
    """compile(..., ranks=[r]) (what load_rank uses) gives rank r exactly the rows of the full plan."""
    model, truth = demo
    src, dst = M("pp=2,dp=2,tp=2"), M("pp=1,dp=2,tp=4")
    full = ucl.compile(model, src, dst)
    shards = shards_for(model, truth, src)
    want = ucl.execute_memory(full, shards)
    for r in (0, 5, 7):
        part = ucl.compile(model, src, dst, ranks=[r])
        assert set(part.dataset_ranks["rank"].tolist()) == {r}
        assert int(part.bytes_read_per_rank()[r]) == int(full.bytes_read_per_rank()[r])
        got = ucl.execute_memory(part, shards)
        assert_same_shards({r: got[r]}, {r: want[r]}, f"rank {r}")


@pytest.mark.parametrize("durable", [True, False])
def test_save_durable_false_skips_fsync_of_rank_files(demo, tmp_path, monkeypatch, durable):
    model, truth = demo
    synced = []
    real = store_writer.fsync_path
    monkeypatch.setattr(store_writer, "fsync_path", lambda p: (synced.append(os.path.basename(p)), real(p)))
    mesh = M("dp=2,tp=2")
    path = ucl.save(tmp_path / "c", shards_for(model, truth, mesh), model=model, mesh=mesh, durable=durable)
    assert sorted(n for n in synced if n.endswith(".h5")) == ([f"rank_{r:05d}.h5" for r in range(4)] if durable else [])
    assert_intact(path, model, truth, mesh)  # committed and whole either way


def test_version_1_checkpoints_with_every_replica_still_load(demo, tmp_path):
    """Format 1 stored a replicated dataset on every rank holding it (and had no byte offsets): such
    a checkpoint loads and reshards exactly; one missing a replica is refused, as it was then."""
    from ucl.ops.prepare import manifest_fields
    from ucl.store import CheckpointWriter
    model, truth = demo
    mesh = M("pp=2,dp=2,tp=2")
    shards = shards_for(model, truth, mesh)
    path = tmp_path / "v1"
    with CheckpointWriter(path, mesh.size, **manifest_fields(model, mesh, {"step": 1}), version=1) as w:
        for r in range(mesh.size):
            dtypes = expected_datasets(model, mesh, r)
            for k, a in shards[r].items():
                w.write(r, k, a, dtype=dtypes[k][1])
        w.commit()
    without_offsets(path)
    with ucl.open(path) as c:
        assert c.manifest.version == 1 and c.verify() == []
        assert "param/output_layer.weight" in c.keys(7)  # a dp replica's copy, as format 1 had it
    for r in range(mesh.size):
        assert_same_shards({r: ucl.load_rank(path, mesh=mesh, rank=r)}, {r: shards[r]}, f"v1 rank {r}")
    ucl.reshard(path, tmp_path / "U", U)
    assert_same_shards(read_all(tmp_path / "U"), {0: truth}, "v1 -> universal")
    edit = json.loads((path / "manifest.json").read_text())
    del edit["datasets"][7]["param/output_layer.weight"]
    (path / "manifest.json").write_text(json.dumps(edit))
    with pytest.raises(StoreError) as e:
        ucl.load_rank(path, mesh=mesh, rank=7)
    assert e.value.code == "UCL417" and "param/output_layer.weight" in str(e.value)


def test_version_2_allows_extra_replicas(demo, tmp_path):
    """A writer that stores a replica on every holder anyway (CheckpointWriter used directly) makes a
    valid version-2 checkpoint: the extra copies are checked against the spec, never read."""
    from ucl.ops.prepare import manifest_fields
    from ucl.store import CheckpointWriter
    model, truth = demo
    mesh = M("dp=2,tp=2")
    shards = shards_for(model, truth, mesh)
    with CheckpointWriter(tmp_path / "c", mesh.size, **manifest_fields(model, mesh)) as w:
        for r in range(mesh.size):
            dtypes = expected_datasets(model, mesh, r)
            for k, a in shards[r].items():
                w.write(r, k, a, dtype=dtypes[k][1])
        w.commit()
    assert ucl.open(tmp_path / "c").manifest.version == 2
    for r in range(mesh.size):
        assert_same_shards({r: ucl.load_rank(tmp_path / "c", mesh=mesh, rank=r)}, {r: shards[r]}, f"rank {r}")


def test_small_api_edges(demo, saved, tmp_path):
    """iter_rank(keys=) takes one key as well as several; a replica read from a rank whose file
    does not store it names the rank that does; save() keyed by anything but the rank ints is a
    UCL421, not a TypeError; reshard takes a numpy integer worker count as load_rank takes ranks."""
    model, truth = demo
    src = saved("pp=2,dp=2,tp=2")
    key = next(k for k in truth if k.startswith("param/"))
    stats = IOStats()
    got = list(ucl.iter_rank(src, keys=key, stats=stats))
    assert [k for k, _ in got] == [key] and got[0][1].tobytes() == truth[key].tobytes()
    assert stats.bytes_needed == truth[key].nbytes
    with ucl.open(src) as ck:
        stored = {k: r for r, entries in enumerate(ck.manifest.datasets) for k in entries}
        replica = next(k for k, r in stored.items() if r == 0 and k not in ck.manifest.datasets[1]
                       and k in expected_datasets(model, M("pp=2,dp=2,tp=2"), 2))
        with pytest.raises(StoreError, match="rank 0's file stores it"):
            ck.read(2, replica)
    with pytest.raises(StoreError, match="keyed by the ranks") as e:
        ucl.save(tmp_path / "bad", {0: truth, "1": truth}, model=model, mesh="dp=2")
    assert e.value.code == "UCL421"
    ucl.reshard(src, tmp_path / "np", M("tp=2"), workers=np.int64(2))
