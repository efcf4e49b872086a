"""The ``ucl`` command line. Exit codes: 0 ok, 1 user error (a clear message, no traceback), 2 usage."""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from pathlib import Path

from . import __version__
from .errors import BindError, Diagnostic, StoreError, UclError, did_you_mean

EPILOG = """meshes are written slowest axis first, like pp=2,dp=2,tp=2 (tp fastest); 'universal' is the
consolidated layout. SPEC is a .ucl file or stdlib:NAME. DIMS is hidden=4096,heads=32,... or a
Hugging Face config.json (or a folder holding one)."""


def _console():
    """Rich console for our output. Every user string printed through it goes through ``_e``
    (rich.markup.escape): a path or spec name like ``stdlib:llama`` is not markup, nor an emoji."""
    from rich.console import Console
    return Console(highlight=False, soft_wrap=True, emoji=False)


def _e(value) -> str:
    from rich.markup import escape
    return escape(str(value))


def _positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (a bad value is a usage error, exit 2)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def _looks_like_path(text: str) -> bool:
    return text.endswith(".json") or "/" in text or os.sep in text


def _dims(spec, text: str | None) -> dict[str, int]:
    """Dims from ``--dims``: name=value pairs or a config.json (or a folder holding one); every
    dim the spec declares must be given (one UCL209 naming those missing, before any binding)."""
    if text is None:
        raise UclError("this command needs --dims (hidden=4096,heads=32,... or a config.json)", code="UCL009")
    if os.path.exists(text):
        return spec.dims_from_config(text)
    if _looks_like_path(text):
        raise UclError(f"--dims {text}: no such file or folder (give a config.json, a folder holding one, "
                       "or the dims themselves like hidden=4096,heads=32)", code="UCL009")
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, eq, value = part.partition("=")
        if not eq or not value.strip().lstrip("-").isdigit():
            raise UclError(f"cannot read dims {text!r}: write them like hidden=4096,heads=32 "
                           "or give a config.json", code="UCL009")
        out[name.strip()] = int(value)
    _require_dims(spec, out)
    return out


def _require_dims(spec, dims: dict[str, int]) -> None:
    """One UCL209 naming every missing dim (and the config fields it is read from), one per
    unknown dim, instead of an "unknown name" for each expression that uses a missing dim."""
    missing = [d for d in spec.dims if d not in dims]
    problems = []
    if missing:
        keys = spec.checked.config_keys
        named = ", ".join(f"{d} ({' | '.join(keys.get(d, (d,)))})" for d in missing)
        problems.append(Diagnostic("UCL209", f"dims not given: {named}", None,
                                   "add them to --dims as name=value, or pass the model's config.json, which "
                                   "holds them under the field names in parentheses"))
    for d in dims:
        if d not in spec.dims:
            problems.append(Diagnostic("UCL209", f"unknown dim {d!r}", None, did_you_mean(d, spec.dims)
                                       or f"the spec declares: {', '.join(spec.dims) or '(none)'}"))
    if problems:
        raise BindError(problems, None, spec.name or spec.filename)


def _checkpoint(path: str) -> str:
    """``path`` if it may be a checkpoint folder; a file inside one (a rank file, the manifest) or any
    other file gets a clear error naming the folder to pass instead."""
    p = Path(path)
    if p.is_file():
        parent = p.resolve().parent
        if (parent / "manifest.json").is_file():
            raise StoreError(f"{path} is a file inside the checkpoint {parent}: pass the checkpoint folder "
                             f"({parent}), not one of its files", code="UCL401")
        raise StoreError(f"{path} is a file, not a checkpoint: pass a checkpoint folder (one holding a "
                         "manifest.json, or a DeepSpeed, DCP, Megatron or Hugging Face checkpoint folder)", code="UCL401")
    return path


def _params(spec, dims, source: str | None):
    if source is None:
        return spec.synthesize_params(dims)
    from .formats.hf import read_tensor_names
    return read_tensor_names(source)


