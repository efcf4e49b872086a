"""The on-disk cache of derived specs (``ucl.formats.hf.specs``): one JSON entry per key under
``$UCL_CACHE_DIR`` (default ``~/.cache/ucl``) ``/hf-specs/KEY.json``.

The key covers the config's fields and everything the derived spec depends on: the source of every
module of ``ucl.formats.hf`` (the drafter, its TP and dims rules, the saved-form tracer...), ucl's
version, and the torch and transformers versions; an upgrade of any of them drafts anew.

Like every file ucl opens, an entry is hostile until checked (docs/security.md): the folder is used
only when it is ours and no one else can write in it (it is created 0700; otherwise the cache is
bypassed), an entry is read with a size cap and never through a link, a FIFO or a device, and
written to a fresh file (``O_EXCL | O_NOFOLLOW``, mode 0600) renamed into place. What an entry says
is validated by the caller; a bad one is drafted again and rewritten, never an error.
"""
from __future__ import annotations

import hashlib
import json
import os
import stat
from importlib import metadata
from pathlib import Path

from ...errors import StoreError
from ...files import read_bounded

MAX_ENTRY_BYTES = 64 << 20  # a big model's entry (its tensor names, its spec) is a few MB


def cache_dir() -> Path:
    """Where the entries live: ``$UCL_CACHE_DIR/hf-specs`` (default ``~/.cache/ucl/hf-specs``)."""
    root = os.environ.get("UCL_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "ucl")
    return Path(root) / "hf-specs"


def source_files() -> list[Path]:
    """The modules a derived spec depends on: every module of this package."""
    return sorted(Path(__file__).parent.glob("*.py"))


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def versions() -> list[str | None]:
    """What besides the config a derived spec depends on (no torch or transformers import)."""
    from ... import __version__
    code = hashlib.sha256()
    for path in source_files():
        code.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return [__version__, _version("torch"), _version("transformers"), code.hexdigest()]


def key(raw: dict) -> str:
    """The entry's key: the config's fields and :func:`versions`."""
    text = json.dumps([raw, versions()], sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _usable_dir(create: bool) -> Path | None:
    """The cache folder if it is ours and no one else can write in it (a looser one we own, left by an
    older ucl, is tightened to 0700); None otherwise, or when it cannot be made."""
    folder = cache_dir()
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


def read(entry_key: str) -> dict | None:
    """The JSON object stored under ``entry_key``, or None: no entry, an unusable folder, a link, a
    FIFO, an oversized or unparsable file. Its contents are still to be validated."""
    folder = _usable_dir(create=False)
    if folder is None:
        return None
    def error(message: str) -> StoreError:
        return StoreError(message, code="UCL401")
    try:
        data = read_bounded(folder / f"{entry_key}.json", limit=MAX_ENTRY_BYTES, what="spec cache entry",
                            error=error, follow=False)
        doc = json.loads(data.decode("utf-8"))
    except (StoreError, ValueError, RecursionError):
        return None
    return doc if isinstance(doc, dict) and doc.get("key") == entry_key else None


def write(entry_key: str, doc: dict) -> None:
    """Store ``doc`` (a JSON object) under ``entry_key``; nothing happens where the folder cannot be
    used (a read-only home, a folder that is not ours: the in-process cache still holds it)."""
    folder = _usable_dir(create=True)
    if folder is None:
        return
    data = json.dumps({**doc, "key": entry_key}).encode()
    tmp = folder / f".{entry_key}.{os.getpid()}.{os.urandom(4).hex()}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    except OSError:
        return
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, folder / f"{entry_key}.json")  # a link planted there is replaced, not followed
    except OSError:
        try:
            os.unlink(tmp)
        except OSError:
            pass
