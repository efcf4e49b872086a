"""Saving a layout: every rank of it from one process, or one rank per process under
torch.distributed, committed atomically."""
from __future__ import annotations

import contextlib
import os
from typing import Any, Mapping

from ..errors import StoreError, UclError
from ..layout.bind import Model
from ..layout.mesh import Mesh, as_mesh
from ..store.rootlock import holding_parent
from ..store.writer import CheckpointWriter
from .collective import commit_collectively
from .dist import allgather_json, initialized_dist
from .prepare import expected_datasets, manifest_fields, normalise


def save(path: str | os.PathLike, shards: Mapping[int, Mapping[str, Any]], *, model: Model, mesh: Mesh,
         state: Any = None, durable: bool = True, compress: str | None = None) -> str:
    """Write every rank of a layout from one process (``shards``: rank -> key -> array/tensor) and
    commit atomically; into a checkpoint root another writer holds, UCL414. Returns the checkpoint
    path. ``durable=False`` skips fsync of the rank files:
    the commit stays atomic against a killed process, not against a power loss. ``compress``
    (``"zstd"``, ``"lz4"``; None or ``"none"``: plain) stores the datasets compressed (docs/format.md)."""
    mesh = as_mesh(mesh)
    nranks = mesh.size
    if set(shards) != set(range(nranks)):
        got = sorted(shards, key=repr)[:8]
        raise StoreError(f"shards must be keyed by the ranks 0..{nranks - 1} of {mesh} (ints), got {got}"
                         f"{'...' if len(shards) > 8 else ''}", code="UCL421")
    checked = {r: normalise(model, mesh, r, shards[r]) for r in range(nranks)}
    want = {r: expected_datasets(model, mesh, r) for r in range(nranks)}
    # write_behind: the arrays stay untouched until commit() returns. Into a checkpoint root
    # (store.rootlock) only while no Checkpointer writes it.
    with holding_parent(path, "ucl.save"), CheckpointWriter(path, nranks, durable=durable, write_behind=True,
                                                            compress=compress,
                                                            **manifest_fields(model, mesh, state)) as w:
        for r in range(nranks):
            for key, arr in checked[r].items():
                w.write(r, key, arr, dtype=want[r][key][1])
        return w.commit()


def save_rank(path: str | os.PathLike, tensors: Mapping[str, Any], *, model: Model, mesh: Mesh, rank: int,
              state: Any = None, durable: bool = True, compress: str | None = None) -> str:
    """Collective save under ``torch.distributed`` (one call per rank; world size = mesh size):
    every rank writes its own file into a shared temporary directory, rank 0 commits once all are
    durable (``durable=False``: written, not fsynced). Without an initialised process group,
    ``mesh`` must have one rank. ``state`` (JSON) is taken from rank 0: pass the same on every rank,
    and gather per-rank values (RNG states) into it yourself. ``compress``: as for :func:`save`."""
    mesh = as_mesh(mesh)
    dist = initialized_dist()
    if dist is None:
        if mesh.size != 1:
            raise StoreError("save_rank on a multi-rank mesh needs torch.distributed to be initialised", code="UCL422")
        return save(path, {0: tensors}, model=model, mesh=mesh, state=state, durable=durable, compress=compress)
    if dist.get_world_size() != mesh.size:
        raise StoreError(f"world size {dist.get_world_size()} != mesh size {mesh.size}", code="UCL422")
    # Every rank checks its tensors, then all learn every problem: one bad rank fails all of them
    # cleanly (nothing written) instead of leaving the others blocked in a collective.
    arrays, problem = {}, ""
    try:
        arrays = normalise(model, mesh, rank, tensors)
    except UclError as e:
        problem = str(e)
    problems = [p for p in allgather_json(problem) if p]
    if problems:
        raise StoreError("checkpoint not written: " + "\n".join(problems), code="UCL421")
    want = expected_datasets(model, mesh, rank)

    def write(writer: CheckpointWriter) -> list[int]:
        for key, arr in arrays.items():
            writer.write(rank, key, arr, dtype=want[key][1])
        return [rank]

    # Rank 0 holds the folder while the collective writes, when it is a locked checkpoint root, as save does
    with contextlib.ExitStack() as held:
        return commit_collectively(os.fspath(path), mesh.size, manifest_fields(model, mesh, state), write,
                                   prepare=lambda: held.enter_context(holding_parent(path, "ucl.save_rank")),
                                   durable=durable, write_behind=True, compress=compress)
