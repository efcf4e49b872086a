"""Plans: compile a model from one layout to another (pure), and run the plan (the one copy loop)."""
from .compile import compile
from .execute import MemorySource, Source, execute_memory, run_copies
from .ir import Plan

__all__ = ["compile", "Plan", "execute_memory", "run_copies", "Source", "MemorySource"]
