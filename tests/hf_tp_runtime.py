"""A drafted TP layout against a TP runtime (issue #29, item 4): the layout `ucl spec from-hf` derives
for ``tp=2`` is turned into DTensor placements, the tiny seeded model is parallelized with
``parallelize_module`` on two gloo processes, and

- each rank's local shard of every parameter (torch's ``distribute_tensor`` of the full tensor) must
  equal the rank's dataset from ucl's own lowering of the draft (``ucl.compile`` + ``execute_memory``);
- the parallelized model's logits must equal the unsharded model's: the runtime computes with the
  local shards (column-parallel outputs stay local, heads per rank, row-parallel outputs all-reduced),
  so a fused q/k/v split in the wrong order gives wrong logits.

Placements come from the compiled layout, not from a table: lowering a tensor whose elements are
their own flat indices says which global indices each rank holds. A split that is one contiguous
``torch.chunk`` block per rank is ``Shard(d)`` of the parameter itself; a split that takes several
blocks per rank (``[Q; K; V]`` part by part, packed ``[gate; up]``) or repeats some (a multi-query
K/V head on every rank) is ``Shard(d)`` of the rank-ordered concatenation of those blocks, i.e. of
the parameter with its rows taken in the order the ranks hold them (Megatron's fused tensors).

What stays a per-family table is the runtime's side: the attributes a TP runtime keeps per rank
(head counts, split sizes) and the ALiBi slopes it slices by head."""
from __future__ import annotations

import os
import re
import socket
import sys
import warnings
from dataclasses import dataclass

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
import hf_zoo as Z  # noqa: E402

TP = 2
# model type -> attributes of attention (and expert) modules that a TP runtime keeps per rank (divided by
# tp); ``Class.attr`` only on modules of that class
LOCAL_ATTRS = {
    "llama": (), "qwen2_moe": (), "mixtral": (),
    "gpt2": ("num_heads", "split_size", "embed_dim"),
    "opt": ("num_heads", "embed_dim"),
    "gpt_bigcode": ("num_heads", "embed_dim", "num_key_value_groups"),
    "stablelm": ("num_heads", "num_key_value_heads", "hidden_size"),
    "bloom": ("num_heads", "hidden_size"),
    "falcon": ("num_heads", "num_kv_heads"),
    "mpt": ("n_heads", "hidden_size"),
    "gpt_neox": ("num_attention_heads", "hidden_size"),
    "phi3": (),  # transformers gathers qkv_proj's output: every rank runs all heads
    "jetmoe": ("hidden_size",),
    "openai-gpt": ("n_head", "split_size"),
    "lfm3": (), "kimi_linear": ("KimiLinearDeltaAttention.qkv_dim",),
    "dbrx": ("num_heads", "num_key_value_heads", "DbrxAttention.hidden_size", "DbrxExperts.ffn_hidden_size"),  # the mixture of attention heads' query width (JetMoeMoA)
}
FAMILIES = tuple(LOCAL_ATTRS)
_STATES = {"exp_avg", "exp_avg_sq", "step"}


@dataclass(frozen=True)
class Placement:
    """How ``tp`` ranks hold one parameter: ``dim`` None is replicated; else ``Shard(dim)`` of the
    parameter with dim ``dim`` taken in ``order`` (None: the parameter itself, a plain chunk)."""

    dim: int | None
    order: tuple[int, ...] | None = None


def ucl_layout(model_type: str, seed: int = 0):
    """(config, {param name: Placement}, {rank: {param name: local array}}) of the drafted spec on tp=2."""
    import torch
    import ucl
    from ucl.dtypes import storage_dtype
    from ucl.formats.hf import draft_spec_from_hf
    cfg = config(model_type)
    model = build(cfg, seed)
    spec = ucl.load_spec(draft_spec_from_hf(cfg))
    shapes, bufs = Z.state_shapes(model)
    bound = spec.bind(spec.dims_from_config(cfg.to_dict()), shapes, frozen=bufs)
    plan = ucl.compile(bound, ucl.UNIVERSAL, f"tp={TP}")
    params = {n: p.detach().numpy() for n, p in model.named_parameters()}
    with torch.no_grad():
        state = {k: v.numpy() for k, v in model.state_dict().items()}

    def lowered(values):
        src = {}
        for t in bound.tensors:  # the parameters' values; optimizer states (not compared) zero
            v = values.get(t.name) if t.kind == "param" else None
            v = state.get(t.name) if v is None and t.kind not in _STATES else v
            src[t.key] = np.ascontiguousarray(v) if v is not None else np.zeros(t.shape, storage_dtype(t.dtype))
        out = ucl.execute_memory(plan, {0: src})
        return {r: {n: out[r][f"param/{n}"] for n in params if f"param/{n}" in out[r]} for r in range(TP)}

    index = {n: np.arange(v.size, dtype=np.float32).reshape(v.shape) for n, v in params.items()}
    assert all(v.size < 1 << 24 for v in params.values())  # flat indices exact in float32
    held = lowered(index)
    placements = {}
    for n in params:
        try:
            placements[n] = placement(index[n], [held[r][n].astype(np.int64) for r in range(TP)])
        except AssertionError as e:
            raise AssertionError(f"{n}: {e}") from None
    return cfg, placements, lowered(params)


