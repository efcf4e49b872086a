"""The compressed encoding (docs/format.md, "Compressed datasets"): bit-exact round trips of whole
datasets and hyperslabs over dtypes, shapes and chunk sizes; every reader transparent (load_rank,
reshard, verify); reshards between compressed and plain checkpoints bit-exact; hostile stored
bytes, frame tables and streams refused with UclErrors before anything is allocated from them."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings, strategies as st, HealthCheck

import ucl
from tests.passes import examples
from tests.test_checkpoint import (U, M, assert_intact, demo, read_all, assert_same_shards, saved,  # noqa: F401
                                   _copy)
from ucl.errors import StoreError
from ucl.store import Checkpoint, CheckpointWriter
from ucl.store.codec import encode, frame_table_digest, units_of
from ucl.store.planes import join_into, split_planes

DTYPES = ["float32", "bfloat16", "float16", "float64", "int64", "int32", "uint8", "bool", "float8_e4m3fn"]


def _storage(dtype: str, shape, rng) -> np.ndarray:
    """Storage bits like trained state: floats of one scale (a redundant exponent), ints small."""
    n = int(np.prod(shape))
    if dtype == "bool":
        return rng.random(n).reshape(shape) < 0.5
    if dtype in ("float32", "float64", "float16"):
        return (rng.standard_normal(n) * 0.02).astype(dtype).reshape(shape)
    if dtype == "bfloat16":
        return (np.float32(rng.standard_normal(n) * 0.02).view(np.uint32) >> 16).astype(np.uint16).reshape(shape)
    if dtype == "float8_e4m3fn":
        return rng.integers(0, 120, n, dtype=np.uint8).reshape(shape)
    return rng.integers(-50, 50, n).astype(dtype).reshape(shape)


def _write(path, arrays: dict, codec: str) -> Checkpoint:
    with CheckpointWriter(path, 1, compress=codec) as w:
        for key, (arr, dtype) in arrays.items():
            w.write(0, key, arr, dtype=dtype)
        w.commit()
    return Checkpoint.open(path)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "float64", "int64"])
def test_byte_planes_invert(dtype):
    rng = np.random.default_rng(1)
    arr = _storage(dtype, (1000,), rng)
    raw = arr.reshape(-1).view(np.uint8)
    planes = split_planes(raw, dtype, arr.itemsize)
    assert len(planes) == arr.itemsize
    out = np.empty_like(raw)
    join_into(planes, dtype, out)
    assert out.tobytes() == raw.tobytes()


def test_the_exponent_plane_is_apart():
    """bf16 rotated one bit: the first plane is the 8 exponent bits, the sign joins the mantissa."""
    x = np.array([0x3F80, 0xBF80, 0x7F7F], np.uint16)  # 1.0, -1.0, max: exponents 127, 127, 254
    planes = split_planes(x.view(np.uint8), "bfloat16", 2)
    assert planes[0].tolist() == [127, 127, 254]


@settings(max_examples=examples(100), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(dtype=st.sampled_from(DTYPES), codec=st.sampled_from(["zstd", "lz4"]),
       shape=st.lists(st.integers(1, 70), min_size=1, max_size=3).map(tuple),
       scale=st.sampled_from([1, 8, 64]), data=st.data())
def test_round_trip_whole_and_hyperslabs(tmp_path_factory, dtype, codec, shape, scale, data):
    shape = shape[:-1] + (shape[-1] * scale,)  # up to a few MiB: chunks of 16 KiB and more, tiles
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    arr = _storage(dtype, shape, rng)
    c = _write(tmp_path_factory.mktemp("c") / "x", {"param/x": (arr, dtype)}, codec)
    with c:
        want = arr.view(np.uint8) if dtype == "bool" else arr
        assert c.read(0, "param/x").tobytes() == want.tobytes()
        assert c.verify() == []
        starts = tuple(data.draw(st.integers(0, s - 1)) for s in shape)
        sizes = tuple(data.draw(st.integers(1, s - a)) for a, s in zip(starts, shape))
        box = tuple(slice(a, a + z) for a, z in zip(starts, sizes))
        assert c.read_box(0, "param/x", starts, sizes).tobytes() == np.ascontiguousarray(want[box]).tobytes()
        if len(shape) >= 2:  # a column block, verified: by tiles where the dataset has them
            cols = shape[-1]
            c0 = data.draw(st.integers(0, cols - 1))
            c1 = data.draw(st.integers(c0 + 1, cols))
            rows = int(np.prod(shape[:-1]))
            got = c.read_runs(0, "param/x", [(c0, rows, cols, c1 - c0)], verify=True)
            assert got.tobytes() == np.ascontiguousarray(want.reshape(rows, cols)[:, c0:c1]).tobytes()
        n = arr.size
        a = data.draw(st.integers(0, n - 1))
        b = data.draw(st.integers(a + 1, n))
        assert c.read_flat(0, "param/x", a, b).tobytes() == want.reshape(-1)[a:b].tobytes()


def test_trained_like_state_is_compressed_and_marked(tmp_path):
    rng = np.random.default_rng(0)
    w = _storage("bfloat16", (512, 512), rng)
    with _write(tmp_path / "x", {"param/w": (w, "bfloat16"), "step/s": (np.int64(7), "int64")}, "zstd") as c:
        info = c.info(0, "param/w")
        assert info.encoding == "zstd" and info.stored < 0.8 * info.nbytes
        assert c.info(0, "step/s").encoding is None  # coding a scalar does not shrink it: plain
        assert c.manifest.version == 5 and info.group >= 1
    assert ucl.open(tmp_path / "x").read(0, "param/w").tobytes() == w.tobytes()


def test_a_column_slice_decodes_only_its_tiles(tmp_path):
    rng = np.random.default_rng(0)
    w = _storage("float32", (1024, 1024), rng)
    c = _write(tmp_path / "x", {"param/w": (w, "float32")}, "zstd")
    with c:
        info = c.info(0, "param/w")
        got = c.read_runs(0, "param/w", [(256, 1024, 1024, 256)], verify=True)
        assert got.tobytes() == np.ascontiguousarray(w[:, 256:512]).tobytes()
        assert c.stored_read.stored <= 1.1 * info.stored / 4  # a quarter of the columns: a quarter of the units


@pytest.mark.parametrize("codec", ["zstd", "lz4"])
@pytest.mark.parametrize("a,b", [("pp=2,dp=2,tp=2", "pp=1,dp=2,tp=4"), ("dp=3,tp=2", "universal")])
def test_reshard_compressed_and_back_is_bit_exact(demo, saved, tmp_path, codec, a, b):
    model, truth = demo
    packed = tmp_path / "packed"
    ucl.reshard(saved(a), packed, M(b), workers=2, compress=codec)
    m = json.load(open(packed / "manifest.json"))
    assert m["version"] == 5 and any(e.get("encoding") == codec for d in m["datasets"] for e in d.values())
    assert_intact(packed, model, truth, M(b))
    plain = tmp_path / "plain"
    ucl.reshard(packed, plain, M(a), workers=1, durable=False)  # streamed from a compressed source
    assert not any("encoding" in e for d in json.load(open(plain / "manifest.json"))["datasets"] for e in d.values())
    assert_same_shards(read_all(plain), read_all(saved(a)), "compressed -> plain")


def test_save_compressed_loads_every_rank(demo, tmp_path):
    from tests.test_checkpoint import shards_for
    model, truth = demo
    mesh = M("pp=2,dp=2,tp=2")
    p = ucl.save(tmp_path / "c", shards_for(model, truth, mesh), model=model, mesh=mesh, compress="lz4")
    assert_intact(p, model, truth, mesh)


def test_cli_reshard_compress(demo, saved, tmp_path, capsys):
    from ucl.cli import main
    src = saved("dp=3,tp=2")
    assert main(["reshard", src, str(tmp_path / "z"), "--to", "tp=2", "--compress", "zstd", "--quiet"]) == 0
    assert ucl.open(tmp_path / "z").info(0, "param/decoder.layers.0.mlp.linear_fc2.weight").encoding == "zstd"
    assert main(["verify", str(tmp_path / "z")]) == 0
    capsys.readouterr()
    assert main(["inspect", str(tmp_path / "z")]) == 0
    out = capsys.readouterr().out
    assert "ucl format v5" in out and "stored, zstd)" in out


def test_an_unknown_codec_is_refused_before_anything_is_written(tmp_path):
    with pytest.raises(StoreError) as e:
        CheckpointWriter(tmp_path / "x", 1, compress="gzip")
    assert e.value.code == "UCL418" and not os.listdir(tmp_path)


# ---- hostile input ----------------------------------------------------------------------------------

def _packed_file(tmp_path, codec="zstd"):
    rng = np.random.default_rng(3)
    w = _storage("float32", (256, 256), rng)  # 256 KiB: 16 tiles
    path = tmp_path / "x"
    _write(path, {"param/w": (w, "float32")}, codec).close()
    m = json.load(open(path / "manifest.json"))
    return path, m, m["datasets"][0]["param/w"], w


def _rewrite(path, m):
    (path / "manifest.json").write_text(json.dumps(m))


def test_a_flipped_stored_byte_is_refused_naming_the_unit(tmp_path):
    path, _, e, _ = _packed_file(tmp_path)
    with open(path / "rank_00000.h5", "r+b") as f:
        f.seek(e["offset"] + 10)
        b = f.read(1)
        f.seek(e["offset"] + 10)
        f.write(bytes([b[0] ^ 1]))
    with Checkpoint.open(path) as c:
        with pytest.raises(StoreError) as err:
            c.read(0, "param/w")
        assert err.value.code == "UCL407" and "unit 0" in str(err.value)
        assert any("unit 0" in p for p in c.verify())
        # a column block away from the damaged unit reads clean: only its own units are decoded
        assert c.read_runs(0, "param/w", [(192, 256, 256, 64)], verify=True).size == 256 * 64


def test_a_frame_table_the_manifest_does_not_bind_is_refused(tmp_path):
    path, m, e, _ = _packed_file(tmp_path)
    e["frames"] = "xxh3_64:" + "0" * 16
    _rewrite(path, m)
    with Checkpoint.open(path) as c, pytest.raises(StoreError) as err:
        c.read(0, "param/w")
    assert err.value.code == "UCL407"


def _forge(path, m, e, units: list[bytes]):
    """A hostile writer's file: its own units and frame table, the manifest made to agree with them."""
    from ucl.store.checksum import chunk_count
    from ucl.store.tiles import tile_grid
    with Checkpoint.open(path) as c:
        info = c.info(0, "param/w")
    ntab = chunk_count(info.nbytes) + (tile_grid(info.shape, 4).count if info.tiles else 0)  # the frames come after
    n = len(units)
    stored = b"".join(units)
    ends = np.cumsum([len(u) for u in units]).astype(np.uint64)
    digests = np.array([xxhash.xxh3_64_intdigest(u) for u in units], np.uint64)
    with open(path / "rank_00000.h5", "r+b") as f:
        f.seek(e["offset"])
        f.write(stored)
        f.seek(e["tables"] + 8 * ntab)
        f.write(np.concatenate([ends, digests]).astype("<u8").tobytes())
    e["stored"] = len(stored)
    e["frames"] = frame_table_digest(e["checksum"], e["encoding"], len(stored), ends, digests, e.get("group"))
    _rewrite(path, m)
    return n


