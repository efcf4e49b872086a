"""Layout pictures: which rank holds which box of a tensor, drawn with matplotlib.

The geometry is computed first, as plain data (:func:`layout_boxes`, :func:`flat_buffer`), and
drawn second, one rectangle per box in global coordinates: a 128k-row vocabulary draws as fast as
a 10-row one. Boxes are coloured by the lowest rank holding them and labelled with every rank;
boxes held by several ranks (replicas) are dotted, padding (stored rows past the real extent,
alignment gaps of flat buffers) is hatched. Tensors of three or more dims are drawn with their
leading dims flattened into rows; scalars as one cell. matplotlib is imported only when drawing.
"""
from __future__ import annotations

import itertools
import math
import os
from dataclasses import dataclass
from types import SimpleNamespace

from .errors import PlanError, UclError, did_you_mean
from .layout.algebra import DimSpec, dim_layout
from .layout.bind import Model, Tensor
from .layout.dims import build_dims
from .layout.lower import lower
from .layout.mesh import Mesh, as_mesh

MAX_RECTS = 20_000  # N-d tensors flattened into rows can fan out; draw at most this many rectangles
PAD_HATCH, REPLICA_HATCH = "////", ".."


# ---- geometry (pure) ---------------------------------------------------------------------------
@dataclass(frozen=True, order=True)
class Box:
    """Elements ``start:stop`` (per dim) of a tensor, held by ``ranks``. Coordinates are global;
    a ``padding`` box lies past the tensor's real extent (rows a rank stores that hold no data)."""

    start: tuple[int, ...]
    stop: tuple[int, ...]
    ranks: tuple[int, ...]
    padding: bool = False


@dataclass(frozen=True)
class Span:
    """Elements ``[start, stop)`` of a flat buffer: part of member ``name``, or padding (name "")."""

    start: int
    stop: int
    name: str


@dataclass(frozen=True)
class FlatBuffer:
    """One flat buffer (``key`` on the coordinates ``where``) cut into equal partitions held by
    ``partition_ranks``; partition ``j`` is ``[j * part, (j + 1) * part)``."""

    key: str
    where: dict
    axes: tuple[str, ...]
    part: int
    partition_ranks: list[tuple[int, ...]]
    spans: list[Span]
    buffers: int = 1  # how many buffers (on other coordinates, e.g. each tp rank's) hold parts of the tensor


def find_tensor(model: Model, param: str, kind: str = "param") -> Tensor:
    """The tensor ``KIND/param``; an unknown name is PlanError UCL311 with a did-you-mean hint."""
    if param not in model.params:
        hint = did_you_mean(param, model.params)
        raise PlanError(f"no parameter {param!r} in the model" + (f"; {hint}" if hint else ""), code="UCL311")
    kinds = [t.kind for t in model.tensors if t.name == param]
    if kind not in kinds:
        hint = did_you_mean(kind, kinds)
        raise PlanError(f"{param} has no {kind!r} tensor (it has: {', '.join(kinds) or 'none'})"
                        + (f"; {hint}" if hint else ""), code="UCL311")
    return model.tensor(f"{kind}/{param}")


def layout_boxes(model: Model, mesh: Mesh | str, param: str, kind: str = "param") -> list[Box]:
    """Every box of ``KIND/param`` that some rank holds on ``mesh``, with all the ranks holding
    it (replicas merged), padding boxes in the coordinates of the padded dim. Sorted by position."""
    mesh = as_mesh(mesh)
    t = find_tensor(model, param, kind)
    held: dict[tuple, set[int]] = {}
    dims = None  # the tensor's dim trees, built only if some piece holds padding
    for h in lower(model, mesh).holdings[t.id]:
        ranks = mesh.ranks_where(h.fixed).tolist()
        for piece in h.pieces:
            if dims is None and any(len(d.fills) for d in piece):
                dims = build_dims(model, t, model.env(mesh), mesh)
            for start, stop, pad in _piece_boxes(piece, dims, h.fixed, mesh):
                held.setdefault((start, stop, pad), set()).update(ranks)
    return sorted(Box(s, e, tuple(sorted(r)), p) for (s, e, p), r in held.items())


