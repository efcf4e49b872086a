"""Distributed reshard: every process of a gloo job writes its share of the target files, rank 0
commits. Processes are spawned (multiprocessing "spawn", not torch's spawn, whose join tears every
process down when one dies: the kill tests need the survivors to finish), report through JSON files,
and the parent compares what was published with the single-process ``ucl.reshard`` of the same
source, byte for byte. Failures are injected by monkeypatching ``run_copies`` inside one process
(its forked workers inherit the patch): raise, SIGKILL the process, or SIGSTOP it (hung)."""
from __future__ import annotations

import datetime
import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import ucl
from spawned import free_port  # noqa: E402
from ucl.demo import llama_model, universal_state

SRC_MESH = "pp=2,dp=2,tp=2"
DIMS = dict(vocab=500, hidden=64, heads=4, kv_heads=4, ffn=128, layers=2)  # small: process start-up dominates
MULTI = "pp=1,dp=2,tp=4"  # 8 target files
TIMEOUT_S = 20.0  # the reshard's collective timeout in the good and failing runs
HUNG_TIMEOUT_S = 3.0  # the one given to a job with a hung process
REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
# more spawned jobs than the default run's budget: `UCL_SLOW_TESTS=1 pytest -m slow` runs them
_SKIP_SLOW = pytest.mark.skipif(not os.environ.get("UCL_SLOW_TESTS"), reason="slow: set UCL_SLOW_TESTS=1")


def slow(test):
    return pytest.mark.slow(_SKIP_SLOW(test))


def _inject(kind: str) -> None:
    """This process's reshard workers (forked: they inherit the patch) fail their first copy."""
    import importlib
    from ucl.errors import StoreError
    rs = importlib.import_module("ucl.ops.reshard")  # the module (the attribute ucl.ops.reshard is the function)

    def failing_run_copies(*args, **kwargs):
        if kind == "raise":
            raise StoreError("injected failure in a source read", code="UCL407")
        os.kill(os.getppid(), signal.SIGKILL if kind == "kill" else signal.SIGSTOP)
        time.sleep(60)  # dies with its parent (the reshard's workers do)

    rs.run_copies = failing_run_copies


def _worker(rank: int, world: int, port: int, workdir: str, src: str, phases: list[dict]) -> None:
    """Runs ``phases`` ({name, to, workers, timeout, inject, culprit}) in order; writes
    ``<name>_<rank>.json`` with what this process's ``ucl.reshard`` returned or raised."""
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=30))
    try:
        for ph in phases:
            if ph.get("inject") and rank == ph["culprit"]:
                _inject(ph["inject"])
            res: dict = {"rank": rank}
            t0 = time.perf_counter()
            try:
                to = ph.get("to_by_rank", {}).get(str(rank), ph["to"])  # a job given different arguments
                dst = ph.get("dst_by_rank", {}).get(str(rank), ph["name"])
                st = ucl.reshard(src, os.path.join(workdir, dst), to=to, workers=ph.get("workers"),
                                 distributed=True, timeout=ph.get("timeout", TIMEOUT_S))
                res["stats"] = [st.bytes_written, st.datasets_written]
            except ucl.UclError as e:
                res["error"] = [type(e).__name__, e.code, str(e)]
            except Exception as e:  # noqa: BLE001 - reported to the parent, which fails the test
                res["other_error"] = [type(e).__name__, str(e)]
            res["seconds"] = time.perf_counter() - t0
            with open(os.path.join(workdir, f"{ph['name']}_{rank}.json"), "w") as f:
                json.dump(res, f)
    finally:
        dist.destroy_process_group()  # returns at once even when a dead process broke the world


def _run(world: int, workdir: Path, src: Path, phases: list[dict], limit_s: float = 90.0,
         expect_dead: tuple[int, ...] = ()) -> dict[str, list[dict | None]]:
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, str(workdir), str(src), phases)) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.time() + limit_s
    try:
        for r, p in enumerate(procs):
            if r in expect_dead:
                continue
            p.join(max(0.1, deadline - time.time()))
            if p.is_alive():
                pytest.fail(f"process {r} did not finish within {limit_s} s (a collective hangs?)")
    finally:
        for p in procs:  # only the processes this test started (a stopped one included)
            if p.is_alive():
                p.kill()
            p.join()
    out: dict[str, list[dict | None]] = {}
    for ph in phases:
        out[ph["name"]] = []
        for r in range(world):
            path = workdir / f"{ph['name']}_{r}.json"
            out[ph["name"]].append(json.loads(path.read_text()) if path.exists() else None)
    return out


