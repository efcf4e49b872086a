"""Atomic publication: a checkpoint is written under a hidden temp name ``.<name>.tmp-<random>``
and becomes visible only through one ``rename`` after every byte is fsynced."""
from __future__ import annotations

import errno
import os
import re
import secrets
import shutil
import time

from ..errors import StoreError
from .manifest import MANIFEST_NAME

_TMP_RE = re.compile(r"^\..+\.tmp-[0-9a-z-]+$")


def tmp_name(final_name: str, tag: str = "") -> str:
    """Hidden sibling name for writing ``final_name``; readers and ``steps()`` skip it."""
    return f".{final_name}.tmp-{tag}{secrets.token_hex(6)}"


def is_tmp_name(name: str) -> bool:
    return bool(_TMP_RE.match(name))


def fsync_path(path: str) -> None:
    """fsync a file (or directory) by path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str) -> None:
    """fsync a directory so renames inside it are durable; some filesystems refuse, which is fine."""
    try:
        fsync_path(path)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF, errno.EACCES):
            raise


def write_atomic(path: str, data: bytes) -> None:
    """Replace ``path`` by ``data`` atomically: write a temp sibling, fsync, rename, fsync dir."""
    parent = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(parent, tmp_name(os.path.basename(path)))
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fsync_dir(parent)


def publish_dir(tmp: str, final: str) -> None:
    """Make a fully written temp directory visible as ``final`` (must not exist yet)."""
    fsync_dir(tmp)
    if os.path.lexists(final):  # rename() would silently replace an empty directory
        raise StoreError(f"cannot commit: {final} already exists", code="UCL405")
    os.rename(tmp, final)
    fsync_dir(os.path.dirname(os.path.abspath(final)))


def cleanup_stale(root: str, min_age_s: float = 0.0) -> list[str]:
    """Remove temp directories/files left in ``root`` by killed writers.

    Only entries matching the temp pattern and unmodified for ``min_age_s`` seconds
    are removed; pass a margin if other writers may be running. Returns removed paths.
    """
    removed = []
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return removed
    now = time.time()
    for name in sorted(names):
        if not is_tmp_name(name):
            continue
        p = os.path.join(root, name)
        try:
            if now - os.lstat(p).st_mtime < min_age_s:
                continue
            if os.path.isdir(p) and not os.path.islink(p):
                shutil.rmtree(p)
            else:
                os.unlink(p)
            removed.append(p)
        except FileNotFoundError:
            continue
    return removed


def is_committed(path: str) -> bool:
    """A committed checkpoint is a non-temp directory holding ``manifest.json``."""
    return not is_tmp_name(os.path.basename(os.path.normpath(path))) and \
        os.path.isfile(os.path.join(path, MANIFEST_NAME))
