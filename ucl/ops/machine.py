"""What this machine can take: how many worker processes, and how many target ranks a plan may
lower. Checked at the entry points (the command line, ``reshard``, ``import_checkpoint``) before
anything per worker or per rank is made, so a huge request is one error, never a MemoryError."""
from __future__ import annotations

import os
import resource
from typing import TYPE_CHECKING

from ..errors import PlanError, UclError

if TYPE_CHECKING:
    from ..layout.bind import Model
    from ..layout.mesh import Mesh

WORKERS_PER_CORE = 8  # more processes than this per core only add contention
# what lowering holds per piece of a tensor on a rank: measured ~80-130 B where most pieces are a
# few elements (a small model over 65,536 to 4M ranks), ~1 KiB for Llama-8B over 2,048 ranks; the
# low end, so a plan is refused only where it would surely not fit
PIECE_BYTES = 128


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity: ``taskset``, a container's cpuset),
    which can be fewer than the machine has."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # no affinity on this platform
        return os.cpu_count() or 1


def max_workers() -> int:
    return WORKERS_PER_CORE * (os.cpu_count() or 1)


def check_workers(workers: int | None) -> None:
    """``workers`` (already a positive int or None) within :func:`max_workers`."""
    if workers is not None and workers > max_workers():
        raise UclError(f"workers={workers:,} is more than this machine can run: at most {max_workers():,} "
                       f"({WORKERS_PER_CORE} per core, {os.cpu_count() or 1} cores)", code="UCL009")


def memory_bytes() -> int:
    """The memory this process may use: physical memory, less where an address-space limit
    (RLIMIT_AS, less what is mapped already) or a cgroup (memory.max) allows less."""
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        total = 1 << 50
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY and soft > 0:
        try:  # what the process has mapped already counts against the limit
            with open("/proc/self/statm") as f:
                mapped = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):
            mapped = 0
        total = min(total, max(0, soft - mapped))
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            text = f.read().strip()
        if text.isdigit():
            total = min(total, int(text))
    except OSError:
        pass
    return total


def plan_bytes(model: "Model", dst: "Mesh") -> int:
    """An estimate (a low one) of the memory lowering ``model`` onto ``dst`` takes: each tensor in
    pieces on at most as many target ranks as it has elements."""
    total = 0
    for t in model.tensors:
        total += min(dst.size, max(1, t.numel)) * PIECE_BYTES
    return total


def check_plan_fits(model: "Model", src: "Mesh", dst: "Mesh") -> None:
    """Refuse a plan from ``src`` to ``dst`` when even :func:`plan_bytes` of both exceeds
    :func:`memory_bytes`."""
    need, have = plan_bytes(model, src) + plan_bytes(model, dst), memory_bytes()
    if need > have:
        raise PlanError(f"a plan from {src} to {dst} ({src.size + dst.size:,} ranks, {len(model.tensors):,} tensors) needs "
                        f"at least {need / 2**30:,.1f} GiB to lower, more than the {have / 2**30:,.1f} GiB "
                        f"this machine allows; use fewer ranks", code="UCL317")
