"""``load_rank(read_once=True)``: the processes of a gloo job holding identical copies of a dataset
share its reading out and send each other what they read. Oracles: the single-process plain
``load_rank`` of every rank (bit for bit), the global tensors' byte count (storage reads of the job),
the bytes of the single-process results (which datasets are copies of one another). Processes are
spawned (as in test_reshard_distributed.py) and report through files; one spawn per world size
runs every scenario, so the file stays fast."""
from __future__ import annotations

import datetime
import json
import multiprocessing as mp
import os
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import ucl
from spawned import free_port  # noqa: E402
from ucl.demo import llama_model, universal_state
from ucl.memory import MemoryCap
from ucl.ops import IOStats
from ucl.plan.execute import rank_datasets

torch = pytest.importorskip("torch")
# the GQA spec gives one KV head to several TP ranks on purpose
pytestmark = pytest.mark.filterwarnings("ignore::ucl.layout.fit.MeshFitWarning")

DEMO_DIMS = dict(vocab=500, hidden=64, heads=4, kv_heads=2, ffn=128, layers=2)  # GQA: 2 query heads per KV head
QKV = "param/decoder.layers.0.self_attention.linear_qkv.weight"  # replicated over dp: corrupted below
GROUP_TIMEOUT_S = 3.0  # the gloo group of the phase whose second process never arrives


def _tied_model():
    """stdlib:llama with tied embeddings (on the first and the last stage) and GQA."""
    spec = ucl.load_spec("stdlib:llama")
    dims = spec.dims_from_config({"vocab_size": 256, "hidden_size": 64, "num_attention_heads": 4,
                                  "num_key_value_heads": 2, "intermediate_size": 96,
                                  "num_hidden_layers": 2, "tie_word_embeddings": True})
    return spec.bind(dims, spec.synthesize_params(dims))


GQA_SPEC = """\
# one KV head shared by the TP ranks (`shared`: tp larger than kv_heads), norm sharded over dp
dims hidden, heads, kv_heads, head_dim
mesh dp, tp
q.weight [heads * head_dim, hidden] : view 0 as [heads, head_dim]; split 0.0 over tp
k.weight [kv_heads * head_dim, hidden] : view 0 as [kv_heads, head_dim]; split 0.0 over tp shared
v.weight [kv_heads * head_dim, hidden] : view 0 as [kv_heads, head_dim]; split 0.0 over tp shared
o.weight [hidden, heads * head_dim] : view 1 as [heads, head_dim]; split 1.0 over tp
norm.weight [hidden] : split 0 over dp uneven
"""


def _gqa_model():
    dims = dict(hidden=64, heads=4, kv_heads=1, head_dim=16)
    params = {"q.weight": (64, 64), "k.weight": (16, 64), "v.weight": (16, 64), "o.weight": (64, 64),
              "norm.weight": (64,)}
    return ucl.load_spec(GQA_SPEC).bind(dims, params)


MODELS = {"demo": lambda: llama_model(DEMO_DIMS), "tied": lambda: _tied_model(), "gqa": _gqa_model}


def _random_state(model, seed):
    rng = np.random.default_rng(seed)
    out = {}
    for t in model.tensors:
        dt = ucl.dtypes.storage_dtype(t.dtype)
        out[t.key] = rng.integers(0, 1 << 15, size=t.shape).astype(dt) if dt.kind in "iu" else \
            rng.standard_normal(t.shape).astype(dt)
    return out


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """Universal checkpoints (every tensor stored once) of the demo model and the tied Llama, and a
    copy of the demo with one byte of a dp-replicated weight flipped."""
    from corrupt import flip_byte
    d = tmp_path_factory.mktemp("ro-src")
    demo = llama_model(DEMO_DIMS)
    ucl.save(d / "demo", {0: universal_state(demo, seed=3)}, model=demo, mesh=ucl.UNIVERSAL)
    ucl.save(d / "bad", {0: universal_state(demo, seed=3)}, model=demo, mesh=ucl.UNIVERSAL)
    flip_byte(d / "bad" / "rank_00000.h5", QKV)
    models = {"demo": demo, "tied": _tied_model(), "gqa": _gqa_model()}
    for name in ("tied", "gqa"):
        ucl.save(d / name, {0: _random_state(models[name], 4)}, model=models[name], mesh=ucl.UNIVERSAL)
    return d, models


