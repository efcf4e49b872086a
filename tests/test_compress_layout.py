"""Plane layout 1 of the compressed encoding (docs/format.md, "Compressed datasets", version 5):
the kernels against the rule as stated, round trips of whole datasets and hyperslabs in both
layouts over dtypes, signs (non-negative, mixed, -0.0, inf/nan, subnormals), shapes and unit sizes,
the writer's choice of layout, version-4 checkpoints still read, and hostile layout headers."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import ucl.store.codec as codec
from tests.passes import examples
from tests.test_compress import _forge, _packed_file, _write, decode_mutated
from ucl.errors import StoreError
from ucl.store import Checkpoint
from ucl.store.codec import LAYOUT_BYTES, Coding, choose, decode_unit, encode, encode_unit, unit_view, units_of
from ucl.store.planes import join_into, offset_elements, plane_into, split_planes

V4 = Path(__file__).parent / "fixtures" / "compressed_v4"
HALVES = (1 << 17) // 4  # float32 elements from which join_into works by 16-bit halves
KINDS = ["nonneg", "mixed", "negzero", "special", "subnormal", "bits"]
WIDTH = {"float32": 4, "bfloat16": 2, "float16": 2}


def _values(kind: str, dtype: str, n: int, rng) -> np.ndarray:
    """``n`` storage elements of ``dtype`` (float32, or the uint16 bits of bfloat16, or float16)."""
    if kind == "bits":
        return rng.integers(0, 256, n * WIDTH[dtype], dtype=np.uint8).view(np.float32 if dtype == "float32" else
                                                                          np.uint16 if dtype == "bfloat16" else
                                                                          np.float16)
    x = (rng.standard_normal((n, 8)) ** 2).mean(axis=1) * 1e-6  # like exp_avg_sq: a mean of squares
    if kind == "mixed":
        x = rng.standard_normal(n) * 0.02
    elif kind == "negzero":
        x[rng.random(n) < 0.1] = -0.0
    elif kind == "special":
        hit = rng.random(n) < 0.1
        x[hit] = rng.choice([np.inf, -np.inf, np.nan], int(hit.sum()))
    elif kind == "subnormal":
        x = x * (1e-36 if dtype != "float16" else 1e-1)  # below float32's (and bf16's) or float16's normals
    if dtype == "float16":
        return x.astype(np.float16)
    f = x.astype(np.float32)
    return f if dtype == "float32" else (f.view(np.uint32) >> 16).astype(np.uint16)


@settings(max_examples=examples(80), deadline=None)
@given(dtype=st.sampled_from(["float32", "bfloat16"]), seed=st.integers(0, 2**32 - 1),
       offset=st.one_of(st.sampled_from([0, 1, 16, 31, 255]), st.integers(0, 255)),
       n=st.one_of(st.integers(0, 300), st.integers(HALVES - 3, HALVES + 3), st.integers(300, 70_000)))
def test_the_layout_1_kernels_are_the_rule(dtype, seed, offset, n):
    """Arbitrary bits (every sign, exponent and mantissa pattern): the planes the codec makes and
    joins are those of split_planes (offset modulo 2**bits, rotate by four, gather the bytes)."""
    k = WIDTH[dtype]
    raw = np.random.default_rng(seed).integers(0, 256, n * k, dtype=np.uint8)
    want = split_planes(raw, dtype, k, 1, offset)
    elems = raw.view(f"<u{k}")
    y = ((elems.astype(np.uint64) + (offset << (8 * k - 9))) % (1 << 8 * k)).astype(elems.dtype)
    z = (y << elems.dtype.type(4)) | (y >> elems.dtype.type(8 * k - 4))  # stated apart from planes.rotate
    assert [p.tobytes() for p in want] == [np.ascontiguousarray(z.view(np.uint8).reshape(-1, k)[:, k - 1 - p])
                                           .tobytes() for p in range(k)]
    x = offset_elements(elems, offset)
    for p in range(k):
        got = np.full(n, 0xA5, np.uint8)
        plane_into(x, dtype, p, got, 1)
        assert got.tobytes() == want[p].tobytes(), p
    out = np.full(raw.size, 0x5A, np.uint8)
    join_into(want, dtype, out, 1, offset)
    assert out.tobytes() == raw.tobytes()


def _forced(dtype: str, layout: int, offset: int, tries):
    """choose() replaced: every dataset coded in ``layout`` where its dtype has it."""
    def choose(arr, dt, name, units=None):
        k = arr.itemsize if dt in WIDTH else 1
        return Coding(tuple(tries[:k]) + (True,) * (k - len(tries[:k])), layout if dt in ("float32", "bfloat16")
                      else 0, offset)
    return choose


@settings(max_examples=examples(80), deadline=None)
@given(dtype=st.sampled_from(sorted(WIDTH)), kind=st.sampled_from(KINDS), name=st.sampled_from(["zstd", "lz4"]),
       layout=st.sampled_from([0, 1]), offset=st.integers(0, 255), tries=st.lists(st.booleans(), min_size=4,
                                                                                    max_size=4),
       shape=st.sampled_from([(1,), (5000,), (40_001,), (3, 5), (64, 1000), (96, 3000), (2, 3, 700)]),
       unit=st.sampled_from([16 << 10, 256 << 10]), data=st.data())
def test_round_trip_whole_and_hyperslabs_in_both_layouts(tmp_path_factory, dtype, kind, name, layout, offset, tries,
                                                         shape, unit, data):
    arr = _values(kind, dtype, int(np.prod(shape)), np.random.default_rng(data.draw(st.integers(0, 2**32 - 1))))
    arr = arr.reshape(shape)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(codec, "choose", _forced(dtype, layout, offset, tries))
        mp.setattr(codec, "UNIT_BYTES", unit)
        c = _write(tmp_path_factory.mktemp("c") / "x", {"param/x": (arr, dtype)}, name)
    with c:
        assert c.read(0, "param/x").tobytes() == arr.tobytes()
        assert c.verify() == []
        starts = tuple(data.draw(st.integers(0, s - 1)) for s in shape)
        sizes = tuple(data.draw(st.integers(1, s - a)) for a, s in zip(starts, shape))
        box = tuple(slice(a, a + z) for a, z in zip(starts, sizes))
        assert c.read_box(0, "param/x", starts, sizes).tobytes() == np.ascontiguousarray(arr[box]).tobytes()
        if len(shape) >= 2:
            cols, rows = shape[-1], int(np.prod(shape[:-1]))
            c0 = data.draw(st.integers(0, cols - 1))
            c1 = data.draw(st.integers(c0 + 1, cols))
            got = c.read_runs(0, "param/x", [(c0, rows, cols, c1 - c0)], verify=True)
            assert got.tobytes() == np.ascontiguousarray(arr.reshape(rows, cols)[:, c0:c1]).tobytes()
        a = data.draw(st.integers(0, arr.size - 1))
        b = data.draw(st.integers(a + 1, arr.size))
        assert c.read_flat(0, "param/x", a, b).tobytes() == arr.reshape(-1)[a:b].tobytes()


@settings(max_examples=examples(40), deadline=None)
@given(dtype=st.sampled_from(sorted(WIDTH)), kind=st.sampled_from(KINDS), name=st.sampled_from(["zstd", "lz4"]),
       shape=st.sampled_from([(1,), (4097,), (300_001,), (64, 1000), (70, 4480)]), seed=st.integers(0, 2**32 - 1))
def test_encode_is_the_units_encoded_one_by_one_in_the_layout_chosen(dtype, kind, name, shape, seed):
    """However encode() batches units, each unit's stored bytes are encode_unit's on it alone with
    choose()'s coding: a layout header on every unit of layout 1, none in layout 0."""
    arr = _values(kind, dtype, int(np.prod(shape)), np.random.default_rng(seed)).reshape(shape)
    got = encode(arr, dtype, name)
    units = units_of(arr.shape, arr.itemsize, got.group)
    coding = choose(arr, dtype, name)
    want = [encode_unit(unit_view(arr, units, u), dtype, arr.itemsize, name, coding) for u in range(units.count)]
    assert got.stored.tobytes() == b"".join(want)
    assert {w[:4] == b"\0\0\0\x80" for w in want} == {bool(coding.layout)}


