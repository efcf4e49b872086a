"""Offline reshard: write a checkpoint in another layout, streaming one target dataset at a time
through worker processes, committed atomically; with ``distributed=True`` every process of a
torch.distributed job writes its share of the target files (docs/distributed.md)."""
from __future__ import annotations

import gc
import json
import os
import threading
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np
import xxhash

from ..dtypes import storage_dtype
from ..errors import StoreError, UclError
from ..layout.mesh import Mesh, as_mesh
from ..memory import MemoryCap, memory_cap
from ..plan.buffers import Arena
from ..plan.execute import run_copies
from ..plan.ir import Plan
from ..store.codec import check_codec
from ..store.reader import Checkpoint
from ..store.source import StoreSource
from ..store.ledger import Filled
from ..store.writer import CheckpointWriter
from .collective import commit_collectively
from .dist import allgather_json, gloo_group, initialized_dist
from .prepare import check_stored, manifest_fields, mesh_of, model_of, open_checkpoint, plan_for, resolve_root
from .stats import IOStats
from . import streamed
from .budget import Budget, budgeted
from .machine import check_workers, usable_cores
from .bounded import BoundedSource
from .shares import GroupTask, ReplicaGroup, WorkerTask, assign, datasets_on, replica_groups, split_files
from .workers import run_forked

if TYPE_CHECKING:  # annotations only: a reshard of a ucl checkpoint imports no format code
    from ..formats.base import UserSpec


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
    format: str | None = None  # the source's format (None: detected)
    user: UserSpec | None = None  # the placements a foreign source's files do not record
    laid: dict | None = None  # rank -> {key: byte offset} of the files several workers fill (lay_out)
    compress: str | None = None  # the target's encoding (store.codec); None: plain
    budget: Budget | None = None  # what each worker's buffers may hold (ops.budget; None: set by _write_files)
    behind: bool = True  # the writes in a thread of their own (store.behind); not on one core through the page cache


@dataclass(frozen=True)
class WorkerResult:
    entries: dict  # rank -> manifest entries of its file
    stats: IOStats
    filled: tuple[Filled, ...] = ()  # datasets written into laid-out files


@dataclass(frozen=True)
class Prepared:
    """What every process of a reshard derives from the source manifest alone (pure, cached)."""

    model: object
    plan: Plan
    state: object
    compile_seconds: float
    source_id: str = ""  # a digest of the source manifest (distributed: every process opened the same)
    open_seconds: float = 0.0  # opening (describing) the source, apart from the plan


_JOB: ReshardJob | None = None  # set for the duration of one reshard, inherited by forked workers
DIST_TIMEOUT_S = 300.0  # how long a distributed reshard waits for a process that stopped answering
HEARTBEAT_S = 1.0  # how often the processes of a distributed reshard tell each other they are alive


