"""The ``ucl`` command line's arguments: one argparse parser for every subcommand, its value types,
and the checks argparse cannot express (a flag given to a format it does not apply to), all usage
errors (exit 2)."""
from __future__ import annotations

import argparse

from .. import __version__

EPILOG = """meshes are written slowest axis first, like pp=2,dp=2,tp=2 (tp fastest); 'universal' is the
consolidated layout. SPEC is a .ucl file or stdlib:NAME. DIMS is hidden=4096,heads=32,... or a
Hugging Face config.json (or a folder holding one). CKPT may be a checkpoint root (latest + step_*):
its latest checkpoint is opened."""

# export option (dest, flag) -> the formats it applies to; given to another, it is a usage error
EXPORT_ONLY = {("dtype", "--dtype"): ("hf",), ("max_shard_size", "--max-shard-size"): ("hf",),
               ("config", "--config"): ("hf",), ("style", "--style"): ("dcp",),
               ("tag", "--tag"): ("deepspeed-universal",), ("no_fsync", "--no-fsync"): ("hf", "deepspeed-universal")}
EXPORT_DEFAULTS = {"max_shard_size": "5GB", "style": "state_dict"}


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (a bad value is a usage error, exit 2)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def seconds(text: str) -> float:
    """argparse type: a non-negative number of seconds."""
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not x >= 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, got {text}")
    return x


def positive_seconds(text: str) -> float:
    """argparse type: a positive number of seconds."""
    x = seconds(text)
    if not x > 0:
        raise argparse.ArgumentTypeError(f"must be more than 0, got {text}")
    return x


