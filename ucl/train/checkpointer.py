"""``ucl.Checkpointer``: lazy, asynchronous, multi-level checkpoints of a live PyTorch training run.

``save(step)`` records what to copy and returns. A copier thread copies parameters and optimizer
state into a preallocated host pool while the next forward and backward run (neither changes them);
an optimizer step pre-hook fences, waiting only if that copy is unfinished. Buffers, which forward
may update, are copied inside ``save``. A flusher thread writes the rank's HDF5 file from the pool
(the ordinary ucl store format), commits, moves ``latest`` and prunes; further tiers are promoted
after that. Collectives of a multi-process save use their own gloo group. Errors in the background
surface on the next ``save``/``wait``/``close``.
"""
from __future__ import annotations

import contextlib
import os
import queue
import shutil
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..dtypes import logical_of_torch_dtype, storage_dtype, to_numpy, to_torch
from ..errors import StoreError, UclError
from ..lang.spec import Spec, load_spec
from ..layout.bind import Model
from ..layout.mesh import as_mesh
from ..ops.collective import commit_collectively
from ..ops.dist import allgather_json, initialized_dist
from ..ops.load import load_rank
from ..ops.prepare import expected_datasets, open_checkpoint
from ..store.checksum import checksum_of
from ..store.root import CheckpointRoot
from ..store.writer import CheckpointWriter
from . import rng
from .optim import hyperparameters, init_state, restore_hyperparameters
from .tiers import open_tier, promote_to
from .derive import TrainLayout, derive
from .pool import HostPool, Region, layout_bytes
from .trace import Trace

SPEC_NAME = "ucl.train"


@dataclass(eq=False)
class Snapshot:
    step: int
    extra: Any
    layout: TrainLayout
    region: Region
    offsets: list[int]
    persist: bool
    state: dict  # JSON: step, extra, rng, optimizer hyperparameters
    copied: threading.Event = field(default_factory=threading.Event)
    holders: set = field(default_factory=set)  # "memory" (tier 0), "flush"
    cuda_event: Any = None


