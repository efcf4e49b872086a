"""ucl.Checkpointer where a training script does something slightly unusual: state only some
parameters have (an unused branch, a rollback to before the first step, progressive unfreezing),
tensor hyperparameters, an ``extra`` dict changed after ``save``, irregular step numbers with
``persist_every``, a run started again in a root that holds a newer one, use after ``close``. Each
case compares against what torch itself holds (``state_dict()``), never against ucl's own reading."""
from __future__ import annotations

import json
import os

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn

import ucl  # noqa: E402


def _net(seed=0, frozen_first=False):
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))
    if frozen_first:
        net[0].requires_grad_(False)
    return net


def _step(net, opt, i):
    g = torch.Generator().manual_seed(100 + i)
    loss = net(torch.randn(6, 4, generator=g)).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.item()


def _same_state(a: dict, b: dict) -> None:
    """Optimizer state dicts equal bit for bit: the same parameters have state, equal tensors."""
    assert sorted(a["state"]) == sorted(b["state"])
    for k in a["state"]:
        sa, sb = a["state"][k], b["state"][k]
        assert sorted(sa) == sorted(sb), k
        for name in sa:
            assert torch.equal(torch.as_tensor(sa[name]), torch.as_tensor(sb[name])), (k, name)


def _disk_extra(root, step) -> object:
    with open(os.path.join(root, f"step_{step:08d}", "manifest.json")) as f:
        return json.load(f)["state"]["extra"]


def test_a_parameter_without_state_resumes(tmp_path):
    """A branch no gradient reached (an expert not routed to yet) has no Adam state; a fresh job
    resumes, and its optimizer has state for the same parameters as the saved one."""
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.used, self.unused = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            return self.used(x)

    net = Net()
    opt = torch.optim.AdamW(net.parameters(), lr=0.1)
    with ucl.Checkpointer(tmp_path, net, opt) as ck:
        net(torch.randn(2, 4)).sum().backward()
        opt.step()
        ck.save(1)
    fresh = Net()
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    with ucl.Checkpointer(tmp_path, fresh, fresh_opt) as ck:
        assert ck.load() == (1, None)
    _same_state(opt.state_dict(), fresh_opt.state_dict())
    assert len(fresh_opt.state_dict()["state"]) == 2  # used.weight, used.bias


def test_rollback_to_before_the_first_step_drops_the_state(tmp_path):
    """Step 0 was saved before any optimizer step: rolling back to it leaves the optimizer as
    ``load_state_dict`` of that moment would (no state), weights as they were."""
    net = _net()
    opt = torch.optim.Adam(net.parameters(), lr=0.01)
    with ucl.Checkpointer(tmp_path, net, opt, keep=5) as ck:
        ck.save(0)
        at_zero = {k: v.clone() for k, v in net.state_dict().items()}
        for i in range(3):
            _step(net, opt, i)
            ck.save(i + 1)
        ck.wait()
        assert ck.load(step=0) == (0, None)
        assert opt.state_dict()["state"] == {}
        for k, v in at_zero.items():
            assert torch.equal(net.state_dict()[k], v), k
        _step(net, opt, 0)  # and training goes on from there
        ck.save(1)


def test_state_of_a_parameter_frozen_at_load_is_kept(tmp_path):
    """Progressive unfreezing: the first layer, frozen when the job starts, was unfrozen before the
    checkpoint. A restarted job (first layer frozen again, as its script builds it) gets the Adam
    moments of all four parameters back, then continues exactly as the original run."""
    net = _net(frozen_first=True)
    opt = torch.optim.Adam(net.parameters(), lr=0.01)
    with ucl.Checkpointer(tmp_path, net, opt) as ck:
        _step(net, opt, 0)
        net[0].requires_grad_(True)
        for i in range(1, 3):
            _step(net, opt, i)
        ck.save(3)
    want_losses = [_step(net, opt, i) for i in range(3, 5)]
    fresh = _net(seed=1, frozen_first=True)
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.01)
    with ucl.Checkpointer(tmp_path, fresh, fresh_opt) as ck:
        assert ck.load()[0] == 3
        assert len(fresh_opt.state_dict()["state"]) == 6  # two linears and the batch norm, weight and bias
        fresh[0].requires_grad_(True)
        assert [_step(fresh, fresh_opt, i) for i in range(3, 5)] == want_losses


