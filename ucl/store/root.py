"""A directory of checkpoints ``step_00000100/`` ... plus a ``latest`` pointer. ``latest`` is a small
text file replaced atomically, and only ever points at a committed checkpoint."""
from __future__ import annotations

import os
import re
import shutil
from typing import Any

from ..errors import StoreError
from ..files import read_bounded
from .atomic import (STALE_AGE_S, Leftover, cleanup_stale, collect_garbage, fsync_dir, is_committed, is_tmp_name,
                     tmp_name, write_atomic)
from .manifest import MANIFEST_NAME
from .reader import Checkpoint
from .writer import CheckpointWriter

LATEST_NAME = "latest"
_STEP_RE = re.compile(r"^step_(\d{8,})$")


class CheckpointRoot:
    """A directory of checkpoints ``step_00000100/`` ... plus a ``latest`` pointer."""

    def __init__(self, root: str | os.PathLike[str]):
        self.root = os.path.abspath(os.fspath(root))

    def __repr__(self) -> str:
        return f"CheckpointRoot({self.root!r})"

    @staticmethod
    def dir_name(step: int) -> str:
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise StoreError(f"step must be a non-negative integer, got {step!r}", code="UCL413")
        return f"step_{step:08d}"

    @staticmethod
    def step_of(name: str) -> int | None:
        """The step a directory name (``step_00000100``) stands for, or None."""
        m = _STEP_RE.match(name)
        return int(m.group(1)) if m else None

    def path_for(self, step: int) -> str:
        return os.path.join(self.root, self.dir_name(step))

    def steps(self) -> list[int]:
        """Steps of committed checkpoints, ascending."""
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return []
        out = []
        for name in names:
            m = _STEP_RE.match(name)
            if m and is_committed(os.path.join(self.root, name)):
                out.append(int(m.group(1)))
        return sorted(out)

    def _resolve(self, name: int | str) -> str:
        """A step, a directory name in the root, or a path inside the root -> directory name."""
        if isinstance(name, int) and not isinstance(name, bool):
            return self.dir_name(name)
        name = os.fspath(name)
        if os.path.isabs(name) or os.sep in name:
            full = os.path.abspath(name)
            if os.path.dirname(full) != self.root:
                raise StoreError(f"{full} is not a checkpoint directly inside {self.root}", code="UCL413")
            name = os.path.basename(full)
        if name in ("", ".", "..") or "/" in name or is_tmp_name(name):
            raise StoreError(f"invalid checkpoint name {name!r}", code="UCL413")
        return name

    def latest_name(self) -> str | None:
        """Directory name ``latest`` points at, or None when there is no ``latest``."""
        path = os.path.join(self.root, LATEST_NAME)
        if not os.path.lexists(path):
            return None
        raw = read_bounded(path, limit=4096, what="latest pointer", inside=self.root,
                           error=lambda msg: StoreError(msg, code="UCL413"))
        try:
            name = raw.decode("utf-8").strip()
            return self._resolve(name)
        except (UnicodeDecodeError, StoreError):
            raise StoreError(f"{self.root}/{LATEST_NAME} is corrupt: {raw[:80]!r}", code="UCL413") from None

    def latest(self) -> str | None:
        """Path of the latest committed checkpoint, or None. A dangling pointer raises UCL413."""
        name = self.latest_name()
        if name is None:
            return None
        path = os.path.join(self.root, name)
        if not is_committed(path):
            raise StoreError(f"{self.root}/{LATEST_NAME} points at {name}, which is not a committed "
                             "checkpoint", code="UCL413")
        return path

    def latest_step(self) -> int | None:
        name = self.latest_name()
        m = _STEP_RE.match(name) if name else None
        return int(m.group(1)) if m else None

    def set_latest(self, name: int | str) -> str:
        """Point ``latest`` at a committed checkpoint (step, name or path); atomic. Returns its path."""
        dname = self._resolve(name)
        path = os.path.join(self.root, dname)
        if not is_committed(path):
            raise StoreError(f"cannot point latest at {path}: not a committed checkpoint", code="UCL413")
        write_atomic(os.path.join(self.root, LATEST_NAME), (dname + "\n").encode())
        return path

    def prune(self, keep: int) -> list[str]:
        """Delete all but the ``keep`` newest steps, never the one ``latest`` points at.

        A victim is first renamed to a temp name (one atomic step), so a half-deleted
        checkpoint is never visible. Returns the removed paths.
        """
        if not isinstance(keep, int) or keep < 0:
            raise StoreError(f"keep must be a non-negative integer, got {keep!r}", code="UCL413")
        protected = self.latest_name()
        steps = self.steps()
        victims = steps[: max(0, len(steps) - keep)]
        removed = []
        for step in victims:
            name = self.dir_name(step)
            if name == protected:
                continue
            path = os.path.join(self.root, name)
            doomed = os.path.join(self.root, tmp_name(name, "del-"))
            os.rename(path, doomed)
            shutil.rmtree(doomed, ignore_errors=True)
            removed.append(path)
        if removed:
            fsync_dir(self.root)
        return removed

    def adopt_newest(self) -> int | None:
        """Point ``latest`` at the newest committed step when it points at an older one, at nothing,
        or at a checkpoint that is gone: a writer killed between its commit and moving ``latest``
        leaves a complete checkpoint that ``latest`` does not name yet. Returns the latest step."""
        steps = self.steps()
        if not steps:
            return None
        try:
            current = self.latest_step() if self.latest() is not None else None
        except StoreError:  # dangling or corrupt pointer
            current = None
        if current is None or current < steps[-1]:
            self.set_latest(steps[-1])
        return steps[-1]

    def set_aside(self, step: int) -> str | None:
        """Hide committed checkpoint ``step`` (one rename to a temp name) so it can be written anew;
        ``latest`` is first moved to the newest older step if it named it. Returns the hidden path
        (delete it once the new checkpoint is published), or None if there was none."""
        path = self.path_for(step)
        if not os.path.lexists(path):
            return None
        if self.latest_name() == self.dir_name(step):
            older = [s for s in self.steps() if s < step]
            if older:
                self.set_latest(older[-1])
            else:
                os.unlink(os.path.join(self.root, LATEST_NAME))
        hidden = os.path.join(self.root, tmp_name(self.dir_name(step), "del-"))
        os.rename(path, hidden)
        os.utime(hidden)  # freshly set aside, not an abandoned temp entry: gc goes by mtime
        fsync_dir(self.root)
        return hidden

    def discard_after(self, step: int) -> list[str]:
        """Delete committed steps newer than ``step`` (a run resumed from an older checkpoint has
        abandoned them); never the one ``latest`` names."""
        protected = self.latest_name()
        removed = []
        for s in self.steps():
            name = self.dir_name(s)
            if s > step and name != protected:
                doomed = os.path.join(self.root, tmp_name(name, "del-"))
                os.rename(os.path.join(self.root, name), doomed)
                shutil.rmtree(doomed, ignore_errors=True)
                removed.append(os.path.join(self.root, name))
        if removed:
            fsync_dir(self.root)
        return removed

    def cleanup_stale(self, min_age_s: float = 0.0) -> list[str]:
        return cleanup_stale(self.root, min_age_s)

    def gc(self, *, dry_run: bool = False, max_age_s: float = STALE_AGE_S, force: bool = False) -> list[Leftover]:
        """``collect_garbage`` on this root: remove dead writers' temp directories, never a live one's."""
        return collect_garbage(self.root, dry_run=dry_run, max_age_s=max_age_s, force=force)

    def writer(self, step: int, nranks: int, **fields: Any) -> CheckpointWriter:
        """A CheckpointWriter for ``path_for(step)``; call ``set_latest(step)`` after its commit."""
        os.makedirs(self.root, exist_ok=True)
        return CheckpointWriter(self.path_for(step), nranks, **fields)

    def open(self, step: int | None = None) -> Checkpoint:
        """Open checkpoint ``step``, or the latest one when ``step`` is None."""
        path = self.path_for(step) if step is not None else self.latest()
        if path is None:
            raise StoreError(f"no latest checkpoint in {self.root}", code="UCL404")
        return Checkpoint.open(path)


def follow_latest(path: str | os.PathLike[str]) -> str | None:
    """The checkpoint a root's ``latest`` names when ``path`` is a checkpoint root (no manifest of its
    own; a ``latest`` naming a ``step_*`` folder); None for anything else (a checkpoint, a DeepSpeed
    root, whose ``latest`` names a tag folder). A ``latest`` naming a step that is not committed
    raises UCL413 rather than falling through to "not a checkpoint"."""
    path = os.fspath(path)
    if os.path.lexists(os.path.join(path, MANIFEST_NAME)) or not os.path.isfile(os.path.join(path, LATEST_NAME)):
        return None
    root = CheckpointRoot(path)
    try:
        name = root.latest_name()
    except StoreError:  # not a pointer of ours (another framework's, or garbage): not a root
        return None
    if name is None or root.step_of(name) is None:
        return None
    return root.latest()
