"""A live checkpoint root nobody can break (docs/security.md, "Lifecycle"):

* one writer at a time: a second ``Checkpointer`` (in this process or another) or a ``ucl.save`` into a
  root a ``Checkpointer`` holds is refused with UCL414 naming the holder; a holder that died is not
  waited for;
* readers change nothing: a ``Checkpointer`` that only loads from a live root (an evaluation job)
  removes, moves and writes nothing there;
* ``ucl gc`` never removes what a live writer may still publish, with or without ``--force``: a
  writer's temp folder until after its rename, a ``latest`` being replaced, a step being re-saved;
* a re-save (``load()``, then ``save(N)`` again) killed at any point leaves step N loadable and
  ``latest`` valid, with the atomic swap of two folders and without it (two renames, undone by
  the root's next holder).

The kill tests run tests/root_child.py in processes forked by a forkserver that has torch and ucl
imported (a fork costs a fraction of a second); the default pass runs a few kills, the slow pass many.
"""
from __future__ import annotations

import multiprocessing
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import ucl  # noqa: E402
from ucl.demo import llama_model, universal_state  # noqa: E402
from ucl.store import CheckpointRoot, CheckpointWriter  # noqa: E402
from ucl.store import atomic, rootlock  # noqa: E402
from ucl.store.atomic import collect_garbage, is_committed, is_tmp_name  # noqa: E402
from ucl.store.manifest import MANIFEST_NAME  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)
import root_child as child  # noqa: E402

REPO = os.path.dirname(HERE)
ENV = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
LINUX = sys.platform.startswith("linux")


def _listing(folder) -> dict[str, tuple]:
    """Every entry under ``folder`` with its inode, size and mtime: what 'changed nothing' compares."""
    out = {}
    for top, dirs, files in os.walk(folder):
        for n in dirs + files:
            p = os.path.join(top, n)
            st = os.lstat(p)
            out[os.path.relpath(p, folder)] = (st.st_ino, st.st_size, st.st_mtime_ns)
    return out


# ---------------------------------------------------------------- one writer at a time

def test_a_second_checkpointer_on_a_root_is_refused_naming_the_holder(tmp_path):
    root = str(tmp_path / "ck")
    first = ucl.Checkpointer(root, *child.build(1), keep=2)
    second = ucl.Checkpointer(root, *child.build(2), keep=2)  # a reader until it saves: that is allowed
    try:
        first.save(0)
        first.wait()
        assert second.load()[0] == 0
        with pytest.raises(ucl.UclError) as e:
            second.save(1)
        assert e.value.code == "UCL414"
        msg = str(e.value)
        assert f"pid {os.getpid()}" in msg and socket.gethostname() in msg and "Checkpointer" in msg, msg
        first.save(1)  # the holder goes on undisturbed
        first.wait()
        assert CheckpointRoot(root).steps() == [0, 1] and CheckpointRoot(root).latest_step() == 1
    finally:
        first.close()
    second.save(2)  # the holder closed: the root is free
    second.close()
    assert CheckpointRoot(root).latest_step() == 2


HOLD = """
import sys, time
from ucl.store import rootlock
rootlock.acquire(sys.argv[1], "Checkpointer")
print("held", flush=True)
time.sleep(600)
"""


