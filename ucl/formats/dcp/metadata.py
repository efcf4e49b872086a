"""The ``.metadata`` file of a PyTorch DCP folder, unpickled with an allow-list of exactly DCP's own
metadata classes (turned into inert records; anything else is UCL500) into :class:`Metadata`:
every tensor's dtype, global shape and saved chunks (each with the file, offset and length of its
item), the other items, and each flattened key's path in the nested state dict (docs/interop.md)."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from ...dtypes import DTYPES
from ...errors import ForeignFormatError, StoreError
from ...files import read_bounded
from ..torchzip.unpickle import BudgetedUnpickler, Call, brief

METADATA = ".metadata"
MAX_METADATA_BYTES = 256 << 20


def _key(key: Any) -> str:
    """A state-dict key for a message: its repr when a short string, else :func:`brief` (a
    .metadata's keys are a stranger's, of any length or type)."""
    return repr(key) if isinstance(key, str) and len(key) <= 160 else brief(key)


def _bad(msg: str) -> StoreError:
    return StoreError(msg, code="UCL500")



# ---- .metadata, unpickled with an allow-list ---------------------------------------------------
class _Record:
    """An allow-listed DCP metadata object kept as data: its pickled state as attributes."""

    cls = "?"

    def __init__(self, *args: Any):
        self.args = args
        self.state: Any = None

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2 and isinstance(state[0], dict) and isinstance(state[1], dict):
            state = {**state[0], **state[1]}  # (dict, slots)
        if isinstance(state, dict):
            for k, v in state.items():
                if not isinstance(k, str) or k.startswith("__") or k in ("cls", "get", "args", "state"):
                    raise _bad(f"{self.cls} carries a malformed attribute {brief(k)}")
                self.__dict__[k] = v
        else:
            self.state = state

    def get(self, name: str, default: Any = None) -> Any:
        return self.__dict__.get(name, default) if name not in ("args", "state") else default


_DCP_CLASSES = {
    ("torch.distributed.checkpoint.metadata", n) for n in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta")} | {("torch.distributed.checkpoint.filesystem", "_StorageInfo")} | {
    # the save plans Megatron keeps in Metadata.planner_data (all_local_plans): data, never used
    ("torch.distributed.checkpoint.planner", n) for n in ("SavePlan", "WriteItem", "WriteItemType",
                                                          "TensorWriteData")}
_RECORDS = {key: type(key[1], (_Record,), {"cls": f"{key[0]}.{key[1]}"}) for key in _DCP_CLASSES}
_MEM_FORMAT = ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING")
_PATHS = {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"}
# torch dtypes ucl has no logical dtype for: unpickled as names, refused (UCL412) only if a tensor uses one
_OTHER_DTYPES = {"complex32", "complex64", "complex128", "uint16", "uint32", "uint64", "float8_e4m3fnuz",
                 "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn_x2", "qint8", "quint8", "qint32", "quint4x2"}


@dataclass(frozen=True)
class _Dtype:
    name: str

    def __setstate__(self, state: Any) -> None:  # BUILD would write past frozen into __dict__
        raise _bad("a pickle tried to set the state of a torch dtype")


def _path(*parts: Any) -> str:
    if not all(isinstance(p, str) for p in parts):
        raise _bad("a pickled path has parts that are not strings")
    return "/".join(parts)


def _layout(name: Any) -> str:
    if not isinstance(name, str) or len(name) > 64:
        raise _bad("a pickled torch layout is malformed")
    return name


def _size(dims=()):
    if not isinstance(dims, (tuple, list)) or len(dims) > 64 or \
            any(isinstance(d, (tuple, list, dict)) for d in dims):  # numbers: checked where used
        raise _bad(f"a pickled torch.Size holds {brief(dims)}")
    return tuple(dims)


def _dict(*args):
    if args:  # an OrderedDict is pickled empty and filled by SETITEMS, whose keys the scan checked
        raise _bad("a pickle asked for an OrderedDict built from arguments")
    return {}


# the callables the unpickler may call, as Call objects: no pickle can set their state
_SIZE, _DICT, _LAYOUT, _PATH = Call(_size), Call(_dict), Call(_layout), Call(_path)
_MEMORY_FORMAT = Call(lambda value: ("memory_format", value))


class _MetadataUnpickler(BudgetedUnpickler):
    def __init__(self, data: bytes, where: str):
        super().__init__(data, where, _bad)

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _RECORDS:
            return _RECORDS[(module, name)]
        if (module, name) == _MEM_FORMAT:
            return _MEMORY_FORMAT
        if module == "torch" and name == "Size":
            return _SIZE
        if module == "torch" and (name in DTYPES or name in _OTHER_DTYPES):
            return _Dtype(name)
        if module == "torch.serialization" and name == "_get_layout":
            return _LAYOUT
        if module in ("pathlib", "pathlib._local") and name in _PATHS:
            return _PATH
        if module == "collections" and name == "OrderedDict":
            return _DICT
        raise _bad(f"{self.where} needs the class {module}.{name}, which ucl does not load from a file "
                   "(only the DCP metadata classes, torch.Size and dtypes; docs/interop.md)")

    def persistent_load(self, pid: Any) -> Any:
        raise _bad(f"{self.where} refers to a persistent object {brief(pid)}; DCP metadata has none")


@dataclass
class Chunk:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str = ""
    offset: int = 0  # of the item (a torch.save archive) in its file
    length: int = 0

    @property
    def empty(self) -> bool:
        return 0 in self.sizes


@dataclass
class TensorMeta:
    key: str
    dtype: str
    shape: tuple[int, ...]
    chunks: list[Chunk] = field(default_factory=list)


@dataclass
class Metadata:
    tensors: dict[str, TensorMeta]
    objects: dict[str, tuple[str, int, int]]  # key -> (file, offset, length)
    paths: dict[str, tuple]  # flattened key -> path in the nested state dict
    version: Any
    ranks: int | None = None  # processes that saved: Megatron keeps one SavePlan each (all_local_plans)


def _ints(x: Any, what: str) -> tuple[int, ...]:
    if not isinstance(x, (tuple, list)) or len(x) > 64 or not all(type(v) is int and 0 <= v < 1 << 63 for v in x):
        raise _bad(f"{what} is not a list of non-negative integers ({brief(x)})")
    return tuple(x)


def _rec(x: Any, cls: str, what: str) -> _Record:
    if not isinstance(x, _Record) or x.cls.rsplit(".", 1)[1] != cls:
        raise _bad(f"{what} is {getattr(x, 'cls', type(x).__name__)}, not a DCP {cls}")
    return x


def read_metadata(path: str) -> Metadata:
    """The ``.metadata`` of the DCP folder ``path``, as plain records (see the module doc)."""
    mpath = os.path.join(path, METADATA)
    data = read_bounded(mpath, limit=MAX_METADATA_BYTES, what="DCP metadata file", inside=path, error=_bad)
    md = _MetadataUnpickler(data, mpath).load_checked()
    md = _rec(md, "Metadata", mpath)
    sdm, storage = md.get("state_dict_metadata"), md.get("storage_data")
    if not isinstance(sdm, dict) or not isinstance(storage, dict):
        raise _bad(f"{mpath}: Metadata has no state_dict_metadata / storage_data dicts (not written by a "
                   "FileSystemWriter?)")
    where: dict[tuple, tuple[str, int, int]] = {}
    for index, info in storage.items():
        index = _rec(index, "MetadataIndex", f"{mpath}: a storage_data key")
        info = _rec(info, "_StorageInfo", f"{mpath}: storage_data[{brief(index.get('fqn'))}]")
        fqn, off = index.get("fqn"), index.get("offset")
        rel, start, length = info.get("relative_path"), info.get("offset"), info.get("length")
        if not isinstance(fqn, str) or not isinstance(rel, str) or not isinstance(start, int) \
                or not isinstance(length, int) or start < 0 or length < 0:
            raise _bad(f"{mpath}: a malformed storage_data entry for {brief(fqn)}")
        if info.get("transform_descriptors"):
            raise ForeignFormatError(f"{mpath}: {_key(fqn)} was written through stream transforms "
                         f"{brief(info.get('transform_descriptors'))} (compression); ucl reads only plain "
                         "items in place")
        if os.path.isabs(rel) or ".." in rel.replace("\\", "/").split("/") or not rel or "\0" in rel:
            raise StoreError(f"{mpath}: item {_key(fqn)} lives in {_key(rel)}, outside the checkpoint folder", code="UCL416")
        where[(fqn, None if off is None else _ints(off, f"{mpath}: offset of {_key(fqn)}"))] = (rel, start, length)
    tensors: dict[str, TensorMeta] = {}
    objects: dict[str, tuple[str, int, int]] = {}
    for key, meta in sdm.items():
        if not isinstance(key, str):
            raise _bad(f"{mpath}: a state dict key is {type(key).__name__}, not a string")
        if isinstance(meta, _Record) and meta.cls.endswith(".BytesStorageMetadata"):
            if (key, None) not in where:
                raise _bad(f"{mpath}: the object {_key(key)} has no storage_data entry")
            objects[key] = where[(key, None)]
            continue
        meta = _rec(meta, "TensorStorageMetadata", f"{mpath}: {_key(key)}")
        props = _rec(meta.get("properties"), "TensorProperties", f"{mpath}: properties of {_key(key)}")
        dt = props.get("dtype") if props.state is None else (props.state[0] if isinstance(props.state, tuple)
                                                              and props.state else None)
        if not isinstance(dt, _Dtype):
            raise _bad(f"{mpath}: {_key(key)} has no dtype")
        if dt.name not in DTYPES:
            raise StoreError(f"{mpath}: {_key(key)} is torch.{dt.name}, a dtype ucl does not read", code="UCL412")
        t = tensors[key] = TensorMeta(key, dt.name, _ints(meta.get("size"), f"{mpath}: size of {_key(key)}"))
        chunks = meta.get("chunks")
        if not isinstance(chunks, list):
            raise _bad(f"{mpath}: {_key(key)} has no chunk list")
        for c in chunks:
            c = _rec(c, "ChunkStorageMetadata", f"{mpath}: a chunk of {_key(key)}")
            off = _ints(c.get("offsets"), f"{mpath}: chunk offsets of {_key(key)}")
            size = _ints(c.get("sizes"), f"{mpath}: chunk sizes of {_key(key)}")
            if len(off) != len(t.shape) or len(size) != len(t.shape) or \
                    any(o + s > n for o, s, n in zip(off, size, t.shape)):
                raise ForeignFormatError(f"{mpath}: {_key(key)} {brief(list(t.shape))} has a chunk at "
                                         f"{brief(list(off))} of {brief(list(size))}, outside the tensor")
            loc = where.get((key, off))
            if loc is None:
                raise _bad(f"{mpath}: the chunk of {_key(key)} at {brief(list(off))} has no storage_data entry")
            t.chunks.append(Chunk(off, size, *loc))
    planner = md.get("planner_data")
    paths = {k: tuple(v) for k, v in planner.items() if isinstance(k, str) and isinstance(v, (tuple, list))} \
        if isinstance(planner, dict) else {}
    plans = md.get("all_local_plans")
    ranks = len(plans) if isinstance(plans, list) and plans else None
    return Metadata(tensors, objects, paths, md.get("version"), ranks)
