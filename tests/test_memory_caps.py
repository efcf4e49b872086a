"""``max_memory=`` of reshard, load_rank and iter_rank (docs/memory.md): each operation runs in a
process of its own (tests/capped_child.py) and its peak added PSS, summed over the processes it
starts (tests/memprobe.py), stays under the cap, with results bit-exact against an uncapped run; bad
caps are UCL011 from Python, and one line without a traceback from the command line."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import ucl
from tests import memprobe
from ucl.errors import UclError
from ucl.memory import MemoryCap, memory_cap
from ucl.ops.budget import MIN_WORKER_BYTES, Budget, load_budget, worker_budget, worker_count
from ucl.ops.load import iter_rank, load_rank
from ucl.ops.reshard import reshard
from ucl.ops.streamed import target_blocks as load_target_blocks
from ucl.store.reader import Checkpoint

ROOT = Path(__file__).resolve().parent.parent
TINY = dict(vocab=2048, hidden=256, heads=8, kv_heads=4, ffn=704, layers=2)  # ~40 MB on TP2·PP2·DP2
MB = 10**6

needs_proc = pytest.mark.skipif(not memprobe.available(), reason="needs /proc/PID/smaps_rollup (Linux)")


def _bench():
    spec = importlib.util.spec_from_file_location("ucl_bench_reshard", ROOT / "bench" / "reshard.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def build(path: Path, dims: dict) -> Path:
    if not path.exists():
        _bench().build_source(path, dims)
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return build(tmp_path_factory.mktemp("caps") / "tiny", TINY)


@pytest.fixture(scope="module")
def warm(tmp_path_factory) -> Path:
    """A small checkpoint of the same kind: each child runs its operation on it first (lazy imports)."""
    return build(tmp_path_factory.mktemp("caps") / "warm", dict(TINY, vocab=512, hidden=128, ffn=352))


@pytest.fixture(scope="module")
def big(tmp_path_factory) -> Path:
    """~250 MB: a universal embedding of 16 MB, flat optimizer buffers of 15 MB a rank."""
    return build(tmp_path_factory.mktemp("caps") / "big", _bench().dims_for(0.25))


def child(op: dict, src: Path, warm: Path, dst: Path | None = None) -> dict:
    args = dict(op, src=str(src), warm=str(warm), dst=str(dst) if dst else None)
    p = subprocess.run([sys.executable, str(ROOT / "tests" / "capped_child.py"), json.dumps(args)],
                       capture_output=True, text=True, timeout=600,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def checksums(path: Path) -> list[dict]:
    m = json.loads((path / "manifest.json").read_text())
    return [{k: (e["shape"], e["dtype"], e["checksum"]) for k, e in ds.items()} for ds in m["datasets"]]


def size_of(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir())


# -- the cap's arithmetic ----------------------------------------------------------------------------

def test_a_small_cap_runs_one_worker_and_a_large_one_what_was_asked():
    assert worker_count(MemoryCap(32 * MB), 2) == 1
    assert worker_count(MemoryCap(MIN_WORKER_BYTES * 3), 8) == 3
    assert worker_count(memory_cap(None), 2) == 2


@pytest.mark.parametrize("total", [16 << 20, 32 * MB, 200 * MB, 2 * 10**9, 10**12])
def test_a_budget_spends_no_more_than_it_has(total):
    for b in (load_budget(MemoryCap(total)), worker_budget(MemoryCap(total), 1, 2 << 20),
              worker_budget(MemoryCap(total), 4, 2 << 20)):
        assert 4 * b.block + 2 * b.piece + b.cache + 2 * b.whole <= max(b.total, 0) or b.whole == 0
        assert b.block % 4096 == 0 and b.piece % 4096 == 0 and b.whole >= 0


def test_budget_of_nothing_still_streams_in_whole_pages():
    b = Budget.of(0, 2 << 20)
    assert b.whole == 0 and b.block >= 4096 and b.piece >= 4096


# -- bad caps ----------------------------------------------------------------------------------------

BAD = ["lots", "1MB", -5, True, "2 parsecs"]


@pytest.mark.parametrize("bad", BAD)
def test_a_bad_cap_is_ucl011_before_anything_is_done(tiny, tmp_path, bad):
    with pytest.raises(UclError) as e:
        reshard(tiny, tmp_path / "out", "tp=1", max_memory=bad)
    assert e.value.code == "UCL011"
    assert not (tmp_path / "out").exists() and not list(tmp_path.iterdir())
    with pytest.raises(UclError) as e:
        load_rank(tiny, mesh="universal", rank=0, max_memory=bad)
    assert e.value.code == "UCL011"
    with pytest.raises(UclError) as e:
        next(iter_rank(tiny, max_memory=bad))
    assert e.value.code == "UCL011"


def run_cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ucl.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})


@pytest.mark.parametrize("command", [["reshard", "{src}", "{dst}", "--to", "universal"], ["import", "{src}", "{dst}"],
                                     ["export", "hf", "{src}", "{dst}"]])
def test_cli_bad_max_memory_is_one_line_ucl011(tiny, tmp_path, command):
    args = [a.format(src=tiny, dst=tmp_path / "out") for a in command]
    p = run_cli(*args, "--max-memory", "12KB")
    assert p.returncode == 1, p.stderr
    assert p.stderr.startswith("ucl: max_memory 12.0 KB is below the smallest cap"), p.stderr
    assert "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()
    p = run_cli(*args, "--max-memory", "a lot")
    assert p.returncode == 1 and p.stderr.startswith("ucl: max_memory 'a lot' is not a size"), p.stderr


def test_cli_reshard_under_a_cap_matches_the_uncapped_one(tiny, tmp_path):
    p = run_cli("reshard", tiny, tmp_path / "capped", "--to", "pp=1,dp=2,tp=4", "--max-memory", "16MiB", "--quiet")
    assert p.returncode == 0, p.stderr
    reshard(tiny, tmp_path / "free", "pp=1,dp=2,tp=4")
    assert checksums(tmp_path / "capped") == checksums(tmp_path / "free")


def test_compressed_target_whose_dataset_cannot_fit_is_refused_up_front(tiny, tmp_path):
    """A compressed target's datasets are coded whole: one larger than a share of the cap is UCL011,
    naming it, before any file is written."""
    with pytest.raises(UclError) as e:
        reshard(tiny, tmp_path / "out", "universal", compress="zstd", max_memory="16MiB")
    assert e.value.code == "UCL011" and "is too small" in str(e.value) and "coded whole" in str(e.value)
    assert not list(tmp_path.iterdir())
    reshard(tiny, tmp_path / "ok", "universal", compress="zstd", max_memory="64MB")  # fits: done


# -- results under a cap are the uncapped ones --------------------------------------------------------

@pytest.mark.parametrize("to", ["universal", "pp=1,dp=2,tp=4", "pp=2,dp=1,tp=4"])
def test_loads_in_pieces_are_bit_exact(tiny, to):
    """The smallest cap reads every box over 512 KiB in pieces (ops.bounded): the same bytes."""
    mesh = ucl.Mesh.parse(to)
    for rank in range(mesh.size):
        free, capped = load_rank(tiny, mesh=mesh, rank=rank), load_rank(tiny, mesh=mesh, rank=rank, max_memory="16MiB")
        assert free.keys() == capped.keys()
        for k in free:
            assert np.array_equal(free[k].view(np.uint8), capped[k].view(np.uint8)), k
    for (k1, a), (k2, b) in zip(iter_rank(tiny, mesh=mesh, rank=mesh.size - 1),
                                iter_rank(tiny, mesh=mesh, rank=mesh.size - 1, max_memory=16 << 20)):
        assert k1 == k2 and np.array_equal(a.view(np.uint8), b.view(np.uint8)), k1


@pytest.mark.parametrize("to", ["universal", "pp=1,dp=2,tp=4"])
def test_tensors_not_filled_in_place_are_filled_block_by_block(tiny, monkeypatch, to):
    """``out=`` tensors a load cannot read into (GPU tensors: here CPU ones ucl is made to treat
    alike) are filled a block at a time: the same values as a plain load. (They went through host
    copies of all of them at once: a universal load held the whole model twice.)"""
    torch = pytest.importorskip("torch")
    import ucl.ops.load as load
    from ucl.dtypes import to_numpy, to_torch
    mesh = ucl.Mesh.parse(to)
    want = load_rank(tiny, mesh=mesh, rank=mesh.size - 1)
    monkeypatch.setattr(load, "storage_view", lambda obj, logical: None)
    blocks = []
    monkeypatch.setattr(load, "target_blocks", lambda *a, **k: blocks.append(a[1]) or load_target_blocks(*a, **k))
    out = {k: torch.nn.Parameter(to_torch(np.full(a.shape, 7, a.dtype), "float32")) for k, a in want.items()}
    got = load_rank(tiny, mesh=mesh, rank=mesh.size - 1, out=out, max_memory="16MiB")
    assert all(got[k] is out[k] for k in out)
    for k, w in want.items():
        assert np.array_equal(to_numpy(got[k].detach())[0].view(np.uint8), w.view(np.uint8)), k
    assert sorted(blocks) == sorted(a.size for a in want.values())


@pytest.mark.parametrize("durable", [False, True])
@pytest.mark.parametrize("to", ["universal", "pp=1,dp=2,tp=4"])
def test_reshards_under_the_smallest_cap_are_bit_exact(tiny, tmp_path, to, durable):
    """16 MiB: one worker, blocks of 512 KiB, every dataset over 2 MiB streamed (durable ones too)."""
    reshard(tiny, tmp_path / "free", to, durable=durable)
    reshard(tiny, tmp_path / "capped", to, durable=durable, max_memory="16MiB", workers=2)
    assert checksums(tmp_path / "capped") == checksums(tmp_path / "free")
    with Checkpoint.open(tmp_path / "capped") as ck:
        assert ck.verify() == []


def test_a_foreign_folders_large_datasets_stream_under_a_cap(tmp_path):
    """A DCP folder read in place (an import): a tensor over a share's ``whole`` is streamed from the
    foreign files in blocks (durable too), the same bytes as the whole-dataset path writes."""
    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as tdcp
    g = torch.Generator().manual_seed(0)
    tdcp.save({"big": torch.randn(2048, 1024, generator=g), "b16": torch.randn(3000, 999, generator=g).to(torch.bfloat16),
               "small": torch.randn(7, generator=g)}, checkpoint_id=str(tmp_path / "dcp"))
    for durable in (False, True):
        reshard(tmp_path / "dcp", tmp_path / f"free{durable}", "universal", durable=durable)
        reshard(tmp_path / "dcp", tmp_path / f"capped{durable}", "universal", durable=durable, max_memory="16MiB")
        assert checksums(tmp_path / f"capped{durable}") == checksums(tmp_path / f"free{durable}")


@needs_proc
def test_durable_universal_stays_under_a_small_cap(tiny, warm, tmp_path):
    """The durable whole-dataset path held two datasets per worker; under 16 MiB it streams."""
    got = child({"op": "reshard", "to": "universal", "durable": True, "workers": 2, "max_memory": "16MiB"}, tiny, warm,
                tmp_path / "out")
    assert got["peak_added"] <= 16 << 20, got
    reshard(tiny, tmp_path / "free", "universal")
    assert checksums(tmp_path / "out") == checksums(tmp_path / "free")


# -- every operation under 1/8 of a ~250 MB checkpoint, measured ----------------------------------

RESHARDS = [dict(to="pp=1,dp=2,tp=4"), dict(to="pp=1,dp=2,tp=4", durable=True),
            dict(to="universal"), dict(to="universal", durable=True), dict(to="pp=2,dp=1,tp=1", workers=4)]


@pytest.mark.slow
@needs_proc
@pytest.mark.parametrize("op", RESHARDS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_reshard_stays_under_an_eighth_of_the_checkpoint(big, warm, tmp_path, op):
    cap = size_of(big) // 8
    got = child(dict(op, op="reshard", workers=op.get("workers", 2), max_memory=cap), big, warm, tmp_path / "out")
    assert got["peak_added"] <= cap, (got, cap)
    reshard(big, tmp_path / "free", op["to"], durable=op.get("durable", True))
    assert checksums(tmp_path / "out") == checksums(tmp_path / "free")


LOADS = [dict(op="load_rank", to="pp=1,dp=2,tp=4", rank=3), dict(op="load_rank", to="universal"),
         dict(op="iter_rank", to="universal"), dict(op="iter_rank", to="pp=1,dp=1,tp=2", rank=1),
         dict(op="load_into", to="universal")]


@pytest.mark.slow
@needs_proc
@pytest.mark.parametrize("op", LOADS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_loads_stay_under_an_eighth_of_the_checkpoint_beyond_their_result(big, warm, op):
    """The tensors a load returns are the caller's; the cap counts what it adds beyond them
    (iter_rank: beyond the one array the caller holds)."""
    cap = size_of(big) // 8
    got, free = child(dict(op, max_memory=cap), big, warm), child(op, big, warm)
    assert got["peak_added"] - got["result"] <= cap, (got, cap)
    assert got["digest"] == free["digest"]