def _report(con, problems: list[str], failure: str, success: str) -> int:
    """Print problems (exit 1) or the success line (exit 0)."""
    for p in problems:
        con.print(f"[red]error[/]: {_e(p)}")
    if problems:
        con.print(_e(f"{len(problems)} problem(s): {failure}"))
        return 1
    con.print(f"[green]ok[/]: {_e(success)}")
    return 0


# ---- commands ------------------------------------------------------------------------------------------
def cmd_check(args) -> int:
    from .lang.spec import load_spec
    spec = load_spec(args.spec)
    con = _console()
    if args.dims is None and args.against and (Path(args.against) / "config.json").is_file():
        args.dims = str(Path(args.against) / "config.json")  # a save_pretrained folder carries its dims
    if args.dims is None and args.against:
        raise UclError("--against needs --dims (a config.json or hidden=...,heads=...)", code="UCL009")
    if args.dims is None:
        con.print("[green]ok[/]: " + _e(f"{spec.name or spec.filename}: {len(spec.checked.rules)} rules, "
                  f"{len(spec.checked.placements)} placement rules, axes {', '.join(spec.axes) or '-'}, "
                  f"kinds {', '.join(spec.kinds)}"))
        return 0
    dims = _dims(spec, args.dims)
    if args.against:
        from .formats.hf import check_against, read_tensor_names, unmatched_patterns
        tensors = read_tensor_names(args.against)
        problems = check_against(spec, dims, tensors)
        for w in [] if problems else unmatched_patterns(spec, dims, tensors):
            con.print(_e(w))
        return _report(con, problems, f"{args.against} does not match {spec.name or spec.filename}",
                       f"every tensor of {args.against} is matched exactly once with its shape")
    model = spec.bind(dims, _params(spec, dims, None))
    for d in model.unmatched():
        con.print(_e(d.render(spec.text, spec.filename)))
    con.print(f"[green]ok[/]: {len(model.params)} parameters, {len(model.tensors)} tensors bound")
    return 0


def cmd_plan(args) -> int:
    from .layout.mesh import Mesh
    from .plan.compile import compile
    from .lang.spec import load_spec
    spec = load_spec(args.spec)
    dims = _dims(spec, args.dims)
    model = spec.bind(dims, _params(spec, dims, args.params))
    plan = compile(model, Mesh.parse(args.src), Mesh.parse(args.dst))
    con = _console()
    con.print(_e(plan.summary()))
    per = plan.bytes_read_per_rank()
    if len(per):
        con.print(f"bytes read per target rank: min {int(per.min()):,}  max {int(per.max()):,}  "
                  f"total {int(per.sum()):,}")
    if args.explain:
        print(plan.explain(args.explain))
    if args.json:
        try:
            Path(args.json).write_text(plan.to_json())
        except OSError as e:
            raise UclError(f"cannot write {args.json}: {e.strerror}", code="UCL000") from None
        con.print(f"plan written to {_e(args.json)}")
    if args.png:
        from .picture import draw_plan
        draw_plan(model, plan.src_mesh, plan.dst_mesh, args.png, param=args.param)
        con.print(f"picture written to {_e(args.png)}")
    return 0


def cmd_reshard(args) -> int:
    from .layout.mesh import Mesh
    from .ops.convert import user_spec
    to = Mesh.parse(args.to)
    src = _checkpoint(args.src)
    spec, dims = _user_spec(args, src)
    return _reshard(args, src, to, user_spec(spec, dims))


