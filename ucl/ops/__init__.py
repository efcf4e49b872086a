"""Operations on checkpoints: save, save_rank, load_rank, reshard (the I/O edge above the store).

``load_rank``, ``iter_rank`` and ``import_checkpoint`` load on first use: a reshard imports neither the
loading path nor the foreign-format readers (start-up is part of every ``ucl reshard``'s cost)."""
from importlib import import_module
from typing import TYPE_CHECKING, Any

from .prepare import expected_datasets, mesh_of, model_of, open_checkpoint
from .reshard import reshard
from .save import save, save_rank
from .stats import IOStats

_LAZY = {"load_rank": "ucl.ops.load", "iter_rank": "ucl.ops.load", "import_checkpoint": "ucl.ops.convert"}

__all__ = ["save", "save_rank", "load_rank", "iter_rank", "reshard", "import_checkpoint", "open_checkpoint", "model_of", "mesh_of",
           "expected_datasets", "IOStats"]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ucl.ops' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value


if TYPE_CHECKING:
    from .convert import import_checkpoint  # noqa: F401
    from .load import iter_rank, load_rank  # noqa: F401
