"""Operations on checkpoints: save, save_rank, load_rank, reshard (the I/O edge above the store)."""
from .convert import import_checkpoint
from .load import iter_rank, load_rank
from .prepare import expected_datasets, mesh_of, model_of, open_checkpoint
from .reshard import reshard
from .save import save, save_rank
from .stats import IOStats

__all__ = ["save", "save_rank", "load_rank", "iter_rank", "reshard", "import_checkpoint", "open_checkpoint", "model_of", "mesh_of",
           "expected_datasets", "IOStats"]
