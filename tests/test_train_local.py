"""The node-local tier (``Checkpointer(local=...)``) and loading from whatever survives: each
"node" is a folder of its own on this machine (docs/resilience.md)."""
from __future__ import annotations

import datetime
import json
import os
import shutil

import pytest

torch = pytest.importorskip("torch")

import ucl  # noqa: E402
from ucl.store.manifest import file_name  # noqa: E402
from spawned import free_port, spawn_ranks  # noqa: E402

DIM, OUT, STEPS = 8, 4, 6


def _dims() -> tuple[int, int, int]:
    """(in, hidden, out); wide (UCL_TEST_WIDE, inherited by spawned workers): matrices of 128 KiB, over
    the 16 KiB checksum chunks, so partial reads are not rounded out to whole datasets."""
    return (64, 512, 64) if os.environ.get("UCL_TEST_WIDE") else (DIM, 16, OUT)


def _model():
    torch.manual_seed(0)
    d, h, o = _dims()
    m = torch.nn.Sequential(torch.nn.Linear(d, h), torch.nn.ReLU(), torch.nn.Linear(h, o))
    return m, torch.optim.AdamW(m.parameters(), lr=1e-2)


def _batch(i):
    g = torch.Generator().manual_seed(100 + i)
    d, _, o = _dims()
    return torch.randn(4, d, generator=g), torch.randn(4, o, generator=g)


