"""Offline reshard: write a checkpoint in another layout, streaming one target dataset at a time
through worker processes, committed atomically."""
from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import queue
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..dtypes import storage_dtype
from ..errors import UclError
from ..layout.mesh import Mesh, as_mesh
from ..plan.buffers import Arena
from ..plan.execute import run_copies
from ..plan.ir import Plan
from ..store.source import StoreSource
from ..store.writer import CheckpointWriter
from .prepare import check_stored, manifest_fields, mesh_of, model_of, open_checkpoint, plan_for
from .stats import IOStats


@dataclass(frozen=True)
class ReplicaGroup:
    """A target dataset with identical contents on ``ranks`` (replicas): built once, written to each."""

    key: str
    shape: tuple[int, ...]
    dtype: str
    ranks: tuple[int, ...]
    rows: np.ndarray  # copy rows that fill it (those of its first rank)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * storage_dtype(self.dtype).itemsize


@dataclass(frozen=True)
class GroupTask:
    group: int  # index into the job's groups
    ranks: tuple[int, ...]  # the replicas this worker writes


@dataclass(frozen=True)
class WorkerTask:
    groups: tuple[GroupTask, ...]
    files: tuple[int, ...]  # target ranks whose files this worker creates (and finishes)


@dataclass(frozen=True)
class ReshardJob:
    """Everything a worker needs; inherited by forked workers, never serialised."""

    src: str
    tmp: str
    nranks: int
    plan: Plan
    groups: tuple[ReplicaGroup, ...]
    durable: bool
    verify: bool
    progress: object | None  # a multiprocessing queue of byte counts, or None


@dataclass(frozen=True)
class WorkerResult:
    entries: dict  # rank -> manifest entries of its file
    stats: IOStats


_JOB: ReshardJob | None = None  # set for the duration of one reshard, inherited by forked workers


def reshard(src: str | os.PathLike, dst: str | os.PathLike, to: Mesh | str, *, workers: int | None = None,
            durable: bool = True, verify: bool = True, progress: Callable[[int], None] | None = None) -> IOStats:
    """Write checkpoint ``dst`` holding ``src`` in layout ``to`` (a Mesh or a string; ``"universal"``
    = consolidated). The spec, dims and source layout come from ``src``'s manifest. Streams one
    target dataset at a time, builds replicated target datasets once, uses ``workers`` processes;
    ``dst`` appears atomically. ``durable=False`` skips fsync of the data files (atomic against
    crashes of the process, not of the machine). ``verify`` checks the checksum of every source
    dataset it reads from, including those it reads only in parts, so corruption is never copied
    into a freshly checksummed file. ``progress`` is called with byte counts as datasets are written."""
    global _JOB
    t0 = time.perf_counter()
    to = as_mesh(to)
    if workers is not None and (not isinstance(workers, int) or isinstance(workers, bool) or workers < 1):
        raise UclError(f"workers must be a positive integer, got {workers!r}", code="UCL009")
    with open_checkpoint(src) as ckpt:
        model = model_of(ckpt)
        plan = plan_for(model, mesh_of(ckpt), to)
        check_stored(ckpt, model)  # every source rank: a reshard reads them all
        state = ckpt.manifest.state
    t1 = time.perf_counter()
    workers = max(1, min(workers or min(2, os.cpu_count() or 1), to.size))
    groups = replica_groups(plan)
    tasks = assign(groups, plan, workers)
    stats = IOStats(compile_seconds=t1 - t0)
    writer = CheckpointWriter(dst, to.size, durable=durable, **manifest_fields(model, to, state))
    ctx = mp.get_context("fork")  # the plan is inherited, not serialised
    channel = ctx.Queue() if progress and workers > 1 else None
    try:
        _JOB = ReshardJob(os.fspath(src), writer.tmp_path, to.size, plan, tuple(groups), durable, verify, channel)
        if workers == 1:
            results = [_run_worker(tasks[0], progress)]
        else:
            with ctx.Pool(workers, initializer=_die_with_parent, initargs=(os.getpid(),)) as pool:
                pending = [pool.apply_async(_run_worker, (t,)) for t in tasks]
                while progress and not all(p.ready() for p in pending):
                    _drain(channel, progress, timeout=0.1)
                results = [p.get() for p in pending]
            if progress:
                _drain(channel, progress, timeout=0)
        for r in results:
            for rank, entries in r.entries.items():
                writer.adopt(int(rank), entries)
            stats.merge(r.stats)
        writer.commit()
    except BaseException:
        writer.abort()
        raise
    finally:
        _JOB = None
        if channel is not None:
            channel.close()
    stats.seconds = time.perf_counter() - t0
    return stats


_PR_SET_PDEATHSIG = 1
PARENT_POLL_S = 0.25  # how often a worker checks that the reshard that forked it is still there


def _die_with_parent(parent: int) -> None:
    """Pool initializer: a worker must not outlive the reshard that forked it. A parent killed with
    SIGKILL cannot stop its pool, and the workers would go on writing into a temp directory that no
    one will ever commit (and, holding its lock, that ``ucl gc`` must leave alone)."""
    if sys.platform.startswith("linux"):
        # the kernel sends SIGKILL when the forking thread exits: reshard() forks from the thread that
        # calls it and waits for the pool there, so that thread outlives the workers
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent:  # it died before the line above took effect
        os.kill(os.getpid(), signal.SIGKILL)
    # everywhere (and where prctl is missing): re-parenting shows the parent is gone
    threading.Thread(target=_watch_parent, args=(parent,), name="ucl-parent-watch", daemon=True).start()


