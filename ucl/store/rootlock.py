"""The root lock: one writer at a time changes a checkpoint root (a ``Checkpointer``, a ``ucl.save``
into it, ``ucl gc`` while it collects). Readers never take it and never change the root.

``ROOT/.ucl-root.lock`` holds the lock: its holder keeps an exclusive ``flock`` on it for as long as
it holds the root and writes who it is into it (host, pid, when, what). The kernel drops the lock when
the holder dies, even under ``kill -9``, so a dead holder is never waited for; on NFS, Linux turns
``flock`` into a lock the server arbitrates between hosts. The file is never removed: unlinking a
lock file lets two processes lock two different files. Where the file system has no locks at all,
the file's content is the lease: a holder on this host whose process is gone (its pid, and the
process start time against a reused pid) is replaced, one on another host is named in the error.

A process never opens the lock file of a root it holds a second time (a registry says which it
holds): on NFS the lock is a POSIX lock, which closing *any* descriptor of the file would drop.
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
import threading
import time

try:
    import fcntl
except ImportError:  # no flock (Windows): the lease alone
    fcntl = None  # type: ignore[assignment]

from ..errors import StoreError


ROOT_LOCK_NAME = ".ucl-root.lock"
GRACE_S = 2.0  # a writer waits this long for a short holder (``ucl gc`` scanning) before refusing
_NO_LOCKS = (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL, errno.EBADF)
_BUSY = (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)

_held: dict[str, "RootLock"] = {}  # root -> this process's lock on it
_held_lock = threading.Lock()


def _hostname() -> str:
    import socket  # (2 ms of import, paid only by a run that takes or inspects a root lock)
    return socket.gethostname()


def _proc_start(pid: int) -> str:
    """The start time of process ``pid`` in clock ticks since boot (Linux), "" where unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[19].decode()
    except (OSError, IndexError):
        return ""


def _alive(pid: int, start: str) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        pass
    return not start or not _proc_start(pid) or _proc_start(pid) == start


def holder_text(info: dict) -> str:
    """``Checkpointer, pid 12 on host n1, since 2024-05-01 10:00:00`` from a lock file's content."""
    if not info:
        return "a writer that has not said who it is yet"
    since = info.get("since")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since)) if isinstance(since, (int, float)) else "?"
    return f"{info.get('role', 'a writer')}, pid {info.get('pid', '?')} on host {info.get('host', '?')}, since {when}"


def _read_info(fd: int) -> dict:
    try:
        raw = os.pread(fd, 4096, 0)
        info = json.loads(raw.decode("utf-8")) if raw.strip() else {}
        return info if isinstance(info, dict) else {}
    except (OSError, ValueError):
        return {}


def _open(path: str, create: bool) -> int | None:
    flags = os.O_RDWR | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | (os.O_CREAT if create else 0)
    try:
        try:
            fd = os.open(path, flags, 0o644)
        except PermissionError:  # another user's root: a local flock works read-only
            if create and not os.path.lexists(path):
                raise
            fd = os.open(path, flags & ~os.O_RDWR & ~os.O_CREAT | os.O_RDONLY)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise StoreError(f"{path} is a symlink; a root's lock file must be a regular file", code="UCL414") from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise StoreError(f"{path} is not a regular file; a root's lock file must be one", code="UCL414")
    return fd


class RootLock:
    """This process's hold on a checkpoint root; :meth:`release` (or process exit) lets it go."""

    def __init__(self, root: str, fd: int, lease: bool, role: str, since: float):
        self.root, self._fd, self._lease, self.role, self.since = root, fd, lease, role, since

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        with _held_lock:
            fd, self._fd = self._fd, None
            if _held.get(self.root) is self:
                del _held[self.root]
        if fd is None:
            return
        try:
            if self._lease:  # no kernel lock: an empty lease is a free one
                os.ftruncate(fd, 0)
        except OSError:
            pass
        os.close(fd)

    def __del__(self) -> None:
        try:
            self.release()
        except Exception:
            pass


