"""``ucl check SPEC --against MODEL``: does a spec match a model's tensors?"""
from __future__ import annotations

from typing import Iterable, Mapping

from ...errors import UclError
from ...lang.spec import load_spec
from .names import fuse_saved_experts


def check_against(spec, dims: Mapping[str, int], tensors: Mapping[str, Iterable[int]],
                  frozen: Iterable[str] = ()) -> list[str]:
    """Problems binding ``spec`` (a Spec or anything ``ucl.load_spec`` takes) with ``dims`` to
    ``tensors`` (``{name: shape}``, e.g. from :func:`read_tensor_names`). An empty list means every
    tensor is matched by exactly one rule with the right shape.

    Saved per-expert MoE names are first mapped onto the fused in-memory tensors the specs describe
    (see :func:`fuse_saved_experts`), so both a ``state_dict()`` and a ``save_pretrained`` folder
    can be checked."""
    fused, problems = fuse_saved_experts(tensors)
    try:
        spec = load_spec(spec)
        spec.bind(dict(dims), fused, frozen=[f for f in frozen if f in fused])
    except UclError as e:
        diags = getattr(e, "diagnostics", None)
        if diags:
            problems += [f"error[{d.code}]: {d.message}" + (f" ({d.hint})" if d.hint else "") for d in diags]
        else:
            problems.append(f"error[{e.code}]: {e}")
    return problems
