"""ucl.Checkpointer in one process: resume gives the same losses bit for bit as an uninterrupted run,
for several optimizers and dtypes, with tied, frozen and buffer tensors; back-pressure, tiers,
retention, background errors and the debug fence check."""
from __future__ import annotations

import copy
import os
import shutil
import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
nn = torch.nn

import ucl  # noqa: E402
from ucl.store.writer import CheckpointWriter  # noqa: E402
from tests.passes import examples


class Toy(nn.Module):
    """A seeded toy transformer: embedding, attention + MLP block with dropout, tied output head,
    a frozen positional table and a persistent buffer updated in forward."""

    def __init__(self, vocab=64, dim=32, dtype=torch.float32, tied=True):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim, dtype=dtype)
        self.pos = nn.Parameter(torch.randn(16, dim, dtype=dtype), requires_grad=False)  # frozen
        self.attn = nn.MultiheadAttention(dim, 4, dropout=0.1, batch_first=True, dtype=dtype)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim, dtype=dtype), nn.GELU(), nn.Dropout(0.1),
                                 nn.Linear(4 * dim, dim, dtype=dtype))
        self.norm = nn.LayerNorm(dim, dtype=dtype)
        self.head = nn.Linear(dim, vocab, bias=False, dtype=dtype)
        if tied:
            self.head.weight = self.embed.weight
        self.register_buffer("seen", torch.zeros((), dtype=torch.int64))

    def forward(self, x):
        self.seen += x.shape[0]
        h = self.embed(x) + self.pos[: x.shape[1]]
        h = h + self.attn(h, h, h, need_weights=False)[0]
        return self.head(self.norm(h + self.mlp(h)))


def make(opt="adamw", dtype=torch.float32, seed=0, tied=True):
    torch.manual_seed(seed)
    model = Toy(dtype=dtype, tied=tied)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = {"adamw": lambda: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1),
                 "adam": lambda: torch.optim.Adam(params, lr=1e-2, amsgrad=True),
                 "sgd": lambda: torch.optim.SGD(params, lr=1e-2, momentum=0.9)}[opt]()
    return model, optimizer


def train_step(model, optimizer, i):
    g = torch.Generator().manual_seed(1000 + i)
    x = torch.randint(0, 64, (4, 8), generator=g)
    logits = model(x)
    loss = nn.functional.cross_entropy(logits.float().reshape(-1, 64), x.reshape(-1))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.detach().float().item()


def run(root, *, steps=6, save_at=(3,), opt="adamw", dtype=torch.float32, **kw):
    model, optimizer = make(opt, dtype)
    losses = []
    with ucl.Checkpointer(root, model, optimizer, **kw) as ck:
        for i in range(steps):
            losses.append(train_step(model, optimizer, i))
            if i + 1 in save_at:
                ck.save(i + 1, extra={"data_position": i + 1})
    return model, optimizer, losses


def resume(root, *, steps=6, opt="adamw", dtype=torch.float32, step=None, **kw):
    model, optimizer = make(opt, dtype, seed=123)  # other initial weights: everything must come from the checkpoint
    torch.manual_seed(999)  # and another RNG state
    with ucl.Checkpointer(root, model, optimizer, **kw) as ck:
        at, extra = ck.load(step)
        losses = [train_step(model, optimizer, i) for i in range(at, steps)]
    return model, optimizer, at, extra, losses


@pytest.mark.parametrize("opt,dtype", [("adamw", torch.float32), ("adam", torch.float32), ("sgd", torch.float32),
                                       ("adamw", torch.bfloat16)])
def test_resume_continues_bit_for_bit(tmp_path, opt, dtype):
    model, optimizer, losses = run(tmp_path, opt=opt, dtype=dtype)
    m2, o2, at, extra, again = resume(tmp_path, opt=opt, dtype=dtype)
    assert at == 3 and extra == {"data_position": 3}
    assert again == losses[3:]  # dropout draws the same numbers: the RNG was restored too
    for (n, a), b in zip(model.state_dict().items(), m2.state_dict().values()):
        assert torch.equal(a, b), n
    assert m2.head.weight is m2.embed.weight  # still tied
    s1, s2 = optimizer.state_dict(), o2.state_dict()
    assert s1["param_groups"] == s2["param_groups"]
    for k in s1["state"]:
        for kind, v in s1["state"][k].items():
            assert torch.equal(v, s2["state"][k][kind]), (k, kind)


