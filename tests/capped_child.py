"""One offline operation in a process of its own, its peak added memory measured (tests/memprobe.py).

    python tests/capped_child.py '{"op": "reshard", "src": ..., "dst": ..., "to": "tp=4", ...}'

Prints one JSON line: ``peak_added`` (bytes of PSS above this process's own at the start, summed over
every process the operation starts), ``baseline``, ``seconds``, and for a load ``result`` (bytes of the arrays
it returned; iter_rank: the largest it yielded, one held at a time) and a ``digest`` of them. Before measuring, the same
operation runs once on ``warm`` (a small checkpoint of the same kind), so that the modules it imports
lazily and their one-time tables are in the baseline, not in the operation's figure: the cap counts
the memory an operation adds, not the interpreter's. ``op``: reshard, load_rank, iter_rank,
load_into (load_rank into torch parameters made beforehand, filled as GPU tensors are).
tests/test_memory_caps.py and bench/reshard.py run it.
"""
from __future__ import annotations

import gc
import json
import os
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from memprobe import TreeMemory  # noqa: E402

import numpy as np  # noqa: E402

import ucl  # noqa: E402
from ucl.ops.load import iter_rank, load_rank  # noqa: E402
from ucl.ops.reshard import reshard  # noqa: E402


def prepare(a: dict, src: str):
    """What the operation is given (not measured): load_into's destination tensors, torch
    parameters, which ucl is made to treat as it treats GPU tensors (no numpy view of them: filled
    through memory of its own), as this machine may have no GPU."""
    if a["op"] != "load_into":
        return None
    import torch
    import ucl.ops.load
    ucl.ops.load.storage_view = lambda obj, logical: None if isinstance(obj, torch.Tensor) else obj
    from ucl.dtypes import to_torch
    from ucl.ops.prepare import mesh_of, model_of, open_checkpoint, plan_for
    from ucl.plan.execute import rank_datasets
    with open_checkpoint(src) as c:
        plan = plan_for(model_of(c), mesh_of(c), ucl.Mesh.parse(a["to"]), ranks=[a.get("rank", 0)])
    return {d["key"]: torch.nn.Parameter(to_torch(np.ones(d["shape"], ucl.dtypes.storage_dtype(d["dtype"])), d["dtype"]))
            for d in rank_datasets(plan, a.get("rank", 0))}


def run(a: dict, src: str, dst: str | None, given=None) -> dict:
    """Run the operation ``a`` names on ``src``; a digest of its result (load_rank, iter_rank)."""
    cap = {"max_memory": a["max_memory"]} if "max_memory" in a else {}
    if a["op"] == "reshard":
        reshard(src, dst, a["to"], workers=a.get("workers"), durable=a.get("durable", False),
                verify=a.get("verify", True), **cap)
        return {}
    if a["op"] == "load_rank":
        out = load_rank(src, mesh=a["to"], rank=a.get("rank", 0), **cap)
        return {"digest": digest(sorted(out.items())), "result": sum(x.nbytes for x in out.values())}
    if a["op"] == "load_into":
        out = load_rank(src, mesh=a["to"], rank=a.get("rank", 0), out=given, **cap)
        assert all(out[k] is given[k] for k in given)
        return {"digest": digest(sorted((k, ucl.dtypes.to_numpy(v.detach())[0]) for k, v in out.items())),
                "result": 0}  # (the tensors were there before)
    if a["op"] == "iter_rank":
        largest = [0]

        def items():  # each array dropped before the next is made: one is held at a time
            for key, arr in iter_rank(src, mesh=a["to"], rank=a.get("rank", 0), **cap):
                largest[0] = max(largest[0], arr.nbytes)
                yield key, arr
                del arr
        return {"digest": digest(items()), "result": largest[0]}
    raise SystemExit(f"unknown op {a['op']!r}")


def digest(items) -> str:
    import xxhash
    h = xxhash.xxh3_64()
    for key, arr in items:
        h.update(key.encode())
        h.update(np.ascontiguousarray(arr).view(np.uint8).reshape(-1).data)
        del arr
    return h.hexdigest()


def main() -> None:
    a = json.loads(sys.argv[1])
    if a.get("warm"):
        scratch = a["dst"] + ".warm" if a["op"] == "reshard" else None
        run(a, a["warm"], scratch, prepare(a, a["warm"]))
        if scratch:
            shutil.rmtree(scratch)
    given = prepare(a, a["src"])
    gc.collect()
    t0 = time.perf_counter()
    with TreeMemory() as mem:
        got = run(a, a["src"], a.get("dst"), given)
    got.update(peak_added=mem.peak_added, baseline=mem.baseline, seconds=time.perf_counter() - t0)
    print(json.dumps(got))


if __name__ == "__main__":
    main()
