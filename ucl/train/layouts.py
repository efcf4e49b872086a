"""The layout a checkpointer saves and loads in: a manual one (``spec=``/``mesh=``) or one derived
from the module at each save; the bound ``Model`` of each layout seen, and the check that the
module's local tensors are what that layout puts on this rank."""
from __future__ import annotations

import warnings

from ..dtypes import logical_of_torch_dtype
from ..errors import StoreError, UclError
from ..lang.spec import Spec, load_spec
from ..layout.bind import Model
from ..layout.mesh import as_mesh
from ..ops.prepare import expected_datasets
from .derive import TrainLayout, derive

SPEC_NAME = "ucl.train"


def bind_manual(spec, mesh) -> Model | None:
    """The bound model of a manual layout, or None to derive one."""
    if spec is None:
        if mesh is not None:
            raise UclError("mesh= needs spec= (a manual layout); without both the layout is derived", code="UCL430")
        return None
    if isinstance(spec, Model):
        return spec
    s = load_spec(spec) if not isinstance(spec, Spec) else spec
    dims = {}
    model = s.bind(dims, s.synthesize_params(dims))
    for d in model.unmatched():  # a misspelt `state ... for` pattern would describe another layout
        warnings.warn(d.render(s.text, s.filename), stacklevel=4)
    return model


class Layouts:
    def __init__(self, spec=None, mesh=None, world: int = 1):
        self.bound = bind_manual(spec, mesh)
        self.mesh = as_mesh(mesh) if mesh is not None else None
        if self.bound is not None:  # what can be checked before the first save
            if self.mesh is None:
                raise UclError("spec= needs mesh= (the layout the module's local tensors have)", code="UCL430")
            self.mesh.check_axes(self.bound.spec.checked.axes)
            if self.mesh.size != world:
                raise UclError(f"mesh {self.mesh} has {self.mesh.size} ranks but the job has {world} processes: "
                               "one process per rank of the mesh", code="UCL430")
        self._models: dict[tuple, Model] = {}
        self._stored: dict[tuple, frozenset[str]] = {}

    def current(self, module, optimizer, reading: bool = False) -> TrainLayout:
        """The layout of ``module`` and ``optimizer`` as they are now (``reading``: to restore into,
        see ``derive``)."""
        return derive(module, optimizer, bound=self.bound, mesh=self.mesh, reading=reading)

    def model_of(self, layout: TrainLayout) -> Model:
        model = self._models.get(layout.signature)
        if model is None:
            if self.bound is not None:
                model = self.bound
            else:
                spec = Spec.from_text(layout.spec_text, "<derived spec>", name=SPEC_NAME)
                model = spec.bind(layout.dims, layout.params, frozen=layout.frozen)
            self._models[layout.signature] = model
        return model

    def stored(self, layout: TrainLayout) -> frozenset[str]:
        """The keys this rank writes: what it holds, less the replicas another rank stores."""
        keys = self._stored.get(layout.signature)
        if keys is None:
            keys = self._stored[layout.signature] = frozenset(
                expected_datasets(self.model_of(layout), layout.mesh, layout.rank, stored=True)
                if layout.rank >= 0 else ())
        return keys

    def validate(self, layout: TrainLayout) -> None:
        """UCL421 naming every mismatch when this rank's tensors are not what the layout says; each
        layout is checked once."""
        if layout.signature in self._models:
            return
        model = self.model_of(layout)
        if layout.rank < 0:
            return
        want = expected_datasets(model, layout.mesh, layout.rank)
        have = {e.key: (tuple(e.tensor.shape), logical_of_torch_dtype(e.tensor.dtype)) for e in layout.entries}
        kinds_have = {k.split("/", 1)[0] for k in have}
        absent = sorted({k.split("/", 1)[0] for k in want} - kinds_have)
        problems = [f"the optimizer holds no {', '.join(absent)} state (it holds "
                    f"{', '.join(sorted(kinds_have - {'param'})) or 'none: state appears at its first step(), and plain SGD has none'}"
                    "); "
                    "the spec's `state` statements must name the optimizer's own kinds"] if absent else []
        problems += [f"missing {k} {list(s)} {d}" for k, (s, d) in sorted(want.items())
                     if k not in have and k.split("/", 1)[0] not in absent]
        problems += [f"unexpected {k}" for k in sorted(set(have) - set(want))]
        problems += [f"{k}: the spec says {list(want[k][0])} {want[k][1]}, the module has {list(s)} {d}"
                     for k, (s, d) in sorted(have.items()) if k in want and (tuple(want[k][0]), want[k][1]) != (s, d)]
        if problems:
            self._models.pop(layout.signature, None)
            more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
            raise StoreError(f"rank {layout.rank} of {layout.mesh}: the module does not match the layout:\n  "
                             + "\n  ".join(problems[:20]) + more, code="UCL421")
