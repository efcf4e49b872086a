"""The Hugging Face writer: an export's tensors as a ``save_pretrained`` folder, ``config.json`` plus
safetensors weights, which ``transformers.AutoModelForCausalLM.from_pretrained(out)`` (and vLLM,
TGI, ...) load. :func:`plan_hf` decides everything from the manifest (names, shards, headers,
config); :func:`write_hf` then takes the tensors one at a time (``ucl.ops.export.export_hf`` feeds
them).

    export_hf("ckpt/step_100", "hf/step_100")                          # param tensors as stored
    export_hf("ds_run/", "hf/", dtype="bfloat16", config="config.json") # fp32 masters rounded to bf16

What is written, as ``save_pretrained`` (transformers 5.23, huggingface_hub 2.4) writes it:

* ``model.safetensors`` when every tensor fits in ``max_shard_size``, else
  ``model-00001-of-0000N.safetensors`` ... and ``model.safetensors.index.json``
  (``{"metadata": {"total_parameters", "total_size"}, "weight_map": {name: file}}``). Shards are
  filled in the checkpoint's tensor order up to ``max_shard_size`` (decimal ``"5GB"``/``"500MB"``/
  ``"10KB"``, binary ``"1GiB"``, or an int of bytes); a tensor larger than that gets a shard alone.
  Each file is byte for byte what ``safetensors.torch.save_file(tensors, f, {"format": "pt"})``
  writes for its tensors: header JSON padded with spaces to a multiple of 8 bytes, tensors ordered
  by dtype (widest first, as safetensors orders them) then name.
* the ``param/*`` tensors of the checkpoint (weights, frozen parameters, persistent buffers) under
  their names in memory; optimizer state is not exported. ``dtype=None`` keeps each tensor's stored
  dtype; ``dtype="bfloat16"`` (``float16``, ``float32``) casts every floating tensor with torch
  (round to nearest even), taking it from its fp32 master (``fp32/NAME``) where the checkpoint has
  one, the most precise copy; integer and bool tensors stay as they are.
* ``config.json``: ``config`` (a dict, a ``config.json`` path or its folder, a ``PretrainedConfig``),
  else the one a Hugging Face folder read in place (or resharded from one) carries in its state;
  else UCL503. Its ``dtype`` and ``torch_dtype`` become the exported one (the dtype most elements
  have). When ucl has a standard spec for its ``model_type``, the tensors are first checked against
  it with the config's dims (a wrong config is refused, UCL503). With ``tie_word_embeddings``
  (transformers' default when absent), a stored ``lm_head.weight`` is left out, as
  ``save_pretrained`` does, after checking it equals a tensor of its shape and dtype; a different
  one is refused (UCL503) rather than silently replaced.

* Megatron's names (megatron-core ``torch_dist``, Megatron-LM legacy, ``stdlib:megatron_gpt``) are
  mapped to the config's model type (llama, mistral, qwen2) with their fusions undone, by the
  declarative table of :mod:`ucl.formats.hf.renames`; the config is ``config``, else the one the run's
  saved Megatron-LM arguments describe (llama, or qwen2 with QKV biases; refused if no such model
  type has the run's architecture).

Streams: each tensor in pieces (``Pieces``: a piece and its cast copy in memory at a time), written at
its offset in its shard; only a part of a fused source tensor is cut from the source read whole. Shard headers are planned from the
manifest before any tensor is read. Written into a hidden temp folder beside ``out`` and renamed at
the end; an existing ``out`` is refused (UCL503).
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import numpy as np

from ...dtypes import DTYPES, FLOAT_DTYPES, to_numpy, to_torch, torch_dtype
from ...errors import ForeignFormatError, UclError
from ...lang.spec import load_spec
from ...memory import format_size, parse_size
from ...model_config import CONFIG_NAME, load_config, read_raw_config
from ...store.atomic import fsync_dir, staged_dir
from ..base import ExportSource, Pieces, Written
from .check import check_against
from .fit import mismatches
from .names import INDEX_NAME, SINGLE_NAME
from .read import known_model_types
from .renames import Renamed, config_from_megatron, mapping_for, rename

EXPORT_DTYPES = ("float32", "bfloat16", "float16")  # what a config's dtype can name and a cast makes sense to
_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16", "float": "float32"}
# safetensors' writer orders a file's tensors by dtype, widest alignment first (its Dtype enum,
# descending; observed with safetensors 0.8), then by name: the same order keeps files byte-identical
# to save_file's and every tensor aligned to its itemsize.
_ST_ORDER = ("I64", "F64", "F32", "I32", "BF16", "F16", "I16", "F8_E4M3", "F8_E5M2", "I8", "U8", "BOOL")
_TIED_HEAD = "lm_head.weight"



@dataclass(frozen=True)
class _Entry:
    """One exported tensor: its name in the folder, the dataset it comes from, what it becomes."""

    name: str
    key: str  # "param/NAME" or "fp32/NAME"
    shape: tuple[int, ...]
    stored: str  # logical dtype of the dataset
    dtype: str  # logical dtype written
    renamed: Renamed | None = None  # the part of the dataset it is, when a framework's names are mapped

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * DTYPES[self.dtype].itemsize

    @property
    def numel(self) -> int:
        return self.nbytes // DTYPES[self.dtype].itemsize


def parse_shard_size(size: int | str) -> int:
    """Bytes of ``"5GB"`` (decimal, as transformers), ``"2GiB"`` (binary) or an int; UCL503 otherwise."""
    value = parse_size(size)
    if value is None:
        raise ForeignFormatError(f"max_shard_size {size!r} is not a size: give bytes or a number with KB, MB, GB or TB "
                     "(decimal, as transformers) or KiB, MiB, GiB, TiB", code="UCL503")
    if value <= 0:
        raise ForeignFormatError(f"max_shard_size {size!r} must be positive", code="UCL503")
    return value


def export_dtype(dtype: Any) -> str | None:
    """The logical dtype a ``dtype=`` argument names (``"bf16"``, ``"bfloat16"``, ``torch.bfloat16``)."""
    if dtype is None:
        return None
    name = str(dtype).rsplit(".", 1)[-1].lower()
    name = _ALIASES.get(name, name)
    if name not in EXPORT_DTYPES:
        raise ForeignFormatError(f"cannot export weights as {dtype!r}; choose {', '.join(EXPORT_DTYPES)}", code="UCL503")
    return name


@dataclass(frozen=True)
class HfExport:
    """Everything a Hugging Face export writes, decided from the manifest before any tensor is read."""

    entries: tuple[_Entry, ...]  # every tensor to write or check, in order
    shards: tuple[tuple[_Entry, ...], ...]
    names: tuple[str, ...]  # the shard files
    dropped: str | None  # the tied head left out (checked against its twin)
    config: dict  # config.json as written
    dtype: str  # what the config records as the model's dtype
    cast: bool
    keys: tuple[str, ...]  # the datasets to read, in the checkpoint's order (its files are swept in order)


def plan_hf(src: ExportSource, *, dtype: str | None = None, max_shard_size: int = 5 * 10**9,
            config: Any = None) -> HfExport:
    """What exporting ``src`` as a Hugging Face folder writes (see the module doc): ``dtype`` as
    :func:`export_dtype` gives it, ``max_shard_size`` in bytes, ``config`` as ``export_hf`` takes it.
    A config that does not fit the checkpoint is refused here (UCL503)."""
    raw = _config_of(src.state, config, src.path)
    _check_fit(raw, src.datasets)
    entries = _entries(src.datasets, dtype, raw)
    if not entries:
        raise ForeignFormatError(f"{src.path} holds no param/ tensors to export", code="UCL503")
    _check_config(raw, entries)
    dropped = _tied_head(raw, entries)
    written = [e for e in entries if e.name != dropped]
    shards = _shards(written, max_shard_size)
    main = _main_dtype(written)
    raw = dict(raw, dtype=main, torch_dtype=main)  # v5 reads "dtype", older readers "torch_dtype"
    wanted = {e.key for e in entries}
    return HfExport(tuple(entries), tuple(tuple(s) for s in shards), tuple(_shard_names(len(shards))), dropped, raw,
                    main, dtype is not None, tuple(k for k in src.datasets if k in wanted))


def write_hf(plan: HfExport, out: str, tensors: Iterable[tuple[str, Pieces]], *, durable: bool = True,
             whole_bytes: int | None = None) -> Written:
    """Write ``tensors`` (:class:`~ucl.formats.base.Pieces` of ``plan.keys``, in that order, each
    read only while current) as the Hugging Face folder ``out``, which appears atomically. Each
    tensor is written piece by piece at its offset; a part of a fused tensor (Megatron's
    ``linear_qkv``) is cut from its source read whole, at most ``whole_bytes`` (UCL011 beyond)."""
    written = [e for e in plan.entries if e.name != plan.dropped]
    with staged_dir(out) as folder:
        head_digest, digests = _write_shards(plan, folder, tensors, durable, whole_bytes)
        if plan.dropped is not None:
            same = [e.name for e in written if digests.get(e.name) == head_digest]
            if not same:
                raise ForeignFormatError(f"the config ties the output embedding to the input one (tie_word_embeddings), but the "
                             f"checkpoint's {plan.dropped} equals no other tensor of its shape; transformers would replace "
                             f"it with the input embedding. Pass a config with \"tie_word_embeddings\": false", code="UCL503")
        _write_json(os.path.join(folder, CONFIG_NAME), plan.config, durable)
        if len(plan.shards) > 1:
            index = {"metadata": {"total_parameters": sum(e.numel for e in written),
                                  "total_size": sum(e.nbytes for e in written)},
                     "weight_map": {e.name: plan.names[i] for i, shard in enumerate(plan.shards) for e in shard}}
            _write_json(os.path.join(folder, INDEX_NAME), index, durable)
        if durable:
            fsync_dir(folder)
        size = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder))
    return Written(size, len(written),
                   dict(format="hf", files=list(plan.names), dtype=plan.dtype, total_size=sum(e.nbytes for e in written),
                        tied_dropped=plan.dropped, cast=plan.cast,
                        fp32_master=any(e.key.startswith("fp32/") for e in written)))


def _config_of(state: dict, config: Any, ckpt: str) -> dict:
    """The config.json to write, as a plain dict (not yet with the exported dtype)."""
    if config is not None:
        try:
            raw = read_raw_config(config)
        except UclError as e:
            raise ForeignFormatError(f"cannot use the config: {e}", code="UCL503") from None
    else:
        hf = state.get("hf") if isinstance(state.get("hf"), dict) else {}
        raw = hf.get("config")
        megatron = state.get("megatron") if isinstance(state.get("megatron"), dict) else {}
        if not isinstance(raw, dict) and isinstance(megatron.get("args"), dict):
            raw = config_from_megatron(megatron["args"])  # a Megatron-LM run's saved arguments
        if not isinstance(raw, dict):
            raise ForeignFormatError(f"{ckpt} carries no Hugging Face config.json (it was not read from a Hugging Face folder, "
                         "nor saved by Megatron-LM with its arguments); pass config= (--config config.json) "
                         "with the model's config", code="UCL503")
    try:
        json.dumps(raw, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ForeignFormatError(f"the config cannot be written as JSON: {e}", code="UCL503") from None
    return dict(raw)


def _entries(datasets: dict[str, tuple[tuple[int, ...], str]], target: str | None, config: dict) -> list[_Entry]:
    """The tensors to write, in the checkpoint's order (or Hugging Face's, when a framework's names
    are mapped to the config's model type); a cast reads the fp32 master where there is one."""
    params = {key.split("/", 1)[1]: (tuple(shape), stored) for key, (shape, stored) in datasets.items()
              if key.startswith("param/")}
    shapes = {n: shape for n, (shape, _) in params.items()}
    mapping = mapping_for(shapes, config)
    parts = rename(mapping, shapes, config) if mapping else [None] * len(params)
    sources = [p.source for p in parts] if mapping else list(params)
    out = []
    for name, part in zip(sources, parts):
        shape, stored = params[name]
        key = f"param/{name}"
        if target is not None and stored in FLOAT_DTYPES:
            master = datasets.get(f"fp32/{name}")
            if master is not None and tuple(master[0]) == shape:
                key, stored = f"fp32/{name}", master[1]
        written = stored if target is None or stored not in FLOAT_DTYPES else target
        out.append(_Entry(part.target if part else name, key, part.shape if part else shape, stored, written, part))
    return out


