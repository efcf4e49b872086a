"""Reading and showing the checkpointer's traces (``ROOT/trace-rank*.jsonl``, see ``trace.py``).

:func:`load_trace` reads every rank's events, :func:`summarize` computes what training lost and
how long checkpoints took to become durable, :func:`to_chrome` converts to the Chrome trace event
format (Perfetto, chrome://tracing) and :func:`draw_timeline` draws a PNG with matplotlib, which
is imported only when drawing. See docs/trace.md.
"""
from __future__ import annotations

import bisect
import fnmatch
import json
import math
import os
import statistics
import warnings

from ..errors import StoreError, UclError

MAX_TRACE_BYTES = 256 << 20
TRACE_GLOB = "trace-rank*.jsonl"
# phase -> lane (Chrome tid): the training thread, the snapshot copier, the flusher, the promoter
LANES = {"blocked": 0, "fence": 0, "restore": 0, "snapshot": 1, "flush": 2, "local": 2, "replicated": 2,
         "promote": 3}
LANE_NAMES = ("training", "snapshot", "flush", "promote")
COLOURS = {"blocked": "#d62728", "fence": "#ff7f0e", "snapshot": "#1f77b4", "flush": "#2ca02c",
           "promote": "#9467bd", "restore": "#8c564b", "local": "#17becf", "replicated": "#bcbd22"}
LEGEND = {"blocked": "blocked in save()", "fence": "fence (optimizer step waited)", "snapshot": "snapshot copy",
          "flush": "flush (write, commit, latest, prune)", "promote": "promote to a further tier",
          "restore": "load (host memory, or the tiers)", "local": "write to the node-local tier",
          "replicated": "copies sent to peer nodes"}


class TraceWarning(UserWarning):
    """Lines of a trace file that are not events were skipped."""


# ---- reading -------------------------------------------------------------------------------------
def trace_files(root) -> list[str]:
    """The trace files in ``root``, sorted; StoreError UCL404 if there are none."""
    root = os.fspath(root)
    if not os.path.isdir(root):
        raise StoreError(f"no trace: {root} is not a folder", code="UCL404")
    names = sorted(n for n in os.listdir(root) if fnmatch.fnmatch(n, TRACE_GLOB))
    files = [os.path.join(root, n) for n in names if os.path.isfile(os.path.join(root, n))]
    if not files:
        raise StoreError(f"no trace files ({TRACE_GLOB}) in {root}", code="UCL404")
    return files


def load_trace(root) -> list[dict]:
    """Every event of every rank's trace file in ``root``, sorted by start. Malformed lines are
    skipped and counted in one :class:`TraceWarning`."""
    events, skipped = [], {}
    for path in trace_files(root):
        try:
            size = os.path.getsize(path)
            if size > MAX_TRACE_BYTES:
                raise StoreError(f"{path} is {size >> 20} MiB, larger than the {MAX_TRACE_BYTES >> 20} MiB "
                                 "a trace is read up to", code="UCL401")
            with open(path, encoding="utf-8", errors="replace") as f:
                lines = f.read().splitlines()
        except OSError as e:
            raise StoreError(f"cannot read {path}: {e}", code="UCL401") from None
        for line in lines:
            event = _event(line) if line.strip() else {}
            if event is None:
                skipped[os.path.basename(path)] = skipped.get(os.path.basename(path), 0) + 1
            elif event:
                events.append(event)
    if skipped:
        where = ", ".join(f"{name}: {n}" for name, n in sorted(skipped.items()))
        warnings.warn(TraceWarning(f"skipped {sum(skipped.values())} malformed trace lines in "
                                   f"{os.fspath(root)} ({where})"), stacklevel=2)
    events.sort(key=lambda e: e["start"])
    return events


def _event(line: str) -> dict | None:
    """The event a line holds, or None if it is not one (bad JSON, unknown phase, bad times)."""
    try:
        e = json.loads(line)
    except ValueError:
        return None
    if not isinstance(e, dict) or e.get("phase") not in LANES or not _is_int(e.get("rank")) or e["rank"] < 0:
        return None
    times = (e.get("start"), e.get("end"))
    if not all(_is_number(t) and math.isfinite(t) for t in times) or times[1] < times[0]:
        return None
    if "step" in e and not _is_int(e["step"]):
        return None
    if "run" in e and not (_is_number(e["run"]) and math.isfinite(e["run"])):
        return None
    return e


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


