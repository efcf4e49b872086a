"""ucl.Checkpointer survives SIGKILL at any moment of snapshot, flush, commit, ``latest`` and pruning.

A trial runs tests/train_crash_child.py (a seeded MLP + Adam that calls ``ck.save(i, extra={"i": i})``
before every iteration, ~2.7 MB per checkpoint, keep=3) in its own process and SIGKILLs it:

* at random points (``test_sigkill_at_random_points...``): once ``save`` has returned a random number
  of times (0-10), after a random delay spanning about one save-to-save cycle (one flush, commit,
  ``latest`` move and prune), measured in the child as it runs; two trials at a time;
* at the narrow publication points random kills rarely hit (``test_sigkill_at_publication_point``):
  the child kills itself right after a commit before ``latest`` moves, with the new ``latest`` written
  but not renamed, and in the middle of pruning.

Then, in this process:

* every ``step_*`` directory visible in the root is committed and verifies (no partial checkpoint);
* ``latest`` is absent only before the first ``set_latest`` (at most one commit), and otherwise
  points at a committed step, the newest or (killed between commit and ``set_latest``) the one before;
* the committed steps are consecutive, at most ``keep + 1``, none beyond the child's last ``save``;
* ``load()`` (and ``load(step)`` for every other committed step) into a fresh, differently initialised
  model gives bit for bit the parameters, Adam state and torch RNG state of a replay of the same
  seeded run without checkpointing, and ``extra == {"i": step}``; with nothing committed, UCL404;
* loading (a ``Checkpointer`` that only reads) changes nothing in the root; the next writer
  (``CheckpointRoot.take_over``, what a ``Checkpointer``'s first save does under the root lock)
  removes the leftover temp entries, keeps every committed step and points ``latest`` at the newest one.

Trial processes are forked by a forkserver that has torch and ucl imported already (started from
``sys.executable``): a trial costs a fraction of a second instead of the seconds ``import torch`` and
the first optimizer (which imports torch._dynamo) take. Seeds, kill counts and delay fractions come
from ``random.Random(1234)``: the plan is reproducible (where in the cycle a kill lands depends on
timing). ``test_resume_after_kill_between_commit_and_latest``: a job killed between committing step K and
moving ``latest`` resumes from step K (the Checkpointer adopts the newest committed step).
"""
from __future__ import annotations

import collections
import multiprocessing
import multiprocessing.forkserver
import os
import random
import re
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import ucl  # noqa: E402
from ucl.store import CheckpointRoot, cleanup_stale  # noqa: E402
from ucl.store import rootlock  # noqa: E402
from ucl.store.atomic import is_committed, is_tmp_name  # noqa: E402
from ucl.store.rootlock import ROOT_LOCK_NAME  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:  # pytest's rootdir-relative import usually put it there already
    sys.path.insert(0, HERE)
import train_crash_child as child  # noqa: E402

TRIALS = 32
PARALLEL = 2
MASTER_SEED = 1234
# multiprocessing's Process objects are not thread-safe: start() reaps finished children (reading their
# exit status) and may race with another thread's join()/is_alive() on the same child, which then reads
# EOF and reports exit code 255. Every start/poll/kill/join holds this lock.
_PROCS = threading.Lock()
MAX_SAVES = 10  # keep=3: from the 4th commit on, every flush also prunes
MIN_SPAN_S, SPAN_CYCLES = 0.05, 1.5
CHILD_TIMEOUT_S = 60  # a child that reported nothing for this long is hung
STEP_DIR = re.compile(r"^step_(\d{8,})$")


@dataclass
class Trial:
    n: int
    seed: int
    saves: int  # kill once this many `saved` reports were read (0: right after `ready`, before any save)
    phase: float  # then sleep phase * max(MIN_SPAN_S, SPAN_CYCLES * the last save-to-save interval)
    where: str | None = None  # or: the child kills itself there (train_crash_child.run_killed_in)
    delay_s: float = 0.0  # the sleep that resulted
    root: str = ""
    last_saved: int = -1  # highest step whose save() returned, from everything the child printed
    returncode: int | None = None
    error: str = ""  # the child misbehaved (died on its own, hung)
    output: str = ""  # the child's stdout and stderr
    problems: list[str] = field(default_factory=list)
    kind: str = ""  # what the kill interrupted, judged from what it left

    def __str__(self) -> str:
        if self.where:
            return (f"trial {self.where!r} (seed={self.seed}, killed itself at {self.where}, last save() "
                    f"returned: step {self.last_saved}, root {self.root})")
        return (f"trial {self.n} (seed={self.seed}, killed {self.delay_s * 1000:.1f} ms after save() returned "
                f"{self.saves} times, last save() returned: step {self.last_saved}, root {self.root})")


