"""Tensor-parallel DeepSpeed checkpoints whose files record no placements (no
``universal_checkpoint_info``), placed by the user's spec (``ucl import --spec SPEC --dims DIMS``).

The spec declares ``mesh tp, dp`` (DeepSpeed's rank ``t * dp + d``) and a rule with a shape for
every parameter, e.g. ``layers.{i}.mlp.fc1.weight [2 * ffn, hidden] : view 0 as [2, ffn]; split
0.1 over tp``; it must not declare ``state``: the optimizer state's layout is in DeepSpeed's files
and stays generated (appended to the user's text). Each parameter's global shape is its rule's
shape; where its tp shards lie is the rule's layout, checked against the shards on disk when the
checkpoint is opened (``check_stored``), so a wrong rule is an never a misread.
"""
from __future__ import annotations

from ...errors import BindError, Diagnostic, ForeignFormatError
from ...lang.expr import ExprError, evaluate_extent, evaluate_lets
from ...lang.spec import Spec
from ...layout.bind import PatternIndex
from ..base import Description, UserSpec
from ..torchzip.plain import plain
from .common import DsFolder
from .tp import describe_tp, Placement, TpReader


def describe_user(f: DsFolder, user: UserSpec) -> Description:
    spec = Spec.from_text(user.text, filename=user.filename)
    if spec.axes != ["tp", "dp"]:
        raise ForeignFormatError(f"{user.filename}: the spec for {f.folder} must declare `mesh tp, dp` (DeepSpeed's tp rank t and dp "
                     f"rank d are rank t * dp + d), not mesh {', '.join(spec.axes) or '(none)'}")
    if spec.kinds != ["param"]:
        raise ForeignFormatError(f"{user.filename}: the spec declares state {[k for k in spec.kinds if k != 'param']}; the "
                     "optimizer state's layout is in DeepSpeed's files, give the parameters' rules only")
    dims = dict(user.dims)
    missing = [d for d in spec.dims if d not in dims]
    if missing or set(dims) - set(spec.dims):
        raise BindError([Diagnostic("UCL209", f"the spec declares dims {spec.dims}; --dims gives {sorted(dims)}")],
                        user.text, user.filename)
    env, _ = evaluate_lets(spec.checked.lets, dims)
    rules = PatternIndex((r.pattern, r) for r in spec.checked.rules)

    def place(n: str, shards: list[tuple], is_buffer: bool) -> Placement:
        hits = rules.matches(n)
        if len(hits) != 1 or hits[0].shape is None:
            raise ForeignFormatError(f"{n}: {user.filename} has {len(hits)} rules for it" if len(hits) != 1 else
                         f"{n}: its rule in {user.filename} (line {hits[0].span.line}) declares no shape; the files "
                         f"hold only its tp-local shape {list(shards[0])}")
        try:
            full = tuple(evaluate_extent(e, env, f"dim {d} of {n}'s shape") for d, e in enumerate(hits[0].shape))
        except ExprError as e:
            raise BindError([e.diagnostic], user.text, user.filename) from None
        return Placement(full, "", None)

    def extra(placements: dict[str, Placement]) -> tuple[str, dict]:
        return "user_spec", {"tp": f.mp, "spec": user.filename, "dims": plain(dims),
                             "universal_checkpoint_info": plain(f.ms.get("universal_checkpoint_info"))}

    return describe_tp(f, TpReader("tensor-parallel (placed by a user spec)", "deepspeed-tp-user", place, extra,
                                   (user.text, dims)))
