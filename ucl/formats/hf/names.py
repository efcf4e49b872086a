"""Tensor names and shapes of Hugging Face checkpoints (safetensors headers, sharded indexes, ucl
manifests), and saved per-expert MoE names mapped back onto the fused in-memory tensors."""
from __future__ import annotations

import math
import os
import re
import struct
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

from ...dtypes import itemsize, of_safetensors
from ...errors import StoreError
from ...files import check_inside, parse_json, read_bounded, read_prefix

Shapes = dict[str, tuple[int, ...]]


# ---- reading tensor names ------------------------------------------------------------------------
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit on a header
MAX_JSON_BYTES = 1 << 30  # an index or a manifest


def _error(msg: str) -> StoreError:
    return StoreError(msg, code="UCL401")


def _json_file(path: Path, what: str, inside: Path | None = None) -> dict:
    data = parse_json(read_bounded(path, limit=MAX_JSON_BYTES, what=what, error=_error, inside=inside),
                      f"{what} {path}", _error)
    if not isinstance(data, dict):
        raise _error(f"{what} {path} is not a JSON object")
    return data


def _raw_safetensors_header(path: Path, inside: Path | None = None) -> tuple[dict, int, int]:
    """(header JSON object, byte offset of the data section, file size) of a .safetensors file; the
    header's length is checked against the file's size before the header is read."""
    if inside is not None:
        check_inside(path, inside, "safetensors file", _error)
    head = read_prefix(path, 8, "safetensors file", _error)
    if len(head) != 8:
        raise _error(f"{path}: not a safetensors file (too short)")
    (n,) = struct.unpack("<Q", head)
    size = os.path.getsize(path)
    if n > MAX_HEADER_BYTES or 8 + n > size:
        raise _error(f"{path}: not a safetensors file (header of {n} bytes in a file of {size})")
    meta = parse_json(read_prefix(path, 8 + n, "safetensors file", _error)[8:], f"safetensors header of {path}", _error)
    if not isinstance(meta, dict):
        raise _error(f"{path}: safetensors header is not a JSON object")
    return meta, 8 + n, size


def _safetensors_header(path: Path, inside: Path | None = None) -> Shapes:
    """Names and shapes from a .safetensors header (8-byte little-endian length + JSON), no data
    read; the length is checked against the file's size before the header is read."""
    meta, _, _ = _raw_safetensors_header(path, inside)
    out: Shapes = {}
    for k, v in meta.items():
        shape = v.get("shape") if isinstance(v, dict) else None
        if k != "__metadata__":
            if not isinstance(shape, list) or len(shape) > 64 or not all(_is_count(x) for x in shape):
                raise _error(f"{path}: tensor {k!r}: shape {str(shape)[:100]} is not a list of non-negative integers")
            out[k] = tuple(shape)
    return out


