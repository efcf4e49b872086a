"""Which spec describes a Hugging Face folder, in order: the user's (``--spec``), the standard
library's for the config's ``model_type``, the standard spec of a type with the same layout (the
alias table), else one derived on the fly from the model class by ``draft_spec_from_hf``.

A derived spec costs a transformers import and two meta-device models, so it is cached: in the
process, and on disk under ``$UCL_CACHE_DIR`` (default ``~/.cache/ucl``) ``/hf-specs/DIGEST.json``,
keyed by the config's fields, the transformers version and the drafter's source. The cache entry
also holds the names the model class holds (its state dict), the completeness check's answer, and
where save_pretrained puts the tensors it does not write as held (``saved_form``).
``ucl spec from-hf FOLDER`` prints the same draft.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from ...errors import StoreError
from ...lang.stdlib import stdlib_names

SOURCES = ("user", "stdlib", "alias", "derived")
_NOT_HF = ("megatron",)  # stdlib specs that describe another framework's names, not a model_type

# model_type -> the stdlib spec that describes its in-memory tensors unchanged (same names, shapes,
# TP plan); each one is checked by tests/test_hf_every.py on a model transformers builds
# (arcee: no gate_proj; cohere, cohere2: no post-attention norm; olmo: norms without weights: derived)
ALIASES = {
    "ministral": "llama", "ministral3": "llama", "internlm3": "llama", "granite": "llama", "helium": "llama",
    "smollm3": "llama", "ernie4_5": "llama", "seed_oss": "llama",
}


@dataclass(frozen=True)
class Choice:
    """The spec a folder is read with: its text, its name (``stdlib:llama``, ``derived:olmo``,
    the user's file), where it came from (one of SOURCES), and for a derived spec the names the model
    class holds (None otherwise: the spec's own rules say what is expected) and where
    ``save_pretrained`` puts the tensors it does not write as held (``ucl.formats.hf.saved_form``):
    ``(in-memory name, shape, runs over saved names)``, the saved names' shapes, and why that could
    not be found (``form_problem``; then the folder's names are taken as they are)."""
    text: str
    name: str
    source: str
    model_names: tuple[str, ...] | None = None
    saved_form: tuple[tuple[str, tuple[int, ...], tuple[tuple[str, int, int], ...]], ...] = ()
    saved_shapes: tuple[tuple[str, tuple[int, ...]], ...] = ()
    form_problem: str = ""


def known_model_types() -> list[str]:
    """The ``model_type``\\ s with a standard spec of the same name (Hugging Face names)."""
    return [n for n in stdlib_names() if not n.startswith(_NOT_HF)]


def standard(model_type: object) -> Choice | None:
    """The stdlib spec of ``model_type`` or of the type it is an alias of, or None."""
    if not isinstance(model_type, str):
        return None
    known = known_model_types()
    if model_type in known:
        return Choice(_stdlib_text(model_type), f"stdlib:{model_type}", "stdlib")
    if ALIASES.get(model_type) in known:
        return Choice(_stdlib_text(ALIASES[model_type]), f"stdlib:{ALIASES[model_type]}", "alias")
    return None


def _stdlib_text(name: str) -> str:
    from ...lang.spec import load_spec
    return load_spec(f"stdlib:{name}").text


_MEMO: dict[str, Choice] = {}


def derived(config_file: str | os.PathLike, raw: dict) -> Choice:
    """The spec ``draft_spec_from_hf`` writes for this config (cached, see the module doc)."""
    model_type = raw.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise StoreError(f"{config_file} has no model_type; ucl reads Hugging Face folders whose config.json names "
                         "one (or give the spec: --spec)", code="UCL501")
    key = _digest(raw)
    hit = _MEMO.get(key) or _read_cache(key)
    if hit is None:
        hit = _draft(config_file, model_type)
        _write_cache(key, hit)
    _MEMO[key] = hit
    return hit


def _draft(config_file, model_type: str) -> Choice:
    from .draft import draft_spec_from_hf
    try:
        import transformers  # noqa: F401 - the drafter needs it; say so plainly when it is missing
    except ImportError:
        raise StoreError(f"{config_file}: model_type {model_type!r} has no standard spec, and deriving one needs "
                         "transformers (pip install transformers), or give the spec: --spec", code="UCL501") from None
    text = draft_spec_from_hf(config_file, name=model_type)
    names, form, shapes, problem = _model_names(config_file)
    return Choice(text, f"derived:{model_type}", "derived", names, form, shapes, problem)


def _model_names(config_file):
    """The names a meta-device instance of the model class holds (parameters, persistent buffers),
    and where save_pretrained puts them (:func:`_saved_form`)."""
    import warnings

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = AutoConfig.from_pretrained(str(Path(config_file).parent))
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    own = dict(model.named_parameters())
    every = dict(model.named_parameters(remove_duplicate=False))
    sd = model.state_dict()
    # a tied alias (the head sharing the embedding) is saved once, under the name kept here
    names = tuple(k for k in sd if k in own or k not in every)
    return (names,) + _saved_form(model, {n: tuple(sd[n].shape) for n in names})


def _saved_form(model, shapes: dict[str, tuple[int, ...]]):
    """(form, saved shapes, problem): the in-memory tensors save_pretrained does not write as held,
    each as runs of saved tensors, found by running transformers' own reversal of its conversion
    mapping on symbolic tensors (``ucl.formats.hf.saved_form``)."""
    from . import saved_form
    try:
        saved = saved_form.trace(model, shapes)
        runs = saved_form.invert(saved, shapes)
    except Exception as e:  # noqa: BLE001 - a transpose, an older transformers: names as held, and why
        return (), (), f"save_pretrained's form of these tensors is not byte ranges of them ({' '.join(str(e).split())[:200]})"
    held = {n: ((n, 0, math.prod(s)),) if math.prod(s) else () for n, s in shapes.items()}
    form = tuple((n, shapes[n], r) for n, r in runs.items() if r != held[n])  # written as held: left out
    used = {s for _, _, r in form for s, _, _ in r}
    return form, tuple((s, saved[s].shape) for s in sorted(used)), ""


def _versions() -> list[str]:
    try:
        tv = metadata.version("transformers")
    except metadata.PackageNotFoundError:
        tv = None
    here = Path(__file__).parent
    code = hashlib.sha256(b"".join((here / f).read_bytes() for f in ("draft.py", "specs.py", "saved_form.py"))).hexdigest()
    return [str(tv), code]


def _digest(raw: dict) -> str:
    text = json.dumps([raw, _versions()], sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def cache_dir() -> Path:
    root = os.environ.get("UCL_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "ucl")
    return Path(root) / "hf-specs"


def _read_cache(key: str) -> Choice | None:
    try:
        data = json.loads((cache_dir() / f"{key}.json").read_text())
        form = tuple((str(n), tuple(int(x) for x in shape), tuple((str(a), int(b), int(c)) for a, b, c in runs))
                     for n, shape, runs in data["saved_form"])
        shapes = tuple((str(n), tuple(int(x) for x in shape)) for n, shape in data["saved_shapes"])
        return Choice(data["text"], data["name"], "derived", tuple(data["model_names"]), form, shapes,
                      str(data["form_problem"]))
    except (OSError, ValueError, KeyError, TypeError):  # no entry, or one that is not ours: draft again
        return None


def _write_cache(key: str, choice: Choice) -> None:
    folder = cache_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".{key}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps({"text": choice.text, "name": choice.name,
                                   "model_names": list(choice.model_names or ()),
                                   "saved_form": [[n, list(shape), [list(r) for r in runs]]
                                                  for n, shape, runs in choice.saved_form],
                                   "saved_shapes": [[n, list(shape)] for n, shape in choice.saved_shapes],
                                   "form_problem": choice.form_problem}))
        os.replace(tmp, folder / f"{key}.json")
    except OSError:  # a read-only home: the in-process cache still holds it
        pass
