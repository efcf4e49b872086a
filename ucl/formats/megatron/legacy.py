"""Megatron-LM legacy checkpoints (``--ckpt-format torch``), described for reading in place.

Layout (Megatron-LM ``megatron/training/checkpointing.py``: ``get_checkpoint_name``,
``generate_state_dict``, ``read_metadata``): a root holding ``latest_checkpointed_iteration.txt``
(an iteration number, or ``release``) and the folder it names, ``iter_{N:07d}`` or ``release``
(that folder may be given itself). In it one folder per model-parallel rank,
``mp_rank_{tp:02d}`` (PP = 1) or ``mp_rank_{tp:02d}_{pp:03d}``, each holding ``model_optim_rng.pt``:
a ``torch.save`` dict with ``args`` (the run's ``argparse.Namespace``), ``checkpoint_version``,
``iteration``, ``model`` (``model0``, ``model1``, ... with virtual pipeline stages: one module
state dict per chunk, layers numbered from 0 in each), and optionally ``optimizer``,
``opt_param_scheduler``, ``rng_state``. Data-parallel ranks share these files (only DP rank 0
writes them).

The description:

* spec: ``stdlib:megatron_gpt`` for megatron-core names (``decoder.layers.0...``), or
  ``stdlib:megatron_legacy_gpt`` for ``language_model.*`` names (nested dicts joined with dots),
  plus ``state param for ... : dtype`` lines where a tensor's stored dtype is not the spec's;
* dims from ``args`` (Megatron's argument names; see :func:`dims_from_args`). The vocabulary is
  ``padded_vocab_size``: the padded rows are real trained rows of the files (the output layer's
  get gradients), so they are kept as data; the spec's own ``pad to multiple_of(128 * tp)`` is
  then a no-op, and a run padded to another multiple is refused rather than misread;
* mesh ``pp, tp`` from ``args`` (rank = pp * tp_size + tp, Megatron's order);
* per rank, every dataset the spec's lowering puts there, ``param/<local name>`` (stage-local
  layer numbers; with virtual stages chunk ``c``'s layer ``j`` is ucl's local layer
  ``c * layers / (pp * vpp) + j``), as the byte range of that tensor in the rank's file. A tied
  embedding's copy on the last stage (``output_layer.weight`` / ``word_embeddings_for_head.weight``)
  is the embedding's dataset there. ``_extra_state`` entries are not tensors to reshard (the
  specs ignore them). A tensor in a file that no rule places on that rank is an error, never
  dropped.

Weights, and with ``--use-distributed-optimizer`` the optimizer state: when every rank folder holds
a ``distrib_optim.pt``, each rank's ``fp32/@flat0``, ``exp_avg/@flat0``, ``exp_avg_sq/@flat0`` are
read from it in place (:mod:`ucl.formats.megatron.legacy_optim`: the layout of
``stdlib:megatron_gpt``'s distributed-optimizer statement at data-parallel size 1, checked against
the file's buffer size) and the ``optimizer`` key (param groups, ``step``) goes into the state.
Without it every parameter is frozen and an ``optimizer`` key is noted, not read. ``args`` (as plain data),
``iteration``, ``checkpoint_version`` and what else the rank-0 file holds (the RNG state
summarized) go into ``state['megatron']``.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, replace
from typing import Any

from ...errors import ForeignFormatError, StoreError, UclError
from ...files import read_bounded
from ...lang.spec import Spec, load_spec
from ...layout.lower import lower
from ...layout.mesh import Mesh
from ...store.extents import Extent
from . import legacy_optim as optim
from .legacy_spec import dims_from_args, global_shapes, int_arg, which_spec, with_dtypes
from ..base import Description
from ..torchzip.read import Record, TensorRef, TorchFile, read_torch_file
from ..torchzip.plain import plain

TRACKER = "latest_checkpointed_iteration.txt"
MODEL_FILE = "model_optim_rng.pt"
DISTRIB_OPTIM = optim.DISTRIB_OPTIM
_RANK_DIR = re.compile(r"^mp_rank_\d+(_\d+){0,2}$")
_NAME = re.compile(r"^[A-Za-z0-9_][\w\-]*(\.[\w\-]+)*$")  # names the spec language can spell
_EXTRA = "._extra_state"
_MAX_TRACKER = 4096


def _rank_dir(tp: int, pp: int, pp_size: int) -> str:
    # Megatron-LM's get_checkpoint_name: the pipeline rank only when PP > 1
    return f"mp_rank_{tp:02d}" if pp_size == 1 else f"mp_rank_{tp:02d}_{pp:03d}"


def _rank0_file(folder: str) -> str | None:
    """The rank-0 file of an iteration folder, under any of the names Megatron-LM gives it."""
    for sub in ("mp_rank_00", "mp_rank_00_000", "mp_rank_00_000_000"):
        if os.path.isfile(os.path.join(folder, sub, MODEL_FILE)):
            return os.path.join(sub, MODEL_FILE)
    return None


def _iteration_folder(path: str) -> tuple[str, str | None] | None:
    """(iteration folder relative to ``path``, tracker text or None), or None when ``path`` is
    neither a checkpoint root nor an iteration folder."""
    if _rank0_file(path) is not None:
        return "", None
    tracker = os.path.join(path, TRACKER)
    if not os.path.isfile(tracker):
        return None
    text = read_bounded(tracker, limit=_MAX_TRACKER, what="Megatron tracker file", inside=path,
                        error=lambda m: StoreError(m, code="UCL500")).decode("utf-8", "replace").strip()
    if text == "release":
        name = "release"
    elif re.fullmatch(r"[0-9]{1,18}", text):  # Megatron-LM reads it with int(); ASCII digits: no path
        name = f"iter_{int(text):07d}"
    else:
        return None
    return (name, text) if _rank0_file(os.path.join(path, name)) is not None else None


def detect(path: str) -> bool:
    """A Megatron-LM root (``latest_checkpointed_iteration.txt`` naming a folder with
    ``mp_rank_*/model_optim_rng.pt``) or such an iteration folder, and no ``manifest.json``."""
    if not os.path.isdir(path) or os.path.lexists(os.path.join(path, "manifest.json")):
        return False
    try:
        return _iteration_folder(path) is not None
    except StoreError:
        return False


def _flatten(obj: Any, prefix: str, out: dict[str, Any]) -> None:
    """A (legacy: nested) module state dict as ``dotted.name -> value``."""
    for k, v in obj.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict) and not name.endswith(_EXTRA):
            _flatten(v, name + ".", out)
        else:
            out[name] = v


@dataclass(frozen=True)
class LegacyFolder:
    """An iteration folder and what its rank-0 file says."""
    path: str  # the checkpoint as given (absolute)
    sub: str  # the iteration folder relative to ``path`` ('' when ``path`` is one)
    tracker: str | None  # the tracker file's text, when ``path`` is the root
    first: TorchFile  # the rank-0 file
    head: dict  # its dict
    args: dict  # the run's arguments
    tp: int
    pp: int

    @property
    def folder(self) -> str:
        return os.path.join(self.path, self.sub)

    def rel(self, *parts: str) -> str:
        return os.path.join(self.sub, *parts) if self.sub else os.path.join(*parts)


@dataclass(frozen=True)
class LegacyRank:
    """One model-parallel rank's file: its tensors under ucl's local names."""
    rel: str
    tf: TorchFile
    pp: int
    tp: int
    tensors: dict[str, TensorRef] = field(default_factory=dict)  # ucl local name -> tensor
    origin: dict[str, str] = field(default_factory=dict)  # ucl local name -> the file's name (model key + name)


@dataclass(frozen=True)
class Naming:
    """How the files name the tensors, and how ucl's names follow from them."""
    spec_name: str
    layer_prefix: str
    embedding: str
    tied_copy: str  # the tied embedding's name on the last stage
    chunk: int  # layers per virtual chunk
    vpp: int
    pp: int
    tied: bool

    def global_name(self, local: str, pp_rank: int) -> str:
        if not local.startswith(self.layer_prefix):
            return local
        num, _, rest = local[len(self.layer_prefix):].partition(".")
        c, j = divmod(int(num), self.chunk)  # ucl's local numbering: chunk-major on the rank
        return f"{self.layer_prefix}{(c * self.pp + pp_rank) * self.chunk + j}.{rest}"


