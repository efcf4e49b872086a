"""Loading one rank of any layout straight from a checkpoint of any other layout."""
from __future__ import annotations

import contextlib
import math
import os
import time
from typing import Any, Iterable, Iterator, Mapping

import numpy as np

from ..dtypes import logical_of_torch_dtype, storage_dtype, storage_view, to_torch
from ..errors import MeshError, StoreError, UclError
from ..formats.base import UserSpec
from ..layout.bind import Model
from ..layout.mesh import Mesh, as_mesh
from ..memory import MemoryCap, memory_cap
from ..plan.buffers import Arena, ArenaRing
from ..plan.execute import covered_elements, rank_datasets, rank_rows, run_copies
from ..plan.ranksets import sorted_distinct
from ..plan.stream import strided_copies
from ..store.like import CheckpointLike
from ..store.reader import Checkpoint
from ..store.source import StoreSource
from .budget import give_back_freed, load_budget
from .bounded import BoundedSource
from .streamed import target_blocks
from .read_once import connect, identity, share_of
from .prepare import check_stored, mesh_of, model_of, open_checkpoint, plan_between, plan_for
from .stats import IOStats


def load_rank(path: str | os.PathLike, *, mesh: Mesh | str, rank: int, model: Model | None = None,
              as_torch: bool = False, verify: bool = True, stats: IOStats | None = None,
              out: Mapping[str, Any] | None = None, read_once: bool = False, group: Any = None,
              user: UserSpec | None = None, source: Any = None,
              max_memory: int | str | MemoryCap | None = None) -> dict[str, Any]:
    """Rank ``rank``'s tensors for layout ``mesh`` (a Mesh or a string like ``"tp=4"``), resharded
    on the fly from whatever layout the checkpoint has: only the hyperslabs this rank needs are read
    (with ``verify``, rounded out to the checksum chunks around them, each verified). Keys are
    ``KIND/LOCAL_NAME``. ``model`` (a spec bound to the same tensors) describes the target layout
    when it is not the checkpoint's own spec, e.g. a TP job loading an FSDP2 checkpoint. The spec
    is parsed, bound and this rank's plan compiled once per checkpoint layout and process (cached).

    ``out`` maps keys to tensors or arrays to fill in place (e.g. a model's parameters or DTensor
    local shards, optimizer state): each must have the key's shape and dtype; a CPU contiguous one
    is read into directly (whole datasets without a bounce buffer), others (GPU) are filled by one
    copy at the end. They are returned as given, with new arrays for keys ``out`` lacks. A tied alias
    (``param/lm_head.weight`` of ``embed.weight``, DeepSpeed's ``shared_params``) is a key too. If the
    load fails (e.g. a checksum mismatch), tensors in ``out`` may be partly overwritten.

    ``read_once=True``: a collective call under an initialised ``torch.distributed`` job, one process
    per rank of ``mesh``, each passing its own ``rank`` and the same path, mesh and model. Datasets
    that several ranks hold identically (replicas in the target layout) are read from storage by
    one of them, shared out evenly, and sent to the others over ``group`` (a gloo group of
    ``mesh.size`` processes; default: one made over the whole world on first use, 300 s timeout). A
    failure on any process (a checksum mismatch...) raises on every one (docs/distributed.md).

    ``user``: the parameter placements a foreign folder's files do not record
    (``ucl.ops.convert.user_spec(spec, dims)``; docs/interop.md).

    ``path`` may also be a checkpoint already open (a ``CheckpointLike``), and ``source`` a plan
    ``Source`` (with ``bytes_read``) to read its boxes from instead of its files: a checkpoint whose
    rank files lie in several places (``ucl.train.recover``).

    ``max_memory`` (bytes, ``"2GB"``, ``"64MB"`` or a ``MemoryCap``; None: the default, 2 GB) caps the
    memory the load adds *beyond the tensors it returns* (or fills in ``out``), which are the
    caller's: boxes larger than a share are read in pieces (docs/memory.md)."""
    t0 = time.perf_counter()
    budget = load_budget(memory_cap(max_memory))
    link = connect(group) if read_once else None
    failure = ident = share = None
    with contextlib.ExitStack() as stack:
        try:  # under read_once every failure up to the exchange is reported to all processes first
            mesh = as_mesh(mesh)
            if not isinstance(rank, (int, np.integer)) or isinstance(rank, bool) or not 0 <= rank < mesh.size:
                raise MeshError(f"rank {rank} is outside {mesh} ({mesh.size} ranks)", code="UCL303")
            if link is not None:
                link.check_size(mesh)
            ckpt = path if isinstance(path, CheckpointLike) else _capped(stack.enter_context(
                open_checkpoint(path, user=user)), budget.cache)
            source_model = model_of(ckpt)
            if model is None:
                target = source_model
                plan = plan_for(source_model, mesh_of(ckpt), mesh, ranks=[rank])  # this rank's part only
            else:  # the very same model (spec, dims, parameters, frozen set) gets the plain plan there
                target = model
                plan = plan_between(source_model, mesh_of(ckpt), model, mesh, ranks=[rank])
            check_stored(ckpt, source_model, sorted_distinct(plan.copies["src_rank"]))
            t1 = time.perf_counter()
            rows = rank_rows(plan, rank)
            datasets = {d["key"]: d for d in rank_datasets(plan, rank)}
            out = out or {}
            covered = covered_elements(plan, rows)
            ties = alias_keys(ckpt, target, set(out) - set(datasets), datasets)
            # a caller's tensor that cannot be filled in place (on a GPU) is filled block by block from
            # memory of our own: host copies of every such tensor at once were the whole rank's size
            over = 0 if link is None and source is None else None
            targets, later, streams = _targets(datasets, covered, {k: v for k, v in out.items() if k not in ties},
                                               mesh, rank, stream_over=over, keep=set(ties.values()))
            # a tied alias is the same dataset: its destination is checked now, filled from it at the end
            tied, tied_later, _ = _targets({a: datasets[t] for a, t in ties.items()},
                                           {a: math.prod(datasets[t]["shape"]) for a, t in ties.items()},
                                           {a: out[a] for a in ties}, mesh, rank)
            mine = targets
            source = BoundedSource(StoreSource(ckpt, Arena(), verify=verify), budget.piece) if source is None else source
            if link is None:
                run_copies(plan, rows, source, targets)
                streamed = _stream_all(streams, plan, rows, datasets, ckpt, verify, budget.stream_block)
            else:  # only what this process reads for itself and its replica sets
                share = share_of(target, mesh, int(rank), targets)
                ident = identity(ckpt, target, mesh)
                mine = {k: v for k, v in targets.items() if k in share.reads}
        except Exception as e:
            if link is None:
                raise
            failure = e
        sent = received = 0
        if link is not None:
            link.settle(rank, ident, failure)  # every process prepared, or every one raises
            by_key = _rows_by_key(plan, rows)
            sent, received = link.transfer(share, targets, lambda key: run_copies(
                plan, by_key.get(key, rows[:0]), source, {key: targets[key]}))
        if stats is not None:
            stats.compile_seconds += t1 - t0
            stats.bytes_read += source.bytes_read + (streamed if link is None else 0)
            stats.bytes_needed += int(plan.bytes_read_per_rank()[rank]) if link is None else \
                sum(covered.get(k, 0) * a.itemsize for k, a in mine.items())
            stats.bytes_sent += sent
            stats.bytes_received += received
            stats.seconds += time.perf_counter() - t0
    for alias, key in ties.items():
        np.copyto(tied[alias], targets[key])
        datasets[alias] = datasets[key]
    targets.update(tied)
    later.update(tied_later)
    for key, dst in later.items():  # GPU (or non-contiguous) destinations: one copy each
        _fill(dst, targets[key], datasets[key]["dtype"])
    targets.update(streams)
    result: dict[str, Any] = {}
    for key, arr in targets.items():
        if key in out:
            result[key] = out[key]
        else:
            result[key] = to_torch(arr, datasets[key]["dtype"]) if as_torch else arr
    return result


