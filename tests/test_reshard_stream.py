"""The reshard's streamed path (a target dataset assembled and written block by block, each source part
read and verified in memory of its own, ops.streamed.stream_dataset) is forced for every dataset here, with blocks of a few kilobytes cut
across rows, tensors and flat-buffer boundaries: the results are the single-pass results bit for
bit, and corrupt or truncated sources are refused with nothing published."""
from __future__ import annotations

import importlib
import numpy as np
import json
import os

import pytest

import ucl
from tests.corrupt import flip_byte
from tests.test_checkpoint import (U, M, assert_intact, assert_nothing_left, demo, read_all,  # noqa: F401
                                   assert_same_shards, saved, _copy)
from ucl.errors import StoreError
import ucl.store.writer as store_writer

streamed_module = importlib.import_module("ucl.ops.streamed")


@pytest.fixture
def streamed(monkeypatch):
    """Every dataset streamed, in blocks of 4,100 bytes (no multiple of a row, a chunk or 8 bytes);
    counts the datasets that took the path (in this process: workers=1)."""
    monkeypatch.setattr(streamed_module, "MIN_STREAM_BYTES", 0)
    monkeypatch.setattr(streamed_module, "STREAM_BLOCK_BYTES", 4100)
    taken = []
    real = streamed_module.stream_dataset

    def spy(*a, **k):
        ok = real(*a, **k)
        taken.append(ok)
        return ok
    monkeypatch.setattr(streamed_module, "stream_dataset", spy)
    return taken


CHAINS = [
    ("pp=2,dp=2,tp=2", "pp=1,dp=2,tp=4"),  # row and column splits inside flat buffers
    ("pp=4,dp=1,tp=1", "dp=3"),  # flat buffers padded to multiple_of(64 * 3): zero gaps
    ("dp=3,tp=2", "universal"),
    ("universal", "pp=2,dp=3,tp=2"),
]


@pytest.mark.parametrize("a,b", CHAINS, ids=[f"{a}->{b}" for a, b in CHAINS])
def test_streamed_reshard_is_bit_exact(demo, saved, tmp_path, streamed, a, b):
    model, truth = demo
    ucl.reshard(saved(a), tmp_path / "B", M(b), workers=1, durable=False)
    assert streamed and all(streamed), "every dataset should take the streamed path"
    assert_intact(tmp_path / "B", model, truth, M(b))


def test_a_durable_reshard_assembles_datasets_whole(demo, saved, tmp_path, streamed):
    """Durable writes go around the page cache, where a whole dataset in flight was the faster."""
    model, truth = demo
    ucl.reshard(saved("pp=2,dp=2,tp=2"), tmp_path / "B", M("pp=1,dp=2,tp=4"), workers=1)
    assert streamed and not any(streamed)
    assert_intact(tmp_path / "B", model, truth, M("pp=1,dp=2,tp=4"))


def test_streamed_and_assembled_targets_have_equal_checksums(demo, saved, tmp_path, monkeypatch):
    src = saved("pp=2,dp=2,tp=2")
    monkeypatch.setattr(streamed_module, "MIN_STREAM_BYTES", 1 << 62)
    ucl.reshard(src, tmp_path / "whole", M("pp=1,dp=2,tp=4"), workers=2)
    monkeypatch.setattr(streamed_module, "MIN_STREAM_BYTES", 0)
    monkeypatch.setattr(streamed_module, "STREAM_BLOCK_BYTES", 999)
    ucl.reshard(src, tmp_path / "streamed", M("pp=1,dp=2,tp=4"), workers=2, durable=False)

    def sums(p):
        m = json.load(open(os.path.join(p, "manifest.json")))
        return [{k: (e["checksum"], e.get("chunks"), e.get("tiles")) for k, e in d.items()} for d in m["datasets"]]
    assert sums(tmp_path / "whole") == sums(tmp_path / "streamed")
    assert_same_shards(read_all(tmp_path / "whole"), read_all(tmp_path / "streamed"), "whole vs streamed")


@pytest.mark.parametrize("key,rank", [("fp32/@flat0", 2), ("param/decoder.layers.0.mlp.linear_fc2.weight", 0)])
@pytest.mark.parametrize("to", ["universal", "tp=4"])
def test_streamed_reshard_refuses_a_corrupted_source(saved, tmp_path, streamed, key, rank, to):
    bad = _copy(saved("dp=2,tp=2"), tmp_path / "src")
    flip_byte(os.path.join(bad, f"rank_{rank:05d}.h5"), key)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(StoreError) as e:
        ucl.reshard(bad, out / "x", M(to), workers=1, durable=False)
    msg = str(e.value)
    assert e.value.code == "UCL407" and "checksum" in msg and key in msg and f"rank_{rank:05d}.h5" in msg, msg
    assert_nothing_left(out, [])