def _piece_boxes(piece, dims, fixed, mesh):
    """(start, stop, is_padding) boxes of one piece: the product of each dim's runs."""
    per_dim = []
    for k, d in enumerate(piece):
        runs = [(int(g), int(n), False) for g, _, n in d.segs]
        if len(d.fills):
            runs += [(g, n, True) for g, n in _padding_runs(d.fills, dims[k], fixed, mesh)]
        per_dim.append(runs)
    for combo in itertools.product(*per_dim):
        yield (tuple(g for g, _, _ in combo), tuple(g + n for g, n, _ in combo), any(p for _, _, p in combo))


def _padding_runs(fills, dim: DimSpec, fixed, mesh):
    """Where a dim's padding (runs of local positions) sits in the padded global dim: lay the dim
    out again as if the padding were real, and map the local positions through it."""
    coords = tuple((a, fixed[a], mesh.axis_size(a)) for a in sorted(dim.node.axes()))
    whole = dim_layout(DimSpec(dim.padded, dim.padded, dim.node), coords)
    for lo, n in fills:
        for g, l, m in whole.segs:
            a, b = max(lo, l), min(lo + n, l + m)
            if a < b:
                yield int(g + a - l), int(b - a)


def flat_buffer(model: Model, mesh: Mesh | str, param: str, kind: str) -> FlatBuffer | None:
    """The flat buffer holding ``KIND/param`` (the first one, if the tensor lies in several, e.g.
    one per tp coordinate), or None when the tensor is not flattened on ``mesh``."""
    mesh = as_mesh(mesh)
    t = find_tensor(model, param, kind)
    sm = lower(model, mesh)
    if t.flat is None or mesh.is_universal or not sm.holdings[t.id]:
        return None
    axes = tuple(a.name for a in t.flat.axes)
    first = sm.holdings[t.id][0]
    key, where = first.slot.key, {a: v for a, v in first.fixed.items() if a not in axes}
    part = first.slot.dataset_shape[0]

    def partition(fixed) -> int | None:
        """The partition a holding or gap of this buffer lies in; None for other buffers."""
        if {a: v for a, v in fixed.items() if a not in axes} != where:
            return None
        j = 0
        for a in axes:
            j = j * mesh.axis_size(a) + fixed[a]
        return j

    spans = []
    for member in model.flat_groups[t.flat_group].members:
        for h in sm.holdings[member.id]:
            if h.slot.key == key and (j := partition(h.fixed)) is not None:
                lo, hi = max(0, h.slot.base), min(part, h.slot.base + math.prod(h.slot.shape))
                spans.append(Span(j * part + lo, j * part + hi, member.name))
    for f in sm.flat_fills:
        if f.slot.key == key and (j := partition(f.fixed)) is not None:
            spans.append(Span(j * part + f.start, j * part + f.start + f.length, ""))
    parts = math.prod(mesh.axis_size(a) for a in axes)
    ranks = [tuple(mesh.ranks_where({**where, **_unravel(j, axes, mesh)}).tolist()) for j in range(parts)]
    buffers = len({tuple(sorted((a, v) for a, v in h.fixed.items() if a not in axes)) for h in sm.holdings[t.id]})
    return FlatBuffer(key, where, axes, part, ranks, sorted(spans, key=lambda s: s.start), buffers)


def _unravel(j: int, axes, mesh: Mesh) -> dict[str, int]:
    out = {}
    for a in reversed(axes):
        out[a] = j % mesh.axis_size(a)
        j //= mesh.axis_size(a)
    return out


def ranks_text(ranks) -> str:
    """``r3``, ``r0,2``, ``r0-3`` (three or more consecutive), ``r0,8,…,56`` (a long stride)."""
    r = list(ranks)
    steps = {b - a for a, b in zip(r, r[1:])}
    if len(r) > 2 and steps == {1}:
        return f"r{r[0]}-{r[-1]}"
    if len(r) <= 4:
        return "r" + ",".join(map(str, r))
    return f"r{r[0]},{r[1]},…,{r[-1]}" if len(steps) == 1 else f"r{r[0]},{r[1]},{r[2]},… ({len(r)} ranks)"


# ---- drawing ------------------------------------------------------------------------------------
def _matplotlib() -> SimpleNamespace:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UclError("layout pictures need matplotlib: pip install matplotlib (or ucl[viz])", code="UCL009") from None
    from matplotlib import colormaps, patches, ticker
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.collections import Collection, PatchCollection
    from matplotlib.figure import Figure
    return SimpleNamespace(colormaps=colormaps, patches=patches, ticker=ticker, Figure=Figure, PatchCollection=PatchCollection,
                           FigureCanvasAgg=FigureCanvasAgg, hatchcolor=hasattr(Collection, "set_hatchcolor"))


