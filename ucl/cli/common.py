"""What the commands share: the rich console, reading ``--dims``, the checkpoint argument (a
Checkpointer root opens its ``latest``), the problems-or-ok report and number formatting."""
from __future__ import annotations

import os
import sys
from pathlib import Path

from ..errors import BindError, Diagnostic, StoreError, UclError, did_you_mean


def console():
    """Rich console for our output. Every user string printed through it goes through ``esc``
    (rich.markup.escape): a path or spec name like ``stdlib:llama`` is not markup, nor an emoji."""
    from rich.console import Console
    return Console(highlight=False, soft_wrap=True, emoji=False)


def esc(value) -> str:
    from rich.markup import escape
    return escape(str(value))


def looks_like_path(text: str) -> bool:
    return text.endswith(".json") or "/" in text or os.sep in text


def parse_dims(spec, text: str | None) -> dict[str, int]:
    """Dims from ``--dims``: name=value pairs or a config.json (or a folder holding one); every
    dim the spec declares must be given (one UCL209 naming those missing, before any binding)."""
    if text is None:
        raise UclError("this command needs --dims (hidden=4096,heads=32,... or a config.json)", code="UCL009")
    if os.path.exists(text):
        return spec.dims_from_config(text)
    if looks_like_path(text):
        raise UclError(f"--dims {text}: no such file or folder (give a config.json, a folder holding one, "
                       "or the dims themselves like hidden=4096,heads=32)", code="UCL009")
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, eq, value = part.partition("=")
        if not eq or not value.strip().lstrip("-").isdigit():
            raise UclError(f"cannot read dims {text!r}: write them like hidden=4096,heads=32 "
                           "or give a config.json", code="UCL009")
        out[name.strip()] = int(value)
    require_dims(spec, out)
    return out


def require_dims(spec, dims: dict[str, int]) -> None:
    """One UCL209 naming every missing dim (and the config fields it is read from), one per
    unknown dim, instead of an "unknown name" for each expression that uses a missing dim."""
    missing = [d for d in spec.dims if d not in dims]
    problems = []
    if missing:
        keys = spec.checked.config_keys
        named = ", ".join(f"{d} ({' | '.join(keys.get(d, (d,)))})" for d in missing)
        problems.append(Diagnostic("UCL209", f"dims not given: {named}", None,
                                   "add them to --dims as name=value, or pass the model's config.json, which "
                                   "holds them under the field names in parentheses"))
    for d in dims:
        if d not in spec.dims:
            problems.append(Diagnostic("UCL209", f"unknown dim {d!r}", None, did_you_mean(d, spec.dims)
                                       or f"the spec declares: {', '.join(spec.dims) or '(none)'}"))
    if problems:
        raise BindError(problems, None, spec.name or spec.filename)


def checkpoint_arg(path: str) -> str:
    """The checkpoint folder a CKPT argument names: ``path`` itself, or the step a checkpoint root's
    ``latest`` names (said on stderr, so stdout stays the command's own output). A file inside a
    checkpoint (a rank file, the manifest) or any other file gets a clear error naming the folder."""
    p = Path(path)
    if p.is_file():
        parent = p.resolve().parent
        if (parent / "manifest.json").is_file():
            raise StoreError(f"{path} is a file inside the checkpoint {parent}: pass the checkpoint folder "
                             f"({parent}), not one of its files", code="UCL401")
        raise StoreError(f"{path} is a file, not a checkpoint: pass a checkpoint folder (one holding a "
                         "manifest.json, or a DeepSpeed, DCP, Megatron or Hugging Face checkpoint folder)", code="UCL401")
    from ..store.root import follow_latest
    step = follow_latest(path)
    if step is None:
        return path
    print(f"ucl: {path} is a checkpoint root; opening its latest, {os.path.basename(step)}", file=sys.stderr)
    return step


def params_of(spec, dims, source: str | None):
    if source is None:
        return spec.synthesize_params(dims)
    from ..formats.hf import read_tensor_names
    return read_tensor_names(source)


def report(con, problems: list[str], failure: str, success: str) -> int:
    """Print problems (exit 1) or the success line (exit 0)."""
    for p in problems:
        con.print(f"[red]error[/]: {esc(p)}")
    if problems:
        con.print(esc(f"{len(problems)} problem(s): {failure}"))
        return 1
    con.print(f"[green]ok[/]: {esc(success)}")
    return 0


def prod(xs) -> int:
    n = 1
    for x in xs:
        n *= int(x)
    return n


def nbytes(shape, dtype: str) -> int:
    from ..dtypes import itemsize
    return prod(shape) * itemsize(dtype)


def size_text(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""


def age_text(seconds: float) -> str:
    return f"{seconds / 3600:g} h" if seconds >= 3600 else f"{seconds:g} s"
