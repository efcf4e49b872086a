"""Loading one rank of any layout straight from a checkpoint of any other layout."""
from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

from ..dtypes import storage_dtype, to_torch
from ..errors import MeshError
from ..layout.mesh import Mesh, as_mesh
from ..layout.bind import Model
from ..plan.compile import compile_between
from ..plan.execute import rank_datasets, rank_rows, run_copies
from ..store.source import StoreSource
from .prepare import check_stored, mesh_of, model_of, open_checkpoint, plan_for
from .stats import IOStats


def load_rank(path: str | os.PathLike, *, mesh: Mesh | str, rank: int, model: Model | None = None,
              as_torch: bool = False, verify: bool = True, stats: IOStats | None = None) -> dict[str, Any]:
    """Rank ``rank``'s tensors for layout ``mesh`` (a Mesh or a string like ``"tp=4"``), resharded
    on the fly from whatever layout the checkpoint has: only the hyperslabs this rank needs are read
    (with ``verify``, rounded out to the checksum chunks around them, each verified). Keys are
    ``KIND/LOCAL_NAME``. ``model`` (a spec bound to the same tensors) describes the target layout
    when it is not the checkpoint's own spec, e.g. a TP job loading an FSDP2 checkpoint. The spec
    is parsed, bound and this rank's plan compiled once per checkpoint layout and process (cached)."""
    t0 = time.perf_counter()
    mesh = as_mesh(mesh)
    if not isinstance(rank, (int, np.integer)) or isinstance(rank, bool) or not 0 <= rank < mesh.size:
        raise MeshError(f"rank {rank} is outside {mesh} ({mesh.size} ranks)", code="UCL303")
    with open_checkpoint(path) as ckpt:
        source_model = model_of(ckpt)
        if model is None or model.spec.text == source_model.spec.text:
            plan = plan_for(source_model, mesh_of(ckpt), mesh, ranks=[rank])  # this rank's part only
        else:
            plan = compile_between(source_model, mesh_of(ckpt), model, mesh, ranks=[rank])
        check_stored(ckpt, source_model, np.unique(plan.copies["src_rank"]))
        t1 = time.perf_counter()
        source = StoreSource(ckpt, verify=verify)
        out = {d["key"]: np.zeros(d["shape"], dtype=storage_dtype(d["dtype"])) for d in rank_datasets(plan, rank)}
        run_copies(plan, rank_rows(plan, rank), source, out)
        if stats is not None:
            stats.compile_seconds += t1 - t0
            stats.bytes_read += source.bytes_read
            stats.bytes_needed += int(plan.bytes_read_per_rank()[rank])
            stats.seconds += time.perf_counter() - t0
    if as_torch:
        dtypes = {d["key"]: d["dtype"] for d in plan.datasets}
        return {k: to_torch(v, dtypes[k]) for k, v in out.items()}
    return out
