"""ucl.train.timeline: reading the checkpointer's trace files (from a real run of ucl.Checkpointer
and from hand-written two-rank traces), the summary against an independent computation, the
Chrome trace export, the PNG timeline and the errors."""
from __future__ import annotations

import ast
import importlib.util
import json
import shutil
import statistics
import struct
import sys
from pathlib import Path

import pytest

import ucl
from ucl.errors import StoreError, UclError
from ucl.train import timeline
from ucl.train.timeline import TraceWarning, draw_timeline, load_trace, summarize, to_chrome, write_chrome

STEPS = 4


@pytest.fixture(scope="module")
def real_root(tmp_path_factory) -> Path:
    """The trace of a tiny training run that saves every step, promoted to a second directory."""
    torch = pytest.importorskip("torch")
    root = tmp_path_factory.mktemp("trace") / "ckpt"
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with ucl.Checkpointer(root, model, opt, tiers=[root.parent / "tier"]) as ck:
        for step in range(STEPS):
            loss = model(torch.randn(4, 16)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            ck.save(step)
    return root


def raw_events(root: Path) -> list[dict]:
    return [json.loads(line) for f in sorted(root.glob("trace-rank*.jsonl")) for line in f.read_text().splitlines()]


def png_size(path) -> tuple[int, int]:
    data = Path(path).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", "not a PNG file"
    return struct.unpack(">II", data[16:24])


def expected_summary(raw: list[dict]) -> dict:
    """The summary, computed again the plain way from the raw lines."""
    saves = [e for e in raw if e["phase"] == "blocked"]
    fences_outside = [e for e in raw if e["phase"] == "fence" and not any(
        s["rank"] == e["rank"] and s["start"] <= e["start"] and e["end"] <= s["end"] for s in saves)]

    def save_to_end(phase):
        out = []
        for step in {e["step"] for e in raw if e["phase"] == phase}:
            end = max(e["end"] for e in raw if e["phase"] == phase and e["step"] == step)
            out.append(end - min(e["start"] for e in saves if e["step"] == step))
        return out
    durable, promoted = save_to_end("flush"), save_to_end("promote")
    peaks = [e["pool_high_water"] for e in raw if "pool_high_water" in e]
    cpu = {f"{p}_cpu_s": sum(e["cpu"] for e in raw if e["phase"] == p and "cpu" in e)
           if any(e["phase"] == p and "cpu" in e for e in raw) else None for p in ("snapshot", "flush", "promote")}
    return {**cpu, "ranks": sorted({e["rank"] for e in raw}), "saves": len({e["step"] for e in saves}), "save_calls": len(saves),
            "checkpoints": len({e["step"] for e in raw if e["phase"] == "flush"}),
            "blocked_s": sum(e["end"] - e["start"] for e in saves),
            "blocked_median_s": statistics.median(e["end"] - e["start"] for e in saves),
            "fence_s": sum(e["end"] - e["start"] for e in fences_outside),
            "durable_median_s": statistics.median(durable),
            "promoted_median_s": statistics.median(promoted) if promoted else None,
            "pool_peak_mib": max(peaks) / 2**20 if peaks else None,
            **{f"{p}_median_s": statistics.median(e["end"] - e["start"] for e in raw if e["phase"] == p)
               if any(e["phase"] == p for e in raw) else None for p in ("snapshot", "flush")},
            "span_s": max(e["end"] for e in raw) - min(e["start"] for e in raw)}


def assert_same_summary(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for k, v in want.items():
        assert got[k] == (pytest.approx(v, abs=1e-9) if isinstance(v, float) else v), k


# ---------------------------------------------------------------- a real run

def test_every_saved_step_has_its_events_in_order(real_root):
    events = load_trace(real_root)
    assert [e["start"] for e in events] == sorted(e["start"] for e in events)
    assert len(events) == len(raw_events(real_root))
    for step in range(STEPS):
        mine = {e["phase"]: e for e in events if e.get("step") == step and e["phase"] != "fence"}
        assert {"blocked", "snapshot", "flush"} <= set(mine), (step, sorted(mine))
        assert mine["blocked"]["start"] <= mine["snapshot"]["start"] <= mine["flush"]["start"]
        assert mine["flush"]["bytes"] == mine["snapshot"]["bytes"] > 0
        for phase in ("snapshot", "flush", "promote"):  # thread CPU time: one thread, at most its wall time
            assert 0 < mine[phase]["cpu"], (step, phase)
        assert mine["snapshot"]["cpu"] <= mine["snapshot"]["end"] - mine["snapshot"]["start"] + 1e-3
        assert mine["flush"]["end"] <= mine["promote"]["start"] and mine["promote"]["tier"] == 2
    assert [e["step"] for e in events if e["phase"] == "blocked"] == list(range(STEPS))
    assert [e["step"] for e in events if e["phase"] == "flush"] == list(range(STEPS))
    assert [e["step"] for e in events if e["phase"] == "promote"] == list(range(STEPS))


def test_summary_equals_an_independent_computation(real_root):
    summary = summarize(load_trace(real_root))
    assert_same_summary(summary, expected_summary(raw_events(real_root)))
    assert summary["saves"] == summary["checkpoints"] == STEPS and summary["ranks"] == [0]
    assert 0 < summary["blocked_median_s"] <= summary["blocked_s"] and summary["durable_median_s"] > 0
    assert summary["promoted_median_s"] > summary["durable_median_s"]
    assert summary["pool_peak_mib"] > 0


def test_chrome_json_round_trips(real_root, tmp_path):
    events = load_trace(real_root)
    out = json.loads(Path(write_chrome(real_root, tmp_path / "trace.json")).read_text())
    assert out == json.loads(json.dumps(to_chrome(events)))
    complete = [e for e in out["traceEvents"] if e["ph"] == "X"]
    assert len(complete) == len(events)
    assert all(e["ts"] >= 0 and e["dur"] >= 0 and e["pid"] == 0 for e in complete)
    assert complete[0]["ts"] == 0
    for e, c in zip(events, complete):
        assert c["name"] == e["phase"] and c["args"]["step"] == e["step"]
        assert c["dur"] == pytest.approx((e["end"] - e["start"]) * 1e6, abs=1e-2)
        assert c["tid"] == {"blocked": 0, "fence": 0, "snapshot": 1, "flush": 2, "promote": 3}[e["phase"]]
    names = {(e["tid"], e["args"]["name"]) for e in out["traceEvents"] if e["name"] == "thread_name"}
    assert names == {(0, "training"), (1, "snapshot"), (2, "flush"), (3, "promote")}


def test_draw_timeline_writes_a_png(real_root, tmp_path):
    pytest.importorskip("matplotlib")
    summary = draw_timeline(real_root, tmp_path / "timeline.png")
    w, h = png_size(tmp_path / "timeline.png")
    assert w > 800 and h > 200
    assert summary == summarize(load_trace(real_root))


def test_malformed_lines_are_skipped_and_counted(real_root, tmp_path):
    shutil.copy(real_root / "trace-rank00000.jsonl", tmp_path)
    good = load_trace(real_root)
    bad = ["not json", '{"rank": 0, "phase": "blocked", "sta', "[1, 2]", '{"rank": 0, "start": 1, "end": 2}',
           '{"rank": 0, "phase": "flush", "start": 5, "end": 4}', '{"rank": true, "phase": "fence", "start": 1, "end": 2}',
           '{"rank": 0, "phase": "warp", "start": 1, "end": 2}', '{"rank": 0, "phase": "fence", "start": NaN, "end": 2}',
           "\x00\xff garbage", ""]
    with open(tmp_path / "trace-rank00000.jsonl", "a") as f:
        f.write("\n".join(bad) + "\n")
    with pytest.warns(TraceWarning, match=r"skipped 9 malformed trace lines .*trace-rank00000.jsonl: 9"):
        assert load_trace(tmp_path) == good


def test_missing_folder_or_no_trace_files_is_ucl404(tmp_path):
    for root in (tmp_path / "nowhere", tmp_path):
        with pytest.raises(StoreError) as e:
            load_trace(root)
        assert e.value.code == "UCL404" and str(root) in str(e.value)


def test_a_trace_file_too_large_is_refused(tmp_path, monkeypatch):
    (tmp_path / "trace-rank00000.jsonl").write_text('{"rank": 0, "phase": "fence", "start": 1, "end": 2}\n')
    monkeypatch.setattr(timeline, "MAX_TRACE_BYTES", 10)
    with pytest.raises(StoreError) as e:
        load_trace(tmp_path)
    assert e.value.code == "UCL401" and "trace-rank00000.jsonl" in str(e.value)


# ---------------------------------------------------------------- a hand-written two-rank trace

def ev(rank, phase, start, end, step, **info) -> str:
    return json.dumps({"rank": rank, "phase": phase, "start": 1000 + start, "end": 1000 + end, "step": step, **info})


@pytest.fixture
def two_ranks(tmp_path) -> Path:
    """Steps 1 and 2 saved on two ranks; rank 1 is slower to flush; rank 0 promotes. One fence is
    inside a save (counted in blocked), two are outside."""
    (tmp_path / "trace-rank00000.jsonl").write_text("\n".join([
        ev(0, "blocked", 0.0, 0.1, 1, waited_for_pool=0.0), ev(0, "fence", 0.02, 0.03, 0),
        ev(0, "snapshot", 0.1, 0.2, 1, bytes=100), ev(0, "flush", 0.2, 0.5, 1, bytes=100, pool_high_water=2 << 20),
        ev(0, "promote", 0.7, 0.8, 1), ev(0, "fence", 0.25, 0.3, 1),
        ev(0, "blocked", 1.0, 1.05, 2), ev(0, "snapshot", 1.05, 1.1, 2, bytes=100),
        ev(0, "flush", 1.1, 1.3, 2, bytes=100, pool_high_water=3 << 20), ev(0, "promote", 1.3, 1.4, 2)]) + "\n")
    (tmp_path / "trace-rank00001.jsonl").write_text("\n".join([
        ev(1, "blocked", 0.01, 0.2, 1), ev(1, "snapshot", 0.2, 0.3, 1, bytes=100),
        ev(1, "flush", 0.3, 0.7, 1, bytes=100, pool_high_water=1 << 20), ev(1, "fence", 0.35, 0.45, 1),
        ev(1, "blocked", 1.02, 1.1, 2), ev(1, "snapshot", 1.1, 1.2, 2, bytes=100),
        ev(1, "flush", 1.2, 1.6, 2, bytes=100, pool_high_water=1 << 20)]) + "\n")
    return tmp_path


def test_two_ranks_are_merged_in_time_order(two_ranks):
    events = load_trace(two_ranks)
    assert len(events) == 17 and {e["rank"] for e in events} == {0, 1}
    assert [e["start"] for e in events] == sorted(e["start"] for e in events)
    assert [(e["rank"], e["phase"]) for e in events[:3]] == [(0, "blocked"), (1, "blocked"), (0, "fence")]


def test_two_rank_summary(two_ranks):
    summary = summarize(load_trace(two_ranks))
    assert_same_summary(summary, expected_summary(raw_events(two_ranks)))
    # by hand: saves 0.1, 0.19, 0.05, 0.08; fences outside a save 0.05 + 0.1; step 1 durable at
    # 0.7 (rank 1's flush), step 2 at 1.6 (rank 1's flush); promoted (rank 0) at 0.8 and 1.4
    assert summary["ranks"] == [0, 1] and summary["checkpoints"] == 2
    assert summary["saves"] == 2 and summary["save_calls"] == 4  # steps 1 and 2, each saved by both ranks
    assert summary["blocked_s"] == pytest.approx(0.42) and summary["blocked_median_s"] == pytest.approx(0.09)
    assert summary["fence_s"] == pytest.approx(0.15)
    assert summary["durable_median_s"] == pytest.approx(((0.7 - 0.0) + (1.6 - 1.0)) / 2)
    assert summary["promoted_median_s"] == pytest.approx(((0.8 - 0.0) + (1.4 - 1.0)) / 2)
    assert summary["pool_peak_mib"] == 3 and summary["span_s"] == pytest.approx(1.6)


def test_two_rank_chrome_groups_by_rank(two_ranks):
    out = to_chrome(load_trace(two_ranks))
    complete = [e for e in out["traceEvents"] if e["ph"] == "X"]
    assert len(complete) == 17 and {e["pid"] for e in complete} == {0, 1}
    assert sum(e["pid"] == 1 for e in complete) == 7
    names = {e["pid"]: e["args"]["name"] for e in out["traceEvents"] if e["name"] == "process_name"}
    assert names == {0: "rank 0", 1: "rank 1"}
    first = next(e for e in complete if e["pid"] == 1)
    assert first["ts"] == pytest.approx(10_000) and first["dur"] == pytest.approx(190_000)


def test_two_rank_png(two_ranks, tmp_path):
    pytest.importorskip("matplotlib")
    one = draw_timeline(two_ranks, tmp_path / "two.png")
    (two_ranks / "trace-rank00001.jsonl").unlink()
    draw_timeline(two_ranks, tmp_path / "one.png")
    assert one["ranks"] == [0, 1]
    assert png_size(tmp_path / "two.png")[1] > png_size(tmp_path / "one.png")[1]  # a row group per rank


def test_empty_trace_files_draw_and_summarize(tmp_path):
    pytest.importorskip("matplotlib")
    (tmp_path / "trace-rank00000.jsonl").write_text("")
    assert load_trace(tmp_path) == [] and to_chrome([])["traceEvents"] == []
    summary = draw_timeline(tmp_path, tmp_path / "empty.png")
    assert summary["saves"] == 0 and summary["blocked_median_s"] is None and png_size(tmp_path / "empty.png")


# ---------------------------------------------------------------- matplotlib

def test_matplotlib_is_imported_only_when_drawing():
    tree = ast.parse(Path(timeline.__file__).read_text())
    top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert not any("matplotlib" in ast.dump(n) for n in top)


def test_missing_matplotlib_is_ucl009(two_ranks, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    with pytest.raises(UclError) as e:
        draw_timeline(two_ranks, tmp_path / "x.png")
    assert e.value.code == "UCL009" and "pip install matplotlib" in str(e.value)
    assert not (tmp_path / "x.png").exists()


def test_cli_trace_draws_and_exports(real_root, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from ucl.cli import main
    png, chrome = tmp_path / "t.png", tmp_path / "t.json"
    assert main(["trace", str(real_root), "--png", str(png), "--chrome", str(chrome)]) == 0
    out = capsys.readouterr().out
    assert "1 run over" in out and "run 1: rank 0" in out and "steps 0-3 (4 saved, 4 flushed)" in out, out
    assert "medians: snapshot" in out and "host pool high-water" in out and "blocked_s" not in out, out  # no raw keys
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads(chrome.read_text())["traceEvents"]
    assert main(["trace", str(tmp_path / "nothing-here")]) == 1
    assert "Traceback" not in capsys.readouterr().err


def test_a_resumed_root_shows_each_run_apart(tmp_path, capsys):
    """Two processes' lifetimes appending to one root (a run, then its resume): the summary and the
    picture separate them, each run's steps and medians its own, not a mix."""
    torch = pytest.importorskip("torch")
    from ucl.cli import main
    from ucl.train.timeline import split_runs
    root = tmp_path / "ckpt"
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for steps in (range(0, 3), range(3, 5)):
        with ucl.Checkpointer(root, model, opt) as ck:
            if steps.start:
                ck.load()
            for step in steps:
                opt.step()
                ck.save(step)
    runs = split_runs(load_trace(root))
    assert [sorted({e["step"] for e in r if e["phase"] == "blocked"}) for r in runs] == [[0, 1, 2], [3, 4]]
    assert main(["trace", str(root)]) == 0
    out = capsys.readouterr().out
    assert "2 runs over" in out and "resumed" in out, out
    assert "run 1: rank 0" in out and "steps 0-2 (3 saved, 3 flushed)" in out, out
    assert "run 2: rank 0" in out and "steps 3-4 (2 saved, 2 flushed)" in out, out
    if importlib.util.find_spec("matplotlib"):
        draw_timeline(root, tmp_path / "t.png")
        assert png_size(tmp_path / "t.png")[0] > 0


def test_runs_of_several_ranks_pair_by_order_and_old_events_count_as_the_first(tmp_path):
    from ucl.train.timeline import split_runs
    ev = lambda rank, run, start, **kw: {"rank": rank, "phase": "blocked", "start": start, "end": start + 1,  # noqa: E731
                                         **({} if run is None else {"run": run}), **kw}
    events = [ev(0, None, 0.0), ev(1, None, 0.5), ev(0, 100.0, 100.0), ev(1, 100.2, 100.1), ev(1, 200.3, 200.0)]
    runs = split_runs(events)
    assert [[(e["rank"], e["start"]) for e in r] for r in runs] == [[(0, 0.0), (1, 0.5)], [(0, 100.0), (1, 100.1)],
                                                                   [(1, 200.0)]]


def test_a_long_run_keeps_the_newest_events_in_memory_and_all_in_the_file(tmp_path, monkeypatch):
    """Before the cap, every event of a run stayed in memory: a run of millions of checkpoints grew."""
    from ucl.train import trace as trace_mod
    monkeypatch.setattr(trace_mod, "KEPT_EVENTS", 50)
    t = trace_mod.Trace(str(tmp_path), 0)
    for i in range(400):
        t.add("flush", 0.0, 1.0, step=i)
        if i % 7 == 0:
            t.flush()
    t.flush()
    kept = t.events()
    assert [e["step"] for e in kept] == list(range(350, 400))
    lines = (tmp_path / "trace-rank00000.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == list(range(400))