def test_a_tensor_learning_rate_stays_that_tensor(tmp_path):
    """``lr=torch.tensor(...)`` (compiled or capturable optimizers need it) is filled in place."""
    net = _net()
    lr = torch.tensor(1e-3)
    opt = torch.optim.AdamW(net.parameters(), lr=lr)
    with ucl.Checkpointer(tmp_path, net, opt) as ck:
        _step(net, opt, 0)
        ck.save(1)
        ck.wait()
        opt.param_groups[0]["lr"].fill_(5.0)
    with ucl.Checkpointer(tmp_path, net, opt) as ck:  # from disk: a new checkpointer has no tier 0
        ck.load()
    assert opt.param_groups[0]["lr"] is lr and lr.item() == torch.tensor(1e-3).item()


def test_extra_is_what_it_was_at_save(tmp_path):
    """A loop that updates one dict and saves it each step: every checkpoint keeps the values of
    its own ``save`` call, on disk and in host memory."""
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    meta = {"position": 0, "seen": []}
    with ucl.Checkpointer(tmp_path, net, opt, keep=5, persist_every=1) as ck:
        for step in range(1, 4):
            meta["position"] = step * 10
            meta["seen"].append(step)
            ck.save(step, extra=meta)
            meta["position"] = -1  # changed before the snapshot is written
        ck.wait()
        for step in range(1, 4):
            assert _disk_extra(tmp_path, step) == {"position": step * 10, "seen": list(range(1, step + 1))}
        assert ck.load() == (3, {"position": 30, "seen": [1, 2, 3]})


@pytest.mark.parametrize("extra", [torch.ones(2), object(), float("nan"), {"x": float("inf")}])
def test_extra_that_is_not_json_is_refused_by_save(tmp_path, extra):
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with ucl.Checkpointer(tmp_path, net, opt) as ck:
        with pytest.raises(ucl.UclError, match="step 7: extra must be a JSON value"):
            ck.save(7, extra=extra)
        ck.save(8, extra={"fine": True})  # nothing was left half-done
    assert _disk_extra(tmp_path, 8) == {"fine": True}


def test_persist_every_writes_irregular_steps_too(tmp_path):
    """Written: steps that are multiples of N, and any save after N - 1 unwritten ones in a row."""
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with ucl.Checkpointer(tmp_path / "odd", net, opt, persist_every=2, keep=10) as ck:
        for step in (5, 15, 25, 35, 45):
            ck.save(step)
    assert ucl.store.CheckpointRoot(tmp_path / "odd").steps() == [15, 35]
    with ucl.Checkpointer(tmp_path / "every", net, opt, persist_every=3, keep=10) as ck:
        for step in range(1, 11):
            ck.save(step)
    assert ucl.store.CheckpointRoot(tmp_path / "every").steps() == [3, 6, 9]


def test_an_older_step_in_a_root_with_a_newer_run_is_refused(tmp_path):
    """A second run started in the same root without load(): saving step 1 would delete steps
    100-300 once durable. It is refused at save(), and nothing is deleted; after load(step=k) a
    rollback saves as usual."""
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with ucl.Checkpointer(tmp_path, net, opt) as ck:
        for step in (100, 200, 300):
            ck.save(step)
    with ucl.Checkpointer(tmp_path, net, opt) as ck:
        with pytest.raises(ucl.UclError, match="already holds step 300"):
            ck.save(1)
        ck.save(300)  # the newest again: replaces it, deletes nothing
        ck.load(step=100)
        ck.save(101)
    assert ucl.store.CheckpointRoot(tmp_path).steps() == [100, 101]