def reshard(src: str | os.PathLike, dst: str | os.PathLike, to: Mesh | str, *, workers: int | None = None,
            durable: bool = True, verify: bool = True, progress: Callable[[int], None] | None = None,
            distributed: bool = False, timeout: float = DIST_TIMEOUT_S, format: str | None = None,
            user: UserSpec | None = None, compress: str | None = None,
            max_memory: int | str | MemoryCap | None = None) -> IOStats:
    """Write checkpoint ``dst`` holding ``src`` in layout ``to`` (a Mesh or a string; ``"universal"``
    = consolidated). The spec, dims and source layout come from ``src``'s manifest. Streams one
    target dataset at a time, builds replicated target datasets once, uses ``workers`` processes;
    ``dst`` appears atomically. ``durable=False`` skips fsync of the data files (atomic against
    crashes of the process, not of the machine). ``verify`` checks the checksum of every source
    dataset it reads from, including those it reads only in parts, so corruption is never copied
    into a freshly checksummed file. ``progress`` is called with byte counts as datasets are written.
    ``src`` may be a folder another framework wrote (``format`` detected when None; docs/interop.md):
    it is read in place, and ``to`` its own layout makes this an import; ``user``: the parameter
    placements its files do not record (``ops.convert.user_spec``; the workers get it in their job).
    ``compress`` (``"zstd"``, ``"lz4"``; None or ``"none"``: plain) is the target's encoding, whatever
    the source's (docs/format.md); each target dataset is then assembled whole and coded by its worker.
    ``max_memory`` (bytes, ``"2GB"``, ``"64MB"`` or a ``MemoryCap``; None: the default, 2 GB) caps the
    memory the reshard adds, summed over this process and its workers (docs/memory.md): fewer workers
    where a share would be small, datasets larger than a share streamed in blocks; UCL011 up front
    where a dataset must be assembled whole (``compress``) and does not fit.

    ``distributed=True``: called by every process of an initialised torch.distributed job with the
    same arguments; each writes its share of the target files (``workers`` forked processes each,
    default 1) into one temp directory on a file system they all see, and rank 0 commits once all
    are durable. A failure anywhere publishes nothing and raises on every process; a process that
    stops answering is given up on after ``timeout`` seconds. Returns the job's totals on every
    process; ``progress`` sees this process's bytes, from a helper thread."""
    t0 = time.perf_counter()
    to = as_mesh(to)
    compress = check_codec(compress)
    cap = memory_cap(max_memory)
    if format in (None, "ucl"):
        src = resolve_root(src)  # once: the workers reopen src by path, and a root's latest may move
    if workers is not None and (not isinstance(workers, (int, np.integer)) or isinstance(workers, bool)
                                or workers < 1):
        raise UclError(f"workers must be a positive integer, got {workers!r}", code="UCL009")
    workers = None if workers is None else int(workers)
    check_workers(workers)
    if distributed:
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise UclError(f"timeout must be a positive number of seconds, got {timeout!r}", code="UCL009")
        return _reshard_distributed(os.fspath(src), os.fspath(dst), to, workers or 1, durable, verify, progress,
                                    float(timeout), t0, format, user, compress, cap)
    prep = _prepare(src, to, format, user=user)
    workers = max(1, workers or min(2, usable_cores()))  # taskset -c 0: one worker, not two on one core
    groups = replica_groups(prep.plan, prep.model)
    stats = IOStats(compile_seconds=prep.compile_seconds, open_seconds=prep.open_seconds)
    writer = CheckpointWriter(dst, to.size, durable=durable, **manifest_fields(prep.model, to, prep.state))
    try:
        job = ReshardJob(os.fspath(src), writer.tmp_path, to.size, prep.plan, tuple(groups), durable, verify,
                         format, user, compress=compress)
        for rank, entries in _write_files(job, range(to.size), workers, progress, stats, cap=cap).items():
            writer.adopt(int(rank), entries)
        writer.commit()
    except BaseException:
        writer.abort()
        raise
    stats.seconds = time.perf_counter() - t0
    return stats


def _prepare(src: str | os.PathLike, to: Mesh, format: str | None = None, identify: bool = False,
             user: UserSpec | None = None) -> Prepared:
    t0 = time.perf_counter()
    with open_checkpoint(src, format, user) as ckpt:
        t1 = time.perf_counter()
        model = model_of(ckpt)
        plan = plan_for(model, mesh_of(ckpt), to)
        check_stored(ckpt, model)  # every source rank: a reshard reads them all
        m = ckpt.manifest
        source_id = xxhash.xxh3_64_hexdigest(json.dumps(  # datasets carry their checksums: the content
            [m.created, m.mesh, m.files, m.datasets, m.spec, m.dims, m.params, m.state], sort_keys=True,
            default=str).encode()) if identify else ""
    return Prepared(model, plan, m.state, time.perf_counter() - t1, source_id, t1 - t0)


def _write_files(job: ReshardJob, files: Sequence[int], workers: int, progress: Callable[[int], None] | None,
                 stats: IOStats, cancel: threading.Event | None = None, cap: MemoryCap | None = None) -> dict:
    """Write target rank ``files`` (``job.groups`` name no others) with ``workers`` processes and
    return their manifest entries (``{rank: entries}``, for the owner's ``adopt``). A file larger than
    one worker's share (a universal target) is laid out first and filled by several workers at once.
    One worker runs in this process, unless ``cancel`` is given (a distributed reshard: a forked pool
    can be stopped when another process fails). ``cap`` (default: the default cap) is shared out
    among the workers (``budgeted``)."""
    workers, budget = budgeted(job.groups, job.plan, memory_cap(cap), workers, compress=bool(job.compress),
                               durable=job.durable, forked=cancel is not None)
    # on one core a write through the page cache is a copy on that core either way: a thread for it
    # only adds switches (5% of a 2 GB reshard's CPU); a durable write waits for the device, and that
    # wait the thread overlaps with reading
    job = replace(job, budget=budget, behind=job.durable or usable_cores() > 1)
    shared = split_files(job.groups, workers) if not job.compress else frozenset()  # coded sizes are not known
    layer = CheckpointWriter.join(job.tmp, job.nranks, durable=job.durable) if shared else None
    try:
        if layer is not None:
            job = replace(job, laid={r: layer.lay_out(r, datasets_on(job.groups, r)) for r in sorted(shared)})
        tasks = assign(list(job.groups), job.plan, workers, files=files, shared=shared)
        tasks = [t for t in tasks if t.groups or t.files] or tasks[:1]
        entries: dict = {}
        filled: list[Filled] = []
        for r in _execute(job, tasks, progress, in_process=len(tasks) == 1 and cancel is None,
                          cancel=cancel):
            entries.update(r.entries)
            filled += r.filled
            stats.merge(r.stats)
        if layer is not None:
            layer.adopt_filled(filled)
            entries.update(layer.finish(sorted(shared)))
        return entries
    except BaseException:
        if layer is not None:
            layer.abort()
        raise


