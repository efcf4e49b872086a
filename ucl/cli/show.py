"""The ``ucl`` subcommands that show what is there: inspect (a checkpoint's parameters and layout),
gc (dead writers' temp folders) and trace (a training checkpointer's timeline)."""
from __future__ import annotations

import json
import sys
from collections import Counter

from .common import age_text, checkpoint_arg, console, esc, nbytes, size_text


def cmd_inspect(args) -> int:
    """A header, then one line per parameter (its shape and layout rule; the kinds it is stored as
    once for all parameters, and per parameter only where they differ). On a terminal a table; piped,
    plain lines that ``grep NAME`` finds, never wrapped."""
    from ..ops.prepare import mesh_of, model_of, open_checkpoint
    path = checkpoint_arg(args.ckpt)
    rows, ranks = [], []
    with open_checkpoint(path) as ck:
        m = ck.manifest
        total = sum(nbytes(e["shape"], e["dtype"]) for ds in m.datasets for e in ds.values())
        codecs = sorted({e["encoding"] for ds in m.datasets for e in ds.values() if "encoding" in e})
        stored = sum(e.get("stored", nbytes(e["shape"], e["dtype"])) for ds in m.datasets for e in ds.values())
        packed = f" ({stored:,} stored, {'/'.join(codecs)})" if codecs else ""
        fmt = f"{ck.format} checkpoint (read in place)" if hasattr(ck, "format") else f"ucl format v{m.version}"
        head = [f"{path}: {fmt}, layout {mesh_of(ck)} ({ck.nranks} rank files), {total:,} bytes{packed}, "
                f"spec {m.spec_name or '(embedded)'}{_spec_source(m.state)}"]
        if m.dims:
            head.append("dims: " + ", ".join(f"{k}={v}" for k, v in m.dims.items()))
        if m.state:
            head.append("state: " + json.dumps(m.state)[:200])
        if m.spec and m.params is not None:
            model = model_of(ck)
            kinds, first = {}, {}
            for t in model.tensors:
                kinds.setdefault(t.name, []).append(f"{t.kind} ({t.dtype})")
                first.setdefault(t.name, t)
            rows = [(name, str(list(shape)), ", ".join(kinds.get(name, ())), rule_text(model, first[name]))
                    for name, shape in model.params.items() if name in first]
        if args.ranks:
            ranks = [(r, m.files[r], sorted(m.datasets[r].items())) for r in range(ck.nranks)]
    usual = Counter(k for _, _, k, _ in rows).most_common(1)
    usual = usual[0][0] if usual else None
    if usual is not None:
        others = sum(1 for _, _, k, _ in rows if k != usual)
        head.append(f"stored as {usual}" + (f" (all {len(rows)} parameters)" if not others else
                                            f" ({len(rows) - others} parameters; the others say theirs)"))
    rows = [(name, shape, "" if k == usual else k, rule) for name, shape, k, rule in rows]
    (_table if sys.stdout.isatty() else _plain)(head, rows, ranks)
    if args.png:
        from ..picture import draw_checkpoint
        draw_checkpoint(path, args.png, param=args.param)
        print(f"picture written to {args.png}")
    return 0


def _spec_source(state) -> str:
    """`` (derived)``: where a Hugging Face folder's spec came from (user, stdlib, alias, derived)."""
    source = state.get("hf", {}).get("spec_source") if isinstance(state, dict) and isinstance(state.get("hf"), dict) \
        else None
    return f" ({source})" if isinstance(source, str) else ""


def _plain(head: list[str], rows: list[tuple], ranks: list[tuple]) -> None:
    """One line per parameter and per dataset, columns padded, nothing wrapped."""
    width = max((len(r[0]) for r in rows), default=0)
    shape = max((len(r[1]) for r in rows), default=0)
    lines = list(head)
    for name, dims, kinds, rule in rows:
        lines.append(f"{name:<{width}}  {dims:<{shape}}  {rule}" + (f"  [stored as {kinds}]" if kinds else ""))
    for r, file, datasets in ranks:
        lines.append(f"rank {r} ({file}):")
        lines += [f"  {key:<60} {str(e['shape']):<16} {e['dtype']}" for key, e in datasets]
    print("\n".join(lines))


