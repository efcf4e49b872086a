"""Sharded HDF5 checkpoint store: one file per rank + manifest.json, atomic commit.

See docs/format.md for the normative on-disk format.
"""
from .commit import CheckpointRoot, cleanup_stale
from .dtypes import (LOGICAL_DTYPES, itemsize, logical_of_numpy_dtype, logical_of_torch_dtype,
                     storage_dtype, to_numpy, to_torch, torch_dtype)
from .format import FORMAT_VERSION, Manifest, file_name, flat_boxes
from .hdf5 import Checkpoint, DatasetInfo
from .writer import CheckpointWriter

__all__ = [
    "Checkpoint", "CheckpointWriter", "CheckpointRoot", "DatasetInfo", "Manifest", "FORMAT_VERSION",
    "LOGICAL_DTYPES", "storage_dtype", "itemsize", "to_numpy", "to_torch", "torch_dtype",
    "logical_of_numpy_dtype", "logical_of_torch_dtype", "file_name", "flat_boxes", "cleanup_stale",
]
