"""Hugging Face ``save_pretrained`` folders (safetensors), described for reading in place.

A folder holding ``config.json`` and ``model.safetensors`` (or ``model.safetensors.index.json``
and the shards its ``weight_map`` names) is read as a *universal* checkpoint (mesh ``()``: every
tensor whole on one rank) of the standard spec for its ``model_type`` (``stdlib:llama``,
``stdlib:qwen2``, ``stdlib:gpt2``...), with the dims that spec's ``dims ... from`` declarations read
from ``config.json`` (:meth:`ucl.Spec.dims_from_config`, the one config reader). What is stored:

* the weights only, kind ``param``, under the model's in-memory names; every parameter is frozen,
  so no optimizer state is expected (``bind(frozen=...)``) and a reshard writes weights alone;
* each tensor in the dtype its header says; the stdlib specs store ``param`` as float32, so the
  description's spec is the stdlib text plus ``state param : dtype X`` for the dtype most tensors
  have and ``state param for NAME | ... : dtype Y`` for the others (fp32 norms in a bf16 model);
* each tensor as one :class:`~ucl.store.extents.Extent`: its bytes at ``8 + header length +
  data_offsets[0]`` of its file. Every header entry is checked (known dtype, shape, the offsets
  holding exactly dtype x shape bytes, inside the file) before anything is described, so a lying
  header is a StoreError and nothing is ever allocated for it. Shards named by the index must be
  plain relative paths inside the folder (``ucl.formats.hf.names.safe_shard_name``).

Tied embeddings follow the stdlib specs (``lm_head.weight`` is ``optional if tied``:
``save_pretrained`` leaves it out). A checkpoint saved without the base model's prefix (GPT-2 on the
Hub: ``h.0.attn.c_attn.weight``) gets it back (``transformer.h.0...``), as ``from_pretrained`` does.

MoE: ``save_pretrained`` writes one tensor per expert (``mlp.experts.{e}.gate_proj.weight``...)
while the specs describe the fused in-memory tensors (``mlp.experts.gate_up_proj [E, 2I, H]``,
``down_proj [E, H, I]``). Their row-major bytes are the saved tensors' bytes joined in order
(gate_0, up_0, gate_1, ...), so each fused tensor is one joined Extent (``Extent.joined``): read in
place, no copy, no transpose.
"""
from __future__ import annotations

import os
import re
from collections import Counter

from ...dtypes import itemsize
from ...errors import BindError, ForeignFormatError, StoreError
from ...files import check_inside
from ...lang import ast
from ...lang.spec import Spec
from ...model_config import CONFIG_NAME, json_config, load_config, read_raw_config
from ...store.extents import Extent, Piece
from ..base import Description, UserSpec
from . import specs
from .check import check_against
from .layers import completeness, layer_kinds, needs_defaults
from .names import INDEX_NAME, SINGLE_NAME, fuse_saved_experts, fused_expert_parts, read_saved_tensors

_NAME = re.compile(r"^[A-Za-z0-9_][\w\-]*(\.[\w\-]+)*$")  # names the spec language can spell
known_model_types = specs.known_model_types


def _has(path: str, name: str) -> bool:
    return os.path.lexists(os.path.join(path, name))


def detect(path: str) -> bool:
    """A folder with ``config.json`` and ``model.safetensors`` or ``model.safetensors.index.json``
    and no ``manifest.json``."""
    return (os.path.isdir(path) and not _has(path, "manifest.json") and _has(path, CONFIG_NAME)
            and (_has(path, SINGLE_NAME) or _has(path, INDEX_NAME)))


def choose_spec(config_file: str, raw: dict, user: UserSpec | None = None) -> specs.Choice:
    """The spec a folder with this config is read with: the user's, the stdlib's (by model_type or
    alias), else derived from the model class (``ucl.formats.hf.specs``)."""
    if user is not None:
        return specs.Choice(user.text, user.filename, "user")
    return specs.standard(raw.get("model_type")) or specs.derived(config_file, raw)


def config_dims(spec: Spec, config_file: str, raw: dict) -> dict[str, int]:
    """The spec's dims from config.json: from the fields as written when they have every dim the spec
    reads (no transformers import), else with the model class's defaults filled in."""
    fields = {k: v for k, v in raw.items() if k != "model_type"}  # no model_type: no class defaults
    if fields.get("head_dim") is None and isinstance(fields.get("hidden_size"), int) \
            and isinstance(fields.get("num_attention_heads"), int) and fields["num_attention_heads"] > 0:
        fields["head_dim"] = fields["hidden_size"] // fields["num_attention_heads"]
    try:
        return spec.dims_from_config(fields)
    except BindError:
        return spec.dims_from_config(config_file)