def _plan() -> list[Trial]:
    r = random.Random(MASTER_SEED)
    return [Trial(n, r.randrange(1, 1 << 30), r.randint(0, MAX_SAVES), r.random()) for n in range(TRIALS)]


def _run_child(ctx, trial: Trial, tmp_path) -> Trial:
    """Start a trial process and SIGKILL it at the trial's point (or let it kill itself at
    ``trial.where``); collect what it reported."""
    base = tmp_path / f"trial{trial.n:02d}"
    base.mkdir()
    trial.root = str(base / "ckpt")
    log = str(base / "output")
    r, w = ctx.Pipe(duplex=False)
    if trial.where:
        proc = ctx.Process(target=child.run_killed_in, args=(trial.root, trial.seed, trial.where, w, log), daemon=True)
    else:
        proc = ctx.Process(target=child.run, args=(trial.root, trial.seed, w, log), daemon=True)
    lines: list[str] = []
    times: list[float] = []
    killed = False  # by us
    try:
        with _PROCS:
            proc.start()
        w.close()
        while True:
            if not r.poll(CHILD_TIMEOUT_S):
                trial.error = f"no progress for {CHILD_TIMEOUT_S} s (hung?)"
                break
            try:
                lines.append(r.recv_bytes().decode())
                times.append(time.monotonic())
            except (EOFError, OSError):
                break  # the child died: on its own, or (trial.where) by its own SIGKILL
            saves = sum(x.startswith("saved ") for x in lines)
            if trial.where is None and (lines[-1] == "ready" and trial.saves == 0 or
                                        lines[-1].startswith("saved ") and saves >= trial.saves):
                # A save() returns when the pool has room, i.e. when the flush before last is done, so
                # the last interval is about one flush + commit + `latest` + prune cycle on this machine
                # now: sweep a bit more than that, wherever the kill lands in it.
                cycle = times[-1] - times[-2] if len(times) >= 2 else 0.0
                trial.delay_s = trial.phase * max(MIN_SPAN_S, SPAN_CYCLES * cycle)
                time.sleep(trial.delay_s)
                with _PROCS:
                    if proc.is_alive():
                        proc.kill()  # SIGKILL
                        killed = True
                break
    finally:
        with _PROCS:
            if proc.pid is not None:  # started
                if not killed and proc.exitcode is None and (trial.where is None or trial.error):
                    proc.kill()  # something above went wrong (hung, error): end it
                proc.join(30)
                trial.returncode = proc.exitcode
        try:
            while r.poll(0):  # what it reported between our last read and the kill
                lines.append(r.recv_bytes().decode())
        except (EOFError, OSError):
            pass
        r.close()
    trial.output = open(log, errors="replace").read()[-3000:] if os.path.exists(log) else ""
    saved = [int(x.split()[1]) for x in lines if x.startswith("saved ")]
    trial.last_saved = max(saved, default=-1)
    if not trial.error and trial.returncode != -signal.SIGKILL:
        trial.error = "the child ended on its own"
    elif not trial.error and not killed and trial.where is None:
        trial.error = "the child died before the planned kill"
    if trial.error:
        trial.error += (f"; exit code {trial.returncode}, reported {len(lines)} lines (last {lines[-3:]}); "
                        f"its output:\n{trial.output}")
    return trial


class _GlobalRng:
    """Checkpointer.load() restores the process's torch/numpy/Python generators: keep ours."""

    def __enter__(self):
        self.state = torch.get_rng_state(), np.random.get_state(), random.getstate()

    def __exit__(self, *exc):
        torch.set_rng_state(self.state[0])
        np.random.set_state(self.state[1])
        random.setstate(self.state[2])


