"""The Checkpointer's compressed flush, pipelined (store.ahead): datasets are coded on every
``compress_threads`` thread ahead of the write, into the same bytes as one thread, with the
memory coded ahead bounded, and a coding error publishes nothing."""
from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import ucl  # noqa: E402
import ucl.store.ahead as ahead  # noqa: E402
import ucl.store.codec as codec  # noqa: E402
from ucl.store.root import CheckpointRoot  # noqa: E402


def trained(layers: int = 4, width: int = 192):
    """A model of several small tensors (weights, biases, LayerNorm) and its AdamW state."""
    torch.manual_seed(0)
    mods = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.LayerNorm(width)]
    model = torch.nn.Sequential(*mods)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(3):
        model(torch.randn(8, width)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def rank_files(path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(Path(path).glob("*.h5"))}


def save_once(root, model, opt, threads: int, pool_bytes) -> tuple[str, dict]:
    """The checkpoint saved, and its flush event."""
    with ucl.Checkpointer(str(root), model, opt, compress="zstd", compress_threads=threads,
                          pool_bytes=pool_bytes) as ck:
        ck.save(1)
        ck.wait()
        return ck.root.latest(), next(e for e in ck.trace.events() if e["phase"] == "flush")


@pytest.mark.parametrize("pool_bytes", [None, 64 << 10])  # the snapshot whole in the pool; streamed through a ring
def test_small_datasets_code_on_every_thread_into_the_same_bytes(tmp_path, monkeypatch, pool_bytes):
    model, opt = trained()
    real, lock, calls, threads = codec._encode_block, threading.Lock(), [0], set()
    both = threading.Barrier(2, timeout=30)  # the first two blocks meet: two threads code at once

    def counted(*a):
        with lock:
            calls[0] += 1
            first_two = calls[0] <= 2
            threads.add(threading.current_thread().name)
        if first_two:
            both.wait()  # broken (a coding error) if one thread codes one dataset after the other
        return real(*a)
    monkeypatch.setattr(codec, "_encode_block", counted)
    two, flush = save_once(tmp_path / "two", model, opt, 2, pool_bytes)
    monkeypatch.setattr(codec, "_encode_block", real)
    assert all(model_tensor.numel() * 4 <= codec.BLOCK_BYTES for model_tensor in model.parameters())
    assert len(threads) == 2 and threading.current_thread().name not in threads
    assert calls[0] >= 4 * 4  # each layer's weight, bias, and their two moments at least
    state = sum(t.numel() * t.element_size() for t in model.parameters()) * 3  # weights, exp_avg, exp_avg_sq
    budget = ahead.ahead_budget(flush["bytes"], 2)  # 2 threads x 2 groups here: not the whole state
    assert 0 < flush["coded_ahead"] <= budget < state
    one, _ = save_once(tmp_path / "one", model, opt, 1, pool_bytes)
    assert rank_files(two) == rank_files(one)
    with ucl.open(two) as c:
        assert c.verify() == [] and any(c.info(0, k).encoding == "zstd" for k in c.keys(0))


def test_a_coding_error_mid_pipeline_publishes_nothing(tmp_path, monkeypatch):
    """The third block fails: wait() raises a UclError naming the dataset, no coding thread is left
    running, step 1 stays latest and whole, and no step 2 appears."""
    model, opt = trained()
    real, lock, calls = codec._encode_block, threading.Lock(), [0]

    def failing(*a):
        with lock:
            calls[0] += 1
            n = calls[0]
        if n == 3:
            raise RuntimeError("injected coding failure")
        return real(*a)
    with ucl.Checkpointer(str(tmp_path), model, opt, compress="zstd", compress_threads=2) as ck:
        ck.save(1)
        ck.wait()
        monkeypatch.setattr(codec, "_encode_block", failing)
        ck.save(2)
        with pytest.raises(ucl.UclError) as err:
            ck.wait()
        assert err.value.code == "UCL410" and "step 2" in str(err.value)
        assert "coding dataset" in str(err.value) and "injected coding failure" in str(err.value)
        assert not [t for t in threading.enumerate() if t.name.startswith("ucl-compress")]
    monkeypatch.setattr(codec, "_encode_block", real)
    root = CheckpointRoot(tmp_path)
    assert root.steps() == [1] and root.latest_step() == 1
    assert not [p for p in Path(tmp_path).iterdir() if p.is_dir() and p.name.startswith(".")]  # no temp dir left
    with ucl.open(root.latest()) as c:
        assert c.verify() == []


def test_coded_ahead_keeps_the_order_and_the_bound(monkeypatch):
    """Many datasets and a few larger than the budget: yielded in order, each coded as encode codes
    it alone; the logical bytes held ahead never exceed the budget, or one larger dataset alone."""
    monkeypatch.setattr(ahead, "AHEAD_BYTES", 256 << 10)
    rng = np.random.default_rng(3)
    sizes = [1000, 70_000, 0, 5, 600_000, 40_000, 40_000, 3 << 20, 12, 90_000] * 3
    arrays = [(f"param/t{i}", (rng.standard_normal(n) * 0.01).astype(np.float32), "float32")
              for i, n in enumerate(sizes)]
    threads = ahead.CodingThreads(2)
    with ahead.CodedAhead(iter(arrays), "zstd", threads) as coded:
        got = list(coded)
        high = coded.high_water
    assert coded.cpu_seconds > 0
    with ahead.CodedAhead(iter(arrays[:3]), "zstd", threads) as again:  # the same threads, kept
        assert [k for k, *_ in again] == [k for k, *_ in arrays[:3]]
    threads.close()
    assert [k for k, *_ in got] == [k for k, *_ in arrays]
    for (key, arr, dtype), (_, same, _, enc) in zip(arrays, got):
        assert same is arr or np.shares_memory(same, arr)  # never copied
        if not arr.nbytes:
            assert enc is None
            continue
        alone = codec.encode(arr, dtype, "zstd")
        assert enc.stored.tobytes() == alone.stored.tobytes() and enc.ends.tolist() == alone.ends.tolist()
    budget, largest = 2 * (256 << 10), max(a.nbytes for _, a, _ in arrays)
    assert budget < largest and high == largest  # the large one went alone
    assert coded.most_queued > 2  # several small ones were coded ahead at once
