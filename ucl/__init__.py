"""ucl: universal, reshardable checkpoints for distributed LLM training.

    spec = ucl.load_spec("stdlib:llama")                 # or a .ucl file, or spec text
    model = spec.bind(dims, params)                      # names and shapes checked against the spec
    plan = ucl.compile(model, ucl.Mesh(pp=2, dp=2, tp=2), ucl.Mesh(tp=4, dp=2))
    ucl.reshard("ckpt/step_100", "ckpt/step_100_tp4", to=ucl.Mesh(tp=4, dp=2))
    local = ucl.load_rank("ckpt/step_100", mesh=ucl.Mesh(tp=4, dp=2), rank=3)
"""
from .errors import BindError, MeshError, PlanError, SpecError, StoreError, UclError
from .mesh import UNIVERSAL, Mesh
from .spec import Spec, load_spec
from .plan import Plan, compile
from .execute import execute_memory
from .checkpoint import load_rank, open_checkpoint as open, reshard, save, save_rank

__all__ = ["load_spec", "Spec", "Mesh", "UNIVERSAL", "compile", "Plan", "execute_memory", "save", "save_rank",
           "load_rank", "reshard", "open", "UclError", "SpecError", "BindError", "MeshError", "PlanError",
           "StoreError"]
__version__ = "0.1.0"
