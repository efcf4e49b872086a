"""The cache of parsed specs: a spec text's syntax tree stored as JSON under ``ucl.cache``'s folder
(``$UCL_CACHE_DIR/specs/KEY.json``), keyed by the text and the code that parses it. A hit skips lark
altogether (its import, the parser tables and the parse: ~45 ms of CPU of every ``ucl reshard``, whose
manifest always holds the same spec text).

An entry is untrusted (docs/security.md): it is JSON decoded into this module's node classes only,
each field of the type it is declared with, and the spec built from it is checked as any other
(``lang.check``); an entry that fails any of this is ignored and parsed again. Only a text that
parsed and checked cleanly is stored, so a spec with errors always reports them from the parser.
"""
from __future__ import annotations

import dataclasses
import json
from functools import lru_cache
from typing import Any

import xxhash

from . import ast
from ..cache import read_entry, write_entry
from ..errors import Span
from .resources import data_dir

SECTION = "specs"
FORMAT = 2  # of an entry: bump when the encoding below changes
MAX_ENTRY_BYTES = 64 << 20  # a 1.2M-token generated spec's tree is tens of MB; a hand-written one a few KB

# the only classes an entry may name: the syntax tree's nodes and Span
_NODES: dict[str, type] = {c.__name__: c for c in vars(ast).values()
                           if dataclasses.is_dataclass(c) and c.__module__ == ast.__name__ and c is not ast.Module}
_NODES["Span"] = Span
_STATEMENTS = (ast.DimsDecl, ast.LetDecl, ast.MeshDecl, ast.IgnoreDecl, ast.StateDecl, ast.Rule)
# declared field types an entry's value is held to exactly; the others are nodes, tuples or None
_PLAIN = {"str": (str,), "int": (int,), "bool": (bool,), "Span": (Span,)}


@lru_cache(maxsize=None)
def _fields(cls: type) -> tuple[tuple[str, tuple[type, ...] | None], ...]:
    return tuple((f.name, _PLAIN.get(f.type)) for f in dataclasses.fields(cls))


@lru_cache(maxsize=1)
def code_digest() -> str:
    """The parsing code an entry depends on: ucl's version, the grammar and the modules that turn
    text into a tree (any change to them parses anew)."""
    from .. import __version__
    from pathlib import Path
    h = xxhash.xxh3_128(f"{FORMAT}\0{__version__}\0".encode())
    here = Path(__file__).parent
    for path in (data_dir("grammar") / "ucl.lark", here / "parse.py", here / "ast.py", here / "expr.py",
                 here / "limits.py", Path(__file__)):
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def key(text: str) -> str:
    return xxhash.xxh3_128_hexdigest(code_digest().encode() + b"\0" + text.encode("utf-8", "surrogatepass"))


def encode(node: Any) -> Any:
    """A tree of nodes as JSON: a node is ``{"Class": [fields...]}``, a tuple a list."""
    if isinstance(node, tuple):
        return [encode(v) for v in node]
    if dataclasses.is_dataclass(node):
        return {type(node).__name__: [encode(getattr(node, f.name)) for f in dataclasses.fields(node)]}
    return node


def decode(doc: Any) -> Any:
    """``encode``'s inverse, refusing (ValueError) anything it would not have written."""
    if isinstance(doc, list):
        return tuple(decode(v) for v in doc)
    if isinstance(doc, dict):
        if len(doc) != 1:
            raise ValueError("a node is one class name")
        (name, values), = doc.items()
        cls = _NODES.get(name)
        fields = _fields(cls) if cls is not None else ()
        if cls is None or not isinstance(values, list) or len(values) != len(fields):
            raise ValueError(f"not a node: {name!r}")
        args = [decode(v) for v in values]
        for (_, types), v in zip(fields, args):
            if types is not None and (type(v) not in types):
                raise ValueError(f"a field of {name} of the wrong type")
        return cls(*args)
    if doc is None or type(doc) in (str, int, bool):
        return doc
    raise ValueError(f"not a tree value: {type(doc).__name__}")


def load(text: str, filename: str) -> ast.Module | None:
    """The tree of ``text`` from the cache, or None (no entry, the cache off, a bad entry)."""
    entry_key = key(text)
    doc = read_entry(SECTION, entry_key, MAX_ENTRY_BYTES)
    if doc is None:
        return None
    body = doc.get("statements")
    try:  # a flipped digit would still decode to a valid, different tree: the entry carries its digest
        if doc.get("digest") != entry_digest(body):
            return None
        statements = decode(body)
        if not isinstance(statements, tuple) or not all(isinstance(s, _STATEMENTS) for s in statements):
            return None
    except (ValueError, TypeError, RecursionError):
        return None
    source = text if text.endswith("\n") else text + "\n"  # as parse.parse keeps it
    return ast.Module(statements, source, filename)


def entry_digest(body: Any) -> str:
    """Of an entry's encoded tree, as JSON with fixed separators (stable over a load and a dump)."""
    return xxhash.xxh3_128_hexdigest(json.dumps(body, separators=(",", ":")).encode())


def store(text: str, module: ast.Module) -> None:
    """Keep the tree of ``text`` (one that parsed and checked cleanly) for the next process."""
    try:
        body = encode(module.statements)
        write_entry(SECTION, key(text), {"statements": body, "digest": entry_digest(body)})
    except (ValueError, TypeError, RecursionError):  # a tree too deep for json: not worth keeping
        pass
