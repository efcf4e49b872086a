"""Checkpointing a live PyTorch training run (docs/training.md)."""
from .checkpointer import Checkpointer
from .derive import derive

__all__ = ["Checkpointer", "derive"]