def test_a_root_held_by_another_process_is_refused_and_freed_when_it_dies(tmp_path):
    root = str(tmp_path / "ck")
    holder = subprocess.Popen([sys.executable, "-c", HOLD, root], env=ENV, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert rootlock.holder(root)["pid"] == holder.pid
        with ucl.Checkpointer(root, *child.build(1)) as ck:
            with pytest.raises(ucl.UclError) as e:
                ck.save(0)
            assert e.value.code == "UCL414" and f"pid {holder.pid} on host {socket.gethostname()}" in str(e.value)
            model = llama_model()
            with pytest.raises(ucl.StoreError) as e:  # ucl.save into the held root
                ucl.save(os.path.join(root, "extra"), {0: universal_state(model)}, model=model, mesh=ucl.UNIVERSAL)
            assert e.value.code == "UCL414" and not os.path.exists(os.path.join(root, "extra"))
            holder.kill()  # SIGKILL: the kernel lets the lock go, nobody waits for a lease to expire
            holder.wait(30)
            assert rootlock.holder(root) is None
            ck.save(0)
        assert CheckpointRoot(root).latest_step() == 0
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait(30)


# ---------------------------------------------------------------- readers change nothing

def test_loading_from_a_live_root_changes_nothing_in_it(tmp_path):
    """An evaluation job's ``Checkpointer(root, model).load()`` beside a training job: before, its
    start-up clean-up deleted the trainer's ``latest`` being replaced, and every later save failed."""
    root = str(tmp_path / "ck")
    with ucl.Checkpointer(root, *child.build(1), keep=2) as trainer:
        for step in (0, 1):
            trainer.save(step)
        trainer.wait()
        # what the trainer may have in flight at any moment: a `latest` being replaced, the old
        # copy of a re-saved step, a leftover of its own killed predecessor
        replacing = os.path.join(root, atomic.tmp_name("latest"))
        with open(replacing, "w") as f:
            f.write("step_00000001\n")
        swapped = os.path.join(root, atomic.tmp_name("step_00000001"))
        os.mkdir(swapped)
        before = _listing(root)
        model, optimizer = child.build(7)
        with ucl.Checkpointer(root, model, optimizer, keep=2) as evaluator:
            assert evaluator.load()[0] == 1
            assert evaluator.load(step=0)[0] == 0
        assert _listing(root) == before  # nothing removed, moved, adopted or traced
        os.unlink(replacing)
        os.rmdir(swapped)
        trainer.save(2)
        trainer.wait()
    assert CheckpointRoot(root).latest_step() == 2


# ---------------------------------------------------------------- gc against live writers

def _gc_all(folder) -> None:
    """Every way ``ucl gc`` can be asked to be aggressive."""
    collect_garbage(folder, force=True)
    collect_garbage(folder, max_age_s=0)
    collect_garbage(folder, max_age_s=0, force=True)


def test_gc_in_a_writers_last_moment_before_its_rename_removes_nothing(tmp_path, monkeypatch):
    """The window the race hit (6 of 20 before): the writer had dropped its lock file just before
    ``rename``, so ``gc --force`` (or ``--max-age 0``) removed the folder it was publishing."""
    model = llama_model()
    real = os.rename
    seen = []

    def rename(src, dst, *a, **k):
        if is_tmp_name(os.path.basename(src)) and os.path.basename(dst) == "ck":
            _gc_all(os.path.dirname(src))
            seen.append(os.path.isdir(src))
        return real(src, dst, *a, **k)
    monkeypatch.setattr(os, "rename", rename)
    path = ucl.save(tmp_path / "ck", {0: universal_state(model)}, model=model, mesh=ucl.UNIVERSAL)
    assert seen == [True]
    assert os.path.isfile(os.path.join(path, MANIFEST_NAME)) and atomic.LOCK_NAME not in os.listdir(path)
    with ucl.open(path) as ck:
        assert ck.verify() == []


def test_gc_in_a_writers_first_moment_before_its_lock_file_removes_nothing(tmp_path, monkeypatch):
    """The other end of a writer's life: its temp folder exists before the lock file in it does."""
    model = llama_model()
    real = atomic._hold_lock
    seen = []

    def hold_lock(folder):
        _gc_all(os.path.dirname(folder))
        seen.append(os.path.isdir(folder))
        return real(folder)
    monkeypatch.setattr(atomic, "_hold_lock", hold_lock)
    path = ucl.save(tmp_path / "ck", {0: universal_state(model)}, model=model, mesh=ucl.UNIVERSAL)
    assert seen == [True]
    with ucl.open(path) as ck:
        assert ck.verify() == []


def test_gc_while_a_checkpointer_replaces_latest_and_re_saves_removes_nothing(tmp_path, monkeypatch):
    """``latest`` is replaced through a temp file without a lock file, and a re-saved step's old copy
    has none: in a root a live Checkpointer holds, gc leaves them to it."""
    root = str(tmp_path / "ck")
    real_replace, real_exchange = os.replace, atomic.exchange_dirs
    kept = []

    def replace(src, dst, *a, **k):
        if os.path.basename(dst) == "latest":
            _gc_all(root)
            kept.append(os.path.exists(src))
        return real_replace(src, dst, *a, **k)

    def exchange(a, b):
        done = real_exchange(a, b)
        _gc_all(root)
        kept.append(os.path.isdir(b) and is_committed(b))
        return done
    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(atomic, "exchange_dirs", exchange)
    import ucl.store.root as root_module
    monkeypatch.setattr(root_module, "exchange_dirs", exchange)
    with ucl.Checkpointer(root, *child.build(1), keep=2) as ck:
        ck.save(0)
        ck.save(1)
        ck.wait()
        assert ck.load(step=0)[0] == 0
        ck.save(0)  # a re-save (and the abandoned step 1 goes)
        ck.wait()
    assert kept and all(kept), kept
    assert CheckpointRoot(root).steps() == [0] and CheckpointRoot(root).latest_step() == 0


def _saves_beside_gc(folder, saves: int, stop) -> list[str]:
    """``ucl.save`` of ``saves`` checkpoints into ``folder``; the paths whose save returned."""
    model = llama_model({"vocab": 64, "hidden": 16, "heads": 2, "kv_heads": 1, "ffn": 32, "layers": 1})
    state = universal_state(model)
    done = []
    try:
        for i in range(saves):
            done.append(ucl.save(os.path.join(folder, f"ck{i}"), {0: state}, model=model, mesh=ucl.UNIVERSAL,
                                 durable=False))
    finally:
        stop.set()
    return done


@pytest.mark.parametrize("saves", [pytest.param(20, id="20"), pytest.param(300, id="300", marks=pytest.mark.slow)])
def test_gc_force_in_a_loop_beside_saves_every_save_keeps_its_manifest(tmp_path, saves):
    folder = str(tmp_path)
    stop = threading.Event()
    collected = [0]

    def collect():
        while not stop.is_set():
            _gc_all(folder)
            collected[0] += 1
    gc = threading.Thread(target=collect)
    gc.start()
    try:
        done = _saves_beside_gc(folder, saves, stop)
    finally:
        stop.set()
        gc.join()
    assert collected[0] > 0
    missing = [p for p in done if not os.path.isfile(os.path.join(p, MANIFEST_NAME))]
    assert not missing, f"{len(missing)} of {len(done)} saves returned but left no manifest: {missing[:3]}"


# ---------------------------------------------------------------- a re-save killed at any point

@pytest.fixture(scope="module")
def forkserver():
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "ucl", "ucl.train", "root_child"])
    return ctx