def _execute(job: ReshardJob, tasks: Sequence[WorkerTask], progress: Callable[[int], None] | None, *,
             in_process: bool, cancel: threading.Event | None = None) -> list[WorkerResult]:
    """Run ``tasks`` in this process (one task) or in forked workers, one per task (ops.workers); the
    first worker error is raised as soon as it happens, and ``cancel`` stops the workers."""
    global _JOB
    froze = False
    try:
        _JOB = job
        if in_process:
            return [_run_worker(t, progress) for t in tasks]
        if gc.get_freeze_count() == 0:  # (a heap the caller froze is left as it is)
            gc.freeze()  # what the workers inherit (the plan) is never swept for cycles there: no copy-on-write
            froze = True
        return run_forked(_run_worker, tasks, progress, cancel, name="reshard worker")
    finally:
        if froze:
            gc.unfreeze()
        _JOB = None


def _reshard_distributed(src: str, dst: str, to: Mesh, workers: int, durable: bool, verify: bool,
                         progress: Callable[[int], None] | None, timeout: float, t0: float,
                         format: str | None, user: UserSpec | None = None, compress: str | None = None,
                         cap: MemoryCap | None = None) -> IOStats:
    """Every process compiles the plan itself (pure, cached: cheaper than shipping its tables),
    partitions the target files with ``assign`` and writes its share with its own forked workers;
    the commit is ``commit_collectively`` with a heartbeat, so the group's ``timeout`` bounds the
    wait for a dead or hung process, not for the slowest writer."""
    dist = initialized_dist()
    if dist is None:
        raise StoreError("reshard(distributed=True) needs torch.distributed to be initialised: call it from every "
                         "process of the job (e.g. under torchrun)", code="UCL422")
    try:
        group = gloo_group(timeout)
    except RuntimeError as e:
        raise StoreError(f"reshard to {dst} not started: a process of the job did not join within {timeout:g} s: "
                         f"{e}", code="UCL424") from None
    me, world = dist.get_rank(), dist.get_world_size()
    own: list[BaseException] = []  # this process's own error, raised in place of the job's summary
    cancel = threading.Event()
    stats = IOStats()
    try:
        prep = None
        try:
            prep = _prepare(src, to, format, identify=True, user=user)
        except Exception as e:  # every process learns it below: none is left waiting in a collective
            own.append(e)
        job = _job_identity(src, dst, to, format, prep)
        problems, jobs = _gathered(own[0] if own else None, group, job)
        if problems:
            raise own[0] if own else StoreError("reshard not done: " + "; ".join(problems), code="UCL410")
        _check_same_job(jobs)
        stats.compile_seconds = prep.compile_seconds
        groups = replica_groups(prep.plan, prep.model)
        mine = assign(groups, prep.plan, world)[me]

        def write(writer: CheckpointWriter) -> dict:
            try:
                if not mine.files:  # e.g. a one-file target on every process but one
                    return {}
                sub = [replace(groups[t.group], ranks=t.ranks) for t in mine.groups]
                job = ReshardJob(src, writer.tmp_path, to.size, prep.plan, tuple(sub), durable, verify, format, user,
                                 compress=compress)
                return _write_files(job, mine.files, workers, progress, stats, cancel, cap)
            except Exception as e:
                if not cancel.is_set():
                    own.append(e)
                raise

        fields = manifest_fields(prep.model, to, prep.state)
        try:
            commit_collectively(dst, to.size, fields, write, group=group, heartbeat=min(HEARTBEAT_S, timeout / 10),
                                cancel=cancel, durable=durable)
        except StoreError:
            if own and isinstance(own[0], UclError):
                raise own[0] from None
            raise
        stats.seconds = time.perf_counter() - t0
        try:
            every = allgather_json([stats.bytes_read, stats.bytes_needed, stats.bytes_written, stats.datasets_written,
                                    stats.seconds, stats.compile_seconds], group=group)
        except RuntimeError:  # committed already: report this process's own numbers
            return stats
        total = IOStats(*(sum(x[i] for x in every) for i in range(4)))
        total.seconds, total.compile_seconds = max(x[4] for x in every), max(x[5] for x in every)
        return total
    finally:
        cancel.set()  # a write thread still running (a collective failed under it) stops its workers
        _destroy(dist, group)


def _job_identity(src: str, dst: str, to: Mesh, format: str | None, prep: Prepared | None) -> dict:
    """What every process of a distributed reshard must agree on: the paths (as this process
    resolves them), the target layout and which source checkpoint it opened (its manifest)."""
    ident = {"src": os.path.realpath(src), "dst": os.path.abspath(dst), "to": str(to), "format": format}
    if prep is not None:
        ident["source"] = prep.source_id
    return ident


