"""The byte-plane kernels the codec runs (ucl/store/planes.py) against the rule as stated
(``split_planes``: rotate, then gather each byte), on arbitrary bits (signs, NaNs, subnormals) and
sizes on both sides of the float32 join's switch to halves; and the per-thread scratch buffers
they reuse never carry bytes from one unit into another."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
from hypothesis import given, settings, strategies as st

import ucl.store.planes as planes
from tests.passes import examples
from tests.test_compress import _storage
from ucl.store.codec import choose, decode_unit, encode, encode_unit, unit_view, units_of
from ucl.store.planes import join_into, plane_into, planes_of, split_planes

SPLIT = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8, "int64": 8, "int32": 4, "uint16": 2, "uint8": 1}
HALVES = (1 << 17) // 4  # float32 elements from which join_into works by 16-bit halves


def _bits(n: int, itemsize: int, seed: int) -> np.ndarray:
    """``n`` elements of random bits (every sign, exponent and mantissa pattern), as uint8."""
    return np.random.default_rng(seed).integers(0, 256, n * itemsize, dtype=np.uint8)


@settings(max_examples=examples(80), deadline=None)
@given(dtype=st.sampled_from(sorted(SPLIT)), seed=st.integers(0, 2**32 - 1),
       n=st.one_of(st.integers(0, 300), st.integers(HALVES - 3, HALVES + 3), st.integers(300, 70_000)))
def test_the_kernels_are_the_rule(dtype, seed, n):
    k = SPLIT[dtype]
    raw = _bits(n, k, seed)
    want = split_planes(raw, dtype, k)
    assert planes_of(dtype, k) == len(want) == k
    x = raw.view(f"<u{k}" if k > 1 else np.uint8)
    for p in range(k):
        got = np.full(n, 0xA5, np.uint8)
        plane_into(x, dtype, p, got)
        assert got.tobytes() == want[p].tobytes(), p
    out = np.full(raw.size, 0x5A, np.uint8)
    join_into(want, dtype, out)
    assert out.tobytes() == raw.tobytes()


def _poison(seed: int) -> None:
    """Fill every scratch buffer this thread holds with noise."""
    rng = np.random.default_rng(seed)
    for buf in getattr(planes._LOCAL, "scratch", {}).values():
        buf[...] = rng.integers(0, 256, buf.size, dtype=np.uint8)


@settings(max_examples=examples(40), deadline=None)
@given(steps=st.lists(st.tuples(st.sampled_from(["float32", "bfloat16", "float64", "int32", "uint8"]),
                                st.sampled_from([(1,), (5000,), (40_000,), (300_001,), (96, 3000), (64, 1000)]),
                                st.sampled_from(["zstd", "lz4"]), st.integers(0, 2**32 - 1)),
                      min_size=2, max_size=5))
def test_scratch_never_carries_bytes_between_units(steps):
    """Datasets of different sizes and dtypes coded and decoded one after the other in one thread,
    the thread's scratch filled with noise before each: every unit's stored bytes are those of
    encode_unit on it alone and decode to the unit's bytes."""
    for dtype, shape, codec, seed in steps:
        arr = np.ascontiguousarray(_storage(dtype, shape, np.random.default_rng(seed)))
        _poison(seed)
        got = encode(arr, dtype, codec)
        units = units_of(arr.shape, arr.itemsize, got.group)
        coding = choose(arr, dtype, codec)
        view, lo = memoryview(got.stored), 0
        for u in range(units.count):
            unit = unit_view(arr, units, u)
            hi = int(got.ends[u])
            assert got.stored[lo:hi].tobytes() == encode_unit(unit, dtype, arr.itemsize, codec, coding)
            _poison(seed + u)
            out = np.empty(unit.size, np.uint8)
            decode_unit(view[lo:hi], out.size, dtype, arr.itemsize, codec, out, str)
            assert out.tobytes() == unit.tobytes()
            lo = hi


def test_threads_keep_their_own_scratch():
    """Four threads coding and decoding datasets of different sizes at once agree with one thread."""
    rng = np.random.default_rng(3)
    jobs = [(np.ascontiguousarray(_storage(d, s, rng)), d) for d, s in
            [("float32", (512, 700)), ("bfloat16", (300_001,)), ("float32", (40_000,)), ("float64", (64, 1000))] * 3]
    alone = [encode(a, d, "zstd").stored.tobytes() for a, d in jobs]

    def both(job):
        a, d = job
        e = encode(a, d, "zstd")
        units = units_of(a.shape, a.itemsize, e.group)
        view, lo, back = memoryview(e.stored), 0, []
        for u in range(units.count):
            out = np.empty(units.unit_bytes(u), np.uint8)
            decode_unit(view[lo:int(e.ends[u])], out.size, d, a.itemsize, "zstd", out, str)
            back.append(out.tobytes() == unit_view(a, units, u).tobytes())
            lo = int(e.ends[u])
        return e.stored.tobytes(), all(back)

    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(both, jobs))
    assert [g[0] for g in got] == alone and all(g[1] for g in got)
