"""Spec: a checked .ucl module. Load from a file, from text, or from the standard library."""
from __future__ import annotations

from pathlib import Path
from typing import Iterable, Mapping

from . import ast
from .check import Checked, check
from ..errors import BindError, Diagnostic, SpecError
from .parse import parse
from .stdlib import PREFIX, stdlib_path


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
        if path.is_dir():
            raise SpecError([Diagnostic("UCL000", "is a folder, not a spec file", None,
                                        "give a .ucl file, stdlib:NAME or spec text")], None, str(path))
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
        """This spec's dims from a model config (a dict, a ``PretrainedConfig``, a ``config.json`` or
        a folder holding one), through the ``dims x from field | other_field`` declarations. The
        config is read by the one config reader (``ucl.model_config``): class defaults and a derived
        ``head_dim`` are filled in, so real Llama-2 and Mixtral configs work."""
        from ..model_config import load_config
        fields = load_config(config)
        out, missing = {}, []
        for dim, keys in self.checked.config_keys.items():
            for k in keys:
                v = fields.get(k)
                if isinstance(v, int):  # bools (tie_word_embeddings) count as 0 / 1
                    out[dim] = int(v)
                    break
            else:
                missing.append(f"{dim} (from {' | '.join(keys)})")
        if missing:
            where = config if not isinstance(config, Mapping) else "the config"
            raise BindError([Diagnostic("UCL211", f"{where} has no value for: {', '.join(missing)}", None,
                                        "give those dims by hand (--dims name=value,...), or use a spec whose "
                                        "`dims ... from` names fields this config has")], None, self.filename)
        return out

    def synthesize_params(self, dims: Mapping[str, int]) -> dict[str, tuple[int, ...]]:
        """Parameter names and shapes from the spec alone, for planning from metadata (see
        ``ucl.layout.bind.synthesize_params``)."""
        from ..layout.bind import synthesize_params
        return synthesize_params(self, dims)

    def bind(self, dims: Mapping[str, int], params: Mapping[str, Iterable[int]] | Iterable[tuple[str, Iterable[int]]],
             frozen: Iterable[str] = ()):
        """Match every parameter to its rule and check shapes. ``params`` is ordered (model order)."""
        from ..layout.bind import Model  # the public face of binding; layout does not import lang.spec
        return Model(self, dims, params, frozen)

    def __repr__(self):
        return f"Spec({self.name or self.filename!r})"


def _looks_like_path(text: str) -> bool:
    """One line without spec syntax that names something on disk, or ends in .ucl."""
    if not text.strip() or "\n" in text or ":" in text.replace("\\", "/").split("/")[-1]:
        return False
    if text.endswith(".ucl"):
        return True
    try:
        return Path(text).exists()
    except (OSError, ValueError):  # too long or not a path at all: it is spec text
        return False


def load_spec(source: "str | Path | Spec") -> Spec:
    """A spec from ``stdlib:NAME``, a path to a ``.ucl`` file, or spec text."""
    if isinstance(source, Spec):
        return source
    if isinstance(source, Path):
        return Spec.from_file(source)
    if source.startswith(PREFIX):
        spec = Spec.from_file(stdlib_path(source))
        spec.name = source
        return spec
    if _looks_like_path(source):
        return Spec.from_file(source)  # a folder or a missing .ucl path gets a clear error, not a parse error
    return Spec.from_text(source)