def _worker(rank: int, world: int, port: int, workdir: str, src: str, phases: list[dict]) -> None:
    """Runs ``phases`` ({name, ckpt, mesh; optional: ckptN for process N, rank, out, short, absent}); writes ``<name>_<rank>.npz`` (the tensors)
    and ``<name>_<rank>.json`` (stats or the error)."""
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=30))
    short = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
    try:
        for ph in phases:
            res: dict = {"rank": rank}
            report = os.path.join(workdir, f"{ph['name']}_{rank}.json")
            if rank in ph.get("absent", ()):  # never arrives: stays alive until the others gave up
                while not os.path.exists(os.path.join(workdir, f"{ph['name']}_0.json")):
                    time.sleep(0.05)
                continue
            stats = IOStats()
            try:
                out = None
                if ph.get("out"):  # torch tensors filled in place: garbage first
                    plan = ucl.compile(_model_of(src, ph), ucl.UNIVERSAL, ph["mesh"], ranks=[rank])
                    out = {d["key"]: ucl.dtypes.to_torch(np.full(d["shape"], 7, ucl.dtypes.storage_dtype(d["dtype"])),
                                                         d["dtype"]) for d in rank_datasets(plan, rank)}
                ckpt = ph.get(f"ckpt{rank}", ph["ckpt"])
                got = ucl.load_rank(os.path.join(src, ckpt), mesh=ph["mesh"], rank=ph.get("rank", rank), stats=stats,
                                    read_once=True, out=out, group=short if ph.get("short") else None,
                                    max_memory=ph.get("max_memory"))
                if out is not None:
                    res["in_place"] = all(got[k] is out[k] for k in out)
                np.savez(os.path.join(workdir, f"{ph['name']}_{rank}.npz"),
                         **{k: v if isinstance(v, np.ndarray) else ucl.dtypes.to_numpy(v)[0] for k, v in got.items()})
                res["stats"] = {k: getattr(stats, k) for k in ("bytes_read", "bytes_needed", "bytes_sent",
                                                                "bytes_received")}
            except ucl.UclError as e:
                res["error"] = [type(e).__name__, e.code, str(e)]
            except Exception as e:  # noqa: BLE001 - reported to the parent, which fails the test
                res["other_error"] = [type(e).__name__, str(e)]
            with open(report, "w") as f:
                json.dump(res, f)
    finally:
        dist.destroy_process_group()


def _model_of(src, ph):
    from ucl.ops import model_of
    with ucl.open(os.path.join(src, ph["ckpt"])) as c:
        return model_of(c)


def _run(world: int, workdir: Path, src: Path, phases: list[dict], limit_s: float = 120.0) -> dict:
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, str(workdir), str(src), phases)) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.time() + limit_s
    try:
        for r, p in enumerate(procs):
            p.join(max(0.1, deadline - time.time()))
            if p.is_alive():
                pytest.fail(f"process {r} did not finish within {limit_s} s (a collective hangs?)")
    finally:
        for p in procs:  # only the processes this test started
            if p.is_alive():
                p.kill()
            p.join()
    out = {}
    for ph in phases:
        out[ph["name"]] = []
        for r in range(world):
            js, npz = workdir / f"{ph['name']}_{r}.json", workdir / f"{ph['name']}_{r}.npz"
            res = json.loads(js.read_text()) if js.exists() else None
            if res is not None and npz.exists():
                with np.load(npz) as z:
                    res["tensors"] = {k: z[k] for k in z.files}
            out[ph["name"]].append(res)
    return out


@pytest.fixture(scope="module")
def world2(ckpts, tmp_path_factory):
    d = tmp_path_factory.mktemp("ro-world2")
    src, _ = ckpts
    phases = [{"name": "dp", "ckpt": "demo", "mesh": "dp=2"},
              {"name": "out", "ckpt": "demo", "mesh": "dp=2", "out": True},
              {"name": "capped", "ckpt": "demo", "mesh": "dp=2", "max_memory": MemoryCap(1 << 20)},
              {"name": "bad", "ckpt": "bad", "mesh": "dp=2"},
              {"name": "gqa", "ckpt": "gqa", "mesh": "tp=2"},
              {"name": "twice", "ckpt": "demo", "mesh": "dp=2", "rank": 0},
              {"name": "mixed", "ckpt": "demo", "ckpt1": "tied", "mesh": "dp=2"}]
    return _run(2, d, src, phases)