class Checkpointer:
    """Checkpoints ``model`` and ``optimizer`` into ``root`` (see docs/training.md).

    ``spec``/``mesh``: a manual layout (a ``ucl.layout.Model`` bound to the global dims and
    parameters, and the mesh the module's local tensors have); by default the layout is derived.
    ``keep``: committed checkpoints kept per directory tier. ``tiers``: further directories each
    checkpoint is copied to after it is durable. ``persist_every``: every ``save`` snapshots to host
    memory, every N-th is written. ``pool_bytes``: host pool size (default: two snapshots).
    ``debug``: detect state mutated between ``save`` and the next fence (checksums).
    """

    def __init__(self, root, model, optimizer=None, *, spec=None, mesh=None, keep: int = 3, tiers=None,
                 persist_every: int = 1, pool_bytes: int | None = None, debug: bool = False):
        import torch
        if not isinstance(persist_every, int) or persist_every < 1:
            raise UclError(f"persist_every must be a positive integer, got {persist_every!r}", code="UCL430")
        if not isinstance(keep, int) or keep < 1:
            raise UclError(f"keep must be a positive integer, got {keep!r}", code="UCL430")
        self.root = CheckpointRoot(root)
        self.tiers = [open_tier(t) for t in (tiers or [])]
        self.model, self.optimizer = model, optimizer
        self.keep, self.persist_every, self.pool_bytes, self.debug = keep, persist_every, pool_bytes, debug
        self._bound = self._manual(spec, mesh)
        self._mesh = as_mesh(mesh) if mesh is not None else None
        self._cuda = torch.cuda.is_available() and any(p.is_cuda for p in model.parameters())
        self._dist = initialized_dist()
        self._group = self._dist.new_group(backend="gloo") if self._dist else None  # never the training group
        if self._process_rank() == 0 and os.path.isdir(self.root.root):
            # a killed job may have left temp directories, or a commit that `latest` does not name yet
            self.root.cleanup_stale()
            self.root.adopt_newest()
        if self._dist:
            self._dist.barrier(group=self._group)
        self._pool: HostPool | None = None
        self._models: dict[tuple, Model] = {}
        self._error: BaseException | None = None
        self._closed = False
        self._memory: Snapshot | None = None  # tier 0: the newest snapshot, in host memory
        self._hidden: str | None = None  # a checkpoint of the step being rewritten, hidden until replaced
        self._last: Snapshot | None = None  # the snapshot the next fence waits for
        self._lock = threading.Lock()
        self._pending = 0  # snapshots queued for flushing, not yet done
        self._idle = threading.Condition(self._lock)
        self._copy_q: queue.Queue = queue.Queue()
        self._flush_q: queue.Queue = queue.Queue()
        self.trace = Trace(self.root.root, self._process_rank())
        self._stream = torch.cuda.Stream() if self._cuda else None
        self._threads = [threading.Thread(target=self._copier, name="ucl-snapshot", daemon=True),
                         threading.Thread(target=self._flusher, name="ucl-flush", daemon=True)]
        for t in self._threads:
            t.start()
        self._hook = optimizer.register_step_pre_hook(lambda *a: self.fence()) if optimizer is not None else None

    # ---- public API ----------------------------------------------------------------------------
    def save(self, step: int, extra: Any = None) -> None:
        """Snapshot the model and optimizer at ``step`` and return; ``extra`` is any JSON value."""
        t0 = time.perf_counter()
        self._check()
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise UclError(f"step must be a non-negative integer, got {step!r}", code="UCL430")
        self.fence()  # the previous snapshot must be complete before its sources change again
        layout = derive(self.model, self.optimizer, bound=self._bound, mesh=self._mesh)
        self._validate(layout)
        sizes = [e.tensor.numel() * e.tensor.element_size() for e in layout.entries]
        offsets, total = layout_bytes(sizes)
        if self._pool is None or (self.pool_bytes is None and self._pool.nbytes < 2 * total):
            self._new_pool(max(self.pool_bytes or 2 * total, 1))
        region, waited = self._pool.allocate(total, closed=lambda: self._error is not None or self._closed,
                                             reclaim=self._forget_memory)
        persist = step % self.persist_every == 0
        snap = Snapshot(step, extra, layout, region, offsets, persist, self._state(step, extra),
                        holders={"memory"} | ({"flush"} if persist else set()))
        if self.debug:
            snap.state["debug_checksums"] = self._checksums(layout)
        for e, off in zip(layout.entries, offsets):
            if e.eager:
                self._view(snap, e, off).copy_(e.tensor)
        if persist:
            with self._lock:
                self._pending += 1
        self._last = snap
        self._copy_q.put(snap)
        self.trace.add("blocked", t0, time.perf_counter(), step=step, waited_for_pool=waited)

    def fence(self) -> None:
        """Wait until the last snapshot's copy is done (on CUDA: the current stream waits on the GPU,
        the CPU does not). Called by the optimizer step pre-hook; call it yourself before changing
        parameters or optimizer state any other way (see docs/training.md)."""
        snap = self._last
        if snap is None:
            return
        t0 = time.perf_counter()
        snap.copied.wait()
        if snap.cuda_event is not None:
            import torch
            torch.cuda.current_stream().wait_event(snap.cuda_event)
        if self.debug and "debug_checksums" in snap.state:
            now = self._checksums(snap.layout)
            changed = [k for k, v in snap.state.pop("debug_checksums").items() if now.get(k) != v]
            if changed:
                self._fail(StoreError(f"step {snap.step}: {len(changed)} tensors changed between save() and the "
                                      f"next fence without ckpt.fence() (e.g. {changed[0]})", code="UCL433"))
        self._last = None
        self.trace.add("fence", t0, time.perf_counter(), step=snap.step)
        self._check()

    def wait(self) -> None:
        """Block until everything saved so far is durable (and promoted); raise a background error."""
        self.fence()
        with self._idle:
            while self._pending and self._error is None:
                self._idle.wait(timeout=0.1)
        self._check()

    def load(self, step: int | None = None) -> tuple[int, Any]:
        """Restore model, optimizer (state and hyperparameters) and RNG in place from checkpoint
        ``step`` (default: the latest committed), written on any layout. Returns (step, extra)."""
        self.wait()
        restored = self._load_memory(step)
        if restored is not None:
            return restored
        path = self.root.latest() if step is None else self.root.path_for(step)
        if path is None:
            raise StoreError(f"no checkpoint in {self.root.root}", code="UCL404")
        with open_checkpoint(path) as ck:
            manifest = ck.manifest
        saved = manifest.state or {}
        kinds = {k.split("/", 1)[0] for ds in manifest.datasets for k in ds}
        if self.optimizer is not None and kinds - {"param"} and not self.optimizer.state:
            init_state(self.optimizer)
        layout = derive(self.model, self.optimizer, bound=self._bound, mesh=self._mesh)
        arrays = self._read(path, manifest, layout)
        import torch
        with torch.no_grad():
            for e in layout.entries if layout.rank >= 0 or layout.mesh.is_universal else ():
                if e.key not in arrays:
                    raise StoreError(f"{path} has no {e.key}: it was saved from a different model or optimizer",
                                     code="UCL434")
                if arrays[e.key] is e.tensor:  # filled in place
                    continue
                src = to_torch(arrays[e.key], logical_of_torch_dtype(e.tensor.dtype))
                e.tensor.copy_(src.reshape(e.tensor.shape))
        if self.optimizer is not None:
            restore_hyperparameters(self.optimizer, saved.get("optimizer"))
        rng.restore(saved.get("rng"), self._process_rank(), self._world())
        return int(saved.get("step", -1)), saved.get("extra")

    def _load_memory(self, step: int | None) -> tuple[int, Any] | None:
        """Tier 0: restore from the snapshot still in host memory when it is what ``load`` asks for
        (``step``, or newer than every committed checkpoint: ``persist_every > 1`` keeps unwritten
        snapshots there) and the model and optimizer still have its layout; on every rank or on none
        (ranks agree through the checkpointer's own group). None: read from disk instead."""
        with self._lock:
            snap = self._memory
            if snap is not None:
                snap.holders.add("load")  # not reclaimed while it is read
        try:
            usable = snap is not None and snap.copied.is_set() and self._error is None
            if usable:
                latest = self.root.latest_step()
                usable = snap.step == step if step is not None else latest is None or snap.step > latest
            layout = derive(self.model, self.optimizer, bound=self._bound, mesh=self._mesh) if usable else None
            usable = usable and layout.signature == snap.layout.signature
            if self._world() > 1:
                usable = all(allgather_json(bool(usable), group=self._group))
            if not usable:
                return None
            t0 = time.perf_counter()
            import torch
            with torch.no_grad():
                for e, off in zip(layout.entries, snap.offsets):
                    e.tensor.copy_(self._view(snap, e, off))
            if self.optimizer is not None:
                restore_hyperparameters(self.optimizer, snap.state.get("optimizer"))
            rng.restore(snap.state.get("rng"), self._process_rank(), self._world())
            self.trace.add("restore", t0, time.perf_counter(), step=snap.step, tier=0)
            return snap.step, snap.state.get("extra")
        finally:
            if snap is not None:
                self._drop(snap, "load")

    def close(self) -> None:
        """Wait for pending work, stop the background threads, remove the hook. Idempotent."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            self._copy_q.put(None)
            for t in self._threads:
                t.join(timeout=60)
            if self._hook is not None:
                self._hook.remove()
            self.trace.flush()

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _new_pool(self, nbytes: int) -> None:
        """The default pool holds two snapshots; it is replaced (once every region is free) when the
        snapshots grow, e.g. when the optimizer state appears after the first step."""
        import torch
        if self._pool is not None:
            self.wait()
            self._forget_memory()
        self._pool = HostPool(nbytes, pin=self._cuda and torch.cuda.is_available())

    def _forget_memory(self) -> None:
        """Give up the tier-0 (host memory) copy of the newest snapshot, to make room for a new one."""
        with self._lock:
            memory, self._memory = self._memory, None
        if memory is not None:
            self._drop(memory, "memory")

    # ---- layout ----------------------------------------------------------------------------------
    @staticmethod
    def _manual(spec, mesh):
        if spec is None:
            if mesh is not None:
                raise UclError("mesh= needs spec= (a manual layout); without both the layout is derived", code="UCL430")
            return None
        if isinstance(spec, Model):
            return spec
        s = load_spec(spec) if not isinstance(spec, Spec) else spec
        dims = {}
        return s.bind(dims, s.synthesize_params(dims))

    def _model_of(self, layout: TrainLayout) -> Model:
        model = self._models.get(layout.signature)
        if model is None:
            if self._bound is not None:
                model = self._bound
            else:
                spec = Spec.from_text(layout.spec_text, "<derived spec>", name=SPEC_NAME)
                model = spec.bind(layout.dims, layout.params, frozen=layout.frozen)
            self._models[layout.signature] = model
        return model

    def _validate(self, layout: TrainLayout) -> None:
        if layout.signature in self._models:
            return
        model = self._model_of(layout)
        if layout.rank < 0:
            return
        want = expected_datasets(model, layout.mesh, layout.rank)
        have = {e.key: (tuple(e.tensor.shape), logical_of_torch_dtype(e.tensor.dtype)) for e in layout.entries}
        problems = [f"missing {k} {list(s)} {d}" for k, (s, d) in sorted(want.items()) if k not in have]
        problems += [f"unexpected {k}" for k in sorted(set(have) - set(want))]
        problems += [f"{k}: the spec says {list(want[k][0])} {want[k][1]}, the module has {list(s)} {d}"
                     for k, (s, d) in sorted(have.items()) if k in want and (tuple(want[k][0]), want[k][1]) != (s, d)]
        if problems:
            self._models.pop(layout.signature, None)
            more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
            raise StoreError(f"rank {layout.rank} of {layout.mesh}: the module does not match the layout:\n  "
                           + "\n  ".join(problems[:20]) + more, code="UCL421")

    def _state(self, step: int, extra: Any) -> dict:
        groups = None
        if self.optimizer is not None:
            groups = hyperparameters(self.optimizer)
        return {"step": step, "extra": extra, "rng": {str(self._process_rank()): rng.capture()},
                "optimizer": {"type": type(self.optimizer).__name__, "param_groups": groups} if groups else None}

    # ---- background: copy ----------------------------------------------------------------------
    def _view(self, snap: Snapshot, entry, offset: int):
        t = entry.tensor
        n = t.numel() * t.element_size()
        raw = self._pool.view(snap.region)[offset:offset + n]
        return raw.view(t.dtype).view(t.shape) if n else raw[:0].view(t.dtype).reshape(t.shape)

    def _copier(self) -> None:
        while True:
            snap = self._copy_q.get()
            if snap is None:
                self._flush_q.put(None)
                return
            t0 = time.perf_counter()
            try:
                self._copy(snap)
            except BaseException as e:  # surfaces on the next call
                self._fail(StoreError(f"rank {self._process_rank()} step {snap.step}: snapshot failed: {e}",
                                      code="UCL432"))
                snap.copied.set()
                self._drop(snap, *list(snap.holders))
                if snap.persist:
                    self._done()
                continue
            self.trace.add("snapshot", t0, time.perf_counter(), step=snap.step, bytes=snap.region.stop - snap.region.start)
            with self._lock:
                previous, self._memory = self._memory, snap
            if previous is not None:
                self._drop(previous, "memory")
            if snap.persist:
                self._flush_q.put(snap)

    def _copy(self, snap: Snapshot) -> None:
        import torch
        ctx = torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext()
        with ctx, torch.no_grad():
            for e, off in zip(snap.layout.entries, snap.offsets):
                if not e.eager:
                    self._view(snap, e, off).copy_(e.tensor, non_blocking=self._stream is not None)
            if self._stream is not None:
                snap.cuda_event = torch.cuda.Event()
                snap.cuda_event.record(self._stream)
        snap.copied.set()
        if snap.cuda_event is not None:
            snap.cuda_event.synchronize()  # the flusher reads host memory: off the training thread

    # ---- background: flush -------------------------------------------------------------------------
    def _flusher(self) -> None:
        while True:
            snap = self._flush_q.get()
            if snap is None:
                return
            try:
                if self._error is None:
                    self._persist(snap)
            except BaseException as e:
                self._unhide(snap.step)
                self._fail(e if isinstance(e, UclError) else
                           StoreError(f"rank {self._process_rank()} step {snap.step}: writing failed: {e}", code="UCL410"))
            finally:
                self._drop(snap, "flush")
                self._done()

    def _persist(self, snap: Snapshot) -> None:
        t0 = time.perf_counter()
        layout = snap.layout
        model = self._model_of(layout)
        os.makedirs(self.root.root, exist_ok=True)
        fields = dict(spec=model.spec.text, spec_name=SPEC_NAME, dims=dict(model.dims), mesh=layout.mesh.to_json(),
                      params={n: list(s) for n, s in model.params.items()}, frozen=sorted(model.frozen),
                      state=snap.state)
        path = self.root.path_for(snap.step)
        if self._world() == 1:
            self._hidden = self.root.set_aside(snap.step)  # the same step saved again replaces it
            with CheckpointWriter(path, layout.mesh.size, **fields) as w:
                self._write(w, snap)
                w.commit()
        else:
            self._persist_collective(snap, path, fields)
        t1 = time.perf_counter()
        self.trace.add("flush", t0, t1, step=snap.step, bytes=snap.region.stop - snap.region.start,
                       pool_high_water=self._pool.high_water)
        if self._process_rank() == 0:
            self.root.set_latest(snap.step)
            self.root.discard_after(snap.step)  # after load(step=k), later steps belong to an abandoned run
            if self._hidden is not None:
                shutil.rmtree(self._hidden, ignore_errors=True)
                self._hidden = None
            self.root.prune(self.keep)
            for tier in self.tiers:
                promote_to(tier, path, snap.step, self.keep)
            self.trace.add("promote", t1, time.perf_counter(), step=snap.step)
        if self._world() > 1:
            self._dist.barrier(group=self._group)  # every rank's wait() returns after `latest` moved
        self.trace.flush()

    def _unhide(self, step: int) -> None:
        """A failed rewrite of ``step`` puts the checkpoint it was to replace back."""
        hidden, self._hidden = self._hidden, None
        path = self.root.path_for(step)
        if hidden is not None and not os.path.lexists(path):
            os.rename(hidden, path)
            self.root.adopt_newest()

    def _write(self, writer: CheckpointWriter, snap: Snapshot) -> None:
        for e, off in zip(snap.layout.entries, snap.offsets):
            logical = logical_of_torch_dtype(e.tensor.dtype)
            n = e.tensor.numel() * e.tensor.element_size()
            raw = self._pool.view(snap.region)[off:off + n].numpy()
            writer.write(snap.layout.rank, e.key, raw.view(storage_dtype(logical)).reshape(tuple(e.tensor.shape)),
                         dtype=logical)

    def _persist_collective(self, snap: Snapshot, path: str, fields: dict) -> None:
        """Every process writes its rank file; rank 0 commits once all are durable (ops.collective)."""
        layout = snap.layout

        def write(writer: CheckpointWriter) -> list[int]:
            if layout.rank < 0:
                return []
            self._write(writer, snap)
            return [layout.rank]

        def before_commit(writer: CheckpointWriter, shares: list) -> None:
            for rng_states in shares:  # every process's generators, by process rank
                writer.manifest.state["rng"].update(rng_states)

        def prepare() -> None:
            self._hidden = self.root.set_aside(snap.step)  # the same step saved again replaces it

        try:
            commit_collectively(path, layout.mesh.size, fields, write, group=self._group,
                                share=snap.state["rng"], before_commit=before_commit, prepare=prepare)
        except StoreError as e:
            raise StoreError(f"step {snap.step}: {e}", code=e.code) from None

    # ---- reading ---------------------------------------------------------------------------------------
    def _read(self, path: str, manifest, layout: TrainLayout) -> dict[str, np.ndarray]:
        """This rank's datasets in the current layout, from a checkpoint of any layout."""
        rank = max(layout.rank, 0)
        model = self._model_of(layout)
        saved = {n: tuple(s) for n, s in (manifest.params or {}).items()}
        if saved != dict(model.params):
            missing = sorted(set(model.params) - set(saved))
            extra = sorted(set(saved) - set(model.params))
            differ = sorted(n for n in set(saved) & set(model.params) if saved[n] != tuple(model.params[n]))
            raise StoreError(f"{path} holds another model: missing {missing[:5]}, extra {extra[:5]}, other shapes "
                             f"{differ[:5]}", code="UCL434")
        # only this rank's hyperslabs, read straight into the live tensors where their shapes agree
        want = expected_datasets(model, layout.mesh, rank) if layout.rank >= 0 or layout.mesh.is_universal else {}
        into = {e.key: e.tensor for e in layout.entries
                if e.key in want and tuple(e.tensor.shape) == tuple(want[e.key][0])}
        return load_rank(path, mesh=layout.mesh, rank=rank, model=model, out=into)

    # ---- helpers -----------------------------------------------------------------------------------------
    @staticmethod
    def _checksums(layout: TrainLayout) -> dict[str, str]:
        return {e.key: checksum_of(to_numpy(e.tensor)[0]) for e in layout.entries}

    def _drop(self, snap: Snapshot, *holders: str) -> None:
        with self._lock:
            for h in holders:
                snap.holders.discard(h)
            free = not snap.holders
        if free and self._pool is not None:
            self._pool.release(snap.region)

    def _done(self) -> None:
        with self._idle:
            self._pending -= 1
            self._idle.notify_all()

    def _fail(self, error: BaseException) -> None:
        with self._lock:
            if self._error is None:
                self._error = error

    def _check(self) -> None:
        error = self._error
        if error is not None:
            self._error = None
            raise error

    def _process_rank(self) -> int:
        return self._dist.get_rank() if self._dist else 0

    def _world(self) -> int:
        return self._dist.get_world_size() if self._dist else 1
