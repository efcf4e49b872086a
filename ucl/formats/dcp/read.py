"""PyTorch Distributed Checkpoint folders (``torch.distributed.checkpoint.save``), described for
reading in place.

What the files are (torch 2.x ``FileSystemWriter``, the default):

* ``.metadata``: a pickle of ``Metadata``. ``state_dict_metadata`` maps every flattened state-dict
  key (``model.<fqn>``, ``optim.state.<fqn>.<kind>``, ``optim.param_groups.0.lr``, ...) to a
  ``TensorStorageMetadata`` (dtype, global size, and the chunks that were saved: offsets and sizes
  of boxes of the global tensor; replicated chunks are saved once) or a ``BytesStorageMetadata``
  (any other object). ``storage_data`` maps ``MetadataIndex(key, chunk offsets)`` to
  ``_StorageInfo(relative_path, offset, length, transform_descriptors)``; ``planner_data`` maps each
  flattened key to its path in the nested state dict (``('optim', 'state', 'fc1.weight', 'exp_avg')``),
  which is how a parameter name is told apart from a state kind. It is unpickled with an
  allow-list of exactly those classes, turned into inert records; anything else is UCL500.
* ``__R_N.distcp``: the items, one after another. Each item, tensor or bytes, is a complete
  ``torch.save`` zip archive of its own (a tensor chunk: of the chunk as a contiguous tensor);
  the chunk's raw bytes are the archive's one stored (uncompressed) storage, which is where the
  :class:`~ucl.store.extents.Extent` points. Items written with stream transforms (the
  experimental zstd extension) or in the safetensors serialization are refused (UCL502).

How it becomes a spec: every parameter's chunks must tile it as a grid, and each dim's pieces
must be what ``split D over AX uneven`` (``torch.chunk`` semantics, the last pieces short or
empty: FSDP2's ``Shard(0)`` and DTensor's ``Shard``) gives, possibly nested up to three deep
(``split 0 over tp uneven; split 0 over dp uneven``: FSDP2 over TP, DTensor's ``_StridedShard``).
The mesh is the smallest set of axes every parameter fits; the innermost split of dim 0 goes to an
axis named ``dp`` (FSDP's), the others to ``tp``. Optimizer states must be chunked like their
parameter (``follow``) or be 0-d (``scalar``, Adam's ``step``). The datasets each rank of that mesh
holds are found by lowering the generated spec and looking up, for every box it puts on a rank,
the DCP chunk with exactly that box: a box DCP did not save, or a saved chunk no rank reads, is
UCL502. Keys: ``param/<fqn>`` (``model.<fqn>``; parameters and persistent buffers, those without
optimizer state are frozen), ``<kind>/<fqn>`` (``optim.state.<fqn>.<kind>``). Bytes items are read
with the allow-listed ``torch.save`` reader into ``state['dcp']['objects']``.
"""
from __future__ import annotations

import math
import os
import re
from typing import Any, Callable

from ...dtypes import itemsize
from ...errors import ForeignFormatError, StoreError
from ...files import check_inside
from ...store.extents import Extent
from .grid import choose_mesh, saved_boxes, shown_offsets, split_options
from .metadata import METADATA, Chunk, Metadata, TensorMeta, read_metadata
from ..base import Description
from ..torchzip.read import TensorRef, read_torch_file
from ..torchzip.plain import MAX_KEPT_TENSOR_BYTES, plain
from ..torchzip.unpickle import brief

MAX_OBJECT_BYTES = 16 << 20  # bytes items larger than this are listed, not read
_MAX_ENTRIES = 20_000_000  # ranks x datasets of one description
_NAME = re.compile(r"^[A-Za-z0-9_][\w\-]*(\.[\w\-]+)*$")  # names the spec language can spell
_KIND = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_ZIP = b"PK\x03\x04"
_WRITER = re.compile(r"^__(\d{1,9})_\d+\.distcp$")  # torch's FileSystemWriter: __{rank}_{n}.distcp



def _bad(msg: str) -> StoreError:
    return StoreError(msg, code="UCL500")


# ---- detect / describe ---------------------------------------------------------------------------
def detect(path: str) -> bool:
    return os.path.isfile(os.path.join(path, METADATA))


def describe(path: str) -> Description:
    return describe_dcp(path, "dcp")


