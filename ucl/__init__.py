"""ucl: universal, reshardable checkpoints for distributed LLM training."""
from .errors import UclError, SpecError, BindError, MeshError, PlanError, StoreError
from .mesh import Mesh, UNIVERSAL
from .spec import Spec, load_spec
from .plan import Plan, compile
from .execute import execute_memory

__all__ = ["UclError", "SpecError", "BindError", "MeshError", "PlanError", "StoreError", "Mesh", "UNIVERSAL",
           "Spec", "load_spec", "Plan", "compile", "execute_memory"]
__version__ = "0.1.0"