def _run(ctx, target, args, kill_after: float | None, timeout: float = 120) -> tuple[int | None, list[str]]:
    """Run ``target(*args, conn)`` in a forked process; SIGKILL it ``kill_after`` seconds after it
    reports ``ready`` (None: let it end). Returns its exit code and what it reported."""
    r, w = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=target, args=(*args, w), daemon=True)
    proc.start()
    w.close()
    lines = []
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not r.poll(1):
                if not proc.is_alive():
                    break
                continue
            try:
                lines.append(r.recv_bytes().decode())
            except (EOFError, OSError):
                break
            if lines[-1] == "ready" and kill_after is not None:
                time.sleep(kill_after)
                proc.kill()
                break
    finally:
        if proc.is_alive() and kill_after is None and time.monotonic() >= deadline:
            proc.kill()
        proc.join(30)
        r.close()
    return proc.exitcode, lines


def _check_root(root: str, step: int, what: str) -> None:
    """Step ``step`` committed and whole, ``latest`` valid, and a load (read-only) finds it; then
    the root's next holder takes it over without losing it."""
    r = CheckpointRoot(root)
    names = sorted(os.listdir(root))
    assert step in r.steps(), f"{what}: step {step} lost; the root holds {names}"
    latest = r.latest()  # raises on a dangling pointer
    assert latest is not None and is_committed(latest), f"{what}: latest {r.latest_name()}; {names}"
    with ucl.open(r.path_for(step)) as ck:
        assert ck.verify() == [], what
        assert ck.manifest.state["extra"]["step"] == step
    before = _listing(root)
    with ucl.Checkpointer(root, *child.build(3)) as reader:
        assert reader.load(step=step)[0] == step
    assert _listing(root) == before, f"{what}: a load changed the root"
    lock = rootlock.acquire(root, "test")
    try:
        r.take_over()
    finally:
        lock.release()
    assert step in r.steps() and r.latest_step() == r.steps()[-1], f"{what}: {sorted(os.listdir(root))}"
    # a writer killed between making its `tmp-new-` folder and locking it leaves that folder: nobody can
    # tell it from a writer about to lock it, so it stays until it is an hour old (docs/format.md)
    left = [n for n in os.listdir(root) if is_tmp_name(n) and ".tmp-new-" not in n]
    assert not left, f"{what}: {sorted(os.listdir(root))}"


