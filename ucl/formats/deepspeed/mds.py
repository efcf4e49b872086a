"""Megatron-DeepSpeed style tensor-parallel checkpoints: ``mp_rank_TT`` files of a model that does
its own tensor parallelism (Megatron's ``mpu`` handed to ``deepspeed.initialize``), each
parameter's placement read from the *pattern* form of ``universal_checkpoint_info`` that
Megatron-DeepSpeed saves in its client state and ``ds_to_universal`` consumes.

The patterns mean what ``ds_to_universal`` makes of them (``re.match``, i.e. anchored at the start;
at most one pattern of a list may match a name; the first category that matches wins, in this
order):

* ``tp_replicated_parameter_patterns``: every tp rank holds the whole tensor (``replicate``).
* ``parameter_to_average_patterns``: the tensor is the mean of the ranks' copies. That is a
  computation, not a place to read bytes from: refused.
* ``parameter_with_2_sub_params_cat_dim_0``: dim 0 is two halves (SwiGLU ``[gate; up]``), each
  split over tp, every rank holding ``[gate_t; up_t]``: ``view 0 as [2, n]; split 0.1 over tp``.
* ``parameter_with_sub_params`` (``{patterns, shape, partition_dim}``): the partition dim is
  the concatenation of sub-params, each split evenly over tp: ``concat D as [...]; split D over
  tp``. Uneven shard widths (``sub_param_shard_widths`` not all equal) are refused.
* anything else is split over tp along dim 1 if it matches
  ``parameter_with_row_parallelism_patterns``, else along dim 0.
* ``vocabulary_parameter_patterns`` (with any of the above): dim 0 is the padded vocabulary; the
  tensor is ``original_vocab_size`` rows, the rest padding (``pad 0 to P``).

The split is always even (Megatron shards evenly); each parameter's tp-local shape comes from the
files and must fit the category, else UCL502 names the parameter. A tensor-parallel checkpoint
without any ``universal_checkpoint_info`` says nothing about its splits and is refused.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from ...errors import ForeignFormatError
from ..base import Description
from ..torchzip.plain import plain
from .common import as_dict, as_list, DsFolder
from .tp import describe_tp, Placement, TpReader

REPLICATED = "tp_replicated_parameter_patterns"
AVERAGE = "parameter_to_average_patterns"
ROW = "parameter_with_row_parallelism_patterns"
VOCAB = "vocabulary_parameter_patterns"
TWO_HALVES = "parameter_with_2_sub_params_cat_dim_0"
SUB_PARAMS = "parameter_with_sub_params"
WIDTHS = "sub_param_shard_widths"
LISTS = (REPLICATED, AVERAGE, ROW, VOCAB, TWO_HALVES)
AUTOTP_ONLY = ("affine_map", "autotp_unsupported_parameter_patterns")  # keys only AutoTP writes


def is_pattern_form(uci: Any) -> bool:
    """A pattern-form ``universal_checkpoint_info`` (not AutoTP's, which carries an affine map and
    marks itself with keys Megatron-DeepSpeed never writes)."""
    return isinstance(uci, dict) and not any(k in uci for k in AUTOTP_ONLY) and \
        any(k in uci for k in LISTS + (SUB_PARAMS,))


@dataclass(frozen=True)
class Patterns:
    """A pattern-form ``universal_checkpoint_info``, its regular expressions checked."""
    lists: dict[str, list[str]]  # each of LISTS -> its patterns
    subs: list[dict]  # the parameter_with_sub_params entries
    widths: dict  # sub_param_shard_widths
    vocab_size: Any  # original_vocab_size


def describe_mds(f: DsFolder) -> Description:
    uci = f.ms["universal_checkpoint_info"]
    pats = _patterns(uci)

    def extra(placements: dict[str, Placement]) -> tuple[str, dict]:
        return "megatron_deepspeed", {"tp": f.mp, "layouts": {n: p.layout for n, p in placements.items()},
                                      "split_dims": {n: p.split_dim for n, p in placements.items()},
                                      "universal_checkpoint_info": plain(uci)}

    return describe_tp(f, TpReader("Megatron-style tensor-parallel", "deepspeed-mds",
                                   lambda n, shards, is_buffer: _place(pats, f.mp, n, shards), extra))


def _patterns(uci: dict) -> Patterns:
    lists = {k: [str(p) for p in as_list(uci.get(k) or [], f"universal_checkpoint_info {k}")] for k in LISTS}
    subs = [as_dict(s, f"universal_checkpoint_info {SUB_PARAMS}") for s in as_list(uci.get(SUB_PARAMS) or [], SUB_PARAMS)]
    widths = as_dict(uci.get(WIDTHS) or {}, f"universal_checkpoint_info {WIDTHS}")
    for k, pats in list(lists.items()) + [(SUB_PARAMS, [p for s in subs for p in as_list(s.get("patterns"), SUB_PARAMS)])]:
        for p in pats:
            try:
                re.compile(str(p))
            except re.error as e:
                raise ForeignFormatError(f"universal_checkpoint_info {k}: {p!r} is not a regular expression ({e})") from None
    return Patterns(lists, subs, widths, uci.get("original_vocab_size"))


def _place(pats: Patterns, tp: int, n: str, shards: list[tuple]) -> Placement:
    """Where ``n``'s tp shards lie: the first category of the module doc that matches it."""
    if any(s != shards[0] for s in shards):
        raise ForeignFormatError(f"{n}: its tp shards differ in shape ({shards}); Megatron splits evenly")
    local = shards[0]
    hit = {k: _match(k, ps, n) for k, ps in pats.lists.items()}
    if hit[REPLICATED]:
        p = Placement(local, "replicate", None)
    elif hit[AVERAGE]:
        raise ForeignFormatError(f"{n}: universal_checkpoint_info has it averaged over tp ranks ({AVERAGE}, "
                     f"{hit[AVERAGE]!r}); ucl reads every element from one place and does not average")
    elif hit[TWO_HALVES]:
        if not local or local[0] % 2:
            raise ForeignFormatError(f"{n}: {TWO_HALVES} ({hit[TWO_HALVES]!r}) says dim 0 is two halves split over tp, but its "
                         f"tp-local shape is {list(local)}")
        half = local[0] // 2 * tp
        p = Placement((2 * half,) + local[1:], f"view 0 as [2, {half}]; split 0.1 over tp", None)
    elif (sub := _sub_params(n, pats.subs)) is not None:
        p = _concat(n, sub, pats.widths, local, tp)
    else:
        dim = 1 if hit[ROW] else 0
        if len(local) <= dim:
            raise ForeignFormatError(f"{n}: universal_checkpoint_info makes it {'row' if dim else 'column'}-parallel "
                         f"(split dim {dim} over tp), but its tp-local shape {list(local)} has no dim {dim}")
        full = local[:dim] + (local[dim] * tp,) + local[dim + 1:]
        p = Placement(full, f"split {dim} over tp", dim)
    return _vocab(n, p, pats.vocab_size, hit[VOCAB]) if hit[VOCAB] else p


