"""The built-in example: a seeded Llama-style model with Adam state in a Megatron TP/PP/DP layout
with ZeRO-1 flat optimizer buffers. Used by ``ucl demo`` (:func:`run_demo`), the benchmarks and
the tests."""
from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
from rich.markup import escape

from .lang.spec import Spec
from .layout.bind import Model
from .layout.mesh import UNIVERSAL, Mesh
from .ops import IOStats, load_rank, open_checkpoint, reshard, save
from .plan import compile, execute_memory

LLAMA_MEGATRON = """\
# Llama-family decoder in Megatron-core naming: fused QKV per KV group, SwiGLU [gate; up],
# vocab padded to 128 * tp, layers staged over pp, bf16 weights, fp32 master + Adam moments in
# ZeRO-1 flat buffers over dp.
dims vocab from vocab_size, hidden from hidden_size, heads from num_attention_heads,
     kv_heads from num_key_value_heads, ffn from intermediate_size, layers from num_hidden_layers
let head_dim = hidden / heads
mesh pp, dp, tp

decoder.layers.{i}.** : index i of layers over pp
embedding.word_embeddings.weight [vocab, hidden] : pad 0 to multiple_of(128 * tp); split 0 over tp; on pp = first
decoder.layers.{i}.self_attention.linear_qkv.weight [(heads + 2 * kv_heads) * head_dim, hidden]
    : view 0 as [kv_heads, (heads / kv_heads + 2) * head_dim]; split 0.0 over tp
decoder.layers.{i}.self_attention.linear_qkv.layer_norm_weight [hidden] : replicate over tp
decoder.layers.{i}.self_attention.linear_proj.weight [hidden, heads * head_dim] : split 1 over tp
decoder.layers.{i}.mlp.linear_fc1.weight [2 * ffn, hidden] : view 0 as [2, ffn]; split 0.1 over tp
decoder.layers.{i}.mlp.linear_fc1.layer_norm_weight [hidden] : replicate over tp
decoder.layers.{i}.mlp.linear_fc2.weight [hidden, ffn] : split 1 over tp
decoder.final_layernorm.weight [hidden] : on pp = last
output_layer.weight [vocab, hidden] : pad 0 to multiple_of(128 * tp); split 0 over tp; on pp = last

state param : dtype bfloat16
state fp32, exp_avg, exp_avg_sq : dtype float32; flat over dp align 64 pad to multiple_of(64 * dp)
state step : dtype int64; scalar
"""

SMALL = dict(vocab=1000, hidden=256, heads=8, kv_heads=4, ffn=704, layers=4)


def llama_params(d: dict) -> dict[str, tuple[int, ...]]:
    """Global parameter names and shapes, in model order."""
    hd = d["hidden"] // d["heads"]
    p = {"embedding.word_embeddings.weight": (d["vocab"], d["hidden"])}
    for i in range(d["layers"]):
        L = f"decoder.layers.{i}."
        p[L + "self_attention.linear_qkv.weight"] = ((d["heads"] + 2 * d["kv_heads"]) * hd, d["hidden"])
        p[L + "self_attention.linear_qkv.layer_norm_weight"] = (d["hidden"],)
        p[L + "self_attention.linear_proj.weight"] = (d["hidden"], d["heads"] * hd)
        p[L + "mlp.linear_fc1.weight"] = (2 * d["ffn"], d["hidden"])
        p[L + "mlp.linear_fc1.layer_norm_weight"] = (d["hidden"],)
        p[L + "mlp.linear_fc2.weight"] = (d["hidden"], d["ffn"])
    p["decoder.final_layernorm.weight"] = (d["hidden"],)
    p["output_layer.weight"] = (d["vocab"], d["hidden"])
    return p


def llama_model(dims: dict | None = None) -> Model:
    dims = dict(SMALL if dims is None else dims)
    return Spec.from_text(LLAMA_MEGATRON, "<demo:llama_megatron>", name="demo:llama_megatron").bind(dims, llama_params(dims))