def _reshard(args, src, to, user) -> int:
    from .ops.dist import torchrun_world
    from .ops.reshard import reshard
    if torchrun_world() > 1:  # under torchrun: every process writes its share (docs/distributed.md)
        return _reshard_distributed(args, src, to, _console(), user)
    if args.quiet:  # plain output: --quiet does not import rich (a tenth of a small reshard's start-up)
        stats = reshard(src, args.dst, to, workers=args.workers, durable=not args.no_fsync, user=user)
        print(f"wrote {_reshard_summary(args.dst, to, stats)}")
        return 0
    con = _console()
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn
    with Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                  TimeRemainingColumn(), console=con, transient=True) as bar:
        task = bar.add_task(_e(f"reshard -> {to}"), total=_reshard_bytes(src, to))
        stats = reshard(src, args.dst, to, workers=args.workers, durable=not args.no_fsync, user=user,
                        progress=lambda n: bar.advance(task, n))
    con.print("[green]wrote[/] " + _e(_reshard_summary(args.dst, to, stats)))
    return 0


def _reshard_summary(dst, to, stats) -> str:
    return (f"{dst} ({to}): {stats.datasets_written} datasets, {stats.bytes_written:,} B written, "
            f"{stats.bytes_read:,} B read ({stats.bytes_needed:,} B needed) in {stats.seconds:.2f} s "
            f"(open {stats.open_seconds:.2f} s, plan {stats.compile_seconds:.2f} s)")


def _reshard_distributed(args, src: str, to, con, user) -> int:
    """One process of a torchrun job: join the gloo world, write this process's share; rank 0 prints."""
    from .ops.dist import init_from_env
    from .ops.reshard import reshard
    dist = init_from_env(args.timeout)
    try:
        stats = reshard(src, args.dst, to, workers=args.workers, durable=not args.no_fsync, distributed=True, user=user,
                        timeout=args.timeout)
        if dist.get_rank() == 0:
            con.print("[green]wrote[/] " + _e(f"{args.dst} ({to}) with {dist.get_world_size()} processes: "
                      f"{stats.datasets_written} datasets, {stats.bytes_written:,} B written, {stats.bytes_read:,} B "
                      f"read ({stats.bytes_needed:,} B needed) in {stats.seconds:.2f} s (plan {stats.compile_seconds:.2f} s)"))
    finally:
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - a world a dead process broke: nothing left to release
            pass
    return 0


def _reshard_bytes(src: str, to) -> int:
    """Bytes a reshard of ``src`` to ``to`` writes (every target dataset once, on the first rank holding
    it): the progress bar's total. The plan is cached on the model, so the reshard itself reuses it."""
    from .dtypes import itemsize
    from .ops.prepare import mesh_of, model_of, open_checkpoint, plan_for
    with open_checkpoint(src) as ck:
        plan = plan_for(model_of(ck), mesh_of(ck), to)
    per = [_prod(d["shape"]) * itemsize(d["dtype"]) for d in plan.datasets]
    return int(sum(per[int(i)] for i in plan.first_holders["dataset"]))


def _user_spec(args, src: str):
    """``--spec`` and ``--dims`` of import/reshard: (spec, dims) or (None, None). A Hugging Face
    folder's dims default to its config.json (read by the spec's `dims ... from` declarations)."""
    if args.spec is None:
        if args.dims is not None:
            raise UclError("--dims is read with --spec only", code="UCL009")
        return None, None
    from .lang.spec import load_spec
    spec = load_spec(args.spec)
    if args.dims is None and os.path.isfile(os.path.join(src, "config.json")):
        return spec, {}
    return spec, _dims(spec, args.dims) if args.dims is not None or spec.dims else {}


def cmd_import(args) -> int:
    from .ops.convert import user_spec
    con = _console()
    src = _checkpoint(args.src)
    spec, dims = _user_spec(args, src)
    return _import(args, con, src, spec, dims, user_spec(spec, dims))