def _table(head: list[str], rows: list[tuple], ranks: list[tuple]) -> None:
    from rich.table import Table
    con = console()
    for line in head:
        con.print(esc(line))
    if rows:
        table = Table("parameter", "shape", "layout rule", *(["stored as"] if any(r[2] for r in rows) else []))
        table.columns[0].no_wrap = True  # a name is read (and copied) whole
        for name, dims, kinds, rule in rows:
            table.add_row(esc(name), esc(dims), esc(rule), *([esc(kinds)] if len(table.columns) == 4 else []))
        con.print(table)
    for r, file, datasets in ranks:
        con.print(esc(f"rank {r} ({file}):"))
        for key, e in datasets:
            con.print(esc(f"  {key:<60} {str(e['shape']):<16} {e['dtype']}"))


def rule_text(model, t) -> str:
    """The text after the colon of the rule that lays out tensor ``t``, on one line."""
    lines = model.spec.text.splitlines()[t.rule.span.line - 1:t.rule.span.end_line]
    body = " ".join(x.strip() for x in lines)
    return body.split(":", 1)[1].strip() if ":" in body else body


def cmd_gc(args) -> int:
    from ..store.atomic import collect_garbage
    con = console()
    found = [e for root in args.roots for e in collect_garbage(root, dry_run=args.dry_run, max_age_s=args.max_age,
                                                               force=args.force)]
    why = {"dead": "its writer{} is gone", "stale": f"no lock file, untouched for {age_text(args.max_age)}",
           "recent": "no lock file" + ("" if args.force else f", changed within {age_text(args.max_age)}; --force removes it"),
           "in use": "a live writer{} holds it", "link": "a symlink, never followed", "unknown": "cannot be examined",
           "root held": "no lock file, in a root a live writer holds: {}",
           "set aside": "a checkpoint a killed re-save set aside; the root's next writer puts it back"}

    def owner(e) -> str:  # the lock file's "pid host"; the root holder's description
        if e.state == "root held":
            return e.owner
        pid, _, host = e.owner.partition(" ")
        return f" (pid {pid} on {host})" if pid.isdigit() and host else ""

    def goes(e) -> bool:  # removed, or would be without --dry-run
        return e.removed or (args.dry_run and (e.removable or (args.force and e.state == "recent")))

    for e in found:
        if e.error:
            con.print(f"[red]error[/]: cannot remove {esc(e.path)}: {esc(e.error)}")
            continue
        verb = ("[green]would remove[/]" if args.dry_run else "[green]removed[/]") if goes(e) else "[yellow]kept[/]"
        con.print(f"{verb} {esc(e.path)}  {esc(size_text(e.nbytes))}  ({esc(why[e.state].format(owner(e)))})")
    gone = [e for e in found if goes(e)]
    failed = sum(1 for e in found if e.error)
    nbytes = sum(e.nbytes for e in gone)
    con.print(esc(f"{'would free' if args.dry_run else 'freed'} {nbytes:,} B ({size_text(nbytes)}) in {len(gone)} temp "
                 f"entr{'y' if len(gone) == 1 else 'ies'}; {len(found) - len(gone) - failed} kept"
                 + (f"; {failed} could not be removed" if failed else "")))
    return 1 if failed else 0


def cmd_trace(args) -> int:
    from ..train.timeline import draw_timeline, load_trace, summary_lines, write_chrome
    con = console()
    for line in summary_lines(load_trace(args.root), args.root):
        con.print(esc(line))
    if args.png:
        draw_timeline(args.root, args.png)
        con.print(f"timeline written to {esc(args.png)}")
    if args.chrome:
        write_chrome(args.root, args.chrome)
        con.print(f"Chrome/Perfetto trace written to {esc(args.chrome)}")
    return 0
