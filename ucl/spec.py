"""Spec: a checked .ucl module. Load from a file, from text, or from the standard library."""
from __future__ import annotations

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

    def synthesize_params(self, dims: Mapping[str, int]) -> dict[str, tuple[int, ...]]:
        """Parameter names and shapes from the spec alone, for planning from metadata: every layout
        rule must declare its shape, and each capture must be spread by an ``index c of N`` so
        its values are known. Order: rules before the first rule with captures, then the captured
        rules index-major (layer 0's rules, then layer 1's...), then the remaining rules."""
        from .expr import ExprError, evaluate
        import itertools
        from . import ast as A
        env = dict(dims)
        problems = []
        for name, expr in self.checked.lets:
            try:
                env[name] = evaluate(expr, env)
            except ExprError:
                pass
        counts: dict[str, int] = {}
        for rule in self.checked.rules + self.checked.placements:
            for t in rule.transforms:
                if isinstance(t, A.Index):
                    try:
                        counts[t.capture.name] = evaluate(t.count, env)
                    except ExprError as e:
                        problems.append(e.diagnostic)
        head, body, tail = [], [], []
        for order, rule in enumerate(self.checked.rules):
            if rule.shape is None or "*" in rule.pattern.text:
                problems.append(Diagnostic("UCL212", f"rule {rule.pattern.text!r} needs a declared shape and no "
                                           "globs to synthesize its parameters; pass the parameters instead",
                                           rule.pattern.span))
                continue
            try:
                shape = tuple(evaluate(e, env) for e in rule.shape)
            except ExprError as e:
                problems.append(e.diagnostic)
                continue
            caps = rule.pattern.captures
            if not caps:
                (tail if body else head).append((rule.pattern.text, shape))
                continue
            missing = [c for c in caps if c not in counts]
            if missing:
                problems.append(Diagnostic("UCL212", f"capture {{{missing[0]}}} has no `index {missing[0]} of N` "
                                           "saying how many values it takes", rule.pattern.span))
                continue
            for values in itertools.product(*(range(counts[c]) for c in caps)):
                name = rule.pattern.text
                for c, v in zip(caps, values):
                    name = name.replace("{" + c + "}", str(v))
                body.append((values, order, name, shape))
        if problems:
            raise SpecError(problems, self.text, self.filename)
        body.sort(key=lambda x: (x[0], x[1]))
        return dict(head + [(n, s) for _, _, n, s in body] + tail)

    def bind(self, dims: Mapping[str, int], params: Mapping[str, Iterable[int]] | Iterable[tuple[str, Iterable[int]]],
             frozen: Iterable[str] = ()):
        """Match every parameter to its rule and check shapes. ``params`` is ordered (model order)."""
        from .model import Model
        return Model(self, dims, params, frozen)

    def __repr__(self):
        return f"Spec({self.name or self.filename!r})"


def _is_file(text: str) -> bool:
    try:
        return Path(text).is_file()
    except (OSError, ValueError):  # too long or not a path at all: it is spec text
        return False


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
    if "\n" not in source and (source.endswith(".ucl") or _is_file(source)):
        return Spec.from_file(source)  # a missing .ucl path gets "cannot read spec", not a parse error
    return Spec.from_text(source)