def describe_dcp(path: str, format: str, state: dict | None = None,
                 classify: Callable[[dict[str, tuple]], dict[str, tuple[str, str] | None]] | None = None
                 ) -> Description:
    """The :class:`Description` of the DCP folder ``path`` (``format`` names it; Megatron's
    torch_dist folders are DCP folders), ``state`` merged into its state. ``classify`` maps each
    tensor's state-dict path (``{key: path}``) to ``(kind, parameter name)``, or None for a tensor
    it cannot place; by default ``model.<fqn>`` is ``param`` and ``optim.state.<fqn>.<kind>`` a state."""
    from ...lang.spec import Spec
    from ...layout.lower import lower
    from ...layout.mesh import Mesh

    if not detect(path):
        raise StoreError(f"{path} is not a DCP checkpoint (no {METADATA})", code="UCL501")
    md = read_metadata(path)
    _check_items(path, md)
    params, states, small = _classify(md, classify or classify_paths)
    if not params:
        raise ForeignFormatError(f"{path}: the checkpoint holds no tensors (only other objects); nothing to read in place")
    trained = {f for _, f in states}
    frozen = [n for n in params if n not in trained]
    kinds = _kinds(params, states)
    layouts = {n: split_options(params[n]) for n in params}
    for (kind, fqn), t in states.items():
        if kinds[kind] == "follow" and saved_boxes(t) != saved_boxes(params[fqn]):
            raise ForeignFormatError(f"{t.key!r} is chunked at {shown_offsets(t)}, its parameter {params[fqn].key!r} at "
                         f"{shown_offsets(params[fqn])}; ucl reads optimizer states laid out like their parameter")
    chosen, axes = choose_mesh(params, layouts)
    _check_writers(path, md, math.prod(s for _, s in axes))
    spec = _spec(os.path.basename(os.path.normpath(path)), params, states, kinds, frozen, chosen, axes)
    shapes = {n: t.shape for n, t in params.items()}
    model = Spec.from_text(spec, filename=f"{os.path.join(path, METADATA)}[generated spec]", name="dcp",
                           params=len(shapes)).bind({}, shapes, frozen)
    mesh = Mesh([(name, size) for name, size in axes])
    entries = math.prod(s for _, s in axes) * (len(params) + len(states))
    if entries > _MAX_ENTRIES:
        raise ForeignFormatError(f"{path}: the layout ucl derived has {math.prod(s for _, s in axes):,} ranks of "
                     f"{len(params) + len(states):,} datasets, more than ucl describes in place ({_MAX_ENTRIES:,})")
    by_key = {f"param/{n}": t for n, t in params.items()} | {f"{k}/{n}": t for (k, n), t in states.items()}
    extents = _extents(path, model, lower(model, mesh), mesh, by_key)
    objects = _objects(path, md, small)
    st = {"format": format, "dcp": {"version": plain(md.version, where=os.path.join(path, METADATA)),
                                     "objects": objects}}
    st.update(state or {})
    files = sorted({c.file for t in md.tensors.values() for c in t.chunks} | {f for f, _, _ in md.objects.values()})
    return Description(format, spec, "dcp", {}, tuple((a, s) for a, s in axes), shapes, tuple(frozen),
                       tuple(extents), (), st, (METADATA, *files))


def _check_writers(path: str, md: Metadata, ranks: int) -> None:
    """A derived layout of ``ranks`` ranks needs as many processes to have saved: refused, before
    anything per rank is made, when the folder's ``__R_S.distcp`` files (and Megatron's saved plans)
    show fewer (a small ``.metadata`` can make the chunk grids multiply to millions of ranks)."""
    world = md.ranks or 0
    with os.scandir(path) as it:
        for entry in it:
            m = _WRITER.match(entry.name)
            if m:
                world = max(world, int(m.group(1)) + 1)
    if world and ranks > world:
        raise ForeignFormatError(f"{path}: the chunks in {METADATA} make a layout of {ranks:,} ranks, but the folder's "
                                 f"files were written by {world:,} process(es) (__R_S.distcp up to R = {world - 1:,}); "
                                 f"the metadata contradicts the files")