def describe(path: str) -> Description:
    lf = _locate(path)
    files = _rank_files(lf)
    modules = [_modules(rk, lf.args) for rk in files]
    spec_name, layer_prefix, embedding, tied_copy = which_spec(modules)
    base = load_spec(spec_name)
    dims = dims_from_args(lf.args, base)
    vpp = dims.get("vpp", 1)
    if dims["layers"] % (lf.pp * vpp):
        raise ForeignFormatError(f"{lf.folder}: num_layers={dims['layers']} is not a multiple of pipeline stages x virtual "
                                 f"stages ({lf.pp} x {vpp}); {spec_name} describes even blocks of layers only")
    naming = Naming(spec_name, layer_prefix, embedding, tied_copy, dims["layers"] // (lf.pp * vpp), vpp, lf.pp,
                    not dims["untied"])
    ranks = [_local_names(rk, chunks, naming) for rk, chunks in zip(files, modules)]
    params, stored = _params(lf, ranks, naming, base, dims)
    spec_text, spec = with_dtypes(base, spec_name, dims, params, stored, lf.path)
    present, optim_files = _optim_files(lf, ranks, naming, dims)
    frozen = () if present else tuple(params)
    try:
        model = spec.bind(dims, params, frozen=frozen)
        mesh = Mesh((("pp", lf.pp), ("tp", lf.tp)))
        shard_map = lower(model, mesh)
    except UclError as e:
        raise ForeignFormatError(f"{lf.path}: the tensors of the Megatron-LM files do not fit {spec_name} with the dims of "
                                 f"args ({', '.join(f'{k}={v}' for k, v in dims.items())}):\n{e}") from None
    extents = _extents(lf, ranks, naming, params, mesh, shard_map, optim_files if present else None)
    state = {"format": "megatron-legacy", "megatron": _state(lf, ranks, dims)}
    if present:
        state["megatron"].update(weights_only=False, optimizer=plain(lf.head.get("optimizer"), where=lf.first.path),
                                 distrib_optim=f"{len(present)} {DISTRIB_OPTIM} file(s), read in place")
    by_rank = {(rk.pp, rk.tp): rk.rel for rk in ranks}
    files = tuple(by_rank[(c["pp"], c["tp"])] for c in map(mesh.coords, range(mesh.size)))
    read = ((TRACKER,) if lf.tracker is not None else ()) + files + tuple(present)
    return Description("megatron-legacy", spec_text, spec_name, dims, (("pp", lf.pp), ("tp", lf.tp)), params,
                       frozen, extents, files, state, read)


