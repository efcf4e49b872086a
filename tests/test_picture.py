"""Layout pictures (ucl.picture): the geometry they are drawn from, checked against layouts worked
out by hand, and the PNG files themselves.

The demo model (``ucl.demo``): vocab=1000 padded to a multiple of 128 * tp, hidden=256, ffn=704
with fc1 = [gate; up] viewed as [2, ffn] and split 0.1 over tp, layernorms replicated over tp,
fp32/exp_avg/exp_avg_sq in ZeRO-1 flat buffers over dp, a scalar int64 step per parameter.
"""
from __future__ import annotations

import struct
import subprocess
import sys

import numpy as np
import pytest

import ucl
from ucl.demo import llama_model, universal_state
from ucl.errors import PlanError, UclError
from ucl.layout import Mesh
from ucl.picture import Box, flat_buffer, layout_boxes, ranks_text

FC1 = "decoder.layers.0.mlp.linear_fc1.weight"
LN = "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight"


@pytest.fixture(scope="module")
def model():
    return llama_model()


def coverage(boxes: list[Box], shape: tuple[int, ...]) -> np.ndarray:
    """How many ranks hold each element of the real (unpadded) tensor, from the boxes."""
    count = np.zeros(shape, dtype=np.int64)
    for b in boxes:
        if not b.padding:
            count[tuple(slice(s, e) for s, e in zip(b.start, b.stop))] += len(b.ranks)
    return count


