"""Child process of tests/test_memory_caps_formats.py and bench/interop.py: build a checkpoint, or run one
import/export under ``--max-memory`` and print the peak PSS it added (tests/memprobe.py) as JSON.

    python tests/memcap_formats_child.py build-dcp OUT MB
    python tests/memcap_formats_child.py build-deepspeed OUT MB
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


def build_deepspeed(out: str, mb: float) -> None:
    """A DeepSpeed ZeRO-1 checkpoint (fp32, dp=2) of about ``mb`` MB, written as DeepSpeed 0.19 lays
    it out (tests/fixtures/deepspeed/z1_fp32_dp2, scaled up; DeepSpeed is not needed): weights of
    4096 x 4096 in group 0 and their biases in group 1, each group one flat buffer cut in two."""
    from collections import OrderedDict

    import numpy as np
    from ucl.formats.torchzip.write import Size, Tensor, save
    dp, width = 2, 4096
    layers = max(1, round(mb * 1e6 / (4 * 4 * (width * width + width))))
    rng = np.random.default_rng(0)
    groups = [OrderedDict((f"layers.{i}.weight", (width, width)) for i in range(layers)),
              OrderedDict((f"layers.{i}.bias", (width,)) for i in range(layers))]
    module = OrderedDict()
    for i in range(layers):
        module[f"layers.{i}.weight"] = rng.standard_normal((width, width), dtype=np.float32)
        module[f"layers.{i}.bias"] = rng.standard_normal(width, dtype=np.float32)
    tag = os.path.join(out, "global_step1")
    os.makedirs(tag)
    with open(os.path.join(out, "latest"), "w") as f:
        f.write("global_step1")
    config = {"train_batch_size": dp, "train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 1}}
    save({"module": OrderedDict((n, Tensor(a, "float32")) for n, a in module.items()), "buffer_names": [],
          "optimizer": None, "param_shapes": [OrderedDict((n, Size(s)) for n, s in g.items()) for g in groups],
          "frozen_param_shapes": None, "shared_params": {}, "frozen_param_fragments": None, "lr_scheduler": None,
          "data_sampler": None, "random_ltd": None, "skipped_steps": 0, "global_steps": 1, "global_samples": dp,
          "dp_world_size": dp, "mp_world_size": 1, "ds_config": config, "ds_version": "0.19.8"},
         os.path.join(tag, "mp_rank_00_model_states.pt"))
    flats = []
    for g in groups:
        flat = np.concatenate([module[n].reshape(-1) for n in g])
        flats.append(np.concatenate([flat, np.zeros(-flat.size % (2 * dp), np.float32)]))
    for r in range(dp):
        part = [f.reshape(dp, -1)[r] for f in flats]
        state = {g: {"step": Tensor(np.array(1.0, np.float32), "float32"),
                     "exp_avg": Tensor(rng.standard_normal(p.size, dtype=np.float32), "float32"),
                     "exp_avg_sq": Tensor(rng.random(p.size, dtype=np.float32), "float32")} for g, p in enumerate(part)}
        groups_hp = [{"lr": 1e-3, "weight_decay": wd, "betas": (0.9, 0.999), "eps": 1e-8, "params": [g]}
                     for g, wd in enumerate((0.01, 0.0))]
        save({"optimizer_state_dict": {"dynamic_loss_scale": False, "overflow": False, "clip_grad": 0.0,
                                       "base_optimizer_state": {"state": state, "param_groups": groups_hp},
                                       "single_partition_of_fp32_groups": [Tensor(np.ascontiguousarray(p), "float32")
                                                                           for p in part],
                                       "zero_stage": 1, "group_paddings": [0, 0],
                                       "partition_count": [dp, dp], "ds_version": "0.19.8"},
              "ds_config": config, "ds_version": "0.19.8"},
             os.path.join(tag, f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt"))


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
    elif sys.argv[1] == "build-deepspeed":
        build_deepspeed(sys.argv[2], float(sys.argv[3]))
    else:
        print(json.dumps(run(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] if len(sys.argv) > 4 else None)))
