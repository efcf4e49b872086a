"""Nothing left behind: ``ucl gc`` removes the temp directories of killed writers and never a live
writer's; the next write of a checkpoint clears dead leftovers of its name; reshard workers die with
their parent; a full disk is one UCL410 and not a word more on stderr."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import ucl
import ucl.cli
from ucl.demo import llama_model, universal_state
from ucl.errors import StoreError
from ucl.store import CheckpointRoot, CheckpointWriter, cleanup_stale
from ucl.store.atomic import LOCK_NAME, TempDir, collect_garbage, is_tmp_name

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), COLUMNS="200")
LINUX = sys.platform.startswith("linux") and os.path.isdir("/proc/self")

# a writer that writes a little and then dies by SIGKILL, as a crashed or OOM-killed job does
KILLED = """
import os, signal, sys
import numpy as np
from ucl.store import CheckpointWriter
w = CheckpointWriter(sys.argv[1], 2, mesh=[("dp", 2)])
for r in range(2):
    w.write(r, "param/w", np.ones((64, 64), np.float32))
print(w.tmp_path, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def _killed_writer(path) -> str:
    """The temp directory a writer of ``path`` left when it was killed."""
    p = subprocess.run([sys.executable, "-c", KILLED, str(path)], env=ENV, capture_output=True, text=True, timeout=60)
    assert p.returncode == -signal.SIGKILL, p.stderr
    tmp = p.stdout.strip()
    assert os.path.isdir(tmp) and os.path.isfile(os.path.join(tmp, LOCK_NAME))
    return tmp


def _age(path, seconds: float) -> None:
    """Make ``path`` and everything in it look untouched for ``seconds``."""
    when = time.time() - seconds
    for top, dirs, files in os.walk(path):
        for n in dirs + files:
            os.utime(os.path.join(top, n), (when, when), follow_symlinks=False)
    os.utime(path, (when, when), follow_symlinks=False)


def _tmp_entries(folder) -> list[str]:
    return sorted(n for n in os.listdir(folder) if is_tmp_name(n))


# ---------------------------------------------------------------- gc: dead vs live writers

def test_gc_removes_a_killed_writers_temp_dir_and_spares_a_live_one(tmp_path):
    root = CheckpointRoot(tmp_path / "run")
    dead = _killed_writer(root.path_for(1))
    with root.writer(2, 1) as live:  # this process: alive, holding its lock
        live.write(0, "param/w", np.arange(10, dtype=np.float32))
        found = {os.path.basename(e.path): e for e in root.gc()}
        assert found[os.path.basename(dead)].state == "dead" and found[os.path.basename(dead)].removed
        assert found[os.path.basename(dead)].nbytes >= 2 * 64 * 64 * 4
        mine = found[os.path.basename(live.tmp_path)]
        assert (mine.state, mine.removed) == ("in use", False) and mine.owner.startswith(f"{os.getpid()} ")
        assert not os.path.exists(dead) and os.path.isdir(live.tmp_path)
        live.commit()  # the concurrent save was not broken
    assert root.steps() == [2] and _tmp_entries(root.root) == []
    with ucl.open(root.path_for(2)) as c:
        assert c.verify() == [] and LOCK_NAME not in os.listdir(root.path_for(2))


def test_gc_dry_run_lists_and_removes_nothing(tmp_path, capsys):
    dead = _killed_writer(tmp_path / "target")
    entries = collect_garbage(tmp_path, dry_run=True)
    assert [(e.path, e.state, e.removed) for e in entries] == [(dead, "dead", False)]
    rc = ucl.cli.main(["gc", str(tmp_path), "--dry-run"])
    out = capsys.readouterr().out
    assert rc == 0 and "would remove" in out and "would free" in out and os.path.isdir(dead)
    rc = ucl.cli.main(["gc", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0 and "removed" in out and "(pid " in out and "is gone" in out and "freed" in out
    assert os.listdir(tmp_path) == []


def test_gc_on_a_folder_without_temp_entries_and_bad_roots(tmp_path, capsys):
    (tmp_path / "keep").mkdir()
    (tmp_path / ".hidden").mkdir()
    assert collect_garbage(tmp_path) == []
    assert sorted(os.listdir(tmp_path)) == [".hidden", "keep"]
    for bad, code in [(tmp_path / "nope", "UCL404"), (tmp_path / "keep" / "f", "UCL401")]:
        if code == "UCL401":
            bad.write_text("x")
        with pytest.raises(StoreError) as e:
            collect_garbage(bad)
        assert e.value.code == code
        assert ucl.cli.main(["gc", str(bad)]) == 1
        err = capsys.readouterr().err
        assert err.startswith("ucl: ") and "Traceback" not in err


def test_temp_entries_without_a_lock_file_go_by_age_or_force(tmp_path):
    legacy = tmp_path / ".ck.tmp-0123456789ab"  # written by a ucl from before lock files
    legacy.mkdir()
    (legacy / "rank_00000.h5").write_bytes(b"x" * 5000)
    stray = tmp_path / ".latest.tmp-abcdef012345"  # a write_atomic temp file
    stray.write_bytes(b"ck\n")
    assert {e.state for e in collect_garbage(tmp_path)} == {"recent"} and len(_tmp_entries(tmp_path)) == 2
    _age(legacy, 7200)
    got = {os.path.basename(e.path): (e.state, e.removed) for e in collect_garbage(tmp_path)}
    assert got == {legacy.name: ("stale", True), stray.name: ("recent", False)}
    assert [e.state for e in collect_garbage(tmp_path, force=True)] == ["recent"]
    assert os.listdir(tmp_path) == []


def test_gc_never_follows_symlinks(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious").write_text("keep me")
    root = tmp_path / "root"
    root.mkdir()
    os.symlink(outside, root / ".ck.tmp-0123456789ab")  # a temp name pointing out of the root
    dead = _killed_writer(root / "other")
    os.symlink(outside, os.path.join(dead, "escape"))  # a link inside a dead writer's directory
    _age(root / ".ck.tmp-0123456789ab", 7200)
    got = {os.path.basename(e.path): (e.state, e.removed) for e in collect_garbage(root, force=True)}
    assert got == {".ck.tmp-0123456789ab": ("link", False), os.path.basename(dead): ("dead", True)}
    assert (outside / "precious").read_text() == "keep me"
    assert os.path.islink(root / ".ck.tmp-0123456789ab") and not os.path.exists(dead)


def test_cleanup_stale_spares_a_live_writer(tmp_path):
    root = CheckpointRoot(tmp_path)
    dead = _killed_writer(root.path_for(1))
    with root.writer(2, 1) as w:
        w.write(0, "param/w", np.zeros(3, np.float32))
        assert cleanup_stale(root.root) == [dead]
        assert os.path.isdir(w.tmp_path)
        w.commit()
    assert root.steps() == [2]


# ---------------------------------------------------------------- the next write cleans its own name

def test_next_write_removes_dead_leftovers_of_its_name_only(tmp_path):
    dead = _killed_writer(tmp_path / "ck")
    other = _killed_writer(tmp_path / "other")
    old_legacy = tmp_path / ".ck.tmp-0123456789ab"
    old_legacy.mkdir()
    _age(old_legacy, 7200)
    new_legacy = tmp_path / ".ck.tmp-ba9876543210"
    new_legacy.mkdir()
    aside = tmp_path / ".ck.tmp-old-0123456789ab"  # a checkpoint set aside while it is written anew
    aside.mkdir()
    _age(aside, 7200)
    with CheckpointWriter(tmp_path / "ck", 1) as live:  # a live writer of the same name, then another one
        live.write(0, "param/w", np.zeros(3, np.float32))
        with CheckpointWriter(tmp_path / "ck2", 1) as unrelated:
            unrelated.write(0, "param/w", np.zeros(3, np.float32))
            unrelated.commit()
        left = set(_tmp_entries(tmp_path))
        assert os.path.basename(dead) not in left and old_legacy.name not in left
        assert {os.path.basename(other), new_legacy.name, aside.name, os.path.basename(live.tmp_path)} <= left
        second = TempDir(str(tmp_path / "ck"))  # what a second writer of ck creates: it spares the live one
        assert os.path.isdir(live.tmp_path)
        second.discard()
        live.commit()
    assert os.path.isdir(tmp_path / "ck")


# ---------------------------------------------------------------- reshard workers die with their parent

SLOW_RESHARD = """
import os, sys, time
import ucl.store.writer as w
if sys.argv[1] == "watchdog":
    sys.platform = "portable"  # no prctl: the workers rely on the parent watch alone
marker = sys.argv[2]
real = w.CheckpointWriter.write
def slow(self, *a, **k):
    real(self, *a, **k)
    open(marker + ".%d" % os.getpid(), "w").close()
    time.sleep(0.2)
w.CheckpointWriter.write = slow
from ucl.cli import main
sys.exit(main(sys.argv[3:]))
"""


def _children(pid: int) -> list[int]:
    out = []
    for n in os.listdir("/proc"):
        if n.isdigit():
            try:
                with open(f"/proc/{n}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(n))
    return out


def _alive(pid: int) -> bool:
    """Any thread of ``pid`` still running. A zombie nobody reaped yet counts as gone (it holds no files
    or locks), but only once every thread has exited: the main thread turns zombie first."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return False
    for t in tasks:
        try:
            with open(f"/proc/{pid}/task/{t}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X"):
                    return True
        except OSError:
            continue
    return False


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    model = llama_model()
    mesh = ucl.Mesh.parse("tp=2")
    shards = ucl.execute_memory(ucl.compile(model, ucl.UNIVERSAL, mesh), {0: universal_state(model, seed=0)})
    return ucl.save(tmp_path_factory.mktemp("src") / "src", shards, model=model, mesh=mesh)


@pytest.mark.skipif(not LINUX, reason="needs /proc to find the workers")
@pytest.mark.parametrize("how", ["prctl", "watchdog"])
def test_reshard_workers_die_when_the_parent_is_killed(source, tmp_path, how):
    out = tmp_path / "out"
    out.mkdir()
    marker = str(tmp_path / "marker")
    log = open(tmp_path / "log", "wb")  # not a pipe: the workers inherit it and would keep it open
    proc = subprocess.Popen([sys.executable, "-c", SLOW_RESHARD, how, marker, "reshard", source, str(out / "target"),
                             "--to", "pp=2,tp=2", "--workers", "2", "--quiet"],
                            env=ENV, start_new_session=True, stdout=log, stderr=subprocess.STDOUT)
    workers: list[int] = []
    try:
        deadline = time.time() + 60
        while len([n for n in os.listdir(tmp_path) if n.startswith("marker.")]) < 2:
            assert proc.poll() is None, (tmp_path / "log").read_text()
            assert time.time() < deadline, "the workers never got going"
            time.sleep(0.02)
        workers = [p for p in _children(proc.pid) if os.path.exists(f"{marker}.{p}")]
        assert len(workers) == 2
        [tmp] = _tmp_entries(out)
        assert collect_garbage(out, dry_run=True)[0].state == "in use"
        t0 = time.time()
        proc.send_signal(signal.SIGKILL)  # the parent only, not its process group
        proc.wait()
        while any(_alive(p) for p in workers) and time.time() - t0 < 10:
            time.sleep(0.01)
        took = time.time() - t0
        assert not any(_alive(p) for p in workers), f"workers still running {took:.1f} s after the parent died"
        assert took < (2 if how == "prctl" else 3), took
    finally:
        for p in [proc.pid, *workers]:
            try:
                os.kill(p, signal.SIGKILL)
            except OSError:
                pass
        proc.wait()
        log.close()
    assert not (out / "target").exists()
    # with the workers gone so is the lock: gc takes the leftovers
    [entry] = collect_garbage(out)
    assert (os.path.basename(entry.path), entry.state, entry.removed) == (tmp, "dead", True)
    assert os.listdir(out) == []


# ---------------------------------------------------------------- a full disk: one UCL410, nothing else

FULL_DISK = """
import resource, signal, sys
import numpy as np
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead of killing us
limit = int(sys.argv[1])
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
from ucl.store import CheckpointWriter
from ucl.errors import UclError
n, size = int(sys.argv[3]), int(sys.argv[4])
try:
    w = CheckpointWriter(sys.argv[2], 2, mesh=[("dp", 2)])
    for i in range(n):
        w.write(i % 2, "param/p%d" % i, np.ones(size, np.float32))
    w.commit()
    print("committed")
except UclError as e:
    print("error", e.code)
"""


@pytest.mark.skipif(not hasattr(signal, "SIGXFSZ"), reason="needs RLIMIT_FSIZE")
@pytest.mark.parametrize("limit,n,size", [
    (8192, 1, 10),      # the data fits; HDF5's metadata, written at close, does not: the commit must fail
    (16384, 300, 10),   # many small datasets
    (4096, 1, 1500),    # the first data write fails
], ids=["at-close", "many-small", "first-write"])
def test_full_disk_is_one_error_and_no_noise(tmp_path, limit, n, size):
    p = subprocess.run([sys.executable, "-c", FULL_DISK, str(limit), str(tmp_path / "ck"), str(n), str(size)],
                       env=ENV, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "error UCL410", p.stdout + p.stderr
    assert p.stderr == "", p.stderr  # no "Exception ignored in: ...ObjectID.__dealloc__"
    assert os.listdir(tmp_path) == []


@pytest.mark.skipif(not hasattr(signal, "SIGXFSZ"), reason="needs RLIMIT_FSIZE")
def test_full_disk_during_reshard_prints_one_line(source, tmp_path):
    script = textwrap.dedent("""
        import resource, signal, sys
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (300000, 300000))
        from ucl.cli import main
        sys.exit(main(sys.argv[1:]))
    """)
    p = subprocess.run([sys.executable, "-c", script, "reshard", source, str(tmp_path / "t"), "--to", "pp=2,tp=2",
                        "--workers", "2", "--quiet"], env=ENV, capture_output=True, text=True, timeout=120)
    assert p.returncode == 1, p.stdout + p.stderr
    assert p.stderr.startswith("ucl: writing checkpoint") and "nothing was published" in p.stderr, p.stderr
    assert "Exception ignored" not in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert os.listdir(tmp_path) == []
