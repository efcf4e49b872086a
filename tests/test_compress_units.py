"""Coded units of several checksum chunks or tile bands (docs/format.md, "Compressed datasets",
version 4): what a writer chooses, what a read of some rows or columns decodes, the ``group`` bound
to the frame table, and version-3 checkpoints (a unit per chunk or tile) still read."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

import ucl
from tests.test_compress import _storage, _write
from ucl.errors import StoreError
from ucl.store import Checkpoint
from ucl.store.codec import UNIT_BYTES, MAX_UNIT_BANDS, encode, group_for, units_of

V3 = Path(__file__).parent / "fixtures" / "compressed_v3"


def _v3_arrays() -> dict:
    spec = importlib.util.spec_from_file_location("make_v3", V3 / "make.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.arrays()


@pytest.mark.parametrize("codec", ["zstd", "lz4"])
def test_a_version_3_checkpoint_still_reads(codec, capsys):
    """Written by the last version-3 writer (tests/fixtures/compressed_v3/make.py): no ``group``, a
    unit per chunk or tile, the frame table bound without it. Read whole and in part, bit for bit,
    and verified."""
    want = _v3_arrays()
    with Checkpoint.open(V3 / codec) as c:
        assert c.manifest.version == 3 and c.verify() == []
        assert {c.info(0, k).group for k in c.keys(0)} == {None}
        assert {c.info(0, k).encoding for k in c.keys(0)} >= {codec}
        for key, (arr, _) in want.items():
            assert c.read(0, key).tobytes() == np.ascontiguousarray(arr).tobytes()
        w = want["param/w"][0]
        assert c.read_runs(0, "param/w", [(80, 96, 300, 90)], verify=True).tobytes() == \
            np.ascontiguousarray(w[:, 80:170]).tobytes()
        b = want["param/b"][0]
        assert c.read_flat(0, "param/b", 8191, 12_345).tobytes() == b[8191:12_345].tobytes()
    from ucl.cli import main
    assert main(["verify", str(V3 / codec)]) == 0


def test_the_writer_groups_units_up_to_its_target():
    """Units of at least UNIT_BYTES where the dataset has that many bytes; a tiled dataset's unit
    spans at most MAX_UNIT_BANDS tile bands, one tile column wide."""
    flat = units_of((1 << 20,), 4, group_for((1 << 20,), 4))  # 4 MiB of flat chunks
    assert flat.grid is None and flat.chunk >= UNIT_BYTES and flat.count == -(-4 * (1 << 20) // flat.chunk)
    shape = (4096, 4096)  # bf16, 32 MiB: a 32 x 32 grid of 32 KiB tiles
    g = group_for(shape, 2)
    base, units = units_of(shape, 2), units_of(shape, 2, g)
    assert g == MAX_UNIT_BANDS and units.grid.tile_rows == g * base.grid.tile_rows
    assert units.grid.tile_cols == base.grid.tile_cols and units.count == base.count // g
    assert group_for((3, 5), 4) == 1 and units_of((3, 5), 4).count == 1


def test_a_block_of_rows_or_columns_decodes_only_its_units(tmp_path):
    """A quarter of the rows (what a column-parallel TP rank loads) and a quarter of the columns
    (row-parallel) each read about a quarter of the stored bytes: units span whole tile bands
    and one tile column, and a 4-way split falls on their edges."""
    w = _storage("bfloat16", (2048, 1024), np.random.default_rng(4))  # 4 MiB: a 32 x 32 grid
    with _write(tmp_path / "x", {"param/w": (w, "bfloat16")}, "zstd") as c:
        info = c.info(0, "param/w")
        assert info.group > 1
        got = c.read_runs(0, "param/w", [(512 * 1024, 512, 1024, 1024)], verify=True)
        assert got.tobytes() == w[512:1024].tobytes()
        assert c.stored_read.stored <= 1.1 * info.stored / 4
    with Checkpoint.open(tmp_path / "x") as c:
        got = c.read_runs(0, "param/w", [(256, 2048, 1024, 256)], verify=True)
        assert got.tobytes() == np.ascontiguousarray(w[:, 256:512]).tobytes()
        assert c.stored_read.stored <= 1.1 * info.stored / 4


@pytest.mark.parametrize("group", [2, 1, 64])
def test_a_group_the_frame_table_was_not_made_for_is_refused(tmp_path, group):
    w = _storage("float32", (512, 512), np.random.default_rng(6))
    _write(tmp_path / "x", {"param/w": (w, "float32")}, "zstd").close()
    m = json.load(open(tmp_path / "x" / "manifest.json"))
    e = m["datasets"][0]["param/w"]
    assert e["group"] != group
    e["group"] = group
    (tmp_path / "x" / "manifest.json").write_text(json.dumps(m))
    with Checkpoint.open(tmp_path / "x") as c, pytest.raises(StoreError) as err:
        c.read(0, "param/w")
    assert err.value.code in ("UCL406", "UCL407")


@pytest.mark.parametrize("bad", [0, -1, 1.5, "4", 1 << 21])
def test_a_malformed_group_is_refused_on_open(tmp_path, bad):
    w = _storage("float32", (512, 512), np.random.default_rng(6))
    _write(tmp_path / "x", {"param/w": (w, "float32")}, "zstd").close()
    m = json.load(open(tmp_path / "x" / "manifest.json"))
    m["datasets"][0]["param/w"]["group"] = bad
    (tmp_path / "x" / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(StoreError) as err:
        Checkpoint.open(tmp_path / "x")
    assert err.value.code == "UCL403"


def test_threads_code_the_same_bytes():
    from concurrent.futures import ThreadPoolExecutor
    w = _storage("float32", (1024, 1024), np.random.default_rng(8))
    one = encode(w, "float32", "zstd")
    with ThreadPoolExecutor(3) as pool:
        many = encode(w, "float32", "zstd", pool)
    assert many.stored.tobytes() == one.stored.tobytes() and many.ends.tolist() == one.ends.tolist()
    assert many.digests.tolist() == one.digests.tolist()


def test_a_plain_entry_with_a_group_is_malformed(tmp_path):
    w = _storage("float32", (64, 64), np.random.default_rng(6))
    _write(tmp_path / "x", {"param/w": (w, "float32")}, None).close()
    m = json.load(open(tmp_path / "x" / "manifest.json"))
    m["datasets"][0]["param/w"]["group"] = 2
    (tmp_path / "x" / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(StoreError) as err:
        Checkpoint.open(tmp_path / "x")
    assert err.value.code == "UCL403"


def test_cli_import_compress(tmp_path, capsys):
    """``ucl import --compress`` writes the imported copy compressed; it reads back like the plain one."""
    from ucl.cli import main
    fixture = Path(__file__).parent / "fixtures" / "megatron" / "tp2_dp2_optim"
    assert main(["import", str(fixture), str(tmp_path / "z"), "--compress", "zstd", "--quiet"]) == 0
    assert main(["import", str(fixture), str(tmp_path / "p"), "--quiet"]) == 0
    capsys.readouterr()
    with ucl.open(tmp_path / "z") as z, ucl.open(tmp_path / "p") as p:
        assert z.manifest.version == 5 and z.verify() == []
        assert any(z.info(r, k).encoding == "zstd" for r in range(z.nranks) for k in z.keys(r))
        assert {(r, k): z.read(r, k).tobytes() for r in range(z.nranks) for k in z.keys(r)} == \
            {(r, k): p.read(r, k).tobytes() for r in range(p.nranks) for k in p.keys(r)}
