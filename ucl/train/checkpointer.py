"""``ucl.Checkpointer``: lazy, asynchronous, multi-level checkpoints of a live PyTorch training run.

``save(step)`` records what to copy and returns. Background stages, one thread each, then take the
snapshot on: ``copier`` copies parameters and optimizer state into a preallocated host pool while
the next forward and backward run (neither changes them; an optimizer step pre-hook fences, waiting
only if that copy is unfinished; buffers, which forward may update, are copied inside ``save``);
``flusher`` writes the rank's HDF5 file (the ordinary ucl store format), commits, moves ``latest``
and prunes; ``promoter`` copies durable checkpoints to further tiers. Collectives of a
multi-process save use their own gloo group. Errors in the background surface on the next
``save``/``wait``/``close``.
"""
from __future__ import annotations

import atexit
import os
import threading
import time
import warnings
import weakref
from typing import Any

from ..dtypes import to_numpy
from ..errors import StoreError, UclError, code_agrees
from ..ops.dist import allgather_json, initialized_dist
from ..ops.stats import IOStats
from ..store.checksum import checksum_of
from ..store.codec import check_codec
from ..store.manifest import plain_json
from ..store.reader import Checkpoint
from ..store.root import CheckpointRoot
from ..store.rootlock import RootLock, acquire
from . import restore, rng
from .copier import Copier
from .derive import TrainLayout
from .flusher import Flusher
from .local import LocalTier, agree_nodes, node_id
from .lineage import new_run, of_state
from .recover import LoadReport, Recovery
from .replicas import placement
from .layouts import Layouts
from .optim import hyperparameters
from .pool import MIN_POOL_BYTES, HostPool, default_pool_bytes, host_room, layout_bytes
from .progress import Progress
from .promoter import Promoter
from .ring import PieceStream
from .snapshot import Snapshot, Snapshots
from .tiers import latest_of, open_tier
from .trace import Trace


# Checkpointers not closed yet, with the thread that made each: closed at interpreter exit, before
# Python stops their daemon threads and tears down their process group under them (a gloo group
# destroyed mid-collective aborts the process), so that a save still in flight is finished rather
# than dropped. First pass: threading's exit hook (the one concurrent.futures uses; it runs before
# executors refuse work, and before Python joins the non-daemon threads), for Checkpointers whose
# maker is the main thread or has ended: one made by a thread still running is that thread's to
# use and close. Second pass, atexit (after those threads are joined): whatever is left, best effort.
# A forked child (DataLoader, Pool workers) holds copies without their threads: it forgets them.
_OPEN: "weakref.WeakKeyDictionary[Checkpointer, threading.Thread]" = weakref.WeakKeyDictionary()


def _close_open(only_orphans: bool) -> None:
    main = threading.main_thread()
    for ck, maker in list(_OPEN.items()):
        if only_orphans and maker is not main and maker.is_alive():
            continue
        try:
            ck.close()
        except Exception as e:  # noqa: BLE001 - at exit nobody can catch it: say it, let the others close
            warnings.warn(f"closing a Checkpointer of {ck.root.root} at exit failed: {e}", stacklevel=1)


try:
    getattr(threading, "_register_atexit", atexit.register)(lambda: _close_open(only_orphans=True))
except RuntimeError:  # first imported by a thread after shutdown began: the atexit pass still runs
    pass
atexit.register(_close_open, only_orphans=False)
os.register_at_fork(after_in_child=_OPEN.clear)