def add_max_memory(p: argparse.ArgumentParser, what: str) -> None:
    """``--max-memory SIZE`` of a command that runs an offline operation (checked by the command:
    a size that is none, or too small, is error UCL011, one line)."""
    p.add_argument("--max-memory", metavar="SIZE", default=None,
                   help=f"the most memory {what} may add, over every process it starts: 2GB, 64MB, 1GiB "
                   "(default 2GB; docs/memory.md)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse ``argv``; an export option of another format exits 2 naming the formats it applies to."""
    args = build_parser().parse_args(argv)
    if args.handler == "export":
        for (dest, flag), formats in EXPORT_ONLY.items():
            if getattr(args, dest) not in (None, False) and args.format not in formats:
                args.usage_error(f"{flag} applies to export {' and '.join(formats)} only, not {args.format}")
        for dest, value in EXPORT_DEFAULTS.items():
            if getattr(args, dest) is None:
                setattr(args, dest, value)
    return args


def build_parser() -> argparse.ArgumentParser:
    """The whole command line; each (sub)command's ``handler`` names its function (``ucl.cli.HANDLERS``)."""
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
    p.set_defaults(handler="check")

    p = sub.add_parser("plan", help="compile a reshard plan and show its statistics", epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("spec", metavar="SPEC")
    p.add_argument("--dims", metavar="DIMS", required=True, help="the model's dims: name=value pairs "
                   "(hidden=4096,heads=32,...) or a Hugging Face config.json (or a folder holding one)")
    p.add_argument("--from", dest="src", metavar="MESH", required=True, help="the layout the checkpoint is "
                   "written in, slowest axis first (pp=2,dp=2,tp=2), or 'universal'")
    p.add_argument("--to", dest="dst", metavar="MESH", required=True, help="the layout to reshard to, "
                   "slowest axis first (pp=1,dp=2,tp=4), or 'universal'")
    p.add_argument("--params", metavar="MODEL", help="parameter names and shapes from a model or checkpoint "
                   "(default: synthesized from the spec's declared shapes)")
    p.add_argument("--explain", metavar="PARAM", help="print where every box of PARAM comes from")
    p.add_argument("--json", metavar="FILE", help="write the plan as JSON (docs/ir.md)")
    p.add_argument("--png", metavar="FILE", help="draw which rank holds which box of a parameter, source and "
                   "target side by side (needs matplotlib: pip install 'ucl[viz]')")
    p.add_argument("--param", metavar="NAME", help="the parameter to draw (default: one whose layout changes)")
    p.set_defaults(handler="plan")

    p = sub.add_parser("reshard", help="write a checkpoint in another layout", epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", metavar="SRC")
    p.add_argument("dst", metavar="DST", help="must not exist; appears atomically when complete")
    p.add_argument("--to", metavar="MESH", required=True, help="the target layout, slowest axis first "
                   "(pp=1,dp=2,tp=4), or 'universal'")
    p.add_argument("--spec", metavar="SPEC", help="a foreign folder read with this spec (a Hugging Face folder: "
                   "instead of the stdlib or derived one; see ucl import --help)")
    p.add_argument("--dims", metavar="DIMS", help="the dims of --spec (default for Hugging Face: its config.json)")
    p.add_argument("--workers", type=positive_int, default=None, metavar="N",
                   help="processes, 1 to 8 a core (default: min(2, cores it may use); under torchrun: forked "
                   "processes per torchrun process, default 1)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--no-fsync", action="store_true", help="skip fsync of the data files: still atomic if the "
                   "process dies, but not if the machine loses power before the OS writes the pages")
    p.add_argument("--compress", choices=["none", "zstd", "lz4"], default="none",
                   help="the target's encoding: units of checksum chunks or tiles, each coded on its own after a "
                   "byte-plane transform, lossless (docs/format.md; default none: plain, whatever the source's)")
    p.add_argument("--timeout", type=positive_seconds, default=300.0, metavar="SECONDS",
                   help="under torchrun: how long to wait for a process that stopped answering before giving "
                   "up, publishing nothing (default 300)")
    add_max_memory(p, "the reshard (under torchrun: each process)")
    p.set_defaults(handler="reshard")

    p = sub.add_parser("import", help="write another framework's checkpoint (DeepSpeed, DCP, Megatron, Hugging "
                       "Face) as a ucl checkpoint in its own layout", epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", metavar="SRC", help="the framework's checkpoint folder (DeepSpeed: the root holding "
                   "'latest', or a tag folder)")
    p.add_argument("dst", metavar="DST", help="must not exist; appears atomically when complete")
    p.add_argument("--from", dest="format", choices=["deepspeed", "dcp", "megatron", "megatron-legacy", "hf"], default=None,
                   help="the source's format (default: detected)")
    p.add_argument("--workers", type=positive_int, default=None, metavar="N",
                   help="processes, 1 to 8 a core (default: min(2, cores it may use))")
    p.add_argument("--spec", metavar="SPEC", help="the parameters' spec where the files do not give it: DeepSpeed "
                   "tensor-parallel checkpoints (`mesh tp, dp` and a rule with a shape per parameter; the optimizer "
                   "state's layout stays generated), or a Hugging Face folder (instead of the stdlib or derived spec)")
    p.add_argument("--dims", metavar="DIMS", help="the dims of --spec (name=value,... or a config.json; default for "
                   "Hugging Face: its config.json)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--no-fsync", action="store_true", help="skip fsync of the data files")
    add_max_memory(p, "the import")
    p.add_argument("--compress", choices=["none", "zstd", "lz4"], default="none",
                   help="the copy's encoding, as for reshard (default none: plain)")
    p.set_defaults(handler="import")

    p = sub.add_parser("export", help="write a checkpoint (ucl, or any folder ucl reads) in another framework's "
                       "format: Hugging Face safetensors, PyTorch DCP, DeepSpeed universal", epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("format", choices=["hf", "dcp", "deepspeed-universal"])
    p.add_argument("ckpt", metavar="CKPT", help="a ucl checkpoint or checkpoint root (its latest), or a DeepSpeed, "
                   "DCP or Hugging Face folder")
    p.add_argument("out", metavar="OUT", help="must not exist; appears atomically when complete")
    p.add_argument("--dtype", metavar="DTYPE", help="hf only: cast floating weights to DTYPE (bfloat16, float16, "
                   "float32), each read from its fp32 master (fp32/NAME) where the checkpoint has one (default: "
                   "each weight as stored, not the master)")
    p.add_argument("--max-shard-size", metavar="SIZE", help="hf only: largest safetensors file (5GB, 500MB, 1GiB; "
                   "default 5GB)")
    p.add_argument("--config", metavar="CONFIG", help="hf only: the config.json to write (default: the one the "
                   "checkpoint carries, from a Hugging Face source, or the one Megatron-LM's saved arguments "
                   "describe); a Megatron checkpoint's tensors are mapped to its model type (llama, mistral, "
                   "qwen2), fused QKV and SwiGLU undone")
    p.add_argument("--style", choices=["state_dict", "torchtitan"], help="dcp only: key names of get_state_dict "
                   "({model, optim}) or torchtitan's (default state_dict)")
    p.add_argument("--tag", metavar="TAG", help="deepspeed-universal only: the tag folder (default global_step<N>)")
    p.add_argument("--no-fsync", action="store_true", help="hf, deepspeed-universal only: skip fsync of the files")
    add_max_memory(p, "the export")
    p.set_defaults(handler="export", usage_error=p.error)  # "ucl export: error: ...", exit 2

    p = sub.add_parser("inspect", help="show a checkpoint's parameters, shapes, dtypes, layout and sizes")
    p.add_argument("ckpt", metavar="CKPT")
    p.add_argument("--ranks", action="store_true", help="also list every rank's datasets")
    p.add_argument("--png", metavar="FILE", help="draw which rank holds which box of a parameter and its optimizer "
                   "states (needs matplotlib: pip install 'ucl[viz]')")
    p.add_argument("--param", metavar="NAME", help="the parameter to draw (default: a split or padded one)")
    p.set_defaults(handler="inspect")

    p = sub.add_parser("verify", help="check every file and checksum of a checkpoint")
    p.add_argument("ckpt", metavar="CKPT")
    p.set_defaults(handler="verify")

    p = sub.add_parser("gc", help="remove temp directories that killed writers left (never a live writer's)",
                       description="Remove the temp entries (.NAME.tmp-*) directly in each ROOT that writers killed "
                       "mid-write left behind: a directory whose writer's lock is free (the writer is gone), or one "
                       "without a lock file (older ucl, a copy) untouched for --max-age. A directory a live writer "
                       "holds is never removed, nor anything through a symlink, nor (in a root a live Checkpointer "
                       "holds) an entry without a lock file, nor a checkpoint set aside by a killed re-save.")
    p.add_argument("roots", nargs="+", metavar="ROOT", help="a checkpoint root, or the folder a reshard writes into")
    p.add_argument("--dry-run", action="store_true", help="list what would be removed; remove nothing")
    p.add_argument("--max-age", type=seconds, default=3600.0, metavar="SECONDS",
                   help="age after which a temp entry without a lock file counts as abandoned (default 3600)")
    p.add_argument("--force", action="store_true", help="also remove temp entries without a lock file changed within "
                   "--max-age: only when no older ucl (or other copy) is writing there")
    p.set_defaults(handler="gc")

    p = sub.add_parser("trace", help="summarise a training checkpointer's trace (ROOT/trace-rank*.jsonl); draw it")
    p.add_argument("root", metavar="ROOT", help="the Checkpointer's root folder")
    p.add_argument("--png", metavar="FILE", help="training iterations vs checkpoint phases per rank (matplotlib)")
    p.add_argument("--chrome", metavar="FILE", help="Chrome trace-event JSON, for Perfetto or chrome://tracing")
    p.set_defaults(handler="trace")

    p = sub.add_parser("demo", help="build a Llama-style checkpoint, reshard it and verify it bit-exactly")
    p.add_argument("--workdir", default=None, help="where to write (default: a temporary folder)")
    p.add_argument("--from", dest="src", default="pp=2,dp=2,tp=2", metavar="MESH",
                   help="the layout the demo checkpoint is written in (default: %(default)s)")
    p.add_argument("--to", dest="dst", default="pp=1,dp=2,tp=4", metavar="MESH",
                   help="the layout it is resharded to (default: %(default)s)")
    p.add_argument("--keep", action="store_true", help="keep the checkpoints it wrote")
    p.set_defaults(handler="demo")

    p = sub.add_parser("spec", help="the standard library of specs, and drafting new ones")
    ssub = p.add_subparsers(dest="spec_command", required=True, metavar="SUBCOMMAND")
    q = ssub.add_parser("list", help="list stdlib specs")
    q.set_defaults(handler="spec_list")
    q = ssub.add_parser("show", help="print a spec")
    q.add_argument("spec", metavar="SPEC")
    q.set_defaults(handler="spec_show")
    q = ssub.add_parser("from-hf", help="draft a spec for a transformers model from its config")
    q.add_argument("config", metavar="CONFIG_OR_DIR")
    q.add_argument("-o", "--output", metavar="FILE", help="write the draft to FILE (default: print it)")
    q.set_defaults(handler="spec_from_hf")
    return ap