def _gathered(error: BaseException | None, group, job: dict) -> tuple[list[str], list[dict]]:
    """Every process's error before writing started (``rank N: message``; [] if none failed) and
    its ``_job_identity``."""
    try:
        got = allgather_json(["" if error is None else str(error) or type(error).__name__, job], group=group)
    except RuntimeError as e:
        raise StoreError(f"reshard not done: a process of the job stopped answering: {e}", code="UCL424") from None
    return [f"rank {r}: {m}" for r, (m, _) in enumerate(got) if m], [j for _, j in got]


def _check_same_job(jobs: list[dict]) -> None:
    """UCL425 on every process when they were not given the same job (another SRC, DST or target,
    or a source folder that differs between nodes): each would write its share of another checkpoint."""
    what = {"src": "SRC", "dst": "DST", "to": "--to", "format": "--from", "source": "the source's manifest"}
    differ = [k for k in what if len({json.dumps(j.get(k)) for j in jobs}) > 1]
    if differ:
        shown = "; ".join(f"{what[k]}: " + ", ".join(f"rank {r}: {j.get(k)}" for r, j in enumerate(jobs[:8]))
                          + (" ..." if len(jobs) > 8 else "") for k in differ)
        raise StoreError(f"reshard not started: the processes were given different jobs ({shown}); every process "
                         "must get the same SRC, DST and --to, as absolute paths on a file system they all see "
                         "(the same source on every node)", code="UCL425")


def _destroy(dist, group) -> None:
    try:
        dist.destroy_process_group(group)
    except Exception:  # a group broken by a dead process: nothing left to release
        pass


def _run_worker(task: WorkerTask, progress: Callable[[int], None] | None = None) -> WorkerResult:
    job = _JOB
    writer = CheckpointWriter.join(job.tmp, job.nranks, durable=job.durable, write_behind=True, compress=job.compress,
                                   behind_thread=job.behind)
    stats = IOStats()
    c = job.plan.copies

    def first_source(t: GroupTask) -> tuple[int, int]:
        rows = job.groups[t.group].rows
        return (int(c["src_rank"][rows[0]]), int(c["src_slot"][rows[0]])) if len(rows) else (-1, -1)

    laid = job.laid or {}
    budget = job.budget
    with open_checkpoint(job.src, job.format, job.user) as ckpt:
        if isinstance(ckpt, Checkpoint):
            ckpt.limit_caches(budget.cache)
        store = StoreSource(ckpt, Arena(), verify=job.verify)
        source = BoundedSource(store, budget.piece)  # a box larger than a piece passes in pieces
        blocks = streamed.block_ring()
        targets = (Arena(), Arena())  # one is filled while the other is still being written (write_behind)
        for i, t in enumerate(sorted(task.groups, key=first_source)):  # reads sweep each source file in order
            g = job.groups[t.group]
            done = None if job.compress else streamed.stream_dataset(job.plan, g.rows, g.key, g.shape, g.dtype,
                                           {r: laid[r][g.key] if r in laid else None for r in t.ranks}, ckpt, writer,
                                           blocks, verify=job.verify, durable=job.durable, block_bytes=budget.block,
                                           force=g.nbytes > budget.whole, tiles=g.tiles)
            if done is not None:
                stats.bytes_read += done.bytes_read
                stats.bytes_needed += done.bytes_needed
            else:
                covered = int(np.prod(c["size"][g.rows], axis=1).sum()) if len(g.rows) else 0
                buf = targets[i % 2].array(g.shape, storage_dtype(g.dtype))
                if covered < int(np.prod(g.shape, dtype=np.int64)):
                    streamed.zero_gaps(job.plan, g.rows, buf)
                stats.bytes_needed += run_copies(job.plan, g.rows, source, {g.key: buf})
                # a dataset copied whole and verified keeps the source's checksums (not hashed again)
                known = streamed.whole_copy(job.plan, g.rows, g.shape, g.dtype, ckpt) if job.verify else None
                for r in t.ranks:
                    if r in laid:
                        writer.fill(r, g.key, laid[r][g.key], buf, dtype=g.dtype, digests=known, tiles=g.tiles)
                    else:
                        writer.write(r, g.key, buf, dtype=g.dtype, digests=known, tiles=g.tiles)
            for _ in t.ranks:
                stats.bytes_written += g.nbytes
                stats.datasets_written += 1
                if progress:
                    progress(g.nbytes)
        entries = writer.finish(list(task.files))
        stats.bytes_read += store.bytes_read
    return WorkerResult(entries, stats, tuple(writer.filled))