def _diff_tensors(what: str, got: dict, want: dict) -> list[str]:
    out = []
    if set(got) != set(want):
        out.append(f"{what}: keys differ: loaded {sorted(got)}, replay {sorted(want)}")
    for k in sorted(set(got) & set(want)):
        a, b = got[k], want[k]
        if torch.is_tensor(a) and torch.is_tensor(b):
            if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b):
                delta = (a.double() - b.double()).abs().max().item() if a.shape == b.shape else "n/a"
                out.append(f"{what}[{k}]: loaded {a.dtype}{list(a.shape)} != replay {b.dtype}{list(b.shape)} "
                           f"(max |diff| {delta})")
        elif a != b:
            out.append(f"{what}[{k}]: loaded {a!r} != replay {b!r}")
    return out


def _load_and_compare(trial: Trial, step: int | None, want_step: int, replay: dict) -> list[str]:
    """Load (latest when ``step`` is None) into a fresh, differently seeded model and compare with the replay."""
    where = f"load({'' if step is None else step})"
    model, optimizer = child.build(trial.seed + 1)  # other weights, no optimizer state: all must come from disk
    try:
        with _GlobalRng():
            torch.manual_seed(trial.seed + 2)  # another RNG state, which load() must overwrite
            with ucl.Checkpointer(trial.root, model, optimizer, keep=child.KEEP) as ck:
                got_step, extra = ck.load(step)
            got_rng = torch.get_rng_state()
    except Exception as e:
        return [f"{where}: raised {type(e).__name__}: {e}"]
    problems = []
    if got_step != want_step:
        return [f"{where}: returned step {got_step}, expected {want_step}"]
    if extra != {"i": want_step}:
        problems.append(f"{where}: extra {extra!r}, expected {{'i': {want_step}}}")
    want = replay[want_step]
    problems += _diff_tensors(f"{where} step {want_step} parameter", dict(model.state_dict()), want["params"])
    got_opt, want_opt = optimizer.state_dict(), want["optimizer"]
    if want_step == 0:  # no optimizer step yet: nothing to compare but the hyperparameters
        pass
    elif set(got_opt["state"]) != set(want_opt["state"]):
        problems.append(f"{where} step {want_step}: optimizer state for params {sorted(got_opt['state'])}, "
                        f"replay has {sorted(want_opt['state'])}")
    else:
        for pid in sorted(want_opt["state"]):
            problems += _diff_tensors(f"{where} step {want_step} optimizer state of param {pid}",
                                      got_opt["state"][pid], want_opt["state"][pid])
    if [{k: v for k, v in g.items() if k != "params"} for g in got_opt["param_groups"]] != \
            [{k: v for k, v in g.items() if k != "params"} for g in want_opt["param_groups"]]:
        problems.append(f"{where} step {want_step}: optimizer hyperparameters differ")
    if not torch.equal(got_rng, want["torch_rng"]):
        problems.append(f"{where} step {want_step}: the torch RNG state was not restored to the child's")
    return problems


