"""A directory of checkpoints ``step_00000100/`` ... plus a ``latest`` pointer. ``latest`` is a small
text file replaced atomically, and only ever points at a committed checkpoint."""
from __future__ import annotations

import os
import re
import shutil
from typing import Any

from ..errors import StoreError
from ..files import read_bounded
from .atomic import (DOOMED_TAG, SET_ASIDE_TAG, STALE_AGE_S, Leftover, cleanup_stale, collect_garbage, drop_lock_file,
                     exchange_dirs, final_name_of, fsync_dir, is_committed, is_tmp_name, publish_dir, tag_of, tmp_name,
                     write_atomic)
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
            doomed = os.path.join(self.root, tmp_name(name, DOOMED_TAG))
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

    def newest(self) -> str | None:
        """The checkpoint a reader should take as the latest, without changing anything: what
        ``latest`` names, unless it is missing, dangling or older than the newest committed step (a
        writer killed between a commit and moving ``latest``): then the newest committed step."""
        steps = self.steps()
        try:
            path, current = self.latest(), self.latest_step()
        except StoreError:  # dangling or corrupt pointer
            path = current = None
        if steps and (path is None or current is None or current < steps[-1]):
            return self.path_for(steps[-1])
        return path

    def publish(self, tmp: str, final: str) -> None:
        """Move a writer's finished, durable temp folder ``tmp`` to ``final``, a folder of this root,
        replacing the committed checkpoint there if there is one (a step saved again): the old copy
        stays committed under its name until the new one takes it, so a kill at any point leaves one
        of the two loadable and ``latest`` valid. Where the file system swaps two folders atomically
        the old copy is swapped out and deleted; elsewhere it is renamed aside (``latest`` first moved
        to an older step, if it named it), the new one renamed in, and a kill between the two is
        undone by ``recover`` (the root's next writer, or ``ucl gc``)."""
        if not os.path.lexists(final):
            return publish_dir(tmp, final)
        fsync_dir(tmp)
        if exchange_dirs(tmp, final):
            fsync_dir(self.root)
            drop_lock_file(final)
            self._drop(tmp)  # the old copy now
            return
        name = os.path.basename(final)
        moved = False
        if self.latest_name() == name:
            older = [s for s in self.steps() if s < (self.step_of(name) or 0)]
            if older:
                self.set_latest(older[-1])
                moved = True
        aside = os.path.join(self.root, tmp_name(name, SET_ASIDE_TAG))
        os.rename(final, aside)
        fsync_dir(self.root)
        publish_dir(tmp, final)
        if moved:
            self.set_latest(name)
        self._drop(aside)

    def _drop(self, path: str) -> None:
        """Delete a folder of this root out of sight: renamed to a doomed temp name first, so a kill
        part-way leaves nothing that looks like a checkpoint or a set-aside copy."""
        name = os.path.basename(path)
        doomed = os.path.join(self.root, tmp_name(final_name_of(name) if is_tmp_name(name) else name, DOOMED_TAG))
        try:
            os.rename(path, doomed)
        except FileNotFoundError:
            return
        fsync_dir(self.root)
        shutil.rmtree(doomed, ignore_errors=True)

    def recover(self) -> list[str]:
        """Undo re-saves killed between their two renames (``publish`` without an atomic swap): a
        set-aside copy returns to its name when no committed checkpoint has it, and is deleted when
        one has. Only the root's holder calls it. Returns the paths put back."""
        try:
            names = sorted(os.listdir(self.root))
        except FileNotFoundError:
            return []
        back = []
        for n in names:
            if not is_tmp_name(n) or not tag_of(n).startswith(SET_ASIDE_TAG):
                continue
            p, final = os.path.join(self.root, n), os.path.join(self.root, final_name_of(n))
            if is_committed(final) or not os.path.isfile(os.path.join(p, MANIFEST_NAME)):
                self._drop(p)
            elif not os.path.lexists(final):
                os.rename(p, final)
                fsync_dir(self.root)
                back.append(final)
        return back

    def discard_after(self, step: int) -> list[str]:
        """Delete committed steps newer than ``step`` (a run resumed from an older checkpoint has
        abandoned them); never the one ``latest`` names."""
        protected = self.latest_name()
        removed = []
        for s in self.steps():
            name = self.dir_name(s)
            if s > step and name != protected:
                doomed = os.path.join(self.root, tmp_name(name, DOOMED_TAG))
                os.rename(os.path.join(self.root, name), doomed)
                shutil.rmtree(doomed, ignore_errors=True)
                removed.append(os.path.join(self.root, name))
        if removed:
            fsync_dir(self.root)
        return removed

    def take_over(self) -> list[str]:
        """What the root's new holder does first (``store.rootlock``; the caller holds the lock): put
        back steps a killed re-save set aside, remove killed writers' temp entries, and point
        ``latest`` at the newest committed step. Returns the temp entries removed."""
        self.recover()
        removed = self.cleanup_stale()
        self.adopt_newest()
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