@pytest.mark.parametrize("trials", [pytest.param(2, id="2"), pytest.param(40, id="40", marks=pytest.mark.slow)])
def test_a_re_save_killed_at_random_points_leaves_the_step_loadable(tmp_path, forkserver, trials):
    """The child saves step 1 once, then loops ``load(); save(1)``; it is SIGKILLed at a random
    moment of that loop. Before, 4 of 4 such kills ended with "no checkpoint"."""
    r = random.Random(4321)
    for n in range(trials):
        root = str(tmp_path / f"t{n}")
        code, lines = _run(forkserver, child.resave_forever, (root, n), kill_after=r.uniform(0.0, 1.5))
        assert code == -signal.SIGKILL, f"trial {n}: exit code {code}, reported {lines[-3:]}"
        _check_root(root, 1, f"trial {n} ({sum(x.startswith('resaved') for x in lines)} re-saves done)")


@pytest.mark.parametrize("where", ["writing", "after_swap", "gap", "gap_no_older"])
def test_a_re_save_killed_at_each_publication_point_leaves_the_step_loadable(tmp_path, forkserver, where):
    """Kills at the narrow points random ones rarely hit: while the new copy is written (before: the
    old copy was already hidden, ``latest`` moved off it), right after the atomic swap, and (on a
    file system without the swap) between the two renames, with and without an older step for
    ``latest`` to stand on meanwhile."""
    if where == "after_swap" and not LINUX:
        pytest.skip("renameat2 is Linux's")
    root = str(tmp_path / "ck")
    code, lines = _run(forkserver, child.resave_killed_at, (root, where), kill_after=None)
    if "no swap" in lines:
        pytest.skip("this file system cannot swap two folders atomically")
    assert code == -signal.SIGKILL, f"{where}: exit code {code}, reported {lines[-3:]}"
    assert "killing" in lines, lines
    if where.startswith("gap"):  # the step is set aside: the next holder puts it back
        names = os.listdir(root)
        assert any(atomic.tag_of(n).startswith(atomic.SET_ASIDE_TAG) for n in names if is_tmp_name(n)), names
        r = CheckpointRoot(root)
        if where == "gap":  # latest stood on step 0 meanwhile: loadable as is
            assert r.latest_step() == 0 and is_committed(r.latest())
        lock = rootlock.acquire(root, "test")
        try:
            r.take_over()
        finally:
            lock.release()
    _check_root(root, 1, where)


def test_gc_keeps_a_step_set_aside_by_a_killed_re_save(tmp_path):
    """Without an atomic swap a re-save renames the old copy aside for a moment; killed then, that
    copy is the step's only one: ``gc --force`` keeps it, the next holder puts it back."""
    r = CheckpointRoot(tmp_path)
    model = llama_model()
    path = ucl.save(r.path_for(1), {0: universal_state(model)}, model=model, mesh=ucl.UNIVERSAL)
    aside = os.path.join(r.root, atomic.tmp_name(r.dir_name(1), atomic.SET_ASIDE_TAG))
    os.rename(path, aside)
    found = collect_garbage(r.root, force=True, max_age_s=0)
    assert [(os.path.basename(e.path), e.state, e.removed) for e in found] == [(os.path.basename(aside), "set aside",
                                                                               False)]
    assert r.take_over() == [] and r.steps() == [1] and r.latest_step() == 1


SAVE_RANK = """
import os, sys, torch.distributed as dist
import ucl
from ucl.demo import llama_model, universal_state
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[2], rank=0, world_size=1)
model = llama_model()
try:
    ucl.save_rank(os.path.join(sys.argv[1], "extra"), universal_state(model), model=model, mesh=ucl.UNIVERSAL, rank=0)
    print("saved")
except ucl.UclError as e:
    print(e.code, e)
"""


def test_save_rank_under_a_process_group_into_a_held_root_is_refused(tmp_path):
    """The collective save takes the root's lock on rank 0 as ``save`` does: UCL414 on every process."""
    from spawned import free_port
    root = str(tmp_path / "ck")
    holder = subprocess.Popen([sys.executable, "-c", HOLD, root], env=ENV, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        out = subprocess.run([sys.executable, "-c", SAVE_RANK, root, str(free_port())],
                             env=ENV, capture_output=True, text=True, timeout=120)
        assert out.stdout.startswith("UCL414") and f"pid {holder.pid}" in out.stdout, out.stdout + out.stderr
        assert not os.path.exists(os.path.join(root, "extra"))
    finally:
        holder.kill()
        holder.wait(30)
    out = subprocess.run([sys.executable, "-c", SAVE_RANK, root, str(free_port())],
                         env=ENV, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "saved", out.stdout + out.stderr
