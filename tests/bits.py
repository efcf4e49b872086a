"""Bit-exact comparison for tests: same dtype, shape and bytes (-0.0 != 0.0, NaN payloads count), for
numpy arrays and torch tensors alike."""
from __future__ import annotations

import numpy as np


def same_bits(a, b) -> bool:
    if hasattr(a, "detach"):  # torch tensors: compare their raw bytes
        import torch
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
            a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))
    return a.shape == b.shape and a.dtype == b.dtype and np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes()
