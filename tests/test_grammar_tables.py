"""The parser's prebuilt tables (grammar/ucl.lark.tables.json, ucl.lang.grammar): current with the
grammar, equivalent to a parser built from it, and never trusted when stale."""
from __future__ import annotations

import json
from pathlib import Path

import lark
import pytest
from lark import Lark

from ucl.errors import SpecError
from ucl.lang import grammar
from ucl.lang.parse import parse

ROOT = Path(__file__).resolve().parent.parent
TEXT = (ROOT / "grammar" / grammar.GRAMMAR_FILE).read_text()
SHIPPED = json.loads((ROOT / "grammar" / grammar.TABLES_FILE).read_text())
SPECS = sorted((ROOT / "stdlib_patterns").glob("*.ucl"))
BAD = ["dims hidden\nparam w : split 0 over\n", "mesh tp\nparam x : split 0 over tp\nstate : dtype\n",
       "param w[hidden : split 0 over tp\n", "let = 3\n", "param w : concat q, k on 0 align\n"]


def test_the_shipped_tables_were_built_from_this_grammar():
    """(Lark numbers its states differently from one build to the next, so the tables are checked by
    the grammar they record and by what the parser does, below, not byte for byte.)"""
    rebuild = 'python -c "from ucl.lang.grammar import write_tables; write_tables()"'
    assert SHIPPED["grammar"] == grammar.tables(TEXT)["grammar"], f"the grammar changed: rebuild the tables ({rebuild})"
    if SHIPPED["lark"] != lark.__version__:
        pytest.skip(f"tables built by lark {SHIPPED['lark']}, lark {lark.__version__} installed: they are not used")
    assert isinstance(grammar.load_tables(ROOT / "grammar" / grammar.TABLES_FILE, TEXT), Lark)


def test_the_process_parser_comes_from_the_tables_when_they_match():
    p = grammar.parser()
    if SHIPPED["lark"] == lark.__version__:
        assert p.source_path == "<deserialized>"
    assert p.options.propagate_positions and p.options.maybe_placeholders and p.options.parser == "lalr"


@pytest.mark.parametrize("spec", SPECS, ids=lambda p: p.name)
def test_the_loaded_parser_gives_the_trees_a_built_one_gives(spec):
    text = spec.read_text()
    built, loaded = grammar.build(TEXT), grammar.parser()
    assert loaded.parse(text) == built.parse(text)


@pytest.mark.parametrize("text", BAD)
def test_syntax_errors_read_the_same_as_with_a_built_parser(text, monkeypatch):
    with pytest.raises(SpecError) as loaded:
        parse(text, "x.ucl")
    built = grammar.build(TEXT)
    monkeypatch.setattr("ucl.lang.parse.parser", lambda: built)
    with pytest.raises(SpecError) as fresh:
        parse(text, "x.ucl")
    assert str(loaded.value) == str(fresh.value)


@pytest.mark.parametrize("change", ["grammar", "lark", "garbage", "missing", "broken"])
def test_stale_or_unreadable_tables_are_not_used(change, tmp_path):
    path = tmp_path / grammar.TABLES_FILE
    doc = dict(SHIPPED, lark=lark.__version__, grammar=grammar.tables(TEXT)["grammar"])
    if change == "grammar":
        doc["grammar"] = "0" * 16
    elif change == "lark":
        doc["lark"] = "0.0.1"
    elif change == "broken":
        doc["data"] = {"__items__": [[1, 2]]}
    if change == "garbage":
        path.write_text("{not json")
    elif change != "missing":
        path.write_text(json.dumps(doc))
    assert grammar.load_tables(path, TEXT) is None
    good = tmp_path / "good.json"
    good.write_text(json.dumps(grammar.tables(TEXT)))
    assert isinstance(grammar.load_tables(good, TEXT), Lark)
    assert grammar.load_tables(good, TEXT + "\n// edited\n") is None
