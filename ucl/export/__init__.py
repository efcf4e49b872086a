"""Exports: a ucl checkpoint (or a foreign folder read in place) written in another framework's own
resumable format, from the universal layout (every tensor whole under its global name).

    export_dcp("ckpt/step_100", "dcp/step_100")                       # torch.distributed.checkpoint
    export_deepspeed_universal("ds_run/", "ds_universal/")            # DeepSpeed load_universal
    export_hf("ckpt/step_100", "hf/step_100", dtype="bfloat16")       # save_pretrained folders

Each writes into a hidden temp folder beside ``out`` and rename it at the end, so ``out`` appears
whole or not at all; an existing ``out`` is refused (UCL503). See docs/interop.md.
"""
from .dcp import export_dcp
from .deepspeed import export_deepspeed_universal
from .hf import export_hf
from .source import ExportSource, survey

__all__ = ["export_dcp", "export_deepspeed_universal", "export_hf", "survey", "ExportSource"]
