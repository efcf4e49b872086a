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
from typing import Any

import numpy as np

from ..dtypes import LOGICAL_DTYPES, itemsize, storage_dtype
from ..errors import StoreError
from ..files import parse_json
from .checksum import is_checksum

FORMAT_NAME = "ucl-checkpoint"
FORMAT_VERSION = 2  # 2: a replicated dataset is stored by its first replica only (docs/format.md)
# 3: some datasets in the compressed encoding, a unit per checksum chunk or tile; 4: units of ``group``
# chunks or tile bands; 5: a unit may start with a layout header (plane layout 1) (docs/format.md).
# What a checkpoint with a compressed dataset says now:
COMPRESSED_VERSION = 5
READ_VERSION = COMPRESSED_VERSION  # the newest version this ucl reads
ENCODINGS = ("zstd", "lz4")  # the compressed encodings an entry's ``encoding`` may name
MAX_GROUP = 1 << 20  # the largest ``group`` a reader takes (far above any a writer chooses)
MANIFEST_NAME = "manifest.json"
TABLES_NAME = "ucl_tables"  # each rank file's dataset of digest tables that entries' ``tables`` locate

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


@dataclass(frozen=True)
class DatasetInfo:
    dtype: str  # logical dtype
    shape: tuple[int, ...]
    checksum: str
    chunks: str | None = None  # digest of the rank file's chunk-digest table (checksum.chunk_table_digest)
    tiles: str | None = None  # digest of the rank file's tile-digest table (checksum.tile_table_digest)
    offset: int | None = None  # byte offset of the data in the rank file (contiguous storage)
    tables: int | None = None  # byte offset of the chunk then tile digests in the rank file's ucl_tables
    encoding: str | None = None  # the compressed encoding's codec; None: plain
    stored: int | None = None  # bytes the compressed dataset takes in the rank file
    frames: str | None = None  # digest binding its frame table (codec.frame_table_digest)
    group: int | None = None  # checksum chunks or tile bands per coded unit (None: 1, as version 3 wrote)

    @classmethod
    def of_entry(cls, e: dict) -> "DatasetInfo":
        """The info a manifest's dataset entry gives (every field a reader needs, compression's included)."""
        return cls(e["dtype"], tuple(e["shape"]), e["checksum"], e.get("chunks"), e.get("tiles"), e.get("offset"),
                   e.get("tables"), e.get("encoding"), e.get("stored"), e.get("frames"), e.get("group"))

    @property
    def storage_dtype(self) -> np.dtype:
        return storage_dtype(self.dtype)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * itemsize(self.dtype)

    @property
    def file_bytes(self) -> int:
        """Bytes its data takes in the rank file (stored bytes when compressed)."""
        return self.nbytes if self.encoding is None else int(self.stored)


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _json_default(obj: Any) -> Any:
    # numpy scalars/arrays are common in training state; convert, never pickle
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, (tuple, set, frozenset)):
        return list(obj)
    raise TypeError(f"object of type {type(obj).__name__} is not JSON serializable")


def plain_json(value: Any) -> Any:
    """A copy of ``value`` in plain JSON values, as a manifest stores it (numpy scalars and arrays,
    tuples and sets converted); TypeError or ValueError (NaN, infinity) when it is not JSON."""
    return json.loads(json.dumps(value, allow_nan=False, default=_json_default))


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
            d = parse_json(text, "manifest", lambda msg: StoreError(msg, code="UCL401"))
        if not isinstance(d, dict):
            raise StoreError("manifest is not a JSON object", code="UCL401")
        if d.get("format") != FORMAT_NAME:
            raise StoreError(f"not a ucl checkpoint manifest (format={d.get('format')!r}, "
                             f"expected {FORMAT_NAME!r})", code="UCL401")
        version = d.get("version")
        if not _is_int(version) or version < 1:
            raise _bad(f"key 'version' must be a positive integer, got {version!r}")
        if version > READ_VERSION:
            raise StoreError(
                f"checkpoint format version {version} was written by a newer ucl; this ucl reads "
                f"versions up to {READ_VERSION}. Upgrade ucl to read it.", code="UCL402")
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
    if not is_checksum(e["checksum"]):
        raise _bad(f"{where}: 'checksum' must look like 'xxh3_64:<16 hex digits>'")
    for k in ("chunks", "tiles", "frames"):
        if k in e and not is_checksum(e[k]):
            raise _bad(f"{where}: {k!r} must look like 'xxh3_64:<16 hex digits>'")
    for k in ("offset", "tables", "stored"):
        if k in e and not (_is_int(e[k]) and e[k] >= 0):
            raise _bad(f"{where}: {k!r} must be a non-negative integer (a byte offset in the rank file)")
    if "tables" in e and "chunks" not in e and "tiles" not in e and "frames" not in e:
        raise _bad(f"{where}: 'tables' locates digest tables that no 'chunks', 'tiles' or 'frames' digest binds")
    packed = [k for k in ("encoding", "stored", "frames", "group") if k in e]
    if packed:
        missing = [k for k in ("encoding", "stored", "frames", "offset", "tables") if k not in e]
        if missing:
            raise _bad(f"{where}: a compressed entry lacks {', '.join(repr(k) for k in missing)}")
        if "group" in e and not (_is_int(e["group"]) and 1 <= e["group"] <= MAX_GROUP):
            raise _bad(f"{where}: 'group' must be an integer from 1 to {MAX_GROUP:,}, got {e['group']!r}")
        if e["encoding"] not in ENCODINGS:
            raise _bad(f"{where}: unknown 'encoding' {e['encoding']!r} (ucl knows {', '.join(ENCODINGS)})")