# ---- summary (pure) ------------------------------------------------------------------------------
def summarize(events: list[dict]) -> dict:
    """Counts and times (seconds) of a trace: ``saves`` (steps saved: every process calls save()
    for each), ``save_calls`` (save() calls on all ranks), ``checkpoints`` (steps flushed),
    ``blocked_s`` (total time in save, all ranks), ``blocked_median_s`` (per call), ``fence_s``
    (fence waits outside save, which blocked_s already holds), ``durable_median_s`` (per step: the
    last end of its flush on any rank minus the first start of its save), ``promoted_median_s``
    (the same to the last end of its promotions to further tiers; None without any),
    ``pool_peak_mib`` (host pool high-water), ``snapshot_cpu_s``, ``flush_cpu_s`` and
    ``promote_cpu_s`` (CPU time of those background phases, all ranks; None where the events
    carry none), ``snapshot_median_s`` and ``flush_median_s`` (per event), ``ranks`` and
    ``span_s``. Summarize each of :func:`split_runs` for a resumed root."""
    by_phase = {p: [e for e in events if e["phase"] == p] for p in LANES}
    blocked = [e["end"] - e["start"] for e in by_phase["blocked"]]
    saves_of_rank: dict[int, list] = {}
    for e in sorted(by_phase["blocked"], key=lambda e: e["start"]):
        saves_of_rank.setdefault(e["rank"], []).append((e["start"], e["end"]))
    fence = 0.0
    for e in by_phase["fence"]:
        saves = saves_of_rank.get(e["rank"], [])
        i = bisect.bisect_right(saves, (e["start"], math.inf)) - 1
        if i < 0 or saves[i][1] < e["end"]:  # not inside a save() of the same rank
            fence += e["end"] - e["start"]
    begun: dict[int, list] = {}
    for e in by_phase["blocked"]:
        begun.setdefault(e.get("step"), []).append(e["start"])
    durable = _save_to_last_end(by_phase["flush"], begun)
    promoted = _save_to_last_end(by_phase["promote"], begun)
    peaks = [e["pool_high_water"] for e in events if _is_number(e.get("pool_high_water"))]
    return {"ranks": sorted({e["rank"] for e in events}), "saves": len({e.get("step") for e in by_phase["blocked"]}),
            "save_calls": len(blocked),
            "checkpoints": len({e.get("step") for e in by_phase["flush"]}),
            "blocked_s": sum(blocked), "blocked_median_s": statistics.median(blocked) if blocked else None,
            "fence_s": fence, "durable_median_s": statistics.median(durable) if durable else None,
            "promoted_median_s": statistics.median(promoted) if promoted else None,
            "pool_peak_mib": max(peaks) / 2**20 if peaks else None,
            "snapshot_median_s": _median_s(by_phase["snapshot"]), "flush_median_s": _median_s(by_phase["flush"]),
            **{f"{p}_cpu_s": _total_cpu(by_phase[p]) for p in ("snapshot", "flush", "promote")},
            "span_s": max(e["end"] for e in events) - min(e["start"] for e in events) if events else 0.0}


def split_runs(events: list[dict]) -> list[list[dict]]:
    """The events of each run, in order: a root resumed by later processes holds several runs, each
    rank's file appended by one lifetime after another, so a rank's k-th distinct ``run`` belongs
    to the job's k-th run (events written before runs were recorded count as each rank's first)."""
    started: dict[int, list] = {}
    for e in events:
        started.setdefault(e["rank"], set()).add(e.get("run", -math.inf))
    index = {rank: {run: i for i, run in enumerate(sorted(runs))} for rank, runs in started.items()}
    out: list[list[dict]] = [[] for _ in range(max((len(i) for i in index.values()), default=0))]
    for e in events:
        out[index[e["rank"]][e.get("run", -math.inf)]].append(e)
    return out


