"""What one lowering of a model on a mesh threads through its layers (``dims``, ``place``, ``local``,
``flat``, ``lower``): the model, the mesh, the environment of expressions on that mesh, and the
memo of what tensors share within that one call. A failure is always reported against one tensor
on this mesh (:class:`TensorFailure`), so the context also says how to fail and how to evaluate."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Mapping

from ..errors import BindError, Diagnostic
from ..lang.expr import ExprError, check_extent, evaluate
from .algebra import DimLayout, DimSpec, LayoutError
from .mesh import Mesh

if TYPE_CHECKING:
    from .bind import Model


class TensorFailure(BindError):
    """A BindError about one tensor on one mesh. Besides the rendered diagnostic it keeps the
    ``tensor``, the ``mesh``, the ``problem`` itself (the diagnostic before the tensor is named) and
    its ``cause`` where known (the split or placement that does not fit), so that lowering can
    report a problem shared by many tensors (every layer) once, and say what to change."""

    def __init__(self, model, tensor, problem: Diagnostic, mesh: Mesh, cause=None):
        self.tensor, self.problem, self.mesh, self.cause = tensor, problem, mesh, cause
        where = "" if mesh.is_universal else f" on mesh {mesh}"
        msg = f"{tensor.name} {list(tensor.shape)} ({tensor.kind}){where}: {problem.message}"
        super().__init__([Diagnostic(problem.code, msg, problem.span, problem.hint)], model.spec.text,
                         model.spec.filename)


def fail(model, tensor, span, err: LayoutError | Diagnostic, mesh: Mesh):
    """Raise a BindError (a TensorFailure) naming the tensor, its shape and kind, the mesh and the
    rule's span."""
    d = err if isinstance(err, Diagnostic) else Diagnostic(err.code, str(err), span, err.hint)
    cause = getattr(err, "split", None)
    raise TensorFailure(model, tensor, Diagnostic(d.code, d.message, d.span or span, d.hint), mesh, cause)


def evaluate_in(model, tensor, expr, env, mesh, extent: str | None = None, count: bool = False):
    """An expression of a tensor's rule; a failure is reported against that tensor. An ``extent``
    (a size: a view factor, a concat part, an index count) must not be negative."""
    try:
        value = evaluate(expr, env)
        return check_extent(value, expr, extent, count) if extent is not None else value
    except ExprError as e:
        fail(model, tensor, expr.span, e.diagnostic, mesh)


@dataclass(frozen=True, eq=False)
class CallMemo:
    """What the tensors of one lowering share, found once (absent with ``lower(reuse=False)``, where
    every tensor is lowered on its own). Keys that are ids are of objects kept alive here or by the
    caller for the whole call."""

    # place: per ``index ... over`` node, its count, and its stage sizes with their cumulative sums
    counts: dict[int, int] = field(default_factory=dict)  # id(ast.Index) -> count
    stage_sizes: dict[tuple[int, int, int], tuple[list[int], list[int]]] = field(default_factory=dict)
    nodes: dict[int, object] = field(default_factory=dict)  # keeps the ast ids above taken
    # lower: equal dim trees (every layer's) as one object, so that ids below stand for equal trees
    trees: dict[DimSpec, DimSpec] = field(default_factory=dict)
    # local: (id of a tree kept in ``trees``, coordinates) -> its layout (``dim_layout``'s own cache
    # hashes the whole tree on every call)
    layouts: dict[tuple[int, tuple], DimLayout] = field(default_factory=dict)
    # lower: each (id of a rule kept alive by the model, parameter name, scalar) -> its dim trees: the
    # kinds of a parameter (fp32, exp_avg, ...) follow its rule
    dims: dict[tuple, tuple] = field(default_factory=dict)
    # ids of trees kept in ``trees`` -> the one tuple of them (tensors of one shape share it, and
    # what is keyed by its id)
    dim_tuples: dict[tuple[int, ...], tuple] = field(default_factory=dict)

    def tree(self, d: DimSpec) -> DimSpec:
        return self.trees.setdefault(d, d)


@dataclass(frozen=True, eq=False)
class LoweringContext:
    """One lowering's model, mesh and environment (dims, lets, the mesh's axis sizes), and what its
    tensors share (``memo``; None: each tensor on its own). ``focus``: the ids of the tensors whose
    holdings the call completes (None: every tensor)."""

    model: Model
    mesh: Mesh
    env: Mapping[str, int]
    memo: CallMemo | None = None
    focus: frozenset[int] | None = None

    @classmethod
    def of(cls, model: Model, mesh: Mesh, reuse: bool = True, focus: frozenset[int] | None = None,
           env: Mapping[str, int] | None = None) -> LoweringContext:
        return cls(model, mesh, model.env(mesh) if env is None else env, CallMemo() if reuse else None, focus)

    def fail(self, tensor, span, err: LayoutError | Diagnostic):
        fail(self.model, tensor, span, err, self.mesh)

    def evaluate(self, tensor, expr, extent: str | None = None, count: bool = False):
        return evaluate_in(self.model, tensor, expr, self.env, self.mesh, extent, count)