@dataclass(frozen=True)
class SafetensorsEntry:
    """One tensor of a .safetensors file: its logical dtype, shape, and where its row-major bytes
    are (``offset``: from the start of the file, ``8 + header length + data_offsets[0]``)."""
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def _is_count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def read_safetensors_entries(path: str | os.PathLike, inside: str | os.PathLike | None = None) \
        -> dict[str, SafetensorsEntry]:
    """``{name: SafetensorsEntry}`` of a .safetensors file, in header order, nothing of the data read.
    Every entry is checked before it is returned: a known dtype, a shape of non-negative integers,
    ``data_offsets`` ``[begin, end]`` with ``end - begin`` = the bytes dtype x shape need, and the
    range inside the file's data section (so a header claiming a huge shape, or bytes past the end
    of the file, is a StoreError and nothing is ever allocated for it). Two tensors sharing bytes are
    refused too (safetensors never writes that). ``inside``: the file must resolve inside it."""
    path = Path(path)
    meta, start, size = _raw_safetensors_header(path, Path(inside) if inside is not None else None)
    out: dict[str, SafetensorsEntry] = {}
    ranges: list[tuple[int, int, str]] = []
    for name, v in meta.items():
        if name == "__metadata__":
            continue
        where = f"{path}: tensor {name!r}"
        if not isinstance(v, dict):
            raise _error(f"{where}: header entry is not a JSON object")
        dtype, shape, offsets = v.get("dtype"), v.get("shape"), v.get("data_offsets")
        if not isinstance(dtype, str):
            raise _error(f"{where}: dtype {dtype!r} is not a string")
        try:
            logical = of_safetensors(dtype)
        except StoreError as e:
            raise StoreError(f"{where}: {e}", code=e.code) from None
        if not isinstance(shape, list) or len(shape) > 64 or not all(_is_count(x) for x in shape):
            raise _error(f"{where}: shape {str(shape)[:100]} is not a list of non-negative integers")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(x) for x in offsets)
                and offsets[0] <= offsets[1]):
            raise _error(f"{where}: data_offsets {str(offsets)[:100]} are not [begin, end] with 0 <= begin <= end")
        begin, end = offsets
        need = math.prod(shape) * itemsize(logical)
        if end - begin != need:
            raise _error(f"{where}: data_offsets [{begin}, {end}] hold {end - begin:,} bytes, but "
                         f"{dtype} {list(shape) if len(shape) <= 8 else '[...]'} needs {need:,}")
        if start + end > size:
            raise StoreError(f"{where}: bytes [{begin:,}, {end:,}) of the data section run past the end of the file "
                             f"({size - start:,} bytes of data; truncated or a lying header)", code="UCL406")
        out[name] = SafetensorsEntry(logical, tuple(shape), start + begin, need)
        if need:
            ranges.append((begin, end, name))
    ranges.sort()
    for (_, e0, a), (b1, _, b) in zip(ranges, ranges[1:]):
        if b1 < e0:
            raise _error(f"{path}: tensors {a!r} and {b!r} overlap in the data section")
    return out


INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


def safe_shard_name(folder: str | os.PathLike, name: Any) -> str:
    """``name`` (a shard named by an index) if it is a plain relative path of a .safetensors file
    inside ``folder``; a StoreError (UCL401) otherwise: not a string, absolute, with a ``..``
    component, or resolving outside ``folder`` through a link. The file is not opened."""
    if not isinstance(name, str) or not name:
        raise _error(f"{folder}: the index names a shard that is not a file name: {str(name)[:100]!r}")
    parts = name.replace("\\", "/").split("/")
    if os.path.isabs(name) or name.startswith(("/", "\\")) or any(p in ("", ".", "..") for p in parts) \
            or "\0" in name or not name.endswith(".safetensors"):
        raise _error(f"{folder}: the index names the shard {name[:200]!r}; shards are .safetensors files named "
                     "by a plain relative path inside the folder")
    check_inside(os.path.join(folder, name), folder, "safetensors shard", _error)
    return name


def read_saved_tensors(folder: str | os.PathLike) -> dict[str, tuple[str, SafetensorsEntry]]:
    """``{name: (shard file relative to folder, SafetensorsEntry)}`` of a ``save_pretrained`` folder:
    ``model.safetensors.index.json``'s ``weight_map`` when there is one (shards checked by
    :func:`safe_shard_name`; every mapped name must be in its shard and every tensor of a shard
    mapped to it), ``model.safetensors`` otherwise; in the index's (or header's) order."""
    folder = Path(folder)
    index = folder / INDEX_NAME
    if not index.exists() and not index.is_symlink():
        return {n: (SINGLE_NAME, e) for n, e in read_safetensors_entries(folder / SINGLE_NAME, folder).items()}
    weight_map = _json_file(index, "index", inside=folder).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise _error(f"{index}: 'weight_map' is not a non-empty object of tensor name -> shard file")
    by_file: dict[str, list[str]] = {}
    for name, file in weight_map.items():
        by_file.setdefault(safe_shard_name(folder, file), []).append(name)
    headers = {f: read_safetensors_entries(folder / f, folder) for f in by_file}
    out: dict[str, tuple[str, SafetensorsEntry]] = {}
    for name, file in weight_map.items():
        entry = headers[file].get(name)
        if entry is None:
            raise _error(f"{index} maps {name!r} to {file}, which has no such tensor")
        out[name] = (file, entry)
    for file, entries in headers.items():
        extra = [n for n in entries if weight_map.get(n) != file]
        if extra:
            raise _error(f"{folder / file} holds {len(extra)} tensor(s) the index does not map to it "
                         f"(e.g. {extra[0]!r}); the index and its shards disagree")
    return out


