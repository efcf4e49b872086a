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
from typing import Any

from ...errors import ForeignFormatError, StoreError, UclError
from ...files import read_bounded
from ...lang.expr import ExprError, evaluate_extent, evaluate_lets
from ...lang.spec import Spec, load_spec
from ...layout.lower import lower
from ...layout.mesh import Mesh
from ...store.extents import Extent
from . import legacy_optim as optim
from ..base import Description
from ..torchzip.read import Record, TensorRef, TorchFile, plain, read_torch_file

TRACKER = "latest_checkpointed_iteration.txt"
MODEL_FILE = "model_optim_rng.pt"
DISTRIB_OPTIM = optim.DISTRIB_OPTIM
_RANK_DIR = re.compile(r"^mp_rank_\d+(_\d+){0,2}$")
_NAME = re.compile(r"^[A-Za-z0-9_][\w\-]*(\.[\w\-]+)*$")  # names the spec language can spell
_EXTRA = "._extra_state"
_MAX_TRACKER = 4096
# per spec: the layer prefix, the embedding, and the tied embedding's name on the last stage
_CORE = ("stdlib:megatron_gpt", "decoder.layers.", "embedding.word_embeddings.weight", "output_layer.weight")
_LEGACY = ("stdlib:megatron_legacy_gpt", "language_model.encoder.layers.",
           "language_model.embedding.word_embeddings.weight", "word_embeddings_for_head.weight")



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


def _arg(args: dict, name: str, default: Any = None) -> Any:
    v = args.get(name, default)
    return default if v is None else v


