"""Where ``save_pretrained`` puts each element of a model's tensors, found by transformers itself.

transformers 5 reverses its load-time conversion mapping on save: names change (``backbone.``,
``embed_out``), a fused tensor is written in parts (``conv1d`` as ``q/k/v_conv1d``), parts are
written fused (``q/k/v_proj`` as ``query_key_value``), experts are written one by one. Rather than
re-implement those rules, :func:`trace` runs transformers' own ``revert_weight_conversion`` on
*symbolic* tensors (:class:`Sym`) that record, for each element of a saved tensor, which in-memory
tensor and element it is; :func:`invert` then turns that into what a reader needs: each in-memory
tensor as runs ``(saved name, first element, count)`` whose elements, joined in order, are its
row-major elements (one joined Extent, read in place, no copy).

Only ops that move whole row-major runs can be described so: concatenation, stacking, chunking and
splitting on any dim, squeezing a unit dim. A transposed or permuted saved form (``Transpose``,
``PermuteForRope``, ``Interleave``) is no set of byte ranges: :class:`Unsupported` names the op.
"""
from __future__ import annotations

import bisect
import math
from typing import Iterable, Sequence

Run = tuple[str, int, int]  # (tensor name, first element, count)
MAX_RUNS = 1 << 20  # a saved form that needs more runs than this is refused, not described


class Unsupported(AttributeError):
    """The save conversion does something to a tensor that is not a move of whole runs (a transpose,
    a permutation, arithmetic); an AttributeError so ``hasattr`` probes in transformers stay quiet."""


def _merge(runs: Iterable[Run]) -> tuple[Run, ...]:
    out: list[Run] = []
    for name, start, count in runs:
        if count == 0:
            continue
        if out and out[-1][0] == name and out[-1][1] + out[-1][2] == start:
            out[-1] = (name, out[-1][1], out[-1][2] + count)
        else:
            out.append((name, start, count))
    if len(out) > MAX_RUNS:
        raise Unsupported(f"the saved form needs more than {MAX_RUNS:,} runs for one tensor")
    return tuple(out)


