"""Spec: a checked .ucl module. Load from a file, from text, or from the standard library."""
from __future__ import annotations

from functools import cached_property
from pathlib import Path
from typing import Iterable, Mapping

from . import ast
from .check import Checked, check
from .errors import SpecError, Diagnostic
from .parse import parse
from .paths import data_dir


class Spec:
    """A parsed and statically checked spec. Bind it to a model with :meth:`bind`."""

    def __init__(self, module: ast.Module, name: str | None = None):
        self.module = module
        self.name = name
        self.checked: Checked = check(module)

    # -- constructors ----------------------------------------------------------------------
    @classmethod
    def from_text(cls, text: str, filename: str = "<spec>", name: str | None = None) -> "Spec":
        return cls(parse(text, filename), name)

    @classmethod
    def from_file(cls, path: str | Path) -> "Spec":
        path = Path(path)
        try:
            text = path.read_text()
        except OSError as e:
            raise SpecError([Diagnostic("UCL000", f"cannot read spec: {e.strerror}")], None, str(path)) from None
        return cls.from_text(text, str(path))

    # -- views -------------------------------------------------------------------------------
    @property
    def text(self) -> str:
        return self.module.source

    @property
    def filename(self) -> str:
        return self.module.filename

    @property
    def dims(self) -> list[str]:
        return list(self.checked.dims)

    @property
    def axes(self) -> list[str]:
        return list(self.checked.axes)

    @property
    def kinds(self) -> list[str]:
        return list(self.checked.kinds)

    def dims_from_config(self, config: "Mapping | str | Path") -> dict[str, int]:
        """Read this spec's dims from a Hugging Face ``config.json`` (a dict, a file, or a folder
        holding one), using the ``dims x from field | other_field`` declarations."""
        import json
        if not isinstance(config, Mapping):
            path = Path(config)
            if path.is_dir():
                path = path / "config.json"
            try:
                config = json.loads(path.read_text())
            except (OSError, ValueError) as e:
                raise SpecError([Diagnostic("UCL211", f"cannot read config {path}: {e}")], None, str(path)) from None
        out, missing = {}, []
        for dim, keys in self.checked.config_keys.items():
            for k in keys:
                if config.get(k) is not None:
                    out[dim] = int(config[k])
                    break
            else:
                missing.append(f"{dim} (from {' | '.join(keys)})")
        if missing:
            raise SpecError([Diagnostic("UCL211", f"the config has no value for: {', '.join(missing)}")],
                            None, self.filename)
        return out

    def bind(self, dims: Mapping[str, int], params: Mapping[str, Iterable[int]] | Iterable[tuple[str, Iterable[int]]],
             frozen: Iterable[str] = ()):
        """Match every parameter to its rule and check shapes. ``params`` is ordered (model order)."""
        from .model import Model
        return Model(self, dims, params, frozen)

    def __repr__(self):
        return f"Spec({self.name or self.filename!r})"


def stdlib_names() -> list[str]:
    return sorted(p.stem for p in data_dir("stdlib_patterns").glob("*.ucl"))


def load_spec(source: "str | Path | Spec") -> Spec:
    """A spec from ``stdlib:NAME``, a path to a ``.ucl`` file, or spec text."""
    if isinstance(source, Spec):
        return source
    if isinstance(source, Path):
        return Spec.from_file(source)
    if source.startswith("stdlib:"):
        name = source.split(":", 1)[1]
        path = data_dir("stdlib_patterns") / f"{name}.ucl"
        if not path.is_file():
            from .errors import did_you_mean
            hint = did_you_mean(name, stdlib_names())
            raise SpecError([Diagnostic("UCL010", f"no standard spec named {name!r}", None,
                                        hint or f"available: {', '.join(stdlib_names())}")], None, source)
        spec = Spec.from_file(path)
        spec.name = source
        return spec
    if "\n" not in source and source.endswith(".ucl"):
        return Spec.from_file(source)
    return Spec.from_text(source)