def _locate(path: str) -> LegacyFolder:
    path = os.path.abspath(path)
    found = _iteration_folder(path) if os.path.isdir(path) else None
    if found is None:
        raise StoreError(f"{path} is not a Megatron-LM checkpoint (no {TRACKER} naming a folder with "
                         f"mp_rank_*/{MODEL_FILE}, and not such an iteration folder)", code="UCL501")
    sub, tracker = found
    folder = os.path.join(path, sub)
    first = read_torch_file(os.path.join(folder, _rank0_file(folder)), inside=path)
    head = _dict(first.obj, _rank0_file(folder))
    args = _args(head, _rank0_file(folder))
    tp, pp = int_arg(args, "tensor_model_parallel_size", 1), int_arg(args, "pipeline_model_parallel_size", 1)
    _refuse_unsupported(args, head, folder)
    if tp < 1 or pp < 1:
        raise ForeignFormatError(f"{folder}: args give tensor_model_parallel_size={tp}, pipeline_model_parallel_size={pp}")
    return LegacyFolder(path, sub, tracker, first, head, args, tp, pp)


def _rank_files(lf: LegacyFolder) -> list[LegacyRank]:
    """The rank files Megatron-LM names from args; never inferred from the folder listing."""
    folder, tp, pp = lf.folder, lf.tp, lf.pp
    present = sorted(n for n in os.listdir(folder) if _RANK_DIR.match(n))
    if tp * pp != len(present):  # before anything per rank is named: args may say 10**10 ranks
        raise ForeignFormatError(f"{folder}: args say tensor_model_parallel_size={tp:,}, pipeline_model_parallel_size="
                                 f"{pp:,} ({tp * pp:,} rank folders), the folder holds {len(present):,} mp_rank_* "
                                 f"folder(s) ({', '.join(present[:4])}); the folder contradicts its args")
    names = {(p, t): _rank_dir(t, p, pp) for p in range(pp) for t in range(tp)}
    missing = [n for n in names.values() if not os.path.isfile(os.path.join(folder, n, MODEL_FILE))]
    if missing:
        raise ForeignFormatError(f"{folder}: args say tensor_model_parallel_size={tp}, pipeline_model_parallel_size={pp}, "
                     f"but {len(missing)} rank file(s) are missing: "
                     + ", ".join(f"{n}/{MODEL_FILE}" for n in missing[:8]))
    stray = sorted(n for n in os.listdir(folder) if _RANK_DIR.match(n) and n not in names.values())
    if stray:
        raise ForeignFormatError(f"{folder} holds {', '.join(stray[:8])}, which a run with tensor_model_parallel_size={tp}, "
                     f"pipeline_model_parallel_size={pp} does not write; the folder contradicts its args")
    ranks = []
    for (p, t), n in sorted(names.items()):
        r = lf.rel(n, MODEL_FILE)
        tf = lf.first if n == os.path.dirname(_rank0_file(folder)) else read_torch_file(os.path.join(lf.path, r),
                                                                                        inside=lf.path)
        ranks.append(LegacyRank(r, tf, p, t))
    return ranks