def _ucl_checkpoint(path: Path) -> Shapes:
    manifest = _json_file(path / "manifest.json", "manifest", inside=path)
    params = manifest.get("params")
    if params:
        return {k: tuple(int(x) for x in v) for k, v in params.items()}
    if not manifest.get("mesh"):  # universal layout: the datasets of rank 0 are the global tensors
        out = {}
        for key, entry in manifest["datasets"][0].items():
            kind, _, name = key.partition("/")
            if kind == "param":
                out[name] = tuple(int(x) for x in entry["shape"])
        return out
    raise StoreError(f"{path}/manifest.json has no `params` (global shapes) and is not universal", code="UCL420")


def read_tensor_names(path) -> Shapes:
    """``{name: shape}`` of every tensor in a ``.safetensors`` file, a ``save_pretrained`` folder
    (``model.safetensors`` or shards listed by ``model.safetensors.index.json``; other
    ``*.safetensors`` files otherwise) or a ucl checkpoint folder (its manifest's ``params``).
    Malformed JSON (a header, an index, a manifest) is a StoreError (UCL401) naming the path."""
    try:
        return _read_tensor_names(Path(path))
    except (ValueError, KeyError, TypeError, AttributeError, IndexError) as e:  # JSON that is not what we read
        what = f"missing {e}" if isinstance(e, KeyError) else " ".join(str(e).split())[:200]
        raise StoreError(f"{path}: cannot read tensor names ({what})", code="UCL401") from None


def _read_tensor_names(path: Path) -> Shapes:
    if path.is_file():
        if path.name == "manifest.json":
            return _ucl_checkpoint(path.parent)
        if path.name.endswith(".index.json"):
            files = sorted(set(_json_file(path, "index")["weight_map"].values()))
            return _merge(path.parent, files)
        return _safetensors_header(path)
    if not path.is_dir():
        raise StoreError(f"{path}: no such file or folder", code="UCL404")
    if (path / "manifest.json").is_file():
        return _ucl_checkpoint(path)
    index = sorted(path.glob("*.safetensors.index.json"))
    if index:
        files = sorted(set(_json_file(index[0], "index", inside=path)["weight_map"].values()))
        return _merge(path, files)
    files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise StoreError(f"{path}: no .safetensors files, index or ucl manifest.json", code="UCL404")
    return _merge(path, files)


def _merge(folder: Path, names: Iterable[str]) -> Shapes:
    """Headers of the shard files ``names`` of ``folder``; a name (from an index) that leads outside
    the folder is refused, never followed."""
    out: Shapes = {}
    for name in names:
        if not isinstance(name, str):
            raise _error(f"{folder}: the index names a shard that is not a string: {name!r}")
        out.update(_safetensors_header(folder / name, inside=folder))
    return out


# ---- saved (per-expert) MoE names -> fused in-memory names ----------------------------------------
# transformers 5 holds experts as mlp.experts.gate_up_proj [E, 2I, H] (rows [:I] gate, [I:] up) and
# mlp.experts.down_proj [E, H, I]; save_pretrained writes one tensor per expert instead.
_EXPERT = re.compile(r"^(?P<pre>.*)\.(?P<blk>mlp|block_sparse_moe|feed_forward)\.experts\.(?P<e>\d+)\."
                     r"(?P<w>gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$")
_ROLE = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}


def _block(m: re.Match) -> str:
    """The MoE block's in-memory name, where the fused tensors live: Mixtral's ``block_sparse_moe``
    is ``mlp`` now, Jamba's ``feed_forward`` keeps its name (one rule for both helpers below)."""
    return f"{m.group('pre')}.{'feed_forward' if m.group('blk') == 'feed_forward' else 'mlp'}"


