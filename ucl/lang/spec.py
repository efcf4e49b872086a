"""Spec: a checked .ucl module. Load from a file, from text, or from the standard library."""
from __future__ import annotations

from pathlib import Path
from typing import Iterable, Mapping

from . import ast, parsed
from .check import Checked, check
from ..errors import BindError, Diagnostic, SpecError, UclError, closest
from ..files import read_bounded
from .limits import check_size, token_budget
from .stdlib import PREFIX, stdlib_names, stdlib_path


MAX_SPEC_BYTES = 16 << 20  # the largest specs are a few KB; anything near this is not a spec


class Spec:
    """A parsed and statically checked spec. Bind it to a model with :meth:`bind`."""

    def __init__(self, module: ast.Module, name: str | None = None):
        self.module = module
        self.name = name
        self.checked: Checked = check(module)

    # -- constructors ----------------------------------------------------------------------
    @classmethod
    def from_text(cls, text: str, filename: str = "<spec>", name: str | None = None,
                  params: int = 0, cache: bool = False) -> "Spec":
        """``params``: how many parameters the text describes, where a parameter list comes with it
        (a manifest): such a spec may be longer in proportion (``lang.limits.token_budget``).
        ``cache``: take the syntax tree from the cache of parsed specs (``lang.parsed``) where it
        holds this text, and keep it there otherwise (a checkpoint's spec, parsed by every command
        that opens it)."""
        max_tokens = token_budget(params)
        if cache and isinstance(text, str):
            check_size(text, filename, max_tokens)  # (what parse checks first, before any cache)
            module = parsed.load(text, filename)
            if module is not None:
                try:
                    return cls(module, name)
                except Exception:  # a bad entry: parsed anew below, and replaced
                    pass
        from .parse import parse  # lark: imported only where a text is parsed
        spec = cls(parse(text, filename, max_tokens), name)
        if cache:
            parsed.store(text, spec.module)
        return spec

    @classmethod
    def from_file(cls, path: str | Path) -> "Spec":
        path = Path(path)
        if path.is_dir():
            raise SpecError([Diagnostic("UCL000", "is a folder, not a spec file", None,
                                        "give a .ucl file, stdlib:NAME or spec text")], None, str(path))
        def error(message: str) -> SpecError:
            return SpecError([Diagnostic("UCL000", f"cannot read spec: {message}")], None, str(path))

        # a FIFO, a device or a huge file is refused before a byte is read
        data = read_bounded(path, limit=MAX_SPEC_BYTES, what="spec", error=error)
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            line = data.count(b"\n", 0, e.start) + 1
            raise SpecError([Diagnostic("UCL000", f"not UTF-8 text: byte {e.start} (line {line}) is "
                                        f"0x{data[e.start]:02x}", None, "a spec is UTF-8 text")],
                            None, str(path)) from None
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
        out, missing, bad = {}, [], []
        for dim, keys in self.checked.config_keys.items():
            for k in keys:
                v = fields.get(k)
                if v is None:  # absent, or null (Mixtral's head_dim): the next field may have it
                    continue
                # bools (tie_word_embeddings) count as 0 / 1; anything else that is not an integer
                # (1000.5, 1000.0, "1000") is an error naming the field, never truncated
                if isinstance(v, int):
                    out[dim] = int(v)
                else:
                    bad.append(f"{dim} from {k} = {v!r} is not an integer")
                break
            else:
                missing.append(f"{dim} (from {' | '.join(keys)})")
        if bad:
            where = config if not isinstance(config, Mapping) else "the config"
            raise BindError([Diagnostic("UCL211", f"{where}: {'; '.join(bad)}", None,
                                        "dims are whole numbers; fix the config or give those dims by hand "
                                        "(--dims name=value,...)")], None, self.filename)
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
    if not isinstance(source, str):
        raise SpecError([Diagnostic("UCL000", f"a spec is text, a path or stdlib:NAME, not {type(source).__name__}")])
    if source.startswith(PREFIX):
        spec = Spec.from_file(stdlib_path(source))
        spec.name = source
        return spec
    if _looks_like_path(source):
        return Spec.from_file(source)  # a folder or a missing .ucl path gets a clear error, not a parse error
    if source and not any(c.isspace() or c == ":" for c in source):
        raise _no_such_file(source)  # one word is never a spec (a rule has a ':'): a name that is no file
    return Spec.from_text(source)


def _no_such_file(word: str) -> UclError:
    """``llama`` (no file of that name): one line that points at ``stdlib:llama`` when it is near one."""
    names = stdlib_names()
    stem = Path(word).stem if len(word) < 256 else word
    match = stem if stem in names else closest(stem, names)
    shown = word if len(word) <= 80 else word[:80] + "..."
    hint = f"did you mean {PREFIX}{match}?" if match else "a spec is a .ucl file, stdlib:NAME or spec text"
    return UclError(f"no file {shown!r}; {hint}", code="UCL000")
