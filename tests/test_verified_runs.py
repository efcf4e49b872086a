"""Verified reads of strided runs (``Checkpoint.read_runs(verify=True)`` on a flat dataset: the
checksum chunks around the runs are read, checked, and the runs cut out of them), as the reshard's
streamed path issues them: one reader, box after box, so the chunks a box shares with the previous
one come from the reader's cache of verified chunks and the rest from the file."""
from __future__ import annotations

import shutil

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.passes import examples
from ucl.errors import StoreError
from ucl.store import Checkpoint, CheckpointWriter

PER = 4096  # float32 elements per checksum chunk of a 4 MiB dataset (256 chunks)
SIZE = 1 << 20


@pytest.fixture(scope="module")
def flat(tmp_path_factory):
    data = np.arange(SIZE, dtype=np.float32)
    path = tmp_path_factory.mktemp("runs") / "c"
    with CheckpointWriter(path, 1) as w:
        w.write(0, "exp_avg/@flat0", data)
        w.commit()
    return path, data


def _select(data: np.ndarray, runs) -> np.ndarray:
    return np.concatenate([data[s + i * st:s + i * st + b] for s, c, st, b in runs for i in range(c)])


def _touched(runs) -> set[int]:
    """The chunks the runs touch, element by element (the reference)."""
    out: set[int] = set()
    for s, c, st, b in runs:
        for i in range(c):
            out.update(range((s + i * st) // PER, (s + i * st + b - 1) // PER + 1))
    return out


@st.composite
def boxes(draw):
    """Boxes as regular runs, in increasing order: gaps both shorter and longer than a chunk."""
    out, pos = [], draw(st.integers(0, 3 * PER))
    for _ in range(draw(st.integers(1, 6))):
        runs = []
        for _ in range(draw(st.integers(1, 3))):
            block = draw(st.integers(1, 3 * PER))
            stride = block + draw(st.sampled_from([0, 1, 100, PER - 1, PER, 2 * PER + 5]))
            count = draw(st.integers(1, 6))
            if pos + (count - 1) * stride + block > SIZE:
                break
            runs.append((pos, count, stride, block))
            pos += (count - 1) * stride + block + draw(st.sampled_from([0, 7, PER]))
        if runs:
            out.append(runs)
        pos = max(0, pos - draw(st.sampled_from([0, PER // 2, 2 * PER])))  # the next box may share chunks
    return out


@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seq=boxes())
def test_verified_runs_equal_numpy_box_after_box(flat, seq):
    """Each box's elements equal numpy's, and a reader read from disk only chunks the box touches
    (cached ones not again): whether the chunks it needs are all missing, partly cached, or not one
    stretch."""
    path, data = flat
    with Checkpoint.open(path) as c:
        for runs in seq:
            got = c.read_runs(0, "exp_avg/@flat0", runs, verify=True)
            assert np.array_equal(got, _select(data, runs))
            assert c.bytes_last_read <= 4 * PER * len(_touched(runs))
    with Checkpoint.open(path) as fresh:  # nothing cached: exactly the chunks touched are read
        for runs in seq[:1]:
            fresh.read_runs(0, "exp_avg/@flat0", runs, verify=True)
            assert fresh.bytes_last_read == 4 * PER * len(_touched(runs))


@pytest.mark.parametrize("gap", [100, 2 * PER + 5])
def test_a_flipped_byte_beside_a_cached_chunk_is_refused(flat, tmp_path, gap):
    """A box whose first chunk the reader verified already (and keeps) and whose next chunks are read
    now: a flipped byte in those is still refused, named by its chunk."""
    path, data = flat
    bad = tmp_path / "c"
    shutil.copytree(path, bad)
    f = bad / "rank_00000.h5"
    raw = bytearray(f.read_bytes())
    at = raw.find(data[:4096].tobytes()) + 4 * (PER * 3 + 10)  # chunk 3
    raw[at] ^= 0x01
    f.write_bytes(bytes(raw))
    with Checkpoint.open(bad) as c:
        first = [(PER - 64, 1, 128, 128)]  # chunks 0 and 1, both kept as edges
        assert np.array_equal(c.read_runs(0, "exp_avg/@flat0", first, verify=True), _select(data, first))
        with pytest.raises(StoreError, match=rf"elements {3 * PER}\.\.{4 * PER}\)") as e:
            c.read_runs(0, "exp_avg/@flat0", [(PER + 5, (2 * PER + 45) // (40 + gap) + 2, 40 + gap, 40)], verify=True)
        assert e.value.code == "UCL407"