def _import(args, con, src, spec, dims, user) -> int:
    from .ops.convert import import_checkpoint
    from .ops.prepare import mesh_of, open_checkpoint
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn
    with open_checkpoint(src, args.format, user) as ck:
        fmt, mesh = getattr(ck, "format", "ucl"), mesh_of(ck)
        total = sum(int(_prod(e["shape"])) * _itemsize(e["dtype"]) for ds in ck.manifest.datasets for e in ds.values())
    with Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(), TimeRemainingColumn(),
                  console=con, transient=True, disable=args.quiet) as bar:
        task = bar.add_task(_e(f"import {fmt} ({mesh})"), total=total)
        stats = import_checkpoint(src, args.dst, format=fmt, workers=args.workers, durable=not args.no_fsync,
                                  progress=lambda n: bar.advance(task, n), spec=spec, dims=dims)
    con.print("[green]imported[/] " + _e(f"{fmt} checkpoint {src} -> {args.dst} ({mesh}): {stats.datasets_written} "
              f"datasets, {stats.bytes_written:,} B written, {stats.bytes_read:,} B read in {stats.seconds:.2f} s"))
    return 0


def cmd_export(args) -> int:
    con = _console()
    src = _checkpoint(args.ckpt)
    if args.format == "hf":
        from .ops.export import export_hf
        stats = export_hf(src, args.out, dtype=args.dtype, max_shard_size=args.max_shard_size, config=args.config,
                          durable=not args.no_fsync)
    elif args.format == "dcp":
        from .ops.export import export_dcp
        stats = export_dcp(src, args.out, style=args.style)
    else:
        from .ops.export import export_deepspeed_universal
        stats = export_deepspeed_universal(src, args.out, tag=args.tag, durable=not args.no_fsync)
    con.print("[green]exported[/] " + _e(f"{src} -> {args.out} ({args.format}): {stats.bytes_written:,} B written, "
              f"{stats.bytes_read:,} B read in {stats.seconds:.2f} s"))
    return 0


def _itemsize(dtype: str) -> int:
    from .dtypes import itemsize
    return itemsize(dtype)


def _spec_source(state) -> str:
    """`` (derived)``: where a Hugging Face folder's spec came from (user, stdlib, alias, derived)."""
    source = state.get("hf", {}).get("spec_source") if isinstance(state, dict) and isinstance(state.get("hf"), dict) \
        else None
    return f" ({source})" if isinstance(source, str) else ""


def cmd_inspect(args) -> int:
    from rich.table import Table
    from .ops.prepare import mesh_of, model_of, open_checkpoint
    from .dtypes import itemsize
    con = _console()
    with open_checkpoint(_checkpoint(args.ckpt)) as ck:
        m = ck.manifest
        total = sum(int(_prod(e["shape"])) * itemsize(e["dtype"]) for ds in m.datasets for e in ds.values())
        fmt = f"{ck.format} checkpoint (read in place)" if hasattr(ck, "format") else f"ucl format v{m.version}"
        con.print(_e(f"{args.ckpt}: {fmt}, layout {mesh_of(ck)} ({ck.nranks} rank files), "
                      f"{total:,} bytes, spec {m.spec_name or '(embedded)'}{_spec_source(m.state)}"))
        if m.dims:
            con.print(_e("dims: " + ", ".join(f"{k}={v}" for k, v in m.dims.items())))
        if m.state:
            con.print(_e("state: " + json.dumps(m.state)[:200]))
        table = Table("parameter", "shape", "kinds (dtype)", "layout rule")
        for col in table.columns:
            col.overflow = "fold"
        if m.spec and m.params is not None:
            model = model_of(ck)
            by = {}
            for t in model.tensors:
                by.setdefault(t.name, []).append(f"{t.kind} ({t.dtype})")
            for name, shape in model.params.items():
                t = next(x for x in model.tensors if x.name == name)
                rule = "; ".join(_transform_text(model, t))
                table.add_row(_e(name), _e(str(list(shape))), _e(", ".join(by.get(name, []))), _e(rule))
            con.print(table)
        if args.ranks:
            for r in range(ck.nranks):
                con.print(_e(f"rank {r} ({m.files[r]}):"))
                for key, e in sorted(m.datasets[r].items()):
                    con.print(_e(f"  {key:<60} {str(e['shape']):<16} {e['dtype']}"))
    if args.png:
        from .picture import draw_checkpoint
        draw_checkpoint(_checkpoint(args.ckpt), args.png, param=args.param)
        con.print(f"picture written to {_e(args.png)}")
    return 0


