"""Layouts: meshes, the per-dim algebra, boxes, binding a spec to a model, lowering to shard maps."""
from .bind import Model
from .lower import ShardMap, lower
from .mesh import UNIVERSAL, Mesh

__all__ = ["Mesh", "UNIVERSAL", "Model", "ShardMap", "lower"]