def _new_figure(width: float, height: float):
    mpl = _matplotlib()
    fig = mpl.Figure(figsize=(width, height), dpi=110, layout="constrained")
    mpl.FigureCanvasAgg(fig)  # Agg for this figure only: no global backend switch, no pyplot state
    return fig


def _colour(rank: int, nranks: int):
    cmap = _matplotlib().colormaps["tab10" if nranks <= 10 else "tab20"]
    return cmap(rank % cmap.N)


def _lighter(colour, amount=0.55):
    return tuple(c + (1 - c) * amount for c in colour[:3]) + (1.0,)


def _style(padding: bool, replicated: bool) -> dict:
    """Hatching: padding striped in grey, replicas dotted in white (black before matplotlib 3.10)."""
    if not (padding or replicated):
        return {}
    style = {"hatch": PAD_HATCH if padding else REPLICA_HATCH}
    if _matplotlib().hatchcolor:
        style["hatchcolor"] = (0.25, 0.25, 0.25, 1) if padding else (1, 1, 1, 0.85)
    return style


def _rects(box: Box, extent: tuple[int, ...]):
    """(x, y, width, height) rectangles of a box in the drawing's (col, row) coordinates."""
    if not extent:
        return [(0, 0, 1, 1)]
    x, w = box.start[-1], box.stop[-1] - box.start[-1]
    return [(x, lo, w, hi - lo) for lo, hi in _row_runs(box.start[:-1], box.stop[:-1], extent[:-1])]


def _row_runs(lo, hi, extent):
    """Rows covered by leading dims ``lo:hi`` (extents ``extent``) flattened row-major, as ranges."""
    if not lo:
        return [(0, 1)]
    inner = math.prod(extent[1:])
    if all(a == 0 and b == e for a, b, e in zip(lo[1:], hi[1:], extent[1:])):
        return [(lo[0] * inner, hi[0] * inner)]
    return [(i * inner + a, i * inner + b) for i in range(lo[0], hi[0]) for a, b in _row_runs(lo[1:], hi[1:], extent[1:])]


def _ticks(ax, axis: str, edges, limit: int):
    """Ticks at the box edges when they are few (thinned so labels do not collide), else plain."""
    keep = []
    for e in sorted(set(edges)):
        if not keep or e - keep[-1] >= 0.045 * limit:
            keep.append(e)
    target = ax.xaxis if axis == "x" else ax.yaxis
    if len(keep) <= 14:
        target.set_ticks(keep)
    target.set_major_formatter(_matplotlib().ticker.StrMethodFormatter("{x:,.0f}"))
    ax.tick_params(axis=axis, labelsize=7)
    (ax.set_xlim(0, limit) if axis == "x" else ax.set_ylim(limit, 0))  # row 0 at the top, like a matrix


def draw_layout(model: Model, mesh: Mesh | str, param: str, *, kind: str = "param", ax=None):
    """Draw which rank holds which box of ``KIND/param`` on ``mesh`` into ``ax`` (a new figure if
    None); returns the Axes."""
    t = find_tensor(model, param, kind)
    if ax is None:
        ax = _new_figure(*{0: (5, 3.2), 1: (9, 2.6)}.get(len(t.shape), (8, 6))).add_subplot()
    _draw_tensor(ax, model, as_mesh(mesh), t, f"{t.kind}/{t.name}")
    return ax


