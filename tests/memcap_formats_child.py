"""Child process of tests/test_memory_caps_formats.py and bench/interop.py: build a checkpoint, or run one
import/export under ``--max-memory`` and print the peak PSS it added (tests/memprobe.py) as JSON.

    python tests/memcap_formats_child.py build-dcp OUT MB
    python tests/memcap_formats_child.py OP SRC OUT [MAX_MEMORY]     OP: import, hf, dcp, universal
"""
from __future__ import annotations

import json
import os
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")


def build_dcp(out: str, mb: float) -> None:
    """A DCP checkpoint of about ``mb`` MB: Linear layers of 4096x4096 (weights of 67 MB, over the
    caps the tests give) and one AdamW step, saved as ``get_state_dict`` gives them in one process
    (fp32 weights, exp_avg, exp_avg_sq, step)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    torch.manual_seed(0)
    layers = max(1, round(mb * 1e6 / (3 * 4 * (4096 * 4096 + 4096))))
    model = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 4096)).square().sum().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=out)


def run(op: str, src: str, out: str, cap: str | None) -> dict:
    import torch  # noqa: F401  imports first: the cap counts what the operation adds, not the interpreter
    import torch.distributed.checkpoint  # noqa: F401
    import ucl
    from ucl.ops import export as ex
    from memprobe import TreeMemory
    kw = {} if cap is None else {"max_memory": cap}
    calls = {"import": lambda: ucl.import_checkpoint(src, out, **kw),
             "hf": lambda: ex.export_hf(src, out, config={"model_type": "ucl-test"}, **kw),
             "dcp": lambda: ex.export_dcp(src, out, **kw),
             "universal": lambda: ex.export_deepspeed_universal(src, out, **kw)}
    t0 = time.perf_counter()
    with TreeMemory() as mem:
        calls[op]()
    return {"op": op, "cap": cap, "peak_added": mem.peak_added, "baseline": mem.baseline,
            "seconds": time.perf_counter() - t0}


if __name__ == "__main__":
    if sys.argv[1] == "build-dcp":
        build_dcp(sys.argv[2], float(sys.argv[3]))
    else:
        print(json.dumps(run(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] if len(sys.argv) > 4 else None)))
