"""Reading ``torch.save`` files without running them and without reading their tensors.

A ``.pt`` file is a zip archive: ``<prefix>/data.pkl`` (a pickle describing the object, tensors
referring to storages by key) and one uncompressed member ``<prefix>/data/<key>`` per storage.
:func:`read_torch_file` unpickles ``data.pkl`` with an allow-list: torch's tensor and storage
rebuilders become :class:`TensorRef` records (where the bytes are, not the bytes), plain containers
stay what they are, a few framework classes that checkpoints carry (DeepSpeed's ``LossScaler``,
``ZeroStageEnum``, ``fragment_address``; ``argparse.Namespace``) become inert :class:`Record`
objects, and anything else is refused with an error naming the class. Nothing is imported on the
file's say-so and nothing executes. torch itself is not needed.
"""
from __future__ import annotations

import collections
import io
import os
import stat
import struct
import zipfile
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...dtypes import DTYPES, itemsize
from ...errors import StoreError
from ...files import check_inside
from .numpy_values import NDARRAY, np_dtype, np_reconstruct, np_scalar
from .unpickle import PICKLE_ERRORS, BudgetedUnpickler, Call, brief, pickle_error

MAX_PICKLE_BYTES = 256 << 20  # data.pkl holds structure, not tensors; a bigger one is hostile

# torch storage classes (as pickled) -> logical dtype
_STORAGES = {d.torch_storage: d.name for d in DTYPES.values() if d.torch_storage}
_UNTYPED = "uint8"  # an UntypedStorage holds bytes; the tensor built on it names its dtype
# torch dtypes (as pickled: their names and torch's aliases) -> logical dtype
_DTYPES = {d.torch_name: d.name for d in DTYPES.values()} | {
    "float": "float32", "double": "float64", "half": "float16", "long": "int64", "int": "int32"}
# framework classes a checkpoint may carry as plain data: recorded, never imported
RECORD_CLASSES = frozenset({
    ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),
    ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"),
    ("deepspeed.utils.tensor_fragment", "fragment_address"),
    ("argparse", "Namespace"),
})
# enums pickled as a call with their value: the value stands for the member
ENUM_CLASSES = frozenset({("deepspeed.runtime.zero.config", "ZeroStageEnum"),
                          ("megatron.core.transformer.enums", "AttnBackend"),  # Megatron-LM args
                          ("megatron.core.transformer.enums", "AttnMaskType"),
                          ("megatron.core.enums", "ModelType")})



class _NoState:
    """A pickle's BUILD must not rewrite a record after its checks (frozen dataclasses do not stop it)."""

    def __setstate__(self, state):
        raise pickle_error("a pickle tried to set the state of a tensor or storage reference")


@dataclass(frozen=True)
class StorageRef(_NoState):
    key: str
    dtype: str  # logical
    numel: int


@dataclass(frozen=True)
class TensorRef(_NoState):
    """A tensor of a torch file, by location: ``shape`` elements of ``dtype`` starting
    ``offset`` elements into storage ``storage``, with element ``stride``."""
    storage: StorageRef
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    @property
    def dtype(self) -> str:
        return self.storage.dtype

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=object))

    @property
    def contiguous(self) -> bool:
        expect = 1
        for size, step in zip(reversed(self.shape), reversed(self.stride)):
            if size != 1 and step != expect:
                return False
            expect *= size
        return True


class Record:
    """An object of an allow-listed framework class, kept as data: ``cls`` is 'module.Name',
    ``state`` what the pickle set on it (usually its ``__dict__``), ``args`` its constructor args."""

    def __init__(self, cls: str, args: tuple = ()):
        self.cls, self.args, self.state = cls, args, None

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def get(self, name: str, default: Any = None) -> Any:
        if isinstance(self.state, dict):
            return self.state.get(name, default)
        if isinstance(self.state, tuple) and len(self.state) == 2 and isinstance(self.state[1], dict):
            return self.state[1].get(name, default)  # (dict, slots)
        return default

    def __repr__(self) -> str:
        return f"Record({self.cls}, {brief(self.state)})"


def _record_factory(cls: str):
    class _New(Record):
        def __new__(klass, *args):
            obj = object.__new__(Record)
            Record.__init__(obj, cls, args)
            return obj
    _New.__name__ = cls.rsplit(".", 1)[-1]
    return _New


MAX_NDIM = 64  # torch's own limit on a tensor's dimensions


def _count(x: Any) -> bool:
    return type(x) is int and 0 <= x < 1 << 63