def test_a_decompression_bomb_is_refused_before_it_is_decoded(tmp_path):
    """A unit whose zstd planes declare far more bytes than the unit holds, in a file whose frame
    table and manifest agree with it (a hostile writer): refused (UCL406) naming the unit, the
    declared size never allocated."""
    import zstandard
    path, m, e, w = _packed_file(tmp_path)
    bomb = zstandard.ZstdCompressor().compress(bytes(1 << 24))  # 16 MiB of zeros in a few hundred bytes
    assert len(bomb) < units_of(w.shape, 4).unit_bytes(0) // 4
    unit = b"".join(len(bomb).to_bytes(4, "little") + bomb for _ in range(4))
    good = encode(w, "float32", "zstd")
    parts = [bytes(good.stored[int(a):int(b)]) for a, b in zip(np.concatenate([[0], good.ends[:-1]]), good.ends)]
    _forge(path, m, e, [unit] + parts[1:])
    with Checkpoint.open(path) as c, pytest.raises(StoreError) as err:
        c.read(0, "param/w")
    assert err.value.code == "UCL406" and "unit 0" in str(err.value) and "corrupt zstd stream" in str(err.value)


def test_a_frame_table_that_does_not_fit_the_units_is_refused(tmp_path):
    path, m, e, w = _packed_file(tmp_path)
    n = units_of(w.shape, 4, e["group"]).count
    _forge(path, m, e, [bytes(16)] * (n - 1) + [bytes(16 + 4 * 1024 * 1024)])  # a unit longer than it can be
    with Checkpoint.open(path) as c, pytest.raises(StoreError) as err:
        c.read(0, "param/w")
    assert err.value.code == "UCL406" and "frame table does not fit" in str(err.value)