def _check_items(path: str, md: Metadata) -> None:
    """Every item lies inside a regular file of the folder: checked before anything is parsed."""
    sizes: dict[str, int] = {}
    items = [(t.key, c.file, c.offset, c.length) for t in md.tensors.values() for c in t.chunks] + \
            [(k, f, o, n) for k, (f, o, n) in md.objects.items()]
    for key, rel, offset, length in items:
        if rel not in sizes:
            p = os.path.join(path, rel)
            check_inside(p, path, "file", lambda msg: StoreError(msg, code="UCL416"))
            try:
                st = os.stat(p)
            except OSError as e:
                raise StoreError(f"{p} (named by {METADATA}): {e.strerror or e}", code="UCL404") from None
            if not os.path.isfile(p):
                raise StoreError(f"{p} is not a regular file", code="UCL416")
            sizes[rel] = st.st_size
        if offset + length > sizes[rel]:
            raise StoreError(f"{os.path.join(path, rel)} is {sizes[rel]:,} bytes, but {METADATA} puts {key!r} at "
                             f"bytes [{offset:,}, {offset + length:,}) (truncated?)", code="UCL406")


def classify_paths(paths: dict[str, tuple]) -> dict[str, tuple[str, str] | None]:
    """``(kind, parameter)`` of each tensor of a ``get_state_dict`` checkpoint (see :func:`describe_dcp`):
    ``model.<fqn>`` is ``param``, optimizer state is ``optim.state.<fqn>.<kind>`` nested or flattened
    (``flatten_optimizer_state_dict=True``, torchtitan's ``optimizer.`` root too). Without ``model.``
    keys, top-level names are parameters: a model state dict saved on its own, or torchtitan's
    layout (model keys at the top, the optimizer under ``optimizer.``)."""
    has_model = any(len(p) == 2 and p[0] == "model" for p in paths.values())
    out: dict[str, tuple[str, str] | None] = {}
    for key, p in paths.items():
        state = _optimizer_state(p)
        if state is not None:
            out[key] = state
        elif len(p) == 2 and p[0] == "model" and isinstance(p[1], str):
            out[key] = ("param", p[1])
        elif len(p) == 1 and isinstance(p[0], str) and not has_model:
            out[key] = ("param", p[0])
        else:
            out[key] = None
    return out


def _optimizer_state(p: tuple) -> tuple[str, str] | None:
    """``(kind, fqn)`` of an optimizer state path, nested ``(optim, state, fqn, kind)`` or flattened
    ``(optim, "state.<fqn>.<kind>")``; None for anything else."""
    if len(p) == 4 and p[0] in _OPTIM and p[1] == "state" and isinstance(p[2], str) and isinstance(p[3], str):
        return p[3], p[2]
    if len(p) == 2 and p[0] in _OPTIM and isinstance(p[1], str) and p[1].startswith("state.") \
            and "." in p[1][len("state."):]:
        fqn, kind = p[1][len("state."):].rsplit(".", 1)
        return kind, fqn
    return None


def _classify(md: Metadata, classify: Callable) -> tuple[dict[str, TensorMeta], dict[tuple[str, str], TensorMeta],
                                                         dict[str, TensorMeta]]:
    """Parameters, optimizer states, and the small tensors outside both (a step counter such as
    torchtitan's ``train_state.step``: kept with the objects); a larger tensor outside both is refused."""
    params: dict[str, TensorMeta] = {}
    states: dict[tuple[str, str], TensorMeta] = {}
    places = classify({key: md.paths.get(key) or _guess_path(key) for key in md.tensors})
    other = [key for key in md.tensors if places.get(key) is None]
    small = {key: md.tensors[key] for key in other if len(md.tensors[key].chunks) == 1
             and math.prod(md.tensors[key].shape) * itemsize(md.tensors[key].dtype) <= MAX_KEPT_TENSOR_BYTES}
    large = [key for key in other if key not in small]
    if large:
        raise ForeignFormatError(f"tensors outside the model and optimizer state ({', '.join(large[:5])}"
                     f"{', ...' if len(large) > 5 else ''}); ucl reads DCP checkpoints of a model state dict, of "
                     "{'model': model_state_dict, 'optim': optim_state_dict} (get_state_dict, optimizer state "
                     "nested or flattened) or in torchtitan's layout (model keys at the top, 'optimizer.'), plus "
                     f"tensors of at most {MAX_KEPT_TENSOR_BYTES // 1024} KiB elsewhere (kept with the objects)")
    for key, t in md.tensors.items():
        if key in small:
            continue
        kind, name = places[key]
        table, at = (params, name) if kind == "param" else (states, (kind, name))
        if at in table:
            raise ForeignFormatError(f"{table[at].key!r} and {key!r} are both {kind} of {name!r}")
        table[at] = t
    for name in params:
        if not _NAME.match(name):
            raise ForeignFormatError(f"parameter name {name!r} cannot be written in a spec")
    for kind, fqn in states:
        if fqn not in params:
            raise ForeignFormatError(f"optimizer state {states[(kind, fqn)].key!r} belongs to no parameter of the model")
        if not _KIND.match(kind) or kind == "param":
            raise ForeignFormatError(f"optimizer state kind {kind!r} ({states[(kind, fqn)].key!r}) cannot be written in a spec")
    return params, states, small


