"""The grammar's LALR parser: loaded from tables built ahead of time (``grammar/ucl.lark.tables.json``)
in a few milliseconds, instead of built from ``grammar/ucl.lark`` at every start (40-80 ms of every
``ucl`` command). The tables are used only when they were built from this very grammar by the lark
version installed; otherwise the parser is built from the grammar, as before. After editing the
grammar, rebuild them: ``python -c "from ucl.lang.grammar import write_tables; write_tables()"``
(a test fails until then)."""
from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

import lark
import xxhash
from lark import Lark
from lark.grammar import Rule
from lark.lexer import TerminalDef

from .resources import data_dir

GRAMMAR_FILE = "ucl.lark"
TABLES_FILE = "ucl.lark.tables.json"


@lru_cache(maxsize=1)
def parser() -> Lark:
    """The parser of the grammar (one per process)."""
    folder = data_dir("grammar")
    text = (folder / GRAMMAR_FILE).read_text()
    return load_tables(folder / TABLES_FILE, text) or build(text)


def build(text: str) -> Lark:
    """The parser built from grammar ``text`` (the slow way)."""
    return Lark(text, parser="lalr", propagate_positions=True, maybe_placeholders=True)


def tables(text: str) -> dict[str, Any]:
    """The JSON document of the parser built from grammar ``text``: its lark serialization, tagged
    with the grammar's digest and the lark version that built it."""
    data, memo = build(text).memo_serialize([TerminalDef, Rule])
    return {"grammar": _digest(text), "lark": lark.__version__, "data": _encode(data), "memo": _encode(memo)}


def write_tables() -> Path:
    """Rebuild ``grammar/ucl.lark.tables.json`` from ``grammar/ucl.lark`` (after editing the grammar)."""
    folder = data_dir("grammar")
    path = folder / TABLES_FILE
    path.write_text(json.dumps(tables((folder / GRAMMAR_FILE).read_text()), separators=(",", ":"), sort_keys=True))
    return path


def load_tables(path: Path, text: str) -> Lark | None:
    """The parser from the tables (``tables``' JSON document) at ``path`` if they were built from
    grammar ``text`` by the lark installed; None if not (stale, missing or unreadable tables: the
    caller builds it)."""
    try:
        doc = json.loads(path.read_text())
        if doc.get("grammar") != _digest(text) or doc.get("lark") != lark.__version__:
            return None
        # a dict, not a file: lark deserializes it as it is (no pickle)
        return Lark.load({"data": _decode(doc["data"]), "memo": _decode(doc["memo"])})
    except Exception:  # tables another lark cannot read: build instead
        return None


def _digest(text: str) -> str:
    return xxhash.xxh3_64_hexdigest(text.encode())


# JSON has neither tuples nor non-string keys, and lark's serialization has both: they are tagged
_ITEMS, _TUPLE = "__items__", "__tuple__"


def _encode(x: Any) -> Any:
    if isinstance(x, dict):
        if all(isinstance(k, str) for k in x) and _ITEMS not in x and _TUPLE not in x:
            return {k: _encode(v) for k, v in x.items()}
        return {_ITEMS: [[_encode(k), _encode(v)] for k, v in x.items()]}
    if isinstance(x, tuple):
        return {_TUPLE: [_encode(v) for v in x]}
    if isinstance(x, list):
        return [_encode(v) for v in x]
    if x is None or isinstance(x, (str, int, float, bool)):
        return x
    raise TypeError(f"cannot store a {type(x).__name__} in the parser tables")


def _decode(x: Any) -> Any:
    if isinstance(x, dict):
        if _ITEMS in x:
            return {_decode(k): _decode(v) for k, v in x[_ITEMS]}
        if _TUPLE in x:
            return tuple(_decode(v) for v in x[_TUPLE])
        return {k: _decode(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_decode(v) for v in x]
    return x