@pytest.mark.parametrize("codec", ["zstd", "lz4"])
def test_a_corrupt_stream_is_a_ucl_error(tmp_path, codec):
    path, m, e, w = _packed_file(tmp_path, codec)
    good = encode(w, "float32", codec)
    parts = [bytes(good.stored[int(a):int(b)]) for a, b in zip(np.concatenate([[0], good.ends[:-1]]), good.ends)]
    first = bytearray(parts[0])
    n = int.from_bytes(first[:4], "little")
    assert not n & (1 << 31), "the first plane (exponents) should be coded"
    for i in range(8, min(n, 40)):
        first[i] ^= 0x5A
    _forge(path, m, e, [bytes(first)] + parts[1:])
    with Checkpoint.open(path) as c, pytest.raises(StoreError) as err:
        c.read(0, "param/w")
    # either the stream fails to decode (UCL406) or decodes to other bytes, caught by the logical checksum
    assert err.value.code in ("UCL406", "UCL407")


def test_stored_bytes_beyond_the_file_are_refused(tmp_path):
    path, m, e, _ = _packed_file(tmp_path)
    e["stored"] = os.path.getsize(path / "rank_00000.h5")
    _rewrite(path, m)
    with Checkpoint.open(path) as c, pytest.raises(StoreError) as err:
        c.read(0, "param/w")
    assert err.value.code == "UCL406"


