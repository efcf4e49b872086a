"""Tile digests only where a layout reads columns (docs/format.md, "Tile checksums"): a reshard's
target dataset of a tensor whose rule never splits or pads its last dim is only ever read in whole
rows, which flat chunks serve as finely, so it gets no tile table (a hash pass and a copy to tile
order saved per byte); a tensor split along its last dim keeps its tiles. The checkpoint is the
same either way for every reader: verified, bit for bit, column blocks read by tiles."""
from __future__ import annotations

import json
import os

import pytest

import ucl
from tests.test_checkpoint import M, assert_intact, demo, saved  # noqa: F401
from ucl.ops import IOStats
from ucl.store.tiles import tile_grid

# the demo's Megatron-style rules: linear_qkv and linear_fc1 split rows (dim 0, or a factor of it),
# linear_proj and linear_fc2 split columns (dim 1), the embedding pads and splits rows
ROWS = ("linear_qkv", "linear_fc1", "word_embeddings")
COLUMNS = ("linear_proj", "linear_fc2")


def tiled_entries(path) -> dict[str, bool]:
    """key -> whether its manifest entry has tiles, for every dataset the tile rule would give a grid."""
    out = {}
    for es in json.load(open(os.path.join(path, "manifest.json")))["datasets"]:
        for k, e in es.items():
            if tile_grid(tuple(e["shape"]), 4 if e["dtype"] == "float32" else 2) is not None:
                out[k] = "tiles" in e
    return out


@pytest.mark.parametrize("to", ["universal", "tp=4"])  # (a dp change carries the source's digests, tiles too)
@pytest.mark.parametrize("durable", [False, True])  # streamed through the page cache / assembled whole
def test_row_split_tensors_get_no_tiles_column_split_ones_keep_them(demo, saved, tmp_path, to, durable):
    model, truth = demo
    out = tmp_path / "out"
    ucl.reshard(saved("dp=2,tp=2"), out, to, workers=1, durable=durable)
    tiled = tiled_entries(out)
    rows = {k: v for k, v in tiled.items() if any(n in k for n in ROWS)}
    cols = {k: v for k, v in tiled.items() if any(n in k for n in COLUMNS)}
    assert rows and (cols or to != "universal"), tiled  # (tp=4's column blocks are too narrow for tiles)
    assert not any(rows.values()), rows
    assert all(cols.values()), cols
    assert_intact(out, model, truth, M(to) if to != "universal" else ucl.UNIVERSAL)


def test_column_blocks_of_the_target_still_read_only_their_tiles(demo, saved, tmp_path):
    """A tensor-parallel load of the resharded universal checkpoint reads about what it needs: the
    column-split weights by their tiles, the row-split ones by flat chunks."""
    out = tmp_path / "universal"
    ucl.reshard(saved("dp=2,tp=2"), out, "universal", workers=1, durable=False)
    for rank in range(4):
        st = IOStats()
        ucl.load_rank(out, mesh=M("tp=4"), rank=rank, stats=st)
        assert st.bytes_read <= 1.25 * st.bytes_needed, (rank, st.bytes_read, st.bytes_needed)


def test_cuts_last_dim_follows_the_rule():
    spec = ucl.load_spec("""
dims n, m
mesh tp
a [n, m] : split 1 over tp
b [n, m] : split 0 over tp
c [n, m] : pad 1 to multiple_of(8)
d [n, m] : view 0 as [2, n / 2]; split 0.1 over tp
e [n, m] : view 1 as [2, m / 2]; split 1.1 over tp
f [n]    : split 0 over tp
g [n, m] : replicate over tp
""")
    model = spec.bind({"n": 64, "m": 64}, {k: (64, 64) for k in "abcdeg"} | {"f": (64,)})
    cuts = {k: model.tensor(f"param/{k}").cuts_last_dim for k in "abcdefg"}
    assert cuts == {"a": True, "b": False, "c": True, "d": False, "e": True, "f": False, "g": False}
