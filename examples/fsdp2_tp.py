"""Checkpoint an FSDP2 x TP job (DTensor) with ucl.Checkpointer and resume it on another layout.

    torchrun --nproc_per_node 4 examples/fsdp2_tp.py /tmp/dtensor --tp 2 --steps 6     # dp=2 x tp=2
    torchrun --nproc_per_node 2 examples/fsdp2_tp.py /tmp/dtensor --tp 1 --steps 10    # FSDP2 only, resumes at 6

The spec is derived from the DTensor placements and the DeviceMesh's dim names (print it with
`ucl.train.derive(model, optimizer).spec_text`); the second run reads the first one's checkpoint
straight into its own shards, whatever the world size or placement. gloo on CPU here; the same
script runs with nccl on GPUs (`--backend nccl`).
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import ucl


class Block(torch.nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.up, self.down = torch.nn.Linear(dim, hidden), torch.nn.Linear(hidden, dim)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class MLP(torch.nn.Module):
    def __init__(self, dim: int = 64, hidden: int = 256, layers: int = 2):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(dim, hidden) for _ in range(layers))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("root")
    ap.add_argument("--tp", type=int, default=2, help="tensor-parallel degree (the rest is FSDP2's dp)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--save-every", type=int, default=3)
    ap.add_argument("--backend", default="gloo")
    args = ap.parse_args()

    dist.init_process_group(args.backend)
    device = "cuda" if args.backend == "nccl" else "cpu"
    if device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh(device, (world // args.tp, args.tp), mesh_dim_names=("dp", "tp"))

    torch.manual_seed(0)  # the same initial weights everywhere, then sharded
    model = MLP().to(device)
    if args.tp > 1:
        for b in model.blocks:
            parallelize_module(b, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    for b in model.blocks:
        fully_shard(b, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    with ucl.Checkpointer(args.root, model, optimizer) as ckpt:  # every process, the same root
        step = 0
        if ckpt.root.latest() is not None:
            step, _ = ckpt.load()
            if rank == 0:
                print(f"resumed at step {step} on dp={world // args.tp} x tp={args.tp}")
        while step < args.steps:
            g = torch.Generator().manual_seed(1000 + step)  # the same batch on every rank (a toy)
            x = torch.randn(16, 64, generator=g).to(device)
            loss = model(x).square().mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            if rank == 0:
                print(f"step {step} loss {loss.item():.6f}", flush=True)
            if step % args.save_every == 0:
                ckpt.save(step)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
