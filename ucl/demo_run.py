"""``ucl demo``: the README's main job, end to end on the built-in Llama-style model."""
from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from . import checkpoint as ck
from .demo import llama_model, universal_state
from .execute import execute_memory
from .mesh import UNIVERSAL, Mesh
from .plan import compile


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def run_demo(workdir: str | None, *, src: str, dst: str, keep: bool, console) -> int:
    base = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="ucl-demo-"))
    base.mkdir(parents=True, exist_ok=True)
    run = Path(tempfile.mkdtemp(prefix="run-", dir=base))
    A, B = Mesh.parse(src), Mesh.parse(dst)
    say = console.print
    try:
        model = llama_model()
        truth = universal_state(model, seed=0)
        n_params = sum(int(np.prod(s)) for s in model.params.values())
        say(f"model: Llama-style, {len(model.params)} parameters ({n_params:,} weights), "
            f"{len(model.tensors)} tensors incl. fp32 master + Adam moments + step; spec demo:llama_megatron")

        t = time.perf_counter()
        shards = execute_memory(compile(model, UNIVERSAL, A), {0: truth})
        ck.save(run / "source", shards, model=model, mesh=A, state={"step": 1000, "data_position": 123456})
        say(f"[1] wrote source checkpoint {A} ({A.size} rank files, {_size(run / 'source'):,} B) "
            f"in {time.perf_counter() - t:.2f} s")

        stats = ck.reshard(run / "source", run / "target", B)
        say(f"[2] resharded {A} -> {B}: {stats.bytes_written:,} B written, {stats.bytes_read:,} B read "
            f"in {stats.seconds:.2f} s")
        stats = ck.reshard(run / "source", run / "universal", UNIVERSAL)
        say(f"[3] consolidated {A} -> universal: {_size(run / 'universal'):,} B in {stats.seconds:.2f} s")
        stats = ck.reshard(run / "target", run / "roundtrip", UNIVERSAL)
        say(f"[4] consolidated {B} -> universal in {stats.seconds:.2f} s")

        failures = []
        for name in ("universal", "roundtrip"):
            with ck.open_checkpoint(run / name) as c:
                for key, value in truth.items():
                    got = c.read(0, key)
                    if got.dtype != value.dtype or not np.array_equal(got, value):
                        failures.append(f"{name}: {key}")
        expected_b = execute_memory(compile(model, UNIVERSAL, B), {0: truth})
        with ck.open_checkpoint(run / "target") as c:
            for r in range(B.size):
                for key, value in expected_b[r].items():
                    if not np.array_equal(c.read(r, key), value):
                        failures.append(f"target rank {r}: {key}")
            problems = c.verify()
        rank = B.size - 1
        stats = ck.IOStats()
        direct = ck.load_rank(run / "source", mesh=B, rank=rank, stats=stats)
        for key, value in expected_b[rank].items():
            if not np.array_equal(direct[key], value):
                failures.append(f"load_rank {rank}: {key}")
        say(f"[5] loaded rank {rank} of {B} straight from the {A} checkpoint: read {stats.bytes_read:,} B for "
            f"{stats.bytes_needed:,} B needed, in {stats.seconds:.2f} s")
        if failures or problems:
            for f in failures[:20] + problems[:20]:
                say(f"[red]MISMATCH[/] {f}")
            return 1
        say(f"[green]bit-exact[/]: {len(truth)} tensors identical after {A} -> universal, {A} -> {B} -> universal, "
            f"and loading {B} rank {rank} from {A}; every checksum verified")
        if keep:
            say(f"checkpoints kept in {run}")
        return 0
    finally:
        if not keep:
            shutil.rmtree(run, ignore_errors=True)
            if workdir is None:
                shutil.rmtree(base, ignore_errors=True)
