"""max_memory for import and the exports (hf, dcp, deepspeed-universal) of a foreign folder read in
place: each run in a subprocess (tests/memcap_formats_child.py) on a ~200 MB DCP checkpoint and a
~260 MB DeepSpeed ZeRO-1 one (dp=2: the masters and moments in flat partitions), whose tensors
(67 MB) exceed the cap of 1/8 of the checkpoint, with the peak PSS it adds (tests/memprobe.py) under
the cap and its output equal, as the frameworks' own loaders read it, to the uncapped run's."""
from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import memprobe
import ucl
from ucl.errors import UclError

CHILD = Path(__file__).parent / "memcap_formats_child.py"
CAPS = {"dcp": 25 * 10**6, "deepspeed": 32 * 10**6}  # 1/8 of each checkpoint


def _child(*args: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)}
    r = subprocess.run([sys.executable, str(CHILD), *args], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1]) if r.stdout.strip() else {}


def _capped(op: str, src: Path, out: Path, cap: int) -> dict:
    """The child's figures under ``cap``; a peak over it is measured again (twice at most), the lowest
    kept. Why: on a machine shared with other jobs, a run now and then peaks 30+ MB above its
    siblings (seen twice in about 30 runs, never reproduced); PSS splits a shared page among the
    processes mapping it, so another process that maps torch's libraries exiting mid-run raises
    this one's PSS by its share of them, which no operation adds (our suspicion, not proven)."""
    best = None
    for _ in range(3):
        shutil.rmtree(out, ignore_errors=True)
        got = _child(op, str(src), str(out), str(cap))
        best = got if best is None or got["peak_added"] < best["peak_added"] else best
        if best["peak_added"] <= cap:
            break
    return best


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    pytest.importorskip("torch")
    if not memprobe.available():
        pytest.skip("needs /proc/PID/smaps_rollup")
    root = tmp_path_factory.mktemp("capsfmt")
    for kind in CAPS:
        _child(f"build-{kind}", str(root / kind), "200")
    return root


def _read(op: str, out: Path) -> dict:
    """What the framework's own loader reads from an export (the oracle)."""
    import torch
    if op == "hf":
        from safetensors.torch import load_file
        return {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    if op == "dcp":
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
        dcp_to_torch_save(str(out), str(out.parent / f"{out.name}.pt"))
        flat: dict = {}

        def walk(prefix, obj):
            if isinstance(obj, dict):
                for k, v in obj.items():
                    walk(f"{prefix}.{k}" if prefix else str(k), v)
            else:
                flat[prefix] = obj
        walk("", torch.load(out.parent / f"{out.name}.pt", weights_only=True))
        return flat
    return {str(p.relative_to(out)): torch.load(p, weights_only=True) for p in sorted(out.rglob("*.pt"))}


def _same(a, b) -> bool:
    import torch
    if isinstance(a, torch.Tensor):  # bit for bit
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and \
            a.contiguous().flatten().view(torch.uint8).equal(b.contiguous().flatten().view(torch.uint8))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.slow
@pytest.mark.parametrize("source", list(CAPS))
@pytest.mark.parametrize("op", ["hf", "dcp", "universal"])
def test_an_export_stays_under_its_cap_and_writes_what_uncapped_writes(op, source, sources, tmp_path):
    src, cap = sources / source, CAPS[source]
    capped = _capped(op, src, tmp_path / "capped", cap)
    _child(op, str(src), str(tmp_path / "free"))
    assert capped["peak_added"] <= cap, capped
    got, want = _read(op, tmp_path / "capped"), _read(op, tmp_path / "free")
    assert got and got.keys() == want.keys()
    for k in want:
        assert _same(got[k], want[k]), k


@pytest.mark.slow
@pytest.mark.parametrize("source", list(CAPS))
def test_import_stays_under_its_cap(source, sources, tmp_path):
    src, cap = sources / source, CAPS[source]
    capped = _capped("import", src, tmp_path / "capped", cap)
    _child("import", str(src), str(tmp_path / "free"))
    assert capped["peak_added"] <= cap, capped
    with ucl.open(tmp_path / "free") as ckpt:
        nranks = ckpt.nranks
    for rank in range(nranks):  # the same datasets, bit for bit
        got = ucl.load_rank(tmp_path / "capped", mesh=_mesh(tmp_path / "free"), rank=rank)
        want = ucl.load_rank(tmp_path / "free", mesh=_mesh(tmp_path / "free"), rank=rank)
        assert got.keys() == want.keys() and all(got[k].tobytes() == want[k].tobytes() for k in want)


def _mesh(path) -> str:
    with ucl.open(path) as ckpt:
        return ",".join(f"{a}={n}" for a, n in ckpt.manifest.mesh) or "universal"


@pytest.mark.parametrize("call", ["import", "hf", "dcp", "universal"])
def test_a_bad_cap_is_ucl011_before_anything_is_read(call, tmp_path):
    from ucl.ops import export as ex
    fn = {"import": ucl.import_checkpoint, "hf": ex.export_hf, "dcp": ex.export_dcp,
          "universal": ex.export_deepspeed_universal}[call]
    for bad in ("lots", "1MB"):
        with pytest.raises(UclError) as e:
            fn(tmp_path / "nothing-here", tmp_path / "out", max_memory=bad)
        assert e.value.code == "UCL011"
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("shape,step", [((10, 7), 21), ((10, 7), 5), ((3, 4, 5), 7), ((3, 4, 5), 1), ((9,), 4),
                                        ((), 3), ((0, 5), 2), ((4, 4), 100)])
def test_dcp_chunks_tile_the_tensor_in_flat_ranges(shape, step):
    from ucl.formats.dcp.write import chunks
    cut = chunks(shape, step)
    total, pos = math.prod(shape), 0
    for offsets, sizes, first, stop in cut:
        assert first == pos and stop - first == math.prod(sizes)
        assert math.prod(sizes) <= max(step, 1) or len(cut) == 1
        flat = sum(o * math.prod(shape[j + 1:]) for j, o in enumerate(offsets))
        assert flat == first and all(o + s <= n for o, s, n in zip(offsets, sizes, shape))
        pos = stop
    assert pos == total


FIXTURES = Path(__file__).parent / "fixtures" / "deepspeed"


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("name", ["z1_fp32_dp2", "z2_bf16_dp2", "z3_bf16_dp2", "tp2_z2_bf16_tied"])
@pytest.mark.parametrize("op", ["dcp", "universal"])
def test_tiny_pieces_write_what_one_piece_writes(name, op, tmp_path):
    """Pieces of 256 bytes (a cap far below the floor users may give: MemoryCap directly), so pieces
    start and end inside ZeRO partitions, TP shards and bf16 tensors: the same export, bit for bit."""
    pytest.importorskip("torch")
    from ucl.memory import MemoryCap
    from ucl.ops import export as ex
    fn = {"dcp": ex.export_dcp, "universal": ex.export_deepspeed_universal}[op]
    fn(FIXTURES / name, tmp_path / "tiny", max_memory=MemoryCap(1024))
    fn(FIXTURES / name, tmp_path / "whole")
    if op == "dcp":
        assert len(list((tmp_path / "tiny").glob("*.distcp"))) > 1  # one file per chunk
    got, want = _read(op, tmp_path / "tiny"), _read(op, tmp_path / "whole")
    assert got and got.keys() == want.keys()
    for k in want:
        assert _same(got[k], want[k]), k
