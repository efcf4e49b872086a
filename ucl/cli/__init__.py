"""The ``ucl`` command line. Exit codes: 0 ok, 1 user error (a clear message, no traceback), 2 usage.

``parser`` holds the arguments, ``commands`` and ``show`` the subcommands, ``common`` what they share."""
from __future__ import annotations

import gc
import os
import sys

from ..errors import UclError
from . import commands, show
from .parser import build_parser, parse_args

__all__ = ["main", "entry", "build_parser", "HANDLERS", "CLI_GC_THRESHOLD"]

# the parser's ``handler`` names -> the functions that run them
HANDLERS = {"check": commands.cmd_check, "plan": commands.cmd_plan, "reshard": commands.cmd_reshard,
            "import": commands.cmd_import, "export": commands.cmd_export, "verify": commands.cmd_verify,
            "demo": commands.cmd_demo, "spec_list": commands.cmd_spec_list, "spec_show": commands.cmd_spec_show,
            "spec_from_hf": commands.cmd_spec_from_hf, "inspect": show.cmd_inspect, "gc": show.cmd_gc,
            "trace": show.cmd_trace}


def main(argv: list[str] | None = None) -> int:
    single_threaded_blas()
    args = parse_args(argv)
    try:
        return HANDLERS[args.handler](args)
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


def single_threaded_blas() -> None:
    """The commands do no linear algebra, but OpenBLAS starts a thread per core when numpy is first
    imported, and each spins about 0.1 s of CPU before it sleeps: on a small machine, time taken
    from the copy itself. A value the user set is kept."""
    if "numpy" not in sys.modules:
        os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