def config(model_type: str):
    """The sweep's tiny config, with what its forward needs to run (dbrx's default ``clip_qkv`` None
    fails in ``clamp``: a bound that the tiny model's activations never reach)."""
    cfg = Z.tiny_config(model_type)
    if model_type == "dbrx":
        cfg.attn_config.clip_qkv = 1e4
    return cfg


def placement(full_index: np.ndarray, local: list[np.ndarray]) -> Placement:
    """The placement that gives each rank ``local[r]`` (global flat indices) of a tensor."""
    shape = full_index.shape
    if all(x.shape == shape and np.array_equal(x, full_index) for x in local):
        return Placement(None)
    dims = {d for x in local for d in range(len(shape)) if x.shape[d] != shape[d]}
    if len(dims) != 1 or any(x.ndim != len(shape) for x in local):
        raise AssertionError(f"not a split of one dim: global {shape}, local {[x.shape for x in local]}")
    (d,) = dims
    picks = []
    for x in local:
        coord = np.unravel_index(x, shape)[d]
        sel = coord[tuple(slice(None) if i == d else 0 for i in range(len(shape)))]
        if not np.array_equal(np.take(full_index.astype(np.int64), sel, axis=d), x):
            raise AssertionError(f"rank's elements are not whole slices of dim {d}")
        picks.append(sel)
    order = np.concatenate(picks)
    chunk = [len(c) for c in _chunks(len(order))]
    if [len(p) for p in picks] != chunk:
        raise AssertionError(f"per-rank sizes {[len(p) for p in picks]} of dim {d} are not torch.chunk's {chunk}")
    plain = len(order) == shape[d] and np.array_equal(order, np.arange(shape[d]))
    return Placement(d, None if plain else tuple(int(i) for i in order))


