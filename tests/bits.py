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


def import_reshard_and_back(src, tmp_path, to: str, universal: dict, mesh: dict) -> None:
    """A foreign folder imported (a verified ucl checkpoint in its own layout ``mesh``) and resharded
    in place to ``to`` and back to universal: both hold ``universal``'s tensors bit for bit."""
    import ucl
    stats = ucl.import_checkpoint(src, tmp_path / "imported")
    assert stats.datasets_written > 0
    with ucl.open(tmp_path / "imported") as ck:
        assert ck.verify() == []
        assert dict(ck.manifest.mesh) == mesh
    ucl.reshard(src, tmp_path / "re", to=to)
    ucl.reshard(tmp_path / "re", tmp_path / "back", to="universal")
    for path in (tmp_path / "imported", tmp_path / "back"):
        again = ucl.load_rank(path, mesh="universal", rank=0)
        assert set(again) == set(universal)
        for k, v in universal.items():
            assert same_bits(again[k], v), (path.name, k)