_OPTIM = ("optim", "optimizer")


def _guess_path(key: str) -> tuple:
    """The state-dict path of a flattened key, for metadata without planner_data."""
    if key.startswith("model."):
        return ("model", key[len("model."):])
    for root in _OPTIM:
        if key.startswith(f"{root}.state.") and "." in key[len(root) + 7:]:
            fqn, kind = key[len(root) + 7:].rsplit(".", 1)
            return (root, "state", fqn, kind)
    return (key,)


def _kinds(params: dict[str, TensorMeta], states: dict[tuple[str, str], TensorMeta]) -> dict[str, str]:
    """Each optimizer state kind: 'scalar' (0-d, replicated) or 'follow' (its parameter's layout)."""
    out: dict[str, str] = {}
    for kind in dict.fromkeys(k for k, _ in states):
        own = {fqn: t for (k, fqn), t in states.items() if k == kind}
        if all(t.shape == () for t in own.values()) and any(params[f].shape != () for f in own):
            out[kind] = "scalar"
            for t in own.values():
                if len(t.chunks) != 1:
                    raise ForeignFormatError(f"{t.key!r} is 0-d but saved as {len(t.chunks)} chunks")
        elif all(t.shape == params[f].shape for f, t in own.items()):
            out[kind] = "follow"
        else:
            bad = next(t for f, t in own.items() if t.shape != params[f].shape)
            raise ForeignFormatError(f"{bad.key!r} is {list(bad.shape)}: neither 0-d nor its parameter's shape; ucl reads "
                         "optimizer states of either kind only")
    return out


# ---- the spec ------------------------------------------------------------------------------------
def _spec(folder: str, params: dict[str, TensorMeta], states: dict[tuple[str, str], TensorMeta], kinds: dict[str, str],
          frozen: list[str], chosen: dict, axes: list[tuple[str, int]]) -> str:
    lines = [f"# generated by ucl from the PyTorch DCP checkpoint {folder}"]
    if axes:
        lines.append(f"mesh {', '.join(a for a, _ in axes)}")
    trainable = {n for n in params if n not in frozen}
    statements: dict[str, list[tuple]] = {}  # kind -> [(names or None, dtype, scalar)]
    for kind in ["param", *kinds]:
        own = list(params) if kind == "param" else [n for (k, n) in states if k == kind]
        table = params if kind == "param" else {n: states[(kind, n)] for n in own}
        by_dtype: dict[str, list[str]] = {}
        for n in own:
            by_dtype.setdefault(table[n].dtype, []).append(n)
        common = max(by_dtype, key=lambda d: len(by_dtype[d]))
        everyone = kind == "param" or set(own) == trainable
        statements[kind] = [(None if dtype == common and everyone else tuple(names), dtype,
                             kinds.get(kind) == "scalar")
                            for dtype, names in sorted(by_dtype.items(), key=lambda kv: kv[0] != common)]
    groups: dict[tuple, list[str]] = {}
    for kind, sig in statements.items():
        groups.setdefault(tuple(sig), []).append(kind)
    for sig, group in groups.items():
        for names, dtype, scalar in sig:
            head = f"state {', '.join(group)}"
            tail = f"dtype {dtype}{'; scalar' if scalar else ''}"
            if names is None:
                lines.append(f"{head} : {tail}")
            else:
                pattern = "\n      | ".join(names)
                lines.append(f"{head} for {pattern}\n    : {tail}")
    for n, t in params.items():
        splits = []
        for (d, i), a in sorted(chosen[n].items()):
            splits.append(f"split {d} over {axes[a][0]} uneven")
        lines.append(f"{n} [{', '.join(str(x) for x in t.shape)}] : {'; '.join(splits) or 'replicate'}")
    return "\n".join(lines) + "\n"


