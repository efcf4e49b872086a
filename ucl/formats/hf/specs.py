"""Which spec describes a Hugging Face folder, in order: the user's (``--spec``), the standard
library's for the config's ``model_type``, the standard spec of a type with the same layout (the
alias table), else one derived on the fly from the model class by ``draft_spec_from_hf``.

A derived spec costs a transformers import and two meta-device models, so it is cached: in the
process (the last 64), and on disk (``ucl.formats.hf.spec_cache``: under ``$UCL_CACHE_DIR``, keyed
by the config's fields, the source of this package and the ucl, torch and transformers versions).
An entry holds the draft without the folder's dtypes (the reader adds each tensor's own, so one
entry serves every folder of a config), the names the model class holds (its state dict), the
completeness check's answer, and where save_pretrained puts the tensors it does not write as held
(``saved_form``).
``ucl spec from-hf FOLDER`` prints the same draft (with a `state param : dtype` line for a folder whose
tensors share one dtype other than float32).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

from ...errors import StoreError, UclError
from ...lang.spec import Spec
from ...lang.stdlib import stdlib_names
from . import spec_cache

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


# derived specs by cache key, most recent last (a long-lived process opening many types stays small)
_MEMO: dict[str, Choice] = {}
_MEMO_KEPT = 64


def derived(config_file: str | os.PathLike, raw: dict) -> Choice:
    """The spec ``draft_spec_from_hf`` writes for this config (cached, see the module doc)."""
    model_type = raw.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise StoreError(f"{config_file} has no model_type; ucl reads Hugging Face folders whose config.json names "
                         "one (or give the spec: --spec)", code="UCL501")
    key = spec_cache.key(raw)
    hit = _MEMO.pop(key, None) or _from_entry(spec_cache.read(key), model_type)
    if hit is None:  # no entry, or one that does not hold up: draft again and rewrite it
        hit = _draft(config_file, model_type)
        spec_cache.write(key, _to_entry(hit))
    _MEMO[key] = hit
    while len(_MEMO) > _MEMO_KEPT:
        del _MEMO[next(iter(_MEMO))]
    return hit


def _draft(config_file, model_type: str) -> Choice:
    try:
        import transformers  # noqa: F401 - the drafter needs it; say so plainly when it is missing
    except ImportError:
        raise StoreError(f"{config_file}: model_type {model_type!r} has no standard spec, and deriving one needs "
                         "transformers (pip install transformers), or give the spec: --spec", code="UCL501") from None
    from .draft import draft_with_model
    text, model = draft_with_model(config_file, name=model_type)
    names, form, shapes, problem = _model_names(model)
    return Choice(text, f"derived:{model_type}", "derived", names, form, shapes, problem)


def _model_names(model):
    """The names a meta-device instance of the model class holds (parameters, persistent buffers),
    and where save_pretrained puts them (:func:`_saved_form`)."""
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


def _to_entry(choice: Choice) -> dict:
    return {"text": choice.text, "name": choice.name, "model_names": list(choice.model_names or ()),
            "saved_form": [[n, list(shape), [list(r) for r in runs]] for n, shape, runs in choice.saved_form],
            "saved_shapes": [[n, list(shape)] for n, shape in choice.saved_shapes],
            "form_problem": choice.form_problem}


def _from_entry(doc: dict | None, model_type: str) -> Choice | None:
    """The Choice a cache entry holds, if it holds up: the spec text parses like any spec, and every
    run of the saved form lies inside its saved tensor and the runs of a tensor sum to its size (the
    reader turns them into byte ranges of the folder's files); else None."""
    if doc is None:
        return None
    try:
        if doc["name"] != f"derived:{model_type}" or not isinstance(doc["text"], str):
            return None
        names = tuple(_str(n) for n in doc["model_names"])
        shapes = tuple((_str(n), _shape(s)) for n, s in doc["saved_shapes"])
        form = tuple((_str(n), _shape(s), tuple((_str(a), _int(b), _int(c)) for a, b, c in runs))
                     for n, s, runs in doc["saved_form"])
        sizes = dict((n, math.prod(s)) for n, s in shapes)
        for _, shape, runs in form:
            if sum(c for _, _, c in runs) != math.prod(shape) or \
                    any(s not in sizes or c <= 0 or b + c > sizes[s] for s, b, c in runs):
                return None
        Spec.from_text(doc["text"], filename="spec cache entry", name=doc["name"])
        return Choice(doc["text"], doc["name"], "derived", names, form, shapes, _str(doc["form_problem"]))
    except (UclError, KeyError, TypeError, ValueError):  # not ours, or not what we wrote: draft again
        return None


def _str(x) -> str:
    if not isinstance(x, str):
        raise TypeError("not a string")
    return x


def _int(x) -> int:
    if type(x) is not int or x < 0:
        raise ValueError("not a count")
    return x


def _shape(s) -> tuple[int, ...]:
    return tuple(_int(x) for x in s)
