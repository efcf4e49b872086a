"""Digests carried over (docs/format.md): a target dataset that is a whole source dataset, byte for
byte, read and verified against the source's checksums, keeps those checksums; the writer does not
hash it again. On both of the reshard's paths (streamed through the page cache, assembled whole for
durable writes) the result is the same checkpoint, bit for bit and checksum for checksum, and a
corrupt source is still refused."""
from __future__ import annotations

import importlib
import json
import os

import numpy as np
import pytest

import ucl
from tests.corrupt import flip_byte
from tests.test_checkpoint import M, _copy, assert_intact, assert_nothing_left, demo, saved  # noqa: F401
from ucl.errors import StoreError
from ucl.store.digests import Digests, checksums
from ucl.store.ledger import known_digests
import ucl.store.writer as store_writer

streamed_module = importlib.import_module("ucl.ops.streamed")
reshard_module = importlib.import_module("ucl.ops.reshard")

SRC, DST = "pp=2,dp=2,tp=2", "pp=2,dp=1,tp=2"  # a dp change: the weights are copied whole


@pytest.fixture
def hashed(monkeypatch):
    """The keys whose bytes the writer hashed (streamed or whole), in this process (workers=1)."""
    keys: list[str] = []
    real_inc, real_sums = store_writer.IncrementalChecksum, store_writer.checksums

    def inc(shape, dtype, **kw):
        keys.append(tuple(shape))
        return real_inc(shape, dtype, **kw)

    def sums(arr, **kw):
        keys.append(tuple(arr.shape))
        return real_sums(arr, **kw)
    monkeypatch.setattr(store_writer, "IncrementalChecksum", inc)
    monkeypatch.setattr(store_writer, "checksums", sums)
    return keys


def entries(path) -> list[dict]:
    return json.load(open(os.path.join(path, "manifest.json")))["datasets"]


def whole_copies(src, dst) -> dict[tuple[int, str], tuple[int, str]]:
    """Target (rank, key) -> the source (rank, key) it is a whole copy of, found from the data (a
    weight stored once over dp in both layouts)."""
    a, b = entries(src), entries(dst)
    out = {}
    for r, es in enumerate(b):
        for k, e in es.items():
            for sr, ses in enumerate(a):
                if k in ses and ses[k]["shape"] == e["shape"] and ses[k]["checksum"] == e["checksum"]:
                    out[(r, k)] = (sr, k)
    return out


@pytest.mark.parametrize("durable", [False, True], ids=["streamed", "whole"])
def test_a_dataset_copied_whole_keeps_the_source_checksums(demo, saved, tmp_path, monkeypatch, hashed, durable):
    model, truth = demo
    src = saved(SRC)
    hashed.clear()  # (the source may have been saved just now)
    monkeypatch.setattr(streamed_module, "MIN_STREAM_BYTES", 0)  # every dataset of the small model streamed
    ucl.reshard(src, tmp_path / "B", M(DST), workers=1, durable=durable)
    assert_intact(tmp_path / "B", model, truth, M(DST))
    copies = whole_copies(src, tmp_path / "B")
    a, b = entries(src), entries(tmp_path / "B")
    big = [(r, k) for (r, k) in copies if "chunks" in b[r][k]]
    assert len(big) >= 4, copies  # chunked datasets copied whole: the case under test
    # the writer hashed only the datasets that are no plain copies: the rest, and the vocabulary-padded
    # weights, whose padding rows the plan fills with zeros rather than copies
    padded = {(r, k) for (r, k) in copies if k.startswith("param/") and ("word_embeddings" in k or "output_layer" in k)}
    for (r, k), (sr, sk) in copies.items():
        for field in ("checksum", "chunks", "tiles"):
            want = {a[sr][sk].get(field)}
            if field == "tiles" and (r, k) in padded and not model.tensor(k).cuts_last_dim:
                want.add(None)  # hashed here (if padding is filled), rows all it is read by: no tiles (test_reshard_tiles)
            assert b[r].get(k, {}).get(field) in want, (r, k, field)
    assert len(padded) == 4  # on both tp ranks of the first and the last stage
    rebuilt = {tuple(e["shape"]) for r, es in enumerate(b) for k, e in es.items() if (r, k) not in copies}
    rebuilt |= {tuple(b[r][k]["shape"]) for r, k in padded}
    assert set(hashed) <= rebuilt, set(hashed) - rebuilt
    assert len(hashed) <= sum(len(es) for es in b) - len(copies) + len(padded)  # (replicas: hashed once)