class Sym:
    """A tensor of ``shape`` whose row-major elements are ``runs`` of named tensors, joined in order."""

    def __init__(self, shape: Sequence[int], runs: Sequence[Run]):
        self.shape = tuple(int(x) for x in shape)
        self.runs = tuple(runs)
        self._starts = [0]
        for _, _, count in self.runs:
            self._starts.append(self._starts[-1] + count)
        if self._starts[-1] != math.prod(self.shape):
            raise Unsupported(f"runs of {self._starts[-1]} elements for shape {list(self.shape)}")

    # -- the Tensor methods transformers' ops call ----------------------------------------------
    def size(self, dim: int | None = None):
        return self.shape if dim is None else self.shape[dim]

    def dim(self) -> int:
        return len(self.shape)

    def numel(self) -> int:
        return math.prod(self.shape)

    def contiguous(self) -> "Sym":
        return self

    def squeeze(self, dim: int | None = None) -> "Sym":
        dims = [d for d, n in enumerate(self.shape) if n == 1] if dim is None else [dim % max(1, len(self.shape))]
        return Sym([n for d, n in enumerate(self.shape) if d not in dims or n != 1], self.runs)

    def unsqueeze(self, dim: int) -> "Sym":
        dim = dim % (len(self.shape) + 1)
        return Sym(self.shape[:dim] + (1,) + self.shape[dim:], self.runs)

    def __getattr__(self, name: str):
        raise Unsupported(f"Tensor.{name}")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        if name in ("cat", "concat", "concatenate"):
            return _cat(list(args[0]), _arg(args, kwargs, 1, "dim", 0))
        if name == "stack":
            dim = _arg(args, kwargs, 1, "dim", 0)
            return _cat([t.unsqueeze(dim) for t in args[0]], dim)
        if name == "chunk":
            t, n, dim = args[0], _arg(args, kwargs, 1, "chunks", None), _arg(args, kwargs, 2, "dim", 0)
            size = -(-t.shape[dim] // n)
            return _split(t, [min(size, t.shape[dim] - i) for i in range(0, t.shape[dim], size)], dim)
        if name in ("split", "split_with_sizes"):
            t, sizes, dim = args[0], _arg(args, kwargs, 1, "split_size_or_sections", None), _arg(args, kwargs, 2, "dim", 0)
            if isinstance(sizes, int):
                sizes = [min(sizes, t.shape[dim] - i) for i in range(0, t.shape[dim], sizes)]
            return _split(t, list(sizes), dim)
        if name == "unbind":
            t, dim = args[0], _arg(args, kwargs, 1, "dim", 0)
            return tuple(p.squeeze(dim) for p in _split(t, [1] * t.shape[dim], dim))
        raise Unsupported(f"torch.{name}")

    # -- element ranges ----------------------------------------------------------------------------
    def flat(self, a: int, b: int) -> list[Run]:
        """The runs of elements [a, b) of the row-major flattening."""
        out: list[Run] = []
        i = bisect.bisect_right(self._starts, a) - 1
        while a < b:
            name, start, count = self.runs[i]
            off = a - self._starts[i]
            take = min(count - off, b - a)
            out.append((name, start + off, take))
            a += take
            i += 1
        return out


def _arg(args, kwargs, i, key, default):
    return args[i] if len(args) > i else kwargs.get(key, default)


def _cat(parts: list[Sym], dim: int) -> Sym:
    nd = len(parts[0].shape)
    dim %= nd
    if any(len(p.shape) != nd or p.shape[:dim] + p.shape[dim + 1:] != parts[0].shape[:dim] + parts[0].shape[dim + 1:]
           for p in parts):
        raise Unsupported("torch.cat of tensors whose shapes do not fit")
    outer = math.prod(parts[0].shape[:dim])
    runs: list[Run] = []
    for o in range(outer):
        for p in parts:
            inner = math.prod(p.shape[dim:])
            runs.extend(p.flat(o * inner, (o + 1) * inner))
    shape = parts[0].shape[:dim] + (sum(p.shape[dim] for p in parts),) + parts[0].shape[dim + 1:]
    return Sym(shape, _merge(runs))


def _split(t: Sym, sizes: list[int], dim: int) -> tuple[Sym, ...]:
    dim %= len(t.shape)
    if sum(sizes) != t.shape[dim]:
        raise Unsupported(f"torch.split into {sizes} of a dim of {t.shape[dim]}")
    outer, inner = math.prod(t.shape[:dim]), math.prod(t.shape[dim:])
    row = math.prod(t.shape[dim + 1:])
    out, at = [], 0
    for size in sizes:
        runs: list[Run] = []
        for o in range(outer):
            runs.extend(t.flat(o * inner + at * row, o * inner + (at + size) * row))
        out.append(Sym(t.shape[:dim] + (size,) + t.shape[dim + 1:], _merge(runs)))
        at += size
    return tuple(out)


def trace(model, shapes: dict[str, tuple[int, ...]]) -> dict[str, Sym]:
    """{saved name: Sym over the in-memory names} of what ``save_pretrained`` writes for the tensors
    ``shapes`` (in-memory name -> shape) of ``model`` (a meta-device instance is enough)."""
    from transformers.core_model_loading import revert_weight_conversion
    symbolic = {n: Sym(s, ((n, 0, math.prod(s)),) if math.prod(s) else ()) for n, s in shapes.items()}
    saved = revert_weight_conversion(model, symbolic)
    for name, t in saved.items():
        if not isinstance(t, Sym):
            raise Unsupported(f"{name} is saved as {type(t).__name__}, not moved from the model's tensors")
    return saved


def invert(saved: dict[str, Sym], shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[Run, ...]]:
    """{in-memory name: runs over saved names} from :func:`trace`'s answer: every element of every
    in-memory tensor in exactly one saved tensor, else :class:`Unsupported` names the first that is not."""
    pieces: dict[str, list[tuple[int, str, int, int]]] = {n: [] for n in shapes}
    for sname, t in saved.items():
        at = 0
        for mname, start, count in t.runs:
            if mname not in pieces:
                raise Unsupported(f"{sname} holds elements of {mname}, which the model does not save")
            pieces[mname].append((start, sname, at, count))
            at += count
    out: dict[str, tuple[Run, ...]] = {}
    for mname, got in pieces.items():
        got.sort()
        at = 0
        for start, _, _, count in got:
            if start != at:
                raise Unsupported(f"{mname}: elements from {at} are {'saved twice' if start < at else 'not saved'}")
            at += count
        if at != math.prod(shapes[mname]):
            raise Unsupported(f"{mname}: {at} of its {math.prod(shapes[mname])} elements are saved")
        out[mname] = _merge((sname, sat, count) for _, sname, sat, count in got)
    return out
