"""Mesh: named axes with sizes, slowest first; ranks are numbered row-major (like a torch DeviceMesh)."""
from __future__ import annotations

import math
import re
from functools import cached_property
from typing import Iterable, Mapping

import numpy as np

from ..errors import MeshError, did_you_mean

MAX_RANKS = 1 << 24  # ranks a mesh may have: checked before anything is made per rank


class Mesh:
    """``Mesh(pp=2, dp=2, tp=2)``: 8 ranks, tp fastest (Megatron's order).

    ``Mesh()`` (no axes) is the *universal* layout: every tensor whole, unpadded, under its global name.
    """

    __slots__ = ("axes", "__dict__")

    def __init__(self, axes: Mapping[str, int] | Iterable[tuple[str, int]] = (), /, **sizes: int):
        items = list(axes.items() if isinstance(axes, Mapping) else axes) + list(sizes.items())
        seen = set()
        for name, size in items:
            if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z_]\w*", name):
                raise MeshError(f"bad mesh axis name {name!r}", code="UCL301")
            if name in seen:
                raise MeshError(f"mesh axis {name!r} given twice", code="UCL301")
            if not isinstance(size, (int, np.integer)) or isinstance(size, bool) or size < 1:
                raise MeshError(f"mesh axis {name}={size!r}: a size must be a positive integer", code="UCL302")
            seen.add(name)
        total = 1
        for _, size in items:  # Python ints: an int64 product of huge sizes could wrap to a small one
            total *= int(size)
        if total > MAX_RANKS:
            shown = ",".join(f"{n}={int(s)}" for n, s in items)
            raise MeshError(f"mesh {shown if len(shown) <= 200 else shown[:200] + '...'} has {total:,} ranks, more "
                            f"than the {MAX_RANKS:,} (2**24) a mesh may have", code="UCL305")
        self.axes: tuple[tuple[str, int], ...] = tuple((n, int(s)) for n, s in items)

    @classmethod
    def parse(cls, text: str) -> "Mesh":
        """``"pp=2,dp=2,tp=2"``; ``"universal"`` for the universal layout."""
        text = text.strip()
        if text == "universal":
            return cls()
        if not text:
            raise MeshError("empty mesh: write it like pp=2,dp=2,tp=2, or 'universal' for the consolidated "
                            "layout", code="UCL301")
        items = []
        for part in text.split(","):
            m = re.fullmatch(r"\s*([A-Za-z_]\w*)\s*=\s*(\d+)\s*", part)
            if not m:
                number = re.fullmatch(r"\s*([A-Za-z_]\w*)\s*=\s*(-?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)\s*", part)
                if number and len(number.group(2)) <= 40:  # tp=-1, dp=2.5: the message of tp=0
                    raise MeshError(f"mesh axis {number.group(1)}={number.group(2)}: a size must be a positive "
                                    "integer", code="UCL302")
                shown = text if len(text) <= 200 else text[:200] + "..."
                raise MeshError(f"cannot read mesh {shown!r}: write it like pp=2,dp=2,tp=2", code="UCL301")
            if len(m.group(2).lstrip("0")) > 18:  # beyond any mesh, and int() refuses 4,300+ digits
                raise MeshError(f"mesh axis {m.group(1)}={m.group(2)[:20]}...: more than the {MAX_RANKS:,} "
                                "(2**24) ranks a mesh may have", code="UCL305")
            items.append((m.group(1), int(m.group(2))))
        return cls(items)

    # -- queries ---------------------------------------------------------------------------
    @property
    def names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self.axes)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(s for _, s in self.axes)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def is_universal(self) -> bool:
        return not self.axes

    def axis_size(self, name: str) -> int:
        """Size of an axis; an axis the mesh does not name has size 1."""
        for n, s in self.axes:
            if n == name:
                return s
        return 1

    @cached_property
    def strides(self) -> dict[str, int]:
        out, stride = {}, 1
        for name, size in reversed(self.axes):
            out[name] = stride
            stride *= size
        return out

    def coords(self, rank: int) -> dict[str, int]:
        if not 0 <= rank < self.size:
            raise MeshError(f"rank {rank} is outside a mesh of {self.size} ranks", code="UCL303")
        return {n: (rank // self.strides[n]) % s for n, s in self.axes}

    def rank(self, **coords: int) -> int:
        return sum(coords.get(n, 0) * self.strides[n] for n, _ in self.axes)

    def ranks_where(self, fixed: Mapping[str, int]) -> np.ndarray:
        """All ranks whose coordinates match ``fixed`` (other axes free), ascending."""
        ranks = np.zeros(1, dtype=np.int64)
        for name, size in self.axes:
            if name in fixed:
                ranks = ranks + fixed[name] * self.strides[name]
            else:
                ranks = (ranks[:, None] + np.arange(size, dtype=np.int64)[None, :] * self.strides[name]).ravel()
        return np.sort(ranks)

    def check_axes(self, declared: Iterable[str]) -> None:

        declared = list(declared)
        for name in self.names:
            if name not in declared:
                same = [d for d in declared if d.lower() == name.lower()]  # TP for tp
                hint = f"did you mean {same[0]}? (axis names are case-sensitive)" if same else did_you_mean(name, declared)
                raise MeshError(f"mesh axis {name!r} is not declared by the spec (it declares: "
                                f"{', '.join(declared) or 'none'})" + (f"; {hint}" if hint else ""), code="UCL304")

    # -- value semantics ----------------------------------------------------------------------
    def __eq__(self, other):
        return isinstance(other, Mesh) and self.axes == other.axes

    def __hash__(self):
        return hash(self.axes)

    def __str__(self):
        return ",".join(f"{n}={s}" for n, s in self.axes) or "universal"

    def __repr__(self):
        return f"Mesh({', '.join(f'{n}={s}' for n, s in self.axes)})"

    def to_json(self) -> list:
        return [[n, s] for n, s in self.axes]

    @classmethod
    def from_json(cls, data) -> "Mesh":
        return cls([(str(n), int(s)) for n, s in data])


UNIVERSAL = Mesh()


def as_mesh(mesh: "Mesh | str | Mapping[str, int]") -> Mesh:
    """A Mesh from a Mesh, a mesh string (``"pp=2,dp=2,tp=2"``, ``"universal"``) or a mapping."""
    if isinstance(mesh, Mesh):
        return mesh
    if isinstance(mesh, str):
        return Mesh.parse(mesh)
    if isinstance(mesh, Mapping):
        return Mesh(mesh)
    raise MeshError(f"expected a Mesh or a mesh string like 'pp=2,dp=2,tp=2', got {type(mesh).__name__}",
                    code="UCL301")