def fuse_saved_experts(tensors: Mapping[str, Iterable[int]]) -> tuple[Shapes, list[str]]:
    """Map saved per-expert names onto the fused in-memory tensors; returns (tensors, problems).

    ``PFX.{mlp|block_sparse_moe}.experts.{e}.{gate_proj|w1}.weight [I, H]`` + ``up_proj|w3 [I, H]``
    -> ``PFX.mlp.experts.gate_up_proj [E, 2I, H]``; ``down_proj|w2 [H, I]`` ->
    ``PFX.mlp.experts.down_proj [E, H, I]`` (Jamba's ``feed_forward`` block keeps its name);
    Mixtral's ``block_sparse_moe.gate.weight`` ->
    ``mlp.gate.weight``. Experts must be numbered 0..E-1 with all three matrices, of equal shapes.
    Names that are not per-expert pass through unchanged (in their order)."""
    out: Shapes = {}
    problems: list[str] = []
    groups: dict[str, dict[int, dict[str, tuple[int, ...]]]] = {}
    for name, shape in tensors.items():
        shape = tuple(int(x) for x in shape)
        m = _EXPERT.match(name)
        if m is None:
            if ".block_sparse_moe.gate." in name:
                name = name.replace(".block_sparse_moe.gate.", ".mlp.gate.")
            out[name] = shape
            continue
        pre = _block(m)
        if pre not in groups:
            groups[pre] = {}
            out[f"{pre}.experts.gate_up_proj"] = ()  # placeholder keeps model order
            out[f"{pre}.experts.down_proj"] = ()
        role = _ROLE[m.group("w")]
        per = groups[pre].setdefault(int(m.group("e")), {})
        if role in per:
            problems.append(f"{name}: expert {m.group('e')} of {pre} has two {role} matrices")
        per[role] = shape
    for pre, experts in groups.items():
        fused_gu, fused_d = f"{pre}.experts.gate_up_proj", f"{pre}.experts.down_proj"
        n = len(experts)
        if sorted(experts) != list(range(n)):
            problems.append(f"{pre}: experts are numbered {sorted(experts)}, expected 0..{n - 1}")
        shapes = defaultdict(set)
        for e, per in sorted(experts.items()):
            for role in ("gate", "up", "down"):
                if role not in per:
                    problems.append(f"{pre}: expert {e} has no {role} matrix")
                else:
                    shapes[role].add(per[role])
        bad = [r for r in ("gate", "up", "down") if len(shapes[r]) > 1]
        for r in bad:
            problems.append(f"{pre}: the experts' {r} matrices differ in shape: {sorted(shapes[r])}")
        if bad or any(len(shapes[r]) != 1 for r in ("gate", "up", "down")):
            del out[fused_gu], out[fused_d]
            continue
        (g,), (u,), (d,) = shapes["gate"], shapes["up"], shapes["down"]
        if len(g) != 2 or g != u or len(d) != 2 or d != (g[1], g[0]):
            problems.append(f"{pre}: expert shapes gate {list(g)}, up {list(u)}, down {list(d)} do not fit "
                            "gate = up = [I, H] and down = [H, I]")
            del out[fused_gu], out[fused_d]
            continue
        out[fused_gu] = (n, 2 * g[0], g[1])
        out[fused_d] = (n, d[0], d[1])
    return out, problems


def fused_expert_parts(names: Iterable[str]) -> dict[str, list[str]]:
    """For each fused in-memory tensor :func:`fuse_saved_experts` makes, the saved per-expert
    tensors whose row-major bytes, joined in this order, are its bytes: ``gate_up_proj [E, 2I, H]``
    is gate_0, up_0, gate_1, up_1, ...; ``down_proj [E, H, I]`` is down_0, down_1, ...
    (call it on names ``fuse_saved_experts`` accepted without problems)."""
    roles: dict[str, dict[int, dict[str, str]]] = {}
    for name in names:
        m = _EXPERT.match(name)
        if m is not None:
            roles.setdefault(_block(m), {}).setdefault(int(m.group("e")), {})[_ROLE[m.group("w")]] = name
    out: dict[str, list[str]] = {}
    for pre, experts in roles.items():
        order = sorted(experts)
        out[f"{pre}.experts.gate_up_proj"] = [experts[e][r] for e in order for r in ("gate", "up")]
        out[f"{pre}.experts.down_proj"] = [experts[e]["down"] for e in order]
    return out