def _transform_text(model, t) -> list[str]:
    text = model.spec.text.splitlines()
    r = t.rule
    lines = text[r.span.line - 1:r.span.end_line]
    body = " ".join(x.strip() for x in lines)
    return [body.split(":", 1)[1].strip() if ":" in body else body]


def _prod(xs):
    n = 1
    for x in xs:
        n *= int(x)
    return n


def cmd_verify(args) -> int:
    from .ops.prepare import check_stored, model_of, open_checkpoint
    con = _console()
    with open_checkpoint(_checkpoint(args.ckpt)) as ck:
        problems, fmt = ck.verify(), getattr(ck, "format", None)
        if ck.manifest.spec is not None and not problems:
            try:  # the datasets are the ones the checkpoint's own spec puts on each rank (what readers need)
                check_stored(ck, model_of(ck))
            except UclError as e:
                problems.append(f"{e} [{e.code}]")
    ok = f"{args.ckpt}: every file present, every checksum matches, the datasets are what its spec lays out" \
        if fmt is None else f"{args.ckpt}: every {fmt} file present and holding its tensors' bytes ({fmt} files " \
        "carry no checksums)"
    return _report(con, problems, f"in {args.ckpt}", ok)


def cmd_gc(args) -> int:
    from .store.atomic import collect_garbage
    con = _console()
    found = [e for root in args.roots for e in collect_garbage(root, dry_run=args.dry_run, max_age_s=args.max_age,
                                                               force=args.force)]
    why = {"dead": "its writer{} is gone", "stale": f"no lock file, untouched for {_age(args.max_age)}",
           "recent": "no lock file" + ("" if args.force else f", changed within {_age(args.max_age)}; --force removes it"),
           "in use": "a live writer{} holds it", "link": "a symlink, never followed", "unknown": "cannot be examined"}

    def owner(e) -> str:  # the lock file's "pid host"
        pid, _, host = e.owner.partition(" ")
        return f" (pid {pid} on {host})" if pid.isdigit() and host else ""

    def goes(e) -> bool:  # removed, or would be without --dry-run
        return e.removed or (args.dry_run and (e.removable or (args.force and e.state == "recent")))

    for e in found:
        if e.error:
            con.print(f"[red]error[/]: cannot remove {_e(e.path)}: {_e(e.error)}")
            continue
        verb = ("[green]would remove[/]" if args.dry_run else "[green]removed[/]") if goes(e) else "[yellow]kept[/]"
        con.print(f"{verb} {_e(e.path)}  {_e(_size(e.nbytes))}  ({_e(why[e.state].format(owner(e)))})")
    gone = [e for e in found if goes(e)]
    failed = sum(1 for e in found if e.error)
    nbytes = sum(e.nbytes for e in gone)
    con.print(_e(f"{'would free' if args.dry_run else 'freed'} {nbytes:,} B ({_size(nbytes)}) in {len(gone)} temp "
                 f"entr{'y' if len(gone) == 1 else 'ies'}; {len(found) - len(gone) - failed} kept"
                 + (f"; {failed} could not be removed" if failed else "")))
    return 1 if failed else 0


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""


def _age(seconds: float) -> str:
    return f"{seconds / 3600:g} h" if seconds >= 3600 else f"{seconds:g} s"


def _seconds(text: str) -> float:
    """argparse type: a non-negative number of seconds."""
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not x >= 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, got {text}")
    return x


def _positive_seconds(text: str) -> float:
    """argparse type: a positive number of seconds."""
    x = _seconds(text)
    if not x > 0:
        raise argparse.ArgumentTypeError(f"must be more than 0, got {text}")
    return x