def _params(lf: LegacyFolder, ranks: list[LegacyRank], naming: Naming, base: Spec,
            dims: dict) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
    """(global name -> the shape the spec declares, in model order: embeddings, the layers in
    global order, the head; global name -> its stored dtype)."""
    order: dict[str, tuple[int, ...]] = {}
    stored: dict[str, str] = {}
    for rk in sorted(ranks, key=lambda r: (r.pp, r.tp)):
        for local, ref in rk.tensors.items():
            name = naming.global_name(local, rk.pp)
            if not _NAME.match(name):
                raise ForeignFormatError(f"{rk.rel}: tensor name {name[:200]!r} cannot be written in a spec")
            if stored.setdefault(name, ref.dtype) != ref.dtype:
                raise ForeignFormatError(f"{name} is stored as {stored[name]} in one rank file and {ref.dtype} in {rk.rel}")
            order.setdefault(name, tuple(ref.shape))
    first_seen = {n: i for i, n in enumerate(order)}
    prefix = naming.layer_prefix

    def rank_in_model(name: str) -> tuple:
        if name.startswith(prefix):
            return (1, int(name[len(prefix):].partition(".")[0]), first_seen[name])
        return (0 if name.startswith(naming.embedding.rsplit(".", 2)[0]) else 2, 0, first_seen[name])
    params = global_shapes(base, dims, {n: order[n] for n in sorted(order, key=rank_in_model)})
    if dims["vocab"] % (128 * lf.tp):
        # the stdlib specs pad the vocabulary to a multiple of 128 * tp (Megatron's default
        # --make-vocab-size-divisible-by); another multiple would be misplaced rows, not padding
        raise ForeignFormatError(f"{lf.folder}: padded_vocab_size={dims['vocab']} is not a multiple of 128 x tp "
                                 f"({128 * lf.tp}) (make_vocab_size_divisible_by="
                                 f"{lf.args.get('make_vocab_size_divisible_by')!r}); {naming.spec_name} pads the "
                                 "vocabulary to multiple_of(128 * tp) and cannot describe this padding")
    return params, stored


def _optim_files(lf: LegacyFolder, ranks: list[LegacyRank], naming: Naming,
                 dims: dict) -> tuple[list[str], dict[tuple[int, int], str]]:
    """--use-distributed-optimizer: (the distrib_optim.pt files present, each rank's) (see legacy_optim)."""
    optim_files = {(rk.pp, rk.tp): os.path.join(os.path.dirname(rk.rel), DISTRIB_OPTIM) for rk in ranks}
    present = [f for f in optim_files.values() if os.path.isfile(os.path.join(lf.path, f))]
    if present and len(present) != len(optim_files):
        raise ForeignFormatError(f"{lf.folder}: {len(present)} of the {len(optim_files)} rank folders hold {DISTRIB_OPTIM}")
    if present:
        optim.refuse_unsupported(lf.args, lf.folder, naming.vpp, lf.pp, not dims.get("untied", 1), naming.spec_name)
    return present, optim_files


