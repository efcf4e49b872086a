"""The one reader of a model's ``config.json`` (Hugging Face style), used wherever dims come from a
config: ``Spec.dims_from_config``, ``--dims config.json``, ``ucl check --against`` and the HF interop.

A config is a dict, a ``transformers.PretrainedConfig``, a ``config.json`` path or a folder holding
one. Fields a spec reads are filled in the way the model class fills them: with transformers
installed, ``AutoConfig.for_model(model_type, **fields)`` supplies class defaults and aliases
(gpt2's ``n_embd``); in every case a missing or null ``head_dim`` becomes
``hidden_size // num_attention_heads`` (Llama-2 has none, Mixtral writes ``null``) and a missing
``num_hidden_layers`` the length of ``layers_block_type`` / ``layer_types`` (Nemotron-H has none).
"""
from __future__ import annotations

import math
import os
import warnings
from pathlib import Path
from typing import Any, Mapping

from .errors import StoreError
from .files import parse_json, read_bounded

CONFIG_NAME = "config.json"
MAX_CONFIG_BYTES = 16 << 20  # a config is a few KB; refuse anything that is not plausibly one


def config_path(source: str | os.PathLike) -> Path:
    """``source`` or ``source/config.json``; a clear error when neither is a readable file."""
    path = Path(source)
    if path.is_dir():
        path = path / CONFIG_NAME
    if not path.exists():
        raise StoreError(f"config {path} does not exist", code="UCL404")
    if not path.is_file():
        raise StoreError(f"config {path} is not a regular file", code="UCL404")
    return path


def read_raw_config(config: Any) -> dict:
    """The fields as written: a plain dict from any accepted form (no defaults filled in)."""
    if isinstance(config, Mapping):  # a manifest keeps non-finite floats as transformers writes them
        return _special_floats(dict(config))
    if hasattr(config, "to_dict"):
        return config.to_dict()
    path = config_path(config)

    def error(message: str) -> StoreError:
        return StoreError(f"cannot read config {path}: {message}", code="UCL401")

    # the one reader of files from strangers: no FIFO or device, a size cap, no RecursionError
    out = parse_json(read_bounded(path, limit=MAX_CONFIG_BYTES, what="config", error=error), "the config", error)
    if not isinstance(out, dict):
        raise StoreError(f"config {path} is not a JSON object", code="UCL401")
    return _special_floats(out)


_SPECIAL_FLOATS = {"Infinity": math.inf, "-Infinity": -math.inf, "NaN": math.nan}


def _special_floats(value: Any) -> Any:
    """Floats JSON has no literal for, as transformers writes them (``{"__float__": "Infinity"}``,
    e.g. Mamba-2's ``time_step_limit``), back as floats."""
    if isinstance(value, dict):
        if len(value) == 1 and value.get("__float__") in _SPECIAL_FLOATS:
            return _SPECIAL_FLOATS[value["__float__"]]
        return {k: _special_floats(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_special_floats(v) for v in value]
    return value


def json_config(value: Any) -> Any:
    """A config read by :func:`read_raw_config` as plain JSON again: non-finite floats written back as
    transformers writes them (``{"__float__": "Infinity"}``), so a manifest can hold it."""
    if isinstance(value, float) and not math.isfinite(value):
        return {"__float__": "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")}
    if isinstance(value, dict):
        return {k: json_config(v) for k, v in value.items()}
    if isinstance(value, list):
        return [json_config(v) for v in value]
    return value


def load_config(config: Any) -> dict:
    """The config as a dict with the fields a spec reads filled in (see the module docstring)."""
    raw = read_raw_config(config)
    out = dict(raw)
    already_full = not isinstance(config, Mapping) and hasattr(config, "to_dict")  # a PretrainedConfig
    if not already_full and raw.get("model_type"):
        try:
            from transformers import AutoConfig
        except ImportError:  # without transformers: the fields as written
            AutoConfig = None
        if AutoConfig is not None:
            fields = {k: v for k, v in raw.items() if k != "model_type"}
            try:
                out = AutoConfig.for_model(raw["model_type"], **fields).to_dict()
            except Exception as e:  # an unknown model type (older transformers), or fields it refuses
                known = "Unrecognized model" not in str(e)
                if known:
                    warnings.warn(f"transformers could not fill in the defaults of a {raw['model_type']!r} config "
                                  f"({type(e).__name__}: {str(e)[:200]}); using the fields as written", stacklevel=2)
                out = dict(raw)
    if out.get("num_hidden_layers") is None:  # hybrids (Nemotron-H) count their layers by their types
        types = next((out[k] for k in ("layers_block_type", "layer_types") if isinstance(out.get(k), list)), None)
        if types is not None:
            out["num_hidden_layers"] = len(types)
    if out.get("head_dim") is None and _positive(out.get("hidden_size")) and _positive(out.get("num_attention_heads")):
        out["head_dim"] = int(out["hidden_size"]) // int(out["num_attention_heads"])
    return out


def _positive(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0
