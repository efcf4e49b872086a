"""A host pool smaller than one snapshot (train.ring): the snapshot streams through it in pieces,
the checkpoint is the one a large pool writes, byte for byte, resume is bit-exact, host memory
held stays within the pool, and failures on either side of the ring neither hang nor publish."""
from __future__ import annotations

import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
nn = torch.nn

import ucl  # noqa: E402
from ucl.store import CheckpointRoot  # noqa: E402


class Net(nn.Module):
    """Matrices of several MiB (sliced into many pieces), small tensors, a buffer."""

    def __init__(self, width=512, depth=3, seed=0, dtype=torch.float32):
        super().__init__()
        torch.manual_seed(seed)
        self.layers = nn.ModuleList(nn.Linear(width, width, dtype=dtype) for _ in range(depth))
        self.out = nn.Linear(width, 7, dtype=dtype)
        self.register_buffer("seen", torch.zeros((), dtype=torch.int64))

    def forward(self, x):
        self.seen += 1
        for layer in self.layers:
            x = torch.relu(layer(x.to(layer.weight.dtype)))
        return self.out(x).float()


def make(seed=0, **kw):
    model = Net(seed=seed, **kw)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def step(model, optimizer, i):
    g = torch.Generator().manual_seed(i)
    loss = model(torch.randn(8, model.layers[0].in_features, generator=g)).square().mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.item()


def train(root, steps, save_every=1, **kw):
    model, optimizer = make()
    losses = []
    with ucl.Checkpointer(root, model, optimizer, **kw) as ck:
        for i in range(steps):
            losses.append(step(model, optimizer, i))
            if (i + 1) % save_every == 0:
                ck.save(i + 1)
    return model, optimizer, losses, ck.trace.events()


def datasets(path):
    with ucl.open(path) as ck:
        assert ck.verify() == []
        return {k: np.asarray(ck.read(0, k)).tobytes() for k in ck.keys(0)}


def _failing_call(real, nth: int, error: BaseException):
    """``real`` (a method), raising ``error`` on its ``nth`` call instead of running."""
    calls = []

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) == nth:
            raise error
        return real(*args, **kwargs)
    return flaky


@pytest.mark.parametrize("pool", [4096, 3 * 4096, 256 << 10])
def test_a_pool_of_a_few_blocks_checkpoints_a_larger_model(tmp_path, pool):
    """Before the ring, a pool smaller than the snapshot (about 9 MiB here) raised UCL431."""
    model, optimizer, losses, events = train(tmp_path / "small", 4, keep=4, pool_bytes=pool)
    snaps = [e for e in events if e["phase"] == "snapshot"]
    assert snaps and all(e["bytes"] > 20 * pool for e in snaps) and all(e["pieces"] > 8 for e in snaps)
    assert max(e["pool_high_water"] for e in events if e["phase"] == "flush") <= pool
    _, _, same, _ = train(tmp_path / "large", 4, keep=4)  # the default pool: each snapshot whole
    assert same == losses
    small, large = CheckpointRoot(tmp_path / "small"), CheckpointRoot(tmp_path / "large")
    assert small.steps() == large.steps() == [1, 2, 3, 4]
    for s in small.steps():
        assert datasets(small.path_for(s)) == datasets(large.path_for(s))
    fresh, fresh_opt = make(seed=5)
    with ucl.Checkpointer(tmp_path / "small", fresh, fresh_opt, pool_bytes=pool) as ck:
        assert ck.load(step=2)[0] == 2
        again = [step(fresh, fresh_opt, i) for i in range(2, 4)]
    assert again == losses[2:]
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values()):
        assert torch.equal(a, b)


def test_every_piece_boundary_resumes_bit_exact(tmp_path):
    """Odd widths, bf16: pieces cut rows and tiles anywhere; what the copier hashed matches the file."""
    model, optimizer = make(width=333, depth=2, dtype=torch.bfloat16)
    with ucl.Checkpointer(tmp_path, model, optimizer, pool_bytes=5 * 4096) as ck:
        for i in range(3):
            step(model, optimizer, i)
            ck.save(i + 1)
        saved = {k: v.clone() for k, v in model.state_dict().items()}
        moments = [optimizer.state[p]["exp_avg"].clone() for p in model.parameters()]
    assert datasets(CheckpointRoot(tmp_path).latest())
    fresh, fresh_opt = make(seed=9, width=333, depth=2, dtype=torch.bfloat16)
    with ucl.Checkpointer(tmp_path, fresh, fresh_opt) as ck:
        assert ck.load()[0] == 3
    assert all(torch.equal(saved[k], v) for k, v in fresh.state_dict().items())
    assert all(torch.equal(m, fresh_opt.state[p]["exp_avg"]) for m, p in zip(moments, fresh.parameters()))