def acquire(root: str | os.PathLike[str], role: str, *, wait_s: float = GRACE_S) -> RootLock:
    """Hold ``root`` (created if missing) for ``role`` (shown to whoever is refused), or raise UCL414
    naming the holder: a live one in another process (waited for up to ``wait_s``), or this process."""
    got = try_acquire(root, role, create=True, wait_s=wait_s)
    if isinstance(got, RootLock):
        return got
    raise StoreError(f"checkpoint root {os.path.abspath(os.fspath(root))} is held by another writer "
                     f"({holder_text(got)}): one Checkpointer or ucl.save writes a root at a time; wait for it "
                     "to finish, stop it, or use another root", code="UCL414")


def try_acquire(root: str | os.PathLike[str], role: str, *, create: bool, wait_s: float = 0.0,
                probe: bool = False) -> RootLock | dict | None:
    """A ``RootLock``, or the holder's info (a dict, maybe empty) when a live writer holds ``root``, or
    None when ``create`` is false and the root has no lock file (a folder no writer ever locked).
    ``probe``: the caller lets the lock go at once and writes nothing into the file."""
    root = os.path.abspath(os.fspath(root))
    with _held_lock:
        mine = _held.get(root)
    if mine is not None and mine.held:
        return {"role": f"{mine.role} in this very process", "pid": os.getpid(), "host": _hostname(),
                "since": mine.since}
    if create:
        os.makedirs(root, exist_ok=True)
    fd = _open(os.path.join(root, ROOT_LOCK_NAME), create)
    if fd is None:
        return None
    deadline = time.monotonic() + wait_s
    try:
        while True:
            state = _lock(fd)
            if state != "busy":
                break
            if time.monotonic() >= deadline:
                info = _read_info(fd)
                os.close(fd)
                return info
            time.sleep(0.05)
        lease = state == "none"
        if lease:
            info = _read_info(fd)
            if info and not (info.get("host") == _hostname() and not _alive(int(info.get("pid", 0) or 0),
                                                                                     str(info.get("start", "")))):
                os.close(fd)
                return info
        since = time.time()
        if probe:
            return RootLock(root, fd, False, role, since)
        me = {"role": role, "pid": os.getpid(), "host": _hostname(), "since": since,
              "start": _proc_start(os.getpid())}
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
        except OSError:  # a read-only lock file (another user's root): the lock itself still holds
            pass
    except BaseException:
        os.close(fd)
        raise
    lock = RootLock(root, fd, lease, role, since)
    with _held_lock:
        _held[root] = lock
    return lock


def _lock(fd: int) -> str:
    """"ok" (locked), "busy" (another holds it) or "none" (the file system has no locks)."""
    if fcntl is None:
        return "none"
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return "ok"
    except OSError as e:
        if e.errno in _BUSY:
            return "busy"
        if e.errno in _NO_LOCKS:
            return "none"
        raise


def holder(root: str | os.PathLike[str]) -> dict | None:
    """Who holds ``root`` now (its info), or None when nobody does. Takes nothing: a probe that
    finds the lock free lets it go at once."""
    got = try_acquire(root, "probe", create=False, probe=True)
    if isinstance(got, RootLock):
        got.release()
        return None
    return got


@contextlib.contextmanager
def holding_parent(path: str | os.PathLike[str], role: str):
    """Hold the folder ``path`` is written into while the block runs, when that folder is a locked
    checkpoint root (it has a lock file); UCL414 when another writer holds it. A plain folder
    (no lock file) is not locked, and gets no lock file."""
    parent = os.path.dirname(os.path.abspath(os.fspath(path)))
    got = try_acquire(parent, role, create=False, wait_s=GRACE_S)
    if isinstance(got, dict):
        raise StoreError(f"cannot write {os.fspath(path)}: checkpoint root {parent} is held by another writer "
                         f"({holder_text(got)}); one writer changes a root at a time", code="UCL414")
    try:
        yield
    finally:
        if got is not None:
            got.release()
