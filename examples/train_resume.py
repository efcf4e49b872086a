"""Checkpoint a training loop with ucl.Checkpointer, kill it, resume it: the resumed run prints
the same losses, bit for bit, as one that was never interrupted.

    python examples/train_resume.py /tmp/run --steps 40 --save-every 5 --kill-at 23   # dies at step 23
    python examples/train_resume.py /tmp/run --steps 40 --save-every 5                # resumes at 20 (or 15)

A seeded toy transformer (embedding, two pre-norm attention + MLP blocks with dropout, AdamW) learns
to predict the next token of random sequences. The data position travels in the checkpoint's `extra`
and the RNG states (dropout) are restored by `load()`, so nothing else needs saving. `--kill-at N`
ends the process with `os._exit` right after step N, without waiting for the background flush:
what was durable by then survives, whatever was in flight does not count.
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.nn as nn

import ucl

VOCAB, DIM, SEQ, BATCH = 128, 64, 32, 8


class TinyGPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, DIM), nn.Parameter(torch.zeros(SEQ, DIM))
        self.blocks = nn.ModuleList(nn.TransformerEncoderLayer(DIM, 4, 4 * DIM, dropout=0.1, batch_first=True,
                                                               norm_first=True) for _ in range(2))
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.tok.weight  # tied: saved once, tied again on load

    def forward(self, idx):
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        mask = nn.Transformer.generate_square_subsequent_mask(idx.shape[1])
        for block in self.blocks:
            x = block(x, src_mask=mask, is_causal=True)
        return self.head(x) * DIM ** -0.5  # tied to an N(0, 1) embedding: keep the first logits small


def batch(position: int) -> torch.Tensor:
    """The batch at a data position: a pure function of it, so a resumed run sees the same data."""
    g = torch.Generator().manual_seed(position)
    return torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("root", help="checkpoint folder (created; resumed from when it holds checkpoints)")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--save-every", type=int, default=5)
    ap.add_argument("--kill-at", type=int, default=None, help="die (os._exit) right after this step")
    args = ap.parse_args()

    torch.manual_seed(0)
    model = TinyGPT()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    with ucl.Checkpointer(args.root, model, optimizer, keep=2) as ckpt:
        step, position = 0, 0
        if ckpt.root.latest() is not None:
            step, extra = ckpt.load()  # model, optimizer, step count and RNG, in place
            position = extra["data_position"]
            print(f"resumed at step {step}")
        while step < args.steps:
            data = batch(position)
            logits = model(data[:, :-1])
            loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), data[:, 1:].reshape(-1))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()  # waits only if the last snapshot is still being copied
            step, position = step + 1, position + BATCH
            print(f"step {step} loss {loss.item()!r}", flush=True)
            if step % args.save_every == 0:
                ckpt.save(step, extra={"data_position": position})  # returns at once
            if step == args.kill_at:
                os._exit(0)  # a crash: no wait(), no close()
    # leaving the block waited until every checkpoint saved is durable


if __name__ == "__main__":
    main()