# ---- extents: each box the spec puts on a rank is a saved chunk --------------------------------
def _extents(path: str, model, sm, mesh, by_key: dict[str, TensorMeta]) -> list[dict[str, Extent]]:
    nranks = 1 if mesh.is_universal else mesh.size
    out: list[dict[str, Extent]] = [{} for _ in range(nranks)]
    read: dict[tuple, Extent] = {}
    used: dict[str, set] = {}
    for t in model.tensors:
        for h in sm.holdings[t.id]:
            src = by_key[h.slot.key]
            box = []
            for d, lay in enumerate(h.pieces[0]):
                segs = lay.segs
                if len(lay.fills) or len(segs) > 1 or (len(segs) and (segs[0][1] != 0 or segs[0][2] != lay.local)):
                    raise ForeignFormatError(f"{src.key!r}: the generated spec puts a non-contiguous piece of dim {d} on a rank")
                box.append((int(segs[0][0]) if len(segs) else -1, int(lay.local)))
            shape = tuple(s for _, s in box)
            if 0 in shape:
                e = Extent(METADATA, 0, src.dtype, shape)  # holds no bytes
            else:
                want = (tuple(o for o, _ in box), shape)
                chunk = next((c for c in src.chunks if (c.offsets, c.sizes) == want), None)
                if chunk is None:
                    raise ForeignFormatError(f"{src.key!r}: the layout ucl derived puts the box at {list(want[0])} of "
                                 f"{list(shape)} on a rank, but DCP saved no such chunk (chunks at {shown_offsets(src)})")
                used.setdefault(src.key, set()).add(want)
                e = read.get((src.key, want))
                if e is None:
                    e = read[(src.key, want)] = _chunk_extent(path, src, chunk)
            ranks = [0] if mesh.is_universal else mesh.ranks_where(h.fixed)
            for r in ranks:
                out[int(r)][h.slot.key] = e
    for t in by_key.values():
        left = saved_boxes(t) - used.get(t.key, set())
        if left:
            raise ForeignFormatError(f"{t.key!r}: the chunks at {sorted(list(o) for o, _ in left)[:8]} are saved but the "
                         "layout ucl derived reads none of them")
    return out


def _chunk_extent(path: str, t: TensorMeta, c: Chunk) -> Extent:
    where = f"{c.file} item {t.key!r} at {list(c.offsets)}"
    with open(os.path.join(path, c.file), "rb") as f:
        f.seek(c.offset)
        head = f.read(4)
    if head != _ZIP:
        raise ForeignFormatError(f"{os.path.join(path, where)} is not a torch.save archive (written with "
                     "SerializationFormat.SAFETENSORS?); ucl reads DCP's default torch_save items only")
    tf = read_torch_file(os.path.join(path, c.file), inside=path, offset=c.offset, length=c.length)
    ref = tf.obj
    if not isinstance(ref, TensorRef):
        raise _bad(f"{where} holds {type(ref).__name__}, not a tensor")
    if ref.shape != c.sizes or ref.dtype != t.dtype:
        raise ForeignFormatError(f"{where} is {list(ref.shape)} {ref.dtype}, but {METADATA} says {list(c.sizes)} {t.dtype}")
    return Extent(c.file, tf.byte_offset(ref), t.dtype, c.sizes)


def _objects(path: str, md: Metadata, small: dict[str, TensorMeta]) -> dict:
    """The bytes items (torch.save'd objects, e.g. param_groups) and the ``small`` tensors outside the
    model and optimizer state (their values kept, see ``torchfile.plain``), as JSON-able data nested
    by their state-dict path."""
    out: dict = {}
    items = [(key, rel, offset, length) for key, (rel, offset, length) in md.objects.items()]
    items += [(key, t.chunks[0].file, t.chunks[0].offset, t.chunks[0].length) for key, t in small.items()]
    for key, rel, offset, length in items:
        if length > MAX_OBJECT_BYTES:
            value: Any = {"unread": f"{length:,} bytes"}
        else:
            try:
                tf = read_torch_file(os.path.join(path, rel), inside=path, offset=offset, length=length)
                value = plain(tf.obj, values=tf, where=f"{tf.path} ({brief(key)})")
            except StoreError as e:
                value = {"unread": str(e)}
        parts = [str(p) for p in md.paths.get(key, (key,))] or [key]
        node = out
        for p in parts[:-1]:
            nxt = node.setdefault(p, {})
            if not isinstance(nxt, dict):
                nxt = node[p] = {"": nxt}
            node = nxt
        node[parts[-1]] = value
    return out