def test_streamed_reshard_refuses_a_source_cut_short(saved, tmp_path, streamed):
    bad = _copy(saved("dp=2,tp=2"), tmp_path / "src")
    path = os.path.join(bad, "rank_00001.h5")
    with ucl.open(bad) as c:
        end = max(c.info(1, k).offset + c.info(1, k).nbytes for k in c.keys(1))
    os.truncate(path, end - 10)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(StoreError) as e:
        ucl.reshard(bad, out / "x", U, workers=1, durable=False)
    assert e.value.code == "UCL406" and "rank_00001.h5" in str(e.value), str(e.value)
    assert_nothing_left(out, [])


def test_a_source_altered_during_the_reshard_is_never_copied_unchecked(demo, saved, tmp_path, streamed, monkeypatch):
    """The bytes hashed and written are the bytes checked: each part of a block is read into memory
    of our own and verified there. A source byte changed after its chunk was first read (another
    process writing into the file) is refused when read again (UCL407), or was read before it
    changed: the target never carries it under a fresh checksum."""
    model, truth = demo
    src = _copy(saved("tp=4"), tmp_path / "src")
    key, path = "fp32/@flat0", os.path.join(src, "rank_00000.h5")
    with ucl.open(src) as c:
        at = c.info(0, key).offset + 8192  # inside the first checksum chunk, which spans several blocks
    real, done = store_writer.CheckpointWriter.write_stream, []

    def write_stream(self, targets, k, shape, dtype, pieces, **kw):
        def altered():  # the source byte changes once the target's first block has been taken
            for n, piece in enumerate(pieces):
                yield piece
                if k == key and 0 in targets and n == 0:
                    done.append(1)
                    with open(path, "r+b") as fh:
                        fh.seek(at)
                        b = fh.read(1)
                        fh.seek(at)
                        fh.write(bytes([b[0] ^ 0x7F]))
        return real(self, targets, k, shape, dtype, altered(), **kw)
    monkeypatch.setattr(store_writer.CheckpointWriter, "write_stream", write_stream)
    try:
        ucl.reshard(src, tmp_path / "out", M("tp=4"), workers=1, durable=False)
    except StoreError as e:
        assert e.code == "UCL407", str(e)
        assert_nothing_left(tmp_path, ["src"])
        return
    assert done
    assert_intact(tmp_path / "out", model, truth, M("tp=4"))


def test_only_blocks_with_gaps_are_zeroed(demo, saved, tmp_path, streamed, monkeypatch):
    """A flat buffer padded at the end of each partition is covered but for a few blocks: the others
    are not zeroed first (a pass over memory for nothing), and the result is still bit-exact."""
    model, truth = demo
    zeroed = []
    real = streamed_module.ArenaRing.array

    def spy(self, shape, dtype, zero=False):
        zeroed.append(zero)
        return real(self, shape, dtype, zero)
    monkeypatch.setattr(streamed_module.ArenaRing, "array", spy)
    ucl.reshard(saved("pp=4,dp=1,tp=1"), tmp_path / "B", M("dp=3"), workers=1, durable=False)
    assert_intact(tmp_path / "B", model, truth, M("dp=3"))
    assert any(zeroed) and sum(zeroed) < len(zeroed) / 4, (sum(zeroed), len(zeroed))


def test_a_dataset_assembled_whole_has_its_gaps_zeroed_only(demo, saved, tmp_path, monkeypatch):
    """The durable path assembles datasets whole in reused memory: the elements no copy writes (each
    partition's padding) are zeroed, and blocks the copies cover are not zeroed first."""
    model, truth = demo
    monkeypatch.setattr(streamed_module, "STREAM_BLOCK_BYTES", 4096)
    plan = ucl.compile(model, M("pp=4,dp=1,tp=1"), M("dp=3"))
    c = plan.copies
    key = "fp32/@flat0"
    slot_keys = np.array([s.key for s in plan.slots], dtype=object)
    rows = np.flatnonzero((c["dst_rank"] == 2) & (slot_keys[c["dst_slot"]] == key))
    shape = next(tuple(d["shape"]) for d in plan.datasets if d["key"] == key)
    covered = np.zeros(int(np.prod(shape)), bool)
    for cp in streamed_module.strided_copies(plan, rows):
        covered[strided_pos(cp)] = True
    assert 0 < covered.sum() < covered.size  # padding at the end of the partition
    out = np.full(shape, -1, np.float32)
    streamed_module.zero_gaps(plan, rows, out)
    flat = out.reshape(-1)
    assert (flat[~covered] == 0).all()
    assert (flat[covered] == -1).mean() > 0.9  # covered blocks were left alone
    ucl.reshard(saved("pp=4,dp=1,tp=1"), tmp_path / "B", M("dp=3"), workers=1)  # arenas reused with old bytes
    assert_intact(tmp_path / "B", model, truth, M("dp=3"))


def strided_pos(cp) -> np.ndarray:
    """The target flat offsets a strided copy writes."""
    pos = np.array([cp.dst])
    for n, st in zip(cp.sizes, cp.dst_strides):
        pos = (pos[:, None] + np.arange(n) * st).reshape(-1)
    return pos