def _check_fit(raw: dict, datasets: dict[str, tuple[tuple[int, ...], str]]) -> None:
    """The config's dims against the checkpoint's tensors, first: a wrong ``--config`` is named as
    such (each dim with both values), not as tensors with no place in the model type. Hugging Face
    names are checked for the model types ucl has a spec for; Megatron's always (they are renamed)."""
    shapes = {k.split("/", 1)[1]: tuple(s) for k, (s, _) in datasets.items() if k.startswith("param/")}
    if mapping_for(shapes, raw) is None and raw.get("model_type") not in known_model_types():
        return
    bad = mismatches(raw, shapes)
    if bad:
        raise ForeignFormatError(f"the config does not match the checkpoint ({len(bad)} dim{'s' * (len(bad) != 1)}); "
                                 "is it the model's own config.json?\n  " + "\n  ".join(bad), code="UCL503")


def _check_config(raw: dict, entries: list[_Entry]) -> None:
    """When ucl has a standard spec for the config's ``model_type``, the tensors must be what that
    spec expects with the config's dims: a wrong ``--config`` fails here, not in ``from_pretrained``."""
    model_type = raw.get("model_type")
    if not isinstance(model_type, str) or model_type not in known_model_types():
        return
    spec = load_spec(f"stdlib:{model_type}")
    try:
        dims = spec.dims_from_config(raw)
    except UclError as e:
        raise ForeignFormatError(f"the config does not give the dims of stdlib:{model_type}: {e}", code="UCL503") from None
    shapes = {e.name: e.shape for e in entries}
    bad = check_against(spec, dims, shapes, frozen=tuple(shapes))
    if bad:
        raise ForeignFormatError(f"the tensors do not fit stdlib:{model_type} with the dims of the config ({len(bad)} "
                     f"problem{'s' * (len(bad) != 1)}); is it the model's own config.json?\n  " + "\n  ".join(bad[:8]), code="UCL503")


