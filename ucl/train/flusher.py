"""The flush stage: a thread writes each persisted snapshot from the pool to this rank's HDF5 file
(the ordinary ucl store format), commits (collectively, on the checkpointer's own gloo group, when
there are several processes), moves ``latest``, prunes, and hands the durable checkpoint to the
promoter. h5py releases the GIL while it writes."""
from __future__ import annotations

import os
import time

from ..dtypes import logical_of_torch_dtype
from ..errors import StoreError, UclError
from ..ops.collective import commit_collectively
from ..ops.dist import allgather_json
from ..store.ahead import CodedAhead, CodingThreads, ahead_budget
from ..store.root import CheckpointRoot
from ..store.writer import CheckpointWriter
from .layouts import SPEC_NAME, Layouts
from .local import LocalTier, copy_to_root
from .replicas import replicate
from .progress import Progress, Stage
from .promoter import Promoter
from .ring import whole_datasets
from .snapshot import Snapshot, Snapshots
from .trace import Trace


TEMPLATES_KEPT = 2  # rank-file templates kept: the current layout and the one before a reshape


class Flusher(Stage):
    def __init__(self, root: CheckpointRoot, layouts: Layouts, snapshots: Snapshots, progress: Progress,
                 trace: Trace, *, keep: int, dist=None, group=None, promoter: Promoter | None = None,
                 tiles: bool = True, compress: str | None = None, compress_threads: int = 1,
                 local: LocalTier | None = None):
        self.compress, self.compress_threads = compress, compress_threads  # coded here, never in training
        self._coders = CodingThreads(compress_threads)  # kept from save to save (started at the first)
        self.root, self.layouts, self.snapshots, self.progress, self.trace = root, layouts, snapshots, progress, trace
        self.keep, self.dist, self.group, self.promoter, self.tiles = keep, dist, group, promoter, tiles
        self.local = local  # the node-local tier: every snapshot goes there, those with snap.shared on to root
        self.rank = dist.get_rank() if dist else 0
        self.world = dist.get_world_size() if dist else 1
        self._coding = (0.0, 0)
        self._templates: dict = {}  # (rank, datasets) -> RankTemplate, most recently used last
        super().__init__("ucl-flush")  # unbounded: bounded by the pool, save() waits for a region first

    def stop(self, timeout: float = 60) -> None:
        super().stop(timeout)
        if not self._thread.is_alive():  # else still flushing (past the timeout): its threads go with the process
            self._coders.close()

    def submit(self, snap: Snapshot) -> None:
        """Persist ``snap`` (its ``progress.begin()`` was called by ``save``)."""
        self._put(snap)

    def _handle(self, snap: Snapshot) -> None:
        # not niced (progress.BACKGROUND_NICE): durability is latency the job waits on (back-pressure),
        # and on a shared machine a niced flusher loses to other processes, not to training
        try:
            go = not self.progress.failed
            if self.world > 1:
                go = self._agree(snap, go)
            if go:
                self._persist(snap)
        except BaseException as e:
            if snap.stream is not None and snap.stream.failed:
                return  # the copier reported why (the finally below still runs)
            ours = isinstance(e, UclError)  # named again with the rank and step it happened at
            error = StoreError(f"rank {self.rank} step {snap.step}: " + (str(e) if ours else f"writing failed: {e}"),
                               code=e.code if ours else "UCL410")
            error.__cause__ = e
            self.progress.fail(error)
        finally:
            if snap.stream is not None:  # pieces not written (nothing was, or it failed) go back to the pool
                snap.stream.abandon()
            self.snapshots.drop(snap, "flush")
            self.progress.done()

    def _agree(self, snap: Snapshot, go: bool) -> bool:
        """Whether every process writes this snapshot: all must be fit to (none stopped by an earlier
        failure of its own) and at the same step, or none writes it; a collective commit entered by
        some processes only would pair up different checkpoints' files."""
        try:
            views = allgather_json([snap.step, go], group=self.group)
        except RuntimeError as e:  # gloo: a peer exited (its own error is raised there) or hung past the timeout
            raise StoreError(f"not written: another process of the job stopped answering (it exited, failed or hung "
                             f"past the collective timeout): {e}", code="UCL424") from None
        steps = sorted({s for s, _ in views})
        if len(steps) > 1:
            calls = ", ".join(f"rank {r}: {s}" for r, (s, _) in enumerate(views))
            raise StoreError(f"save() was called with different steps on the processes ({calls}); every process "
                             "must save the same steps", code="UCL436")
        broken = [r for r, (_, ok) in enumerate(views) if not ok]
        if broken and go:
            raise StoreError(f"not written: process{'es' if len(broken) > 1 else ''} "
                             f"{', '.join(map(str, broken))} failed earlier (their error is raised there)",
                             code="UCL436")
        return not broken

    def _persist(self, snap: Snapshot) -> None:
        t0, cpu0 = time.perf_counter(), time.thread_time()
        self._coding = (0.0, 0)  # the coding threads' CPU seconds, the most bytes coded ahead (_write)
        writers: list[CheckpointWriter] = []  # whose write-behind CPU the trace adds to this thread's
        layout = snap.layout
        model = self.layouts.model_of(layout)
        os.makedirs(self.root.root, exist_ok=True)
        fields = dict(spec=model.spec.text, spec_name=SPEC_NAME, dims=dict(model.dims), mesh=layout.mesh.to_json(),
                      params={n: list(s) for n, s in model.params.items()}, frozen=sorted(model.frozen),
                      state=snap.state)
        path = self.root.path_for(snap.step)
        if self.local is not None:
            if not self._persist_local(snap, path, fields):
                return
        elif self.world == 1:  # the same step saved again replaces it (root.publish: the old copy until then)
            with CheckpointWriter(path, layout.mesh.size, write_behind=True, publish=self.root.publish,
                                  compress=self.compress, compress_threads=self.compress_threads, **fields) as w:  # the pool holds still
                writers.append(w)
                self._write(w, snap)
                w.commit()
        else:
            self._persist_collective(snap, path, fields, writers)
        if self.rank == 0:
            self.root.set_latest(snap.step)
            self.root.discard_after(snap.step)  # after load(step=k), later steps belong to an abandoned run
            self.root.prune(self.keep)
        cpu = time.thread_time() - cpu0 + sum(w.write_cpu_seconds for w in writers) + self._coding[0]
        coded = dict(coded_ahead=self._coding[1]) if self.compress else {}
        self.trace.add("flush", t0, time.perf_counter(), step=snap.step, bytes=snap.nbytes,
                       pool_high_water=self.snapshots.pool.high_water, cpu=round(cpu, 6), **coded)
        if self.rank == 0 and self.promoter is not None:
            self.promoter.submit(path, snap.step)  # waits while the promoter's queue is full
        if self.world > 1:
            self.dist.barrier(group=self.group)  # every rank's wait() returns after `latest` moved
        self.trace.flush()

    def _persist_local(self, snap: Snapshot, path: str, fields: dict) -> bool:
        """Into every node's local folder; then, for a ``shared`` snapshot, copied on to ``root``.
        Returns whether it went to ``root`` too."""
        t0 = time.perf_counter()
        layout = snap.layout
        entries = self.local.write(snap.step, layout.mesh.size, layout.rank, fields, lambda w: self._write(w, snap),
                                   compress=self.compress, compress_threads=self.compress_threads)
        self.trace.add("local", t0, time.perf_counter(), step=snap.step, bytes=snap.nbytes)
        replicate(self.local, snap.step, layout.rank, self.local.replicas, self.group, self.trace)
        if not snap.shared:
            self.trace.flush()
            return False
        copy_to_root(self.local.root.path_for(snap.step), self.root, snap.step, layout.mesh.size, layout.rank,
                     fields, entries, dist=self.dist if self.world > 1 else None, group=self.group)
        return True

    def _write(self, writer: CheckpointWriter, snap: Snapshot) -> None:
        """The rank's file, replayed from its layout's template (store.template: the HDF5 structure
        is built at the first checkpoint of a layout, not at every one)."""
        stored = self.layouts.stored(snap.layout)  # replicas another rank stores are not written
        arrays, datasets = {}, {}
        for e, off in zip(snap.layout.entries, snap.offsets):
            if e.key not in stored:
                continue
            if snap.stream is None:
                arrays[e.key] = self.snapshots.array(snap, e, off)
            datasets[e.key] = (tuple(e.tensor.shape), logical_of_torch_dtype(e.tensor.dtype))
        rank = snap.layout.rank
        if writer.compress:  # coded sizes differ at every checkpoint: no template, each dataset written
            if snap.stream is not None:  # coded whole: assembled from the ring
                arrays = whole_datasets(snap.stream.pieces(), datasets)
            items = ((key, arr, datasets[key][1])
                     for key, arr in (arrays if snap.stream is not None else arrays.items()))
            # the next datasets are coded (on compress_threads threads) while this one is written
            budget = ahead_budget(snap.nbytes, self._coders.threads)
            with CodedAhead(items, writer.compress, self._coders, budget) as ahead:
                for key, arr, dtype, enc in ahead:  # digests: hashed by the copier
                    writer.write(rank, key, arr, dtype=dtype, digests=snap.digests.get(key), coded=enc)
            self._coding = (self._coding[0] + ahead.cpu_seconds, max(self._coding[1], ahead.high_water))
            return
        signature = (rank, tuple(datasets.items()))
        template = self._templates.pop(signature, None) or writer.template(rank, datasets, tiles=self.tiles)
        self._templates[signature] = template
        while len(self._templates) > TEMPLATES_KEPT:
            self._templates.pop(next(iter(self._templates)))
        if snap.stream is not None:  # pieces from the ring, as the copier fills them (train.ring)
            writer.write_pieces(rank, template, snap.stream.pieces(), lambda: snap.digests)
        else:
            writer.write_from(rank, template, arrays, snap.digests)  # hashed by the copier

    def _persist_collective(self, snap: Snapshot, path: str, fields: dict, writers: list) -> None:
        """Every process writes its rank file; rank 0 commits once all are durable (ops.collective)."""
        layout = snap.layout

        def write(writer: CheckpointWriter) -> list[int]:
            writers.append(writer)
            if layout.rank < 0:
                return []
            self._write(writer, snap)
            return [layout.rank]

        def before_commit(writer: CheckpointWriter, shares: list) -> None:
            for rng_states in shares:  # every process's generators, by process rank
                writer.manifest.state["rng"].update(rng_states)

        commit_collectively(path, layout.mesh.size, fields, write, group=self.group,
                            share=snap.state["rng"], before_commit=before_commit, publish=self.root.publish,
                            write_behind=True, compress=self.compress)

