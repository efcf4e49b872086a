"""The node-local tier (``Checkpointer(local=PATH)``): every snapshot is written to storage only its
node sees (local NVMe, ``/dev/shm``), and one in ``persist_every`` is copied on to the shared
``root``.

A node's local folder is a checkpoint root of its own (``step_*``, ``latest``, ``keep``). Its step
folder holds the rank files of that node's processes, ``ucl_node.json`` (the node id and those
ranks) and the *whole job's* ``manifest.json``, the same on every node (every rank's entries and
checksums), so any node's folder describes the checkpoint and checks the bytes of every part.
A step is written by every process or by none: each node's folder appears by one atomic rename
once every process of the job has its file durable; a node whose rename failed makes the others
take theirs back. A job killed between two nodes' renames leaves a step that some nodes hold and
others lack: recovery (``train.recover``) serves only steps whose every part some copy holds."""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from typing import Any, Callable

from ..errors import StoreError, UclError
from ..ops.dist import allgather_json
from ..store.atomic import TempDir, fsync_path, write_atomic
from ..store.manifest import COMPRESSED_VERSION, MANIFEST_NAME, Manifest, file_name
from ..store.root import CheckpointRoot
from ..store.writer import CheckpointWriter

NODE_NAME = "ucl_node.json"  # in a local step folder: {"node": N, "ranks": [the rank files it holds]}


def node_id(node: Any = None) -> int:
    """This process's node: ``node`` when given, else torchrun's ``GROUP_RANK`` (the node rank), else
    ``RANK // LOCAL_WORLD_SIZE``, else 0 (one node)."""
    if node is not None:
        if not isinstance(node, int) or isinstance(node, bool) or node < 0:
            raise UclError(f"node must be a non-negative integer, got {node!r}", code="UCL430")
        return node
    env = os.environ
    if env.get("GROUP_RANK", "").isdigit():
        return int(env["GROUP_RANK"])
    if env.get("RANK", "").isdigit() and env.get("LOCAL_WORLD_SIZE", "").isdigit() and int(env["LOCAL_WORLD_SIZE"]):
        return int(env["RANK"]) // int(env["LOCAL_WORLD_SIZE"])
    return 0


@dataclass(frozen=True)
class Nodes:
    """Which node each process of the job is on (process rank -> node id), and this process's rank."""
    of: tuple[int, ...]
    me: int

    @property
    def node(self) -> int:
        return self.of[self.me]

    def members(self, node: int) -> list[int]:
        return [p for p, n in enumerate(self.of) if n == node]

    def leader(self, node: int) -> int:
        """The process that creates and publishes the node's folder: its lowest process rank."""
        return min(self.members(node))

    @property
    def leads(self) -> bool:
        return self.leader(self.node) == self.me


def agree_nodes(node: int, local: str, me: int, world: int, group) -> Nodes:
    """Every process's node, gathered; UCL430 when processes of one node name different local folders
    (each node's processes write into one folder)."""
    if world == 1:
        return Nodes((node,), 0)
    views = allgather_json([node, os.path.abspath(local)], group=group)
    folders: dict[int, set] = {}
    for n, path in views:
        folders.setdefault(n, set()).add(path)
    split = {n: sorted(p) for n, p in folders.items() if len(p) > 1}
    if split:
        n, paths = next(iter(split.items()))
        raise UclError(f"the processes of node {n} were given different local folders ({', '.join(paths)}); "
                       "the processes of one node must share one", code="UCL430")
    return Nodes(tuple(n for n, _ in views), me)


def node_file(path: str) -> dict | None:
    """A local step folder's ``ucl_node.json`` (None: not a local tier's folder, or unreadable)."""
    try:
        with open(os.path.join(path, NODE_NAME), "rb") as f:
            data = json.loads(f.read(1 << 20))
    except (OSError, ValueError):
        return None
    ok = isinstance(data, dict) and isinstance(data.get("node"), int) and isinstance(data.get("ranks"), list)
    return data if ok else None