def cmd_trace(args) -> int:
    from .train.timeline import draw_timeline, load_trace, summarize, write_chrome
    con = _console()
    summary = summarize(load_trace(args.root))
    con.print(_e(", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in summary.items())))
    if args.png:
        draw_timeline(args.root, args.png)
        con.print(f"timeline written to {_e(args.png)}")
    if args.chrome:
        write_chrome(args.root, args.chrome)
        con.print(f"Chrome/Perfetto trace written to {_e(args.chrome)}")
    return 0


def cmd_demo(args) -> int:
    from .demo import run_demo
    return run_demo(args.workdir, src=args.src, dst=args.dst, keep=args.keep, console=_console())


def cmd_spec_list(args) -> int:
    from .lang.stdlib import stdlib_names
    for n in stdlib_names():
        print(f"stdlib:{n}")
    return 0


def cmd_spec_show(args) -> int:
    from .lang.spec import load_spec
    print(load_spec(args.spec).text, end="")
    return 0


def cmd_spec_from_hf(args) -> int:
    from .formats.hf import draft_spec_from_hf
    text = draft_spec_from_hf(args.config)
    if args.output:
        Path(args.output).write_text(text)
        _console().print(_e(f"draft spec written to {args.output}; review it, then `ucl check {args.output} "
                            f"--dims {args.config} --against MODEL`"))
    else:
        print(text, end="")
    return 0


# ---- parser ------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="ucl", description="Universal, reshardable checkpoints for distributed "
                                 "LLM training.", epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--version", action="version", version=f"ucl {__version__}")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("check", help="check a spec (and optionally a model against it)", epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("spec", metavar="SPEC")
    p.add_argument("--dims", metavar="DIMS", help="model dims, or a config.json")
    p.add_argument("--against", metavar="MODEL", help="a .safetensors file, a save_pretrained folder or a ucl "
                   "checkpoint: every tensor must match exactly one rule with the right shape")
    p.set_defaults(func=cmd_check)

    p = sub.add_parser("plan", help="compile a reshard plan and show its statistics", epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("spec", metavar="SPEC")
    p.add_argument("--dims", metavar="DIMS", required=True)
    p.add_argument("--from", dest="src", metavar="MESH", required=True)
    p.add_argument("--to", dest="dst", metavar="MESH", required=True)
    p.add_argument("--params", metavar="MODEL", help="parameter names and shapes from a model or checkpoint "
                   "(default: synthesized from the spec's declared shapes)")
    p.add_argument("--explain", metavar="PARAM", help="print where every box of PARAM comes from")
    p.add_argument("--json", metavar="FILE", help="write the plan as JSON (docs/ir.md)")
    p.add_argument("--png", metavar="FILE", help="draw which rank holds which box of a parameter, source and "
                   "target side by side (needs matplotlib: pip install 'ucl[viz]')")
    p.add_argument("--param", metavar="NAME", help="the parameter to draw (default: one whose layout changes)")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("reshard", help="write a checkpoint in another layout", epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", metavar="SRC")
    p.add_argument("dst", metavar="DST", help="must not exist; appears atomically when complete")
    p.add_argument("--to", metavar="MESH", required=True)
    p.add_argument("--spec", metavar="SPEC", help="a foreign folder read with this spec (a Hugging Face folder: "
                   "instead of the stdlib or derived one; see ucl import --help)")
    p.add_argument("--dims", metavar="DIMS", help="the dims of --spec (default for Hugging Face: its config.json)")
    p.add_argument("--workers", type=_positive_int, default=None, metavar="N",
                   help="processes, at least 1 (default: min(2, cores); under torchrun: forked processes per "
                   "torchrun process, default 1)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--no-fsync", action="store_true", help="skip fsync of the data files: still atomic if the "
                   "process dies, but not if the machine loses power before the OS writes the pages")
    p.add_argument("--timeout", type=_positive_seconds, default=300.0, metavar="SECONDS",
                   help="under torchrun: how long to wait for a process that stopped answering before giving "
                   "up, publishing nothing (default 300)")
    p.set_defaults(func=cmd_reshard)

    p = sub.add_parser("import", help="write another framework's checkpoint (DeepSpeed, DCP, Megatron, Hugging "
                       "Face) as a ucl checkpoint in its own layout", epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", metavar="SRC", help="the framework's checkpoint folder (DeepSpeed: the root holding "
                   "'latest', or a tag folder)")
    p.add_argument("dst", metavar="DST", help="must not exist; appears atomically when complete")
    p.add_argument("--from", dest="format", choices=["deepspeed", "dcp", "megatron", "megatron-legacy", "hf"], default=None,
                   help="the source's format (default: detected)")
    p.add_argument("--workers", type=_positive_int, default=None, metavar="N", help="processes (default: min(2, cores))")
    p.add_argument("--spec", metavar="SPEC", help="the parameters' spec where the files do not give it: DeepSpeed "
                   "tensor-parallel checkpoints (`mesh tp, dp` and a rule with a shape per parameter; the optimizer "
                   "state's layout stays generated), or a Hugging Face folder (instead of the stdlib or derived spec)")
    p.add_argument("--dims", metavar="DIMS", help="the dims of --spec (name=value,... or a config.json; default for "
                   "Hugging Face: its config.json)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--no-fsync", action="store_true", help="skip fsync of the data files")
    p.set_defaults(func=cmd_import)

    p = sub.add_parser("export", help="write a checkpoint (ucl, or any folder ucl reads) in another framework's "
                       "format: Hugging Face safetensors, PyTorch DCP, DeepSpeed universal", epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("format", choices=["hf", "dcp", "deepspeed-universal"])
    p.add_argument("ckpt", metavar="CKPT", help="a ucl checkpoint, or a DeepSpeed, DCP or Hugging Face folder")
    p.add_argument("out", metavar="OUT", help="must not exist; appears atomically when complete")
    p.add_argument("--dtype", metavar="DTYPE", help="hf: cast floating weights (bfloat16, float16, float32; "
                   "float32 takes the fp32 master where there is one)")
    p.add_argument("--max-shard-size", default="5GB", metavar="SIZE", help="hf: largest shard (default 5GB)")
    p.add_argument("--config", metavar="CONFIG", help="hf: the config.json to write (default: the one the "
                   "checkpoint carries, from a Hugging Face source, or the one Megatron-LM's saved arguments "
                   "describe); a Megatron checkpoint's tensors are mapped to its model type (llama, mistral, "
                   "qwen2), fused QKV and SwiGLU undone")
    p.add_argument("--style", choices=["state_dict", "torchtitan"], default="state_dict",
                   help="dcp: key names of get_state_dict ({model, optim}) or torchtitan's (default state_dict)")
    p.add_argument("--tag", metavar="TAG", help="deepspeed-universal: the tag folder (default global_step<N>)")
    p.add_argument("--no-fsync", action="store_true", help="hf, deepspeed-universal: skip fsync of the files")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("inspect", help="show a checkpoint's parameters, shapes, dtypes, layout and sizes")
    p.add_argument("ckpt", metavar="CKPT")
    p.add_argument("--ranks", action="store_true", help="also list every rank's datasets")
    p.add_argument("--png", metavar="FILE", help="draw which rank holds which box of a parameter and its optimizer "
                   "states (needs matplotlib: pip install 'ucl[viz]')")
    p.add_argument("--param", metavar="NAME", help="the parameter to draw (default: a split or padded one)")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("verify", help="check every file and checksum of a checkpoint")
    p.add_argument("ckpt", metavar="CKPT")
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("gc", help="remove temp directories that killed writers left (never a live writer's)",
                       description="Remove the temp entries (.NAME.tmp-*) directly in each ROOT that writers killed "
                       "mid-write left behind: a directory whose writer's lock is free (the writer is gone), or one "
                       "without a lock file (older ucl, a copy) untouched for --max-age. A directory a live writer "
                       "holds is never removed, nor anything through a symlink.")
    p.add_argument("roots", nargs="+", metavar="ROOT", help="a checkpoint root, or the folder a reshard writes into")
    p.add_argument("--dry-run", action="store_true", help="list what would be removed; remove nothing")
    p.add_argument("--max-age", type=_seconds, default=3600.0, metavar="SECONDS",
                   help="age after which a temp entry without a lock file counts as abandoned (default 3600)")
    p.add_argument("--force", action="store_true", help="also remove temp entries without a lock file changed within "
                   "--max-age: only when no older ucl (or other copy) is writing there")
    p.set_defaults(func=cmd_gc)

    p = sub.add_parser("trace", help="summarise a training checkpointer's trace (ROOT/trace-rank*.jsonl); draw it")
    p.add_argument("root", metavar="ROOT", help="the Checkpointer's root folder")
    p.add_argument("--png", metavar="FILE", help="training iterations vs checkpoint phases per rank (matplotlib)")
    p.add_argument("--chrome", metavar="FILE", help="Chrome trace-event JSON, for Perfetto or chrome://tracing")
    p.set_defaults(func=cmd_trace)

    p = sub.add_parser("demo", help="build a Llama-style checkpoint, reshard it and verify it bit-exactly")
    p.add_argument("--workdir", default=None, help="where to write (default: a temporary folder)")
    p.add_argument("--from", dest="src", default="pp=2,dp=2,tp=2", metavar="MESH",
                   help="the layout the demo checkpoint is written in (default: %(default)s)")
    p.add_argument("--to", dest="dst", default="pp=1,dp=2,tp=4", metavar="MESH",
                   help="the layout it is resharded to (default: %(default)s)")
    p.add_argument("--keep", action="store_true", help="keep the checkpoints it wrote")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("spec", help="the standard library of specs, and drafting new ones")
    ssub = p.add_subparsers(dest="spec_command", required=True, metavar="SUBCOMMAND")
    q = ssub.add_parser("list", help="list stdlib specs")
    q.set_defaults(func=cmd_spec_list)
    q = ssub.add_parser("show", help="print a spec")
    q.add_argument("spec", metavar="SPEC")
    q.set_defaults(func=cmd_spec_show)
    q = ssub.add_parser("from-hf", help="draft a spec for a transformers model from its config")
    q.add_argument("config", metavar="CONFIG_OR_DIR")
    q.add_argument("-o", "--output", metavar="FILE")
    q.set_defaults(func=cmd_spec_from_hf)
    return ap


def main(argv: list[str] | None = None) -> int:
    _single_threaded_blas()
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except UclError as e:
        print(f"ucl: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # a path the user gave that cannot be read or written
        print(f"ucl: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("ucl: interrupted", file=sys.stderr)
        return 1


# a command allocates mostly long-lived objects (modules, classes, the plan): collecting every 700
# allocations (Python's default) spends 20-30 ms of a reshard's start sweeping them; cycles are
# still collected, just less often
CLI_GC_THRESHOLD = (50_000, 20, 20)


def entry() -> int:
    """The ``ucl`` command (console script and ``python -m ucl``): :func:`main`, with the cycle
    collector running less often (``CLI_GC_THRESHOLD``), and after which the heap is frozen
    (``gc.freeze``), so the interpreter's exit does not sweep every object for cycles again (0.1-0.25 s
    after a reshard); the process ends, and the OS takes its memory back anyway."""
    gc.set_threshold(*CLI_GC_THRESHOLD)
    try:
        return main()
    finally:
        gc.freeze()


def _single_threaded_blas() -> None:
    """The commands do no linear algebra, but OpenBLAS starts a thread per core when numpy is first
    imported, and each spins about 0.1 s of CPU before it sleeps: on a small machine, time taken
    from the copy itself. A value the user set is kept."""
    if "numpy" not in sys.modules:
        os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")


if __name__ == "__main__":
    sys.exit(entry())