def iter_rank(path: str | os.PathLike, *, mesh: Mesh | str = "universal", rank: int = 0,
              keys: Iterable[str] | None = None, as_torch: bool = False, verify: bool = True,
              stats: IOStats | None = None, reuse: bool = False,
              user: UserSpec | None = None, max_memory: int | str | MemoryCap | None = None) -> Iterator[tuple[str, Any]]:
    """``load_rank`` one dataset at a time: yields ``(key, array)`` for each dataset rank ``rank`` of
    ``mesh`` holds (default: every tensor consolidated), or only for ``keys`` (one key or several), in plan order, so an
    export holds one tensor in memory, not the model. Each array is new (safe to keep), unless
    ``reuse``: then all are views of one warm buffer, valid until the next item (no fresh pages to
    fault in per tensor: several times faster reads for a consumer that writes each one out).
    ``user``, ``max_memory``: as for :func:`load_rank` (the cap counts the memory beyond the array
    it yields; one the caller keeps is the caller's)."""
    mesh = as_mesh(mesh)
    budget = load_budget(memory_cap(max_memory))
    if not isinstance(rank, (int, np.integer)) or isinstance(rank, bool) or not 0 <= rank < mesh.size:
        raise MeshError(f"rank {rank} is outside {mesh} ({mesh.size} ranks)", code="UCL303")
    with open_checkpoint(path, user=user) as ckpt:
        _capped(ckpt, budget.cache)
        model = model_of(ckpt)
        plan = plan_for(model, mesh_of(ckpt), mesh, ranks=[rank])
        check_stored(ckpt, model, sorted_distinct(plan.copies["src_rank"]))
        rows = rank_rows(plan, rank)
        datasets = {d["key"]: d for d in rank_datasets(plan, rank)}
        wanted = list(datasets) if keys is None else [keys] if isinstance(keys, str) else list(keys)
        ties = alias_keys(ckpt, model, set(wanted) - set(datasets), datasets)
        unknown = [k for k in wanted if k not in datasets and k not in ties]
        if unknown:
            raise StoreError(f"rank {rank} of {mesh} holds no {unknown[0]!r}"
                             f"{f' (and {len(unknown) - 1} more)' if len(unknown) > 1 else ''}", code="UCL408")
        by_key = _rows_by_key(plan, rows)
        store, warm = StoreSource(ckpt, Arena(), verify=verify), Arena() if reuse else None
        source = BoundedSource(store, budget.piece)
        for key in wanted:
            real = ties.get(key, key)  # a tied alias reads the tensor it shares
            d, mine = datasets[real], by_key.get(real, rows[:0])
            full = covered_elements(plan, mine).get(real, 0) == math.prod(d["shape"])
            shape, dtype = tuple(d["shape"]), storage_dtype(d["dtype"])
            if warm is None:
                give_back_freed()  # the arrays the caller dropped: not held as freed heap past the cap
            arr = warm.array(shape, dtype, zero=not full) if warm is not None else \
                (np.empty if full else np.zeros)(shape, dtype=dtype)
            run_copies(plan, mine, source, {real: arr})
            if stats is not None:
                stats.bytes_needed += covered_elements(plan, mine).get(real, 0) * arr.itemsize
            yield key, (to_torch(arr, d["dtype"]) if as_torch else arr)
            arr = None  # the caller's now: not held here while the next one is made
        if stats is not None:
            stats.bytes_read += store.bytes_read