def _manifest(path: Path) -> dict:
    m = json.loads((path / "manifest.json").read_text())
    m.pop("created", None)
    return m


def _assert_same(got: Path, want: Path) -> None:
    """Bit-exact: the same manifest (datasets, checksums, fields) and the same bytes in every dataset."""
    assert _manifest(got) == _manifest(want)
    with ucl.open(got) as g, ucl.open(want) as w:
        assert g.nranks == w.nranks
        for r in range(w.nranks):
            assert g.keys(r) == w.keys(r), r
            for k in w.keys(r):
                a, b = g.read(r, k), w.read(r, k)
                assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), (r, k)


def _leftovers(workdir: Path) -> list[str]:
    return sorted(n for n in os.listdir(workdir) if n.startswith("."))


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A source checkpoint and its single-process reshards to both targets."""
    d = tmp_path_factory.mktemp("rd-src")
    model = llama_model(DIMS)
    truth = universal_state(model, seed=0)
    mesh = ucl.Mesh.parse(SRC_MESH)
    ucl.save(d / "src", ucl.execute_memory(ucl.compile(model, ucl.UNIVERSAL, mesh), {0: truth}), model=model,
             mesh=mesh, state={"step": 7})
    for name, to in (("universal", "universal"), ("multi", MULTI)):
        ucl.reshard(d / "src", d / f"ref-{name}", to=to, workers=1)
    return d


GOOD = [{"name": "universal", "to": "universal"}, {"name": "multi", "to": MULTI}]


@pytest.fixture(scope="module")
def world2(source, tmp_path_factory):
    """One 2-process job: both targets, the multi-file one again with 2 forked workers per process,
    a failure injected in process 1, then process 1 hung (one spawn for all keeps this file fast)."""
    d = tmp_path_factory.mktemp("rd-world2")
    phases = GOOD + [{"name": "multi-w2", "to": MULTI, "workers": 2},
                     {"name": "other-to", "to": "pp=1,dp=5,tp=2", "to_by_rank": {"1": "pp=1,dp=4,tp=2"}},
                     {"name": "other-dst", "to": MULTI, "dst_by_rank": {"1": "other-dst-1"}},
                     {"name": "fail", "to": MULTI, "inject": "raise", "culprit": 1},
                     {"name": "hung", "to": MULTI, "inject": "stop", "culprit": 1, "timeout": HUNG_TIMEOUT_S}]
    return d, _run(2, d, source / "src", phases, expect_dead=(1,))


@pytest.fixture(scope="module")
def world4(source, tmp_path_factory):
    """One 4-process job: both targets, then process 3 killed with SIGKILL mid-way."""
    d = tmp_path_factory.mktemp("rd-world4")
    return d, _run(4, d, source / "src", GOOD + [{"name": "kill", "to": MULTI, "inject": "kill", "culprit": 3}],
                   expect_dead=(3,))


@pytest.mark.parametrize("target", ["universal", "multi"])
def test_two_processes_bit_exact(source, world2, target):
    d, res = world2
    for r in res[target]:
        assert r is not None and "stats" in r, r
    assert res[target][0]["stats"] == res[target][1]["stats"]  # every process gets the job's totals
    _assert_same(d / target, source / f"ref-{target}")


def test_two_processes_with_local_workers(source, world2):
    d, res = world2
    assert all("stats" in r for r in res["multi-w2"]), res["multi-w2"]
    _assert_same(d / "multi-w2", source / "ref-multi")


@pytest.mark.parametrize("case", ["other-to", "other-dst"])
def test_processes_given_different_jobs_refuse_on_every_process_and_write_nothing(world2, case):
    """Each process would write its share of another checkpoint (before: rank 0 published a
    checkpoint of mixed layouts that `ucl verify` passed, or rank 1 wrote into rank 0's)."""
    d, res = world2
    for r in res[case]:
        assert r is not None and r.get("error", [None])[:2] == ["StoreError", "UCL425"], r
        assert ("--to: rank 0: pp=1,dp=5,tp=2, rank 1: pp=1,dp=4,tp=2" if case == "other-to" else
                f"DST: rank 0: {d / 'other-dst'}, rank 1: {d / 'other-dst-1'}") in r["error"][2], r
    assert not (d / case).exists() and not (d / "other-dst-1").exists()
    assert _leftovers(d) == []


def test_failure_in_one_process_publishes_nothing_and_every_process_raises(world2):
    d, res = world2
    culprit, other = res["fail"][1], res["fail"][0]
    assert culprit["error"][:2] == ["StoreError", "UCL407"], culprit  # its own error
    assert "injected failure" in culprit["error"][2]
    assert other["error"][:2] == ["StoreError", "UCL410"], other  # the job's: who failed, and why
    assert "rank 1" in other["error"][2] and "injected failure" in other["error"][2], other
    assert not (d / "fail").exists()
    assert _leftovers(d) == []


@pytest.mark.slow  # two processes above keep distributed reshards in the default pass
@pytest.mark.parametrize("target", ["universal", "multi"])
def test_four_processes_bit_exact(source, world4, target):
    d, res = world4
    assert all(r is not None and "stats" in r for r in res[target]), res[target]
    _assert_same(d / target, source / f"ref-{target}")


def _assert_survivors_failed(results: list[dict | None], dead: int, limit_s: float) -> None:
    assert results[dead] is None
    for r, res in enumerate(results):
        if r == dead:
            continue
        assert res is not None and "error" in res, res
        assert res["error"][0] == "StoreError" and res["error"][1] in ("UCL424", "UCL410"), res
        assert res["seconds"] < limit_s, res


@pytest.mark.slow
def test_killed_process_fails_the_others_and_publishes_nothing(world4):
    d, res = world4
    _assert_survivors_failed(res["kill"], 3, TIMEOUT_S)
    assert not (d / "kill").exists()
    assert _leftovers(d) == []  # rank 0 removed its temp directory


@slow
def test_killed_rank_0_publishes_nothing_and_leaves_gc_the_temp_dir(source, tmp_path):
    res = _run(2, tmp_path, source / "src", [{"name": "kill0", "to": MULTI, "inject": "kill", "culprit": 0}],
               expect_dead=(0,))
    _assert_survivors_failed(res["kill0"], 0, TIMEOUT_S)
    assert not (tmp_path / "kill0").exists()
    from ucl.store.atomic import collect_garbage
    collect_garbage(tmp_path)  # the dead owner's lock is free: its temp directory goes
    assert _leftovers(tmp_path) == []


def test_hung_process_is_given_up_on_after_the_timeout(world2):
    d, res = world2
    _assert_survivors_failed(res["hung"], 1, HUNG_TIMEOUT_S + 10)
    assert res["hung"][0]["error"][1] == "UCL424", res
    assert not (d / "hung").exists()
    assert _leftovers(d) == []


def test_cli_under_torchrun(source, tmp_path):
    out = tmp_path / "cli"
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1"}
    p = subprocess.run([str(BIN / "torchrun"), "--nproc_per_node", "2", "--master_port", str(free_port()),
                        "-m", "ucl", "reshard", str(source / "src"), str(out), "--to", MULTI, "--timeout", "30"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.count("with 2 processes") == 1, p.stdout  # rank 0 alone reports
    _assert_same(out, source / "ref-multi")


@slow
def test_cli_under_torchrun_fails_cleanly(source, tmp_path):
    """A target that exists: every process says so, none prints a traceback (torchrun's own report aside)."""
    out = tmp_path / "cli"
    out.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1"}
    p = subprocess.run([str(BIN / "torchrun"), "--nproc_per_node", "2", "--master_port", str(free_port()),
                        "-m", "ucl", "reshard", str(source / "src"), str(out), "--to", MULTI],
                       capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode != 0
    assert p.stderr.count("ucl: checkpoint not written") == 2 and "already exists" in p.stderr, p.stderr
    # frames of ucl's own code (torchrun's report of the failed children is a traceback of torchrun's, and the
    # checkout may itself sit in a folder named ucl)
    ours = f'File "{REPO / "ucl"}{os.sep}'
    assert not [line for line in p.stderr.splitlines() if ours in line], p.stderr


def test_distributed_without_a_process_group_is_refused(source, tmp_path):
    with pytest.raises(ucl.UclError) as e:
        ucl.reshard(source / "src", tmp_path / "x", to=MULTI, distributed=True)
    assert e.value.code == "UCL422"
    with pytest.raises(ucl.UclError) as e:
        ucl.reshard(source / "src", tmp_path / "x", to=MULTI, distributed=True, timeout=0)
    assert e.value.code == "UCL009"