def summary_lines(events: list[dict], root=None) -> list[str]:
    """The trace as a few readable lines: per run its ranks, steps, time blocked in save(), the
    medians of snapshot, flush and save-to-durable, and the host pool's high-water mark."""
    runs = split_runs(events)
    span = max((e["end"] for e in events), default=0.0) - min((e["start"] for e in events), default=0.0)
    lines = [f"{os.fspath(root) + ': ' if root is not None else ''}{len(runs)} run{'s' * (len(runs) != 1)}"
             f" over {_seconds(span)}" + (" (resumed: each later run appended to the same root)" if len(runs) > 1 else "")]
    for i, run in enumerate(runs, 1):
        s = summarize(run)
        steps = sorted({e["step"] for e in run if e["phase"] == "blocked" and "step" in e})
        ranks = s["ranks"]
        where = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks[0]}-{ranks[-1]} ({len(ranks)})"
        lines.append(f"run {i}: {where}, {_seconds(s['span_s'])}, "
                     + (f"steps {steps[0]}-{steps[-1]} " if len(steps) > 1 else f"step {steps[0]} " if steps else "")
                     + f"({s['saves']} saved, {s['checkpoints']} flushed)")
        lines.append(f"  blocked in save(): {_seconds(s['blocked_s'])} total, median {_seconds(s['blocked_median_s'])}"
                     f" per call; optimizer step waited {_seconds(s['fence_s'])}")
        lines.append(f"  medians: snapshot {_seconds(s['snapshot_median_s'])}, flush {_seconds(s['flush_median_s'])}, "
                     f"save to durable {_seconds(s['durable_median_s'])}"
                     + (f", save to promoted {_seconds(s['promoted_median_s'])}" if s["promoted_median_s"] else ""))
        peak = "n/a" if s["pool_peak_mib"] is None else f"{s['pool_peak_mib']:.1f} MiB"
        lines.append(f"  host pool high-water {peak}")
    return lines


def _median_s(events: list[dict]) -> float | None:
    return statistics.median(e["end"] - e["start"] for e in events) if events else None


def _total_cpu(events: list[dict]) -> float | None:
    cpu = [e["cpu"] for e in events if _is_number(e.get("cpu"))]
    return sum(cpu) if cpu else None


def _save_to_last_end(events: list[dict], begun: dict[int, list]) -> list[float]:
    """Per step of ``events``: their last end minus the first start of that step's save before it."""
    done: dict[int, float] = {}
    for e in events:
        if "step" in e:
            done[e["step"]] = max(done.get(e["step"], -math.inf), e["end"])
    out = []
    for step, end in done.items():
        starts = [t for t in begun.get(step, ()) if t <= end]
        if starts:
            out.append(end - min(starts))
    return out


