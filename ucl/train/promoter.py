"""The promotion stage (process rank 0): a thread of its own copies each durable checkpoint to the
further tiers (``tiers=``), so a slow tier never delays the next flush.

The flusher hands over hard links to the committed files, in a hidden locked folder beside the
checkpoint (``store.atomic.TempDir``), so pruning or rewriting that checkpoint in tier 1 meanwhile
cannot pull files out from under the copy; a killed process leaves a dead folder that the next
checkpointer (or ``ucl gc``) removes. At most ``depth`` checkpoints wait besides the one being
copied; then the flusher waits too (disk and, through the pool, memory stay bounded)."""
from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from typing import Any

from ..errors import StoreError
from ..store.atomic import TempDir
from .progress import Progress, Stage, lower_priority
from .tiers import committed_files, describe, promote_to
from .trace import Trace


@dataclass(frozen=True)
class Promotion:
    step: int
    staged: Any  # TempDir of hard links to the committed files
    files: tuple[str, ...]
    tiers: tuple[int, ...]  # indices into Promoter.tiers


class Promoter(Stage):
    def __init__(self, tiers: list, keep: int, progress: Progress, trace: Trace, rank: int, depth: int = 1):
        self.tiers, self.keep, self.progress, self.trace, self.rank = tiers, keep, progress, trace, rank
        super().__init__("ucl-promote", depth)

    def submit(self, path: str, step: int, tiers: tuple[int, ...] | None = None) -> None:
        """Promote the committed checkpoint ``path`` of ``step`` (to ``tiers``, indices; default all);
        waits while the queue is full."""
        try:
            staged = TempDir(path)
            try:
                files = tuple(committed_files(path))
                for name in files:
                    _link_or_copy(os.path.join(path, name), os.path.join(staged.path, name))
            except BaseException:
                staged.discard()
                raise
        except Exception as e:
            self.progress.report(self._error(step, "tier 1 (staging its files)", e))
            return
        self.progress.begin()
        self._put(Promotion(step, staged, files, tuple(range(len(self.tiers))) if tiers is None else tuple(tiers)))

    def _setup(self) -> None:
        lower_priority()

    def _handle(self, item: Promotion) -> None:
        try:
            for i in item.tiers:
                tier = self.tiers[i]
                t0, cpu0 = time.perf_counter(), time.thread_time()
                try:
                    promote_to(tier, item.staged.path, item.step, self.keep, list(item.files))
                except Exception as e:  # each tier is tried; the first error surfaces
                    self.progress.report(self._error(item.step, f"tier {i + 2} ({describe(tier)})", e))
                    continue
                self.trace.add("promote", t0, time.perf_counter(), step=item.step, tier=i + 2,
                               cpu=round(time.thread_time() - cpu0, 6))
        finally:
            item.staged.discard()
            self.trace.flush()
            self.progress.done()

    def _error(self, step: int, where: str, e: BaseException) -> StoreError:
        return StoreError(f"rank {self.rank} step {step}: promoting to {where} failed: {type(e).__name__}: {e}",
                          code="UCL435")


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:  # a filesystem without hard links: a copy, in the flusher's time
        shutil.copyfile(src, dst)