def describe(path: str, user: UserSpec | None = None) -> Description:
    path = os.path.abspath(path)
    if not detect(path):
        raise StoreError(f"{path} is not a Hugging Face save_pretrained folder (config.json with model.safetensors "
                         "or model.safetensors.index.json, no manifest.json)", code="UCL501")
    config_file = os.path.join(path, CONFIG_NAME)
    check_inside(config_file, path, "config", lambda m: StoreError(m, code="UCL401"))
    raw = read_raw_config(config_file)
    choice = choose_spec(config_file, raw, user)
    try:
        return _describe(path, config_file, raw, choice, user)
    except ForeignFormatError:
        if choice.source != "alias":
            raise
    # this config of an aliased type has tensors the shared spec does not describe (a flag): derive one
    return _describe(path, config_file, raw, specs.derived(config_file, raw), None)


def _describe(path: str, config_file: str, raw: dict, choice: specs.Choice, user: UserSpec | None) -> Description:
    spec_name = choice.name
    base = Spec.from_text(choice.text, filename=choice.name, name=choice.name)
    dims = dict(user.dims) if user is not None and user.dims else config_dims(base, config_file, raw)

    on_disk = read_saved_tensors(path)  # every header entry checked against its file here
    traced = _by_saved_form(choice, on_disk, path)
    if traced is not None:  # the derived model's own save conversion, inverted
        saved, renamed, joined = traced
        names = {n: n for n in saved}
    else:
        renamed, joined = {}, []
        shapes = {n: e.shape for n, (_, e) in on_disk.items()}
        fused, problems = fuse_saved_experts(shapes)
        if problems:
            raise ForeignFormatError(f"{path}: the per-expert tensors cannot be fused into the tensors {spec_name} "
                                     "describes:\n  " + "\n  ".join(problems[:8]) + _why_not_traced(choice))
        saved = _fused(on_disk, fused, fused_expert_parts(shapes), path)
        names = _in_memory_names(base, list(saved))
    for n in names.values():
        if not _NAME.match(n):
            raise ForeignFormatError(f"{path}: tensor name {n[:200]!r} cannot be written in a spec")

    dtypes = {names[n]: e.dtype for n, e in saved.items()}
    spec_text = _without_param_dtypes(base).rstrip("\n") + "\n" + _dtype_lines(dtypes)
    spec = Spec.from_text(spec_text, filename=f"{path} [{spec_name} + dtypes]", name=spec_name)
    params = {names[n]: e.shape for n, e in sorted(saved.items(), key=lambda kv: _natural(names[kv[0]]))}
    frozen = tuple(params)
    bad = check_against(spec, dims, params, frozen=frozen)
    if bad:
        raise ForeignFormatError(f"{path}: the tensors do not fit {spec_name} ({choice.source}) with the dims of "
                                 f"config.json ({len(bad)} problem{'s' * (len(bad) != 1)}):\n  " + "\n  ".join(bad[:8])
                                 + _why_not_traced(choice))
    incomplete = _incomplete(choice, spec, dims, params, raw, config_file)
    if incomplete:
        raise ForeignFormatError(f"{path} {'; '.join(incomplete)}; an incomplete save_pretrained folder is not read")
    extents = {f"param/{names[n]}": e for n, e in saved.items()}
    files = sorted({p.file for e in saved.values() for p in e.parts()})
    sharded = _has(path, INDEX_NAME)
    read = (CONFIG_NAME,) + ((INDEX_NAME,) if sharded else ()) + tuple(files)
    state = {"format": "hf", "hf": {"spec_source": choice.source, "spec": spec_name, "model_type": raw.get("model_type"),
                                    "renamed": {**renamed, **{n: m for n, m in names.items() if n != m}},
                                    "joined": joined,
                                    "config": json_config(raw)}}
    return Description("hf", spec_text, spec_name, dims, (), params, frozen, ({k: extents[k] for k in
                       sorted(extents)},), (INDEX_NAME if sharded else SINGLE_NAME,), state, read)


def _incomplete(choice: specs.Choice, spec: Spec, dims: dict, params: dict, raw: dict, config_file: str) -> list[str]:
    """What the folder lacks (or holds of the wrong kind) against what the model has: a derived spec
    knows the model class's own names; the others' rules say it, layer by layer as the config makes
    each layer (dense or MoE)."""
    if choice.model_names is not None:
        missing = [n for n in choice.model_names if n not in params]
        return [f"lacks {len(missing)} tensor(s) the {raw.get('model_type')} model holds (e.g. {missing[:3]})"] \
            if missing else []
    fields = load_config(config_file) if needs_defaults(raw) else raw
    layers = int(dims.get("layers", 0) or 0)
    return completeness(spec, dims, params, layer_kinds(fields, layers) if layers else None)


