"""The checkpoint manifest (``manifest.json``) and the naming rules of a checkpoint.

Pure: no file I/O beyond reading/writing JSON text. The normative description is
docs/format.md; keep the two in step.
"""
from __future__ import annotations

import datetime as _dt
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import numpy as np
import xxhash

from ..errors import StoreError
from .dtypes import LOGICAL_DTYPES, itemsize, storage_dtype

FORMAT_NAME = "ucl-checkpoint"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
CHECKSUM_ALGO = "xxh3_64"

_CHECKSUM_RE = re.compile(r"^xxh3_64:[0-9a-f]{16}$")
_FILE_RE = re.compile(r"^[A-Za-z0-9_.-]+\.h5$")
# required keys: without them a reader cannot find or check a byte
_REQUIRED = ("format", "version", "dims", "mesh", "files", "datasets")


def file_name(rank: int) -> str:
    """Name of a rank's HDF5 file: ``rank_00042.h5``."""
    return f"rank_{rank:05d}.h5"


def split_key(key: str) -> tuple[str, str]:
    """Split ``kind/name`` (exactly one '/'); names may hold dots but not be '.' or '..'."""
    if not isinstance(key, str) or key.count("/") != 1:
        raise StoreError(f"dataset key {key!r} must be 'kind/name' with exactly one '/'", code="UCL409")
    kind, name = key.split("/")
    for part in (kind, name):
        if part in ("", ".", ".."):
            raise StoreError(f"dataset key {key!r} has an empty or reserved part", code="UCL409")
    return kind, name


def format_checksum(hexdigest: str) -> str:
    return f"{CHECKSUM_ALGO}:{hexdigest}"


def raw_bytes(arr: np.ndarray) -> np.ndarray:
    """A C-contiguous array's bytes as a flat uint8 view (safe for bool and 0-d)."""
    return arr.reshape(-1).view(np.uint8)


def checksum_of(arr: np.ndarray) -> str:
    """``xxh3_64:<hex>`` of a C-contiguous storage array's bytes."""
    return format_checksum(xxhash.xxh3_64_hexdigest(raw_bytes(arr)))


# Datasets above MIN_CHUNK_BYTES also carry a checksum per chunk of their flat bytes (in their rank
# file, as attributes), so a partial read (one rank's hyperslab) is verified by reading only the
# chunks it touches. Chunks are a power of two of at least MIN_CHUNK_BYTES, at most MAX_CHUNKS per
# dataset: a partial read rounds out by at most 1/1024 of the dataset at each end.
MIN_CHUNK_BYTES = 16 << 10
MAX_CHUNKS = 1024


def chunk_size(nbytes: int) -> int | None:
    """Chunk size in bytes for a dataset of ``nbytes``; None when it is small enough to verify whole."""
    if nbytes <= MIN_CHUNK_BYTES:
        return None
    size = MIN_CHUNK_BYTES
    while size * MAX_CHUNKS < nbytes:
        size *= 2
    return size