def _extents(lf: LegacyFolder, ranks: list[LegacyRank], naming: Naming, params: dict, mesh: Mesh, shard_map,
             optim_files: dict[tuple[int, int], str] | None) -> tuple[dict[str, Extent], ...]:
    """Per rank of ``mesh``, every dataset the lowering puts there: a tensor of its file, or with
    ``optim_files`` a flat buffer of its distrib_optim.pt. Any disagreement is an error."""
    extents: list[dict[str, Extent]] = []
    problems: list[str] = []
    by_rank = {(rk.pp, rk.tp): rk for rk in ranks}
    spec_name = naming.spec_name
    for r in range(mesh.size):
        c = mesh.coords(r)
        rk = by_rank[(c["pp"], c["tp"])]
        table: dict[str, Extent] = {}
        left = dict(rk.tensors)
        if optim_files is not None:
            position = {n: i for i, n in enumerate(params)}
            held = sorted(rk.tensors, key=lambda n: position[naming.global_name(n, rk.pp)])
            buffers, _ = optim.read(lf.path, optim_files[(rk.pp, rk.tp)], [rk.tensors[n].numel for n in held], lf.args)
        for key, (shape, dtype) in sorted(shard_map.rank_datasets(r).items()):
            kind, _, local = key.partition("/")
            mkind = next((m for m, k in optim.KINDS.items() if k == kind), None)
            if optim_files is not None and local == "@flat0" and mkind is not None:
                tf, t = buffers[mkind]
                table[key] = optim.extent(optim_files[(rk.pp, rk.tp)], tf, t, shape[0])
                continue
            ref = left.pop(local, None) if kind == "param" else None
            if ref is None:
                problems.append(f"{rk.rel} lacks {local!r} {list(shape)} {dtype}, which {spec_name} puts on that rank")
            elif tuple(ref.shape) != tuple(shape) or ref.dtype != dtype:
                problems.append(f"{rk.rel}: {rk.origin[local]} is {list(ref.shape)} {ref.dtype}, but {spec_name} "
                                f"makes {local!r} {list(shape)} {dtype} on that rank")
            else:
                table[key] = Extent(rk.rel, rk.tf.byte_offset(ref), ref.dtype, tuple(ref.shape))
        problems += [f"{rk.rel} holds {rk.origin[n]} {list(t.shape)}, which {spec_name} does not place on that rank"
                     for n, t in left.items()]
        extents.append(table)
    if problems:
        raise ForeignFormatError(f"{lf.path}: the Megatron-LM files disagree with {spec_name} ({len(problems)} problem"
                     f"{'s' * (len(problems) != 1)}):\n  " + "\n  ".join(problems[:8]))
    return tuple(extents)


def _dict(obj: Any, where: str) -> dict:
    if not isinstance(obj, dict):
        raise ForeignFormatError(f"{where} holds a {type(obj).__name__}, not the dict Megatron-LM saves")
    return obj


def _args(head: dict, where: str) -> dict:
    args = head.get("args")
    if not isinstance(args, Record) or args.cls != "argparse.Namespace" or not isinstance(args.state, dict):
        raise ForeignFormatError(f"{where} has no 'args' (the run's argparse.Namespace); without it the layout is unknown")
    return args.state


def _refuse_unsupported(args: dict, head: dict, folder: str) -> None:
    if int_arg(args, "expert_model_parallel_size", 1) > 1:
        raise ForeignFormatError(f"{folder}: expert-parallel checkpoints (expert_model_parallel_size="
                     f"{args['expert_model_parallel_size']}, files mp_rank_TT[_PPP]_EEE) are not read yet")
    uneven = [k for k in ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
                          "pipeline_model_parallel_layout") if args.get(k) is not None]
    uneven += [k for k in ("account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split")
               if args.get(k)]
    if uneven:
        raise ForeignFormatError(f"{folder}: the pipeline stages hold uneven blocks of layers ({', '.join(uneven)} set); the "
                     "stdlib Megatron specs describe even blocks only")
    version = head.get("checkpoint_version", 0)
    if not isinstance(version, (int, float)) or version < 2.0:
        # versions 0 and 1.0 order the fused QKV rows differently (Megatron converts them on load)
        raise ForeignFormatError(f"{folder}: checkpoint_version {version!r} stores query_key_value in an older order; "
                     "load and save it once with Megatron-LM (checkpoint_version >= 2.0) first")