def test_an_older_reader_refuses_a_compressed_checkpoint(tmp_path, monkeypatch):
    import ucl.store.manifest as manifest
    path, *_ = _packed_file(tmp_path)
    monkeypatch.setattr(manifest, "READ_VERSION", 2)
    monkeypatch.setattr(ucl.store.reader, "_MANIFESTS", {})
    with pytest.raises(StoreError) as err:
        Checkpoint.open(path)
    assert err.value.code == "UCL402"


def test_a_compressed_entry_lacking_its_keys_is_malformed(tmp_path):
    path, m, e, _ = _packed_file(tmp_path)
    del e["frames"]
    _rewrite(path, m)
    with pytest.raises(StoreError) as err:
        Checkpoint.open(path)
    assert err.value.code == "UCL403"


def test_checkpointer_compresses_in_its_flusher(tmp_path):
    torch = pytest.importorskip("torch")
    import threading
    import ucl.store.codec as codec
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(3):
        model(torch.randn(8, 64)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    coded_in, real = set(), codec._encode_block
    codec._encode_block = lambda *a: (coded_in.add(threading.current_thread().name), real(*a))[1]
    try:
        with ucl.Checkpointer(str(tmp_path), model, opt, compress="zstd") as ck:
            ck.save(1)
            ck.wait()
            latest = ck.root.latest()
    finally:
        codec._encode_block = real
    assert coded_in and threading.current_thread().name not in coded_in  # never the training thread
    with ucl.open(latest) as c:
        assert c.manifest.version == 5 and c.verify() == []
        assert any(c.info(0, k).encoding == "zstd" for k in c.keys(0))
    want = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    with ucl.Checkpointer(str(tmp_path), model, opt) as ck:
        ck.load()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in want.items())


def test_checkpointer_refuses_an_unknown_codec(tmp_path):
    torch = pytest.importorskip("torch")
    model = torch.nn.Linear(4, 4)
    with pytest.raises(StoreError) as e:
        ucl.Checkpointer(str(tmp_path), model, compress="brotli")
    assert e.value.code == "UCL418"


@settings(max_examples=examples(200), deadline=None)
@given(codec=st.sampled_from(["zstd", "lz4"]), dtype=st.sampled_from(["float32", "bfloat16", "int64", "uint8"]),
       flips=st.lists(st.tuples(st.integers(0, 10**6), st.integers(1, 255)), min_size=1, max_size=6),
       cut=st.integers(0, 3))
def test_a_mutated_unit_decodes_or_fails_with_a_ucl_error(codec, dtype, flips, cut):
    """The decoder on hostile bytes (digest checks aside): a UclError (UCL406) naming the unit, or
    bytes of exactly the unit's length; never another exception, never more memory than the unit."""
    from ucl.store.codec import encode_unit
    rng = np.random.default_rng(7)
    arr = _storage(dtype, (4096,), rng)
    unit = encode_unit(arr.reshape(-1).view(np.uint8), dtype, arr.itemsize, codec)
    decode_mutated(unit, flips, cut, arr, dtype, codec)