def _headers(enc) -> list[tuple[int, int]]:
    """(layout, offset) of each unit of an encoded dataset, from its stored bytes."""
    starts = np.concatenate([[0], enc.ends[:-1]]).astype(int)
    return [(int.from_bytes(h[4:6], "little"), int.from_bytes(h[6:8], "little")) if h[:4] == b"\0\0\0\x80"
            else (0, 0) for h in (enc.stored[a:a + 8].tobytes() for a in starts)]


def test_the_writer_takes_layout_1_for_non_negative_floats_only():
    """Layout 1 where no sign bit is set and it codes smaller (a mean of squares, like exp_avg_sq,
    in float32 and bfloat16), never for signed values, for float16, or where one element of the
    first unit is negative; its offset, in every unit's header, puts the median exponent of evenly
    spaced elements of the first unit at 16 of a window of 32."""
    rng = np.random.default_rng(9)
    for dtype in ("float32", "bfloat16"):
        sq = _values("nonneg", dtype, 1 << 18, rng)
        got = choose(sq, dtype, "zstd")
        assert got.layout == 1 and got.tries[0]
        enc = encode(sq, dtype, "zstd")
        units = units_of(sq.shape, sq.itemsize, enc.group)
        assert units.count > 1 and set(_headers(enc)) == {(1, got.offset)}
        x = unit_view(sq, units, 0).view(f"<u{sq.itemsize}")
        e = np.sort(x[::max(1, x.size // 1024)] >> (8 * sq.itemsize - 9))
        assert (int(e[e.size // 2]) + got.offset) % 32 == 16
        one = sq.copy()
        one[100] = -one[100] if dtype == "float32" else one[100] | 0x8000
        assert choose(one, dtype, "zstd").layout == 0
        assert choose(_values("mixed", dtype, 1 << 16, rng), dtype, "zstd").layout == 0
        assert enc.stored.size < encode(one, dtype, "zstd").stored.size
    assert choose(_values("nonneg", "float16", 1 << 16, rng), "float16", "zstd").layout == 0


def _v4_arrays() -> dict:
    spec = importlib.util.spec_from_file_location("make_v4", V4 / "make.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.arrays()


@pytest.mark.parametrize("name", ["zstd", "lz4"])
def test_a_version_4_checkpoint_still_reads(name):
    """Written by the last version-4 writer (tests/fixtures/compressed_v4/make.py): no unit has a
    layout header, non-negative datasets included. Read whole and in part, bit for bit, verified;
    today's writer stores the same non-negative dataset in layout 1, and both read the same."""
    want = _v4_arrays()
    with Checkpoint.open(V4 / name) as c:
        assert c.manifest.version == 4 and c.verify() == []
        assert {c.info(0, k).encoding for k in c.keys(0)} >= {name}
        for key, (arr, _) in want.items():
            assert c.read(0, key).tobytes() == np.ascontiguousarray(arr).tobytes()
        sq = want["state/sq"][0]
        assert c.read_runs(0, "state/sq", [(80, 64, 256, 90)], verify=True).tobytes() == \
            np.ascontiguousarray(sq[:, 80:170]).tobytes()
        b = want["param/b"][0]
        assert c.read_flat(0, "param/b", 8191, 12_345).tobytes() == b[8191:12_345].tobytes()
    from ucl.cli import main
    assert main(["verify", str(V4 / name)]) == 0


def _first_unit_forged(tmp_path, header: bytes, dtype="float32"):
    """The test file's dataset with its first unit given ``header`` before its planes, its second
    cut by as many bytes (the stored bytes keep their length; frame table and manifest made to
    agree: a hostile writer)."""
    path, m, e, w = _packed_file(tmp_path)
    good = encode(w, "float32", "zstd")
    parts = [bytes(good.stored[int(a):int(b)]) for a, b in zip(np.concatenate([[0], good.ends[:-1]]), good.ends)]
    assert parts[0][:4] != b"\0\0\0\x80"  # signed weights: layout 0
    _forge(path, m, e, [header + parts[0], parts[1][:-len(header)]] + parts[2:])
    return path


@pytest.mark.parametrize("header,says", [
    ((1 << 31).to_bytes(4, "little") + (2).to_bytes(2, "little") + bytes(2), "unknown plane layout 2"),
    ((1 << 31).to_bytes(4, "little") + bytes(4), "unknown plane layout 0"),
    ((1 << 31).to_bytes(4, "little") + (1).to_bytes(2, "little") + (256).to_bytes(2, "little"),
     "layout offset 256 out of range"),
])
def test_a_hostile_layout_header_is_refused_naming_the_unit(tmp_path, header, says):
    path = _first_unit_forged(tmp_path, header)
    with Checkpoint.open(path) as c:
        with pytest.raises(StoreError) as err:
            c.read(0, "param/w")
        assert err.value.code == "UCL406" and "unit 0" in str(err.value) and says in str(err.value)
        # a column block away from the forged unit reads clean: only its own units are decoded
        assert c.read_runs(0, "param/w", [(192, 256, 256, 64)], verify=True).size == 256 * 64


@pytest.mark.parametrize("dtype", ["float16", "float64", "int32", "uint8"])
def test_layout_1_is_refused_for_a_dtype_without_it(dtype):
    """A layout header on a unit whose dtype has no layout 1, and one cut short, are refused
    (UCL406) before any plane is read or anything allocated for it."""
    k = {"float16": 2, "float64": 8, "int32": 4, "uint8": 1}[dtype]
    raw = np.arange(64 * k, dtype=np.uint8)
    unit = Coding(None, 1, 3).header() + encode_unit(raw, dtype, k, "zstd")
    out = np.empty(raw.size, np.uint8)
    with pytest.raises(StoreError) as err:
        decode_unit(memoryview(unit), out.size, dtype, k, "zstd", out, lambda: "unit 7")
    assert err.value.code == "UCL406" and "unit 7" in str(err.value) and "unknown plane layout 1" in str(err.value)
    with pytest.raises(StoreError) as err:
        decode_unit(memoryview(unit[:LAYOUT_BYTES - 1]), out.size, "float32", 4, "zstd", out, lambda: "unit 7")
    assert err.value.code == "UCL406" and "unit 7" in str(err.value)


@settings(max_examples=examples(200), deadline=None)
@given(name=st.sampled_from(["zstd", "lz4"]), dtype=st.sampled_from(["float32", "bfloat16"]),
       flips=st.lists(st.tuples(st.integers(0, 10**6), st.integers(1, 255)), min_size=1, max_size=6),
       cut=st.integers(0, 3))
def test_a_mutated_layout_1_unit_decodes_or_fails_with_a_ucl_error(name, dtype, flips, cut):
    """The decoder on hostile bytes of a layout-1 unit (digest checks aside): UCL406 naming the
    unit, or bytes of exactly the unit's length; never another exception."""
    arr = _values("nonneg", dtype, 4096, np.random.default_rng(7))
    coding = choose(arr, dtype, name)
    decode_mutated(encode_unit(arr.view(np.uint8), dtype, arr.itemsize, name, Coding(coding.tries, 1, 17)),
                   flips, cut, arr, dtype, name)


def test_a_compressed_checkpoint_is_version_5(tmp_path):
    sq = _values("nonneg", "float32", 1 << 16, np.random.default_rng(2))
    with _write(tmp_path / "x", {"state/sq": (sq, "float32")}, "zstd") as c:
        assert c.manifest.version == 5 and c.read(0, "state/sq").tobytes() == sq.tobytes()
    assert json.load(open(tmp_path / "x" / "manifest.json"))["version"] == 5


@pytest.mark.parametrize("version", [3, 4])
def test_a_layout_header_under_an_older_version_is_refused(tmp_path, version):
    """Layout headers came with version 5: a manifest edited to say 4 (which its readers refuse to read
    past the header) must not read, nor verify clean, here either."""
    sq = _values("nonneg", "float32", 1 << 16, np.random.default_rng(2))
    _write(tmp_path / "x", {"state/sq": (sq, "float32")}, "zstd").close()
    m = json.load(open(tmp_path / "x" / "manifest.json"))
    assert _headers_in(tmp_path / "x", m), "the writer should have taken layout 1 here"
    m["version"] = version
    (tmp_path / "x" / "manifest.json").write_text(json.dumps(m))
    with Checkpoint.open(tmp_path / "x") as c:
        with pytest.raises(StoreError, match="unit 0: starts with a layout header") as e:
            c.read(0, "state/sq")
        assert e.value.code == "UCL406"
        assert c.verify()


def _headers_in(path: Path, m: dict) -> bool:
    e = m["datasets"][0]["state/sq"]
    with open(path / "rank_00000.h5", "rb") as f:
        f.seek(e["offset"])
        return f.read(4) == b"\x00\x00\x00\x80"


def test_a_dataset_whose_plane_would_pass_2_gib_is_refused_before_coding():
    """A plane header records its length in 31 bits: a unit whose plane would hold 2**31 bytes or more
    (one huge row of bytes) cannot be written; nothing is read or allocated (a zero-stride array)."""
    huge = np.broadcast_to(np.zeros(1, np.uint8), (1, 1 << 36))  # 32 tiles of 2 GiB
    with pytest.raises(StoreError, match="save it with compress='none'") as e:
        encode(huge, "uint8", "zstd")
    assert e.value.code == "UCL418"