def test_save_after_close_is_an_error_not_a_hang(tmp_path):
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    ck = ucl.Checkpointer(tmp_path, net, opt)
    ck.save(1)
    ck.close()
    with pytest.raises(ucl.UclError, match="after close"):
        ck.save(2)
    _step(net, opt, 0)  # the step hook is gone: nothing waits
    ck.wait()
    ck.close()


def test_debug_mode_lets_forward_update_buffers(tmp_path):
    """Batch norm updates its running statistics in every forward: buffers are copied inside
    save(), so the debug check must not count them as state changed without a fence."""
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with ucl.Checkpointer(tmp_path, net, opt, debug=True) as ck:
        for i in range(3):
            _step(net, opt, i)
            ck.save(i + 1)


def test_a_failed_load_changes_nothing(tmp_path):
    """A checkpoint of another model is refused before the fresh optimizer gets any state, and the
    user's step hooks never see a step (an EMA hook would otherwise move)."""
    net = _net()
    opt = torch.optim.Adam(net.parameters())
    with ucl.Checkpointer(tmp_path, net, opt) as ck:
        _step(net, opt, 0)
        ck.save(1)
    other = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))
    other_opt = torch.optim.Adam(other.parameters())
    calls = []
    other_opt.register_step_post_hook(lambda *a: calls.append(1))
    with ucl.Checkpointer(tmp_path / "other", other, other_opt) as ck:
        ck.root = ucl.store.CheckpointRoot(tmp_path)
        with pytest.raises(ucl.StoreError, match="another model"):
            ck.load()
    assert other_opt.state_dict()["state"] == {} and calls == []


def test_state_creation_runs_no_user_hooks(tmp_path):
    """Loading into a fresh optimizer creates its state with one zero step: the user's hooks do not
    run for it."""
    net = _net()
    opt = torch.optim.AdamW(net.parameters())
    with ucl.Checkpointer(tmp_path, net, opt) as ck:
        _step(net, opt, 0)
        ck.save(1)
    fresh = _net(seed=3)
    fresh_opt = torch.optim.AdamW(fresh.parameters())
    calls = []
    fresh_opt.register_step_post_hook(lambda *a: calls.append(1))
    with ucl.Checkpointer(tmp_path, fresh, fresh_opt) as ck:
        ck.load()
    assert calls == []
    _same_state(opt.state_dict(), fresh_opt.state_dict())


def test_sparse_adam_resumes(tmp_path):
    emb = nn.Embedding(10, 4, sparse=True)
    opt = torch.optim.SparseAdam(list(emb.parameters()), lr=0.1)
    with ucl.Checkpointer(tmp_path, emb, opt) as ck:
        emb(torch.tensor([1, 2, 3])).sum().backward()
        opt.step()
        ck.save(1)
    fresh = nn.Embedding(10, 4, sparse=True)
    fresh_opt = torch.optim.SparseAdam(list(fresh.parameters()), lr=0.1)
    with ucl.Checkpointer(tmp_path, fresh, fresh_opt) as ck:
        ck.load()
    assert torch.equal(fresh.weight, emb.weight)
    _same_state(opt.state_dict(), fresh_opt.state_dict())


def test_a_reported_error_stops_nothing_a_failure_stops_flushes():
    """A failed promotion is reported (raised by the next call; later checkpoints are still
    written), a failed write or snapshot stops further flushes until it is raised."""
    from ucl.train.progress import Progress
    p = Progress()
    p.report(ucl.StoreError("promotion failed", code="UCL435"))
    assert not p.failed
    with pytest.raises(ucl.StoreError, match="promotion failed"):
        p.raise_error()
    p.fail(ucl.StoreError("write failed", code="UCL410"))
    p.report(ucl.StoreError("later", code="UCL435"))  # the first error wins
    assert p.failed
    with pytest.raises(ucl.StoreError, match="write failed"):
        p.raise_error()
    assert not p.failed
    p.raise_error()  # nothing left