def _train(model, opt, start, stop, ck=None):
    losses = []
    for i in range(start, stop):
        x, y = _batch(i)
        loss = ((model(x) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if ck is not None:
            ck.save(i + 1)
    return losses


def _state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_every_save_goes_to_the_local_tier_and_one_in_persist_every_to_root(tmp_path):
    m, o = _model()
    with ucl.Checkpointer(tmp_path / "root", m, o, local=tmp_path / "local", persist_every=3, keep=2) as ck:
        _train(m, o, 0, 7, ck)
    assert ucl.store.CheckpointRoot(tmp_path / "root").steps() == [3, 6]
    from ucl.train.timeline import load_trace
    phases = [e["phase"] for e in load_trace(tmp_path / "root")]
    assert phases.count("local") == 7 and phases.count("flush") == 2
    local = ucl.store.CheckpointRoot(tmp_path / "local")
    assert local.steps() == [6, 7] and local.latest_step() == 7  # keep=2 there too
    folder = local.path_for(7)
    assert json.load(open(os.path.join(folder, "ucl_node.json"))) == {"node": 0, "ranks": [0]}
    with ucl.open(folder) as ck:
        assert ck.verify() == [] and ck.state["step"] == 7


def test_a_compressed_local_tier_loads_bit_for_bit(tmp_path):
    pytest.importorskip("zstandard")
    m, o = _model()
    with ucl.Checkpointer(tmp_path / "root", m, o, local=tmp_path / "local", compress="zstd") as ck:
        _train(m, o, 0, 2, ck)
        want = _state(m)
    with ucl.open(ucl.store.CheckpointRoot(tmp_path / "local").path_for(2)) as ck:
        assert ck.verify() == []
    m2, o2 = _model()
    with ucl.Checkpointer(tmp_path / "root", m2, o2, local=tmp_path / "local") as ck:
        assert ck.load()[0] == 2 and set(ck.last_load.bytes_from) == {"local"}
    assert all(torch.equal(v, m2.state_dict()[k]) for k, v in want.items())


def test_load_reads_the_local_tier_then_root_then_a_further_tier(tmp_path):
    m, o = _model()
    with ucl.Checkpointer(tmp_path / "root", m, o, local=tmp_path / "local", tiers=[tmp_path / "far"],
                          persist_every=2) as ck:
        _train(m, o, 0, 5, ck)
        want = _state(m)
    m2, o2 = _model()
    with ucl.Checkpointer(tmp_path / "root", m2, o2, local=tmp_path / "local", tiers=[tmp_path / "far"]) as ck:
        assert ck.load()[0] == 5
        assert set(ck.last_load.bytes_from) == {"local"} and ck.last_load.bytes_from["local"] > 0
        # the phases of the load, this process's seconds in each (bench/recover.py prints them)
        assert {"inventory", "plan", "read", "total"} <= set(ck.last_load.seconds)
        assert ck.last_load.seconds["total"] >= ck.last_load.seconds["read"] >= 0
    assert all(torch.equal(v, m2.state_dict()[k]) for k, v in want.items())
    shutil.rmtree(tmp_path / "local")  # the node is gone: root's newest step
    with ucl.Checkpointer(tmp_path / "root", m2, o2, local=tmp_path / "local", tiers=[tmp_path / "far"]) as ck:
        assert ck.load()[0] == 4 and set(ck.last_load.bytes_from) == {"root"}
    shutil.rmtree(tmp_path / "root")  # the shared file system is gone too: the further tier, no manual fetch
    with ucl.Checkpointer(tmp_path / "root", m2, o2, local=tmp_path / "local", tiers=[tmp_path / "far"]) as ck:
        assert ck.load()[0] == 4
        assert set(ck.last_load.bytes_from) == {str(tmp_path / "far")}
        assert ck.last_load.parts == {"0": str(tmp_path / "far")}


def test_a_local_copy_with_flipped_bytes_is_refused_and_root_serves(tmp_path):
    m, o = _model()
    with ucl.Checkpointer(tmp_path / "root", m, o, local=tmp_path / "local") as ck:
        _train(m, o, 0, 2, ck)
        want = _state(m)
    path = os.path.join(ucl.store.CheckpointRoot(tmp_path / "local").path_for(2), file_name(0))
    with ucl.open(os.path.dirname(path)) as ck:
        offset = ck.info(0, "param/0.weight").offset
    with open(path, "r+b") as f:
        f.seek(offset + 5)
        b = f.read(1)
        f.seek(offset + 5)
        f.write(bytes([b[0] ^ 0x40]))
    m2, o2 = _model()
    with ucl.Checkpointer(tmp_path / "root", m2, o2, local=tmp_path / "local") as ck:
        assert ck.load()[0] == 2
        assert ck.last_load.bytes_from.get("root", 0) > 0
    assert all(torch.equal(v, m2.state_dict()[k]) for k, v in want.items())


def test_stale_and_half_written_local_steps_are_never_served(tmp_path):
    m, o = _model()
    with ucl.Checkpointer(tmp_path / "root", m, o, local=tmp_path / "local", persist_every=2) as ck:
        _train(m, o, 0, 4, ck)
        want = _state(m)
    local = ucl.store.CheckpointRoot(tmp_path / "local")
    # a step folder whose manifest is damaged, and one without its node file (not a local tier's)
    shutil.copytree(local.path_for(4), local.path_for(9))
    with open(os.path.join(local.path_for(9), "manifest.json"), "w") as f:
        f.write("{")
    shutil.copytree(local.path_for(4), local.path_for(8))
    os.unlink(os.path.join(local.path_for(8), "ucl_node.json"))
    m2, o2 = _model()
    with ucl.Checkpointer(tmp_path / "root", m2, o2, local=tmp_path / "local") as ck:
        assert ck.load()[0] == 4 and set(ck.last_load.bytes_from) == {"local"}
    assert all(torch.equal(v, m2.state_dict()[k]) for k, v in want.items())


def test_a_checkpoint_of_another_model_is_refused_with_its_own_code(tmp_path):
    m, o = _model()
    with ucl.Checkpointer(tmp_path / "root", m, o, local=tmp_path / "local") as ck:
        _train(m, o, 0, 1, ck)
    other = torch.nn.Sequential(torch.nn.Linear(DIM, 8))
    with ucl.Checkpointer(tmp_path / "root", other, torch.optim.AdamW(other.parameters()),
                          local=tmp_path / "local") as ck:
        with pytest.raises(ucl.StoreError) as e:
            ck.load()
    assert e.value.code == "UCL434" and "another model" in str(e.value)


def test_ucl_verify_checks_a_local_folder_and_names_the_parts_elsewhere(tmp_path, capsys):
    import ucl.cli
    m, o = _model()
    with ucl.Checkpointer(tmp_path / "root", m, o, local=tmp_path / "local") as ck:
        _train(m, o, 0, 1, ck)
    folder = ucl.store.CheckpointRoot(tmp_path / "local").path_for(1)
    # as another node's processes would have left it: rank 0 held elsewhere, its file not here
    with open(os.path.join(folder, "ucl_node.json"), "w") as f:
        json.dump({"node": 1, "ranks": []}, f)
    os.unlink(os.path.join(folder, file_name(0)))
    capsys.readouterr()
    assert ucl.cli.main(["verify", folder]) == 0
    out = capsys.readouterr().out
    assert "node 1's local copy" in " ".join(out.split()) and "on other nodes" in out
    assert ucl.cli.main(["inspect", folder]) == 0


def test_replicas_need_a_local_tier_and_more_nodes_than_copies(tmp_path):
    m, o = _model()
    for kw in (dict(replicas=1), dict(replicas=1, local=tmp_path / "local"), dict(replicas=-1, local=tmp_path)):
        with pytest.raises(ucl.UclError) as e:
            ucl.Checkpointer(tmp_path / "root", m, o, **kw)
        assert e.value.code == "UCL430", kw


@pytest.mark.parametrize("nodes,per_node", [(2, 2), (3, 1), (4, 2), (5, 3)])
def test_replica_placement_loses_nothing_when_any_k_nodes_are_lost(nodes, per_node):
    import itertools
    from ucl.train.replicas import receivers
    of = tuple(n for n in range(nodes) for _ in range(per_node))
    for k in range(nodes):
        to = receivers(of, k)
        for p, qs in to.items():
            assert len({of[q] for q in qs} | {of[p]}) == k + 1  # k + 1 copies on distinct nodes
        for lost in itertools.combinations(range(nodes), k):
            for p in range(len(of)):  # some copy of every process's file survives
                assert any(of[q] not in lost for q in [p] + to[p]), (k, lost, p)


# ---- several processes, two simulated nodes ------------------------------------------------------

SAVE_AT = 3


def _worker(rank: int, world: int, nodes: list, port: int, base: str, phase: str, out: str,
            replicas: int = 0) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    result: dict = {"rank": rank}
    try:
        model, _ = _model()
        if phase.endswith("-tp"):  # tensor parallel: another parallelism family
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
            mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
            parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        else:
            mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
            for layer in (model[0], model[2]):
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        node = nodes[rank]
        with ucl.Checkpointer(os.path.join(base, "root"), model, opt, local=os.path.join(base, f"node{node}"),
                              node=node, replicas=replicas if phase.startswith("save") else 0) as ck:
            if phase.startswith("save"):
                result["losses"] = _train(model, opt, 0, SAVE_AT, ck) + _train(model, opt, SAVE_AT, STEPS)
                ck.wait()
                result["replicated"] = [e["step"] for e in ck.trace.events() if e["phase"] == "replicated"]
            else:
                start, _ = ck.load()
                result["start"] = start
                result["bytes_from"] = ck.last_load.bytes_from
                result["losses"] = _train(model, opt, start, STEPS)
    except Exception as e:  # noqa: BLE001 - reported to the parent
        import traceback
        result["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
    finally:
        with open(os.path.join(out, f"{phase}_{rank}.json"), "w") as f:
            json.dump(result, f)
        dist.destroy_process_group()


def _spawn(nodes, base, phase, limit_s=120.0, replicas=0):
    out = os.path.join(base, "out")
    return spawn_ranks(_worker, len(nodes), (len(nodes), list(nodes), free_port(), str(base), phase, out, replicas),
                       out, phase, limit_s)


@pytest.mark.slow
def test_a_lost_node_costs_only_its_parts_from_root_on_any_world_size(tmp_path):
    """4 FSDP2 processes as 2 nodes save steps 1-3 to their nodes' folders and to root. Loaded
    as saved, every byte is local. Node 1's folder deleted: the same 4 processes read node 1's parts
    from root, the rest locally (and Adam's step, which rank 0 alone stores, from a peer); 2 processes (another mesh), one on node 1 and one on node 0, read
    what node 0 holds from it (the one on node 1 receives it over the group) and the rest from root.
    Every load continues the saving run's losses."""
    saved = _spawn([0, 0, 1, 1], tmp_path, "save")
    want = saved[0]["losses"][SAVE_AT:]
    same = _spawn([0, 0, 1, 1], tmp_path, "load")
    got = same[0]["bytes_from"]  # Adam's step, stored by rank 0 alone, reaches node 1 from node 0
    assert same[0]["start"] == SAVE_AT and set(got) == {"local", "peer"} and got["peer"] * 20 < got["local"], got
    assert same[0]["losses"] == pytest.approx(want, rel=1e-6, abs=1e-7)
    shutil.rmtree(tmp_path / "node1")
    lost = _spawn([0, 0, 1, 1], tmp_path, "load")
    got = lost[0]["bytes_from"]
    assert set(got) == {"local", "peer", "root"} and got["local"] > got["root"] > got["peer"], got
    assert lost[0]["losses"] == pytest.approx(want, rel=1e-6, abs=1e-7)
    smaller = _spawn([1, 0], tmp_path, "load")
    got = smaller[0]["bytes_from"]
    assert got["peer"] > 0 and got["root"] > 0, got
    for r in smaller:
        assert r["losses"] == pytest.approx(want, rel=1e-5, abs=1e-6)


@pytest.mark.slow
def test_with_one_replica_a_lost_node_costs_no_byte_from_root(tmp_path):
    """4 FSDP2 processes as 2 nodes, replicas=1: every step is fast-recoverable (traced). Node 1's
    folder deleted: 2 processes on node 0 (another mesh) and 4 on the two nodes (node 1 empty) read
    nothing from root and continue the saving run's losses. A replica whose bytes were flipped is
    refused by its checksums and root serves that part."""
    saved = _spawn([0, 0, 1, 1], tmp_path, "save", replicas=1)
    assert saved[0]["replicated"] == [1, 2, 3]
    want = saved[0]["losses"][SAVE_AT:]
    held = json.load(open(tmp_path / "node0" / "step_00000003" / "ucl_node.json"))
    assert held == {"node": 0, "ranks": [0, 1, 2, 3]}
    shutil.rmtree(tmp_path / "node1")
    smaller = _spawn([0, 0], tmp_path, "load")
    assert set(smaller[0]["bytes_from"]) == {"local"}, smaller[0]["bytes_from"]
    for r in smaller:
        assert r["losses"] == pytest.approx(want, rel=1e-5, abs=1e-6)
    again = _spawn([0, 0, 1, 1], tmp_path, "load")
    got = again[0]["bytes_from"]
    assert "root" not in got and got["peer"] > 0, got
    assert again[0]["losses"] == pytest.approx(want, rel=1e-6, abs=1e-7)
    from tests.corrupt import flip_byte
    flip_byte(str(tmp_path / "node0" / "step_00000003" / file_name(2)), "param/0.weight", offset=4)
    flipped = _spawn([0, 0], tmp_path, "load")
    assert flipped[0]["bytes_from"].get("root", 0) > 0, flipped[0]["bytes_from"]
    assert flipped[0]["losses"] == pytest.approx(want, rel=1e-5, abs=1e-6)


def test_every_checkpoint_records_its_runs_and_a_rewind_starts_one(tmp_path):
    from ucl.train.lineage import of_state
    m, o = _model()
    with ucl.Checkpointer(tmp_path / "root", m, o, local=tmp_path / "local") as ck:
        _train(m, o, 0, 3, ck)
    m, o = _model()
    with ucl.Checkpointer(tmp_path / "root", m, o, local=tmp_path / "local") as ck:
        ck.save(4)  # no load: it goes on from the newest step, in a run of its own
        ck.wait()
        ck.load(step=2)
        ck.save(3)
    lineage = [of_state(ucl.open(ucl.store.CheckpointRoot(tmp_path / p).path_for(s)).state)
               for p, s in (("root", 2), ("local", 3))]
    assert [r for _, r in lineage[0]] == [None]
    # the run that saved step 4 is not in the history any more: step 3 follows step 2 of the first run
    assert [r for _, r in lineage[1]] == [None, 2] and lineage[1][0] == lineage[0][0]


def test_a_node_with_steps_of_an_abandoned_run_never_serves_them():
    """Node 1 holds every part of steps 2 and 3 of run A (replicas); while it was away the job went
    back to step 1 and saved step 2 again in run B. Node 1's step 3 is newer, but abandoned."""
    from ucl.train.inventory import choose
    a, b = [["1-A", None]], [["1-A", None], ["2-B", 1]]
    node0 = [[1, "s1", 2, [0, 1], a], [2, "s2B", 2, [0, 1], b]]
    node1 = [[2, "s2A", 2, [0, 1], a], [3, "s3A", 2, [0, 1], a]]
    root = [[0, 1, "s1", 2, a], [0, 2, "s2B", 2, b]]
    got = choose([(0, node0), (1, node1)], root, None)
    assert (got.step, got.ident) == (2, "s2B")
    assert choose([(1, node1)], [], None).step == 3  # alone, nothing says run A was abandoned
    assert choose([(0, node0), (1, node1)], root, 3) is None


def test_a_step_only_some_nodes_published_is_not_served_and_bad_copies_are_left_out():
    """A job killed between node 0's and node 1's rename left step 3 on node 0 only: step 2 is the
    newest whole one; a copy that failed its checksums is not used again, another one is."""
    from ucl.train.inventory import choose
    node0 = [[2, "s2", 2, [0], []], [3, "s3", 2, [0], []]]
    node1 = [[2, "s2", 2, [1], []]]
    got = choose([(0, node0), (1, node1)], [], None)
    assert (got.step, got.holders) == (2, {0: (0,), 1: (1,)})
    assert choose([(0, node0), (1, node1)], [], None, frozenset({(1, 1)})) is None
    got = choose([(0, node0), (1, node1)], [[0, 2, "s2", 2, []]], None, frozenset({(1, 1)}))
    assert (got.step, got.holders, got.shared) == (2, {0: (0,)}, 0)  # rank 1 from root


def _stored_bytes(path) -> int:
    with ucl.open(path) as ck:
        return sum(ck.info(r, k).nbytes for r in range(ck.nranks) for k in ck.keys(r))


@pytest.mark.slow
def test_a_load_across_families_reads_each_box_once_per_job(tmp_path, monkeypatch):
    """Saved with FSDP2 on 4 processes (2 nodes), loaded with TP on 2 (one a node), and saved with TP,
    loaded with FSDP2: the job reads about the checkpoint once in all (verified reads round out to
    checksum chunks and tiles), not once per process, and continues the saving run's losses."""
    monkeypatch.setenv("UCL_TEST_WIDE", "1")
    saved = _spawn([0, 0, 1, 1], tmp_path / "a", "save")
    want = saved[0]["losses"][SAVE_AT:]
    tp = _spawn([0, 1], tmp_path / "a", "load-tp")
    stored = _stored_bytes(ucl.store.CheckpointRoot(tmp_path / "a" / "root").latest())
    assert "root" not in tp[0]["bytes_from"] and sum(tp[0]["bytes_from"].values()) < 1.5 * stored, \
        (tp[0]["bytes_from"], stored)
    assert tp[0]["losses"] == pytest.approx(want, rel=1e-5, abs=1e-6)
    saved = _spawn([0, 1], tmp_path / "b", "save-tp")
    want = saved[0]["losses"][SAVE_AT:]
    back = _spawn([0, 0, 1, 1], tmp_path / "b", "load")
    stored = _stored_bytes(ucl.store.CheckpointRoot(tmp_path / "b" / "root").latest())
    assert "root" not in back[0]["bytes_from"] and sum(back[0]["bytes_from"].values()) < 1.5 * stored, \
        (back[0]["bytes_from"], stored)
    assert back[0]["losses"] == pytest.approx(want, rel=1e-5, abs=1e-6)


def test_a_replica_cut_short_by_a_kill_is_not_counted(tmp_path):
    """A process killed while writing a copy leaves a temp file the node file does not name (the copy
    is named only once renamed into place): the step counts the parts it had, and a file named but
    gone is not counted either."""
    from ucl.store.atomic import tmp_name
    from ucl.train.inventory import local_holdings
    m, o = _model()
    with ucl.Checkpointer(tmp_path / "root", m, o, local=tmp_path / "local") as ck:
        _train(m, o, 0, 2, ck)
    local = ucl.store.CheckpointRoot(tmp_path / "local")
    with open(os.path.join(local.path_for(2), tmp_name(file_name(1))), "wb") as f:
        f.write(b"half a copy")
    assert [h[3] for h in local_holdings(local)] == [[0], [0]]
    with open(os.path.join(local.path_for(1), "ucl_node.json"), "w") as f:
        json.dump({"node": 0, "ranks": [0, 1]}, f)
    assert [h[3] for h in local_holdings(local)] == [[0], [0]]
    os.unlink(os.path.join(local.path_for(2), file_name(0)))
    assert [h[3] for h in local_holdings(local)] == [[0], []]