def _modules(rk: LegacyRank, args: dict) -> list[dict[str, Any]]:
    """The rank's module state dicts, one per virtual chunk, flattened."""
    obj = _dict(rk.tf.obj, rk.rel)
    sub = _args(obj, rk.rel)
    for k in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "num_layers", "hidden_size"):
        if sub.get(k) != args.get(k):
            raise ForeignFormatError(f"{rk.rel}: args.{k} is {sub.get(k)!r}, the rank-0 file says {args.get(k)!r}")
    if "model" in obj:
        keys = ["model"]
    else:
        keys = sorted((k for k in obj if isinstance(k, str) and re.fullmatch(r"model\d+", k)), key=lambda k: int(k[5:]))
        if not keys or keys != [f"model{i}" for i in range(len(keys))]:
            raise ForeignFormatError(f"{rk.rel} has no 'model' (or model0, model1, ...) state dict: saved without the model?")
    out = []
    for k in keys:
        flat: dict[str, Any] = {}
        _flatten(_dict(obj[k], f"{rk.rel}: {k}"), "", flat)
        for name, v in flat.items():
            if not name.endswith(_EXTRA) and not isinstance(v, TensorRef):
                raise ForeignFormatError(f"{rk.rel}: {k}[{name!r}] is a {type(v).__name__}, not a tensor")
        out.append({n: v for n, v in flat.items() if not n.endswith(_EXTRA)})
    return out


def _local_names(rk: LegacyRank, chunks: list[dict], naming: Naming) -> LegacyRank:
    """``rk`` with its tensors under ucl's local names (stage-local layers, chunk-major)."""
    vpp, chunk, layer_prefix = naming.vpp, naming.chunk, naming.layer_prefix
    if len(chunks) != vpp:
        raise ForeignFormatError(f"{rk.rel} holds {len(chunks)} model chunk(s), args say {vpp} virtual pipeline stage(s)")
    layer = re.compile(re.escape(layer_prefix) + r"(\d+)\.")
    tensors: dict[str, TensorRef] = {}
    origin: dict[str, str] = {}
    for c, chunk_sd in enumerate(chunks):
        key = "model" if vpp == 1 else f"model{c}"
        for name, ref in chunk_sd.items():
            local = name
            m = layer.match(name)
            if m:
                j = int(m.group(1))
                if j >= chunk:
                    raise ForeignFormatError(f"{rk.rel}: {key}[{name!r}]: a stage holds {chunk} layer(s) per chunk")
                local = f"{layer_prefix}{c * chunk + j}.{name[m.end():]}"
            elif naming.tied and name == naming.tied_copy and not (rk.pp == 0 and c == 0):
                local = naming.embedding  # the tied embedding's copy on the last stage
            if local in tensors:
                raise ForeignFormatError(f"{rk.rel}: {key}[{name!r}] and {origin[local]} are the same tensor {local!r}")
            tensors[local], origin[local] = ref, f"{key}[{name!r}]"
    return replace(rk, tensors=tensors, origin=origin)


def _state(lf: LegacyFolder, ranks: list[LegacyRank], dims: dict) -> dict:
    head, args, sub = lf.head, lf.args, lf.sub
    out: dict[str, Any] = {
        "iteration": head.get("iteration"), "checkpoint_version": head.get("checkpoint_version"),
        "release": sub == "release" or lf.tracker == "release", "folder": sub or None,
        "args": plain(args, where=lf.first.path), "vocab_size": args.get("vocab_size"), "padded_vocab_size": dims.get("vocab"),
        "weights_only": True,
    }
    for k, v in head.items():
        if k in ("args", "model", "iteration", "checkpoint_version") or re.fullmatch(r"model\d+", str(k)):
            continue
        if k == "rng_state":
            out[k] = "saved per rank (not read)"
        elif k == "optimizer":
            out[k] = "saved (not read: ucl reads the weights of legacy checkpoints)"
        else:
            out[str(k)] = plain(v, where=lf.first.path)
    optim = [rk.rel for rk in ranks if os.path.isfile(os.path.join(lf.path, os.path.dirname(rk.rel), DISTRIB_OPTIM))]
    if optim:
        out["distrib_optim"] = f"{len(optim)} {DISTRIB_OPTIM} file(s), not read"
    return out
