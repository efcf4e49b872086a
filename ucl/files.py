"""Reading small files a user or a stranger hands us (manifests, configs, dims, specs, headers):
the one place that checks what a path really is before a byte is read.

Promises (docs/security.md): a path that is not a regular file (a FIFO, a device such as
``/dev/zero``, a folder) is refused without blocking; a file larger than the caller's cap is
refused before it is read into memory; with ``inside``, a path that resolves (through symlinks)
outside that folder is refused; JSON that nests too deeply or holds NaN is an error, not a ``RecursionError``.
"""
from __future__ import annotations

import json
import os
import stat
from typing import Any, Callable

from .errors import UclError

ErrorFactory = Callable[[str], UclError]


def resolves_inside(path: str | os.PathLike[str], folder: str | os.PathLike[str]) -> bool:
    """Whether ``path``, with every symlink resolved, lies inside ``folder`` (also resolved)."""
    real, root = os.path.realpath(path), os.path.realpath(folder)
    return real == root or real.startswith(root.rstrip(os.sep) + os.sep)


def check_inside(path: str | os.PathLike[str], folder: str | os.PathLike[str], what: str,
                 error: ErrorFactory) -> None:
    """Raise ``error(...)`` when ``path`` resolves outside ``folder`` (a symlink pointing away)."""
    if not resolves_inside(path, folder):
        raise error(f"{what} {os.fspath(path)} resolves to {os.path.realpath(path)}, outside "
                    f"{os.path.realpath(folder)}; links out of a checkpoint are never followed")


def read_bounded(path: str | os.PathLike[str], *, limit: int, what: str, error: ErrorFactory,
                 inside: str | os.PathLike[str] | None = None) -> bytes:
    """The bytes of the regular file ``path``, at most ``limit`` of them; anything else is
    ``error(message)``: a missing file, a folder, a FIFO or device, a file over the cap, a path
    resolving outside ``inside``. Opening never blocks (``O_NONBLOCK``) and the size is checked on
    the open descriptor, so what is checked is what is read."""
    path = os.fspath(path)
    if inside is not None:
        check_inside(path, inside, what, error)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0))
    except FileNotFoundError:
        raise error(f"{what} {path} does not exist") from None
    except IsADirectoryError:
        raise error(f"{what} {path} is a folder, not a file") from None
    except OSError as e:
        raise error(f"cannot open {what} {path}: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise error(f"{what} {path} is a folder, not a file")
        if not stat.S_ISREG(st.st_mode):
            raise error(f"{what} {path} is not a regular file (a pipe, socket or device); refusing to read it")
        if st.st_size > limit:
            raise error(f"{what} {path} is {st.st_size:,} bytes, more than the {limit:,} a {what} may have")
        chunks, total = [], 0
        while True:  # the file may grow after fstat: never read past the cap
            piece = os.read(fd, min(1 << 20, limit + 1 - total))
            if not piece:
                break
            chunks.append(piece)
            total += len(piece)
            if total > limit:
                raise error(f"{what} {path} is more than the {limit:,} bytes a {what} may have")
        return b"".join(chunks)
    except OSError as e:
        raise error(f"cannot read {what} {path}: {e.strerror or e}") from None
    finally:
        os.close(fd)


def parse_json(data: str | bytes, what: str, error: ErrorFactory) -> Any:
    """JSON text as Python values; invalid UTF-8, invalid JSON, NaN/Infinity and nesting too deep
    for the parser (``RecursionError``) are ``error(message)``."""
    def no_constants(name: str) -> Any:
        raise ValueError(f"{name} is not JSON")

    try:
        if isinstance(data, bytes):
            data = data.decode("utf-8")
        return json.loads(data, parse_constant=no_constants)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise error(f"{what} is not valid JSON: {e}") from None
