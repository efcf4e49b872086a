"""ucl's on-disk cache: one JSON entry per key under ``$UCL_CACHE_DIR`` (default ``~/.cache/ucl``)
``/SECTION/KEY.json``, for what is costly to derive and cheap to check (derived Hugging Face specs,
parsed spec text). ``UCL_CACHE_DIR=off`` turns it off: nothing is read or written.

Like every file ucl opens, an entry is hostile until checked (docs/security.md): a section's folder is
used only when it is ours and no one else can write in it (it is created 0700; otherwise the cache
is bypassed), an entry is read with a size cap and never through a link, a FIFO or a device, is
JSON (never a pickle: reading one runs no code), and is written to a fresh file (``O_EXCL |
O_NOFOLLOW``, mode 0600) renamed into place. What an entry says is validated by the caller; a bad
one is derived again and rewritten, never an error.
"""
from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from .errors import StoreError
from .files import read_bounded

OFF = "off"  # UCL_CACHE_DIR=off: no cache


def cache_root() -> Path | None:
    """``$UCL_CACHE_DIR`` (default ``~/.cache/ucl``); None when it is ``off``."""
    root = os.environ.get("UCL_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "ucl")
    return None if root == OFF else Path(root)


def section_dir(section: str) -> Path | None:
    """Where ``section``'s entries live (None: the cache is off)."""
    root = cache_root()
    return None if root is None else root / section


def _usable_dir(section: str, create: bool) -> Path | None:
    """The section's folder if it is ours and no one else can write in it (a looser one we own, left
    by an older ucl, is tightened to 0700); None otherwise, or when it cannot be made."""
    folder = section_dir(section)
    if folder is None:
        return None
    try:
        if create:
            os.makedirs(folder.parent, mode=0o700, exist_ok=True)
            try:
                os.mkdir(folder, 0o700)
            except FileExistsError:
                pass
        st = os.lstat(folder)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
            return None  # a link, not ours, or writable by others: what it holds cannot be trusted
        if stat.S_IMODE(st.st_mode) != 0o700:
            os.chmod(folder, 0o700, follow_symlinks=False)
        return folder
    except (OSError, NotImplementedError):
        return None


def read_entry(section: str, key: str, limit: int) -> dict | None:
    """The JSON object stored under ``key``, or None: no entry, an unusable folder, a link, a FIFO,
    a file over ``limit`` bytes or unparsable, one stored under another key. Its contents are
    still to be validated."""
    folder = _usable_dir(section, create=False)
    if folder is None:
        return None
    def error(message: str) -> StoreError:
        return StoreError(message, code="UCL401")
    try:
        data = read_bounded(folder / f"{key}.json", limit=limit, what="cache entry", error=error, follow=False)
        doc = json.loads(data.decode("utf-8"))
    except (StoreError, ValueError, RecursionError):
        return None
    return doc if isinstance(doc, dict) and doc.get("key") == key else None


def write_entry(section: str, key: str, doc: dict) -> None:
    """Store ``doc`` (a JSON object) under ``key``; nothing happens where the folder cannot be used
    (the cache is off, a read-only home, a folder that is not ours)."""
    folder = _usable_dir(section, create=True)
    if folder is None:
        return
    data = json.dumps({**doc, "key": key}, separators=(",", ":")).encode()
    tmp = folder / f".{key}.{os.getpid()}.{os.urandom(4).hex()}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    except OSError:
        return
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, folder / f"{key}.json")  # a link planted there is replaced, not followed
    except OSError:
        try:
            os.unlink(tmp)
        except OSError:
            pass
