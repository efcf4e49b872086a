"""Atomic publication: a checkpoint is written under a hidden temp name ``.<name>.tmp-<random>``
and becomes visible only through one ``rename`` after every byte is fsynced.

A writer's temp directory holds a lock file (:data:`LOCK_NAME`) on which the writer keeps an
exclusive ``flock`` for as long as it lives; the kernel drops the lock when the process dies, even
under ``kill -9``. So a temp directory whose lock can be taken is a dead writer's leftovers, and one
whose lock cannot is in use: :func:`collect_garbage` (``ucl gc``) removes the first kind only.
"""
from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import stat
import time
from dataclasses import dataclass

try:
    import fcntl
except ImportError:  # no flock (Windows): every temp directory counts as one without a lock
    fcntl = None  # type: ignore[assignment]

from ..errors import StoreError
from .manifest import MANIFEST_NAME
from .rootlock import RootLock, holder_text, try_acquire

_TMP_RE = re.compile(r"^\..+\.tmp-[0-9a-z-]+$")
LOCK_NAME = ".ucl-writer.lock"
DOOMED_TAG = "del-"  # a folder renamed out of sight to be deleted (pruning): removable once its writer is gone
SET_ASIDE_TAG = "old-"  # a committed checkpoint a re-save set aside: never collected (CheckpointRoot.recover)
NEW_TAG = "new-"  # a writer's temp folder before its lock file is in place: collected only once dead or an hour old
STALE_AGE_S = 3600.0  # a temp entry without a lock file counts as abandoned after this long untouched


def tmp_name(final_name: str, tag: str = "") -> str:
    """Hidden sibling name for writing ``final_name``; readers and ``steps()`` skip it."""
    return f".{final_name}.tmp-{tag}{os.urandom(6).hex()}"


def is_tmp_name(name: str) -> bool:
    return bool(_TMP_RE.match(name))


def final_name_of(tmp: str) -> str:
    """``NAME`` of a temp name ``.NAME.tmp-...``."""
    return tmp[1:tmp.rindex(".tmp-")]


def tag_of(tmp: str) -> str:
    """What follows ``.tmp-`` in a temp name: the tag (``del-``, ``old-``) and the random part."""
    return tmp[tmp.rindex(".tmp-") + 5:]


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
    """Make a fully written temp directory visible as ``final`` (must not exist yet). Its lock file
    travels with it and goes only after the rename: until then ``ucl gc`` finds the folder locked by a
    live writer, whatever its age and with ``--force`` too (the writer holds the lock until after
    this returns)."""
    fsync_dir(tmp)
    if os.path.lexists(final):  # rename() would silently replace an empty directory
        raise StoreError(f"cannot commit: {final} already exists", code="UCL405")
    os.rename(tmp, final)
    fsync_dir(os.path.dirname(os.path.abspath(final)))
    drop_lock_file(final)


def drop_lock_file(folder: str) -> None:
    """Remove a published folder's writer lock file (a kill before this leaves it there: readers and
    copies ignore it)."""
    try:
        os.unlink(os.path.join(folder, LOCK_NAME))
    except FileNotFoundError:
        pass


_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100


def _renameat2():
    import ctypes
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


def exchange_dirs(a: str, b: str) -> bool:
    """Swap two existing paths in one atomic step (Linux ``renameat2(RENAME_EXCHANGE)``): neither name
    is ever missing. False (nothing done) where the platform or the file system cannot (NFS, Lustre,
    macOS): the caller falls back to two renames."""
    import ctypes
    fn = _renameat2() if hasattr(os, "uname") and os.uname().sysname == "Linux" else None
    if fn is None:
        return False
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), a)


# ---- the writer's side: a locked temp directory ----------------------------------------------------

class TempDir:
    """A writer's hidden temp directory beside ``final``, locked for as long as this object (and the
    process) lives. Creating one first removes dead writers' leftovers of the same name."""

    def __init__(self, final: str):
        final = os.path.abspath(final)
        parent, name = os.path.split(final)
        os.makedirs(parent, exist_ok=True)
        _remove_dead(parent, name)
        self.path = os.path.join(parent, tmp_name(name))
        self._fd: int | None = None
        # born under a NEW_TAG name and renamed once its lock file is in place: gc never sees this
        # directory without a lock file under a name it would take for an abandoned one
        born = os.path.join(parent, tmp_name(name, NEW_TAG))
        os.mkdir(born)
        try:
            self._fd = _hold_lock(born)
            os.rename(born, self.path)
        except BaseException:
            shutil.rmtree(born, ignore_errors=True)
            self.release()
            raise

    def discard(self) -> None:
        """Remove the directory and everything in it, then let the lock go."""
        shutil.rmtree(self.path, ignore_errors=True)
        self.release()

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def __del__(self) -> None:  # a writer dropped without commit or abort: do not leak the descriptor
        try:
            self.release()
        except Exception:
            pass