def _draw_tensor(ax, model: Model, mesh: Mesh, t: Tensor, heading: str):
    mpl = _matplotlib()
    boxes = layout_boxes(model, mesh, t.name, t.kind)
    extent = tuple(max([n] + [b.stop[k] for b in boxes]) for k, n in enumerate(t.shape))  # grown by padding
    rows, cols = max(1, math.prod(extent[:-1])), max(1, extent[-1]) if extent else 1  # N-d: dims[:-1] into rows
    styles: dict[tuple, tuple[list, list]] = {}
    drawn, xs, ys = 0, {0, cols}, {0, rows}
    for box in boxes:
        rects = _rects(box, extent)[:max(0, MAX_RECTS - drawn)]
        drawn += len(rects)
        colour = _colour(box.ranks[0], mesh.size)
        shapes, faces = styles.setdefault((box.padding, len(box.ranks) > 1), ([], []))
        for x, y, w, h in rects:
            shapes.append(mpl.patches.Rectangle((x, y), w, h))
            faces.append(_lighter(colour) if box.padding else colour)
            xs.update((x, x + w))
            ys.update((y, y + h))
        if rects:
            _label(ax, box, max(rects, key=lambda r: r[2] * r[3]), rows, cols)
    for (padding, replicated), (shapes, faces) in styles.items():
        ax.add_collection(mpl.PatchCollection(shapes, facecolors=faces, edgecolors="black", linewidths=0.8,
                                              **_style(padding, replicated)))
    _ticks(ax, "x", xs, cols)
    _ticks(ax, "y", ys, rows)
    nd = len(t.shape)
    if nd and extent[-1] > t.shape[-1]:
        ax.axvline(t.shape[-1], color="black", linestyle="--", linewidth=1.2)
    if nd == 2 and extent[0] > t.shape[0]:
        ax.axhline(t.shape[0], color="black", linestyle="--", linewidth=1.2)
        ax.annotate(f"▲ {t.shape[0]:,} rows\n▼ {extent[0] - t.shape[0]:,} padding", (cols, t.shape[0]), xytext=(4, 0),
                    textcoords="offset points", fontsize=7, va="center", annotation_clip=False)
    ax.set_box_aspect(1 if nd == 0 else 0.1 if nd == 1 else min(1.3, max(0.3, rows / cols)))
    if nd <= 1:
        ax.set(yticks=[], xticks=[] if nd == 0 else ax.get_xticks())
    ax.set_xlabel("scalar" if nd == 0 else f"dim {nd - 1}", fontsize=8)
    if nd >= 2:
        ax.set_ylabel("dim 0" if nd == 2 else f"dims 0-{nd - 2} flattened", fontsize=8)
    padded = "" if extent == t.shape else f", stored as {list(extent)}"
    flattened = f"\ndrawn as [{rows:,}, {cols:,}]: dims 0-{nd - 2} flattened into rows" if nd >= 3 else ""
    cut = f"\nonly the first {MAX_RECTS:,} rectangles drawn" if drawn >= MAX_RECTS else ""
    ax.set_title(f"{heading}\n{list(t.shape)} {t.dtype} on {mesh}{padded}{flattened}{cut}", fontsize=9)
    _legend(ax, mesh, boxes)


def _label(ax, box: Box, rect, rows: int, cols: int):
    """The box's ranks, in the middle of its largest rectangle if that is big enough to read."""
    x, y, w, h = rect
    fw, fh = w / cols, h / rows if rows > 1 else 1.0
    if fw < 0.035 or fh < 0.03:
        return
    size = 9 if min(fw, fh) > 0.15 else 7 if min(fw, fh) > 0.06 else 5.5
    ax.text(x + w / 2, y + h / 2, ranks_text(box.ranks) + (" pad" if box.padding else ""), ha="center",
            va="center", fontsize=size, fontweight="bold",
            bbox=dict(boxstyle="round,pad=0.15", facecolor="white", alpha=0.8, linewidth=0))


def _legend(ax, mesh: Mesh, boxes: list[Box]):
    """One entry per group of ranks (its mesh coordinates, ``*`` where the replicas differ)."""
    patches = _matplotlib().patches
    handles = []
    groups = sorted({b.ranks for b in boxes})
    if len(groups) <= 16:
        for g in groups:
            coords = [mesh.coords(r) for r in g]
            where = " ".join(f"{a}={'*' if len({c[a] for c in coords}) > 1 else coords[0][a]}" for a in mesh.names)
            handles.append(patches.Patch(facecolor=_colour(g[0], mesh.size), edgecolor="black",
                                         label=f"{ranks_text(g)}  {where or 'universal'}", **_style(False, len(g) > 1)))
    if any(b.padding for b in boxes):
        handles.append(patches.Patch(facecolor="white", edgecolor="black", label="padding", **_style(True, False)))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.02, 1), fontsize=7, frameon=False,
              borderaxespad=0, handlelength=1.8, handleheight=1.3)