def test_checkpoint_is_an_ordinary_ucl_checkpoint(tmp_path):
    model, _, _ = run(tmp_path)
    from ucl.store import CheckpointRoot
    path = CheckpointRoot(tmp_path).latest()
    with ucl.open(path) as ck:
        assert ck.verify() == []
        m = ck.manifest
        assert m.mesh == [] and "head.weight" not in m.params  # tied: stored once
        assert "pos" in m.frozen and "seen" in m.frozen
        names = set(ck.keys(0))
    assert {"param/embed.weight", "exp_avg/embed.weight", "exp_avg_sq/embed.weight", "step/embed.weight",
            "param/pos", "param/seen"} <= names
    assert "exp_avg/pos" not in names
    got = ucl.load_rank(path, mesh="universal", rank=0, as_torch=True)
    # the snapshot is the state right after step 3 (the model trained on afterwards)
    m3, o3, _ = run(tmp_path / "again", steps=3, save_at=())
    assert torch.equal(got["param/embed.weight"], m3.embed.weight)
    assert int(got["param/seen"]) == int(m3.seen)


def test_what_the_copier_hashed_is_not_hashed_again_and_verifies(tmp_path, monkeypatch):
    """The snapshot thread hashes each tensor as it copies it; the flusher hashes only what was
    copied inside save() (buffers), and the digests agree with the bytes on disk."""
    import ucl.store.template as template
    hashed_by_flusher = []
    real = template.checksums
    monkeypatch.setattr(template, "checksums", lambda arr, **kw: hashed_by_flusher.append(arr.shape) or real(arr, **kw))
    # a pool of two snapshots: each whole in it (through a ring, the copier hashes the buffers too)
    model, _, _ = run(tmp_path, save_at=(2, 3), pool_bytes=64 << 20)
    from ucl.store import CheckpointRoot
    with ucl.open(CheckpointRoot(tmp_path).latest()) as ck:
        assert ck.verify() == []
        n_datasets = len(ck.keys(0))
    assert hashed_by_flusher == [()] * 2  # `seen`, a buffer, at each save; nothing else of the 20-odd datasets
    assert n_datasets > 10


def test_without_tile_checksums_column_slices_are_verified_by_whole_rows(tmp_path):
    """``tile_checksums=False``: matrices carry flat chunk checksums only (no ``tiles`` in the
    manifest, no tile digests in the file); the checkpoint verifies and resumes as usual, and a
    column slice is still verified, by reading the whole rows around it instead of its tiles."""
    from ucl.store import CheckpointRoot

    def make_mlp(seed):
        torch.manual_seed(seed)
        m = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 8))
        return m, torch.optim.AdamW(m.parameters(), lr=1e-2)

    sizes = {}
    for tiles in (True, False):
        root = tmp_path / str(tiles)
        model, optimizer = make_mlp(0)
        with ucl.Checkpointer(root, model, optimizer, tile_checksums=tiles) as ck:
            for _ in range(2):
                model(torch.randn(4, 256)).square().mean().backward()
                optimizer.step()
                optimizer.zero_grad()
            ck.save(2)
            saved = model[0].weight.detach().clone().numpy()
        with ucl.open(CheckpointRoot(root).latest()) as ck:
            assert ck.verify() == []
            info = ck.info(0, "param/0.weight")  # 512 x 256 float32: chunked, tiled when asked
            assert info.chunks is not None and (info.tiles is not None) == tiles
            runs = [(r * 256 + 64, 1, 64, 64) for r in range(512)]  # columns 64..127 of every row
            got = ck.read_runs(0, "param/0.weight", runs, verify=True)
            assert np.array_equal(got.reshape(512, 64), saved[:, 64:128])
            sizes[tiles] = ck.bytes_last_read
        fresh, fresh_opt = make_mlp(1)
        with ucl.Checkpointer(root, fresh, fresh_opt, tile_checksums=tiles) as ck:
            assert ck.load()[0] == 2
        assert np.array_equal(fresh[0].weight.detach().numpy(), saved)
        assert torch.equal(fresh_opt.state[fresh[0].weight]["exp_avg"], optimizer.state[model[0].weight]["exp_avg"])
    assert sizes[True] == 512 * 64 * 4 < sizes[False] == 512 * 256 * 4  # tiles: its columns; flat: whole rows


