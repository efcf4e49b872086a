"""The ``ucl`` subcommands that read and write checkpoints and specs: check, plan, reshard, import,
export, verify, demo, spec. Each returns the exit code; a UclError is turned into one line by ``main``."""
from __future__ import annotations

import os
from pathlib import Path

from ..errors import UclError
from .common import checkpoint_arg, console, esc, nbytes, params_of, parse_dims, report

# ---- commands ------------------------------------------------------------------------------------------
def cmd_check(args) -> int:
    from ..lang.spec import load_spec
    spec = load_spec(args.spec)
    con = console()
    if args.dims is None and args.against and (Path(args.against) / "config.json").is_file():
        args.dims = str(Path(args.against) / "config.json")  # a save_pretrained folder carries its dims
    if args.dims is None and args.against:
        raise UclError("--against needs --dims (a config.json or hidden=...,heads=...)", code="UCL009")
    if args.dims is None:
        con.print("[green]ok[/]: " + esc(f"{spec.name or spec.filename}: {len(spec.checked.rules)} rules, "
                  f"{len(spec.checked.placements)} placement rules, axes {', '.join(spec.axes) or '-'}, "
                  f"kinds {', '.join(spec.kinds)}"))
        return 0
    dims = parse_dims(spec, args.dims)
    if args.against:
        from ..formats.hf import check_against, read_tensor_names, unmatched_patterns
        tensors = read_tensor_names(args.against)
        problems = check_against(spec, dims, tensors)
        for w in [] if problems else unmatched_patterns(spec, dims, tensors):
            con.print(esc(w))
        return report(con, problems, f"{args.against} does not match {spec.name or spec.filename}",
                       f"every tensor of {args.against} is matched exactly once with its shape")
    model = spec.bind(dims, params_of(spec, dims, None))
    for d in model.unmatched():
        con.print(esc(d.render(spec.text, spec.filename)))
    con.print(f"[green]ok[/]: {len(model.params)} parameters, {len(model.tensors)} tensors bound")
    return 0


def cmd_plan(args) -> int:
    from ..layout.mesh import Mesh
    from ..plan.compile import compile
    from ..lang.spec import load_spec
    spec = load_spec(args.spec)
    dims = parse_dims(spec, args.dims)
    from ..ops.machine import check_plan_fits
    model = spec.bind(dims, params_of(spec, dims, args.params))
    src, dst = Mesh.parse(args.src), Mesh.parse(args.dst)
    check_plan_fits(model, src, dst)
    plan = compile(model, src, dst)
    con = console()
    con.print(esc(plan.summary()))
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
        con.print(f"plan written to {esc(args.json)}")
    if args.png:
        from ..picture import draw_plan
        draw_plan(model, plan.src_mesh, plan.dst_mesh, args.png, param=args.param)
        con.print(f"picture written to {esc(args.png)}")
    return 0


def cmd_reshard(args) -> int:
    from ..layout.mesh import Mesh
    from ..ops.convert import user_spec
    from ..ops.machine import check_workers
    to = Mesh.parse(args.to)
    check_workers(args.workers)
    cap = _capped(args).get("max_memory")
    src = checkpoint_arg(args.src)
    spec, dims = _user_spec(args, src)
    return _reshard(args, src, to, user_spec(spec, dims), cap)


def _reshard(args, src, to, user, cap=None) -> int:
    from ..ops.dist import torchrun_world
    from ..ops.reshard import reshard
    if torchrun_world() > 1:  # under torchrun: every process writes its share (docs/distributed.md)
        return _reshard_distributed(args, src, to, console(), user, cap)
    if args.quiet:  # plain output: --quiet does not import rich (a tenth of a small reshard's start-up)
        stats = reshard(src, args.dst, to, workers=args.workers, durable=not args.no_fsync, user=user,
                        compress=args.compress, max_memory=cap)
        print(f"wrote {_reshard_summary(args.dst, to, stats)}")
        return 0
    con = console()
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn
    with Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                  TimeRemainingColumn(), console=con, transient=True) as bar:
        task = bar.add_task(esc(f"reshard -> {to}"), total=_reshard_bytes(src, to))
        stats = reshard(src, args.dst, to, workers=args.workers, durable=not args.no_fsync, user=user,
                        progress=lambda n: bar.advance(task, n), compress=args.compress, max_memory=cap)
    con.print("[green]wrote[/] " + esc(_reshard_summary(args.dst, to, stats)))
    return 0


