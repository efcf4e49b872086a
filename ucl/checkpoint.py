"""Checkpoints on disk: save a layout, load one rank resharded on the fly, reshard offline.

This is the I/O edge: it binds the manifest's spec, compiles a plan (pure) and moves bytes
between HDF5 stores through ``ucl.store``.
"""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import numpy as np

from .errors import StoreError, UclError
from .execute import flat_runs, write_box
from .lower import Slot
from .mesh import Mesh
from .model import Model
from .plan import Plan, compile
from .spec import Spec
from .store import Checkpoint, CheckpointWriter, storage_dtype, to_numpy, to_torch


@dataclass
class IOStats:
    """What an I/O operation did. ``bytes_needed`` counts the plan's boxes; ``bytes_read`` what was
    actually read from disk (whole datasets are read when that is cheaper, and verified)."""

    bytes_read: int = 0
    bytes_needed: int = 0
    bytes_written: int = 0
    datasets_written: int = 0
    seconds: float = 0.0
    compile_seconds: float = 0.0
    details: dict = field(default_factory=dict)

    def merge(self, other: "IOStats") -> None:
        self.bytes_read += other.bytes_read
        self.bytes_needed += other.bytes_needed
        self.bytes_written += other.bytes_written
        self.datasets_written += other.datasets_written


# ---- opening -----------------------------------------------------------------------------------
def open_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """Open a committed checkpoint for reading (lazy: rank files open on first use)."""
    return Checkpoint.open(path)


def model_of(ckpt: Checkpoint) -> Model:
    """The bound model a checkpoint was written with (spec text, dims, parameter shapes, frozen)."""
    m = ckpt.manifest
    if not m.spec or m.params is None:
        raise StoreError(f"{ckpt.path} carries no spec or parameter list; it cannot be resharded", code="UCL420")
    spec = Spec.from_text(m.spec, filename=f"{ckpt.path}/manifest.json[spec]", name=m.spec_name)
    return spec.bind(m.dims, m.params, m.frozen)


def mesh_of(ckpt: Checkpoint) -> Mesh:
    return Mesh([(str(a), int(s)) for a, s in ckpt.manifest.mesh])


def _manifest_fields(model: Model, mesh: Mesh, state: Any = None) -> dict:
    return dict(spec=model.spec.text, spec_name=model.spec.name, dims=dict(model.dims), mesh=mesh.to_json(),
                params={n: list(s) for n, s in model.params.items()}, frozen=sorted(model.frozen),
                state=state if state is not None else {})


# ---- checking what a rank hands us ----------------------------------------------------------------
def expected_datasets(model: Model, mesh: Mesh, rank: int) -> dict[str, tuple[tuple, str]]:
    """key -> (shape, logical dtype) of every dataset ``rank`` must hold on ``mesh``."""
    return model.lower(mesh).rank_datasets(rank)


def _rule_of(model: Model, key: str) -> str:
    kind, _, local = key.partition("/")
    for t in model.tensors:
        if t.kind == kind and (t.name == local or t.rule.pattern.match(local)):
            r = t.rule
            return f"rule `{r.pattern.text}` ({model.spec.filename}:{r.span.line})"
    return "no rule"


