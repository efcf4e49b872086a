"""Draft a spec for every decoder type of the installed transformers and grade it (the table of
issue #29's items 4 and 5). ``python tests/hf_sweep.py [TYPE ...]`` prints the table; the tests in
tests/test_hf_draft.py call :func:`grade`.

Columns: drafted (the draft parses), binds (the size-0 model's state dict), other size (a size-1
model, dims read from its own config), tp share (parameter bytes on the largest of 2 tp ranks over
all), fused (fused tensors whose layout was checked against the model's forward code), notes."""
from __future__ import annotations

import os
import sys
import warnings
from dataclasses import dataclass, field

sys.path.insert(0, os.path.dirname(__file__))
import hf_zoo as Z  # noqa: E402


@dataclass
class Grade:
    model_type: str
    drafted: bool = False
    binds: bool = False
    other_size: bool = False
    tp_share: float | None = None
    fused: str = ""
    notes: list[str] = field(default_factory=list)
    text: str = ""

    def row(self) -> str:
        mark = {True: "yes", False: "NO"}
        share = f"{self.tp_share:.0%}" if self.tp_share is not None else "-"
        return (f"| {self.model_type} | {mark[self.drafted]} | {mark[self.binds]} | {mark[self.other_size]} | "
                f"{share} | {self.fused or '-'} | {'; '.join(self.notes)[:160]} |")


def tp_share(model, leave_out: str | None = None) -> float:
    """Elements of parameters on the largest of ``tp=2`` ranks over all elements. Persistent buffers
    (bound as frozen: minimax's decay tables) are not parameters; ``leave_out``: a regex of parameter
    names replicated by design, not counted (see TP_SHARE_BY_DESIGN in tests/test_hf_draft.py)."""
    import re
    from ucl import Mesh
    from ucl.layout.lower import lower
    sm = lower(model, Mesh.parse("tp=2"))
    counted = {t.name for t in model.tensors if t.kind == "param" and t.name not in model.frozen
               and not (leave_out and re.search(leave_out, t.name))}
    total = sum(t.numel for t in model.tensors if t.kind == "param" and t.name in counted)
    per = [sum(int(_numel(s)) for k, (s, _) in sm.rank_datasets(r).items()
               if k.startswith("param/") and k[len("param/"):] in counted) for r in range(2)]
    return max(per) / total if total else 0.0


def _numel(shape) -> int:
    n = 1
    for x in shape:
        n *= int(x)
    return n


def grade(model_type: str, leave_out: str | None = None) -> Grade:
    import ucl
    from ucl.formats.hf import draft_spec_from_hf
    g = Grade(model_type)
    try:
        cfg0, cfg1 = Z.tiny_config(model_type, 0), Z.tiny_config(model_type, 1)
        shapes0, bufs0 = Z.state_shapes(Z.meta_model(cfg0))
        shapes1, bufs1 = Z.state_shapes(Z.meta_model(cfg1))
    except Exception as e:  # noqa: BLE001 - the table says why
        g.notes.append(f"cannot instantiate: {' '.join(str(e).split())[:100]}")
        return g
    try:
        g.text = draft_spec_from_hf(cfg0)
        spec = ucl.load_spec(g.text)
        g.drafted = True
    except Exception as e:  # noqa: BLE001
        g.notes.append(f"draft: {' '.join(str(e).split())[:140]}")
        return g
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = spec.bind(spec.dims_from_config(cfg0.to_dict()), shapes0, frozen=bufs0)
        g.binds = True
        g.tp_share = tp_share(model, leave_out)
    except Exception as e:  # noqa: BLE001
        g.notes.append(f"bind: {' '.join(str(e).split())[:140]}")
    try:
        spec.bind(spec.dims_from_config(cfg1.to_dict()), shapes1, frozen=bufs1)
        g.other_size = True
    except Exception as e:  # noqa: BLE001
        g.notes.append(f"other size: {' '.join(str(e).split())[:140]}")
    return g


def main(types: list[str]) -> int:
    import transformers
    transformers.logging.set_verbosity_error()
    types = types or Z.zoo_types()
    print("| type | drafted | binds | other size | tp share | fused | notes |")
    print("|---|---|---|---|---|---|---|")
    for t in types:
        print(grade(t).row(), flush=True)
    for t, why in sorted(Z.SKIPPED.items()):
        print(f"| {t} | skipped | | | | | {why} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
