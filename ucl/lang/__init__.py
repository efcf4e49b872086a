"""The language: parse (lark), check, evaluate expressions; ``Spec`` is a checked module."""
from .spec import Spec, load_spec
from .stdlib import stdlib_names

__all__ = ["Spec", "load_spec", "stdlib_names"]
