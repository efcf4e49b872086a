"""``load_rank(..., out=...)``: filling the caller's tensors in place, bit-exactly, from a checkpoint
of another layout. The oracle is ``load_rank`` without ``out`` (itself checked against in-memory
resharding in tests/test_checkpoint.py) and the in-memory plan execution."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import ucl
from ucl.demo import llama_model, universal_state
from ucl.dtypes import to_torch
from ucl.errors import StoreError

SRC = "pp=2,dp=2,tp=2"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    model = llama_model()
    truth = universal_state(model, seed=1)
    shards = ucl.execute_memory(ucl.compile(model, ucl.UNIVERSAL, SRC), {0: truth})
    path = ucl.save(tmp_path_factory.mktemp("into") / "src", shards, model=model, mesh=SRC)
    return path, model, truth


def _expected(model, truth, mesh, rank):
    return ucl.execute_memory(ucl.compile(model, ucl.UNIVERSAL, mesh), {0: truth}, ranks=[rank])[rank]


@pytest.mark.parametrize("mesh,rank", [(SRC, 5), ("tp=4", 3), ("pp=4,dp=2", 6), ("universal", 0)])
def test_out_tensors_are_filled_in_place_bit_exactly(saved, mesh, rank):
    path, model, truth = saved
    want = _expected(model, truth, mesh, rank)
    dtypes = {d["key"]: d["dtype"] for d in ucl.compile(model, SRC, mesh, ranks=[rank]).datasets}
    # garbage-filled destinations: padding and gaps must come back as zeros, not garbage
    out = {k: to_torch(np.full_like(v, 0x5A if v.dtype.itemsize == 1 else 7), dtypes[k]) for k, v in want.items()}
    before = {k: t.data_ptr() for k, t in out.items()}
    got = ucl.load_rank(path, mesh=mesh, rank=rank, out=out)
    assert sorted(got) == sorted(want)
    for k, w in want.items():
        assert got[k] is out[k] and out[k].data_ptr() == before[k], k
        assert ucl.dtypes.to_numpy(out[k])[0].tobytes() == w.tobytes(), k


def test_out_may_cover_some_keys_and_accepts_numpy_and_non_contiguous(saved):
    path, model, truth = saved
    want = _expected(model, truth, "tp=4", 1)
    keys = sorted(want)
    as_array = keys[0]
    fp32 = next(k for k in keys if want[k].dtype == np.float32 and want[k].ndim == 1 and k != as_array)
    two_d = next(k for k in keys if want[k].ndim == 2 and k not in (as_array, fp32))
    arr = np.zeros_like(want[as_array])
    # a non-contiguous destination (a transposed view) is filled through one copy at the end
    holder = torch.zeros(want[two_d].shape[::-1], dtype=torch.bfloat16 if want[two_d].dtype == np.uint16 else torch.float32)
    view = holder.t()
    flat = torch.zeros(want[fp32].shape, dtype=torch.float32)
    got = ucl.load_rank(path, mesh="tp=4", rank=1, out={as_array: arr, two_d: view, fp32: flat})
    assert got[as_array] is arr and arr.tobytes() == want[as_array].tobytes()
    assert ucl.dtypes.to_numpy(holder.t().contiguous())[0].tobytes() == want[two_d].tobytes()
    assert flat.numpy().tobytes() == want[fp32].tobytes()
    for k in keys:
        got_bytes = got[k].tobytes() if isinstance(got[k], np.ndarray) else ucl.dtypes.to_numpy(got[k])[0].tobytes()
        assert got_bytes == want[k].tobytes(), k


def test_out_with_the_wrong_shape_dtype_or_key_is_refused(saved):
    path, model, truth = saved
    want = _expected(model, truth, "tp=4", 0)
    key = next(k for k in want if want[k].dtype == np.float32 and want[k].size > 1)
    for bad, needle in [({key: torch.zeros(want[key].size + 1)}, "holds it as float32"),
                        ({key: torch.zeros(want[key].shape, dtype=torch.float64)}, "float64"),
                        ({key: np.zeros(want[key].shape, np.float64)}, "float64"),
                        ({"param/nope": torch.zeros(1)}, "does not hold")]:
        with pytest.raises(StoreError) as e:
            ucl.load_rank(path, mesh="tp=4", rank=0, out=bad)
        assert e.value.code == "UCL409" and needle in str(e.value), str(e.value)


def test_whole_dataset_reads_zero_what_no_row_writes(tmp_path):
    # vocab padding rows are fills; a writer may leave garbage there. A same-layout load reads the
    # dataset whole (one read), so it must zero the padding afterwards, as the plan says.
    model = llama_model()
    truth = universal_state(model, seed=2)
    want = _expected(model, truth, SRC, 1)
    key = "param/embedding.word_embeddings.weight"  # rows 488..511 of tp rank 1 pad vocab 1000 to 1024
    assert not want[key][500:].any()
    shards = ucl.execute_memory(ucl.compile(model, ucl.UNIVERSAL, SRC), {0: truth})
    shards[1][key] = shards[1][key].copy()
    shards[1][key][500:] = 0x3F80  # bf16 1.0
    path = ucl.save(tmp_path / "garbage", shards, model=model, mesh=SRC)
    stats = ucl.ops.IOStats()
    got = ucl.load_rank(path, mesh=SRC, rank=1, stats=stats)
    assert got[key].tobytes() == want[key].tobytes()
    # one read per dataset; tensors replicated over tp are also read from the replica the plan picks
    assert stats.bytes_read <= 1.05 * sum(v.nbytes for v in want.values())


def test_strided_numpy_views_and_grad_parameters_are_filled(saved):
    """Destinations no view can be taken of are filled at the end: a transposed and a strided numpy
    view (before: AttributeError after the whole read), a Parameter that requires grad."""
    path, model, truth = saved
    want = _expected(model, truth, "tp=4", 2)
    two_d = [k for k in sorted(want) if want[k].ndim == 2][:3]
    a, b, c = (want[k] for k in two_d)
    transposed = np.zeros(a.shape[::-1], a.dtype).T
    wide = np.zeros((b.shape[0], 2 * b.shape[1]), b.dtype)
    strided = wide[:, ::2]
    dtype = torch.bfloat16 if c.dtype == np.uint16 else torch.float32
    param = torch.nn.Parameter(torch.zeros(c.shape, dtype=dtype).t().contiguous().t())  # requires grad, strided
    ucl.load_rank(path, mesh="tp=4", rank=2, out={two_d[0]: transposed, two_d[1]: strided, two_d[2]: param})
    assert np.ascontiguousarray(transposed).tobytes() == a.tobytes()
    assert np.ascontiguousarray(strided).tobytes() == b.tobytes() and not wide[:, 1::2].any()
    assert ucl.dtypes.to_numpy(param.detach().contiguous())[0].tobytes() == c.tobytes()


def test_read_only_arrays_and_meta_tensors_are_refused_before_reading(saved, monkeypatch, tmp_path):
    """A read-only array, or a tensor on the meta device (a module not materialised yet, which copy_
    would "fill" without a word), is UCL409 before a byte is read; save() names a meta tensor too."""
    path, model, truth = saved
    want = _expected(model, truth, "tp=4", 0)
    key = next(k for k in want if want[k].ndim == 2)
    frozen = np.zeros_like(want[key])
    frozen.flags.writeable = False
    dtype = torch.bfloat16 if want[key].dtype == np.uint16 else torch.float32
    meta = torch.empty(want[key].shape, dtype=dtype, device="meta")
    reads = []
    import ucl.ops.load as load_module
    monkeypatch.setattr(load_module, "run_copies", lambda *a, **k: reads.append(a))
    for bad, needle in [(frozen, "read-only"), (meta, "meta device")]:
        with pytest.raises(StoreError, match=needle) as e:
            ucl.load_rank(path, mesh="tp=4", rank=0, out={key: bad})
        assert e.value.code == "UCL409"
    assert reads == []
    name = next(iter(truth))
    shards = {0: {k: (torch.empty(v.shape, device="meta") if k == name else v) for k, v in truth.items()}}
    with pytest.raises(StoreError, match="meta device") as e:
        ucl.save(tmp_path / "meta", shards, model=model, mesh="universal")
    assert e.value.code == "UCL421" and not (tmp_path / "meta").exists()


def test_a_model_given_to_load_rank_is_the_layout_read(saved):
    """``model=`` with the checkpoint's spec text but other parameters (fewer layers) or another
    frozen set is honoured: before, the same spec text made load_rank use the checkpoint's own."""
    path, model, truth = saved
    from ucl.demo import LLAMA_MEGATRON
    fewer = {n: s for n, s in model.params.items() if ".layers.3." not in n and ".layers.2." not in n}
    dims = dict(model.dims, layers=2)
    small = ucl.load_spec(LLAMA_MEGATRON).bind(dims, fewer)
    got = ucl.load_rank(path, mesh="universal", rank=0, model=small)
    assert not any(".layers.2." in k or ".layers.3." in k for k in got)
    assert {k for k in got} == {k for k in truth if ".layers.2." not in k and ".layers.3." not in k}
    frozen = ucl.load_spec(LLAMA_MEGATRON).bind(dict(model.dims), dict(model.params), frozen=list(model.params))
    assert {k.split("/")[0] for k in ucl.load_rank(path, mesh="universal", rank=0, model=frozen)} == {"param"}
