"""The few torch.distributed collectives the save and load paths need: JSON values over byte
tensors (never pickle on the wire)."""
from __future__ import annotations

import json
from typing import Any


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
    return json.loads(bytes(buf.tolist()).decode())


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
    return [json.loads(bytes(b[:int(s.item())].tolist()).decode()) for b, s in zip(bufs, sizes)]
