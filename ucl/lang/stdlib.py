"""The standard library of specs: ``stdlib:NAME`` names a file of ``stdlib_patterns/``."""
from __future__ import annotations

from pathlib import Path

from ..errors import Diagnostic, SpecError, did_you_mean
from .resources import data_dir

PREFIX = "stdlib:"


def stdlib_names() -> list[str]:
    """Names of the standard specs, sorted (``llama``, ``megatron_gpt``...)."""
    return sorted(p.stem for p in data_dir("stdlib_patterns").glob("*.ucl"))


def stdlib_path(source: str) -> Path:
    """The file of ``stdlib:NAME``; an unknown name is a SpecError (UCL010) with a suggestion."""
    name = source[len(PREFIX):] if source.startswith(PREFIX) else source
    path = data_dir("stdlib_patterns") / f"{name}.ucl"
    if not path.is_file():
        names = stdlib_names()
        hint = did_you_mean(name, names)
        raise SpecError([Diagnostic("UCL010", f"no standard spec named {name!r}", None,
                                    hint or f"available: {', '.join(names)}")], None, source)
    return path
