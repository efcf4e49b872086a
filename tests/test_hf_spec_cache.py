"""The derived-spec cache (ucl.formats.hf.spec_cache): its key covers everything a derived spec
depends on, and its entries are hostile until checked (docs/security.md): a bad, linked or
planted entry is ignored and drafted again, never trusted and never an error."""
from __future__ import annotations

import json
import os
import shutil

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import hf_every as E  # noqa: E402
import ucl  # noqa: E402
from ucl.formats import registry  # noqa: E402
from ucl.formats.hf import spec_cache, specs  # noqa: E402


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("UCL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(specs, "_MEMO", {})
    registry.forget()


@pytest.fixture(scope="module")
def neox(tmp_path_factory):
    """A gpt_neox folder (derived spec, a renamed head: a saved form with runs) and its state dict."""
    model = E.build("gpt_neox")
    folder = tmp_path_factory.mktemp("neox") / "m"
    model.save_pretrained(folder)
    return str(folder), {k: v.detach().clone() for k, v in model.state_dict().items()}


def _open(folder: str) -> tuple[str, dict]:
    """A fresh process's open (no in-process memo): the description's spec and the values read."""
    specs._MEMO.clear()
    registry.forget()
    spec = registry.describe(folder).spec
    registry.forget()
    return spec, ucl.load_rank(folder, mesh="universal", rank=0, as_torch=True)


def _exact(got: dict, ref: dict) -> bool:
    return bool(got) and all(torch.equal(v, ref[k.split("/", 1)[1]]) for k, v in got.items())


def _entry() -> str:
    (entry,) = spec_cache.cache_dir().glob("*.json")
    return str(entry)


def test_the_key_covers_every_module_of_the_package_and_the_versions(tmp_path, monkeypatch):
    """A changed byte of draft_tp.py (a TP layout) is another key (only draft.py, specs.py and
    saved_form.py were hashed before: an old layout was served after an upgrade)."""
    raw = {"model_type": "gpt_neox", "hidden_size": 64}
    names = {p.name for p in spec_cache.source_files()}
    assert {"draft.py", "draft_tp.py", "draft_dims.py", "meta.py", "saved_form.py", "specs.py"} <= names
    copies = tmp_path / "src"
    copies.mkdir()
    for p in spec_cache.source_files():
        shutil.copy(p, copies / p.name)
    monkeypatch.setattr(spec_cache, "source_files", lambda: sorted(copies.glob("*.py")))
    before = spec_cache.key(raw)
    src = (copies / "draft_tp.py").read_bytes()
    (copies / "draft_tp.py").write_bytes(src.replace(b"tp", b"pt", 1))
    assert spec_cache.key(raw) != before
    (copies / "draft_tp.py").write_bytes(src)
    assert spec_cache.key(raw) == before
    monkeypatch.setattr(spec_cache, "_version", lambda package: "0" if package == "torch" else None)
    assert spec_cache.key(raw) != before


def test_entries_are_private_files_in_a_private_folder(neox):
    folder, ref = neox
    _, got = _open(folder)
    assert _exact(got, ref)
    assert os.stat(spec_cache.cache_dir()).st_mode & 0o777 == 0o700
    assert os.stat(_entry()).st_mode & 0o777 == 0o600


def test_an_entry_whose_runs_point_outside_their_tensor_is_ignored_and_rewritten(neox):
    folder, ref = neox
    _open(folder)
    entry = _entry()
    doc = json.loads(open(entry).read())
    assert doc["saved_form"], "gpt_neox's head is saved under another name: a form with runs"
    good = json.dumps(doc)
    doc["saved_form"][0][2][0][1] += 10**6  # start past the saved tensor's end
    with open(entry, "w") as f:
        f.write(json.dumps(doc))
    _, got = _open(folder)
    assert _exact(got, ref)
    assert json.loads(open(entry).read()) == json.loads(good)
    for bad in ({**doc, "text": "mesh tp\nnot a spec ("}, {**doc, "saved_shapes": "x"}, "[1, 2]", "{"):
        with open(entry, "w") as f:
            f.write(bad if isinstance(bad, str) else json.dumps(bad))
        assert _exact(_open(folder)[1], ref)
        assert json.loads(open(entry).read()) == json.loads(good)


def _planted(entry: str) -> dict:
    """The entry with a comment added to its spec: a valid entry, recognisable if it is used."""
    doc = json.loads(open(entry).read())
    return {**doc, "text": doc["text"] + "\n# planted\n"}


def test_a_linked_entry_is_not_followed(neox, tmp_path):
    folder, ref = neox
    _open(folder)
    entry = _entry()
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text(json.dumps(_planted(entry)))
    os.unlink(entry)
    os.symlink(elsewhere, entry)
    spec, got = _open(folder)
    assert "# planted" not in spec and _exact(got, ref)
    assert not os.path.islink(entry) and "# planted" in elsewhere.read_text()


@pytest.mark.skipif(os.name != "posix", reason="POSIX modes")
def test_a_cache_folder_others_can_write_is_bypassed(neox):
    folder, ref = neox
    _open(folder)
    entry = _entry()
    planted = json.dumps(_planted(entry))
    with open(entry, "w") as f:
        f.write(planted)
    os.chmod(spec_cache.cache_dir(), 0o777)
    spec, got = _open(folder)
    assert "# planted" not in spec and _exact(got, ref)
    assert "# planted" in open(entry).read() and len(os.listdir(spec_cache.cache_dir())) == 1  # nothing written
    os.chmod(spec_cache.cache_dir(), 0o755)  # ours, only we write in it (an older ucl's): used, tightened
    spec, _ = _open(folder)
    assert "# planted" in spec and os.stat(spec_cache.cache_dir()).st_mode & 0o777 == 0o700


def test_the_in_process_memo_is_bounded(monkeypatch):
    monkeypatch.setattr(spec_cache, "key", lambda raw: str(raw["n"]))
    monkeypatch.setattr(spec_cache, "read", lambda key: None)
    monkeypatch.setattr(spec_cache, "write", lambda key, doc: None)
    monkeypatch.setattr(specs, "_draft", lambda config_file, model_type: specs.Choice("", model_type, "derived"))
    for n in range(specs._MEMO_KEPT + 10):
        specs.derived("config.json", {"model_type": "x", "n": n})
    assert len(specs._MEMO) == specs._MEMO_KEPT and "0" not in specs._MEMO and str(n) in specs._MEMO
