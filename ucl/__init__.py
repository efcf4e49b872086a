"""ucl: universal, reshardable checkpoints for distributed LLM training.

    spec = ucl.load_spec("stdlib:llama")                 # or a .ucl file, or spec text
    model = spec.bind(dims, params)                      # names and shapes checked against the spec
    plan = ucl.compile(model, ucl.Mesh(pp=2, dp=2, tp=2), ucl.Mesh(tp=4, dp=2))
    ucl.reshard("ckpt/step_100", "ckpt/step_100_tp4", to="tp=4,dp=2")
    local = ucl.load_rank("ckpt/step_100", mesh="tp=4,dp=2", rank=3)
    ucl.import_checkpoint("ds_run/", "ckpt/imported")   # DeepSpeed, DCP, Megatron, HF (also read in place)

Names are imported on first use: ``import ucl`` is cheap and never imports torch.
"""
from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> module that owns it
_EXPORTS = {
    "UclError": "ucl.errors", "SpecError": "ucl.errors", "BindError": "ucl.errors", "MeshError": "ucl.errors",
    "PlanError": "ucl.errors", "StoreError": "ucl.errors",
    "load_spec": "ucl.lang.spec", "Spec": "ucl.lang.spec",
    "Mesh": "ucl.layout.mesh", "UNIVERSAL": "ucl.layout.mesh",
    "compile": "ucl.plan.compile", "Plan": "ucl.plan.ir", "execute_memory": "ucl.plan.execute",
    "save": "ucl.ops.save", "save_rank": "ucl.ops.save", "load_rank": "ucl.ops.load", "iter_rank": "ucl.ops.load", "reshard": "ucl.ops.reshard",
    "import_checkpoint": "ucl.ops.convert",
    "open": "ucl.ops.prepare", "Checkpointer": "ucl.train.checkpointer",
}
_RENAMED = {"open": "open_checkpoint"}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ucl' has no attribute {name!r}")
    value = getattr(import_module(module), _RENAMED.get(name, name))
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


if TYPE_CHECKING:  # for type checkers and IDEs; at run time the names above load lazily
    from .errors import BindError, MeshError, PlanError, SpecError, StoreError, UclError  # noqa: F401
    from .lang.spec import Spec, load_spec  # noqa: F401
    from .layout.mesh import UNIVERSAL, Mesh  # noqa: F401
    from .ops.convert import import_checkpoint  # noqa: F401
    from .ops.load import iter_rank, load_rank  # noqa: F401
    from .ops.prepare import open_checkpoint as open  # noqa: F401
    from .ops.reshard import reshard  # noqa: F401
    from .ops.save import save, save_rank  # noqa: F401
    from .plan.compile import compile  # noqa: F401
    from .plan.execute import execute_memory  # noqa: F401
    from .plan.ir import Plan  # noqa: F401
    from .train.checkpointer import Checkpointer  # noqa: F401