@contextlib.contextmanager
def staged_dir(final: str, publish=None):
    """A locked temp folder beside ``final`` (yields its path) that becomes ``final`` by one atomic
    rename (or ``publish(tmp, final)``) when the block ends without error, and is removed when it
    raises: ``final`` appears whole or not at all."""
    tmp = TempDir(final)
    try:
        yield tmp.path
        (publish or publish_dir)(tmp.path, final)
    except BaseException:
        tmp.discard()
        raise
    tmp.release()


def _hold_lock(folder: str) -> int | None:
    """Create ``folder/LOCK_NAME`` already locked: it is made and locked under another name and renamed
    into place, so a lock file that can be seen is never one its writer has not locked yet. The
    descriptor is inherited by forked children (reshard workers), which keep the directory in use."""
    if fcntl is None:
        return None
    init = os.path.join(folder, LOCK_NAME + ".init")
    fd = os.open(init, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL, errno.EBADF):
                raise
            # no locks on this filesystem: gc cannot take the lock either and falls back to the age rule
        os.write(fd, f"{os.getpid()} {os.uname().nodename}\n".encode())
        os.rename(init, os.path.join(folder, LOCK_NAME))
    except BaseException:
        os.close(fd)
        raise
    return fd


# ---- the collector's side: which temp entries are dead ---------------------------------------------

@dataclass(frozen=True)
class Leftover:
    """A temp entry found by :func:`collect_garbage`.

    ``state`` is ``dead`` (its writer's lock is free: the writer is gone), ``in use`` (a live writer
    holds the lock), ``stale`` (no lock file, untouched for ``max_age_s``), ``recent`` (no lock file,
    touched more recently), ``root held`` (no lock file, in a root a live writer holds: its own;
    ``owner`` names that writer), ``set aside`` (a committed checkpoint a killed re-save set aside:
    the root's next writer puts it back), ``link`` (a symlink: never followed, never removed) or
    ``unknown`` (it could not be examined). ``nbytes`` is the disk space it takes, ``owner`` the ``pid host`` its
    writer recorded, ``removed`` whether it was removed, ``error`` why examining or removing it failed."""

    path: str
    state: str
    nbytes: int
    owner: str = ""
    removed: bool = False
    error: str = ""

    @property
    def removable(self) -> bool:
        return self.state in ("dead", "stale")


def _usage(path: str) -> tuple[int, float]:
    """(bytes on disk, newest mtime) of ``path`` and everything under it, links not followed. A writer
    without a lock file touches a file's mtime as it writes it, not its folder's."""
    st = os.lstat(path)
    total, newest = _blocks(st), st.st_mtime
    if stat.S_ISDIR(st.st_mode):
        for top, dirs, files in os.walk(path, followlinks=False):
            for n in dirs + files:
                try:
                    s = os.lstat(os.path.join(top, n))
                except FileNotFoundError:
                    continue
                total += _blocks(s)
                newest = max(newest, s.st_mtime)
    return total, newest


def _blocks(st: os.stat_result) -> int:
    return st.st_blocks * 512 if hasattr(st, "st_blocks") else st.st_size


def _try_lock(folder: str) -> tuple[str, int | None, str]:
    """("dead", fd holding the lock, owner) | ("in use", None, owner) | ("none", None, "") when there is
    no usable lock file (none at all, a link, unreadable, or a filesystem without locks)."""
    if fcntl is None:
        return "none", None, ""
    path = os.path.join(folder, LOCK_NAME)
    flags = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        try:
            fd = os.open(path, os.O_RDWR | flags)  # NFS's flock emulation needs write access
        except PermissionError:  # another user's lock file: a local flock works read-only
            fd = os.open(path, os.O_RDONLY | flags)
    except OSError:
        return "none", None, ""
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # a FIFO or device planted under the name
            os.close(fd)
            return "none", None, ""
        owner = os.read(fd, 200).decode("utf-8", "replace").strip()
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                return "in use", None, owner
            return "none", None, owner
        # the writer unlinks its lock file just before publishing: the file we locked must still be there
        if os.fstat(fd).st_ino != os.lstat(path).st_ino:
            os.close(fd)
            return "in use", None, owner
        return "dead", fd, owner
    except BaseException:
        try:
            os.close(fd)
        except OSError:
            pass
        raise


