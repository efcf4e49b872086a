"""Reading small files a user or a stranger hands us (manifests, configs, dims, specs, headers):
the one place that checks what a path really is before a byte is read.

Promises (docs/security.md): a path that is not a regular file (a FIFO, a device such as
``/dev/zero``, a folder) is refused without blocking; a file larger than the caller's cap is
refused before it is read into memory; with ``inside``, a path that resolves (through symlinks)
outside that folder is refused; JSON that nests too deeply or holds NaN is an error, not a ``RecursionError``.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import stat
from typing import Any, Callable, Iterator

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


@contextlib.contextmanager
def _regular_file(path: str, what: str, error: ErrorFactory,
                  follow: bool = True) -> Iterator[tuple[int, os.stat_result]]:
    """An open descriptor of the regular file ``path`` and its stat, taken on the descriptor (so
    what is checked is what is read). Opening never blocks (``O_NONBLOCK``: a FIFO cannot hang it);
    anything but a regular file, and every OSError, is ``error(message)``; so is a symbolic link
    where ``follow`` is False (``O_NOFOLLOW``)."""
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0)
    try:
        fd = os.open(path, flags if follow else flags | getattr(os, "O_NOFOLLOW", 0))
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
        yield fd, st
    except OSError as e:
        raise error(f"cannot read {what} {path}: {e.strerror or e}") from None
    finally:
        os.close(fd)


def _read_upto(fd: int, n: int) -> bytes:
    chunks, total = [], 0
    while total < n:
        piece = os.read(fd, min(1 << 20, n - total))
        if not piece:
            break
        chunks.append(piece)
        total += len(piece)
    return b"".join(chunks)


def read_bounded(path: str | os.PathLike[str], *, limit: int, what: str, error: ErrorFactory,
                 inside: str | os.PathLike[str] | None = None, follow: bool = True) -> bytes:
    """The bytes of the regular file ``path``, at most ``limit`` of them; anything else is
    ``error(message)``: a missing file, a folder, a FIFO or device, a file over the cap, a path
    resolving outside ``inside``, a symbolic link where ``follow`` is False."""
    path = os.fspath(path)
    if inside is not None:
        check_inside(path, inside, what, error)
    with _regular_file(path, what, error, follow) as (fd, st):
        if st.st_size > limit:
            raise error(f"{what} {path} is {st.st_size:,} bytes, more than the {limit:,} a {what} may have")
        data = _read_upto(fd, limit + 1)  # the file may grow after fstat: never read past the cap
        if len(data) > limit:
            raise error(f"{what} {path} is more than the {limit:,} bytes a {what} may have")
        return data


def read_prefix(path: str | os.PathLike[str], n: int, what: str, error: ErrorFactory) -> bytes:
    """The first ``n`` bytes (fewer if the file is shorter) of the regular file ``path``, with the
    checks of :func:`read_bounded`."""
    path = os.fspath(path)
    with _regular_file(path, what, error) as (fd, _):
        return _read_upto(fd, n)


def parse_json(data: str | bytes, what: str, error: ErrorFactory) -> Any:
    """JSON text as Python values; invalid UTF-8, invalid JSON, NaN/Infinity, a number too large for
    a float (``1e400``, which Python reads as infinity) and nesting too deep for the parser
    (``RecursionError``) are ``error(message)``."""
    def no_constants(name: str) -> Any:
        raise ValueError(f"{name} is not JSON")

    def finite(text: str) -> float:
        value = float(text)
        if value in (math.inf, -math.inf):
            raise ValueError(f"the number {text[:40]} is beyond a float's range")
        return value

    try:
        if isinstance(data, bytes):
            data = data.decode("utf-8")
        return json.loads(data, parse_constant=no_constants, parse_float=finite)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise error(f"{what} is not valid JSON: {e}") from None