def test_persist_every_keep_and_tiers(tmp_path):
    tier = tmp_path / "remote"
    _, _, losses = run(tmp_path / "local", steps=9, save_at=range(1, 10), persist_every=3, keep=2, tiers=[tier])
    from ucl.store import CheckpointRoot
    assert CheckpointRoot(tmp_path / "local").steps() == [6, 9]
    assert CheckpointRoot(tier).steps() == [6, 9] and CheckpointRoot(tier).latest_step() == 9
    *_, at, _, again = resume(tier, steps=9)
    assert at == 9 and again == []
    *_, at, _, again = resume(tmp_path / "local", steps=9, step=6)
    assert at == 6 and again == losses[6:]


def test_tiny_pool_applies_back_pressure(tmp_path):
    model, optimizer = make()
    with ucl.Checkpointer(tmp_path, model, optimizer) as probe:
        probe.save(0)  # before the first step there is no optimizer state yet: the default pool grows
        train_step(model, optimizer, 0)
        probe.save(1)
    events = probe.trace.events()
    need = max(e["bytes"] for e in events if e["phase"] == "snapshot")
    root = tmp_path / "tiny"
    losses = []
    with ucl.Checkpointer(root, model, optimizer, pool_bytes=need + 64) as ck:
        for i in range(4):
            losses.append(train_step(model, optimizer, i))
            ck.save(i + 1)
    events = ck.trace.events()
    assert [e["step"] for e in events if e["phase"] == "flush"] == [1, 2, 3, 4]
    assert all(e["pool_high_water"] <= need + 64 for e in events if e["phase"] == "flush")
    # a pool smaller than one snapshot streams it (tests/test_train_ring.py)


def test_pool_reclaims_a_cached_region_handed_over_while_waiting():
    """The copier hands the previous snapshot to tier 0 just after the fence lets save() in: a pool
    that asked to reclaim only once, before that, waited forever."""
    from ucl.train.pool import HostPool
    pool = HostPool(10_000)
    first, _ = pool.allocate(6_000)
    cached = threading.Event()
    threading.Timer(0.3, cached.set).start()  # the hand-over, after the first reclaim

    def reclaim():
        if cached.is_set():
            pool.release(first)

    deadline = time.monotonic() + 10
    second, waited = pool.allocate(6_000, closed=lambda: time.monotonic() > deadline, reclaim=reclaim)
    assert second.start == 0 and 0.25 < waited < 5