def _normalise(model: Model, mesh: Mesh, rank: int, tensors: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Arrays in storage form, checked against the layout: names, shapes and dtypes."""
    want = expected_datasets(model, mesh, rank)
    problems, out = [], {}
    for key in sorted(set(want) - set(tensors)):
        problems.append(f"missing {key} {list(want[key][0])} {want[key][1]} ({_rule_of(model, key)})")
    for key in sorted(set(tensors) - set(want)):
        problems.append(f"unexpected {key}: the spec puts no such tensor on rank {rank} of {mesh}")
    for key in sorted(set(tensors) & set(want)):
        shape, dtype = want[key]
        arr, logical = to_numpy(tensors[key], dtype if _is_raw(tensors[key], dtype) else None)
        if tuple(arr.shape) != tuple(shape) or logical != dtype:
            problems.append(f"{key}: expected {list(shape)} {dtype}, got {list(arr.shape)} {logical} "
                            f"({_rule_of(model, key)}, mesh {mesh}, rank {rank})")
        out[key] = arr
    if problems:
        raise StoreError(f"rank {rank}'s tensors do not match the spec:\n  " + "\n  ".join(problems), code="UCL421")
    return out


def _is_raw(value: Any, dtype: str) -> bool:
    # numpy arrays already in storage form (bf16/fp8 raw bits) are taken as the declared dtype
    return isinstance(value, np.ndarray) and value.dtype == storage_dtype(dtype)


# ---- saving ----------------------------------------------------------------------------------------
def save(path: str | os.PathLike, shards: Mapping[int, Mapping[str, Any]], *, model: Model, mesh: Mesh,
         state: Any = None) -> str:
    """Write every rank of a layout from one process (``shards``: rank -> key -> array/tensor) and
    commit atomically. Returns the checkpoint path."""
    nranks = mesh.size
    if set(shards) != set(range(nranks)):
        raise StoreError(f"shards must hold ranks 0..{nranks - 1} of {mesh}, got {sorted(shards)[:8]}...", code="UCL421")
    checked = {r: _normalise(model, mesh, r, shards[r]) for r in range(nranks)}
    want = {r: expected_datasets(model, mesh, r) for r in range(nranks)}
    with CheckpointWriter(path, nranks, **_manifest_fields(model, mesh, state)) as w:
        for r in range(nranks):
            for key, arr in checked[r].items():
                w.write(r, key, arr, dtype=want[r][key][1])
        return w.commit()


def save_rank(path: str | os.PathLike, tensors: Mapping[str, Any], *, model: Model, mesh: Mesh, rank: int,
              state: Any = None) -> str:
    """Collective save under ``torch.distributed`` (one call per rank; world size = mesh size):
    every rank writes its own file into a shared temporary directory, rank 0 commits once all are
    durable. Without an initialised process group, ``mesh`` must have one rank."""
    dist = _dist()
    if dist is None:
        if mesh.size != 1:
            raise StoreError("save_rank on a multi-rank mesh needs torch.distributed to be initialised", code="UCL422")
        return save(path, {0: tensors}, model=model, mesh=mesh, state=state)
    if dist.get_world_size() != mesh.size:
        raise StoreError(f"world size {dist.get_world_size()} != mesh size {mesh.size}", code="UCL422")
    # Every rank checks its tensors, then all learn every problem: one bad rank fails all of them
    # cleanly (nothing written) instead of leaving the others blocked in a collective.
    arrays, problem = {}, ""
    try:
        arrays = _normalise(model, mesh, rank, tensors)
    except UclError as e:
        problem = str(e)
    problems = [p for p in _allgather_json(problem) if p]
    if problems:
        raise StoreError("checkpoint not written: " + "\n".join(problems), code="UCL421")
    want = expected_datasets(model, mesh, rank)
    writer = None
    tmp = ""
    error = ""
    if rank == 0:
        try:
            writer = CheckpointWriter(path, mesh.size, **_manifest_fields(model, mesh, state))
            tmp = writer.tmp_path
        except UclError as e:
            error = str(e)
    tmp, error = _broadcast_json([tmp, error])
    if error:
        raise StoreError(error, code="UCL405")
    entries, problem = {}, ""
    try:
        part = writer if rank == 0 else CheckpointWriter.join(tmp, mesh.size)
        for key, arr in arrays.items():
            part.write(rank, key, arr, dtype=want[key][1])
        if rank != 0:
            entries = part.finish([rank])
    except UclError as e:
        problem = f"rank {rank}: {e}"
    gathered = _allgather_json({"entries": {str(k): v for k, v in entries.items()}, "problem": problem})
    problems = [g["problem"] for g in gathered if g["problem"]]
    result = ""
    if rank == 0:
        try:
            if problems:
                raise StoreError("; ".join(problems), code="UCL410")
            for g in gathered:
                for r, e in g["entries"].items():
                    writer.adopt(int(r), e)
            result = writer.commit()
        except UclError as e:
            writer.abort()
            problems.append(str(e))
    result, err = _broadcast_json([result, "; ".join(problems)])
    if err:
        raise StoreError(f"checkpoint not written: {err}", code="UCL410")
    return result


def _dist():
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    return dist if dist.is_available() and dist.is_initialized() else None


def _broadcast_json(obj: Any) -> Any:
    """Broadcast a JSON value from rank 0 as a byte tensor (no pickle on the wire)."""
    import torch
    dist = _dist()
    data = json.dumps(obj).encode() if dist.get_rank() == 0 else b""
    n = torch.tensor([len(data)], dtype=torch.int64)
    dist.broadcast(n, 0)
    buf = torch.zeros(int(n.item()), dtype=torch.uint8)
    if dist.get_rank() == 0:
        buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    dist.broadcast(buf, 0)
    return json.loads(bytes(buf.tolist()).decode())


def _allgather_json(obj: Any) -> list:
    import torch
    dist = _dist()
    data = json.dumps(obj).encode()
    n = torch.tensor([len(data)], dtype=torch.int64)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, n)
    longest = int(max(s.item() for s in sizes))
    buf = torch.zeros(longest, dtype=torch.uint8)
    buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else buf[:0]
    bufs = [torch.zeros(longest, dtype=torch.uint8) for _ in sizes]
    dist.all_gather(bufs, buf)
    return [json.loads(bytes(b[:int(s.item())].tolist()).decode()) for b, s in zip(bufs, sizes)]


# ---- reading boxes -----------------------------------------------------------------------------------
class _Arena:
    """One reusable buffer handing out arrays: on machines where freshly mapped pages are slow to
    touch, reusing warm memory beats allocating per dataset (see bench/reshard.py)."""

    def __init__(self):
        self.buf = np.empty(0, dtype=np.uint8)

    def array(self, shape, dtype, zero: bool = False) -> np.ndarray:
        dtype = np.dtype(dtype)
        n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if n > self.buf.size:
            self.buf = np.empty(max(n, int(self.buf.size * 1.5)), dtype=np.uint8)
        out = self.buf[:n].view(dtype).reshape(shape)
        if zero:
            out.fill(0)
        return out


class _Reader:
    """Reads plan boxes from a source checkpoint with exact hyperslab selections (strided ones for
    tensors inside flat buffers). A box that is a whole dataset is read whole and its checksum
    verified; with ``verify``, a partial box is read together with the whole checksum chunks
    around it (docs/format.md), each verified, so corrupt bytes are never passed on. With an
    arena, results are views valid until the next read."""

    def __init__(self, ckpt: Checkpoint, arena: _Arena | None = None, verify: bool = True):
        self.ckpt = ckpt
        self.arena = arena
        self.verify = verify
        self.bytes_read = 0

    def read(self, rank: int, slot: Slot, start, size) -> np.ndarray:
        nd = len(slot.shape)
        start = tuple(int(x) for x in start[len(start) - nd:])
        size = tuple(int(x) for x in size[len(size) - nd:])
        direct = slot.base == 0 and slot.shape == slot.dataset_shape
        info = self.ckpt.info(rank, slot.key)
        dtype = info.storage_dtype
        n = int(np.prod(size, dtype=np.int64))
        if start == (0,) * nd and n == info.size and (direct or slot.base == 0):
            out = self.ckpt.read(rank, slot.key, verify=True, out=self._buf(info.shape, dtype)).reshape(size)
            self.bytes_read += out.nbytes
            return out
        if self.verify or not direct:
            view = slot if not direct else Slot(slot.key, 0, tuple(info.shape), tuple(info.shape))
            out = self.ckpt.read_runs(rank, slot.key, flat_runs(view, start, size), out=self._buf((n,), dtype),
                                      verify=self.verify).reshape(size)
            self.bytes_read += self.ckpt.bytes_last_read
            return out
        out = self.ckpt.read_box(rank, slot.key, start, size, out=self._buf(size, dtype))
        self.bytes_read += out.nbytes
        return out

    def _buf(self, shape, dtype):
        return self.arena.array(tuple(shape), dtype) if self.arena is not None else None


# ---- loading one rank ----------------------------------------------------------------------------------
def load_rank(path: str | os.PathLike, *, mesh: Mesh, rank: int, as_torch: bool = False, verify: bool = True,
              stats: IOStats | None = None) -> dict[str, Any]:
    """Rank ``rank``'s tensors for layout ``mesh``, resharded on the fly from whatever layout the
    checkpoint has: only the hyperslabs this rank needs are read (with ``verify``, rounded out to
    the checksum chunks around them, each verified). Keys are ``KIND/LOCAL_NAME``."""
    t0 = time.perf_counter()
    if not isinstance(rank, (int, np.integer)) or not 0 <= rank < mesh.size:
        from .errors import MeshError
        raise MeshError(f"rank {rank} is outside {mesh} ({mesh.size} ranks)", code="UCL303")
    with open_checkpoint(path) as ckpt:
        model = model_of(ckpt)
        plan = compile(model, mesh_of(ckpt), mesh, ranks=[rank])  # this rank's part of the plan only
        t1 = time.perf_counter()
        reader = _Reader(ckpt, verify=verify)
        out = _assemble(plan, reader, rank)
        if stats is not None:
            stats.compile_seconds += t1 - t0
            stats.bytes_read += reader.bytes_read
            stats.bytes_needed += int(plan.bytes_read_per_rank()[rank])
            stats.seconds += time.perf_counter() - t0
    if as_torch:
        dtypes = {d["key"]: d["dtype"] for d in plan.datasets}
        return {k: to_torch(v, dtypes[k]) for k, v in out.items()}
    return out


def _assemble(plan: Plan, reader: _Reader, rank: int, rows: np.ndarray | None = None,
              keys: set | None = None) -> dict[str, np.ndarray]:
    """Target datasets of ``rank`` (or only ``keys``), built from the copy rows (zeros elsewhere)."""
    out: dict[str, np.ndarray] = {}
    sel = np.flatnonzero(plan.dataset_ranks["rank"] == rank)
    for d in plan.dataset_ranks["dataset"][sel]:
        ds = plan.datasets[d]
        if keys is None or ds["key"] in keys:
            out[ds["key"]] = np.zeros(ds["shape"], dtype=storage_dtype(ds["dtype"]))
    c = plan.copies
    if rows is None:
        rows = np.flatnonzero(c["dst_rank"] == rank)
    for i in rows:
        dslot = plan.slots[c["dst_slot"][i]]
        if dslot.key not in out:
            continue
        values = reader.read(int(c["src_rank"][i]), plan.slots[c["src_slot"][i]], c["src_start"][i], c["size"][i])
        write_box(out[dslot.key], dslot, c["dst_start"][i], c["size"][i], values)
    return out


# ---- offline reshard ----------------------------------------------------------------------------------
def reshard(src: str | os.PathLike, dst: str | os.PathLike, to: Mesh, *, workers: int | None = None,
            durable: bool = True, verify: bool = True, progress: Callable[[int], None] | None = None) -> IOStats:
    """Write checkpoint ``dst`` holding ``src`` in layout ``to`` (``Mesh()`` = universal). The spec,
    dims and source layout come from ``src``'s manifest. Streams one target dataset at a time,
    builds replicated target datasets once, uses ``workers`` processes; ``dst`` appears atomically.
    ``durable=False`` skips fsync of the data files (atomic against crashes of the process, not of
    the machine). ``verify`` checks the checksum of every source dataset it reads from, including
    those it reads only in parts, so corruption is never copied into a freshly checksummed file."""
    t0 = time.perf_counter()
    with open_checkpoint(src) as ckpt:
        model = model_of(ckpt)
        plan = compile(model, mesh_of(ckpt), to)
        state = ckpt.manifest.state
    t1 = time.perf_counter()
    workers = max(1, min(workers or min(2, os.cpu_count() or 1), to.size))
    groups = _replica_groups(plan)
    assignment = _assign(groups, plan, workers)
    stats = IOStats(compile_seconds=t1 - t0)
    writer = CheckpointWriter(dst, to.size, durable=durable, **_manifest_fields(model, to, state))
    try:
        global _JOB
        _JOB = (os.fspath(src), writer.tmp_path, to.size, plan, groups, durable, verify)
        if workers == 1:
            results = [_run_worker(assignment[0], progress)]
        else:
            ctx = mp.get_context("fork")  # the plan is inherited, not serialised
            with ctx.Pool(workers) as pool:
                pending = [pool.apply_async(_run_worker, (a,)) for a in assignment]
                results = [p.get() for p in pending]
                if progress:
                    progress(sum(json.loads(r)["bytes_written"] for r in results))
        for text in results:
            r = json.loads(text)
            for rank, entries in r["entries"].items():
                writer.adopt(int(rank), entries)
            stats.merge(IOStats(r["bytes_read"], r["bytes_needed"], r["bytes_written"], r["datasets"]))
        writer.commit()
    except BaseException:
        writer.abort()
        raise
    finally:
        _JOB = None
    stats.seconds = time.perf_counter() - t0
    return stats


_JOB: Any = None  # (src, tmp path, nranks, plan, groups, durable, verify), inherited by forked workers


def _replica_groups(plan: Plan) -> list[tuple[str, tuple, str, list[int], np.ndarray]]:
    """Target datasets with identical contents on several ranks (replicas) become one group:
    (key, shape, dtype, ranks, copy rows of the first rank)."""
    c = plan.copies
    slot_keys = np.array([s.key for s in plan.slots], dtype=object)
    row_keys = slot_keys[c["dst_slot"]] if len(c["dst_slot"]) else np.zeros(0, dtype=object)
    rows_by = {}
    order = np.argsort(c["dst_rank"], kind="stable")
    ranks_sorted = c["dst_rank"][order]
    bounds = np.searchsorted(ranks_sorted, np.arange(plan.dst_mesh.size + 1))
    for r in range(plan.dst_mesh.size):
        rows = order[bounds[r]:bounds[r + 1]]
        for key in np.unique(row_keys[rows]) if len(rows) else []:
            rows_by[(r, key)] = rows[row_keys[rows] == key]
    groups: dict[tuple, tuple] = {}
    for r, d in zip(plan.dataset_ranks["rank"], plan.dataset_ranks["dataset"]):
        ds = plan.datasets[d]
        rows = rows_by.get((int(r), ds["key"]), np.zeros(0, dtype=np.int64))
        sig_cols = np.stack([c[k][rows] for k in ("tensor", "src_rank", "src_slot", "dst_slot")], axis=1)
        sig = (ds["key"], ds["shape"], ds["dtype"], sig_cols.tobytes(), c["src_start"][rows].tobytes(),
               c["dst_start"][rows].tobytes(), c["size"][rows].tobytes())
        if sig in groups:
            groups[sig][3].append(int(r))
        else:
            groups[sig] = (ds["key"], ds["shape"], ds["dtype"], [int(r)], rows)
    return list(groups.values())


def _assign(groups, plan: Plan, workers: int) -> list[list[int]]:
    """Give each target rank file to one worker (files cannot be shared), keeping replica groups
    together where the load allows, so their source bytes are read once."""
    owner: dict[int, int] = {}
    load = [0] * workers
    sizes = [int(np.prod(g[1], dtype=np.int64)) * storage_dtype(g[2]).itemsize for g in groups]
    total = sum(s * len(g[3]) for s, g in zip(sizes, groups)) or 1
    for gi in sorted(range(len(groups)), key=lambda i: -sizes[i] * len(groups[i][3])):
        for r in groups[gi][3]:
            if r in owner:
                continue
            taken = [owner[x] for x in groups[gi][3] if x in owner]
            w = taken[0] if taken and load[taken[0]] < 1.1 * total / workers else min(range(workers), key=load.__getitem__)
            owner[r] = w
        for r in groups[gi][3]:
            load[owner[r]] += sizes[gi]
    for r in range(plan.dst_mesh.size):
        owner.setdefault(r, min(range(workers), key=load.__getitem__))
    out = [[] for _ in range(workers)]
    for gi, g in enumerate(groups):
        for w in sorted({owner[r] for r in g[3]}):
            out[w].append(gi)
    # each worker also owns (and creates) its ranks' files
    return [[(gi, [r for r in groups[gi][3] if owner[r] == w]) for gi in gis] + [("ranks", [r for r in owner if owner[r] == w])]
            for w, gis in enumerate(out)]


def _run_worker(tasks, progress=None) -> str:
    src, tmp, nranks, plan, groups, durable, verify = _JOB
    ranks = tasks[-1][1]
    writer = CheckpointWriter.join(tmp, nranks, durable=durable)
    written = datasets = needed = 0
    with open_checkpoint(src) as ckpt:
        reader = _Reader(ckpt, _Arena(), verify=verify)
        target = _Arena()
        c = plan.copies
        # order by first source (file, dataset): reads sweep each file in order
        tasks = sorted(tasks[:-1], key=lambda t: (int(c["src_rank"][groups[t[0]][4][0]]) if len(groups[t[0]][4]) else -1,
                                                  int(c["src_slot"][groups[t[0]][4][0]]) if len(groups[t[0]][4]) else -1))
        for gi, mine in tasks:
            key, shape, dtype, _ranks, rows = groups[gi]
            covered = int(np.prod(c["size"][rows], axis=1).sum()) if len(rows) else 0
            buf = target.array(shape, storage_dtype(dtype), zero=covered < int(np.prod(shape, dtype=np.int64)))
            for i in rows:
                dslot = plan.slots[c["dst_slot"][i]]
                values = reader.read(int(c["src_rank"][i]), plan.slots[c["src_slot"][i]], c["src_start"][i], c["size"][i])
                write_box(buf, dslot, c["dst_start"][i], c["size"][i], values)
                needed += values.nbytes
            for r in mine:
                writer.write(r, key, buf, dtype=dtype)
                written += buf.nbytes
                datasets += 1
                if progress:
                    progress(buf.nbytes)
        entries = writer.finish(ranks)
    return json.dumps({"entries": {str(k): v for k, v in entries.items()}, "bytes_read": reader.bytes_read,
                       "bytes_needed": needed, "bytes_written": written, "datasets": datasets})
