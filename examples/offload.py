"""ZeRO-Offload-style training checkpointed with ucl.Checkpointer: the fp32 master weights and the
AdamW moments live in host memory and a CPU optimizer updates them; the model that runs forward and
backward holds a bf16 copy (on the GPU when there is one). The checkpoint is taken from the host
copies directly: no device round trip, behind the same fence as any optimizer step.

    python examples/offload.py /tmp/offload --steps 20           # trains, saving every 5 steps
    python examples/offload.py /tmp/offload --steps 30           # resumes at 20

On resume only the master is restored; the device copy is refreshed from it.
"""
from __future__ import annotations

import argparse
import copy

import torch

import ucl


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("root")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--save-every", type=int, default=5)
    args = ap.parse_args()

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    master = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))  # fp32, host
    model = copy.deepcopy(master).to(device, torch.bfloat16)  # bf16 compute copy
    cpu_adam = torch.optim.AdamW(master.parameters(), lr=1e-3)  # runs on the CPU, in place on the host tensors

    def refresh_device_copy():
        with torch.no_grad():
            for m, d in zip(master.parameters(), model.parameters()):
                d.copy_(m)

    with ucl.Checkpointer(args.root, master, cpu_adam) as ckpt:
        step = 0
        if ckpt.root.latest() is not None:
            step, _ = ckpt.load()
            refresh_device_copy()
            print(f"resumed at step {step}")
        while step < args.steps:
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(32, 64, generator=g), torch.randn(32, 64, generator=g)
            out = model(x.to(device, torch.bfloat16)).float()
            loss = torch.nn.functional.mse_loss(out, y.to(device))
            model.zero_grad()
            loss.backward()
            for m, d in zip(master.parameters(), model.parameters()):
                m.grad = d.grad.to("cpu", torch.float32)  # gradients offloaded to the host
            cpu_adam.step()  # the checkpointer's step pre-hook fences here: waits only if a snapshot is copying
            refresh_device_copy()
            step += 1
            print(f"step {step} loss {loss.item():.6f}", flush=True)
            if step % args.save_every == 0:
                ckpt.save(step)


if __name__ == "__main__":
    main()