def test_unwritten_saves_need_a_pool_of_one_snapshot_and_say_so(tmp_path):
    model, optimizer = make()
    with ucl.Checkpointer(tmp_path, model, optimizer, persist_every=2, pool_bytes=64 << 10) as ck:
        for i in range(3):
            step(model, optimizer, i)
            ck.save(i + 1)  # 2 is written; 1 and 3 are unwritten and too large for the pool
        with pytest.raises(ucl.StoreError) as err:
            ck.load(step=3)
        assert err.value.code == "UCL404" and "pool_bytes" in str(err.value) and "not kept" in str(err.value)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert ck.load()[0] == 2
        assert any("step 3" in str(w.message) for w in caught)
    # with a pool of a whole snapshot the unwritten one is a rollback from memory, as before
    model, optimizer = make()
    with ucl.Checkpointer(tmp_path / "whole", model, optimizer, persist_every=2) as ck:
        for i in range(3):
            step(model, optimizer, i)
            ck.save(i + 1)
        want = {k: v.clone() for k, v in model.state_dict().items()}
        step(model, optimizer, 3)
        assert ck.load()[0] == 3
        assert all(torch.equal(want[k], v) for k, v in model.state_dict().items())
    assert [e.get("tier") for e in ck.trace.events() if e["phase"] == "restore"] == [0]


def test_pool_bytes_below_one_block_is_refused(tmp_path):
    model, optimizer = make()
    for bad in (0, 4095, 1.5e6):
        with pytest.raises(ucl.UclError) as err:
            ucl.Checkpointer(tmp_path, model, optimizer, pool_bytes=bad)
        assert err.value.code == "UCL430" and "pool_bytes" in str(err.value)


def test_a_failing_write_mid_stream_neither_hangs_nor_publishes(tmp_path, monkeypatch):
    """The flusher fails after some pieces: the copier, waiting for ring space, stops; the error
    surfaces; the step before stays latest; later saves work again."""
    from ucl.store import direct
    model, optimizer, _, _ = train(tmp_path, 1, pool_bytes=16 << 10)
    real = direct.DirectWriter.write
    monkeypatch.setattr(direct.DirectWriter, "write", _failing_call(real, 5, OSError(28, "No space left on device")))
    with ucl.Checkpointer(tmp_path, model, optimizer, pool_bytes=16 << 10) as ck:
        step(model, optimizer, 1)
        ck.save(2)
        with pytest.raises(ucl.StoreError) as err:
            ck.wait()
        assert err.value.code == "UCL410" and "step 2" in str(err.value)
        assert CheckpointRoot(tmp_path).steps() == [1] and CheckpointRoot(tmp_path).latest_step() == 1
    monkeypatch.setattr(direct.DirectWriter, "write", real)
    with ucl.Checkpointer(tmp_path, model, optimizer, pool_bytes=16 << 10) as ck:
        ck.save(2)
    assert CheckpointRoot(tmp_path).latest_step() == 2 and datasets(CheckpointRoot(tmp_path).latest())


def test_a_failing_copy_mid_stream_neither_hangs_nor_publishes(tmp_path, monkeypatch):
    from ucl.train import ring
    model, optimizer, _, _ = train(tmp_path, 1, pool_bytes=16 << 10)
    monkeypatch.setattr(ring.IncrementalChecksum, "advance",
                        _failing_call(ring.IncrementalChecksum.advance, 7, MemoryError("injected")))
    with ucl.Checkpointer(tmp_path, model, optimizer, pool_bytes=16 << 10) as ck:
        step(model, optimizer, 1)
        ck.save(2)
        with pytest.raises(ucl.StoreError) as err:
            ck.wait()
        assert err.value.code == "UCL432" and "injected" in str(err.value)
    assert CheckpointRoot(tmp_path).steps() == [1]


@pytest.mark.slow
def test_a_pool_of_4_mib_checkpoints_hundreds_of_mib(tmp_path):
    """About 300 MiB of state (weights and two Adam moments) through a 4 MiB pool; bit-exact."""
    model, optimizer = make(width=2048, depth=6)
    with ucl.Checkpointer(tmp_path, model, optimizer, pool_bytes=4 << 20) as ck:
        for i in range(2):
            step(model, optimizer, i)
            ck.save(i + 1)
        saved = {k: v.clone() for k, v in model.state_dict().items()}
        moments = [optimizer.state[p]["exp_avg_sq"].clone() for p in model.parameters()]
    events = ck.trace.events()
    assert min(e["bytes"] for e in events if e["phase"] == "snapshot") > 250 << 20
    assert max(e["pool_high_water"] for e in events if e["phase"] == "flush") <= 4 << 20
    fresh, fresh_opt = make(seed=1, width=2048, depth=6)
    with ucl.Checkpointer(tmp_path, fresh, fresh_opt) as ck:
        assert ck.load()[0] == 2
    assert all(torch.equal(saved[k], v) for k, v in fresh.state_dict().items())
    assert all(torch.equal(m, fresh_opt.state[p]["exp_avg_sq"]) for m, p in zip(moments, fresh.parameters()))
    with ucl.open(CheckpointRoot(tmp_path).latest()) as ck:
        assert ck.verify() == []