def checksums(arr: np.ndarray) -> tuple[str, tuple[int, np.ndarray] | None]:
    """(checksum, (chunk bytes, chunk digests) or None) in one pass over the bytes, chunk by chunk
    while each is in cache."""
    raw = raw_bytes(arr)
    size = chunk_size(raw.size)
    if size is None:
        return format_checksum(xxhash.xxh3_64_hexdigest(raw)), None
    whole, digests = xxhash.xxh3_64(), np.empty(-(-raw.size // size), dtype=np.uint64)
    for k, i in enumerate(range(0, raw.size, size)):
        piece = raw[i:i + size]
        whole.update(piece)
        digests[k] = xxhash.xxh3_64_intdigest(piece)
    return format_checksum(whole.hexdigest()), (size, digests)


class IncrementalChecksum:
    """Checksums (whole and per chunk) of a dataset filled piecewise: hashed on the fly while pieces
    arrive in flat order."""

    def __init__(self, nbytes: int) -> None:
        self.hasher, self.next_flat, self.in_order = xxhash.xxh3_64(), 0, True
        self.size = chunk_size(nbytes)
        self.chunks: list[int] = []
        self.chunk, self.chunk_fill = xxhash.xxh3_64(), 0

    def advance(self, start: int, flat: np.ndarray) -> None:
        if self.in_order and start == self.next_flat:
            raw = raw_bytes(flat)
            self.hasher.update(raw)
            pos = 0
            while self.size and pos < raw.size:
                take = min(self.size - self.chunk_fill, raw.size - pos)
                self.chunk.update(raw[pos:pos + take])
                self.chunk_fill += take
                pos += take
                if self.chunk_fill == self.size:
                    self.chunks.append(self.chunk.intdigest())
                    self.chunk, self.chunk_fill = xxhash.xxh3_64(), 0
            self.next_flat += flat.size
        elif flat.size:
            self.in_order = False  # out of order or overwrite: caller re-reads at close

    def result(self, total: int) -> tuple[str, tuple[int, np.ndarray] | None] | None:
        """(checksum, (chunk bytes, chunk digests) or None) if exactly ``total`` elements arrived
        in order, else None."""
        if not (self.in_order and self.next_flat == total):
            return None
        chunks = self.chunks + ([self.chunk.intdigest()] if self.chunk_fill else [])
        return format_checksum(self.hasher.hexdigest()), \
            ((self.size, np.array(chunks, dtype=np.uint64)) if self.size else None)


@dataclass(frozen=True)
class DatasetInfo:
    dtype: str  # logical dtype
    shape: tuple[int, ...]
    checksum: str

    @property
    def storage_dtype(self) -> np.dtype:
        return storage_dtype(self.dtype)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * itemsize(self.dtype)


def box_sel(starts: Sequence[int], sizes: Sequence[int]) -> tuple[slice, ...]:
    return tuple(slice(s, s + z) for s, z in zip(starts, sizes))


def check_box(starts: tuple[int, ...], sizes: tuple[int, ...], shape: tuple[int, ...], where: str) -> None:
    """Raise UCL409 unless the box lies inside ``shape``."""
    if len(starts) != len(shape) or len(sizes) != len(shape) or any(
            s < 0 or z < 0 or s + z > n for s, z, n in zip(starts, sizes, shape)):
        raise StoreError(f"box starts={list(starts)} sizes={list(sizes)} does not fit {where} of shape "
                         f"{list(shape)}", code="UCL409")


def check_out(out: np.ndarray | None, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """``out`` if it is a usable destination (or a new array when None), else raise UCL409."""
    if out is None:
        return np.empty(shape, dtype)
    if out.shape != shape or out.dtype != dtype or not out.flags.c_contiguous or not out.flags.writeable:
        raise StoreError(f"out must be a writable C-contiguous {dtype} array of shape {shape}, got "
                         f"{out.dtype} {out.shape}", code="UCL409")
    return out


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def flat_boxes(shape: tuple[int, ...], start: int, stop: int) -> Iterator[tuple[int, tuple[int, ...], tuple[int, ...]]]:
    """Cover the row-major flat range ``[start, stop)`` of ``shape`` by N-d boxes.

    Yields ``(flat_offset_of_box, starts, sizes)`` in increasing flat order; at most
    ``2*ndim - 1`` boxes, each contiguous in the flattening, so memory stays exact.
    """
    if start >= stop:
        return
    if not shape:
        yield start, (), ()
        return
    if len(shape) == 1:
        yield start, (start,), (stop - start,)
        return
    inner = math.prod(shape[1:])
    r0, o0 = divmod(start, inner)
    r1, o1 = divmod(stop, inner)
    if r0 == r1:
        for off, s, z in flat_boxes(shape[1:], o0, o1):
            yield r0 * inner + off, (r0, *s), (1, *z)
        return
    if o0:
        for off, s, z in flat_boxes(shape[1:], o0, inner):
            yield r0 * inner + off, (r0, *s), (1, *z)
        r0 += 1
    if r1 > r0:
        yield r0 * inner, (r0,) + (0,) * (len(shape) - 1), (r1 - r0, *shape[1:])
    if o1:
        for off, s, z in flat_boxes(shape[1:], 0, o1):
            yield r1 * inner + off, (r1, *s), (1, *z)


def _json_default(obj: Any) -> Any:
    # numpy scalars/arrays are common in training state; convert, never pickle
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, (tuple, set, frozenset)):
        return list(obj)
    raise TypeError(f"object of type {type(obj).__name__} is not JSON serializable")


def _bad(msg: str) -> StoreError:
    return StoreError(f"invalid manifest: {msg}", code="UCL403")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass
class Manifest:
    """Everything about a checkpoint except tensor bytes. ``datasets[rank][key]`` is
    ``{"dtype": logical, "shape": [...], "checksum": "xxh3_64:<hex>"}``."""

    dims: dict[str, int] = field(default_factory=dict)
    mesh: list[tuple[str, int]] = field(default_factory=list)
    files: list[str] = field(default_factory=list)
    datasets: list[dict[str, dict[str, Any]]] = field(default_factory=list)
    spec: str | None = None
    spec_name: str | None = None
    params: dict[str, list[int]] | None = None
    frozen: list[str] = field(default_factory=list)
    state: Any = field(default_factory=dict)
    created: str | None = None
    version: int = FORMAT_VERSION
    format: str = FORMAT_NAME
    extra: dict[str, Any] = field(default_factory=dict)  # unknown keys, kept verbatim

    @property
    def nranks(self) -> int:
        return len(self.files)

    @property
    def mesh_shape(self) -> dict[str, int]:
        return {a: s for a, s in self.mesh}

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = dict(self.extra)
        d.update(
            format=self.format, version=self.version, created=self.created or now_iso(),
            spec=self.spec, spec_name=self.spec_name, dims=dict(self.dims),
            mesh=[[a, s] for a, s in self.mesh], params=self.params, frozen=list(self.frozen),
            files=list(self.files), datasets=self.datasets, state=self.state,
        )
        return d

    def to_json(self) -> str:
        self.validate()
        def dump(v: Any) -> str:
            return json.dumps(v, separators=(",", ":"), allow_nan=False, default=_json_default)

        try:  # one top-level key per line, one rank's datasets per line: small yet greppable
            lines = [f"{json.dumps(k)}:[\n" + ",\n".join(dump(x) for x in v) + "\n]" if k == "datasets"
                     else f"{json.dumps(k)}:{dump(v)}" for k, v in self.to_dict().items()]
            return "{\n" + ",\n".join(lines) + "\n}\n"
        except (TypeError, ValueError) as e:
            raise _bad(f"not JSON-serializable (state must be plain JSON; no NaN/inf, no objects): {e}") from e

    @classmethod
    def from_json(cls, text: str | bytes | dict[str, Any]) -> "Manifest":
        if isinstance(text, dict):
            d = text
        else:
            try:
                d = json.loads(text)
            except (ValueError, UnicodeDecodeError) as e:
                raise StoreError(f"manifest is not valid JSON: {e}", code="UCL401") from e
        if not isinstance(d, dict):
            raise StoreError("manifest is not a JSON object", code="UCL401")
        if d.get("format") != FORMAT_NAME:
            raise StoreError(f"not a ucl checkpoint manifest (format={d.get('format')!r}, "
                             f"expected {FORMAT_NAME!r})", code="UCL401")
        version = d.get("version")
        if not _is_int(version) or version < 1:
            raise _bad(f"key 'version' must be a positive integer, got {version!r}")
        if version > FORMAT_VERSION:
            raise StoreError(
                f"checkpoint format version {version} was written by a newer ucl; this ucl reads "
                f"versions up to {FORMAT_VERSION}. Upgrade ucl to read it.", code="UCL402")
        for k in _REQUIRED:
            if k not in d:
                raise _bad(f"missing key {k!r}")
        known = {f for f in cls.__dataclass_fields__ if f != "extra"}
        m = cls(
            dims=d["dims"], mesh=d["mesh"], files=d["files"], datasets=d["datasets"],
            spec=d.get("spec"), spec_name=d.get("spec_name"), params=d.get("params"),
            frozen=d.get("frozen") or [], state=d.get("state", {}), created=d.get("created"),
            version=version, format=d["format"],
            extra={k: v for k, v in d.items() if k not in known},
        )
        m.validate()
        m.mesh = [(a, s) for a, s in m.mesh]
        return m

    def validate(self) -> None:
        """Check structure and types; raise StoreError(UCL403) naming the offending key."""
        if not isinstance(self.dims, dict) or not all(isinstance(k, str) and _is_int(v) and v >= 0
                                                      for k, v in self.dims.items()):
            raise _bad("key 'dims' must map names to non-negative integers")
        if not isinstance(self.mesh, (list, tuple)) or not all(
                isinstance(p, (list, tuple)) and len(p) == 2 and isinstance(p[0], str)
                and _is_int(p[1]) and p[1] >= 1 for p in self.mesh):
            raise _bad("key 'mesh' must be a list of [axis, size>=1] pairs")
        axes = [p[0] for p in self.mesh]
        if len(set(axes)) != len(axes):
            raise _bad(f"key 'mesh' repeats an axis: {axes}")
        if not isinstance(self.files, list) or not all(isinstance(f, str) and _FILE_RE.match(f)
                                                       and f not in (".h5", "..h5") for f in self.files):
            raise _bad("key 'files' must be a list of plain '*.h5' file names")
        if len(set(self.files)) != len(self.files):
            raise _bad("key 'files' names a file twice")
        if not isinstance(self.datasets, list) or len(self.datasets) != len(self.files):
            raise _bad(f"key 'datasets' must be a list with one entry per file ({len(self.files)})")
        nmesh = math.prod(s for _, s in self.mesh)
        if len(self.files) != nmesh:
            raise _bad(f"mesh {axes or '[] (universal)'} has {nmesh} ranks but 'files' lists {len(self.files)}")
        for rank, entries in enumerate(self.datasets):
            if not isinstance(entries, dict):
                raise _bad(f"datasets[{rank}] must be an object")
            for key, e in entries.items():
                check_entry(rank, key, e)
        if self.spec is not None and not isinstance(self.spec, str):
            raise _bad("key 'spec' must be a string or null")
        if self.spec_name is not None and not isinstance(self.spec_name, str):
            raise _bad("key 'spec_name' must be a string or null")
        if self.params is not None and not (isinstance(self.params, dict) and all(
                isinstance(k, str) and isinstance(v, list) and all(_is_int(x) and x >= 0 for x in v)
                for k, v in self.params.items())):
            raise _bad("key 'params' must map names to shape lists")
        if not isinstance(self.frozen, (list, tuple)) or not all(isinstance(x, str) for x in self.frozen):
            raise _bad("key 'frozen' must be a list of names")
        if self.created is not None and not isinstance(self.created, str):
            raise _bad("key 'created' must be a string")


def check_entry(rank: int, key: str, e: Any) -> None:
    where = f"datasets[{rank}][{key!r}]"
    try:
        split_key(key)
    except StoreError as err:
        raise _bad(f"{where}: {err}") from None
    if not isinstance(e, dict):
        raise _bad(f"{where} must be an object")
    for k in ("dtype", "shape", "checksum"):
        if k not in e:
            raise _bad(f"{where}: missing key {k!r}")
    if e["dtype"] not in LOGICAL_DTYPES:
        raise _bad(f"{where}: unknown dtype {e['dtype']!r}")
    if not isinstance(e["shape"], list) or not all(_is_int(x) and x >= 0 for x in e["shape"]):
        raise _bad(f"{where}: 'shape' must be a list of non-negative integers")
    if not isinstance(e["checksum"], str) or not _CHECKSUM_RE.match(e["checksum"]):
        raise _bad(f"{where}: 'checksum' must look like 'xxh3_64:<16 hex digits>'")
