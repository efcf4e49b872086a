"""Hugging Face interop: config reading (``ucl.model_config``), tensor names of safetensors
checkpoints, checking a spec against a model, and drafting a spec for a transformers model.
Only :func:`draft_spec_from_hf` (and :func:`load_config`, when it can) imports torch/transformers."""
from ...model_config import load_config
from .check import check_against, unmatched_patterns
from .draft import draft_spec_from_hf
from .names import fuse_saved_experts, read_tensor_names

__all__ = ["load_config", "read_tensor_names", "fuse_saved_experts", "check_against", "unmatched_patterns",
           "draft_spec_from_hf"]