def _int_arg(args: dict, name: str, default: int | None = None) -> int:
    v = _arg(args, name, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ForeignFormatError(f"args.{name} is {v!r}: not a usable whole number")
    return v


def dims_from_args(args: dict, spec: Spec) -> dict[str, int]:
    """The spec's dims from Megatron-LM's argument names (as ``validate_args`` leaves them)."""
    heads, hidden = _int_arg(args, "num_attention_heads"), _int_arg(args, "hidden_size")
    layers, pp = _int_arg(args, "num_layers"), _int_arg(args, "pipeline_model_parallel_size", 1)
    vpp = _arg(args, "virtual_pipeline_model_parallel_size")
    if vpp is None and _arg(args, "num_layers_per_virtual_pipeline_stage") is not None:
        vpp = layers // max(1, pp * _int_arg(args, "num_layers_per_virtual_pipeline_stage"))
    experts = _int_arg(args, "num_experts", 0)
    ffn = _int_arg(args, "ffn_hidden_size")
    dims = {
        "vocab": _int_arg(args, "padded_vocab_size"),  # the stored rows (see the module doc)
        "hidden": hidden, "heads": heads,
        # num_query_groups counts only with group_query_attention (it defaults to 1 otherwise)
        "kv_heads": _int_arg(args, "num_query_groups") if _arg(args, "group_query_attention", False) else heads,
        "head_dim": _int_arg(args, "kv_channels", hidden // heads if heads else 0),
        "ffn": ffn, "swiglu": int(bool(_arg(args, "swiglu", False))), "layers": layers,
        "vpp": int(vpp or 1), "experts": experts,
        "moe_ffn": _int_arg(args, "moe_ffn_hidden_size", ffn if experts else 0),
        "shared_ffn": _int_arg(args, "moe_shared_expert_intermediate_size", 0),
        "untied": int(bool(_arg(args, "untie_embeddings_and_output_weights", False))),
    }
    return {d: dims[d] for d in spec.dims if d in dims}


def _flatten(obj: Any, prefix: str, out: dict[str, Any]) -> None:
    """A (legacy: nested) module state dict as ``dotted.name -> value``."""
    for k, v in obj.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict) and not name.endswith(_EXTRA):
            _flatten(v, name + ".", out)
        else:
            out[name] = v


class _Rank:
    """One model-parallel rank's file: its tensors under ucl's local names."""

    def __init__(self, rel: str, tf: TorchFile, pp_rank: int, tp_rank: int):
        self.rel, self.tf, self.pp, self.tp = rel, tf, pp_rank, tp_rank
        self.tensors: dict[str, TensorRef] = {}  # ucl local name -> tensor
        self.origin: dict[str, str] = {}  # ucl local name -> the file's name (model key + name)


def describe(path: str) -> Description:
    path = os.path.abspath(path)
    found = _iteration_folder(path) if os.path.isdir(path) else None
    if found is None:
        raise StoreError(f"{path} is not a Megatron-LM checkpoint (no {TRACKER} naming a folder with "
                         f"mp_rank_*/{MODEL_FILE}, and not such an iteration folder)", code="UCL501")
    sub, tracker = found
    folder = os.path.join(path, sub)
    rel = lambda *p: os.path.join(sub, *p) if sub else os.path.join(*p)  # noqa: E731
    first = read_torch_file(os.path.join(folder, _rank0_file(folder)), inside=path)
    head = _dict(first.obj, _rank0_file(folder))
    args = _args(head, _rank0_file(folder))
    tp, pp = _int_arg(args, "tensor_model_parallel_size", 1), _int_arg(args, "pipeline_model_parallel_size", 1)
    _refuse_unsupported(args, head, folder)
    if tp < 1 or pp < 1:
        raise ForeignFormatError(f"{folder}: args give tensor_model_parallel_size={tp}, pipeline_model_parallel_size={pp}")

    # the rank files Megatron-LM names from args; never inferred from the folder listing
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
    ranks: list[_Rank] = []
    for (p, t), n in sorted(names.items()):
        r = rel(n, MODEL_FILE)
        tf = first if n == os.path.dirname(_rank0_file(folder)) else read_torch_file(os.path.join(path, r), inside=path)
        ranks.append(_Rank(r, tf, p, t))

    modules = {rk: _modules(rk, args) for rk in ranks}
    spec_name, layer_prefix, embedding, tied_copy = _which_spec(modules)
    base = load_spec(spec_name)
    dims = dims_from_args(args, base)
    vpp = dims.get("vpp", 1)
    if dims["layers"] % (pp * vpp):
        raise ForeignFormatError(f"{folder}: num_layers={dims['layers']} is not a multiple of pipeline stages x virtual stages "
                     f"({pp} x {vpp}); {spec_name} describes even blocks of layers only")
    chunk = dims["layers"] // (pp * vpp)
    for rk in ranks:
        _local_names(rk, modules[rk], layer_prefix, chunk, vpp, pp, embedding, tied_copy, not dims["untied"])

    # global names (model order) and the shapes the spec declares for them
    order: dict[str, tuple[int, ...]] = {}
    stored: dict[str, str] = {}
    for rk in sorted(ranks, key=lambda r: (r.pp, r.tp)):
        for local, ref in rk.tensors.items():
            name = _global_name(local, layer_prefix, rk.pp, chunk, pp)
            if not _NAME.match(name):
                raise ForeignFormatError(f"{rk.rel}: tensor name {name[:200]!r} cannot be written in a spec")
            if stored.setdefault(name, ref.dtype) != ref.dtype:
                raise ForeignFormatError(f"{name} is stored as {stored[name]} in one rank file and {ref.dtype} in {rk.rel}")
            order.setdefault(name, tuple(ref.shape))
    # model order: embeddings, then the layers in global order, then the head
    first_seen = {n: i for i, n in enumerate(order)}

    def rank_in_model(name: str) -> tuple:
        if name.startswith(layer_prefix):
            return (1, int(name[len(layer_prefix):].partition(".")[0]), first_seen[name])
        return (0 if name.startswith(embedding.rsplit(".", 2)[0]) else 2, 0, first_seen[name])
    params = _global_shapes(base, dims, {n: order[n] for n in sorted(order, key=rank_in_model)})
    if dims["vocab"] % (128 * tp):
        # the stdlib specs pad the vocabulary to a multiple of 128 * tp (Megatron's default
        # --make-vocab-size-divisible-by); another multiple would be misplaced rows, not padding
        raise ForeignFormatError(f"{folder}: padded_vocab_size={dims['vocab']} is not a multiple of 128 x tp ({128 * tp}) "
                     f"(make_vocab_size_divisible_by={args.get('make_vocab_size_divisible_by')!r}); {spec_name} "
                     "pads the vocabulary to multiple_of(128 * tp) and cannot describe this padding")
    spec_text, spec = _with_dtypes(base, spec_name, dims, params, stored, path)
    # --use-distributed-optimizer: each rank's distrib_optim.pt (see megatron_legacy_optim)
    optim_files = {(rk.pp, rk.tp): os.path.join(os.path.dirname(rk.rel), DISTRIB_OPTIM) for rk in ranks}
    present = [f for f in optim_files.values() if os.path.isfile(os.path.join(path, f))]
    if present and len(present) != len(optim_files):
        raise ForeignFormatError(f"{folder}: {len(present)} of the {len(optim_files)} rank folders hold {DISTRIB_OPTIM}")
    if present:
        optim.refuse_unsupported(args, folder, vpp, pp, not dims.get("untied", 1), spec_name)
    frozen = () if present else tuple(params)
    try:
        model = spec.bind(dims, params, frozen=frozen)
        mesh = Mesh((("pp", pp), ("tp", tp)))
        shard_map = lower(model, mesh)
    except UclError as e:
        raise ForeignFormatError(f"{path}: the tensors of the Megatron-LM files do not fit {spec_name} with the dims of args "
                     f"({', '.join(f'{k}={v}' for k, v in dims.items())}):\n{e}") from None

    extents: list[dict[str, Extent]] = []
    files: list[str] = []
    problems: list[str] = []
    by_rank = {(rk.pp, rk.tp): rk for rk in ranks}
    for r in range(mesh.size):
        c = mesh.coords(r)
        rk = by_rank[(c["pp"], c["tp"])]
        table: dict[str, Extent] = {}
        left = dict(rk.tensors)
        if present:
            position = {n: i for i, n in enumerate(params)}
            held = sorted(rk.tensors, key=lambda n: position[_global_name(n, layer_prefix, rk.pp, chunk, pp)])
            buffers, _ = optim.read(path, optim_files[(rk.pp, rk.tp)], [rk.tensors[n].numel for n in held], args)
        for key, (shape, dtype) in sorted(shard_map.rank_datasets(r).items()):
            kind, _, local = key.partition("/")
            mkind = next((m for m, k in optim.KINDS.items() if k == kind), None)
            if present and local == "@flat0" and mkind is not None:
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
        files.append(rk.rel)
    if problems:
        raise ForeignFormatError(f"{path}: the Megatron-LM files disagree with {spec_name} ({len(problems)} problem"
                     f"{'s' * (len(problems) != 1)}):\n  " + "\n  ".join(problems[:8]))

    state = {"format": "megatron-legacy", "megatron": _state(head, args, sub, tracker, path, ranks, dims)}
    if present:
        state["megatron"].update(weights_only=False, optimizer=plain(head.get("optimizer")),
                                 distrib_optim=f"{len(present)} {DISTRIB_OPTIM} file(s), read in place")
    read = ((TRACKER,) if tracker is not None else ()) + tuple(files) + tuple(present)
    return Description("megatron-legacy", spec_text, spec_name, dims, (("pp", pp), ("tp", tp)), params,
                       frozen, tuple(extents), tuple(files), state, read)


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
    if _int_arg(args, "expert_model_parallel_size", 1) > 1:
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


def _modules(rk: _Rank, args: dict) -> list[dict[str, Any]]:
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


def _which_spec(modules: dict) -> tuple[str, str, str, str]:
    names = {n for chunks in modules.values() for m in chunks for n in m}
    if any(n.startswith("language_model.") for n in names):
        return _LEGACY
    if any(n.startswith(("decoder.", "embedding.")) for n in names):
        return _CORE
    sample = sorted(names)[:3]
    raise ForeignFormatError(f"the module state dicts hold neither megatron-core GPTModel names (decoder.layers...) nor legacy "
                 f"GPT names (language_model...); e.g. {sample}")


def _local_names(rk: _Rank, chunks: list[dict], layer_prefix: str, chunk: int, vpp: int, pp: int,
                 embedding: str, tied_copy: str, tied: bool) -> None:
    if len(chunks) != vpp:
        raise ForeignFormatError(f"{rk.rel} holds {len(chunks)} model chunk(s), args say {vpp} virtual pipeline stage(s)")
    layer = re.compile(re.escape(layer_prefix) + r"(\d+)\.")
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
            elif tied and name == tied_copy and not (rk.pp == 0 and c == 0):
                local = embedding  # the tied embedding's copy on the last stage
            if local in rk.tensors:
                raise ForeignFormatError(f"{rk.rel}: {key}[{name!r}] and {rk.origin[local]} are the same tensor {local!r}")
            rk.tensors[local], rk.origin[local] = ref, f"{key}[{name!r}]"


def _global_name(local: str, layer_prefix: str, pp_rank: int, chunk: int, pp: int) -> str:
    if not local.startswith(layer_prefix):
        return local
    num, _, rest = local[len(layer_prefix):].partition(".")
    c, j = divmod(int(num), chunk)  # ucl's local numbering: chunk-major on the rank
    return f"{layer_prefix}{(c * pp + pp_rank) * chunk + j}.{rest}"


def _global_shapes(spec: Spec, dims: dict, local: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """Each tensor's global shape: the one its rule declares; a rule declaring none replicates it
    (the stdlib Megatron specs declare a shape wherever they split), so the stored one. The
    lowering then proves every rank's stored shape."""
    env, _ = evaluate_lets(spec.checked.lets, dims)
    out = {}
    for name, shape in local.items():
        rules = [r for r in spec.checked.rules if r.pattern.match(name)]
        if len(rules) != 1 or rules[0].shape is None:
            out[name] = shape  # no rule or several: bind names the problem
            continue
        try:
            out[name] = tuple(evaluate_extent(e, env, f"dim {d} of {name}") for d, e in enumerate(rules[0].shape))
        except ExprError:
            out[name] = shape  # bind reports the broken expression at its span
    return out


def _with_dtypes(base: Spec, spec_name: str, dims: dict, params: dict, stored: dict, path: str) -> tuple[str, Spec]:
    """The spec text plus ``state param for ... : dtype`` lines for tensors stored in another dtype
    than the spec gives them (fp32 or fp16 runs; fp32 norms in a bf16 model)."""
    try:
        declared = {t.name: t.dtype for t in base.bind(dims, params, frozen=tuple(params)).tensors}
    except UclError as e:
        raise ForeignFormatError(f"{path}: the tensors of the Megatron-LM files do not fit {spec_name} with the dims of args "
                     f"({', '.join(f'{k}={v}' for k, v in dims.items())}):\n{e}") from None
    other: dict[str, list[str]] = {}
    for name, dtype in stored.items():
        if declared.get(name) != dtype:
            other.setdefault(dtype, []).append(name)
    if not other:
        return base.text, base
    lines = ["# added by ucl: the dtypes the Megatron-LM files hold"]
    if len(other) == 1 and sum(map(len, other.values())) == len(stored):
        lines.append(f"state param for ** : dtype {next(iter(other))}")  # one dtype throughout (fp32, fp16 runs)
    else:
        for dtype, names in sorted(other.items()):
            lines.append(f"state param for {' | '.join(names)}\n    : dtype {dtype}")
    text = base.text.rstrip("\n") + "\n" + "\n".join(lines) + "\n"
    return text, Spec.from_text(text, filename=f"{path} [{spec_name} + dtypes]", name=spec_name)


def _state(head: dict, args: dict, sub: str, tracker: str | None, path: str, ranks: list[_Rank], dims: dict) -> dict:
    out: dict[str, Any] = {
        "iteration": head.get("iteration"), "checkpoint_version": head.get("checkpoint_version"),
        "release": sub == "release" or tracker == "release", "folder": sub or None,
        "args": plain(args), "vocab_size": args.get("vocab_size"), "padded_vocab_size": dims.get("vocab"),
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
            out[str(k)] = plain(v)
    optim = [rk.rel for rk in ranks if os.path.isfile(os.path.join(path, os.path.dirname(rk.rel), DISTRIB_OPTIM))]
    if optim:
        out["distrib_optim"] = f"{len(optim)} {DISTRIB_OPTIM} file(s), not read"
    return out