# 4 processes on a small machine take a while to start: `UCL_SLOW_TESTS=1 pytest -m slow` runs them
_SKIP_SLOW = pytest.mark.skipif(not os.environ.get("UCL_SLOW_TESTS"), reason="slow: set UCL_SLOW_TESTS=1")


def slow(test):
    return pytest.mark.slow(_SKIP_SLOW(test))


@pytest.fixture(scope="module")
def world4(ckpts, tmp_path_factory):
    d = tmp_path_factory.mktemp("ro-world4")
    src, _ = ckpts
    phases = [{"name": "dp_tp", "ckpt": "demo", "mesh": "dp=2,tp=2"},
              {"name": "tied", "ckpt": "tied", "mesh": "pp=2,tp=2"},
              {"name": "bad", "ckpt": "bad", "mesh": "dp=4"},
              {"name": "absent", "ckpt": "demo", "mesh": "dp=4", "short": True, "absent": [3]}]
    return _run(4, d, src, phases)


def _nbytes(tensor) -> int:
    return int(np.prod(tensor.shape, dtype=np.int64)) * ucl.dtypes.storage_dtype(tensor.dtype).itemsize


def _check_job(ckpts, results, name, mesh, model_name, slack=0.0):
    """Bit-exact against plain single-process loads; storage reads of the job = the checkpoint once."""
    src, models = ckpts
    path = src / model_name
    plain_needed, plain_read = 0, []
    held, distinct = 0, {}
    for rank, res in enumerate(results[name]):
        assert res is not None and "stats" in res, res
        plain_stats = IOStats()
        want = ucl.load_rank(path, mesh=mesh, rank=rank, stats=plain_stats)
        plain_needed += plain_stats.bytes_needed
        plain_read.append(plain_stats.bytes_read)
        got = res["tensors"]
        assert sorted(got) == sorted(want), rank
        for k, w in want.items():
            assert got[k].dtype == w.dtype and got[k].shape == w.shape and got[k].tobytes() == w.tobytes(), (rank, k)
            held += w.nbytes
            distinct[(k, w.tobytes())] = w.nbytes
    stats = [r["stats"] for r in results[name]]
    universal = sum(_nbytes(t) for t in models[model_name].tensors)
    needed = sum(s["bytes_needed"] for s in stats)
    assert universal <= needed <= (1 + slack) * universal  # every byte of the checkpoint read once
    assert plain_needed > universal  # ... where plain loads read the replicas again
    # storage reads (verified reads round out to checksum chunks): a part of each rank's plain reads
    assert all(s["bytes_read"] <= p for s, p in zip(stats, plain_read))
    assert sum(s["bytes_read"] for s in stats) < sum(plain_read)
    assert sum(s["bytes_sent"] for s in stats) == sum(s["bytes_received"] for s in stats) \
        == held - sum(distinct.values())


def test_two_processes_dp_bit_exact_and_read_once(ckpts, world2):
    _check_job(ckpts, world2, "dp", "dp=2", "demo")
    # the reading is shared out: each process reads a good part, neither reads it all
    needed = [r["stats"]["bytes_needed"] for r in world2["dp"]]
    assert min(needed) > 0.3 * sum(needed)


def test_two_processes_sharing_a_kv_head(ckpts, world2):
    _check_job(ckpts, world2, "gqa", "tp=2", "gqa")
    kv = sum(_nbytes(t) for t in ckpts[1]["gqa"].tensors if t.name in ("k.weight", "v.weight"))
    assert sum(r["stats"]["bytes_received"] for r in world2["gqa"]) == kv + 64 * 4  # the KV head and the norm


def test_under_the_smallest_cap_boxes_pass_in_pieces_bit_exact(ckpts, world2):
    """A cap below any real one (a MemoryCap is taken as given): boxes over 64 KiB (the embedding,
    128 KiB) are read in pieces, then sent on (docs/memory.md)."""
    _check_job(ckpts, world2, "capped", "dp=2", "demo")


def test_out_tensors_are_filled_in_place(ckpts, world2):
    assert all(r is not None and r.get("in_place") for r in world2["out"]), world2["out"]
    _check_job(ckpts, world2, "out", "dp=2", "demo")


def _fails_everywhere_with_ucl407(res, world):
    for r in res:
        assert r is not None and "error" in r, r
        assert r["error"][:2] == ["StoreError", "UCL407"], r
    assert all(QKV.split("/")[1] in r["error"][2] for r in res)  # the reader's message, everywhere...
    assert sum("failed on process" in r["error"][2] for r in res) == world - 1  # ...the others say who failed