def _check(trial: Trial) -> Trial:
    """Every invariant of the checkpoint root a SIGKILL may leave; appends to trial.problems."""
    p = trial.problems
    root = CheckpointRoot(trial.root)
    names = sorted(os.listdir(trial.root)) if os.path.isdir(trial.root) else []
    tmp = [n for n in names if is_tmp_name(n)]
    step_dirs = [n for n in names if STEP_DIR.match(n)]
    other = [n for n in names if n not in tmp and n not in step_dirs and n not in ("latest", ROOT_LOCK_NAME)
             and not re.match(r"^trace-rank\d+\.jsonl$", n)]
    if other:
        p.append(f"unexpected entries in the root: {other}")
    partial = [n for n in step_dirs if not is_committed(os.path.join(trial.root, n))]
    if partial:
        p.append(f"partial checkpoint(s) visible under a final name (no manifest.json): {partial}")
    steps = root.steps()
    if steps != sorted(int(STEP_DIR.match(n).group(1)) for n in step_dirs if n not in partial):
        p.append(f"CheckpointRoot.steps() = {steps} disagrees with the listing {names}")

    # latest
    try:
        latest_name = root.latest_name()
    except Exception as e:
        p.append(f"`latest` is unreadable: {type(e).__name__}: {e}")
        return trial
    latest_step = root.latest_step()
    if latest_name is None:
        if len(steps) > 1:
            p.append(f"no `latest` although steps {steps} are committed (only the very first commit may "
                     "precede the first `latest`)")
    else:
        try:
            path = root.latest()
        except Exception as e:
            p.append(f"`latest` -> {latest_name} is dangling: {type(e).__name__}: {e}; listing {names}")
            return trial
        if latest_step not in steps:
            p.append(f"`latest` -> {latest_name} (step {latest_step}) is not among the committed steps {steps}")
            return trial
        if latest_step not in steps[-2:]:
            p.append(f"`latest` -> step {latest_step} lags more than one commit behind: committed {steps}")
        if path != root.path_for(latest_step):
            p.append(f"latest() = {path}, expected {root.path_for(latest_step)}")

    # the committed set
    if steps:
        if steps != list(range(steps[0], steps[-1] + 1)):
            p.append(f"committed steps are not consecutive: {steps}")
        if len(steps) > child.KEEP + 1:
            p.append(f"{len(steps)} committed steps {steps}, keep={child.KEEP} allows at most {child.KEEP + 1} "
                     "(one committed but not yet pruned)")
        if steps[-1] > trial.last_saved + 1:
            p.append(f"step {steps[-1]} committed, but the child's last save() that returned was step "
                     f"{trial.last_saved}")
    for s in steps:
        with ucl.open(root.path_for(s)) as ck:
            bad = ck.verify()
        if bad:
            p.append(f"committed step {s} does not verify: {bad[:3]}")

    # what was interrupted, for the summary
    if not steps:
        trial.kind = "before the first commit"
    elif latest_name is None:
        trial.kind = "between the first commit and `latest`"
    elif any(n.startswith(".latest.tmp-") for n in tmp):
        trial.kind = "while replacing `latest`"
    elif latest_step != steps[-1]:
        trial.kind = "between a commit and moving `latest`"
    elif any(".tmp-del-" in n for n in tmp):
        trial.kind = "while pruning"
    elif len(steps) > child.KEEP:
        trial.kind = "after `latest` moved, before pruning"
    elif tmp:
        trial.kind = "while writing a checkpoint"
    else:
        trial.kind = "between flushes"

    # contents: bit for bit what the uninterrupted run had at each committed step
    if steps:
        replay = child.replay(trial.seed, steps)
        old = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            model, _ = child.build(trial.seed)  # the child's torch RNG state: seeded, then init, never again
            rng = torch.get_rng_state()
        finally:
            torch.set_num_threads(old)
        del model
        for s in replay:
            replay[s]["torch_rng"] = rng
        # a Checkpointer adopts the newest committed step even where `latest` did not move yet
        p += _load_and_compare(trial, None, steps[-1], replay)
        for s in steps[:-1]:
            p += _load_and_compare(trial, s, s, replay)
    else:
        try:
            with _GlobalRng(), ucl.Checkpointer(trial.root, *child.build(0), keep=child.KEEP) as ck:
                ck.load()
            p.append("load() succeeded although no checkpoint is committed")
        except ucl.StoreError as e:
            if e.code != "UCL404":
                p.append(f"load() with no checkpoint raised {e.code}, expected UCL404: {e}")

    # the loads above (Checkpointers that only read) changed nothing in the root
    if sorted(os.listdir(trial.root)) != names:
        p.append(f"loading changed the root: {names} -> {sorted(os.listdir(trial.root))}")
    # leftovers: the next writer (a Checkpointer's first save takes the root so) removes the temp
    # entries, keeps every committed step and points `latest` at the newest one
    lock = rootlock.acquire(trial.root, "test")
    try:
        root.take_over()
    finally:
        lock.release()
    removed = sorted(os.path.basename(x) for x in cleanup_stale(trial.root))
    if removed:
        p.append(f"temp entries left after the root was taken over: {removed} (there were {tmp})")
    if root.steps() != steps:
        p.append(f"opening the root changed the committed steps: {steps} -> {root.steps()}")
    if steps and root.latest_step() != steps[-1]:
        p.append(f"`latest` is {root.latest_name()} after the root was taken over, expected step {steps[-1]}")
    return trial


