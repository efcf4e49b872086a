"""The one builder of meta-device transformers models (the drafter's source of parameter names and
shapes: no memory, no download)."""
from __future__ import annotations

from typing import Mapping


def meta_model(config):
    """(config, model on the meta device) from a PretrainedConfig, a config dict or a path."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

    if not isinstance(config, PretrainedConfig):
        if isinstance(config, Mapping):
            fields = dict(config)
            config = AutoConfig.for_model(fields.pop("model_type"), **fields)
        else:
            config = AutoConfig.from_pretrained(str(config))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return config, model