def _watch_parent(parent: int) -> None:
    while True:
        time.sleep(PARENT_POLL_S)
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGKILL)


def _drain(channel, progress: Callable[[int], None], timeout: float) -> None:
    try:
        progress(channel.get(timeout=timeout) if timeout else channel.get_nowait())
        while True:
            progress(channel.get_nowait())
    except queue.Empty:
        pass


def replica_groups(plan: Plan) -> list[ReplicaGroup]:
    """Target datasets with identical contents on several ranks (replicas) become one group."""
    c = plan.copies
    slot_keys = np.array([s.key for s in plan.slots], dtype=object)
    row_keys = slot_keys[c["dst_slot"]] if len(c["dst_slot"]) else np.zeros(0, dtype=object)
    rows_by = {}
    order = np.argsort(c["dst_rank"], kind="stable")
    bounds = np.searchsorted(c["dst_rank"][order], np.arange(plan.dst_mesh.size + 1))
    for r in range(plan.dst_mesh.size):
        rows = order[bounds[r]:bounds[r + 1]]
        for key in np.unique(row_keys[rows]) if len(rows) else []:
            rows_by[(r, key)] = rows[row_keys[rows] == key]
    found: dict[tuple, tuple] = {}  # content signature -> (dataset, ranks, rows)
    for r, d in zip(plan.dataset_ranks["rank"], plan.dataset_ranks["dataset"]):
        ds = plan.datasets[d]
        rows = rows_by.get((int(r), ds["key"]), np.zeros(0, dtype=np.int64))
        sig_cols = np.stack([c[k][rows] for k in ("tensor", "src_rank", "src_slot", "dst_slot")], axis=1)
        sig = (ds["key"], ds["shape"], ds["dtype"], sig_cols.tobytes(), c["src_start"][rows].tobytes(),
               c["dst_start"][rows].tobytes(), c["size"][rows].tobytes())
        if sig in found:
            found[sig][1].append(int(r))
        else:
            found[sig] = (ds, [int(r)], rows)
    return [ReplicaGroup(ds["key"], tuple(ds["shape"]), ds["dtype"], tuple(ranks), rows)
            for ds, ranks, rows in found.values()]


def assign(groups: list[ReplicaGroup], plan: Plan, workers: int) -> list[WorkerTask]:
    """Give each target rank file to one worker (files cannot be shared), keeping replica groups
    together where the load allows, so their source bytes are read once."""
    owner: dict[int, int] = {}
    load = [0] * workers
    total = sum(g.nbytes * len(g.ranks) for g in groups) or 1
    for gi in sorted(range(len(groups)), key=lambda i: -groups[i].nbytes * len(groups[i].ranks)):
        g = groups[gi]
        for r in g.ranks:
            if r in owner:
                continue
            taken = [owner[x] for x in g.ranks if x in owner]
            w = taken[0] if taken and load[taken[0]] < 1.1 * total / workers else min(range(workers), key=load.__getitem__)
            owner[r] = w
        for r in g.ranks:
            load[owner[r]] += g.nbytes
    for r in range(plan.dst_mesh.size):
        owner.setdefault(r, min(range(workers), key=load.__getitem__))
    tasks = []
    for w in range(workers):
        mine = [GroupTask(gi, tuple(r for r in g.ranks if owner[r] == w)) for gi, g in enumerate(groups)]
        tasks.append(WorkerTask(tuple(t for t in mine if t.ranks), tuple(r for r in sorted(owner) if owner[r] == w)))
    return tasks


def _run_worker(task: WorkerTask, progress: Callable[[int], None] | None = None) -> WorkerResult:
    job = _JOB
    report = progress or (job.progress.put if job.progress is not None else None)
    writer = CheckpointWriter.join(job.tmp, job.nranks, durable=job.durable)
    stats = IOStats()
    c = job.plan.copies

    def first_source(t: GroupTask) -> tuple[int, int]:
        rows = job.groups[t.group].rows
        return (int(c["src_rank"][rows[0]]), int(c["src_slot"][rows[0]])) if len(rows) else (-1, -1)

    with open_checkpoint(job.src) as ckpt:
        source = StoreSource(ckpt, Arena(), verify=job.verify)
        target = Arena()
        for t in sorted(task.groups, key=first_source):  # reads sweep each source file in order
            g = job.groups[t.group]
            covered = int(np.prod(c["size"][g.rows], axis=1).sum()) if len(g.rows) else 0
            buf = target.array(g.shape, storage_dtype(g.dtype), zero=covered < int(np.prod(g.shape, dtype=np.int64)))
            stats.bytes_needed += run_copies(job.plan, g.rows, source, {g.key: buf})
            for r in t.ranks:
                writer.write(r, g.key, buf, dtype=g.dtype)
                stats.bytes_written += buf.nbytes
                stats.datasets_written += 1
                if report:
                    report(buf.nbytes)
        entries = writer.finish(list(task.files))
        stats.bytes_read = source.bytes_read
    return WorkerResult(entries, stats)
