"""The Checkpointer's CUDA path (pinned pool, side stream, events). Skipped without a GPU (CI has
none); run it on a GPU machine: ``python -m pytest -q tests/test_train_cuda.py``."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn

import ucl  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _busy(x, n=30):
    """Queue n large matmuls on the current stream: what follows runs late."""
    y = x
    for _ in range(n):
        y = (y @ x) * 1e-3
    return y


def test_snapshot_waits_for_the_step_queued_before_save(tmp_path):
    """save() right after optimizer.step(), while the step's kernels still wait behind others on
    the training stream: the copy on the side stream must see the values after the step."""
    torch.manual_seed(0)
    net = nn.Linear(4096, 4096).cuda()
    opt = torch.optim.SGD(net.parameters(), lr=0.5, momentum=0.9)
    x = torch.randn(4096, 4096, device="cuda")
    with ucl.Checkpointer(tmp_path, net, opt) as ck:
        for step in range(1, 4):
            net.weight.grad = _busy(x)
            net.bias.grad = net.weight.grad[0].clone()
            opt.step()
            ck.save(step)  # the step above is most likely not done yet
            ck.wait()
            torch.cuda.synchronize()
            want = {k: v.detach().cpu().clone() for k, v in net.state_dict().items()}
            got = ucl.load_rank(ck.root.latest(), mesh="universal", rank=0)
            for k, v in want.items():
                assert torch.equal(torch.as_tensor(got[f"param/{k}"]), v), (step, k)


def test_fence_makes_the_step_wait_for_the_copy(tmp_path):
    """The next optimizer step must not change a parameter before the side stream copied it."""
    torch.manual_seed(0)
    net = nn.Linear(4096, 4096).cuda()
    opt = torch.optim.SGD(net.parameters(), lr=0.5)
    with ucl.Checkpointer(tmp_path, net, opt) as ck:
        net.weight.grad = torch.ones_like(net.weight)
        net.bias.grad = torch.ones_like(net.bias)
        opt.step()
        torch.cuda.synchronize()
        want = {k: v.detach().cpu().clone() for k, v in net.state_dict().items()}
        ck.save(1)
        opt.step()  # fences first: runs after the copy
        ck.wait()
    got = ucl.load_rank(ucl.store.CheckpointRoot(tmp_path).latest(), mesh="universal", rank=0)
    for k, v in want.items():
        assert torch.equal(torch.as_tensor(got[f"param/{k}"]), v), k


@pytest.mark.parametrize("pool_bytes", [8 << 20, 4096])  # four pieces; one (the smallest pool)
def test_snapshot_streamed_through_a_small_pool_is_bit_exact(tmp_path, pool_bytes):
    """A pool smaller than the snapshot: pieces copied from the GPU, hashed and written as they land;
    the step after each save changes every value, so a piece copied late or hashed before it landed
    shows."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(2048, 2048), nn.Linear(2048, 1000)).cuda()
    opt = torch.optim.Adam(net.parameters(), lr=0.1)
    x = torch.randn(2048, 2048, device="cuda")
    with ucl.Checkpointer(tmp_path, net, opt, pool_bytes=pool_bytes) as ck:
        for step in range(1, 4):
            for p in net.parameters():
                p.grad = torch.randn_like(p)
            _busy(x, 10)
            opt.step()
            torch.cuda.synchronize()
            names = {p: n for n, p in net.named_parameters()}
            want = {f"param/{k}": v.detach().cpu().clone() for k, v in net.state_dict().items()}
            want.update({f"{kind}/{names[p]}": v.detach().cpu().clone() for p, st in opt.state.items()
                         for kind, v in st.items() if kind != "step"})
            ck.save(step)
            for p in net.parameters():  # the next step's values: the copy must not see them
                p.grad = torch.randn_like(p)
            opt.step()
            ck.wait()
            got = ucl.load_rank(ck.root.latest(), mesh="universal", rank=0)
            assert len(want) == 12
            for k, v in want.items():
                assert torch.equal(torch.as_tensor(got[k]), v), (step, k)
            trace = [e for e in ck.trace.events() if e["phase"] == "snapshot" and e["step"] == step]
            assert trace and trace[-1].get("pieces", 0) > 1, trace  # it went through the ring
