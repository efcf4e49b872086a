"""The cache of parsed specs (ucl.lang.parsed, under ucl.cache): a hit gives the very tree a parse
gives, with no parse; an entry is untrusted (anything but a clean tree of the node classes is parsed
anew and replaced); specs with errors are never stored; the cache can be turned off."""
from __future__ import annotations

import json
import os
import stat

import pytest

import ucl
from ucl.lang import parse as parse_mod
from ucl.lang import parsed
from ucl.lang.spec import Spec
from ucl.lang.stdlib import stdlib_names, stdlib_path


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("UCL_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / parsed.SECTION


def _entry(cache) -> os.PathLike:
    (path,) = cache.glob("*.json")
    return path


@pytest.mark.parametrize("name", stdlib_names())
def test_every_stdlib_spec_round_trips_to_the_same_tree(name):
    module = parse_mod.parse(stdlib_path(f"stdlib:{name}").read_text())
    doc = json.loads(json.dumps(parsed.encode(module.statements)))
    assert parsed.decode(doc) == module.statements


def test_a_second_load_takes_the_tree_from_the_cache(cache, monkeypatch):
    text = stdlib_path("stdlib:llama").read_text()
    first = Spec.from_text(text, filename="a.ucl", name="llama", cache=True)
    assert _entry(cache).stat().st_mode & 0o777 == 0o600 and stat.S_IMODE(cache.stat().st_mode) == 0o700

    def refuse(*a, **k):
        raise AssertionError("parsed, not taken from the cache")
    monkeypatch.setattr(parse_mod, "parse", refuse)
    again = Spec.from_text(text, filename="b.ucl", name="llama", cache=True)
    assert again.module.statements == first.module.statements and again.text == first.text
    assert again.filename == "b.ucl" and again.name == "llama"
    assert again.checked == first.checked


def test_without_cache_nothing_is_read_or_written(cache):
    Spec.from_text(stdlib_path("stdlib:llama").read_text())
    assert not cache.exists()


def _bump_first_number(node, inside_span=False):
    """The encoded tree with its first integer outside a source span raised by one (a flipped digit)."""
    if isinstance(node, list):
        for i, v in enumerate(node):
            bumped = _bump_first_number(v, inside_span)
            if bumped is not v:
                return node[:i] + [bumped] + node[i + 1:]
    elif isinstance(node, dict):
        (name, values), = node.items()
        bumped = _bump_first_number(values, name == "Span")
        if bumped is not values:
            return {name: bumped}
    elif type(node) is int and not inside_span:
        return node + 1
    return node


# each a changed entry: a str is written as it is; a dict gets the digest of its statements, so that
# what refuses it is the decoding and the checks, not the digest
@pytest.mark.parametrize("tamper", [
    lambda doc: "not json {",
    lambda doc: {**doc, "statements": [{"os.system": ["x"]}]},  # a class that is not a node
    lambda doc: {**doc, "statements": [{"Span": [1, 1, 1, 1]}]},  # a node, not a statement
    lambda doc: {**doc, "statements": 3.5},
    lambda doc: {**doc, "statements": doc["statements"][:1] + [{"MeshDecl": ["tp", "x"]}]},  # wrong types
    lambda doc: json.dumps({**doc, "key": "another"}),
    lambda doc: {**doc, "statements": doc["statements"][1:]},  # well formed, but fails the checks
    # a flipped digit: decodes to a valid tree of another spec; only the digest it no longer matches tells
    lambda doc: json.dumps({**doc, "statements": _bump_first_number(doc["statements"])}),
])
def test_a_tampered_entry_is_parsed_anew_and_replaced(cache, tamper):
    text = stdlib_path("stdlib:llama").read_text()
    good = Spec.from_text(text, cache=True)
    path = _entry(cache)
    clean = path.read_text()
    changed = tamper(json.loads(clean))
    if isinstance(changed, dict):
        changed = json.dumps({**changed, "digest": parsed.entry_digest(changed["statements"])})
    path.write_text(changed)
    spec = Spec.from_text(text, cache=True)
    assert spec.module.statements == good.module.statements and spec.checked == good.checked
    assert json.loads(path.read_text()) == json.loads(clean)  # rewritten from the parse


def test_a_folder_others_can_write_is_bypassed(cache, monkeypatch):
    text = stdlib_path("stdlib:llama").read_text()
    Spec.from_text(text, cache=True)
    os.chmod(cache, 0o777)
    calls = []
    real = parse_mod.parse
    monkeypatch.setattr(parse_mod, "parse", lambda *a, **k: calls.append(1) or real(*a, **k))
    Spec.from_text(text, cache=True)
    assert calls == [1]


def test_a_spec_with_errors_is_never_stored_and_reports_as_before(cache):
    bad = "mesh tp\nw [4] : split 0 over dp\n"
    with pytest.raises(ucl.SpecError) as plain:
        Spec.from_text(bad)
    for _ in range(2):
        with pytest.raises(ucl.SpecError) as cached:
            Spec.from_text(bad, cache=True)
        assert str(cached.value) == str(plain.value)
    assert not cache.exists() or not list(cache.glob("*.json"))


def test_the_size_caps_hold_before_the_cache(cache, monkeypatch):
    text = "mesh tp\nlet a = 1" + " + 1" * 200 + "\n"
    Spec.from_text(text, cache=True)
    assert _entry(cache)
    import ucl.lang.spec
    monkeypatch.setattr(ucl.lang.spec, "token_budget", lambda params: 50)
    with pytest.raises(ucl.SpecError) as e:
        Spec.from_text(text, cache=True)
    assert e.value.diagnostics[0].code == "UCL004"


def test_off_turns_the_cache_off(tmp_path, monkeypatch):
    monkeypatch.setenv("UCL_CACHE_DIR", "off")
    monkeypatch.chdir(tmp_path)
    Spec.from_text(stdlib_path("stdlib:llama").read_text(), cache=True)
    assert list(tmp_path.iterdir()) == []


def test_the_key_covers_the_text_and_the_parsing_code(monkeypatch):
    a = parsed.key("mesh tp\n")
    assert parsed.key("mesh dp\n") != a
    monkeypatch.setattr(parsed, "code_digest", lambda: "another parser")
    assert parsed.key("mesh tp\n") != a


def test_a_flipped_digit_changes_the_tree():
    """The premise of the digest case above: the bumped entry decodes, to another tree."""
    module = parse_mod.parse(stdlib_path("stdlib:llama").read_text())
    body = json.loads(json.dumps(parsed.encode(module.statements)))
    bumped = _bump_first_number(body)
    assert bumped != body and parsed.decode(bumped) != module.statements