@pytest.mark.parametrize("codec", ["zstd", "lz4"])
def test_a_compressed_checkpoint_streams_through_a_small_pool(tmp_path, codec):
    """Compressed datasets are coded whole: the flusher assembles each from its pieces."""
    pytest.importorskip("zstandard" if codec == "zstd" else "lz4")
    model, optimizer, losses, events = train(tmp_path / "small", 2, pool_bytes=64 << 10, compress=codec)
    assert all(e["pieces"] > 8 for e in events if e["phase"] == "snapshot")
    _, _, same, _ = train(tmp_path / "plain", 2)
    assert same == losses
    small, plain = CheckpointRoot(tmp_path / "small"), CheckpointRoot(tmp_path / "plain")
    assert datasets(small.latest()) == datasets(plain.latest())


def test_the_default_pool_is_a_quarter_snapshot_when_every_save_is_written(tmp_path, monkeypatch):
    """The default pool (train.pool.default_pool_bytes): with every save written, a quarter of a
    snapshot (at least WHOLE_POOL_BYTES, lowered here so a ~9 MiB state streams) and the checkpoints
    are the ones a whole-snapshot pool writes; with persist_every > 1, unwritten saves live only in
    the pool, so it holds a whole snapshot and a rollback from memory still works."""
    from ucl.train import pool as pool_module
    monkeypatch.setattr(pool_module, "WHOLE_POOL_BYTES", 64 << 10)
    _, _, losses, events = train(tmp_path / "quarter", 3, keep=3)
    snaps = [e for e in events if e["phase"] == "snapshot"]
    size = snaps[0]["bytes"]
    high = max(e["pool_high_water"] for e in events if e["phase"] == "flush")
    assert all(e["pieces"] > 1 for e in snaps) and high <= -(-(size // 4) // 4096) * 4096 + 4096, (size, high)
    _, _, same, _ = train(tmp_path / "whole", 3, keep=3, pool_bytes=size + 4096)
    assert same == losses
    quarter, whole = CheckpointRoot(tmp_path / "quarter"), CheckpointRoot(tmp_path / "whole")
    for s in whole.steps():
        assert datasets(quarter.path_for(s)) == datasets(whole.path_for(s))
    assert pool_module.default_pool_bytes(size, rollbacks=True) >= size  # persist_every > 1: whole
    model, optimizer = make()
    with ucl.Checkpointer(tmp_path / "rollback", model, optimizer, persist_every=4) as ck:
        step(model, optimizer, 0)
        ck.save(1)  # written (the first save after none)
        step(model, optimizer, 1)
        ck.save(2)  # host memory only
        want = {k: v.clone() for k, v in model.state_dict().items()}
        step(model, optimizer, 2)
        assert ck.load()[0] == 2 and ck.last_load.bytes_from == {"memory": 0}
        assert all(torch.equal(v, want[k]) for k, v in model.state_dict().items())


def test_the_default_pool_from_a_gpu_is_whole_where_the_host_has_room():
    """From a GPU the next step's fence waits until every byte has left it, so the default pool
    holds a whole snapshot when that takes at most half of the host memory a process may take;
    otherwise the quarter rule; a rollback pool is whole regardless."""
    from ucl.train.pool import WHOLE_POOL_BYTES, default_pool_bytes
    total = 40 * WHOLE_POOL_BYTES + 1000  # large enough that a quarter is above the 256 MiB floor
    whole = -(-total // 4096) * 4096
    quarter = -(-(total // 4) // 4096) * 4096
    assert default_pool_bytes(total, rollbacks=False) == quarter  # CPU
    assert default_pool_bytes(total, rollbacks=False, room=2 * whole) == whole
    assert default_pool_bytes(total, rollbacks=False, room=2 * whole - 1) == quarter
    assert default_pool_bytes(total, rollbacks=True, room=0) == whole


def test_host_room_is_what_is_available_over_the_processes_on_the_node():
    from ucl.train.pool import host_room
    one = host_room({})
    if one is None:
        pytest.skip("no /proc/meminfo")
    with open("/proc/meminfo") as f:
        available = next(int(x.split()[1]) * 1024 for x in f if x.startswith("MemAvailable:"))
    assert abs(one - available) < available // 4  # read a moment apart
    eight = host_room({"LOCAL_WORLD_SIZE": "8"})
    assert abs(eight - available // 8) < available // 4 // 8
    assert abs(host_room({"LOCAL_WORLD_SIZE": "nonsense"}) - available) < available // 4