@pytest.fixture(scope="module")
def forkserver():
    """A multiprocessing context whose forkserver (started from sys.executable) has torch, torch._dynamo
    (the first optimizer imports it: seconds) and ucl imported: each trial process is a fork of it and
    starts in milliseconds instead of seconds. The server is stopped afterwards if we started it."""
    ctx = multiprocessing.get_context("forkserver")
    server = getattr(multiprocessing.forkserver, "_forkserver", None)
    ours = server is not None and getattr(server, "_forkserver_pid", 1) is None
    if ours:
        ctx.set_forkserver_preload(["torch", "torch._dynamo", "torch.optim", "numpy", "h5py", "ucl",
                                    "ucl.train.checkpointer", "ucl.ops.prepare", "train_crash_child"])
    try:
        yield ctx
    finally:
        if ours and hasattr(server, "_stop"):
            server._stop()
            server.set_forkserver_preload(["__main__"])  # the default


def _report(done: list[Trial]) -> list[str]:
    return [f"{t}:\n  " + (t.error or "\n  ".join(t.problems)) for t in done if t.error or t.problems]


@pytest.mark.slow  # many kills at random points; the publication points below stay in the default pass
def test_sigkill_at_random_points_leaves_latest_loadable(tmp_path, forkserver):
    trials = _plan()
    t0 = time.perf_counter()
    with ThreadPoolExecutor(PARALLEL) as pool:  # checks run here while the next children run
        done = [_check(t) if not t.error else t
                for t in pool.map(lambda t: _run_child(forkserver, t, tmp_path), trials)]
    failures = _report(done)
    kinds = collections.Counter(t.kind for t in done if not t.error)
    print(f"\n{len(done)} SIGKILL trials in {time.perf_counter() - t0:.1f} s; interrupted: "
          + ", ".join(f"{k}: {v}" for k, v in kinds.most_common()))
    assert not failures, f"{len(failures)} of {len(done)} trials failed:\n" + "\n".join(failures)
    assert sum(1 for t in done if t.kind != "before the first commit") >= TRIALS // 2, \
        f"too few trials killed after a commit to test anything: {dict(kinds)}"


K = child.KILL_STEP
PUBLICATION_POINTS = {  # where -> (committed steps, latest step, temp entry prefix, kind)
    "set_latest": (list(range(K - 3, K + 1)), K - 1, None, "between a commit and moving `latest`"),
    "replace_latest": (list(range(K - 3, K + 1)), K - 1, ".latest.tmp-", "while replacing `latest`"),
    "prune": ([1, 2, 3], 3, ".step_00000000.tmp-del-", "while pruning"),
}


@pytest.mark.parametrize("where", sorted(PUBLICATION_POINTS))
def test_sigkill_at_publication_point_leaves_latest_loadable(tmp_path, forkserver, where):
    steps, latest, temp, kind = PUBLICATION_POINTS[where]
    trial = _run_child(forkserver, Trial(0, 4321, 0, 0.0, where=where), tmp_path)
    assert not trial.error, f"{trial}: {trial.error}"
    root = CheckpointRoot(trial.root)
    names = sorted(os.listdir(trial.root))
    assert (root.steps(), root.latest_step()) == (steps, latest), f"{trial}: left {names}"
    tmp = [n for n in names if is_tmp_name(n)]
    assert [n for n in tmp if n.startswith(temp)] if temp else not tmp, f"{trial}: temp entries {tmp}"
    _check(trial)
    assert not trial.problems, "\n".join(_report([trial]))
    assert trial.kind == kind, f"{trial}: classified {trial.kind!r}"