def test_the_step_hook_fences_but_raises_nothing(tmp_path):
    """A background error is raised by save/wait/close/fence(), never inside optimizer.step() (on
    one process only it would skip that step there and part the processes' weights)."""
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    ck = ucl.Checkpointer(tmp_path, net, opt)
    ck.save(1)
    ck._progress.fail(ucl.StoreError("injected", code="UCL410"))
    _step(net, opt, 0)  # fences, raises nothing
    with pytest.raises(ucl.StoreError, match="injected"):
        ck.fence()
    ck.close()


MANUAL = "mesh tp\nw [8, 4] : split 0 over tp\nstate exp_avg, exp_avg_sq : follow\nstate step : scalar\n"


@pytest.mark.parametrize("mesh,code,needle", [
    (None, "UCL430", "spec= needs mesh="),
    (ucl.Mesh(mp=1), "UCL304", "mesh axis 'mp' is not declared by the spec"),
    (ucl.Mesh(tp=2), "UCL430", "has 2 ranks but the job has 1 processes"),
])
def test_a_manual_layout_that_cannot_fit_is_refused_when_the_checkpointer_is_made(tmp_path, mesh, code, needle):
    """Not at the first save(), hours into the run."""
    net = nn.Linear(4, 8, bias=False)
    with pytest.raises(ucl.UclError) as err:
        ucl.Checkpointer(tmp_path, net, torch.optim.AdamW(net.parameters()), spec=MANUAL, mesh=mesh)
    assert err.value.code == code and needle in str(err.value), str(err.value)
    assert not os.listdir(tmp_path)


def test_a_spec_naming_state_the_optimizer_lacks_says_so_once(tmp_path):
    """SGD without momentum has no exp_avg: one line saying which kinds the optimizer holds, not
    one 'missing' line per parameter and kind."""
    net = nn.Linear(4, 8, bias=False)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    _step(nn.Sequential(net), opt, 0)
    with ucl.Checkpointer(tmp_path, net, opt, spec=MANUAL, mesh=ucl.Mesh(tp=1)) as ck:
        with pytest.raises(ucl.StoreError) as err:
            ck.save(1)
    text = str(err.value)
    assert err.value.code == "UCL421" and "the optimizer holds no exp_avg, exp_avg_sq, step state (it holds none" in text, text
    assert "missing exp_avg" not in text, text


def test_a_checkpoint_of_another_optimizer_is_refused_naming_both(tmp_path):
    """Saved with SGD (momentum), loaded with AdamW: UCL434 names SGD and AdamW and their state, not
    a plan's "source has no exp_avg" (UCL316); the AdamW and the weights are left as they were."""
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    with ucl.Checkpointer(tmp_path, net, opt) as ck:
        _step(net, opt, 0)
        ck.save(1)
    fresh = _net(seed=1)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    adamw = torch.optim.AdamW(fresh.parameters())
    with ucl.Checkpointer(tmp_path, fresh, adamw) as ck:
        with pytest.raises(ucl.StoreError) as info:
            ck.load()
    msg = str(info.value)
    assert info.value.code == "UCL434", msg
    assert "saved with SGD (state: momentum_buffer)" in msg and "optimizer is AdamW (state: exp_avg" in msg, msg
    assert "nothing was changed" in msg and "without an optimizer" in msg
    assert adamw.state_dict()["state"] == {}
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in before.items())
    with ucl.Checkpointer(tmp_path, fresh) as ck:  # what the message suggests: the weights alone
        assert ck.load() == (1, None)
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in net.state_dict().items())


