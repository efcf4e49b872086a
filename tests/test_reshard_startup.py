"""A reshard's start-up: what a run of ``ucl reshard`` on a ucl checkpoint pays before the first
byte moves (bench/reshard.py counts every process's CPU time)."""
from __future__ import annotations

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PROBE = """
import sys
from ucl.ops.reshard import reshard
import ucl.cli.commands
reshard(sys.argv[1], sys.argv[2], "universal", workers=1, durable=False)
unused = ("ucl.formats", "ucl.store.extents", "ucl.ops.load", "ucl.ops.read_once", "ucl.ops.export")
print(" ".join(sorted(m for m in sys.modules if m.startswith(unused))))
"""


def test_a_ucl_reshard_imports_no_foreign_format_code_nor_the_load_path(tmp_path):
    """The DeepSpeed, DCP, Megatron and Hugging Face readers (and the format registry, and the byte
    ranges they read through) load only when a foreign folder is met; ``load_rank``'s modules only
    when something loads."""
    import ucl
    from tests.test_checkpoint import M
    from ucl.demo import llama_model, universal_state
    model = llama_model()
    mesh = M("dp=2,tp=2")
    shards = ucl.execute_memory(ucl.compile(model, ucl.UNIVERSAL, mesh), {0: universal_state(model, seed=0)})
    src = ucl.save(tmp_path / "src", shards, model=model, mesh=mesh, state={"step": 1})
    env = dict(os.environ, PYTHONPATH=REPO)
    out = subprocess.run([sys.executable, "-c", PROBE, str(src), str(tmp_path / "dst")], capture_output=True,
                         text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [], out.stdout


NO_LARK = """
import sys
from ucl.ops.reshard import reshard
reshard(sys.argv[1], sys.argv[2], "universal", workers=1, durable=False)
print(" ".join(sorted(m for m in sys.modules if m in ("lark", "ucl.lang.parse", "ucl.lang.grammar") or m.startswith("lark."))))
"""


def test_a_second_reshard_of_a_checkpoint_imports_no_parser(tmp_path):
    """The checkpoint's spec text is parsed by the first process that opens it; later ones take its
    syntax tree from the cache of parsed specs (ucl.lang.parsed) and import neither lark nor the
    parser (~45 ms of CPU of every start)."""
    import ucl
    from tests.test_checkpoint import M
    from ucl.demo import llama_model, universal_state
    model = llama_model()
    mesh = M("dp=2,tp=2")
    shards = ucl.execute_memory(ucl.compile(model, ucl.UNIVERSAL, mesh), {0: universal_state(model, seed=0)})
    src = ucl.save(tmp_path / "src", shards, model=model, mesh=mesh, state={"step": 1})
    env = dict(os.environ, PYTHONPATH=REPO, UCL_CACHE_DIR=str(tmp_path / "cache"))
    runs = []
    for i in range(2):
        out = subprocess.run([sys.executable, "-c", NO_LARK, str(src), str(tmp_path / f"dst{i}")], capture_output=True,
                             text=True, env=env, timeout=120)
        assert out.returncode == 0, out.stderr
        runs.append(out.stdout.split())
    assert "lark" in runs[0] and runs[1] == []
    a, b = (ucl.load_rank(tmp_path / f"dst{i}", mesh="universal", rank=0) for i in range(2))
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)


def test_on_one_core_a_page_cache_reshard_writes_without_a_thread(tmp_path, monkeypatch):
    """On one core a write through the page cache is a copy on that core whether a thread does it or
    not: the reshard writes in its own thread (the same file), and a durable one keeps the write thread,
    which overlaps the device's wait with reading."""
    import json
    import ucl
    import ucl.store.behind as behind
    from tests.test_checkpoint import M
    from ucl.demo import llama_model, universal_state
    model = llama_model()
    mesh = M("dp=2,tp=2")
    shards = ucl.execute_memory(ucl.compile(model, ucl.UNIVERSAL, mesh), {0: universal_state(model, seed=0)})
    src = ucl.save(tmp_path / "src", shards, model=model, mesh=mesh, state={"step": 1})
    threads = []
    real = behind.ThreadPoolExecutor
    monkeypatch.setattr(behind, "ThreadPoolExecutor", lambda *a, **k: threads.append(a) or real(*a, **k))
    reshard = sys.modules["ucl.ops.reshard"]  # (the package's ``reshard`` is the function)
    for cores, durable, name in ((2, False, "two"), (1, False, "one"), (1, True, "durable")):
        monkeypatch.setattr(reshard, "usable_cores", lambda cores=cores: cores)
        threads.clear()
        reshard.reshard(src, tmp_path / name, "universal", workers=1, durable=durable)
        assert bool(threads) == (name != "one"), name
    digests = [[{k: v["checksum"] for k, v in d.items()} for d in json.loads((tmp_path / n / "manifest.json").read_text())["datasets"]]
               for n in ("two", "one", "durable")]
    assert digests[0] == digests[1] == digests[2]
    assert (tmp_path / "two" / "rank_00000.h5").read_bytes() == (tmp_path / "one" / "rank_00000.h5").read_bytes()
