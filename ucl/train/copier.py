"""The snapshot stage: a thread copies each saved snapshot's tensors into its pool region while
the next forward and backward run (on CUDA: a side stream, ``non_blocking``), keeps the newest
copy as tier 0 and hands those to be persisted to the flusher."""
from __future__ import annotations

import contextlib
import time
from typing import Callable

import numpy as np

from ..errors import StoreError
from ..store.digests import copy_checksummed
from .derive import TrainLayout
from .progress import Progress, Stage
from .ring import copy_streamed, host_bytes
from .snapshot import Snapshot, Snapshots
from .trace import Trace


class Copier(Stage):
    def __init__(self, snapshots: Snapshots, progress: Progress, trace: Trace, rank: int, *,
                 device, then: Callable[[Snapshot], None], stored: Callable[[TrainLayout], frozenset[str]],
                 tiles: bool = True):
        import torch
        self.snapshots, self.progress, self.trace, self.rank, self.then = snapshots, progress, trace, rank, then
        self.stored, self.tiles = stored, tiles
        self._stream = torch.cuda.Stream(device=device) if device is not None else None  # CUDA only
        super().__init__("ucl-snapshot")  # unbounded: bounded by the pool, save() waits for a region first

    def submit(self, snap: Snapshot) -> None:
        self._put(snap)

    def _handle(self, snap: Snapshot) -> None:
        t0, cpu0 = time.perf_counter(), time.thread_time()
        streamed, info = snap.stream is not None, {}
        if streamed:  # the flusher drains the ring while this fills it
            self.then(snap)
        try:
            if streamed:
                info["pieces"], info["waited_for_ring"] = self._copy_streamed(snap)
            else:
                self._copy(snap)
        except BaseException as e:  # surfaces on the next call
            if not (streamed and snap.stream.abandoned):  # abandoned: the flusher's reason is the error
                self.progress.fail(StoreError(f"rank {self.rank} step {snap.step}: snapshot failed: {e}",
                                              code="UCL432"))
            if streamed:  # after the failure is recorded: the flusher then reports nothing of its own
                snap.stream.close(e)
            snap.copied.set()
            self.snapshots.drop(snap, *[h for h in list(snap.holders) if h != "flush"])
            if snap.persist and not streamed:  # the flusher writes nothing of it, but takes part in the agreement
                self.then(snap)
            return
        self.trace.add("snapshot", t0, time.perf_counter(), step=snap.step, bytes=snap.nbytes,
                       cpu=round(time.thread_time() - cpu0, 6), **info)
        if streamed:
            snap.stream.close()
        else:
            self.snapshots.remember(snap)
            if snap.persist:
                self.then(snap)

    def _copy_streamed(self, snap: Snapshot) -> tuple[int, float]:
        """Through the ring in pieces (train.ring); the fence waits for the last piece's copy."""
        import torch
        stream = self._stream
        ctx = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
        with ctx, torch.no_grad():
            if snap.ready_event is not None:
                stream.wait_event(snap.ready_event)
            done = copy_streamed(snap, snap.stream, self.stored(snap.layout), tiles=self.tiles, cuda_stream=stream,
                                 waiting=lambda: self.progress.failed, reclaim=self.snapshots.forget)
        snap.copied.set()
        return done

    def _copy(self, snap: Snapshot) -> None:
        import torch
        stream = self._stream
        ctx = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
        # what this rank writes is hashed as it is copied, block by block while in cache, instead of
        # by the flusher from memory (a second pass over the pool that training's threads feel)
        hashed = self.stored(snap.layout) if snap.persist else frozenset()
        with ctx, torch.no_grad():
            if snap.ready_event is not None:
                # the kernels queued on the training stream before save() (the optimizer step that
                # produced these values) finish before the copy reads them
                stream.wait_event(snap.ready_event)
            for e, off in zip(snap.layout.entries, snap.offsets):
                if e.eager:
                    continue
                src = host_bytes(e.tensor)  # None for a CUDA tensor; offloaded optimizer state is on the CPU
                if src is not None and e.key in hashed:
                    dst = self.snapshots.array(snap, e, off)
                    snap.digests[e.key] = copy_checksummed(dst, src.view(dst.dtype).reshape(dst.shape),
                                                                tiles=self.tiles)
                elif src is not None:  # one thread, GIL released: no second team of intra-op threads
                    np.copyto(self.snapshots.bytes(snap, off, src.size), src)
                else:
                    self.snapshots.view(snap, e, off).copy_(e.tensor, non_blocking=stream is not None)
            if stream is not None:
                snap.cuda_event = torch.cuda.Event()
                snap.cuda_event.record(stream)
        snap.copied.set()
        if snap.cuda_event is not None:
            snap.cuda_event.synchronize()  # the flusher reads host memory: off the training thread