def _check(path: str, now: float, max_age_s: float) -> tuple[Leftover, int | None, float]:
    """What ``path`` is, (for a dead writer's directory) the descriptor holding its lock, to be closed
    only after the directory is gone, and when anything in it last changed."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        return Leftover(path, "link", 0), None, now
    nbytes, newest = _usage(path)
    state, fd, owner = _try_lock(path) if stat.S_ISDIR(st.st_mode) else ("none", None, "")
    if state == "none":
        state = "stale" if now - newest >= max_age_s else "recent"
    return Leftover(path, state, nbytes, owner), fd, newest


def _remove(path: str) -> None:
    """Remove a temp entry without following links: ``rmtree`` refuses a link and does not descend into
    the links inside (it works on directory descriptors where the platform allows)."""
    if stat.S_ISDIR(os.lstat(path).st_mode):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def _scan(folder: str, name: str | None, max_age_s: float, force: bool, dry_run: bool,
          root_holder: str = "") -> list[Leftover]:
    """``root_holder``: the live writer holding ``folder`` as a checkpoint root; the entries without a
    lock file are then its own (a ``latest`` being replaced, a checkpoint being re-saved) and stay."""
    out = []
    now = time.time()
    try:
        names = sorted(os.listdir(folder))
    except FileNotFoundError:
        return out
    for n in names:
        if not is_tmp_name(n) or (name is not None and final_name_of(n) != name):
            continue
        p = os.path.join(folder, n)
        fd = None
        try:
            if tag_of(n).startswith(SET_ASIDE_TAG):
                out.append(Leftover(p, "set aside", _usage(p)[0]))
                continue
            entry, fd, newest = _check(p, now, max_age_s)
            if tag_of(n).startswith(NEW_TAG) and entry.state in ("stale", "recent"):  # a writer being born
                entry = Leftover(p, "stale" if now - newest >= STALE_AGE_S else "in use", entry.nbytes)
            if root_holder and entry.state in ("stale", "recent"):
                entry = Leftover(p, "root held", entry.nbytes, root_holder)
            go = entry.removable or (force and entry.state == "recent")
            if go and not dry_run:
                try:
                    _remove(p)
                    entry = Leftover(p, entry.state, entry.nbytes, entry.owner, removed=True)
                except FileNotFoundError:
                    continue  # removed (or published) meanwhile
                except OSError as e:
                    entry = Leftover(p, entry.state, entry.nbytes, entry.owner, error=str(e))
            out.append(entry)
        except FileNotFoundError:
            continue
        except OSError as e:  # e.g. a folder inside it we may not read: report it, go on with the rest
            out.append(Leftover(p, "unknown", 0, error=str(e)))
        finally:
            if fd is not None:
                os.close(fd)
    return out


def collect_garbage(folder: str | os.PathLike[str], *, dry_run: bool = False, max_age_s: float = STALE_AGE_S,
                    force: bool = False) -> list[Leftover]:
    """Remove the temp entries (``.NAME.tmp-*``) directly in ``folder`` that killed writers left:
    directories whose writer's lock is free, and entries without a lock file (written by ucl before
    lock files, or by a plain copy) untouched for ``max_age_s`` seconds, or whatever their age with
    ``force``. A directory a live writer holds is never removed, nor anything through a symlink, nor
    (in a checkpoint root a live writer holds: ``store.rootlock``) an entry without a lock file, nor a
    checkpoint set aside by a re-save. A root nobody holds is held while it is collected.
    ``dry_run`` removes nothing. Returns every temp entry found, with what happened to it."""
    folder = os.path.abspath(os.fspath(folder))
    if not os.path.exists(folder):
        raise StoreError(f"{folder} does not exist", code="UCL404")
    if not os.path.isdir(folder):
        raise StoreError(f"{folder} is a file: pass the folder holding checkpoints (or a reshard's target)",
                         code="UCL401")
    if not isinstance(max_age_s, (int, float)) or isinstance(max_age_s, bool) or max_age_s < 0:
        raise StoreError(f"max_age_s must be a non-negative number, got {max_age_s!r}", code="UCL413")
    got = try_acquire(folder, "ucl gc", create=False, probe=dry_run)
    try:
        held = holder_text(got) if isinstance(got, dict) else ""
        return _scan(folder, None, float(max_age_s), force, dry_run, held)
    finally:
        if isinstance(got, RootLock):
            got.release()


def _remove_dead(parent: str, name: str) -> None:
    """Before writing ``parent/name``: remove dead writers' temp directories of that name (never a
    checkpoint set aside by a re-save). Best effort; a failure here must not stop the write."""
    try:
        _scan(parent, name, STALE_AGE_S, False, False)
    except OSError:
        pass


def cleanup_stale(root: str, min_age_s: float = 0.0) -> list[str]:
    """Remove temp directories/files left in ``root`` by killed writers.

    Only entries matching the temp pattern and untouched for ``min_age_s`` seconds are removed, and
    never a directory whose writer is alive (it holds its lock), nor a checkpoint set aside by a
    re-save (``CheckpointRoot.recover``). Only the root's holder calls it: entries without a lock
    file are taken for dead. Returns removed paths.
    """
    now = time.time()
    removed = []
    try:
        names = sorted(os.listdir(root))
    except FileNotFoundError:
        return removed
    for n in names:
        if not is_tmp_name(n) or tag_of(n).startswith(SET_ASIDE_TAG):
            continue
        p = os.path.join(root, n)
        fd = None
        try:
            entry, fd, newest = _check(p, now, min_age_s)
            if entry.state == "dead" and now - newest < min_age_s:
                continue
            if tag_of(n).startswith(NEW_TAG) and entry.state == "stale" and now - newest < STALE_AGE_S:
                continue  # a writer being born
            if entry.state in ("dead", "stale"):
                _remove(p)
                removed.append(p)
        except FileNotFoundError:
            continue
        finally:
            if fd is not None:
                os.close(fd)
    return removed


def is_committed(path: str) -> bool:
    """A committed checkpoint is a non-temp directory holding ``manifest.json``."""
    return not is_tmp_name(os.path.basename(os.path.normpath(path))) and \
        os.path.isfile(os.path.join(path, MANIFEST_NAME))
