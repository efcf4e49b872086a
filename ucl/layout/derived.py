"""Caches of what is derived from one object (a bound ``Model``, a ``ShardMap``) by pure functions
of other modules: lowering, plan proofs, plans, replica sets. Each such module defines its own
cache class (private to it, so no other module can name it, let alone write its entries), with
typed fields and typed keys, and finds its instance with ``obj.derived.of(ThatClass)``. The caches
live exactly as long as the object they hang on."""
from __future__ import annotations

from typing import TypeVar

C = TypeVar("C")


class Derived:
    """One cache per owning class, made on first use by calling the class with no arguments."""

    __slots__ = ("_by_owner",)

    def __init__(self):
        self._by_owner: dict[type, object] = {}

    def of(self, owner: type[C]) -> C:
        found = self._by_owner.get(owner)
        if found is None:
            found = self._by_owner[owner] = owner()
        return found

    def __repr__(self):
        return f"Derived({', '.join(sorted(t.__qualname__ for t in self._by_owner))})"
