"""Peer replicas (``Checkpointer(local=..., replicas=k)``): once a step is in every node's local
folder, each process sends its rank file to k processes on other nodes, which add it to their own
node's folder for that step, so a lost node's parts are still on the survivors.

Placement: the job's nodes in ascending order, node i's files go to nodes i+1, ..., i+k (cyclically),
to the process of the same position among that node's processes (modulo their number). A file is
then on k + 1 *consecutive* nodes; losing any k nodes cannot take all k + 1, so nothing is lost
(``replicas`` must be below the number of nodes). A replica is written under a temp name, made
durable and renamed into place; the node's ``ucl_node.json`` names it only after that, so a
process killed while replicating leaves the step as it was (and the steps before it untouched)."""
from __future__ import annotations

import json
import os
import time

import numpy as np

from ..errors import StoreError, UclError
from ..ops.dist import initialized_dist
from ..store.atomic import write_atomic
from ..store.manifest import file_name
from .local import NODE_NAME, LocalTier, node_file


def placement(nodes: list[int], k: int) -> dict[int, list[int]]:
    """Node -> the k nodes that receive copies of its files."""
    order = sorted(set(nodes))
    if k >= len(order) and k:
        raise UclError(f"replicas={k} needs more than {k} nodes; the job has {len(order)}", code="UCL430")
    return {n: [order[(i + j) % len(order)] for j in range(1, k + 1)] for i, n in enumerate(order)}


def receivers(of: tuple[int, ...], k: int) -> dict[int, list[int]]:
    """Process -> the k processes (on other nodes) that receive copies of its rank file."""
    places = placement(list(of), k)
    members = {n: [p for p, m in enumerate(of) if m == n] for n in set(of)}
    out = {}
    for p, n in enumerate(of):
        position = members[n].index(p)
        out[p] = [members[t][position % len(members[t])] for t in places[n]]
    return out


def replicate(local: LocalTier, step: int, rank: int, k: int, group, trace=None) -> None:
    """Every process: send this process's rank file of ``step`` (mesh rank ``rank``; negative for
    none) to its receivers, write the copies it receives into its node's folder, then each node's
    leader names them in ``ucl_node.json``. The trace records ``replicated`` when every part has
    1 + k copies."""
    nodes = local.nodes
    if k == 0 or len(nodes.of) == 1:
        return
    t0 = time.perf_counter()
    import torch
    dist = initialized_dist()
    folder = local.root.path_for(step)
    mine = os.path.join(folder, file_name(rank)) if rank >= 0 else None
    size = os.path.getsize(mine) if mine else 0
    views = local.gather([rank, size])
    to = receivers(nodes.of, k)
    ops, keep, incoming = [], [], []
    if mine:
        data = torch.from_numpy(np.fromfile(mine, dtype=np.uint8))
        keep.append(data)
        for q in to[nodes.me]:
            ops.append(dist.isend(data, q, group=group))
    for p, (r, n) in enumerate(views):
        if r >= 0 and nodes.me in to[p]:
            buf = torch.empty(n, dtype=torch.uint8)
            ops.append(dist.irecv(buf, p, group=group))
            incoming.append((r, buf))
    problem, got = "", []
    try:
        for op in ops:
            op.wait()
        for r, buf in incoming:  # durable under a temp name, then renamed into place
            write_atomic(os.path.join(folder, file_name(r)), buf.numpy().tobytes())
            got.append(r)
    except Exception as e:  # reported to every process
        problem = f"rank {nodes.me}: replicating step {step}: {e}"
    done = local.gather([got, problem])
    problems = [p for _, p in done if p]
    if nodes.leads and not problems:
        held = node_file(folder) or {"node": nodes.node, "ranks": []}
        ranks = set(held["ranks"]) | {r for p in nodes.members(nodes.node) for r in done[p][0]}
        write_atomic(os.path.join(folder, NODE_NAME), json.dumps({"node": nodes.node, "ranks": sorted(ranks)}).encode())
    if problems:
        raise StoreError(f"step {step}: not replicated: {'; '.join(problems)}", code="UCL410")
    local.gather(True)  # every node names its copies before the step counts as replicated
    if trace is not None:
        trace.add("replicated", t0, time.perf_counter(), step=step, copies=1 + k,
                  bytes=sum(buf.numel() for _, buf in incoming))