def _capped(ckpt: CheckpointLike, cache: int) -> CheckpointLike:
    """``ckpt`` (opened by this load) with its read caches held to ``cache`` bytes."""
    if isinstance(ckpt, Checkpoint):
        ckpt.limit_caches(cache)
    return ckpt


def tied_aliases(state: Any, params: Iterable[str]) -> dict[str, str]:
    """Tied alias name -> the parameter whose tensor it shares, for the parameters ``params``: the
    ``shared_params`` DeepSpeed records (kept in the state of a folder read in place and of a
    checkpoint imported from one). An alias that is itself a parameter is no alias."""
    ds = state.get("deepspeed") if isinstance(state, dict) else None
    shared = ds.get("shared_params") if isinstance(ds, dict) else None
    params = set(params)
    return {str(a): str(t) for a, t in (shared if isinstance(shared, dict) else {}).items()
            if str(t) in params and str(a) not in params}


def alias_keys(ckpt, model: Model, keys: Iterable[str], datasets: Mapping[str, Any]) -> dict[str, str]:
    """``KIND/alias`` -> ``KIND/target`` for those of ``keys`` that name a tied alias of a dataset
    in ``datasets``, so a load by either name of a tied tensor finds it."""
    aliases = tied_aliases(ckpt.manifest.state, model.params)
    found = {}
    for key in keys:
        kind, _, name = key.partition("/")
        if name in aliases and f"{kind}/{aliases[name]}" in datasets:
            found[key] = f"{kind}/{aliases[name]}"
    return found


def _rows_by_key(plan, rows: np.ndarray) -> dict[str, np.ndarray]:
    """Target dataset key -> the ``rows`` that write it, in plan order."""
    slot_keys = np.array([sl.key for sl in plan.slots], dtype=object)
    row_keys = slot_keys[plan.copies["dst_slot"][rows]]
    by_key: dict[str, list[int]] = {}
    for row, key in zip(rows.tolist(), row_keys.tolist()):
        by_key.setdefault(key, []).append(row)
    return {k: np.asarray(v, dtype=np.int64) for k, v in by_key.items()}