def test_adam_state_loads_into_adamw(tmp_path):
    """Another class with the same state is not refused (a switch from Adam to AdamW is common)."""
    net = _net()
    opt = torch.optim.Adam(net.parameters(), lr=0.01)
    with ucl.Checkpointer(tmp_path, net, opt) as ck:
        _step(net, opt, 0)
        ck.save(1)
    fresh = _net(seed=1)
    adamw = torch.optim.AdamW(fresh.parameters(), lr=0.01)
    with ucl.Checkpointer(tmp_path, fresh, adamw) as ck:
        assert ck.load() == (1, None)
    _same_state(opt.state_dict(), adamw.state_dict())


def test_loading_a_step_that_is_not_there_lists_the_steps_that_are(tmp_path):
    net = _net()
    opt = torch.optim.Adam(net.parameters())
    with ucl.Checkpointer(tmp_path, net, opt, keep=5) as ck:
        for s in (2, 4, 6):
            _step(net, opt, s)
            ck.save(s)
        ck.wait()
        with pytest.raises(ucl.StoreError) as info:
            ck.load(step=7)
    assert info.value.code == "UCL404"
    assert str(info.value) == f"no checkpoint of step 7 in {tmp_path}; the steps there: 2, 4, 6"


def _saved_by_two_processes(root, step) -> None:
    """The checkpoint as if two processes had saved it: its RNG states, one per process."""
    path = os.path.join(root, f"step_{step:08d}", "manifest.json")
    with open(path) as f:
        manifest = json.load(f)
    manifest["state"]["rng"]["1"] = manifest["state"]["rng"]["0"]
    with open(path, "w") as f:
        json.dump(manifest, f)


def test_the_rng_warning_of_another_world_size_is_raised_once_at_the_callers_load_line(tmp_path):
    import inspect
    import warnings
    net = _net()
    opt = torch.optim.Adam(net.parameters())
    with ucl.Checkpointer(tmp_path, net, opt) as ck:
        _step(net, opt, 0)
        ck.save(1)
    _saved_by_two_processes(tmp_path, 1)
    with ucl.Checkpointer(tmp_path, _net(), None) as ck:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            line = inspect.currentframe().f_lineno + 1
            ck.load()
    rng = [w for w in caught if "RNG states" in str(w.message)]
    assert len(rng) == 1, [str(w.message) for w in caught]
    assert "of 2 processes, this job has 1" in str(rng[0].message)
    assert (rng[0].filename, rng[0].lineno) == (__file__, line)


def test_only_process_rank_0_warns_that_rng_states_are_not_restored():
    import warnings
    from ucl.train import rng
    saved = {"0": rng.capture(), "1": rng.capture()}
    for rank, expected in ((0, 1), (1, 0), (2, 0)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            rng.restore(saved, rank, 4)
        assert len(caught) == expected, rank


@pytest.mark.parametrize("bf16_layers", [(1,), (0,), (0, 1, 2)])
def test_a_module_with_layers_in_several_dtypes_resumes(tmp_path, bf16_layers):
    """One bf16 layer among fp32 ones (a half tie of dtypes, so no dtype is the common one by far):
    every parameter's Adam state is declared, whatever dtype is the commonest (the derived spec
    once declared the state only for the layers in the rarer dtype: UCL421 at the first save)."""
    def make():
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2))
        for i in bf16_layers:
            net[i].to(torch.bfloat16)
        return net, torch.optim.AdamW(net.parameters(), lr=0.1)

    net, opt = make()
    with ucl.Checkpointer(tmp_path, net, opt) as ck:
        for p in net.parameters():
            p.grad = torch.full_like(p, 0.5)
        opt.step()
        ck.save(1)
    fresh, fresh_opt = make()
    with ucl.Checkpointer(tmp_path, fresh, fresh_opt) as ck:
        assert ck.load() == (1, None)
    for a, b in zip(net.state_dict().values(), fresh.state_dict().values()):
        assert a.dtype == b.dtype and torch.equal(a, b)
    _same_state(opt.state_dict(), fresh_opt.state_dict())
