"""Further tiers a committed checkpoint is promoted to after it is durable: a directory (copied
atomically, with its own ``latest`` and retention) or an fsspec URL (``s3://bucket/run``,
``gs://...``, ``memory://...``, any filesystem fsspec knows)."""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from typing import Any

from ..errors import UclError
from ..store.atomic import LOCK_NAME, fsync_path, staged_dir
from ..store.manifest import MANIFEST_NAME
from ..store.root import LATEST_NAME, CheckpointRoot


def committed_files(path: str) -> list[str]:
    """The files of a committed checkpoint folder (rank files and the manifest), sorted."""
    return sorted(f for f in os.listdir(path) if not f.startswith(LOCK_NAME))


def _manifest(path: str) -> bytes:
    with open(os.path.join(path, MANIFEST_NAME), "rb") as f:
        return f.read()


def promote(path: str, tier: CheckpointRoot, step: int, keep: int, files=None) -> None:
    """Copy a committed checkpoint (``files`` of ``path``, default all) to another directory tier,
    atomically (the folder appears whole or not at all), then move its ``latest`` and prune. The tier
    mirrors tier 1's history: a ``step`` it already holds from an abandoned run (another manifest) is
    replaced, and its steps after ``step`` (tier 1 discarded them when the run went back) go."""
    files = committed_files(path) if files is None else files
    os.makedirs(tier.root, exist_ok=True)
    final = tier.path_for(step)
    if os.path.isfile(os.path.join(final, MANIFEST_NAME)) and _manifest(final) == _manifest(path):
        return
    with staged_dir(final, publish=tier.publish) as folder:  # an abandoned run's copy stays until replaced
        for name in files:
            shutil.copyfile(os.path.join(path, name), os.path.join(folder, name))
            fsync_path(os.path.join(folder, name))
    tier.set_latest(step)
    tier.discard_after(step)
    tier.prune(keep)


@dataclass
class RemoteTier:
    """A tier on an fsspec filesystem. Object stores have no atomic rename of a folder, so a
    checkpoint's ``manifest.json`` (which makes a folder a checkpoint) is uploaded after every rank
    file and ``latest`` after that; pruning deletes a victim's manifest first. A promotion killed
    half-way leaves a folder without a manifest, which is not a checkpoint and is replaced by the
    next promotion of that step."""
    url: str
    fs: Any
    root: str

    @classmethod
    def open(cls, url: str) -> "RemoteTier":
        try:
            import fsspec
        except ImportError:
            raise UclError(f"tier {url}: an fsspec URL needs fsspec (pip install fsspec, plus the filesystem's "
                           "package, e.g. s3fs)", code="UCL430") from None
        try:
            fs, root = fsspec.core.url_to_fs(url)
        except (ValueError, ImportError) as e:
            raise UclError(f"tier {url}: fsspec cannot open it: {e}", code="UCL430") from None
        return cls(url, fs, root.rstrip("/"))

    def _join(self, *parts: str) -> str:
        return "/".join((self.root, *parts))

    def steps(self) -> list[int]:
        """Steps whose folder holds a manifest (committed), ascending."""
        try:
            names = [p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(self.root, detail=False)]
        except FileNotFoundError:
            return []
        out = []
        for name in names:
            step = CheckpointRoot.step_of(name)
            if step is not None and self.fs.exists(self._join(name, MANIFEST_NAME)):
                out.append(step)
        return sorted(out)

    def latest_step(self) -> int | None:
        try:
            return CheckpointRoot.step_of(self.fs.cat_file(self._join(LATEST_NAME)).decode("utf-8", "replace").strip())
        except FileNotFoundError:
            return None

    def promote(self, path: str, step: int, keep: int, files=None) -> None:
        name = CheckpointRoot.dir_name(step)
        target = self._join(name)
        if self.fs.exists(self._join(name, MANIFEST_NAME)):
            if self.fs.cat_file(self._join(name, MANIFEST_NAME)) == _manifest(path):
                return
            self.fs.rm_file(self._join(name, MANIFEST_NAME))  # an abandoned run's: uncommitted, then replaced
        files = [f for f in (committed_files(path) if files is None else files) if f != MANIFEST_NAME]
        self.fs.makedirs(target, exist_ok=True)
        for f in files + [MANIFEST_NAME]:  # the manifest last: it commits the folder
            self.fs.put_file(os.path.join(path, f), self._join(name, f))
        self.fs.pipe_file(self._join(LATEST_NAME), name.encode())
        steps = self.steps()
        later = [s for s in steps if s > step]  # an abandoned run's (tier 1 discarded them too)
        kept = [s for s in steps if s <= step]
        for old in later + (kept[:-keep] if keep else []):
            if old != step:
                self.fs.rm_file(self._join(CheckpointRoot.dir_name(old), MANIFEST_NAME))  # uncommit first
                self.fs.rm(self._join(CheckpointRoot.dir_name(old)), recursive=True)

    def manifest_text(self, step: int) -> bytes:
        """The committed manifest of ``step``."""
        return self.fs.cat_file(self._join(CheckpointRoot.dir_name(step), MANIFEST_NAME))

    def get(self, step: int, name: str, dst: str) -> int:
        """Download one file of checkpoint ``step`` to the path ``dst``; returns its size."""
        self.fs.get_file(self._join(CheckpointRoot.dir_name(step), name), dst)
        return os.path.getsize(dst)

    def fetch(self, step: int | None, dst: str) -> str:
        """Download checkpoint ``step`` (default: the tier's ``latest``) into the new folder ``dst``."""
        step = self.latest_step() if step is None else step
        if step is None or step not in self.steps():
            raise UclError(f"tier {self.url} holds no committed checkpoint"
                           f"{'' if step is None else f' of step {step}'}", code="UCL430")
        name = CheckpointRoot.dir_name(step)
        with staged_dir(dst) as folder:
            for remote in self.fs.ls(self._join(name), detail=False):
                self.fs.get_file(remote, os.path.join(folder, remote.rstrip("/").rsplit("/", 1)[-1]))
        return dst


def open_tier(tier: Any) -> CheckpointRoot | RemoteTier:
    """A directory tier, or an fsspec one for a URL (``scheme://...``)."""
    return RemoteTier.open(tier) if "://" in os.fspath(tier) else CheckpointRoot(tier)


def promote_to(tier: CheckpointRoot | RemoteTier, path: str, step: int, keep: int, files=None) -> None:
    if isinstance(tier, RemoteTier):
        tier.promote(path, step, keep, files)
    else:
        promote(path, tier, step, keep, files)


def latest_of(tier: CheckpointRoot | RemoteTier) -> int | None:
    """The tier's ``latest`` step (None: none yet, or a pointer that cannot be read)."""
    try:
        return tier.latest_step()
    except (OSError, UclError):
        return None


def describe(tier: CheckpointRoot | RemoteTier) -> str:
    return tier.url if isinstance(tier, RemoteTier) else tier.root