def _rebuild_tensor(storage, offset, size, stride, *rest):
    if not isinstance(storage, StorageRef):
        raise pickle_error(f"a tensor refers to {type(storage).__name__}, not a storage")
    if not (isinstance(size, tuple) and isinstance(stride, tuple) and len(size) == len(stride) <= MAX_NDIM
            and all(map(_count, size)) and all(map(_count, stride)) and _count(offset)):
        raise pickle_error(f"a tensor has an invalid view: size {brief(size)}, stride {brief(stride)}, "
                     f"offset {brief(offset)}")
    shape, stride = size, stride
    if all(shape):  # the last element it reaches must lie in its storage
        last = int(offset) + sum((s - 1) * t for s, t in zip(shape, stride))
        if last >= storage.numel:
            raise pickle_error(f"a tensor of size {shape} reaches element {last} of a storage of {storage.numel}")
    return TensorRef(storage, int(offset), shape, stride)


def _rebuild_tensor_v3(storage, offset, size, stride, requires_grad, hooks, dtype, *rest):
    # torch's form for dtypes without a typed storage class (fp8): an UntypedStorage of bytes
    logical = dtype.removeprefix("torch.") if isinstance(dtype, str) else None
    if not isinstance(storage, StorageRef) or storage.dtype != _UNTYPED or logical not in DTYPES:
        raise pickle_error(f"a tensor of {brief(dtype)} refers to {type(storage).__name__}, not an untyped storage")
    size_of = itemsize(logical)
    if storage.numel % size_of:
        raise pickle_error(f"an untyped storage of {storage.numel} bytes does not hold whole {logical} elements")
    return _rebuild_tensor(StorageRef(storage.key, logical, storage.numel // size_of), offset, size, stride)


_TENSOR_TYPE = ("tensor-type",)


_REBUILD, _REBUILD_V3 = Call(_rebuild_tensor), Call(_rebuild_tensor_v3)


def _rebuild_from_type(func, new_type, args, state=None):
    # a tensor saved with its Python type and attributes: the tensor is what matters
    if (func is not _REBUILD and func is not _REBUILD_V3) or new_type is not _TENSOR_TYPE or type(args) is not tuple:
        raise pickle_error("a pickle asked to rebuild a tensor subclass ucl does not know")
    return func(*args)


def _rebuild_parameter(data, requires_grad=False, backward_hooks=None, *rest):
    return data


def _ordered_dict(*args):
    if args:  # a pickled OrderedDict is made empty and filled by SETITEMS, whose keys are checked
        raise pickle_error("a pickle asked for an OrderedDict built from arguments")
    return collections.OrderedDict()


def _size(dims=()):
    if not isinstance(dims, (tuple, list)) or len(dims) > MAX_NDIM or \
            any(isinstance(d, (tuple, list, dict, set, frozenset)) for d in dims):  # numbers: checked where used
        raise pickle_error(f"a pickled torch.Size holds {brief(dims)}, not up to {MAX_NDIM} sizes")
    return tuple(dims)


def _device(kind, index=None):
    if not isinstance(kind, str) or len(kind) > 32 or not (index is None or type(index) is int):
        raise pickle_error(f"a pickle asked for the torch device {brief(kind)}, {brief(index)}")
    return f"device:{kind}" if index is None else f"device:{kind}:{index}"


def _complex(real=0.0, imag=0.0):
    if not all(type(x) in (int, float) for x in (real, imag)):
        raise pickle_error(f"a pickle asked for a complex number of {brief(real)}, {brief(imag)}")
    return complex(float(real), float(imag))  # an int beyond a float's range: OverflowError, refused


def _slice(*args):
    if not 1 <= len(args) <= 3 or not all(x is None or type(x) is int for x in args):
        raise pickle_error(f"a pickle asked for a slice of {brief(args)}")
    return slice(*args)


def _latin1_encode(text, encoding="latin1"):
    if encoding not in ("latin1", "latin-1") or not isinstance(text, str):
        raise pickle_error("a pickle asked for an unsupported byte encoding")
    return text.encode("latin1")


def _bytearray(data=b"", *rest):
    if not isinstance(data, (bytes, str)):  # bytearray(n) would allocate n zeroed bytes
        raise pickle_error("a pickle asked for a bytearray of a given size")
    if isinstance(data, str):  # pickled bytearrays are latin-1 text; any other codec is refused
        if rest not in (("latin1",), ("latin-1",)):
            raise pickle_error(f"a pickle asked for a bytearray in the encoding {brief(rest)}")
        return bytearray(data, "latin-1")
    if rest:
        raise pickle_error("a pickle asked for a bytearray of bytes with an encoding")
    return bytearray(data)


_NUMPY = ("numpy.core.multiarray", "numpy._core.multiarray")
# (module, name) -> what the unpickler gets: callables wrapped as Call (no pickle can set their state)
_ALLOWED: dict[tuple[str, str], Any] = {
    ("collections", "OrderedDict"): Call(_ordered_dict),
    ("torch._utils", "_rebuild_tensor_v2"): _REBUILD,
    ("torch._utils", "_rebuild_tensor_v3"): _REBUILD_V3,
    ("torch._utils", "_rebuild_parameter"): Call(_rebuild_parameter),
    ("torch._utils", "_rebuild_parameter_with_state"): Call(_rebuild_parameter),
    ("torch._tensor", "_rebuild_from_type_v2"): Call(_rebuild_from_type),
    ("torch.storage", "UntypedStorage"): ("storage-type", _UNTYPED),
    ("torch", "Tensor"): _TENSOR_TYPE, ("torch.nn.parameter", "Parameter"): _TENSOR_TYPE,
    ("torch", "Size"): Call(_size), ("torch", "device"): Call(_device),
    ("builtins", "slice"): Call(_slice), ("builtins", "complex"): Call(_complex),
    ("builtins", "bytearray"): Call(_bytearray), ("_codecs", "encode"): Call(_latin1_encode),
    **{(m, "_reconstruct"): Call(np_reconstruct) for m in _NUMPY},
    **{(m, "scalar"): Call(np_scalar) for m in _NUMPY},
    ("numpy", "ndarray"): NDARRAY, ("numpy", "dtype"): Call(np_dtype),
    **{("torch", name): ("storage-type", dtype) for name, dtype in _STORAGES.items()},
    **{("torch", name): f"torch.{dtype}" for name, dtype in _DTYPES.items()},
    **{key: _record_factory(f"{key[0]}.{key[1]}") for key in RECORD_CLASSES},
    **{key: Call(lambda value: value) for key in ENUM_CLASSES},
}


class _Unpickler(BudgetedUnpickler):
    def __init__(self, data: bytes, where: str):
        super().__init__(data, where, pickle_error)
        self.sets = {("builtins", "set"): Call(self.checked_set), ("builtins", "frozenset"): Call(self.checked_frozenset)}

    def find_class(self, module: str, name: str) -> Any:
        found = _ALLOWED.get((module, name)) or self.sets.get((module, name))
        if found is None:
            raise pickle_error(f"{self.where} needs the class {module}.{name}, which ucl does not load from a file "
                         "(only tensors, plain containers and a short allow-list of framework records; "
                         "docs/interop.md)")
        return found

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"
                and isinstance(pid[1], tuple) and pid[1][:1] == ("storage-type",)):
            raise pickle_error(f"{self.where} refers to an unsupported persistent object {brief(pid)}")
        _, (_, dtype), key, _location, numel = pid
        if type(dtype) is not str or not isinstance(key, str) or not key.isalnum() or len(key) > 64 or not _count(numel):
            raise pickle_error(f"{self.where} has a malformed storage reference {brief(pid)}")
        return StorageRef(key, dtype, numel)


@dataclass(frozen=True)
class TorchFile:
    """A ``torch.save`` file read lazily: its object (tensors as :class:`TensorRef`) and where
    each storage's bytes start in the file."""
    path: str
    obj: Any
    storage_offsets: dict[str, int]  # storage key -> byte offset in the file
    storage_bytes: dict[str, int]

    def byte_offset(self, t: TensorRef) -> int:
        """Where ``t``'s first element is in the file (``t`` must be contiguous)."""
        if not t.contiguous:
            raise pickle_error(f"{self.path}: a tensor of size {t.shape} is stored with stride {t.stride}, not "
                         "row-major; ucl reads tensors in place only when they are contiguous")
        return self.storage_offsets[t.storage.key] + t.offset * itemsize(t.dtype)


def read_torch_file(path: str, inside: str | None = None, *, offset: int = 0, length: int | None = None
                    ) -> TorchFile:
    """The object of a ``torch.save`` zip file, tensors left on disk (see the module doc).
    Every storage is checked against the archive: uncompressed, present, exactly the size its
    references claim, and inside the file. With ``offset``/``length`` the archive is those bytes of
    the file (a DCP ``.distcp`` item); storage offsets are still offsets into the whole file."""
    where = path if not (offset or length is not None) else f"{path} bytes [{offset}, +{length})"
    if inside is not None:
        check_inside(path, inside, "file", lambda msg: StoreError(msg, code="UCL416"))
    try:
        st = os.stat(path)
    except OSError as e:
        raise pickle_error(f"cannot read {where}: {e.strerror or e}") from None
    if not stat.S_ISREG(st.st_mode):
        raise StoreError(f"{where} is not a regular file", code="UCL416")
    size = st.st_size - offset if length is None else length
    if offset < 0 or size < 0 or offset + size > st.st_size:
        raise StoreError(f"{where} runs past the end of the file ({st.st_size:,} bytes; truncated?)", code="UCL406")
    try:
        with open(path, "rb") as whole, zipfile.ZipFile(f := _Window(whole, offset, size)) as z:
            infos = {i.filename: i for i in z.infolist()}
            pkl = [n for n in infos if n.endswith("/data.pkl") and n.count("/") == 1]
            if len(pkl) != 1:
                raise pickle_error(f"{where} is not a torch.save zip archive (no single <prefix>/data.pkl)")
            prefix = pkl[0][:-len("data.pkl")]
            packed = [n for n, i in infos.items() if i.compress_type != zipfile.ZIP_STORED]
            if packed:  # torch.save stores every member; a compressed one could be a decompression bomb
                raise pickle_error(f"{where}: member {brief(packed[0])} is compressed; torch.save files store every member")
            locked = [n for n, i in infos.items() if i.flag_bits & 0x1]
            if locked:  # zipfile would ask for a password (RuntimeError); torch.save never encrypts
                raise pickle_error(f"{where}: member {brief(locked[0])} is marked encrypted; torch.save files never are")
            if infos[pkl[0]].file_size > MAX_PICKLE_BYTES:
                raise pickle_error(f"{where}: data.pkl is {infos[pkl[0]].file_size:,} bytes, beyond the limit")
            order = infos.get(prefix + "byteorder")
            if order is not None and (order.file_size > 16 or z.read(order).strip() not in (b"little",)):
                raise pickle_error(f"{where} was written big-endian; ucl reads little-endian files only")
            data = z.read(pkl[0])
            obj = _Unpickler(data, where).load_checked()
            offsets, sizes = {}, {}
            for name, info in infos.items():
                if not name.startswith(prefix + "data/"):
                    continue
                key = name[len(prefix + "data/"):]
                if info.compress_type != zipfile.ZIP_STORED:
                    raise pickle_error(f"{where}: storage {key} is compressed; ucl reads stored tensors in place only")
                f.seek(info.header_offset)
                head = f.read(30)
                if len(head) != 30 or head[:4] != b"PK\x03\x04":
                    raise pickle_error(f"{where}: the zip entry of storage {key} is damaged")
                name_len, extra_len = struct.unpack("<HH", head[26:30])
                start = info.header_offset + 30 + name_len + extra_len
                if start + info.file_size > size:
                    raise pickle_error(f"{where}: storage {key} runs past the end of the file (truncated?)")
                offsets[key], sizes[key] = offset + start, info.file_size
    except StoreError:
        raise
    except (zipfile.BadZipFile, OSError, *PICKLE_ERRORS) as e:
        text = str(e) if isinstance(e, OSError) else e.args[0] if e.args and isinstance(e.args[0], str) else ""
        raise pickle_error(f"{where} is not a readable torch.save file: {type(e).__name__}: {text[:160]}") from None
    _check_storages(obj, offsets, sizes, where)
    return TorchFile(path, obj, offsets, sizes)


class _Window(io.RawIOBase):
    """Bytes ``[offset, offset + size)`` of an open file, as a seekable file of their own."""

    def __init__(self, f, offset: int, size: int):
        super().__init__()
        self._f, self._offset, self._size, self._pos = f, offset, size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._size}[whence]
        if base + pos < 0:
            raise ValueError("negative seek position")
        self._pos = base + pos
        return self._pos

    def read(self, n: int | None = -1) -> bytes:
        n = self._size - self._pos if n is None or n < 0 else n
        n = max(0, min(n, self._size - self._pos))
        self._f.seek(self._offset + self._pos)
        data = self._f.read(n) if n else b""
        self._pos += len(data)
        return data

    def readinto(self, buf) -> int:
        data = self.read(len(buf))
        buf[:len(data)] = data
        return len(data)


def _check_storages(obj: Any, offsets: dict, sizes: dict, where: str) -> None:
    seen: set[int] = set()
    stack = [obj]
    while stack:
        x = stack.pop()
        if id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, TensorRef):
            s = x.storage
            if type(s) is not StorageRef or type(x.offset) is not int or not isinstance(x.shape, tuple):
                raise pickle_error(f"{where}: a malformed tensor reference")
            _rebuild_tensor(s, x.offset, x.shape, x.stride)  # its view checked again: inside its storage
            if s.key not in offsets:
                raise pickle_error(f"{where}: storage {s.key} is referenced but missing from the archive")
            if s.numel * itemsize(s.dtype) != sizes[s.key]:
                raise pickle_error(f"{where}: storage {s.key} holds {sizes[s.key]:,} bytes, not the "
                             f"{s.numel:,} x {s.dtype} its tensors claim")
        elif isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
        elif isinstance(x, Record):
            stack.extend([x.state, x.args])