def test_a_corrupt_byte_fails_both_processes_with_ucl407(world2):
    _fails_everywhere_with_ucl407(world2["bad"], 2)


@pytest.mark.parametrize("phase,words", [("twice", "exactly one process"), ("mixed", "another checkpoint")])
def test_processes_that_disagree_fail_together_with_ucl425(world2, phase, words):
    for r in world2[phase]:
        assert r is not None and r.get("error", [None])[:2] == ["StoreError", "UCL425"], r
        assert words in r["error"][2], r


@slow
def test_a_corrupt_byte_fails_four_processes_with_ucl407(world4):
    _fails_everywhere_with_ucl407(world4["bad"], 4)


@slow
def test_a_process_that_never_arrives_times_out(world4):
    for r in world4["absent"][:3]:
        assert r is not None and r["error"][:2] == ["StoreError", "UCL424"], r
    assert world4["absent"][3] is None


@slow
def test_four_processes_tp_dp(ckpts, world4):
    # the ZeRO-1 buffers of tp=0 and tp=1 each hold the (tp-replicated) norms' state: not replicas
    # of each other, so those few elements are read twice
    _check_job(ckpts, world4, "dp_tp", "dp=2,tp=2", "demo", slack=0.01)


@slow
def test_four_processes_tied_embeddings_on_two_stages(ckpts, world4):
    _check_job(ckpts, world4, "tied", "pp=2,tp=2", "tied")
    recv = sum(r["stats"]["bytes_received"] for r in world4["tied"])
    assert recv >= _nbytes(_tied_model().tensors[0])  # the embedding crossed between the stages


def test_outside_torch_distributed_is_refused(ckpts):
    src, _ = ckpts
    with pytest.raises(ucl.UclError) as e:
        ucl.load_rank(src / "demo", mesh="dp=2", rank=0, read_once=True)
    assert e.value.code == "UCL422" and "torch.distributed" in str(e.value)


def test_one_process_world(ckpts):
    """A world of one: the mesh must have one rank (UCL422 otherwise); the result is the plain one."""
    import torch.distributed as dist
    src, _ = ckpts
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(ucl.UclError) as e:
            ucl.load_rank(src / "demo", mesh="dp=2", rank=0, read_once=True)
        assert e.value.code == "UCL422" and "2 ranks" in str(e.value)
        stats = IOStats()
        got = ucl.load_rank(src / "demo", mesh="tp=1", rank=0, read_once=True, stats=stats)
    finally:
        dist.destroy_process_group()
    want = ucl.load_rank(src / "demo", mesh="tp=1", rank=0)
    assert sorted(got) == sorted(want) and all(got[k].tobytes() == want[k].tobytes() for k in want)
    assert stats.bytes_received == stats.bytes_sent == 0


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pp=st.sampled_from([1, 2]), dp=st.sampled_from([1, 2, 3]), tp=st.sampled_from([1, 2]),
       which=st.sampled_from(sorted(MODELS)))
def test_shares_cover_every_dataset_once_and_replicas_are_byte_identical(pp, dp, tp, which):
    """For every rank: each dataset is read by it or received from a reader that holds the same
    bytes (oracle: the in-memory reshard of random global tensors); each content is read once."""
    from ucl.ops.read_once import share_of
    model = MODELS[which]()
    mesh = ucl.Mesh.parse(f"dp={dp},tp={tp}" if which == "gqa" else f"pp={pp},dp={dp},tp={tp}")
    plan = ucl.compile(model, ucl.UNIVERSAL, mesh)
    shards = ucl.execute_memory(plan, {0: _random_state(model, 5)})
    read_contents: list[tuple[str, bytes]] = []
    for r in range(mesh.size):
        keys = [d["key"] for d in rank_datasets(plan, r)]
        share = share_of(model, mesh, r, keys)
        got = {s.key: s.reader for s in share.receives}
        assert share.reads.isdisjoint(got) and share.reads | set(got) == set(keys)
        for k, reader in got.items():
            assert reader != r and shards[reader][k].tobytes() == shards[r][k].tobytes(), (r, k, reader)
        for s in share.sends:
            assert s.reader == r and r in s.ranks and s.key in share.reads
        read_contents += [(k, shards[r][k].tobytes()) for k in share.reads]
    assert len(read_contents) == len(set(read_contents))  # no content read twice