class LocalTier:
    """This node's local folder and the collective writing of one step into every node's folder."""

    def __init__(self, path: str, nodes: Nodes, keep: int, group=None, replicas: int = 0):
        self.root = CheckpointRoot(path)
        self.nodes, self.keep, self.group, self.replicas = nodes, keep, group, replicas

    def gather(self, value: Any) -> list:
        """Every process's JSON ``value`` over the checkpointer's group."""
        if len(self.nodes.of) == 1:
            return [value]
        try:
            return allgather_json(value, group=self.group)
        except RuntimeError as e:  # gloo: a peer exited or hung past the timeout
            raise StoreError(f"local tier: another process of the job stopped answering: {e}", code="UCL424") from None

    def write(self, step: int, nranks: int, rank: int, fields: dict,
              write: Callable[[CheckpointWriter], None], compress: str | None = None,
              compress_threads: int = 1) -> dict[int, dict]:
        """Called by every process: write this process's rank file (mesh rank ``rank``, negative for
        none) with ``write(writer)`` into its node's folder for ``step``; every node's folder is
        published once every file is durable, with the job's whole manifest. Returns every rank's
        manifest entries (for the copy to the shared root)."""
        final = self.root.path_for(step)
        staged = None
        problem = ""
        if self.nodes.leads:
            try:
                os.makedirs(self.root.root, exist_ok=True)
                staged = TempDir(final)
            except OSError as e:
                problem = f"local tier {self.root.root}: cannot create a temp folder: {e}"
        views = self.gather([staged.path if staged else None, problem])
        try:
            problems = [p for _, p in views if p]
            tmp = views[self.nodes.leader(self.nodes.node)][0]
            entries: dict = {}
            if not problems and rank >= 0:
                try:
                    writer = CheckpointWriter.join(tmp, nranks, write_behind=True, compress=compress,
                                                   compress_threads=compress_threads)
                    write(writer)
                    entries = {str(r): e for r, e in writer.finish([rank]).items()}
                except Exception as e:  # reported to every process
                    problem = f"rank {self.nodes.me}: {e}"
            shared = self.gather([entries, problem, fields["state"].get("rng", {})])
            problems += [p for _, p, _ in shared if p]
            if problems:
                raise StoreError(f"step {step} not written to the local tier: {'; '.join(problems)}", code="UCL410")
            everyone = {int(r): e for g, _, _ in shared for r, e in g.items()}
            committed = ""
            if staged is not None:
                try:
                    self._publish(staged, final, nranks, fields, everyone, [s for _, _, s in shared])
                    staged = None
                except Exception as e:
                    committed = f"node {self.nodes.node}: {e}"
            failed = [c for c in self.gather(committed) if c]
        except BaseException:
            if staged is not None:
                staged.discard()
            raise
        if failed:
            if self.nodes.leads and not committed:  # every part or none: take ours back
                self.root.discard_after(step - 1)
            raise StoreError(f"step {step} not written to the local tier: {'; '.join(failed)}", code="UCL410")
        if self.nodes.leads:
            self.root.set_latest(step)
            self.root.discard_after(step)  # after load(step=k), later steps belong to an abandoned run
            self.root.prune(self.keep)
        return everyone

    def _publish(self, staged: TempDir, final: str, nranks: int, fields: dict, entries: dict[int, dict],
                 rngs: list[dict]) -> None:
        ranks = sorted(r for r in entries if os.path.isfile(os.path.join(staged.path, file_name(r))))
        state = dict(fields["state"])
        state["rng"] = {k: v for s in rngs for k, v in s.items()}
        manifest = Manifest(files=[file_name(r) for r in range(nranks)],
                            datasets=[entries.get(r, {}) for r in range(nranks)], **{**fields, "state": state})
        if any("encoding" in e for es in entries.values() for e in es.values()):
            manifest.version = COMPRESSED_VERSION  # as CheckpointWriter.commit says it
        write_atomic(os.path.join(staged.path, NODE_NAME),
                     json.dumps({"node": self.nodes.node, "ranks": ranks}).encode())
        write_atomic(os.path.join(staged.path, MANIFEST_NAME), manifest.to_json().encode())
        self.root.publish(staged.path, final)
        staged.release()


def copy_to_root(local_path: str, root: CheckpointRoot, step: int, nranks: int, rank: int, fields: dict,
                 entries: dict[int, dict], *, dist=None, group=None) -> str:
    """The step just written locally, copied on to the shared ``root`` (its rank files are copied, not
    written again from memory), committed there as any checkpoint is (collectively when there are
    several processes)."""
    from ..ops.collective import commit_collectively
    path = root.path_for(step)
    state = _manifest_state(local_path)

    def copy(writer: CheckpointWriter) -> dict[int, dict]:
        if rank < 0:
            return {}
        name = file_name(rank)
        shutil.copyfile(os.path.join(local_path, name), os.path.join(writer.tmp_path, name))
        fsync_path(os.path.join(writer.tmp_path, name))
        return {rank: entries[rank]}

    fields = {**fields, "state": state}
    if dist is None:
        with CheckpointWriter(path, nranks, publish=root.publish, **fields) as w:
            for r, e in copy(w).items():
                w.adopt(r, e)
            return w.commit()
    return commit_collectively(path, nranks, fields, copy, group=group, publish=root.publish)


def _manifest_state(path: str) -> Any:
    """The local copy's state (every process's generators merged): the root copy says the same."""
    from ..store.reader import Checkpoint
    with Checkpoint.open(path) as ck:
        return ck.manifest.state