def _by_saved_form(choice: specs.Choice, on_disk: dict, path: str):
    """(in-memory name -> Extent, {saved: held} renames, [names joined from parts]) by the saved form
    traced from the derived model class, or None where it does not apply: no trace, or the folder is
    not what save_pretrained writes (a saved name missing or of another shape, a name the model does
    not hold: a folder written under the in-memory names, or without the base model's prefix)."""
    if choice.model_names is None or choice.form_problem:
        return None
    for name, shape in choice.saved_shapes:
        if name not in on_disk or on_disk[name][1].shape != shape:
            return None
    used = {n for n, _ in choice.saved_shapes}
    held = set(choice.model_names)
    if any(n not in used and n not in held for n in on_disk):
        return None
    out: dict[str, Extent] = {n: Extent(f, e.offset, e.dtype, e.shape) for n, (f, e) in on_disk.items() if n not in used}
    renamed: dict[str, str] = {}
    joined: list[str] = []
    for name, shape, runs in choice.saved_form:
        dtypes = {on_disk[s][1].dtype for s, _, _ in runs}
        if len(dtypes) > 1:
            raise ForeignFormatError(f"{path}: {name} is saved in parts of several dtypes {sorted(dtypes)}")
        dtype = dtypes.pop() if dtypes else "float32"
        size = itemsize(dtype)
        pieces = [Piece(on_disk[s][0], on_disk[s][1].offset + start * size, count * size) for s, start, count in runs]
        if len(runs) == 1 and runs[0][1] == 0 and tuple(on_disk[runs[0][0]][1].shape) == tuple(shape):
            renamed[runs[0][0]] = name
            out[name] = Extent(pieces[0].file, pieces[0].offset, dtype, tuple(shape))
        else:
            joined.append(name)
            out[name] = Extent.joined(pieces, dtype, tuple(shape))
    return out, renamed, joined


def _why_not_traced(choice: specs.Choice) -> str:
    return f"\n  ({choice.form_problem})" if choice.form_problem else ""


def _fused(saved: dict, fused: dict, parts: dict[str, list[str]], path: str) -> dict[str, Extent]:
    """Saved name -> extent, with per-expert tensors joined into the fused tensors the spec
    describes (their bytes, in order, are the fused tensor's: no copy, no transpose)."""
    out: dict[str, Extent] = {}
    for name, shape in fused.items():
        if name in parts:
            pieces = [saved[s] for s in parts[name]]
            dtypes = {e.dtype for _, e in pieces}
            if len(dtypes) != 1:
                raise ForeignFormatError(f"{path}: the experts of {name} are stored in several dtypes {sorted(dtypes)}")
            out[name] = Extent.joined([Piece(f, e.offset, e.nbytes) for f, e in pieces], dtypes.pop(), shape)
        else:
            orig = name if name in saved else name.replace(".mlp.gate.", ".block_sparse_moe.gate.")
            file, e = saved[orig]
            out[name] = Extent(file, e.offset, e.dtype, e.shape)
    return out


def _in_memory_names(spec: Spec, saved: list[str]) -> dict[str, str]:
    """Saved name -> in-memory name: unchanged, unless no saved name has the base model's prefix
    (``model.``, ``transformer.``) that every rule of the spec but ``lm_head``'s starts with, and
    then it is added to every name but ``lm_head.*``."""
    heads = {r.pattern.text.split(".", 1)[0] for r in spec.checked.rules} - {"lm_head"}
    if len(heads) != 1 or not _NAME.match(next(iter(heads))):
        return {n: n for n in saved}
    prefix = heads.pop() + "."
    if any(n.startswith(prefix) for n in saved):
        return {n: n for n in saved}
    return {n: n if n.startswith("lm_head.") else prefix + n for n in saved}


def _without_param_dtypes(spec: Spec) -> str:
    """The spec's text without its ``state param [for ...] : dtype T`` statements: the headers say
    each tensor's dtype, and their lines replace these (a spec from ``ucl spec from-hf`` says the
    folder's dtype; both would declare it twice). Lines are kept, so messages point where they did."""
    lines = spec.text.split("\n")
    for st in reversed(spec.module.statements):
        if isinstance(st, ast.StateDecl) and [k.name for k in st.kinds] == ["param"] and st.transforms \
                and all(isinstance(t, ast.Dtype) for t in st.transforms):
            a, b = st.span, st.span
            head, tail = lines[a.line - 1][:a.col - 1], lines[b.end_line - 1][b.end_col - 1:]
            lines[a.line - 1:b.end_line] = [head + tail] + [""] * (b.end_line - a.line)
    return "\n".join(lines)


def _dtype_lines(dtypes: dict[str, str]) -> str:
    """``state param`` statements giving every tensor its stored dtype (the default is float32)."""
    counts = Counter(dtypes.values())
    main = max(counts, key=lambda d: (counts[d], d == "float32")) if counts else "float32"
    lines = ["# added by ucl: the dtypes the safetensors headers give"]
    if main != "float32":
        lines.append(f"state param : dtype {main}")
    for dtype in sorted(d for d in counts if d != main):
        names = [n for n, d in dtypes.items() if d == dtype]
        lines.append(f"state param for {' | '.join(names)}\n    : dtype {dtype}")
    return "\n".join(lines) + "\n" if len(lines) > 1 else ""


def _natural(name: str) -> list:
    """Sort key putting ``layers.2`` before ``layers.10``."""
    return [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in re.split(r"(\d+)", name)]
