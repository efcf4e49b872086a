"""Sizes and host-memory caps: one owner for ``"2GB"``-style sizes and for what ``max_memory=`` means.

The offline operations (reshard, import, export, consolidation, ``load_rank``, read-once loads) take
``max_memory=`` and keep the peak resident memory they add, summed over every process they start, under
it. A :class:`MemoryCap` is that budget; an operation that starts ``n`` workers gives each
``cap.split(n)``, and streams tensors larger than its share in pieces of at most ``cap.piece_bytes()``.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from .errors import UclError

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?)\s*([KMGT]I?B|B)?\s*$", re.IGNORECASE)

DEFAULT_MAX_MEMORY = 2 * 10**9  # "modest and stated": docs/memory.md; fits a laptop and a busy node
MIN_MAX_MEMORY = 16 * 2**20  # below this the fixed costs (interpreter, HDF5, buffers) dominate any cap
_PIECE_SHARE = 4  # a piece is at most 1/4 of a share: a read buffer, a write buffer and slack stay inside it


def parse_size(value: int | str) -> int | None:
    """Bytes of an int, ``"64MB"``/``"2GB"`` (decimal) or ``"2GiB"`` (binary); ``None`` if it is no size."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if hasattr(value, "__index__") and not isinstance(value, str):  # numpy integers
        return int(value.__index__())
    if isinstance(value, str) and (m := _SIZE.match(value)):
        return int(float(m.group(1)) * _UNITS[(m.group(2) or "").upper()])
    return None


@dataclass(frozen=True)
class MemoryCap:
    """A budget of host bytes for one operation, over all the processes it starts."""

    total: int

    def split(self, parts: int) -> "MemoryCap":
        """Each of ``parts`` processes' share (the parent's own overhead is in the floor of the cap)."""
        return MemoryCap(max(1, self.total // max(1, parts)))

    def piece_bytes(self, align: int = 1) -> int:
        """The largest buffer one streamed piece may take, a multiple of ``align`` (at least one ``align``)."""
        piece = self.total // _PIECE_SHARE
        return max(align, piece // align * align)

    def __str__(self) -> str:
        return format_size(self.total)


def memory_cap(value: int | str | MemoryCap | None) -> MemoryCap:
    """The cap ``max_memory=`` names: ``None`` is :data:`DEFAULT_MAX_MEMORY`; UCL011 if it is no size or too small."""
    if isinstance(value, MemoryCap):
        return value
    total = DEFAULT_MAX_MEMORY if value is None else parse_size(value)
    if total is None:
        raise UclError(f"max_memory {value!r} is not a size: give bytes or a number with KB, MB, GB "
                       "(decimal) or KiB, MiB, GiB", code="UCL011")
    if total < MIN_MAX_MEMORY:
        raise UclError(f"max_memory {format_size(total)} is below the smallest cap, {format_size(MIN_MAX_MEMORY)}: "
                       "the interpreter and its buffers alone need about that", code="UCL011")
    return MemoryCap(total)


def format_size(nbytes: int) -> str:
    """``2.0 GB``, ``64.0 MB``: decimal units, as the sizes users type."""
    for unit, scale in (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"