def universal_state(model: Model, seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded global tensors for every (kind, parameter): bf16 weights as raw uint16 bits (the top
    half of a float32, as torch rounds-to-zero would give), fp32 master/moments, int64 step."""
    rng = np.random.default_rng(seed)
    out = {}
    for t in model.tensors:
        if t.dtype == "bfloat16":
            out[t.key] = (rng.standard_normal(t.shape, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)
        elif t.dtype == "int64":
            out[t.key] = np.asarray(1000 + t.id, dtype=np.int64).reshape(t.shape)
        else:
            out[t.key] = rng.standard_normal(t.shape, dtype=np.float32).astype(t.dtype)
    return out


# ---- ucl demo ---------------------------------------------------------------------------------------
def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def run_demo(workdir: str | None, *, src: str, dst: str, keep: bool, console) -> int:
    A, B = Mesh.parse(src), Mesh.parse(dst)
    model = llama_model()
    for mesh in (A, B):  # a mesh that does not fit the model fails here, before anything is written
        compile(model, UNIVERSAL, mesh)
    base = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="ucl-demo-"))
    base.mkdir(parents=True, exist_ok=True)
    run = Path(tempfile.mkdtemp(prefix="run-", dir=base))
    say = console.print
    try:
        truth = universal_state(model, seed=0)
        n_params = sum(int(np.prod(s)) for s in model.params.values())
        say(f"model: Llama-style, {len(model.params)} parameters ({n_params:,} weights), "
            f"{len(model.tensors)} tensors incl. fp32 master + Adam moments + step; spec demo:llama_megatron")

        t = time.perf_counter()
        shards = execute_memory(compile(model, UNIVERSAL, A), {0: truth})
        save(run / "source", shards, model=model, mesh=A, state={"step": 1000, "data_position": 123456})
        say(f"[1] wrote source checkpoint {A} ({A.size} rank files, {_size(run / 'source'):,} B) "
            f"in {time.perf_counter() - t:.2f} s")

        stats = reshard(run / "source", run / "target", B)
        say(f"[2] resharded {A} -> {B}: {stats.bytes_written:,} B written, {stats.bytes_read:,} B read "
            f"in {stats.seconds:.2f} s")
        stats = reshard(run / "source", run / "universal", UNIVERSAL)
        say(f"[3] consolidated {A} -> universal: {_size(run / 'universal'):,} B in {stats.seconds:.2f} s")
        stats = reshard(run / "target", run / "roundtrip", UNIVERSAL)
        say(f"[4] consolidated {B} -> universal in {stats.seconds:.2f} s")

        expected_b = execute_memory(compile(model, UNIVERSAL, B), {0: truth})
        failures = _compare_written(run, truth, expected_b, B)
        rank = B.size - 1
        stats = IOStats()
        direct = load_rank(run / "source", mesh=B, rank=rank, stats=stats)
        failures += [f"load_rank {rank}: {key}" for key, value in expected_b[rank].items()
                     if not np.array_equal(direct[key], value)]
        say(f"[5] loaded rank {rank} of {B} straight from the {A} checkpoint: read {stats.bytes_read:,} B for "
            f"{stats.bytes_needed:,} B needed, in {stats.seconds:.2f} s")
        if failures:
            for f in failures[:20]:
                say(f"[red]MISMATCH[/] {escape(f)}")
            return 1
        say(f"[green]bit-exact[/]: {len(truth)} tensors identical after {A} -> universal, {A} -> {B} -> universal, "
            f"and loading {B} rank {rank} from {A}; every checksum verified")
        if keep:
            say(f"checkpoints kept in {escape(str(run))}")
        return 0
    finally:
        if not keep:
            shutil.rmtree(run, ignore_errors=True)
            if workdir is None:
                shutil.rmtree(base, ignore_errors=True)


def _compare_written(run: Path, truth: dict, expected_b: dict, B: Mesh) -> list[str]:
    """Mismatches between what the demo wrote and what it should hold, plus checksum problems."""
    failures = []
    for name in ("universal", "roundtrip"):
        with open_checkpoint(run / name) as c:
            for key, value in truth.items():
                got = c.read(0, key)
                if got.dtype != value.dtype or not np.array_equal(got, value):
                    failures.append(f"{name}: {key}")
    with open_checkpoint(run / "target") as c:
        for r in range(B.size):  # each rank stores what it holds, less replicas a lower rank stores
            failures += [f"target rank {r}: {key}" for key in c.keys(r)
                         if key not in expected_b[r] or not np.array_equal(c.read(r, key), expected_b[r][key])]
        failures += c.verify()
    for r in range(B.size):  # and every rank loads all it holds
        got = load_rank(run / "target", mesh=B, rank=r)
        failures += [f"target rank {r} loaded: {key}" for key, value in expected_b[r].items()
                     if key not in got or not np.array_equal(got[key], value)]
    return failures
