"""Sharded HDF5 checkpoint store: one file per rank + manifest.json, atomic commit.

See docs/format.md for the normative on-disk format. Only ``h5`` imports h5py.
"""
from .atomic import Leftover, cleanup_stale, collect_garbage
from .like import CheckpointLike
from .manifest import FORMAT_VERSION, READ_VERSION, DatasetInfo, Manifest, file_name
from .reader import Checkpoint
from .root import CheckpointRoot
from .source import StoreSource
from .writer import CheckpointWriter

__all__ = [
    "Checkpoint", "CheckpointLike", "CheckpointWriter", "CheckpointRoot", "DatasetInfo", "Manifest", "FORMAT_VERSION", "READ_VERSION", "StoreSource",
    "file_name", "cleanup_stale", "collect_garbage", "Leftover",
]