def _match(key: str, patterns: list[str], name: str) -> str | None:
    hits = [p for p in patterns if re.match(p, name)]
    if len(hits) > 1:  # ds_to_universal refuses this too
        raise ForeignFormatError(f"{name}: several {key} match it ({hits}); DeepSpeed allows one")
    return hits[0] if hits else None


def _sub_params(name: str, subs: list[dict]) -> dict | None:
    for s in subs:
        for p in as_list(s.get("patterns"), f"{SUB_PARAMS} patterns"):
            if re.match(str(p), name):
                return {**s, "pattern": str(p)}
    return None


def _concat(name: str, sub: dict, widths: dict, local: tuple, tp: int) -> Placement:
    """``parameter_with_sub_params``: the partition dim concatenates sub-params, each split evenly."""
    shape, dim = as_list(sub.get("shape"), f"{SUB_PARAMS} shape of {name}"), sub.get("partition_dim")
    if not isinstance(dim, int) or not 0 <= dim < len(local) or len(shape) != len(local):
        raise ForeignFormatError(f"{name}: {SUB_PARAMS} entry {plain(sub)} does not fit its tp-local shape {list(local)}")
    spec = shape[dim]
    if isinstance(spec, (list, tuple)):  # widths of the sub-params in the full tensor
        sizes = [int(x) for x in spec]
    else:  # a count of equal sub-params (older metadata)
        if not isinstance(spec, int) or spec < 1 or (local[dim] * tp) % spec:
            raise ForeignFormatError(f"{name}: {SUB_PARAMS} says dim {dim} holds {spec!r} sub-params, which does not divide "
                         f"{local[dim] * tp}")
        sizes = [local[dim] * tp // spec] * spec
    got = widths.get(sub["pattern"])
    want = [[s // tp] * tp for s in sizes]
    if any(s % tp for s in sizes) or sum(sizes) != local[dim] * tp or (got is not None and plain(got) != want):
        raise ForeignFormatError(f"{name}: sub-params {sizes} along dim {dim} (shard widths {plain(got)}) are not each split "
                     f"evenly over tp={tp} into its tp-local {local[dim]}; ucl reads even sub-param splits only")
    parts = ", ".join(f"p{i} = {s}" for i, s in enumerate(sizes))
    full = local[:dim] + (sum(sizes),) + local[dim + 1:]
    return Placement(full, f"concat {dim} as [{parts}]; split {dim} over tp", None)


def _vocab(name: str, p: Placement, vocab: Any, pattern: str) -> Placement:
    """The padded vocabulary (dim 0) holds ``original_vocab_size`` real rows."""
    if p.layout not in ("replicate", "split 0 over tp") or len(p.full) != 2:
        raise ForeignFormatError(f"{name}: {VOCAB} ({pattern!r}) pads dim 0 of a 2-D tensor split over dim 0 or replicated; "
                     f"it is {list(p.full)} with '{p.layout}'")
    if not isinstance(vocab, int) or isinstance(vocab, bool) or not 0 < vocab <= p.full[0]:
        raise ForeignFormatError(f"{name}: original_vocab_size {vocab!r} does not fit its padded vocabulary of {p.full[0]} rows")
    if vocab == p.full[0]:
        return p
    return Placement((vocab,) + p.full[1:], f"pad 0 to {p.full[0]}; {p.layout}", p.split_dim)