def png_size(path) -> tuple[int, int]:
    data = open(path, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", "not a PNG file"
    return struct.unpack(">II", data[16:24])


# ---------------------------------------------------------------- geometry

def test_padded_vocab_rows_past_the_real_extent(model):
    """Mesh(tp=2): 1000 rows padded to 1024 (a multiple of 256); rank 0 holds rows 0..512, rank 1
    rows 512..1000 and 24 padding rows 1000..1024."""
    boxes = layout_boxes(model, Mesh(tp=2), "output_layer.weight")
    assert boxes == [Box((0, 0), (512, 256), (0,)), Box((512, 0), (1000, 256), (1,)),
                     Box((1000, 0), (1024, 256), (1,), padding=True)]


def test_padding_with_tp4_lands_on_the_last_rank(model):
    boxes = layout_boxes(model, "tp=4", "embedding.word_embeddings.weight")  # 1000 -> 1024, 256 rows each
    pads = [b for b in boxes if b.padding]
    assert pads == [Box((1000, 0), (1024, 256), (3,), padding=True)]
    assert [b.start[0] for b in boxes if not b.padding] == [0, 256, 512, 768]
    assert (coverage(boxes, (1000, 256)) == 1).all()


def test_padding_under_a_view_is_placed_where_the_padded_dim_has_it():
    """pad 6 rows to 8, view as [2, 4], split the 4 over tp=2: rank 0 holds padded rows {0,1,4,5},
    rank 1 {2,3,6,7}, of which 6 and 7 are padding. A concat split gives [q_r; k_r]."""
    spec = ucl.load_spec("dims n\nmesh tp\n"
                         "w [n, 4] : pad 0 to 8; view 0 as [2, 4]; split 0.1 over tp\n"
                         "c [6, 2] : concat 0 as [q = 4, k = 2]; split 0 over tp\n")
    model = spec.bind({"n": 6}, {"w": (6, 4), "c": (6, 2)})
    assert [(b.start[0], b.stop[0], b.ranks, b.padding) for b in layout_boxes(model, "tp=2", "w")] == [
        (0, 2, (0,), False), (2, 4, (1,), False), (4, 6, (0,), False), (6, 8, (1,), True)]
    assert [(b.start[0], b.stop[0], b.ranks) for b in layout_boxes(model, "tp=2", "c")] == [
        (0, 2, (0,)), (2, 4, (1,)), (4, 5, (0,)), (5, 6, (1,))]


def test_padded_flat_state_keeps_its_padding_rows(model):
    boxes = layout_boxes(model, "tp=2,dp=2", "output_layer.weight", "fp32")  # tp slowest: tp=1 is ranks 2, 3
    pads = [b for b in boxes if b.padding]
    assert sum(b.stop[0] - b.start[0] for b in pads) == 24 and {r for b in pads for r in b.ranks} <= {2, 3}
    assert all(b.start[0] >= 1000 and b.stop[0] <= 1024 and (b.start[1], b.stop[1]) == (0, 256) for b in pads)


def test_swiglu_view_split_gives_each_rank_a_gate_and_an_up_block(model):
    """fc1 [2 * 704, 256] viewed as [2, 704], split 0.1 over tp=2: rank r holds gate rows
    [352 r, 352 (r + 1)) and up rows 704 + the same."""
    boxes = layout_boxes(model, Mesh(tp=2), FC1)
    by_rank = {r: sorted((b.start[0], b.stop[0]) for b in boxes if b.ranks == (r,)) for r in (0, 1)}
    assert by_rank == {0: [(0, 352), (704, 1056)], 1: [(352, 704), (1056, 1408)]}
    assert all((b.start[1], b.stop[1]) == (0, 256) and not b.padding for b in boxes)


def test_replicas_are_one_box_listing_every_rank(model):
    assert layout_boxes(model, Mesh(tp=2), LN) == [Box((0,), (256,), (0, 1))]
    # over dp as well: fc1's boxes are each held by the two dp replicas of one tp rank
    mesh = Mesh(dp=2, tp=2)
    assert {b.ranks for b in layout_boxes(model, mesh, FC1)} == {(0, 2), (1, 3)}
    assert ranks_text((0, 1, 2, 3)) == "r0-3" and ranks_text((0, 2)) == "r0,2" and ranks_text((0, 1)) == "r0,1" and ranks_text((5,)) == "r5"


def test_pipeline_placement_only_the_owning_stage_holds_it(model):
    mesh = Mesh(pp=2, tp=2)
    assert {r for b in layout_boxes(model, mesh, "output_layer.weight") for r in b.ranks} == {2, 3}
    assert {r for b in layout_boxes(model, mesh, "embedding.word_embeddings.weight") for r in b.ranks} == {0, 1}


def test_scalar_is_one_cell_held_by_its_stage(model):
    assert layout_boxes(model, Mesh(pp=2, dp=2), "output_layer.weight", "step") == [Box((), (), (2, 3))]


@pytest.mark.parametrize("mesh", ["dp=2", "dp=4", "pp=2,dp=2,tp=2"])
@pytest.mark.parametrize("name", ["output_layer.weight", FC1, LN])
def test_flat_buffer_elements_each_held_by_one_dp_partition(model, mesh, name):
    """ZeRO-1: every element of a tp rank's shard of fp32/NAME lies in exactly one dp partition,
    so it is held by exactly one rank with that tp coordinate (the union covers the shard)."""
    mesh = Mesh.parse(mesh)
    boxes = layout_boxes(model, mesh, name, "fp32")
    tp = mesh.axis_size("tp")
    rows = np.arange(model.params[name][0])
    shard_of_row = {"output_layer.weight": rows // (1024 // tp),  # padded to 1024, split 0 over tp
                    FC1: (rows % 704) // (704 // tp),  # [gate; up], each split over tp
                    LN: None}[name]  # replicated over tp: every tp rank's buffer has all of it
    for c in range(tp):
        mine = [Box(b.start, b.stop, tuple(r for r in b.ranks if mesh.coords(r).get("tp", 0) == c), b.padding)
                for b in boxes]
        expected = np.ones(model.params[name], dtype=np.int64)
        if shard_of_row is not None:
            expected[shard_of_row != c] = 0
        assert (coverage(mine, model.params[name]) == expected).all()


def test_flat_buffer_with_dp2_cuts_the_buffer_in_two(model):
    buf = flat_buffer(model, Mesh(dp=2), FC1, "fp32")
    assert buf.key == "fp32/@flat0" and buf.axes == ("dp",) and buf.partition_ranks == [(0,), (1,)]
    members = {s.name for s in buf.spans if s.name}
    assert members == set(model.params)  # one buffer holds every parameter on a mesh without pp/tp
    # the spans tile the buffer exactly: members and padding, no overlap, no hole
    edges = [(s.start, s.stop) for s in buf.spans]
    assert edges[0][0] == 0 and edges[-1][1] == 2 * buf.part
    assert all(a[1] == b[0] for a, b in zip(edges, edges[1:]))
    # fc1's range is its size, and the partition boundary cuts the buffer where the boxes change rank
    fc1 = [s for s in buf.spans if s.name == FC1]
    assert sum(s.stop - s.start for s in fc1) == 1408 * 256
    boxes = layout_boxes(model, Mesh(dp=2), FC1, "fp32")
    held_by_1 = sum(int(np.prod(np.subtract(b.stop, b.start))) for b in boxes if b.ranks == (1,))
    assert held_by_1 == sum(s.stop - s.start for s in fc1 if s.start >= buf.part)
    assert flat_buffer(model, Mesh(dp=2), FC1, "param") is None  # weights are not flattened


def test_three_dims_flatten_leading_dims_into_rows():
    """Mixtral experts [experts, 2 * ffn, hidden] over ep=2, tp=2: ep splits the experts, tp takes
    [gate_r; up_r] of each; drawn with rows = expert * 2ffn + row."""
    from ucl.picture import _rects
    spec = ucl.load_spec("stdlib:mixtral")
    dims = dict(vocab=1000, hidden=64, heads=4, kv_heads=2, head_dim=16, ffn=96, experts=8, layers=2, tied=0)
    model = spec.bind(dims, spec.synthesize_params(dims))
    name = "model.layers.0.mlp.experts.gate_up_proj"
    boxes = layout_boxes(model, "ep=2,tp=2", name)
    assert (coverage(boxes, (8, 192, 64)) == 1).all()
    rank0 = [b for b in boxes if b.ranks == (0,)]
    assert [(b.start, b.stop) for b in rank0] == [((0, 0, 0), (4, 48, 64)), ((0, 96, 0), (4, 144, 64))]
    assert _rects(rank0[0], (8, 192, 64)) == [(0, e * 192, 64, 48) for e in range(4)]
    assert _rects(Box((4, 0, 0), (8, 192, 64), (1,)), (8, 192, 64)) == [(0, 768, 64, 768)]


def test_universal_is_one_box_on_rank_0(model):
    assert layout_boxes(model, ucl.UNIVERSAL, "output_layer.weight", "fp32") == [Box((0, 0), (1000, 256), (0,))]
    assert flat_buffer(model, ucl.UNIVERSAL, "output_layer.weight", "fp32") is None


def test_unknown_names_say_what_was_meant(model):
    with pytest.raises(PlanError) as e:
        layout_boxes(model, "tp=2", "output_layer.weights")
    assert e.value.code == "UCL311" and "did you mean output_layer.weight?" in str(e.value)
    with pytest.raises(PlanError) as e:
        layout_boxes(model, "tp=2", "output_layer.weight", "exp_avgsq")
    assert e.value.code == "UCL311" and "exp_avg_sq" in str(e.value)


# ---------------------------------------------------------------- pictures

def test_import_does_not_need_matplotlib():
    code = "import sys, ucl.picture; print('matplotlib' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip() == "False"


def test_missing_matplotlib_is_a_ucl_error(model, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    with pytest.raises(UclError) as e:
        ucl.picture.draw_plan(model, "tp=2", "tp=4", tmp_path / "x.png")
    assert e.value.code == "UCL009" and "pip install matplotlib" in str(e.value)


def test_draw_plan_writes_a_png(model, tmp_path):
    pytest.importorskip("matplotlib")
    from ucl.picture import draw_plan
    out = draw_plan(model, "pp=2,dp=2,tp=2", "tp=4,dp=2", tmp_path / "plan.png")
    w, h = png_size(out)
    assert 1000 < w < 3000 and 400 < h < 2000
    out = draw_plan(model, "pp=2,dp=2,tp=2", "dp=4", tmp_path / "flat.png", param="output_layer.weight", kind="fp32")
    assert png_size(out)[1] > h  # the flat buffers add a row


def test_draw_plan_default_picks_a_parameter_whose_layout_changes(model, tmp_path):
    from ucl.picture import _changed_param
    assert _changed_param(model, Mesh(tp=2), Mesh(tp=4), "param") == "embedding.word_embeddings.weight"
    assert _changed_param(model, Mesh(dp=2), Mesh(dp=4), "param") == "embedding.word_embeddings.weight"  # none
    name = _changed_param(model, Mesh(dp=2), Mesh(dp=4), "fp32")  # the first tensor the new dp cut moves
    before, after = layout_boxes(model, "dp=2", name, "fp32"), layout_boxes(model, "dp=4", name, "fp32")
    assert [(b.start, b.stop) for b in before] != [(b.start, b.stop) for b in after]
    first = next(t.name for t in model.tensors if t.kind == "fp32")
    assert name != first  # the embedding stays whole in dp partition 0
    pytest.importorskip("matplotlib")
    from ucl.picture import draw_plan
    with pytest.raises(PlanError) as e:
        draw_plan(model, "tp=2", "tp=4", tmp_path / "q.png", param="embedding.word_embedding.weight")
    assert e.value.code == "UCL311" and "did you mean embedding.word_embeddings.weight?" in str(e.value)


def test_draw_layout_every_shape(model, tmp_path):
    pytest.importorskip("matplotlib")
    from ucl.picture import draw_layout
    for i, (name, kind) in enumerate([(FC1, "param"), (LN, "param"), (LN, "step"), (FC1, "exp_avg")]):
        ax = draw_layout(model, "pp=2,dp=2,tp=2", name, kind=kind)
        assert name in ax.get_title()
        ax.figure.savefig(tmp_path / f"{i}.png")
        assert png_size(tmp_path / f"{i}.png")[0] > 300


def test_draw_checkpoint_writes_a_png(model, tmp_path):
    pytest.importorskip("matplotlib")
    from ucl.picture import draw_checkpoint
    mesh = Mesh(pp=2, dp=2, tp=2)
    shards = ucl.execute_memory(ucl.compile(model, ucl.UNIVERSAL, mesh), {0: universal_state(model)})
    ucl.save(tmp_path / "ckpt", shards, model=model, mesh=mesh)
    w, h = png_size(draw_checkpoint(tmp_path / "ckpt", tmp_path / "c.png"))
    assert 1000 < w < 3000 and 600 < h < 2000
    assert png_size(draw_checkpoint(tmp_path / "ckpt", tmp_path / "d.png", param=LN))[0] > 0
    with pytest.raises(PlanError) as e:
        draw_checkpoint(tmp_path / "ckpt", tmp_path / "e.png", param="output_layer")
    assert e.value.code == "UCL311"