def _tied_head(raw: dict, entries: list[_Entry]) -> str | None:
    """``lm_head.weight`` when the config ties it to the input embedding and the checkpoint stores it
    beside a tensor of its shape (transformers ties only equal shapes: CPM-Ant's head, a slice of a
    larger input embedding, stays in the folder although its config says tie_word_embeddings)."""
    head = next((e for e in entries if e.name == _TIED_HEAD), None)
    if head is None or not any(e.shape == head.shape for e in entries if e.name != _TIED_HEAD):
        return None
    try:  # transformers 5 ties only where the config class has the field and it is true
        tied = load_config(raw).get("tie_word_embeddings", False)
    except UclError:
        tied = raw.get("tie_word_embeddings", True)
    return _TIED_HEAD if tied else None


def _shards(entries: list[_Entry], limit: int) -> list[list[_Entry]]:
    """Tensors in order, a new shard when the next would pass ``limit``; an oversized one alone."""
    shards: list[list[_Entry]] = []
    current: list[_Entry] = []
    size = 0
    for e in entries:
        if current and size + e.nbytes > limit:
            shards.append(current)
            current, size = [], 0
        current.append(e)
        size += e.nbytes
    if current:
        shards.append(current)
    return shards


def _shard_names(n: int) -> list[str]:
    if n == 1:
        return [SINGLE_NAME]
    return [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


def _main_dtype(entries: list[_Entry]) -> str:
    """The floating dtype most elements have (what transformers records as the model's dtype)."""
    counts: dict[str, int] = {}
    for e in entries:
        if e.dtype in FLOAT_DTYPES:
            counts[e.dtype] = counts.get(e.dtype, 0) + e.numel
    return max(counts, key=lambda d: counts[d]) if counts else "float32"


def _file_order(shard: list[_Entry]) -> list[_Entry]:
    rank = {name: i for i, name in enumerate(_ST_ORDER)}
    return sorted(shard, key=lambda e: (rank.get(DTYPES[e.dtype].safetensors, len(rank)), e.name.encode()))


def _header(ordered: list[_Entry]) -> bytes:
    """The safetensors header of these tensors, in this data order, padded to a multiple of 8 bytes."""
    head: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for e in ordered:
        head[e.name] = {"dtype": DTYPES[e.dtype].safetensors, "shape": list(e.shape),
                        "data_offsets": [offset, offset + e.nbytes]}
        offset += e.nbytes
    text = json.dumps(head, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def _write_shards(plan: HfExport, folder: str, tensors: Iterable[tuple[str, Pieces]],
                  durable: bool, whole_bytes: int | None) -> tuple[bytes | None, dict[str, bytes]]:
    """Write every shard's header, then take the checkpoint's tensors once, in its own order, each
    into its place (a source tensor may feed several exported ones: Megatron's ``linear_qkv``). With
    a dropped tied head, also digest the head and the tensors it could equal (same shape and dtype),
    to compare them afterwards."""
    shards, names, dropped, entries = plan.shards, plan.names, plan.dropped, plan.entries
    head = next((e for e in entries if e.name == dropped), None)
    twins = set() if head is None else {e.name for e in entries
                                        if e.name != dropped and e.shape == head.shape and e.dtype == head.dtype}
    places: dict[str, tuple[int, int]] = {}  # exported name -> (shard, byte offset in its file)
    left: list[int] = []  # bytes each shard still expects
    fds: list[int] = []
    digests: dict[str, bytes] = {}
    head_digest = None
    try:
        for i, shard in enumerate(shards):
            ordered = _file_order(shard)
            header = _header(ordered)
            fds.append(os.open(os.path.join(folder, names[i]), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644))
            _pwrite_all(fds[i], memoryview(header), 0)
            offset = len(header)
            for e in ordered:
                places[e.name] = (i, offset)
                offset += e.nbytes
            left.append(offset - len(header))
        wanted: dict[str, list[_Entry]] = {}
        for e in [e for shard in shards for e in shard] + ([head] if head is not None else []):
            wanted.setdefault(e.key, []).append(e)
        for key, pieces in tensors:
            for e in wanted[key]:
                if e.nbytes != pieces.size * DTYPES[e.dtype].itemsize and e.renamed is None:
                    # the manifest and the tensor read disagree: never write a lying header
                    raise ForeignFormatError(f"{e.key} reads as {pieces.size} elements, but its manifest entry says "
                                             f"{e.numel}", code="UCL503")
                digest = hashlib.blake2b(digest_size=32) if e is head or e.name in twins else None
                i, offset = places[e.name] if e is not head else (-1, 0)
                for at, data in _parts(pieces, e, whole_bytes):
                    if digest is not None:
                        digest.update(memoryview(data).cast("B"))
                    if e is not head:
                        _pwrite_all(fds[i], memoryview(data).cast("B"), offset + at)
                        left[i] -= data.nbytes
                if e is head:
                    head_digest = digest.digest()
                elif digest is not None:
                    digests[e.name] = digest.digest()
        short = [f"{names[i]} ({n} bytes)" for i, n in enumerate(left) if n]
        if short:
            raise ForeignFormatError(f"{', '.join(short)} short of what the header declares", code="UCL503")
        for fd in fds if durable else ():
            os.fsync(fd)
    finally:
        for fd in fds:
            os.close(fd)
    return head_digest, digests


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while len(data):
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


def _parts(pieces: Pieces, e: _Entry, whole_bytes: int | None) -> Iterator[tuple[int, np.ndarray]]:
    """``(byte offset in the tensor written, storage bytes in e.dtype)``: piece by piece, or for a
    part of a fused source tensor (``e.renamed``), that part of the source read whole, refused
    (UCL011) over ``whole_bytes``."""
    if e.renamed is None:
        for lo, piece in pieces:
            yield lo * DTYPES[e.dtype].itemsize, _converted(to_torch(piece, e.stored), e)
        return
    need = pieces.size * DTYPES[pieces.dtype].itemsize
    if whole_bytes is not None and need > whole_bytes:
        raise UclError(f"{e.name} is a part of {e.key} ({format_size(need)}), which this export reads whole to cut "
                       "it out, more than the max_memory cap allows; give a larger max_memory", code="UCL011")
    data = _converted(e.renamed.take(to_torch(pieces.whole(), pieces.dtype)), e)
    if data.nbytes != e.nbytes:  # the manifest and the tensor read disagree: never write a lying header
        raise ForeignFormatError(f"{e.key} read as {data.nbytes} bytes, but its manifest entry says {e.nbytes}", code="UCL503")
    yield 0, data


def _converted(tensor: Any, e: _Entry) -> np.ndarray:
    """The C-contiguous little-endian storage bytes of ``tensor`` (a torch tensor) in ``e.dtype``."""
    if e.dtype != e.stored:
        tensor = tensor.to(torch_dtype(e.dtype))  # torch's cast: round to nearest even, as .to() does
    return to_numpy(tensor)[0].reshape(-1)


def _write_json(path: str, obj: Any, durable: bool) -> None:
    # transformers writes config.json and the index with indent=2 and sorted keys
    with open(path, "x", encoding="utf-8") as fh:
        fh.write(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n")
        if durable:
            fh.flush()
            os.fsync(fh.fileno())