def decode_mutated(unit: bytes, flips, cut: int, arr: np.ndarray, dtype: str, codec: str) -> None:
    """``unit`` (the coded ``arr``) with bytes flipped and its end cut decodes into exactly the
    unit's length or fails with UCL406 naming the unit (any other exception propagates)."""
    from ucl.store.codec import decode_unit
    unit = bytearray(unit)
    for pos, x in flips:
        unit[pos % len(unit)] ^= x
    if cut:
        del unit[-cut * 3:]
    out = np.empty(arr.nbytes, np.uint8)
    try:
        decode_unit(memoryview(bytes(unit)), out.size, dtype, arr.itemsize, codec, out, lambda: "unit 5")
    except StoreError as e:
        assert e.code == "UCL406" and "unit 5" in str(e)


def test_import_to_compressed_then_exports_read_the_same(tmp_path):
    """A held-in DeepSpeed fixture imported, resharded into a compressed copy of its own layout and
    exported to DCP from both: the exports hold the same tensors, bit for bit."""
    pytest.importorskip("torch")
    from pathlib import Path
    from ucl.ops.export import export_dcp
    from ucl.ops.prepare import mesh_of, open_checkpoint
    fixture = Path(__file__).parent / "fixtures" / "deepspeed" / "z1_fp32_dp2"
    plain, packed = tmp_path / "plain", tmp_path / "packed"
    ucl.import_checkpoint(fixture, plain)
    with ucl.open(plain) as c:
        mesh = mesh_of(c)
    ucl.reshard(plain, packed, mesh, compress="zstd", workers=1)
    with ucl.open(packed) as c:
        assert c.verify() == [] and any(c.info(r, k).encoding for r in range(c.nranks) for k in c.keys(r))
    for src in (plain, packed):
        export_dcp(src, tmp_path / f"dcp-{src.name}")
    got = []
    for name in ("plain", "packed"):
        with open_checkpoint(tmp_path / f"dcp-{name}") as c:
            got.append({(r, k): c.read(r, k).tobytes() for r in range(c.nranks) for k in c.keys(r)})
    assert got[0] == got[1] and got[0]


def test_long_flat_reads_go_a_group_of_units_at_a_time(tmp_path, monkeypatch):
    import ucl.store.packed as packed
    monkeypatch.setattr(packed, "_GROUP_BYTES", 1)  # one unit per group
    rng = np.random.default_rng(5)
    flat = _storage("float32", (300_001,), rng)  # 1-D: units are its 16 KiB checksum chunks, the last short
    rows = _storage("bfloat16", (96, 3000), rng)  # tiled
    with _write(tmp_path / "x", {"param/f": (flat, "float32"), "param/r": (rows, "bfloat16")}, "lz4") as c:
        assert c.read(0, "param/f").tobytes() == flat.tobytes()
        assert c.read_flat(0, "param/f", 4095, 290_000).tobytes() == flat[4095:290_000].tobytes()
        assert c.read(0, "param/r").tobytes() == rows.tobytes()
        assert c.read_flat(0, "param/r", 2999, 250_001).tobytes() == rows.reshape(-1)[2999:250_001].tobytes()


@settings(max_examples=examples(60), deadline=None)
@given(dtype=st.sampled_from(DTYPES), codec=st.sampled_from(["zstd", "lz4"]),
       shape=st.sampled_from([(1,), (4097,), (300_001,), (3, 5), (64, 1000), (70, 4480), (5, 7, 300)]),
       seed=st.integers(0, 2**32 - 1))
def test_encode_is_the_units_encoded_one_by_one(dtype, codec, shape, seed):
    """However encode() batches units (a block of them split into planes at once, a grid's cells
    gathered first), each unit's stored bytes are those of encode_unit on it alone, with the planes
    the dataset's first elements showed worth coding."""
    from ucl.store.codec import choose, encode_unit, unit_view
    arr = np.ascontiguousarray(_storage(dtype, shape, np.random.default_rng(seed)))
    got = encode(arr, dtype, codec)
    units = units_of(arr.shape, arr.itemsize, got.group)
    coding = choose(arr, dtype, codec)
    want = [encode_unit(unit_view(arr, units, u), dtype, arr.itemsize, codec, coding) for u in range(units.count)]
    assert got.stored.tobytes() == b"".join(want)
    assert got.ends.tolist() == np.cumsum([len(w) for w in want]).tolist()