# ---- Chrome trace event format -------------------------------------------------------------------
def to_chrome(events: list[dict]) -> dict:
    """The events as Chrome trace events: one complete ("X") event each, ts/dur in microseconds
    since the first event, pid = rank, tid = lane; plus process and thread names ("M")."""
    t0 = min((e["start"] for e in events), default=0.0)
    out = []
    for rank in sorted({e["rank"] for e in events}):
        out.append({"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}})
        out.append({"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "args": {"sort_index": rank}})
        out += [{"ph": "M", "name": "thread_name", "pid": rank, "tid": lane, "args": {"name": name}}
                for lane, name in enumerate(LANE_NAMES)]
    for e in events:
        out.append({"ph": "X", "name": e["phase"], "cat": "ucl.checkpoint", "pid": e["rank"], "tid": LANES[e["phase"]],
                    "ts": round((e["start"] - t0) * 1e6, 3), "dur": round((e["end"] - e["start"]) * 1e6, 3),
                    "args": {k: v for k, v in e.items() if k not in ("rank", "phase", "start", "end")}})
    return {"traceEvents": out, "displayTimeUnit": "ms", "otherData": {"origin_unix_s": t0}}


def write_chrome(root, path):
    """Write the trace of ``root`` as Chrome trace JSON to ``path``, which is returned."""
    with open(os.fspath(path), "w") as f:
        json.dump(to_chrome(load_trace(root)), f)
    return path


# ---- drawing -------------------------------------------------------------------------------------
def draw_timeline(root, path) -> dict:
    """Draw the trace of ``root`` as a PNG at ``path``: per rank a training lane (what training
    lost) and background lanes, checkpoint steps on top, the summary in the title. Returns the
    summary (:func:`summarize`)."""
    events = load_trace(root)
    summary = summarize(events)
    Figure, FigureCanvasAgg, Patch = _matplotlib()
    ranks = summary["ranks"]
    row = {r: i * (len(LANE_NAMES) + 1) for i, r in enumerate(ranks)}  # a gap row between ranks
    nrows = max(len(ranks) * (len(LANE_NAMES) + 1) - 1, 1)
    fig = Figure(figsize=(12, min(2.6 + 0.28 * nrows, 40)), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)  # Agg for this figure only: no global backend, no pyplot state
    ax = fig.add_subplot()
    t0 = min((e["start"] for e in events), default=0.0)
    spans: dict[tuple, list] = {}
    for e in events:
        spans.setdefault((e["phase"], e["rank"]), []).append((e["start"] - t0, e["end"] - e["start"]))
    order = {p: i for i, p in enumerate(("snapshot", "flush", "promote", "blocked", "fence"))}  # fences over saves
    for (phase, rank), xs in sorted(spans.items(), key=lambda kv: (order.get(kv[0][0], -1), kv[0][1])):
        y = row[rank] + LANES[phase]
        ax.broken_barh(xs, (y - 0.38, 0.76), facecolors=COLOURS[phase], edgecolors=COLOURS[phase], linewidth=0.6)
    ticks = [row[r] + lane for r in ranks for lane in range(len(LANE_NAMES))]
    ax.set_yticks(ticks, [f"rank {r} · {name}" for r in ranks for name in LANE_NAMES], fontsize=8)
    for r in ranks[1:]:
        ax.axhline(row[r] - 1, color="0.8", linewidth=0.8)
    ax.set_ylim(nrows - 0.5, -0.5)
    ax.set_xlim(0, max(summary["span_s"], 1e-6) * 1.01)
    ax.set_xlabel("seconds since the first event")
    ax.grid(axis="x", color="0.92")
    ax.set_axisbelow(True)
    _mark_steps(ax, events, t0, summary["span_s"])
    _mark_runs(ax, split_runs(events), t0)
    fig.legend([Patch(color=COLOURS[p]) for p in LEGEND], LEGEND.values(), loc="outside lower center",
               ncols=len(LEGEND), fontsize=8, frameon=False)
    nruns = len(split_runs(events))
    fig.suptitle(f"checkpointer timeline: {os.fspath(root)}" + (f" ({nruns} runs)" if nruns > 1 else "")
                 + f"\n{_title(summary)}", fontsize=10)
    fig.savefig(os.fspath(path))
    return summary


def _mark_steps(ax, events, t0: float, span: float) -> None:
    """A dotted line at the first save of each step, labelled on a top axis (labels thinned out)."""
    first: dict[int, float] = {}
    for e in events:
        if e["phase"] == "blocked" and "step" in e:
            first[e["step"]] = min(first.get(e["step"], math.inf), e["start"] - t0)
    xs, labels = [], []
    for step, x in sorted(first.items(), key=lambda kv: kv[1]):
        ax.axvline(x, color="0.55", linewidth=0.6, linestyle=":", zorder=0)
        chars = max(len(str(step)), len(labels[-1]) if labels else 0) + 1  # ~0.6 % of the width per char
        if not xs or x - xs[-1] >= span * 0.006 * chars:
            xs.append(x)
            labels.append(str(step))
    top = ax.secondary_xaxis("top")
    top.set_xticks(xs, labels, fontsize=7)
    top.set_xlabel("checkpoint step (save)", fontsize=8)


def _mark_runs(ax, runs: list[list[dict]], t0: float) -> None:
    """A resumed root's later runs: a solid line where each begins, labelled, the gap before it shaded."""
    for i, run in enumerate(runs[1:], 2):
        begin = min(e["start"] for e in run) - t0
        before = max(e["end"] for e in runs[i - 2]) - t0
        if before < begin:
            ax.axvspan(before, begin, color="0.93", zorder=0)
        ax.axvline(begin, color="0.2", linewidth=1.2, zorder=3)
        ax.annotate(f"run {i} (resumed)", (begin, 0), xycoords=("data", "axes fraction"), xytext=(3, 3),
                    textcoords="offset points", fontsize=8, color="0.2")


def _title(s: dict) -> str:
    peak = "n/a" if s["pool_peak_mib"] is None else f"{s['pool_peak_mib']:.1f} MiB"
    return (f"{s['checkpoints']} checkpoints ({s['saves']} saves) · blocked {_seconds(s['blocked_s'])} total, "
            f"median {_seconds(s['blocked_median_s'])} per save · fence waits {_seconds(s['fence_s'])}\n"
            f"save→durable median {_seconds(s['durable_median_s'])}"
            + (f" · save→promoted median {_seconds(s['promoted_median_s'])}" if s.get("promoted_median_s") else "")
            + f" · pool peak {peak}")


def _seconds(x: float | None) -> str:
    if x is None:
        return "n/a"
    return f"{x:.2f} s" if x >= 1 else f"{x * 1e3:.1f} ms" if x >= 1e-3 else f"{x * 1e6:.0f} µs"


def _matplotlib():
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UclError("timelines need matplotlib: pip install matplotlib (or ucl[viz])", code="UCL009") from None
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch
    return Figure, FigureCanvasAgg, Patch