@given(sizes=st.lists(st.integers(0, 3 << 20), min_size=1, max_size=12), keep=st.integers(1, 3))
@settings(max_examples=examples(40), deadline=None)
def test_pool_regions_start_on_blocks_and_never_overlap(sizes, keep):
    from ucl.store.direct import BLOCK
    from ucl.train.pool import HostPool, layout_bytes
    offsets, total = layout_bytes(sizes)
    assert all(o % BLOCK == 0 for o, n in zip(offsets, sizes) if n >= 1 << 20)
    assert all(a + n <= b for a, n, b in zip(offsets, sizes, offsets[1:]))
    pool = HostPool(3 * -(-max(total, 1) // BLOCK) * BLOCK)
    assert pool.buffer.data_ptr() % BLOCK == 0
    live = []
    for _ in range(8):
        region, _ = pool.allocate(total, reclaim=lambda: live and pool.release(live.pop(0)))
        assert region.start % BLOCK == 0 and region.stop <= pool.nbytes
        assert all(region.stop <= r.start or r.stop <= region.start for r in live if r.stop > r.start)
        live.append(region)
        while len(live) > keep:
            pool.release(live.pop(0))


def test_background_error_surfaces_and_publishes_nothing(tmp_path, monkeypatch):
    model, optimizer = make()
    ck = ucl.Checkpointer(tmp_path, model, optimizer)
    train_step(model, optimizer, 0)
    ck.save(1)
    ck.wait()
    real = CheckpointWriter.commit

    def full_disk(self):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(CheckpointWriter, "commit", full_disk)
    train_step(model, optimizer, 1)
    ck.save(2)
    with pytest.raises(ucl.StoreError) as err:
        ck.wait()
    assert "step 2" in str(err.value) and "No space left" in str(err.value)
    monkeypatch.setattr(CheckpointWriter, "commit", real)
    from ucl.store import CheckpointRoot
    root = CheckpointRoot(tmp_path)
    assert root.latest_step() == 1 and root.steps() == [1]
    assert not [n for n in os.listdir(tmp_path) if ".tmp-" in n]
    train_step(model, optimizer, 2)
    ck.save(3)  # it keeps working after the error was reported
    ck.close()
    assert root.latest_step() == 3


def test_debug_mode_detects_a_mutation_without_fence(tmp_path):
    model, optimizer = make()
    with ucl.Checkpointer(tmp_path, model, optimizer, debug=True) as ck:
        train_step(model, optimizer, 0)
        ck.save(1)
        ck.fence()  # nothing changed: fine
        ck.save(2)
        with torch.no_grad():
            model.norm.weight.add_(1.0)  # changes state behind the checkpointer's back
        with pytest.raises(ucl.StoreError) as err:
            ck.fence()
        assert err.value.code == "UCL433" and "norm.weight" in str(err.value)


def test_snapshot_is_the_state_at_save_not_after_the_next_step(tmp_path):
    model, optimizer = make()
    with ucl.Checkpointer(tmp_path, model, optimizer) as ck:
        train_step(model, optimizer, 0)
        ck.save(1)
        want = copy.deepcopy(model.state_dict())
        for i in range(1, 4):  # the next steps change every parameter while the flush may still run
            train_step(model, optimizer, i)
    from ucl.store import CheckpointRoot
    got = ucl.load_rank(CheckpointRoot(tmp_path).latest(), mesh="universal", rank=0, as_torch=True)
    for n, v in want.items():
        if n != "head.weight":
            assert torch.equal(got[f"param/{n}"], v), n


def test_load_into_another_module_is_refused_clearly(tmp_path):
    run(tmp_path)
    model = nn.Linear(3, 3)
    with ucl.Checkpointer(tmp_path, model, torch.optim.SGD(model.parameters(), lr=0.1)) as ck:
        with pytest.raises(ucl.StoreError) as err:
            ck.load()
    assert err.value.code == "UCL434" and "holds another model (the job's bias, weight not in it; it has " in \
        str(err.value), str(err.value)


def test_bad_arguments(tmp_path):
    model, optimizer = make()
    for kw in ({"persist_every": 0}, {"keep": 0}, {"mesh": "tp=2"}):
        with pytest.raises(ucl.UclError):
            ucl.Checkpointer(tmp_path, model, optimizer, **kw)
    with ucl.Checkpointer(tmp_path, model, optimizer) as ck:
        with pytest.raises(ucl.UclError):
            ck.save(-1)
        with pytest.raises(ucl.StoreError):
            ck.load()  # nothing saved yet


def test_numbers_survive_as_json(tmp_path):
    """extra state is JSON; numpy scalars in it are plain numbers."""
    model, optimizer = make()
    with ucl.Checkpointer(tmp_path, model, optimizer) as ck:
        ck.save(0, extra={"lr": np.float32(0.5), "seen": [1, 2]})
    with ucl.Checkpointer(tmp_path, model, optimizer) as ck:
        _, extra = ck.load()
    assert extra == {"lr": 0.5, "seen": [1, 2]}


def test_load_restores_the_snapshot_still_in_host_memory(tmp_path):
    """persist_every=4: steps 5 and 6 exist only in host memory (tier 0). After a bad step, load()
    rolls back to step 6 from memory, bit for bit (model, optimizer, RNG), and training goes on as
    an uninterrupted run would; load(step=4) still reads the disk."""
    _, _, straight = run(tmp_path / "ref", steps=9, save_at=())
    model, optimizer = make()
    with ucl.Checkpointer(tmp_path / "ck", model, optimizer, persist_every=4) as ck:
        for i in range(6):
            train_step(model, optimizer, i)
            ck.save(i + 1, extra={"data_position": i + 1})
        assert ck.root.latest_step() == 4  # 5 and 6 were not written
        want = copy.deepcopy(model.state_dict())
        train_step(model, optimizer, 100)  # a step that must be undone
        with torch.no_grad():
            model.norm.weight.fill_(float("nan"))
        at, extra = ck.load()
        assert (at, extra) == (6, {"data_position": 6})
        assert any(e["phase"] == "restore" and e["tier"] == 0 for e in ck.trace.events())
        for n, v in want.items():
            assert torch.equal(model.state_dict()[n], v), n
        losses = [train_step(model, optimizer, i) for i in range(6, 9)]
        assert losses == straight[6:]
        at, _ = ck.load(step=4)  # an older step: from disk
        assert at == 4


def test_an_fsspec_tier_gets_every_checkpoint_and_gives_it_back(tmp_path):
    """tiers=["memory://..."]: each durable checkpoint is uploaded (manifest last, then latest), older
    ones pruned to keep; fetch() brings one back as an ordinary local checkpoint; a half-uploaded
    folder (no manifest) is not a checkpoint and the next promotion of that step completes it."""
    import uuid

    pytest.importorskip("fsspec")
    from ucl.store import CheckpointRoot
    from ucl.train.tiers import RemoteTier
    url = f"memory://ucl-test-{uuid.uuid4().hex}/run"
    run(tmp_path / "local", steps=5, save_at=range(1, 6), keep=2, tiers=[url])
    remote = RemoteTier.open(url)
    assert remote.steps() == [4, 5] and remote.latest_step() == 5
    back = remote.fetch(None, str(tmp_path / "fetched"))
    with ucl.open(back) as ck:
        assert ck.verify() == []
    local = CheckpointRoot(tmp_path / "local").latest()
    a = ucl.load_rank(local, mesh="universal", rank=0)
    b = ucl.load_rank(back, mesh="universal", rank=0)
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    # a promotion killed before its manifest: not a checkpoint; promoting the step again completes it
    remote.fs.rm_file(f"{remote.root}/step_00000005/manifest.json")
    assert remote.steps() == [4]
    remote.promote(local, 5, keep=2)
    assert remote.steps() == [4, 5]
    with pytest.raises(ucl.UclError, match="no committed checkpoint of step 3"):
        remote.fetch(3, str(tmp_path / "nothing"))
    assert not (tmp_path / "nothing").exists()


def test_a_tier_url_fsspec_cannot_open_is_refused(tmp_path):
    model, optimizer = make()
    with pytest.raises(ucl.UclError, match="fsspec cannot open") as e:
        ucl.Checkpointer(tmp_path, model, optimizer, tiers=["nosuchscheme-ucl://bucket/x"])
    assert e.value.code == "UCL430"


# ---- promotion: its own stage ------------------------------------------------------------------

def _gated_tier(protocol: str, *, fail_step: int | None = None):
    """An fsspec memory filesystem under ``protocol`` whose uploads wait for ``gate`` (set by
    default) and fail for checkpoint ``fail_step``; ``started`` is set by the first upload."""
    import threading
    fsspec = pytest.importorskip("fsspec")
    from fsspec.implementations.memory import MemoryFileSystem

    class Gated(MemoryFileSystem):
        gate, started = threading.Event(), threading.Event()

        @classmethod
        def _strip_protocol(cls, path):
            return super()._strip_protocol(path.removeprefix(f"{protocol}://") if isinstance(path, str) else path)

        def put_file(self, lpath, rpath, **kw):
            Gated.started.set()
            assert Gated.gate.wait(120), "the test never opened the gate"
            if fail_step is not None and f"step_{fail_step:08d}/" in rpath:
                raise OSError(5, "Input/output error")
            return super().put_file(lpath, rpath, **kw)

    Gated.protocol = protocol
    Gated.gate.set()
    fsspec.register_implementation(protocol, Gated, clobber=True)
    return Gated


def _until(condition, what: str) -> None:
    """Poll ``condition`` (a state the background reaches on its own); not a timing assertion."""
    import time
    deadline = time.monotonic() + 120
    while not condition():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.01)


def test_promotion_does_not_delay_the_next_flush_and_wait_waits_for_it(tmp_path):
    """A tier stuck on its first upload: step 2 still becomes durable in tier 1 while the promotion
    of step 1 hangs; wait() does not return until both are promoted."""
    import threading
    import uuid
    from ucl.store import CheckpointRoot
    from ucl.train.tiers import RemoteTier
    gated = _gated_tier("ucltestgated")
    gated.gate.clear()
    url = f"ucltestgated://run-{uuid.uuid4().hex}"
    model, optimizer = make()
    local = CheckpointRoot(tmp_path / "local")
    ck = ucl.Checkpointer(local.root, model, optimizer, keep=3, tiers=[url])
    try:
        train_step(model, optimizer, 0)
        ck.save(1)
        _until(gated.started.is_set, "the promotion of step 1 started")
        train_step(model, optimizer, 1)
        ck.save(2)
        _until(lambda: local.latest_step() == 2, "step 2 durable while the promotion of step 1 is stuck")
        remote = RemoteTier.open(url)
        assert remote.steps() == []
        waiter = threading.Thread(target=ck.wait)
        waiter.start()
        waiter.join(0.5)
        assert waiter.is_alive(), "wait() returned before the promotions were done"
        gated.gate.set()
        waiter.join(120)
        assert not waiter.is_alive()
        assert remote.steps() == [1, 2] and remote.latest_step() == 2
        events = ck.trace.events()
        flush2 = next(e for e in events if e["phase"] == "flush" and e["step"] == 2)
        promote1 = next(e for e in events if e["phase"] == "promote" and e["step"] == 1)
        assert flush2["end"] < promote1["end"] and promote1["tier"] == 2
    finally:
        gated.gate.set()
        ck.close()
    # the staged hard links are gone once promoted
    assert not [n for n in os.listdir(local.root) if ".tmp-" in n]


def test_a_promotion_error_surfaces_naming_rank_step_and_tier(tmp_path):
    import uuid
    from ucl.store import CheckpointRoot
    from ucl.train.tiers import RemoteTier
    _gated_tier("ucltestfailing", fail_step=2)
    url = f"ucltestfailing://run-{uuid.uuid4().hex}"
    model, optimizer = make()
    ck = ucl.Checkpointer(tmp_path, model, optimizer, keep=2, tiers=[url])
    for i in range(2):
        train_step(model, optimizer, i)
        ck.save(i + 1)
    with pytest.raises(ucl.StoreError) as err:
        ck.wait()
    assert err.value.code == "UCL435"
    assert all(s in str(err.value) for s in ("rank 0", "step 2", "tier 2", url, "Input/output error")), err.value
    assert CheckpointRoot(tmp_path).latest_step() == 2  # durable in tier 1 all the same
    remote = RemoteTier.open(url)
    assert remote.steps() == [1] and remote.latest_step() == 1  # nothing half-promoted is visible
    train_step(model, optimizer, 2)
    ck.save(3)  # it keeps working after the error was reported
    ck.close()
    assert remote.steps() == [1, 3] and remote.latest_step() == 3


def test_a_directory_tier_keeps_whole_checkpoints_when_tier_1_prunes_them_first(tmp_path):
    """keep=1 in tier 1 prunes each checkpoint as soon as the next is durable, possibly before it is
    promoted: the promoter copies from its own hard links, so the tier still gets every one."""
    from ucl.store import CheckpointRoot
    tier = CheckpointRoot(tmp_path / "tier")
    _, _, losses = run(tmp_path / "local", steps=5, save_at=range(1, 6), keep=1, tiers=[tier.root])
    assert CheckpointRoot(tmp_path / "local").steps() == [5]
    assert tier.steps() == [5] and tier.latest_step() == 5
    with ucl.open(tier.latest()) as ck:
        assert ck.verify() == []
    *_, at, _, again = resume(tier.root, steps=5)
    assert at == 5 and again == []


def test_snapshot_of_strided_and_half_precision_tensors_is_bit_exact(tmp_path):
    """The copier copies plain contiguous CPU tensors as bytes and falls back to torch for others (a
    transposed parameter here); the checkpoint's stored arrays equal the tensors at save(), whatever
    training did afterwards."""
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.t = nn.Parameter(torch.randn(8, 4).t())  # a strided view
            self.h = nn.Parameter(torch.randn(5, 7, dtype=torch.bfloat16))
            self.w = nn.Parameter(torch.randn(3, 6, dtype=torch.float16))

    torch.manual_seed(0)
    m = M()
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    want = {k: v.detach().clone() for k, v in m.state_dict().items()}
    assert not m.t.is_contiguous()
    with ucl.Checkpointer(tmp_path, m, opt) as ck:
        ck.save(1)
        sum(p.float().sum() for p in m.parameters()).backward()
        opt.step()  # changes every parameter once the snapshot is done
        ck.wait()
        got = ucl.load_rank(ck.root.latest(), mesh="universal", rank=0)
    for k, v in want.items():
        stored = got[f"param/{k}"]
        raw = v.contiguous().view(torch.int16 if v.element_size() == 2 else torch.int32).numpy()
        assert stored.shape == tuple(v.shape) and np.array_equal(stored.view(raw.dtype), raw), k


@pytest.mark.parametrize("kind", ["dir", "fsspec"])
def test_a_tier_mirrors_a_rewind_of_the_run(tmp_path, kind):
    """load(step=2) after steps 1-4, then saving 3 and 4 again: tier 1 drops the abandoned 3 and 4
    and so must every further tier; their step 3 must be the new one, not the old one kept."""
    import uuid

    from ucl.store import CheckpointRoot
    from ucl.train.tiers import RemoteTier, open_tier
    if kind == "fsspec":
        pytest.importorskip("fsspec")
    tier = str(tmp_path / "tier2") if kind == "dir" else f"memory://ucl-test-{uuid.uuid4().hex}/run"
    local = tmp_path / "local"
    run(local, steps=4, save_at=(1, 2, 3, 4), keep=5, tiers=[tier])
    model, optimizer = make(seed=7)
    with ucl.Checkpointer(local, model, optimizer, keep=5, tiers=[tier]) as ck:
        assert ck.load(step=2)[0] == 2
        train_step(model, optimizer, 50)  # another path than the first run's
        ck.save(3)
    t = open_tier(tier)
    assert t.steps() == [1, 2, 3] and t.latest_step() == 3
    assert CheckpointRoot(local).steps() == [1, 2, 3]
    with open(os.path.join(CheckpointRoot(local).path_for(3), "manifest.json"), "rb") as f:
        want = f.read()
    got = (open(os.path.join(t.path_for(3), "manifest.json"), "rb").read() if kind == "dir"
           else t.fs.cat_file(t._join(CheckpointRoot.dir_name(3), "manifest.json")))
    assert got == want  # the new step 3, not the abandoned one
    if isinstance(t, RemoteTier):
        fetched = t.fetch(3, str(tmp_path / "fetched"))
        with ucl.open(fetched) as c:
            assert c.verify() == []


def test_a_checkpoint_committed_but_not_promoted_is_promoted_on_restart(tmp_path):
    """A job killed after committing step 3 in tier 1 but before promoting it: the next Checkpointer,
    when it takes the root (its first save; a Checkpointer that only loads changes nothing), promotes
    it to the tiers that are behind, and leaves a tier that is ahead alone."""
    from ucl.store import CheckpointRoot
    from ucl.train.tiers import promote
    local, behind, ahead = tmp_path / "local", CheckpointRoot(tmp_path / "behind"), CheckpointRoot(tmp_path / "ahead")
    run(local, steps=5, save_at=(1, 3, 5), keep=5)  # no tiers: nothing promoted
    root = CheckpointRoot(local)
    promote(root.path_for(1), behind, 1, keep=5)
    for s in (1, 3, 5):
        promote(root.path_for(s), ahead, s, keep=5)
    shutil.rmtree(root.path_for(5))  # tier 1 lost its newest: the further tier is ahead
    root.adopt_newest()
    model, optimizer = make()
    with ucl.Checkpointer(local, model, optimizer, keep=5, tiers=[behind.root, ahead.root]) as ck:
        ck.wait()
        assert behind.steps() == [1] and ahead.steps() == [1, 3, 5]  # a reader so far
        assert ck.load()[0] == 3
        ck.save(4)
        ck.wait()
        promoted = sorted((e["step"], e["tier"]) for e in ck.trace.events() if e["phase"] == "promote")
    assert promoted == [(3, 2), (4, 2), (4, 3)]  # step 3 caught up where it was missing only
    assert behind.steps() == [1, 3, 4] and behind.latest_step() == 4
    assert ahead.steps() == [1, 3, 4] and ahead.latest_step() == 4  # step 5 belonged to the abandoned run