def _short(name: str) -> str:
    """``decoder.layers.2.mlp.linear_fc1.weight`` -> ``2.linear_fc1.weight``: indices and the tail."""
    parts = name.split(".")
    short = ".".join([p for p in parts[:-2] if p.isdigit()] + parts[-2:])
    return short if len(short) <= 26 else "…" + short[-25:]


def _draw_buffer(ax, buf: FlatBuffer, highlight: str, mesh: Mesh):
    """One flat buffer along x: partitions coloured by the rank holding them, member ranges
    outlined (``highlight`` in full colour, the others pale), alignment and padding gaps hatched."""
    mpl = _matplotlib()
    n = len(buf.partition_ranks)
    styles: dict[bool, tuple[list, list]] = {False: ([], []), True: ([], [])}
    members: dict[str, tuple[int, int]] = {}
    for s in buf.spans:
        colour = _colour(buf.partition_ranks[s.start // buf.part][0], mesh.size)
        shapes, faces = styles[not s.name]
        shapes.append(mpl.patches.Rectangle((s.start, 0), s.stop - s.start, 1))
        faces.append("white" if not s.name else colour if s.name == highlight else _lighter(colour, 0.72))
        if s.name:
            a, b = members.get(s.name, (s.start, s.stop))
            members[s.name] = (min(a, s.start), max(b, s.stop))
    for padding, (shapes, faces) in styles.items():
        ax.add_collection(mpl.PatchCollection(shapes, facecolors=faces, edgecolors="black", linewidths=0.4,
                                              **_style(padding, False)))
    for name, (a, b) in members.items():
        if name != highlight and (b - a) / (n * buf.part) > 0.02:
            ax.text((a + b) / 2, 0.5, _short(name), rotation=90, ha="center", va="center", fontsize=5.5, clip_on=True)
    lo, hi = members[highlight]
    ax.add_patch(mpl.patches.Rectangle((lo, 0), hi - lo, 1, fill=False, edgecolor="black", linewidth=3))
    ax.plot([(lo + hi) / 2], [1], marker="v", markersize=9, color="black", clip_on=False)  # findable when thin
    for j in range(1, n):
        ax.axvline(j * buf.part, color="black", linewidth=2.2)
    ax.set(xlim=(0, n * buf.part), ylim=(0, 1), yticks=[])
    ax.set_xticks([j * buf.part for j in (range(n + 1) if n <= 4 else (0, n))])  # long numbers: few of them
    ax.xaxis.set_major_formatter(mpl.ticker.StrMethodFormatter("{x:,.0f}"))
    labelled = range(0, n, -(-n // 8))  # partitions named below the axis: at most 8
    ax.set_xticks([(j + 0.5) * buf.part for j in labelled], minor=True, labels=[
        ",".join(f"{a}={v}" for a, v in _unravel(j, buf.axes, mesh).items()) + ": " + ranks_text(buf.partition_ranks[j])
        for j in labelled])
    ax.tick_params(axis="x", which="major", labelsize=7)
    ax.tick_params(axis="x", which="minor", length=0, pad=15, labelsize=8)
    where = ",".join(f"{a}={v}" for a, v in buf.where.items() if a in mesh.names)
    which = f" (1 of {buf.buffers} holding it)" if buf.buffers > 1 else ""
    padding = sum(s.stop - s.start for s in buf.spans if not s.name)
    ax.set_title(f"flat buffer {buf.key}{' on ' + where if where else ''}{which}: {len(members)} members\n"
                 f"{n} partitions over {'x'.join(buf.axes)} of {buf.part:,} elements, "
                 f"{f'{padding:,} padding elements (hatched)' if padding else 'no padding'}\n"
                 f"{highlight} (outlined): elements {lo:,} to {hi:,}", fontsize=8, pad=10)


# ---- figures ------------------------------------------------------------------------------------
def _spec_lines(model: Model, tensors: list[Tensor]) -> str:
    """The spec statements behind the tensors drawn: their rule, then each state declaration."""
    lines = model.spec.text.splitlines()
    spans = [tensors[0].rule.span] + [t.state.span for t in tensors if t.state is not None and t.kind != "param"]
    return "\n".join(dict.fromkeys(" ".join(x.strip() for x in lines[s.line - 1:s.end_line]) for s in spans))


def _finish(fig, title: str, model: Model, tensors: list[Tensor], path):
    fig.suptitle(title, fontsize=12, fontweight="bold")
    fig.supxlabel(_spec_lines(model, tensors), fontsize=7, family="monospace", x=0.01, ha="left")
    fig.savefig(os.fspath(path))
    return path


def _changed_param(model: Model, src: Mesh, dst: Mesh, kind: str) -> str:
    """The first parameter whose boxes of ``kind`` differ between the layouts, else the first
    whose ranks differ, else the first."""
    pairs = [(t.name, layout_boxes(model, src, t.name, kind), layout_boxes(model, dst, t.name, kind))
             for t in model.tensors if t.kind == kind]
    geometry = (lambda boxes: [(b.start, b.stop, b.padding) for b in boxes])
    for differs in (lambda a, b: geometry(a) != geometry(b), lambda a, b: a != b, lambda a, b: True):
        for name, a, b in pairs:
            if differs(a, b):
                return name
    return next(iter(model.params))


def draw_plan(model: Model, src: Mesh | str, dst: Mesh | str, path, *, param: str | None = None,
              kind: str = "param"):
    """Source and target layouts of ``KIND/param`` side by side (by default the first parameter
    whose boxes change, else the first whose ranks change), with their flat buffers below if the
    tensor is flattened; written as a PNG to ``path``, which is returned."""
    src, dst = as_mesh(src), as_mesh(dst)
    t = find_tensor(model, param if param is not None else _changed_param(model, src, dst, kind), kind)
    param = t.name
    buffers = [flat_buffer(model, m, param, kind) for m in (src, dst)]
    flat = any(b is not None for b in buffers)
    top = 2.4 if len(t.shape) <= 1 else 5.2  # vectors and scalars need little height
    fig = _new_figure(14, top + 0.8 + 2.4 * flat)
    grid = fig.add_gridspec(2 if flat else 1, 2, height_ratios=[top, 2.4] if flat else None)
    for col, (mesh, buf, side) in enumerate(zip((src, dst), buffers, ("source", "target"))):
        _draw_tensor(fig.add_subplot(grid[0, col]), model, mesh, t, side)
        if buf is not None:
            _draw_buffer(fig.add_subplot(grid[1, col]), buf, param, mesh)
    return _finish(fig, f"reshard {src} → {dst}:  {t.kind}/{t.name}", model, [t], path)


def draw_checkpoint(ckpt_path, path, *, param: str | None = None):
    """A parameter as a checkpoint stores it: its layout, beside it its optimizer states where
    they are laid out differently (kinds laid out alike drawn once), and below the flat buffer of
    flattened states. ``param`` defaults to the first split or padded parameter. Written as a PNG
    to ``path``, which is returned."""
    from .ops import mesh_of, model_of, open_checkpoint
    with open_checkpoint(ckpt_path) as ckpt:
        model, mesh = model_of(ckpt), mesh_of(ckpt)
    if param is None:
        names = list(model.params)
        param = next((n for n in names if len(layout_boxes(model, mesh, n)) > 1), names[0])
    find_tensor(model, param)
    groups: dict[tuple, list[Tensor]] = {}
    for t in model.tensors:
        if t.name == param:
            groups.setdefault(tuple(layout_boxes(model, mesh, param, t.kind)), []).append(t)
    panels = list(groups.values())
    buffers = [b for b in (flat_buffer(model, mesh, param, ts[0].kind) for ts in panels) if b is not None]
    widths = [0.5 if ts[0].scalar else 1 for ts in panels]
    fig = _new_figure(max(8.0, 5.5 * sum(widths) + 1.5), 6 + 2 * len(buffers))
    grid = fig.add_gridspec(1 + len(buffers), len(panels), width_ratios=widths, height_ratios=[3] + [1] * len(buffers))
    for col, ts in enumerate(panels):
        _draw_tensor(fig.add_subplot(grid[0, col]), model, mesh, ts[0], ", ".join(t.kind for t in ts))
    for row, buf in enumerate(buffers, start=1):
        _draw_buffer(fig.add_subplot(grid[row, :]), buf, param, mesh)
    title = f"{os.path.basename(os.path.normpath(os.fspath(ckpt_path)))} ({mesh}, {mesh.size} ranks):  {param}"
    return _finish(fig, title, model, [ts[0] for ts in panels], path)