@pytest.mark.parametrize("durable", [False, True], ids=["streamed", "whole"])
def test_a_corrupt_dataset_copied_whole_is_refused(saved, tmp_path, monkeypatch, durable):
    monkeypatch.setattr(streamed_module, "MIN_STREAM_BYTES", 0)
    bad = _copy(saved(SRC), tmp_path / "src")
    key = "param/decoder.layers.0.mlp.linear_fc1.weight"
    flip_byte(os.path.join(bad, "rank_00000.h5"), key, offset=5000)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(StoreError) as e:
        ucl.reshard(bad, out / "x", M(DST), workers=1, durable=durable)
    assert e.value.code == "UCL407" and key in str(e.value), str(e.value)
    assert_nothing_left(out, [])


def test_without_verification_every_dataset_is_hashed(demo, saved, tmp_path, monkeypatch, hashed):
    """``verify=False`` reads bytes nobody checked: they get checksums of their own, never the
    source's (which would bless, or blame, bytes they were not computed from)."""
    monkeypatch.setattr(streamed_module, "MIN_STREAM_BYTES", 0)
    src = saved(SRC)
    hashed.clear()
    ucl.reshard(src, tmp_path / "B", M(DST), workers=1, durable=False, verify=False)
    assert len(hashed) == sum(len(es) for es in entries(tmp_path / "B"))


def test_a_source_entry_without_a_chunk_digest_carries_nothing(saved, tmp_path):
    """Entries written before ``chunks`` existed bind their chunk table only by hashing the whole
    dataset: the writer then hashes its copy itself."""
    src = _copy(saved(SRC), tmp_path / "src")
    mpath = os.path.join(src, "manifest.json")
    m = json.load(open(mpath))
    key = "param/decoder.layers.0.mlp.linear_fc1.weight"
    del m["datasets"][0][key]["chunks"]
    json.dump(m, open(mpath, "w"))
    with ucl.open(src) as c:
        assert c.digests(0, key) is None
        other = "param/decoder.layers.0.self_attention.linear_proj.weight"
        d = c.digests(0, other)
        assert d is not None and d.chunks is not None and d.whole == c.info(0, other).checksum


def test_handed_digests_must_fit_the_dataset():
    arr = np.arange(64 * 1024, dtype=np.float32).reshape(256, 256)
    d = checksums(arr)
    assert known_digests(d, arr.shape, arr.dtype, "k") is d
    for wrong in (Digests(d.whole), Digests(d.whole, (d.chunks[0] * 2, d.chunks[1]), d.tiles),
                  Digests(d.whole, d.chunks, (d.tiles[0], d.tiles[1][:-1])), Digests("sha:0", d.chunks, d.tiles)):
        with pytest.raises(StoreError) as e:
            known_digests(wrong, arr.shape, arr.dtype, "k")
        assert e.value.code == "UCL409"
    assert known_digests(Digests(d.whole, d.chunks), arr.shape, arr.dtype, "k").tiles is None  # tiles are optional


def test_default_workers_follow_the_cores_this_process_may_use(saved, tmp_path, monkeypatch):
    """Under ``taskset -c 0`` a reshard forks no second worker to share the one core."""
    seen = []
    real = reshard_module._write_files

    def spy(job, files, workers, *a, **k):
        seen.append(workers)
        return real(job, files, workers, *a, **k)
    monkeypatch.setattr(reshard_module, "_write_files", spy)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    ucl.reshard(saved(SRC), tmp_path / "B", M(DST), durable=False)
    assert seen == [1]


def test_a_compressed_source_carries_nothing(demo, tmp_path, monkeypatch):
    """A compressed dataset's reads check its stored bytes against the frame table, not the chunk
    digests: its copies are hashed afresh, none takes the source's checksums."""
    from tests.test_checkpoint import shards_for
    from ucl.store.reader import Checkpoint
    model, truth = demo
    src = ucl.save(tmp_path / "src", shards_for(model, truth, M(SRC)), model=model, mesh=M(SRC), state={"step": 1},
                   compress="zstd")
    asked = []
    real = Checkpoint.digests
    monkeypatch.setattr(Checkpoint, "digests", lambda self, r, k: (asked.append((r, k)), real(self, r, k))[1])
    monkeypatch.setattr(streamed_module, "MIN_STREAM_BYTES", 0)
    for durable in (False, True):
        ucl.reshard(src, tmp_path / f"B{durable}", M(DST), workers=1, durable=durable)
        assert_intact(tmp_path / f"B{durable}", model, truth, M(DST))
    with ucl.open(src) as c:
        assert all(c.info(r, k).encoding is None for r, k in asked), asked  # only datasets coding did not shrink
