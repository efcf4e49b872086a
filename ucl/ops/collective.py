"""The collective commit: every process writes its own rank files into one temporary directory that
rank 0 created; rank 0 adopts them and commits once every process reports its files durable. A
failure anywhere publishes nothing, and every process learns it (no one is left in a collective)."""
from __future__ import annotations

import threading
from typing import Any, Callable, Mapping, Sequence

from ..errors import StoreError, UclError, code_agrees
from ..store.writer import CheckpointWriter
from .dist import allgather_json, broadcast_json, initialized_dist


def commit_collectively(path: str, nranks: int, fields: dict,
                        write: Callable[[CheckpointWriter], Sequence[int] | Mapping[int, dict]], *,
                        group=None, share: Any = None,
                        before_commit: Callable[[CheckpointWriter, list], None] | None = None,
                        prepare: Callable[[], None] | None = None,
                        publish: Callable[[str, str], None] | None = None,
                        heartbeat: float | None = None, cancel: threading.Event | None = None,
                        durable: bool = True, write_behind: bool = False, compress: str | None = None) -> str:
    """Called by every process of ``group``. Rank 0 runs ``prepare()`` and creates the writer for
    ``path`` (``nranks`` files, manifest ``fields``); each process calls ``write(writer)``, which
    writes its files and returns the ranks it wrote, or ``{rank: entries}`` of files already
    finished (by its own forked workers) for rank 0 to adopt. ``publish``: rank 0's writer's (see
    ``CheckpointWriter``). ``share`` (JSON) of every process
    reaches ``before_commit(writer, shares)`` on rank 0. Returns the committed path on every process.

    ``durable=False`` skips the fsync of the rank files (still atomic against a killed process);
    ``compress``: the writers' (``CheckpointWriter``).
    With ``heartbeat`` (seconds), ``write`` runs in a thread while this one tells every process,
    that often, who is still writing and whether one failed: the group's timeout then bounds how
    long a killed or hung process is waited for, not how long the slowest one writes; after a
    failure anywhere ``cancel`` is set, so the others' ``write`` can stop early. A collective that
    fails (a process died, or did not answer within the group's timeout) aborts rank 0's writer and
    raises UCL424 on every process that is left."""
    me = initialized_dist().get_rank()
    owner = tmp = error = None
    code = "UCL405"
    if me == 0:
        try:
            if prepare is not None:
                prepare()
            owner = CheckpointWriter(path, nranks, durable=durable, write_behind=write_behind, publish=publish,
                                     compress=compress, **fields)
            tmp = owner.tmp_path
        except (UclError, OSError) as e:
            error = str(e)
            if code_agrees(StoreError, getattr(e, "code", "")):  # e.g. UCL414, a held root: every process says so
                code = e.code
    tmp, error, code = _collective(broadcast_json, [tmp, error, code], group, owner, cancel)
    if error:
        raise StoreError(f"checkpoint not written: {error}", code=code)
    out = {"entries": {}, "problem": ""}

    def attempt() -> None:
        try:
            writer = owner if me == 0 else CheckpointWriter.join(tmp, nranks, durable=durable, write_behind=write_behind,
                                                                 compress=compress)
            done = write(writer)
            if isinstance(done, Mapping):
                out["entries"] = dict(done)
            elif (ranks := list(done)) and me != 0:
                out["entries"] = writer.finish(ranks)
        except Exception as e:  # reported to every process below
            if cancel is None or not cancel.is_set():  # not merely stopped because another one failed
                out["problem"] = f"rank {me}: {e}"

    if heartbeat is None:
        attempt()
    else:
        _beat_while(attempt, out, heartbeat, group, owner, cancel)
    gathered = _collective(allgather_json, {"entries": {str(k): v for k, v in out["entries"].items()},
                                            "problem": out["problem"], "share": share}, group, owner, cancel)
    problems = list(dict.fromkeys(g["problem"] for g in gathered if g["problem"]))  # each cause once
    result = ""
    if me == 0:
        try:
            if problems:
                owner.abort()
            else:
                if before_commit is not None:
                    before_commit(owner, [g["share"] for g in gathered])
                for g in gathered:
                    for r, e in g["entries"].items():
                        owner.adopt(int(r), e)
                result = owner.commit()
        except Exception as e:
            owner.abort()
            problems.append(str(e))
    result, err = _collective(broadcast_json, [result, "; ".join(problems)], group, owner, cancel)
    if err:
        raise StoreError(f"checkpoint not written: {err}", code="UCL410")
    return result


def _collective(op: Callable, value: Any, group, owner: CheckpointWriter | None,
                cancel: threading.Event | None) -> Any:
    """``op(value, group=group)``; when it fails (a process died, or did not answer within the group's
    timeout) rank 0 discards its temp directory and everyone left raises a UclError, not gloo's."""
    try:
        return op(value, group=group)
    except UclError:
        raise
    except Exception as e:  # torch.distributed raises RuntimeError (DistBackendError) and its kin
        if owner is not None:
            owner.abort()
        if cancel is not None:
            cancel.set()
        raise StoreError(f"checkpoint not written: a process of the job stopped answering (killed, or hung past "
                         f"the collective timeout): {e}", code="UCL424") from None


def _beat_while(attempt: Callable[[], None], out: dict, interval: float, group, owner: CheckpointWriter | None,
                cancel: threading.Event | None) -> None:
    """Run ``attempt`` in a thread; until it has ended on every process, sum (still writing, failed)
    over the group at least every ``interval`` seconds. A process that finished joins the sum at
    once, so the last one to finish ends the loop everywhere without waiting out an interval."""
    import torch
    dist = initialized_dist()
    worker = threading.Thread(target=attempt, name="ucl-collective-write", daemon=True)
    worker.start()
    while True:
        worker.join(interval)
        flags = torch.tensor([int(worker.is_alive()), int(bool(out["problem"]))], dtype=torch.int64)
        _collective(lambda t, group: dist.all_reduce(t, group=group), flags, group, owner, cancel)
        if flags[1] and cancel is not None:
            cancel.set()
        if not flags[0]:
            return