def test_resume_after_kill_between_commit_and_latest(tmp_path, forkserver):
    """Resume as docs/training.md does (load the latest, train, save step + 1) after the child died
    between committing step K and pointing `latest` at it: training must go on."""
    seed = 4321
    trial = _run_child(forkserver, Trial(0, seed, 0, 0.0, where="set_latest"), tmp_path)
    assert not trial.error, f"{trial}: {trial.error}"
    root = CheckpointRoot(trial.root)
    assert (root.steps()[-1], root.latest_step()) == (K, K - 1)
    cleanup_stale(trial.root)
    model, optimizer = child.build(seed + 1)
    with _GlobalRng(), ucl.Checkpointer(trial.root, model, optimizer, keep=child.KEEP) as ck:
        start, extra = ck.load()
        assert (start, extra) == (K, {"i": K})  # the complete commit `latest` did not name yet
        for i in range(start, start + 3):
            child.train_step(model, optimizer, seed, i)
            ck.save(i + 1, extra={"i": i + 1})
    assert root.latest_step() == start + 3
    with _GlobalRng():
        got = CheckpointRoot(trial.root).latest()
        model2, optimizer2 = child.build(seed + 2)
        with ucl.Checkpointer(trial.root, model2, optimizer2) as ck:
            assert ck.load() == (start + 3, {"i": start + 3}), got
    want = child.replay(seed, [start + 3])[start + 3]["params"]
    assert not _diff_tensors("resumed parameter", dict(model2.state_dict()), want)
    # rewinding: load an older step and save the next one again; it replaces the old checkpoint of that
    # step and the abandoned newer ones are discarded once the new one is durable
    model3, optimizer3 = child.build(seed + 3)
    with _GlobalRng(), ucl.Checkpointer(trial.root, model3, optimizer3, keep=child.KEEP) as ck:
        assert ck.load(start + 1) == (start + 1, {"i": start + 1})
        child.train_step(model3, optimizer3, seed, start + 1)
        ck.save(start + 2, extra={"i": start + 2, "again": True})
    root = CheckpointRoot(trial.root)
    assert root.latest_step() == start + 2 and root.steps()[-1] == start + 2
    assert ucl.open(root.latest()).manifest.state["extra"] == {"i": start + 2, "again": True}
    assert not [n for n in os.listdir(trial.root) if is_tmp_name(n)]


def test_sigkill_during_promotion_leaves_only_whole_checkpoints_in_the_tier(tmp_path, forkserver):
    """The child dies while its promoter copies step K into a directory tier (one file copied): the tier
    shows only whole checkpoints (K-3..K-1, each verifying), `latest` names K-1, K's half copy is a
    hidden temp folder; tier 1 already holds K (promotion comes after durability), perhaps K+1 too
    (the flusher goes on while the promoter copies). The next Checkpointer removes the dead temp
    folders of both tiers, keeps every committed step and promotes tier 1's newest, which the tier
    lacks."""
    trial = _run_child(forkserver, Trial(0, 4321, 0, 0.0, where="promote"), tmp_path)
    assert not trial.error, f"{trial}: {trial.error}"
    tier_dir = trial.root + child.TIER_SUFFIX
    tier = CheckpointRoot(tier_dir)
    names = sorted(os.listdir(tier_dir))
    whole = list(range(K - child.KEEP, K))
    assert (tier.steps(), tier.latest_step()) == (whole, K - 1), f"{trial}: tier left {names}"
    assert [n for n in names if STEP_DIR.match(n)] == [CheckpointRoot.dir_name(s) for s in whole], names
    assert [n for n in names if is_tmp_name(n)] and all(n.startswith(f".step_{K:08d}.tmp-")
                                                        for n in names if is_tmp_name(n)), names
    for s in whole:
        with ucl.open(tier.path_for(s)) as ck:
            assert ck.verify() == [] and ck.manifest.state["extra"] == {"i": s}
    root = CheckpointRoot(trial.root)
    # K, or K+1 where the flusher committed it while the promoter copied K; the kill can land between
    # that commit and moving `latest`, so `latest` may still name K: the Checkpointer adopts the newest.
    newest = root.steps()[-1]
    assert K in root.steps() and newest >= K and root.latest_step() in (K, newest)
    with _GlobalRng(), ucl.Checkpointer(trial.root, *child.build(0), keep=child.KEEP, tiers=[tier_dir]) as ck:
        assert ck.load()[0] == newest
        ck.save(newest + 1)  # the first save takes the root: it cleans up and catches the tier up
    assert not [n for n in os.listdir(tier_dir) if is_tmp_name(n)]
    assert not [n for n in os.listdir(trial.root) if is_tmp_name(n)]
    assert tier.steps() == (whole + [newest, newest + 1])[-child.KEEP:] and tier.latest_step() == newest + 1
