"""The few torch.distributed pieces the save, load and reshard paths need: JSON values over byte
tensors (never pickle on the wire), a gloo group with its own timeout, a world from torchrun's
environment."""
from __future__ import annotations

import datetime
import json
import os
from typing import Any

from ..errors import StoreError


def initialized_dist():
    """``torch.distributed`` when a process group is initialised, else None (torch is optional)."""
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    return dist if dist.is_available() and dist.is_initialized() else None


def broadcast_json(obj: Any, group=None) -> Any:
    """Broadcast a JSON value from (global) rank 0, over ``group`` (default: the world)."""
    import torch
    dist = initialized_dist()
    data = json.dumps(obj).encode() if dist.get_rank() == 0 else b""
    n = torch.tensor([len(data)], dtype=torch.int64)
    dist.broadcast(n, 0, group=group)
    buf = torch.zeros(int(n.item()), dtype=torch.uint8)
    if dist.get_rank() == 0:
        buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    dist.broadcast(buf, 0, group=group)
    return json.loads(buf.numpy().tobytes().decode())


def allgather_json(obj: Any, group=None) -> list:
    """Every rank's JSON value, in rank order, over ``group`` (default: the world)."""
    import torch
    dist = initialized_dist()
    data = json.dumps(obj).encode()
    n = torch.tensor([len(data)], dtype=torch.int64)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, n, group=group)
    longest = int(max(s.item() for s in sizes))
    buf = torch.zeros(longest, dtype=torch.uint8)
    buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else buf[:0]
    bufs = [torch.zeros(longest, dtype=torch.uint8) for _ in sizes]
    dist.all_gather(bufs, buf, group=group)
    return [json.loads(b[:int(s.item())].numpy().tobytes().decode()) for b, s in zip(bufs, sizes)]


def torchrun_world() -> int:
    """The world size a launcher such as torchrun announced in the environment (1 without one)."""
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        return 1


def gloo_group(timeout_s: float):
    """A new gloo group over the whole world (a collective call) whose operations give up after
    ``timeout_s``: CPU tensors work whatever backend the default group has (NCCL too), and our
    timeout does not change the caller's."""
    return initialized_dist().new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))


def init_from_env(timeout_s: float):
    """``torch.distributed`` with a gloo world made from a launcher's environment (torchrun sets
    RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), or the group already initialised."""
    try:
        import torch.distributed as dist
    except ImportError:
        raise StoreError("running under a launcher (WORLD_SIZE > 1) needs torch: pip install torch", code="UCL422") from None
    if not dist.is_initialized():
        try:
            dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
        except (RuntimeError, ValueError) as e:  # no rendezvous within the timeout, a bad MASTER_ADDR...
            raise StoreError(f"cannot join the distributed job: {e}", code="UCL424") from None
    return dist
