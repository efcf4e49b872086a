"""The collective commit: every process writes its own rank files into one temporary directory that
rank 0 created; rank 0 adopts them and commits once every process reports its files durable. A
failure anywhere publishes nothing, and every process learns it (no one is left in a collective)."""
from __future__ import annotations

from typing import Any, Callable, Sequence

from ..errors import StoreError, UclError
from ..store.writer import CheckpointWriter
from .dist import allgather_json, broadcast_json, initialized_dist


def commit_collectively(path: str, nranks: int, fields: dict, write: Callable[[CheckpointWriter], Sequence[int]], *,
                        group=None, share: Any = None,
                        before_commit: Callable[[CheckpointWriter, list], None] | None = None,
                        prepare: Callable[[], None] | None = None) -> str:
    """Called by every process of ``group``. Rank 0 runs ``prepare()`` and creates the writer for
    ``path`` (``nranks`` files, manifest ``fields``); each process calls ``write(writer)``, which
    writes its files and returns the ranks it wrote. ``share`` (JSON) of every process reaches
    ``before_commit(writer, shares)`` on rank 0. Returns the committed path on every process."""
    me = initialized_dist().get_rank()
    owner = tmp = error = None
    if me == 0:
        try:
            if prepare is not None:
                prepare()
            owner = CheckpointWriter(path, nranks, **fields)
            tmp = owner.tmp_path
        except (UclError, OSError) as e:
            error = str(e)
    tmp, error = broadcast_json([tmp, error], group=group)
    if error:
        raise StoreError(f"checkpoint not written: {error}", code="UCL405")
    entries, problem = {}, ""
    try:
        writer = owner if me == 0 else CheckpointWriter.join(tmp, nranks)
        ranks = list(write(writer))
        if me != 0 and ranks:
            entries = writer.finish(ranks)
    except Exception as e:  # reported to every process below
        problem = f"rank {me}: {e}"
    gathered = allgather_json({"entries": {str(k): v for k, v in entries.items()}, "problem": problem,
                               "share": share}, group=group)
    problems = [g["problem"] for g in gathered if g["problem"]]
    result = ""
    if me == 0:
        try:
            if problems:
                raise StoreError("; ".join(problems), code="UCL410")
            if before_commit is not None:
                before_commit(owner, [g["share"] for g in gathered])
            for g in gathered:
                for r, e in g["entries"].items():
                    owner.adopt(int(r), e)
            result = owner.commit()
        except Exception as e:
            owner.abort()
            problems.append(str(e))
    result, err = broadcast_json([result, "; ".join(problems)], group=group)
    if err:
        raise StoreError(f"checkpoint not written: {err}", code="UCL410")
    return result