def _reshard_summary(dst, to, stats) -> str:
    return (f"{dst} ({to}): {stats.datasets_written} datasets, {stats.bytes_written:,} B written, "
            f"{stats.bytes_read:,} B read ({stats.bytes_needed:,} B needed) in {stats.seconds:.2f} s "
            f"(open {stats.open_seconds:.2f} s, plan {stats.compile_seconds:.2f} s)")


def _reshard_distributed(args, src: str, to, con, user, cap=None) -> int:
    """One process of a torchrun job: join the gloo world, write this process's share; rank 0 prints."""
    from ..ops.dist import init_from_env
    from ..ops.reshard import reshard
    dist = init_from_env(args.timeout)
    try:
        stats = reshard(src, args.dst, to, workers=args.workers, durable=not args.no_fsync, distributed=True, user=user,
                        timeout=args.timeout, compress=args.compress, max_memory=cap)
        if dist.get_rank() == 0:
            con.print("[green]wrote[/] " + esc(f"{args.dst} ({to}) with {dist.get_world_size()} processes: "
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
    from ..ops.prepare import mesh_of, model_of, open_checkpoint, plan_for
    with open_checkpoint(src) as ck:
        plan = plan_for(model_of(ck), mesh_of(ck), to)
    per = [nbytes(d["shape"], d["dtype"]) for d in plan.datasets]
    return int(sum(per[int(i)] for i in plan.first_holders["dataset"]))


def _user_spec(args, src: str):
    """``--spec`` and ``--dims`` of import/reshard: (spec, dims) or (None, None). A Hugging Face
    folder's dims default to its config.json (read by the spec's `dims ... from` declarations)."""
    if args.spec is None:
        if args.dims is not None:
            raise UclError("--dims is read with --spec only", code="UCL009")
        return None, None
    from ..lang.spec import load_spec
    spec = load_spec(args.spec)
    if args.dims is None and os.path.isfile(os.path.join(src, "config.json")):
        return spec, {}
    return spec, parse_dims(spec, args.dims) if args.dims is not None or spec.dims else {}


def _capped(args) -> dict:
    """``max_memory=`` for an op, from ``--max-memory`` (checked here, UCL011, before anything is
    opened); nothing where it was not given, so the op's own default applies."""
    from ..memory import memory_cap
    return {} if args.max_memory is None else {"max_memory": memory_cap(args.max_memory)}


def cmd_import(args) -> int:
    from ..ops.convert import user_spec
    from ..ops.machine import check_workers
    con = console()
    check_workers(args.workers)
    args.cap = _capped(args)
    src = checkpoint_arg(args.src)
    spec, dims = _user_spec(args, src)
    return _import(args, con, src, spec, dims, user_spec(spec, dims))


def _import(args, con, src, spec, dims, user) -> int:
    from ..ops.convert import import_checkpoint
    from ..ops.prepare import mesh_of, open_checkpoint
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn
    with open_checkpoint(src, args.format, user) as ck:
        fmt, mesh = getattr(ck, "format", "ucl"), mesh_of(ck)
        total = sum(nbytes(e["shape"], e["dtype"]) for ds in ck.manifest.datasets for e in ds.values())
    with Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(), TimeRemainingColumn(),
                  console=con, transient=True, disable=args.quiet) as bar:
        task = bar.add_task(esc(f"import {fmt} ({mesh})"), total=total)
        stats = import_checkpoint(src, args.dst, format=fmt, workers=args.workers, durable=not args.no_fsync,
                                  progress=lambda n: bar.advance(task, n), spec=spec, dims=dims, compress=args.compress,
                                  **args.cap)
    con.print("[green]imported[/] " + esc(f"{fmt} checkpoint {src} -> {args.dst} ({mesh}): {stats.datasets_written} "
              f"datasets, {stats.bytes_written:,} B written, {stats.bytes_read:,} B read in {stats.seconds:.2f} s"))
    return 0


def cmd_export(args) -> int:
    con = console()
    cap = _capped(args)
    src = checkpoint_arg(args.ckpt)
    if args.format in ("hf", "dcp"):
        need_torch(f"ucl export {args.format}")
    if args.format == "hf":
        from ..ops.export import export_hf
        stats = export_hf(src, args.out, dtype=args.dtype, max_shard_size=args.max_shard_size, config=args.config,
                          durable=not args.no_fsync, **cap)
    elif args.format == "dcp":
        from ..ops.export import export_dcp
        stats = export_dcp(src, args.out, style=args.style, **cap)
    else:
        from ..ops.export import export_deepspeed_universal
        stats = export_deepspeed_universal(src, args.out, tag=args.tag, durable=not args.no_fsync, **cap)
    con.print("[green]exported[/] " + esc(f"{src} -> {args.out} ({args.format}): {stats.bytes_written:,} B written, "
              f"{stats.bytes_read:,} B read in {stats.seconds:.2f} s"))
    return 0


def need_torch(what: str) -> None:
    """One line naming what to install when torch is missing, not the traceback of a deep import."""
    try:
        import torch  # noqa: F401
    except ImportError as e:
        if (e.name or "").split(".")[0] != "torch":
            raise UclError(f"{what} needs torch, which does not import: {e}", code="UCL009") from None
        raise UclError(f"{what} needs torch: pip install 'ucl[torch]' (CPU only: pip install torch==2.13.0 "
                       "--index-url https://download.pytorch.org/whl/cpu)", code="UCL009") from None


def cmd_verify(args) -> int:
    from ..ops.prepare import check_stored, model_of, open_checkpoint
    con = console()
    path = checkpoint_arg(args.ckpt)
    from ..train.local import node_file
    held = node_file(path)  # a node-local tier's folder holds its node's rank files only
    with open_checkpoint(path) as ck:
        ranks = None if held is None else sorted(r for r in held["ranks"] if isinstance(r, int) and 0 <= r < ck.nranks)
        problems, fmt = ck.verify(ranks), getattr(ck, "format", None)
        if ck.manifest.spec is not None and not problems:
            try:  # the datasets are the ones the checkpoint's own spec puts on each rank (what readers need)
                check_stored(ck, model_of(ck), ranks)
            except UclError as e:
                problems.append(f"{e} [{e.code}]")
        elsewhere = [] if ranks is None else sorted(set(range(ck.nranks)) - set(ranks))
    ok = f"{path}: every file present, every checksum matches, the datasets are what its spec lays out" \
        if fmt is None else f"{path}: every {fmt} file present and holding its tensors' bytes ({fmt} files " \
        "carry no checksums)"
    if held is not None:
        ok = (f"{path}: node {held['node']}'s local copy: rank files {_ranks_text(ranks)} present, every checksum "
              f"matches, the datasets are what its spec lays out"
              + (f"; rank files {_ranks_text(elsewhere)} are on other nodes" if elsewhere else ""))
    return report(con, problems, f"in {path}", ok)


def _ranks_text(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks[:16])) + (f" ... ({len(ranks)} in all)" if len(ranks) > 16 else "") or "none"


def cmd_demo(args) -> int:
    from ..demo import run_demo
    return run_demo(args.workdir, src=args.src, dst=args.dst, keep=args.keep, console=console())


def cmd_spec_list(args) -> int:
    from ..lang.stdlib import stdlib_names
    for n in stdlib_names():
        print(f"stdlib:{n}")
    return 0


def cmd_spec_show(args) -> int:
    from ..lang.spec import load_spec
    print(load_spec(args.spec).text, end="")
    return 0


def cmd_spec_from_hf(args) -> int:
    from ..formats.hf import draft_spec_from_hf
    text = draft_spec_from_hf(args.config)
    if args.output:
        Path(args.output).write_text(text)
        console().print(esc(f"draft spec written to {args.output}; review it, then `ucl check {args.output} "
                            f"--dims {args.config} --against MODEL`"))
    else:
        print(text, end="")
    return 0
