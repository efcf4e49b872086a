"""The on-disk cache of derived specs (``ucl.formats.hf.specs``): one JSON entry per key under
``$UCL_CACHE_DIR`` (default ``~/.cache/ucl``) ``/hf-specs/KEY.json``.

The key covers the config's fields and everything the derived spec depends on: the source of every
module of ``ucl.formats.hf`` (the drafter, its TP and dims rules, the saved-form tracer...), ucl's
version, and the torch and transformers versions; an upgrade of any of them drafts anew.

Entries are read and written by ``ucl.cache`` (hostile until checked: docs/security.md). What an
entry says is validated by the caller; a bad one is drafted again and rewritten, never an error.
"""
from __future__ import annotations

import hashlib
import json
from importlib import metadata
from pathlib import Path

from ...cache import read_entry, section_dir, write_entry

SECTION = "hf-specs"
MAX_ENTRY_BYTES = 64 << 20  # a big model's entry (its tensor names, its spec) is a few MB


def cache_dir() -> Path | None:
    """Where the entries live: ``$UCL_CACHE_DIR/hf-specs`` (default ``~/.cache/ucl/hf-specs``); None
    when the cache is off."""
    return section_dir(SECTION)


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


def read(entry_key: str) -> dict | None:
    """The JSON object stored under ``entry_key``, or None (``ucl.cache.read_entry``). Its contents
    are still to be validated."""
    return read_entry(SECTION, entry_key, MAX_ENTRY_BYTES)


def write(entry_key: str, doc: dict) -> None:
    """Store ``doc`` (a JSON object) under ``entry_key``; nothing happens where the folder cannot be
    used (a read-only home, a folder that is not ours: the in-process cache still holds it)."""
    write_entry(SECTION, entry_key, doc)