def _chunks(n: int) -> list[range]:
    step = -(-n // TP)
    return [range(i, min(i + step, n)) for i in range(0, n, step)]


def build(cfg, seed: int = 0):
    import torch
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    return model.float().eval()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- the runtime: DTensor parallel styles made from the placements, run on each rank ----------------
def styles(model, placements: dict[str, Placement]) -> dict:
    """{module path: ParallelStyle} for every module whose own parameters the layout splits: its role
    (column, row, vocab-parallel embedding, experts) follows from which dim of its weight is split."""
    import torch.nn as nn
    out = {}
    head = model.get_output_embeddings()
    by_module: dict[str, dict[str, Placement]] = {}
    for name, pl in placements.items():
        path, leaf = name.rsplit(".", 1)
        by_module.setdefault(path, {})[leaf] = pl
    if head is not None and not any(p is head.weight for n, p in model.named_parameters()
                                    if n.startswith(_path(model, head) + ".")):
        tied = next(n for n, p in model.named_parameters() if p is head.weight)  # a tied head: the embedding's
        by_module[_path(model, head)] = {"weight": placements[tied]}
    for path, pls in by_module.items():
        if all(p.dim is None for p in pls.values()):
            continue
        module = model.get_submodule(path)
        weight = pls.get("weight")
        kind = type(module).__name__
        if isinstance(module, nn.Embedding) or module is model.get_input_embeddings():
            assert weight.dim == 0, f"{path}: an embedding split on dim {weight.dim}"
            out[path] = UclStyle(pls, "replicate", "replicate")
        elif weight is not None and module.weight.ndim == 2:
            out_dim = 1 if kind == "Conv1D" else 0  # GPT-2's Conv1D stores [in, out]
            column = weight.dim == out_dim
            hf = _hf_style(model, path)
            gather = module is head or hf == "colwise_gather_output"
            row_input = "split" if hf == "rowwise_split_input" else "shard"
            out[path] = UclStyle(pls, "replicate" if column else row_input, "shard" if column and not gather else
                                 "replicate")
        else:  # experts stacked [E, ...]: computed with the local shards, the partial sums all-reduced
            # (one [E, out, in] weight split on its output dim (jetmoe's input_linear) is column-parallel,
            # and a module of per-head parameters without a weight (kimi_linear's forget gate) computes
            # its heads: their outputs stay local)
            column = set(pls) == {"weight"} and weight.dim == 1 and type(module).__name__.endswith("ParallelExperts")
            per_head = set(pls) <= {"dt_bias", "A_log", "D"}
            out[path] = LocalStyle(pls, reduce=not column and not per_head)
    return out


def _hf_style(model, path: str) -> str | None:
    """transformers' TP style of a module, where its plan names one: the runtime computes as it says
    (``colwise_gather_output``: the column output all-gathered; ``rowwise_split_input``: a replicated
    input cut to the rank's columns)."""
    plan = getattr(model, "_tp_plan", None) or {}
    return plan.get(re.sub(r"\.\d+(?=\.|$)", ".*", path))


def _path(model, module) -> str:
    return next(n for n, m in model.named_modules() if m is module)


def _global(param, pl: Placement):
    """The tensor whose ``Shard(pl.dim)`` gives each rank its local shard: the parameter, or its
    slices along ``pl.dim`` in the order the ranks hold them."""
    import torch
    t = param.detach()
    if pl.order is None:
        return t
    return torch.index_select(t, pl.dim, torch.tensor(pl.order, dtype=torch.long))


def _placements(pl: Placement):
    from torch.distributed.tensor import Replicate, Shard
    return [Replicate() if pl.dim is None else Shard(pl.dim)]


def _style_base():
    from torch.distributed.tensor.parallel import ParallelStyle
    return ParallelStyle


class UclStyle(_style_base()):
    """A Linear / Conv1D / Embedding computed in DTensor: parameters placed as the layout says, the
    input taken as replicated or as the local shard of its last dim, the output kept as the local
    shard (column-parallel) or reduced to a replicated tensor."""

    def __init__(self, pls: dict[str, Placement], input_: str, output: str):
        super().__init__()
        self.pls, self.input, self.output = pls, input_, output

    def _apply(self, module, mesh):
        import torch.nn as nn
        from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor

        def partition(name, m, mesh):
            if m is not module:
                return
            for leaf, pl in self.pls.items():
                p = getattr(m, leaf)
                m.register_parameter(leaf, nn.Parameter(distribute_tensor(_global(p, pl), mesh, _placements(pl))))

        def inputs(m, args, mesh):
            x = args[0]
            layout = [Shard(x.ndim - 1)] if self.input == "shard" else [Replicate()]
            x = DTensor.from_local(x, mesh, layout, run_check=False)
            if self.input == "split":
                x = x.redistribute(mesh, [Shard(x.ndim - 1)])
            return (x, *args[1:])

        def outputs(m, y, mesh):
            if self.output == "replicate":
                y = y.redistribute(mesh, [Replicate()])
            return y.to_local()

        return distribute_module(module, mesh, partition, inputs, outputs)


class LocalStyle(_style_base()):
    """Stacked experts: each rank computes with its shards (DTensors of the layout's placements,
    kept for the shard check) and the partial outputs are summed over tp."""

    def __init__(self, pls: dict[str, Placement], reduce: bool = True):
        super().__init__()
        self.pls, self.reduce = pls, reduce

    def _apply(self, module, mesh):
        import torch.distributed as dist
        import torch.nn as nn
        from torch.distributed.tensor import distribute_tensor
        module.ucl_dtensors = {}
        for leaf, pl in self.pls.items():
            dt = distribute_tensor(_global(getattr(module, leaf), pl), mesh, _placements(pl))
            module.ucl_dtensors[leaf] = dt
            module.register_parameter(leaf, nn.Parameter(dt.to_local()))

        def reduce(m, args, y):
            dist.all_reduce(y, group=mesh.get_group())
            return y
        if self.reduce:
            module.register_forward_hook(reduce)
        return module


def localize(model, model_type: str, placements: dict[str, Placement], rank: int) -> None:
    """The runtime's per-rank view: head counts and split sizes of the attention modules over tp, and
    ALiBi slopes sliced to the rank's heads (bloom, mpt build them for every head)."""
    split_parents = {n.rsplit(".", 2)[0] for n, p in placements.items() if p.dim is not None and n.count(".") >= 2}
    split_parents = {p for p in split_parents
                     if re.search("Attention|MoA$|Experts$", type(model.get_submodule(p)).__name__)}
    for path in split_parents:
        m = model.get_submodule(path)
        for attr in LOCAL_ATTRS[model_type]:
            cls, _, attr = attr.rpartition(".")
            if cls and type(m).__name__ != cls:
                continue
            v = getattr(m, attr, None)
            if isinstance(v, int) and not isinstance(v, bool):
                assert v % TP == 0, (path, attr, v)
                setattr(m, attr, v // TP)
    heads = {"bloom": "n_head", "mpt": "n_heads"}.get(model_type)
    if heads is None:
        return
    h = getattr(model.config, heads)
    lo, hi = rank * h // TP, (rank + 1) * h // TP

    def slice_alibi(m, args, kwargs):
        key = "alibi" if "alibi" in kwargs else "position_bias"
        a = kwargs[key]
        if model_type == "bloom":  # [batch * heads, 1, kv]
            kwargs[key] = a.view(-1, h, *a.shape[1:])[:, lo:hi].reshape(-1, *a.shape[1:])
        else:  # [heads, 1, kv]
            kwargs[key] = a[lo:hi]
        return args, kwargs
    for path in split_parents:
        model.get_submodule(path).register_forward_pre_hook(slice_alibi, with_kwargs=True)


def check_rank(model_type: str, placements, local, rank: int, mesh) -> list[str]:
    """On one rank: the parallelized model's shards and logits against the layout and the unsharded
    model. Returns the problems (empty: the layout is one this runtime computes with)."""
    import torch
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module
    cfg = config(model_type)
    model = build(cfg)
    ids = torch.randint(3, cfg.vocab_size, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids, use_cache=False).logits
    plan = styles(model, placements)
    parallelize_module(model, mesh, plan)
    localize(model, model_type, placements, rank)
    problems = []
    for name, pl in placements.items():
        path, leaf = name.rsplit(".", 1)
        m = model.get_submodule(path)
        p = getattr(m, "ucl_dtensors", {}).get(leaf, getattr(m, leaf))
        got = p.to_local() if isinstance(p, DTensor) else p
        if pl.dim is not None and not isinstance(p, DTensor):
            problems.append(f"{name}: split by the layout but not distributed by the runtime")
        if not torch.equal(got.detach(), torch.from_numpy(local[rank][name])):
            problems.append(f"{name}: rank {rank}'s shard {tuple(got.shape)} differs from ucl's "
                            f"{local[rank][name].shape}")
    with torch.no_grad():
        logits = model(ids, use_cache=False).logits
    if isinstance(logits, DTensor):
        logits = logits.full_tensor()
    if not torch.allclose(logits, want, rtol=1e-4, atol=1e-5):
        problems.append(f"logits differ by {float((logits - want).abs().max()):.3g}")
    return problems


def worker(rank: int, port: int, jobs: list, results: str) -> None:
    import json
    import torch.distributed as dist
    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    transformers.logging.set_verbosity_error()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=TP)
    mesh = init_device_mesh("cpu", (TP,))
    out = {}
    for label, model_type, placements, local in jobs:
        try:
            out[label] = check_rank(model_type, placements, local, rank, mesh)
        except Exception as e:  # noqa: BLE001 - reported per family
            out[label] = [f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"]
    with open(os.path.join(results, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


def run(types, results: str, extra=()) -> dict[str, list[str]]:
    """Both ranks' problems per model type (the layouts are lowered here, once); ``extra`` adds jobs
    ``(label, model_type, placements, local)`` (a tampered layout, to see the check fail)."""
    import json
    import torch.multiprocessing as mp
    jobs, out = [], {}
    for t in types:
        try:
            _, placements, local = ucl_layout(t)
            jobs.append((t, t, placements, local))
            out[t] = []
        except AssertionError as e:  # a layout no placement describes
            out[t] = [f"layout: {e}"]
    for job in extra:
        jobs.append(job)
        out[job[0]] = []
    if jobs:
        mp.spawn(worker, args=(free_port(), jobs, results), nprocs=TP, join=True)
    for r in range(TP if jobs else 0):
        with open(os.path.join(results, f"rank{r}.json")) as f:
            for t, probs in json.load(f).items():
                out[t] += probs
    return out


if __name__ == "__main__":
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        for t, probs in run(sys.argv[1:] or FAMILIES, d).items():
            print(f"{t}: {'ok' if not probs else '; '.join(dict.fromkeys(probs))[:600]}")