class Checkpointer:
    """Checkpoints ``model`` and ``optimizer`` into ``root`` (see docs/training.md).

    ``spec``/``mesh``: a manual layout (a ``ucl.layout.Model`` bound to the global dims and
    parameters, and the mesh the module's local tensors have); by default the layout is derived.
    ``keep``: committed checkpoints kept per directory tier. ``tiers``: further directories or
    fsspec URLs each checkpoint is copied to, in the background, after it is durable.
    ``persist_every``: every ``save`` snapshots to host memory; steps that are multiples of N, and any
    save after N - 1 unwritten ones, are written.
    ``pool_bytes``: host pool size (default: one snapshot with ``persist_every > 1``, or for a model on
    a GPU when the host has twice that available per process, else a quarter of one, at least 256
    MiB; any size down to 4 KiB works, a snapshot larger than what is free streams through it,
    train.ring). ``tile_checksums``: also hash each
    matrix by tiles, so a later load that takes column slices (another tensor-parallel degree)
    verifies only those columns; off, snapshots cost about a third less CPU and such loads read whole
    rows. ``debug``: detect state mutated between ``save`` and the next fence (checksums).
    ``compress`` (``"zstd"``, ``"lz4"``; default None: plain): each checkpoint stored compressed
    (docs/format.md), coded by the flusher in ``compress_threads`` threads, never in the training thread.
    ``local``: a folder only this node sees (docs/resilience.md): every snapshot is written there,
    one in ``persist_every`` also to ``root``; ``node``: this process's node (default: from torchrun's
    environment); ``replicas``: k copies of each rank file on other nodes. After ``load()``, ``last_load`` says
    where the bytes came from.
    """

    def __init__(self, root, model, optimizer=None, *, spec=None, mesh=None, keep: int = 3, tiers=None,
                 persist_every: int = 1, pool_bytes: int | None = None, tile_checksums: bool = True,
                 debug: bool = False, compress: str | None = None, compress_threads: int = 1, local=None,
                 replicas: int = 0, node: int | None = None):
        import torch
        compress = check_codec(compress)  # UCL418 before anything is started
        if not isinstance(persist_every, int) or persist_every < 1:
            raise UclError(f"persist_every must be a positive integer, got {persist_every!r}", code="UCL430")
        if pool_bytes is not None and (not isinstance(pool_bytes, int) or pool_bytes < MIN_POOL_BYTES):
            raise UclError(f"pool_bytes must be an integer of at least {MIN_POOL_BYTES:,} (one block), got "
                           f"{pool_bytes!r}", code="UCL430")
        if not isinstance(keep, int) or keep < 1:
            raise UclError(f"keep must be a positive integer, got {keep!r}", code="UCL430")
        if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 0:
            raise UclError(f"replicas must be a non-negative integer, got {replicas!r}", code="UCL430")
        if replicas and local is None:
            raise UclError(f"replicas={replicas} needs local= (the copies go to other nodes' local folders)",
                           code="UCL430")
        self.root = CheckpointRoot(root)
        self.tiers = [open_tier(t) for t in (tiers or [])]
        self.last_load: LoadReport | None = None
        self.model, self.optimizer = model, optimizer
        self.keep, self.persist_every, self.pool_bytes, self.debug = keep, persist_every, pool_bytes, debug
        # the CUDA device the parameters are on (None: a CPU model; the CUDA path is never entered)
        self._device = next((p.device for p in model.parameters() if p.is_cuda), None) \
            if torch.cuda.is_available() else None
        self._pin = self._device is not None
        self._dist = initialized_dist()
        self._layouts = Layouts(spec, mesh, world=self._dist.get_world_size() if self._dist else 1)
        self._group = self._dist.new_group(backend="gloo") if self._dist else None  # never the training group
        if self._dist:
            self._check_same_root()
        rank = self._process_rank()
        self._local = None
        if local is not None:
            nodes = agree_nodes(node_id(node), local, rank, self._world(), self._group)
            placement(list(nodes.of), replicas)  # UCL430 unless there are more than `replicas` nodes
            self._local = LocalTier(local, nodes, keep, self._group, replicas)
        # The root lock (store.rootlock) is taken by the first save(), by process rank 0 for the job:
        # until then this is a reader, which changes nothing in the root (an evaluation job may load
        # from a root a training job is writing).
        self._lock: RootLock | None = None
        self._holding = False
        self._closed = False
        self._last: Snapshot | None = None  # the snapshot the next fence waits for
        self._unwritten = 0  # saves since the last one written to disk (persist_every)
        # the run the saves belong to (train.lineage): made at the first save and at the first after a load
        self._lineage: list | None = None
        self._base: list | None = None  # the lineage of what load() restored (None: no load yet)
        self._resumed: int | None = None  # the step load() restored
        self._not_kept: tuple[int, int] | None = None  # (step, bytes) of the last unwritten save the pool could not hold
        # the newest step saved in root (load() sets it to the step it restored: a rollback)
        newest = [r.newest() for r in [self.root] + ([self._local.root] if self._local else []) if os.path.isdir(r.root)]
        steps = [self.root.step_of(os.path.basename(n)) for n in newest if n]
        self._newest = max(steps) if steps else None
        self._progress = Progress()
        self._snapshots = Snapshots()
        self.trace = Trace(self.root.root, rank)
        self._promoter = Promoter(self.tiers, keep, self._progress, self.trace, rank) \
            if self.tiers and rank == 0 else None
        self._flusher = Flusher(self.root, self._layouts, self._snapshots, self._progress, self.trace, keep=keep,
                                dist=self._dist, group=self._group, promoter=self._promoter, tiles=tile_checksums,
                                compress=compress, compress_threads=compress_threads, local=self._local)
        self._copier = Copier(self._snapshots, self._progress, self.trace, rank, device=self._device,
                              then=self._flusher.submit, stored=self._layouts.stored, tiles=tile_checksums)
        self._hook = optimizer.register_step_pre_hook(lambda *a: self._fence()) if optimizer is not None else None
        _OPEN[self] = threading.current_thread()

    def _check_same_root(self) -> None:
        """UCL430 on every process when they were given different roots (a per-process temp dir):
        rank 0's would receive every rank file, the others' would stay empty, and a later load()
        would restore some processes and not others."""
        roots = allgather_json(os.path.abspath(self.root.root), group=self._group)
        if len(set(roots)) > 1:
            shown = ", ".join(f"rank {r}: {p}" for r, p in enumerate(roots[:4])) + (" ..." if len(roots) > 4 else "")
            raise UclError(f"the processes were given different checkpoint roots ({shown}); every process must pass "
                           "the same root, on a file system they all see (e.g. create it on rank 0 and "
                           "broadcast the path with dist.broadcast_object_list)", code="UCL430")

    # ---- public API ----------------------------------------------------------------------------
    def save(self, step: int, extra: Any = None) -> None:
        """Snapshot the model and optimizer at ``step`` and return; ``extra`` is any JSON value."""
        t0 = time.perf_counter()
        if self._closed:
            raise UclError("save() after close(): this Checkpointer's threads have stopped; make a new one",
                           code="UCL430")
        self._progress.raise_error()
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise UclError(f"step must be a non-negative integer, got {step!r}", code="UCL430")
        extra = _frozen_json(step, extra)
        self._hold()
        if self._lineage is None:
            self._new_run()
        if self._newest is not None and step < self._newest:
            raise UclError(f"step {step}: {self.root.root} already holds step {self._newest}; saving an older step "
                           "would delete the newer ones once it is durable (they would belong to an abandoned "
                           "run). To continue that run call load() first; to roll back, load(step=k) and save "
                           "from there; to start another run, use another root", code="UCL430")
        self._fence()  # the previous snapshot must be complete before its sources change again
        self._progress.raise_error()  # what that fence found too (debug mode)
        layout = self._layouts.current(self.model, self.optimizer)
        self._layouts.validate(layout)
        sizes = [e.tensor.numel() * e.tensor.element_size() for e in layout.entries]
        offsets, total = layout_bytes(sizes)
        pool = self._snapshots.pool
        # unwritten saves live only in the pool (persist_every > 1 without a local tier): keep them whole;
        # from a GPU, whole where the host has the room (the fence waits for every byte to leave it)
        default = default_pool_bytes(total, rollbacks=self.persist_every > 1 and self._local is None,
                                     room=host_room() if self._pin else None)
        if pool is None or (self.pool_bytes is None and pool.nbytes < default):
            self._new_pool(self.pool_bytes or default)
        pool = self._snapshots.pool
        # written: steps that are multiples of N, and any save after N - 1 unwritten ones in a row
        persist = step % self.persist_every == 0 or self._unwritten + 1 >= self.persist_every
        self._unwritten = 0 if persist else self._unwritten + 1
        shared = persist  # with a local tier every snapshot is written there, these to root too
        persist = persist or self._local is not None
        self._newest = step if self._newest is None else max(self._newest, step)
        region, waited = None, 0.0
        if persist:  # one region if free now (it stays in memory as tier 0), else through the ring
            region = pool.try_allocate(total, reclaim=self._snapshots.forget)
        elif pool.nbytes >= total:  # kept in memory only: it needs a region
            region, waited = pool.allocate(total, closed=lambda: self._progress.failed or self._closed,
                                           reclaim=self._snapshots.forget)
        else:  # a pool smaller than one snapshot keeps none in memory (docs/training.md)
            self._not_kept = (step, total)
            self._last = None
            self.trace.add("blocked", t0, time.perf_counter(), step=step, not_kept=total)
            return
        snap = Snapshot(step, extra, layout, region, offsets, persist, self._state(step, extra),
                        holders={"flush"} if region is None else {"memory"} | ({"flush"} if persist else set()),
                        shared=shared, nbytes=total)
        if region is None:
            snap.stream = PieceStream(pool)
        if self._device is not None:
            import torch
            snap.ready_event = torch.cuda.Event()
            snap.ready_event.record(torch.cuda.current_stream(self._device))
        if self.debug:
            snap.state["debug_checksums"] = self._checksums(layout)
        for e, off in zip(layout.entries, offsets):
            if e.eager and region is None:
                snap.eager[e.key] = e.tensor.detach().to("cpu", copy=True)
            elif e.eager:
                self._snapshots.view(snap, e, off).copy_(e.tensor)
        if persist:
            self._progress.begin()
        self._last = snap
        self._copier.submit(snap)
        self.trace.add("blocked", t0, time.perf_counter(), step=step, waited_for_pool=waited)

    def _hold(self) -> None:
        """Before the job's first write: process rank 0 takes the root lock on the job's behalf (a
        root another job holds raises UCL414 on every process, naming the holder), puts back what a
        killed job left half-done (a step set aside by a re-save, a commit ``latest`` does not name
        yet), removes its temp folders, and promotes the newest checkpoint to tiers that lack it."""
        if self._holding:
            return
        problem = ["", ""]
        if self._process_rank() == 0:
            try:
                lock = acquire(self.root.root, "Checkpointer")
                try:
                    for tier in [self.root] + [t for t in self.tiers if isinstance(t, CheckpointRoot)]:
                        if os.path.isdir(tier.root):
                            tier.take_over()
                    if self._promoter is not None:
                        self._catch_up_tiers()
                except BaseException:
                    lock.release()
                    raise
                self._lock = lock
            except (UclError, OSError) as e:
                if not self._dist:
                    raise
                problem = [str(e), getattr(e, "code", "UCL410")]
        if self._local is not None and self._local.nodes.leads and os.path.isdir(self._local.root.root):
            try:  # what a killed job left in this node's folder
                self._local.root.take_over()
            except (UclError, OSError) as e:
                if not self._dist:
                    raise
                problem = problem if problem[0] else [f"local tier {self._local.root.root}: {e}", "UCL410"]
        if self._dist:
            problems = [p for p in allgather_json(problem, group=self._group) if p[0]]
            if problems:
                if self._lock is not None:
                    self._lock.release()
                    self._lock = None
                text, code = problems[0]
                cls = StoreError if code_agrees(StoreError, code) else UclError
                raise cls(f"process rank 0: {text}" if self._process_rank() else text, code=code)
        self._holding = True

    def _new_run(self) -> None:
        """A run starts (train.lineage): after a load, from what was restored; else it goes on from the
        newest step in ``root`` or this node's folder (process rank 0's view, shared)."""
        base = self._base
        if base is None and self._process_rank() == 0:
            newest = [(self.root.step_of(os.path.basename(p)), p) for p in
                      [r.newest() for r in [self.root] + ([self._local.root] if self._local else [])
                       if os.path.isdir(r.root)] if p]
            try:
                base = of_state(_manifest_of(max(newest)[1]).state) if newest else []
            except (UclError, OSError):
                base = []
        run = [new_run(), base or []]
        if self._dist:
            run = allgather_json(run, group=self._group)[0]
        self._lineage = run[1] + [[run[0], self._resumed]]

    def fence(self) -> None:
        """Wait until the last snapshot's copy is done (on CUDA: the current stream waits on the GPU,
        the CPU does not), and raise a background error. The optimizer step pre-hook fences too, but
        raises nothing: an error raised inside one process's ``optimizer.step()`` would skip that
        step there only, and the processes' weights would part. Call it yourself before changing
        parameters or optimizer state any other way (see docs/training.md)."""
        self._fence()
        self._progress.raise_error()

    def _fence(self) -> None:
        snap = self._last
        if snap is None:
            return
        t0 = time.perf_counter()
        snap.copied.wait()
        if snap.cuda_event is not None:
            import torch
            torch.cuda.current_stream(self._device).wait_event(snap.cuda_event)
        if self.debug and "debug_checksums" in snap.state:
            now = self._checksums(snap.layout)
            changed = [k for k, v in snap.state.pop("debug_checksums").items() if now.get(k) != v]
            if changed:
                self._progress.fail(StoreError(f"step {snap.step}: {len(changed)} tensors changed between save() "
                                               f"and the next fence without ckpt.fence() (e.g. {changed[0]})",
                                               code="UCL433"))
        self._last = None
        self.trace.add("fence", t0, time.perf_counter(), step=snap.step)

    def wait(self) -> None:
        """Block until everything saved so far is durable and promoted (on process rank 0, which
        promotes); raise a background error."""
        self.fence()
        self._progress.wait_idle()
        self._progress.raise_error()

    def load(self, step: int | None = None) -> tuple[int, Any]:
        """Restore model, optimizer (state and hyperparameters) and RNG in place from checkpoint
        ``step`` (default: the latest committed), written on any layout. Returns (step, extra)."""
        self.wait()
        target = restore.Target(self.model, self.optimizer, self._layouts, self._process_rank(), self._world(),
                                self._group)
        restored = restore.from_memory(target, self._snapshots, self.root, step, self.trace,
                                       usable=not self._progress.failed)
        base = self._lineage or self._base or []  # a rollback from memory: the run it was saved in
        if restored is not None:
            self.last_load = LoadReport(restored[0], {"memory": 0})
        elif self._local is not None or self.tiers:
            recovery = Recovery(target, self._local, [self.root] + self.tiers, step, self.trace)
            restored, self.last_load = recovery.run()
            base = recovery.lineage
        else:
            path = self.root.newest() if step is None else self.root.path_for(step)
            if path is None:
                raise StoreError(f"no checkpoint in {self.root.root}", code="UCL404")
            if step is not None and not os.path.isdir(path):
                if self._not_kept is not None and self._not_kept[0] == step:
                    raise StoreError(f"step {step} was saved to host memory only (persist_every={self.persist_every}) "
                                     f"and not kept: its snapshot ({self._not_kept[1]:,} bytes) is larger than the "
                                     f"pool ({self._snapshots.pool.nbytes:,} bytes); roll back from memory with "
                                     f"pool_bytes >= the snapshot", code="UCL404")
                steps = self.root.steps()
                shown = ", ".join(map(str, steps[-20:])) if steps else "none"
                raise StoreError(f"no checkpoint of step {step} in {self.root.root}; the steps there: "
                                 f"{'... ' if len(steps) > 20 else ''}{shown}", code="UCL404")
            stats = IOStats()
            restored = restore.from_checkpoint(
                target, path, read=lambda layout: restore.read_layout(self._layouts, path, layout, stats=stats))
            read = sum(allgather_json(stats.bytes_read, group=self._group)) if self._dist else stats.bytes_read
            self.last_load = LoadReport(restored[0], {"root": read})
            base = of_state(_manifest_of(path).state)
            if step is None and self._not_kept is not None and self._not_kept[0] > restored[0]:
                warnings.warn(f"load() restored step {restored[0]}, the newest written; step {self._not_kept[0]} "
                              "was newer but not kept in host memory (the pool is smaller than its snapshot)",
                              stacklevel=2)
        self._newest = restored[0]
        self._base, self._resumed, self._lineage = base, restored[0], None  # the next save starts a run  # the run goes on from here: newer steps are abandoned
        return restored

    def close(self) -> None:
        """Wait for pending work, stop the background threads, remove the hook. Idempotent."""
        if self._closed:
            return
        _OPEN.pop(self, None)
        try:
            self.wait()
        finally:
            self._closed = True
            self._copier.stop()
            self._flusher.stop()
            if self._promoter is not None:
                self._promoter.stop()
            if self._hook is not None:
                self._hook.remove()
            if self._holding:  # a reader writes nothing into the root, not even its trace
                self.trace.flush()
            if self._lock is not None:
                self._lock.release()
                self._lock = None
            if self._group is not None:  # its threads and sockets: a job that reopens checkpointers leaked them
                if self._dist.is_initialized():  # else the job's destroy_process_group() took it already
                    self._dist.destroy_process_group(self._group)
                self._group = None

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- helpers -----------------------------------------------------------------------------------
    def _catch_up_tiers(self) -> None:
        """A job killed after a commit but before its promotion left the newest checkpoint in tier 1
        only: promote it, in the background, to the tiers whose ``latest`` is older (never to one that
        is ahead, e.g. after tier 1 was lost and the run resumed from a further tier)."""
        step = self.root.latest_step() if os.path.isdir(self.root.root) else None
        if step is None:
            return
        latest = [latest_of(t) for t in self.tiers]  # one look at each tier (a remote one costs a request)
        behind = tuple(i for i, s in enumerate(latest) if s is None or s < step)
        if behind:
            self._promoter.submit(self.root.path_for(step), step, behind)

    def _new_pool(self, nbytes: int) -> None:
        """The default pool holds one snapshot; it is replaced (once every region is free) when the
        snapshots grow, e.g. when the optimizer state appears after the first step."""
        import torch
        if self._snapshots.pool is not None:
            self.wait()
            self._snapshots.forget()
        self._snapshots.pool = HostPool(nbytes, pin=self._pin and torch.cuda.is_available())

    def _state(self, step: int, extra: Any) -> dict:
        groups = None
        if self.optimizer is not None:
            groups = hyperparameters(self.optimizer)
        return {"step": step, "extra": extra, "rng": {str(self._process_rank()): rng.capture()},
                "lineage": self._lineage,
                "optimizer": {"type": type(self.optimizer).__name__, "param_groups": groups} if groups else None}

    @staticmethod
    def _checksums(layout: TrainLayout) -> dict[str, str]:
        """Of what is copied lazily; buffers (copied inside ``save``) may change in forward."""
        return {e.key: checksum_of(to_numpy(e.tensor)[0]) for e in layout.entries if not e.eager}

    def _process_rank(self) -> int:
        return self._dist.get_rank() if self._dist else 0

    def _world(self) -> int:
        return self._dist.get_world_size() if self._dist else 1


def _frozen_json(step: int, extra: Any) -> Any:
    """``extra`` as it is now (a copy: the caller may change its dict after ``save``), checked to be
    JSON here rather than failing in the background."""
    try:
        return plain_json(extra)
    except (TypeError, ValueError) as e:
        raise UclError(f"step {step}: extra must be a JSON value (dicts, lists, str, int, finite float, bool, "
                       f"None): {e}", code="UCL430") from None


def _manifest_of(path: str):
    with Checkpoint.open(path) as ck:
        return ck.manifest
