"""Where the grammar and the standard library live, installed or in a source checkout."""
from __future__ import annotations

from pathlib import Path

_PKG = Path(__file__).resolve().parent.parent  # the ucl package


def data_dir(name: str) -> Path:
    """``grammar`` or ``stdlib_patterns``: inside the wheel they are shipped as ``ucl/_data/<name>``;
    in a source checkout (and editable installs) they sit at the repository's top level."""
    for candidate in (_PKG / "_data" / name, _PKG.parent / name):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"ucl data folder {name!r} not found next to {_PKG}")