def _targets(datasets: dict[str, dict], covered: dict[str, int], out: Mapping[str, Any], mesh: Mesh, rank: int,
             stream_over: int | None = None, keep: set = frozenset()):
    """(key -> storage array to fill, key -> a caller's tensor filled from its array at the end,
    key -> a caller's tensor filled block by block at the end: a contiguous torch tensor that
    cannot be filled in place and holds more than ``stream_over`` bytes, unless its key is in
    ``keep``). New arrays are zeroed only where the plan leaves elements unwritten (padding, flat gaps)."""
    unknown = sorted(set(out) - set(datasets))
    if unknown:
        raise StoreError(f"out= names {len(unknown)} key(s) rank {rank} of {mesh} does not hold: "
                         f"{', '.join(map(repr, unknown[:5]))}{', ...' if len(unknown) > 5 else ''}", code="UCL409")
    targets, later, streams = {}, {}, {}
    for key, d in datasets.items():
        shape, full = tuple(d["shape"]), covered.get(key, 0) == math.prod(d["shape"])
        if key not in out:
            targets[key] = (np.empty if full else np.zeros)(shape, dtype=storage_dtype(d["dtype"]))
            continue
        obj = out[key]
        got_shape = tuple(getattr(obj, "shape", ()))
        if got_shape != shape or not _dtype_fits(obj, d["dtype"]):
            raise StoreError(f"out[{key!r}] is {getattr(obj, 'dtype', type(obj).__name__)} {list(got_shape)}, but "
                             f"rank {rank} of {mesh} holds it as {d['dtype']} {list(shape)} (numpy arrays hold "
                             f"{storage_dtype(d['dtype'])} storage)", code="UCL409")
        if getattr(obj, "is_meta", False):
            raise StoreError(f"out[{key!r}] is on the meta device: it has no memory to fill (materialise the "
                             "module first, e.g. module.to_empty(device=...))", code="UCL409")
        if isinstance(obj, np.ndarray) and not obj.flags.writeable:
            raise StoreError(f"out[{key!r}] is a read-only numpy array", code="UCL409")
        view = storage_view(obj, d["dtype"])
        if view is None and stream_over is not None and key not in keep and _streamable_into(obj, d, stream_over):
            streams[key] = obj
            continue
        if view is None:  # filled through a host array, copied once at the end
            view, later[key] = np.empty(shape, dtype=storage_dtype(d["dtype"])), obj
        if not full:
            view.fill(0)
        targets[key] = view
    return targets, later, streams


def _streamable_into(obj: Any, d: dict, over: int) -> bool:
    """A torch tensor (any device) filled through a flat view, larger than ``over`` bytes."""
    return hasattr(obj, "is_contiguous") and obj.is_contiguous() and \
        math.prod(d["shape"]) * storage_dtype(d["dtype"]).itemsize > over


def _stream_all(streams: Mapping[str, Any], plan, rows, datasets: Mapping[str, dict], ckpt: CheckpointLike,
                verify: bool, block_bytes: int) -> int:
    """``_stream_into`` each of ``streams`` (key -> the caller's tensor); the bytes read."""
    if not streams:
        return 0
    by_key, blocks = _rows_by_key(plan, rows), ArenaRing(1)  # each block is copied out before the next is read
    return sum(_stream_into(dst, plan, by_key.get(key, rows[:0]), datasets[key], ckpt, blocks, verify, block_bytes)
               for key, dst in streams.items())


def _stream_into(dst: Any, plan, rows, d: dict, ckpt: CheckpointLike, blocks: ArenaRing, verify: bool,
                 block_bytes: int) -> int:
    """Fill the caller's torch tensor ``dst`` (dataset ``d``, written by plan ``rows``) a block at a
    time: each block read into memory of our own (``streamed.target_blocks``) and copied to its place.
    Returns the bytes read."""
    import torch
    total, sdtype = math.prod(d["shape"]), storage_dtype(d["dtype"])
    copies = strided_copies(plan, rows) if len(rows) else []
    read = [0]
    flat = dst.detach().view(-1)
    with torch.no_grad():
        if copies is None:  # boxes not laid out alike on both sides: through one host copy after all
            arr = np.zeros(tuple(d["shape"]), sdtype)
            run_copies(plan, rows, StoreSource(ckpt, Arena(), verify=verify), {d["key"]: arr})
            flat.copy_(to_torch(arr, d["dtype"]).view(-1))
            return int(arr.nbytes)
        for lo, block in target_blocks(copies, total, sdtype, ckpt, blocks, verify=verify, block_bytes=block_bytes,
                                       read=read):
            flat[lo:lo + block.size].copy_(to_torch(block, d["dtype"]))
    return read[0]


def _fill(dst: Any, array: np.ndarray, logical: str) -> None:
    """Copy ``array`` (storage form) into a caller's array or tensor that could not be filled in
    place (a strided numpy view, a GPU or strided tensor, a parameter that requires grad)."""
    if isinstance(dst, np.ndarray):
        np.copyto(dst, array)
        return
    import torch
    with torch.no_grad():
        dst.copy_(to_torch(array, logical))


def _dtype_fits(obj: Any, logical: str) -> bool:
    """A tensor of ``logical`` dtype, or an array of its storage dtype (bf16 as raw uint16 bits)."""
    if isinstance(obj, np.ndarray):
        return obj.dtype == storage_dtype(logical)
    try:
        return logical_of_torch_dtype(obj.dtype) == logical
    except (UclError, AttributeError):
        return False
