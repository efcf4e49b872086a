"""Recovery from whatever survives, on any layout: ``Checkpointer.load`` when there is a node-local
tier or further tiers.

Every process lists what its node's local folder holds; the lists (and process rank 0's listing of
``root`` and each further tier) are exchanged over the checkpointer's group; every process then
picks the same step (``inventory.choose``) and compiles the same plans from the saved layout to the
job's. Each box a process needs is read once: from its own node's folder where that holds the
rank file ("local"), else by one process of a node that holds it, which reads and verifies it and
sends it over the group ("peer"), else from the first shared tier that holds the step ("root",
then each further tier by its path or URL). A copy that fails its checksums is left out and the
load is tried again from the other copies."""
from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import StoreError, UclError, code_agrees
from ..ops.dist import allgather_json, initialized_dist
from ..ops.prepare import mesh_of, model_of, plan_between
from ..plan.buffers import Arena
from ..plan.execute import rank_rows
from ..store.manifest import MANIFEST_NAME, DatasetInfo, Manifest, file_name
from ..store.like import ManifestBacked
from ..store.reader import Checkpoint
from ..store.source import StoreSource
from . import restore
from .inventory import LOCAL, PEER, choose, local_holdings, shared_holdings, steps_seen, tier_name
from .lineage import of_state
from .local import LocalTier
from .tiers import RemoteTier

ATTEMPTS = 4  # loads tried, each without the copies the ones before found damaged
PIECE = 32 << 20  # bytes one peer message holds at most (whole boxes): a send starts before all is read


@dataclass(frozen=True)
class LoadReport:
    """What the last ``load()`` restored and from where: ``bytes_from`` maps each source (``"memory"``,
    ``"local"``, ``"peer"``, ``"root"``, a further tier's path or URL) to the bytes the whole job read
    from it; ``parts`` maps each rank file of the checkpoint to where this process would read it;
    ``seconds`` maps each phase of a load from the tiers to this process's wall seconds in it
    (``inventory``, ``manifest``, ``prepare``, ``plan``, ``exchange``, ``read``, ``copy``, ``agree``,
    ``total``)."""
    step: int
    bytes_from: dict = field(default_factory=dict)
    parts: dict = field(default_factory=dict)
    seconds: dict = field(default_factory=dict)


class Assembled(ManifestBacked):
    """A checkpoint whose rank files lie in several places (``CheckpointLike`` for ``load_rank``, which
    reads it through a ``Routed`` source): the manifest, and the opened copy each file is checked in."""

    def __init__(self, path: str, manifest: Manifest, files: dict[int, Checkpoint]):
        self.path, self.manifest, self.files = path, manifest, files
        self.bytes_last_read = 0

    def keys(self, rank: int) -> list[str]:
        return sorted(self.manifest.datasets[rank])

    def info(self, rank: int, key: str) -> DatasetInfo:
        e = self.manifest.datasets[rank].get(key)
        if e is None:
            raise StoreError(f"rank {rank} has no dataset {key!r} in {self.path}", code="UCL408")
        return DatasetInfo.of_entry(e)  # the copies read it; compression fields included, as Checkpoint.info

    def check_files(self, ranks) -> None:
        for r in ranks:  # a peer's files are checked by the peer that reads them
            if r in self.files:
                self.files[r].check_files([r])

    def verify(self, ranks=None) -> list[str]:
        raise StoreError("an assembled checkpoint is verified part by part, where each part is", code="UCL411")

    def _no(self, *a, **k):
        raise StoreError(f"{self.path}: read through its recovery source", code="UCL411")

    read = to_torch = read_flat = read_box = read_runs = _no


@dataclass
class Route:
    name: str  # "local", "peer", "root" or a tier's path or URL
    bad: list  # what to leave out when this copy fails: [node, rank] or ["tier", index]
    source: Any = None  # StoreSource; None for "peer" (boxes received)


class Routed:
    """A plan source reading each source rank from where its route says; counts bytes per route."""

    def __init__(self, routes: dict[int, Route], received: "Transfer"):
        self.routes, self.received = routes, received
        self.bytes_from: dict[str, int] = {}
        self.bytes_read = 0
        self.failed: list | None = None

    def read(self, rank: int, slot, start, size) -> np.ndarray:
        route = self.routes[rank]
        if route.source is None:
            box = self.received.get(_box_key(rank, slot, start, size))
            if box is None:
                raise StoreError(f"rank file {rank}: a box that no peer sent", code="UCL411")
            return box
        return self._counted(route, lambda: route.source.read(rank, slot, start, size))

    def read_into(self, rank: int, slot, start, size, out: np.ndarray) -> bool:
        route = self.routes[rank]
        if route.source is None:
            box = self.received.get(_box_key(rank, slot, start, size))
            if box is None:
                return False
            out[...] = box
            return True
        return self._counted(route, lambda: route.source.read_into(rank, slot, start, size, out))

    def _counted(self, route: Route, read):
        before = route.source.bytes_read
        try:
            return read()
        except StoreError:
            self.failed = route.bad
            raise
        finally:
            n = route.source.bytes_read - before
            self.bytes_from[route.name] = self.bytes_from.get(route.name, 0) + n
            self.bytes_read += n


def _box_key(rank: int, slot, start, size) -> tuple:
    return (rank, slot.key, slot.base, tuple(slot.shape), tuple(int(x) for x in start),
            tuple(int(x) for x in size))


class Recovery:
    """One ``load()`` from the tiers: inventory, choice, transfers, the restore itself."""

    def __init__(self, target: restore.Target, local: LocalTier | None, shared: list, step: int | None,
                 trace=None):
        self.target, self.local, self.shared, self.step, self.trace = target, local, shared, step, trace
        self.world, self.me = target.world, target.rank
        self.group = target.group
        self.scratch: str | None = None  # downloads from a remote tier
        self.lineage: list = []  # of the checkpoint restored (train.lineage)
        self.seconds: dict[str, float] = {}  # phase -> this process's wall seconds (LoadReport.seconds)

    def timed(self, phase: str, t0: float) -> float:
        """Adds the seconds since ``t0`` to ``phase``; returns now."""
        now = time.perf_counter()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - t0
        return now

    def gather(self, value: Any) -> list:
        if self.world == 1:
            return [value]
        try:
            return allgather_json(value, group=self.group)
        except RuntimeError as e:
            raise StoreError(f"load: another process of the job stopped answering: {e}", code="UCL424") from None

    def run(self) -> tuple[tuple[int, Any], LoadReport]:
        t0 = time.perf_counter()
        node = self.local.nodes.node if self.local is not None else -1 - self.me
        mine = local_holdings(self.local.root if self.local is not None else None)
        shared = shared_holdings(self.shared) if self.me == 0 else []
        views = self.gather([node, mine, shared])
        self.node_of = [v[0] for v in views]
        self.nodes_view = [(v[0], v[1]) for v in views]
        shared = views[0][2]
        self.timed("inventory", t0)
        bad: set = set()
        try:
            for _ in range(ATTEMPTS):
                choice = choose(self.nodes_view, shared, self.step, frozenset(bad))
                if choice is None:
                    seen = steps_seen(self.nodes_view, shared)
                    what = "no checkpoint" if self.step is None else f"no checkpoint of step {self.step}"
                    raise StoreError(f"{what} can be assembled from the local folders, {tier_name(self.shared, 0)} "
                                     f"({self.shared[0].root}) and the further tiers; the steps seen: "
                                     f"{', '.join(map(str, seen[-20:])) or 'none'}", code="UCL404")
                result = self.attempt(choice)
                if isinstance(result, tuple):
                    self.timed("total", t0)
                    return result[0], LoadReport(result[1].step, result[1].bytes_from, result[1].parts,
                                                 {k: round(v, 6) for k, v in self.seconds.items()})
                bad |= result
            raise StoreError(f"load: every copy tried failed its checks ({sorted(bad)})", code="UCL404")
        finally:
            if self.scratch is not None:
                shutil.rmtree(self.scratch, ignore_errors=True)

    # ---- one attempt ----------------------------------------------------------------------------
    def attempt(self, choice):
        t0 = time.perf_counter()
        holding = {n for n, hs in self.nodes_view for h in hs if (h[0], h[1]) == (choice.step, choice.ident)}
        mine = self.node_of[self.me] in holding
        opened: list[Checkpoint] = []
        error = ""
        manifest = path = None
        try:
            if mine:
                path = self.local.root.path_for(choice.step)
                opened.append(Checkpoint.open(path))
            elif choice.shared is not None:
                path, ck = self._open_shared(choice, [])
                opened.append(ck)
            if opened:
                manifest = opened[0].manifest
        except (UclError, OSError) as e:
            error = f"process {self.me}: {e}"
        manifest = self._manifest_to_all(choice, holding, manifest)
        self.timed("manifest", t0)
        path = path or f"step {choice.step} (from the nodes' local folders)"
        state: dict = {"failed": None, "bytes": {}, "error": error}

        self.mark = time.perf_counter()

        def read(layout):
            self.timed("prepare", self.mark)  # the optimizer's state made, the layout derived
            return self._read(choice, manifest, path, layout, opened, state)

        restored = None
        try:
            if error:
                raise StoreError(error, code="UCL404")
            restored = restore.from_checkpoint(self.target, path, read=read, manifest=manifest)
            self.timed("copy", self.mark)  # what read_layout did not read in place, and the RNG
        except UclError as e:
            if not state["error"]:
                state["error"], state["code"] = f"process {self.me}: {e}", e.code
            if not state.get("gathered"):  # failed before the exchanges: the others wait in them
                self.gather(None)
            if not state.get("exchanged"):
                self._exchange(None, {}, {}, manifest, state).finish()
        finally:
            for ck in opened:
                ck.close()
        t1 = time.perf_counter()
        outcome = self.gather([state["failed"], state["error"], state["bytes"], state.get("code", "UCL404")])
        self.timed("agree", t1)
        failed = {tuple(f) for f, _, _, _ in outcome if f}
        if failed:
            return failed
        errors = [(e, c) for _, e, _, c in outcome if e]
        if errors:  # the first cause's code (UCL434: another model...), every distinct message
            code = errors[0][1]
            cls = StoreError if code_agrees(StoreError, code) else UclError
            raise cls("; ".join(list(dict.fromkeys(e for e, _ in errors))[:3]), code=code)
        total: dict[str, int] = {}
        for _, _, b, _ in outcome:
            for k, v in b.items():
                total[k] = total.get(k, 0) + v
        self.lineage = of_state(manifest.state)
        if self.trace is not None:
            self.trace.add("restore", t0, time.perf_counter(), step=choice.step, bytes_from=total)
        return restored, LoadReport(choice.step, total, dict(state.get("parts", {})))

    def _open_shared(self, choice, ranks: list[int]) -> tuple[str, Checkpoint]:
        tier = self.shared[choice.shared]
        if not isinstance(tier, RemoteTier):
            path = tier.path_for(choice.step)
            return path, Checkpoint.open(path)
        # a remote tier: the manifest and the rank files this process reads, downloaded once
        self.scratch = self.scratch or tempfile.mkdtemp(prefix="ucl-recover-")
        folder = os.path.join(self.scratch, f"step_{choice.step}")
        os.makedirs(folder, exist_ok=True)
        for name in [MANIFEST_NAME] + [file_name(r) for r in ranks]:
            if not os.path.exists(os.path.join(folder, name)):
                tier.get(choice.step, name, os.path.join(folder, name))
        return folder, Checkpoint.open(folder)

    def _manifest_to_all(self, choice, holding: set, manifest: Manifest | None) -> Manifest:
        """The chosen step's manifest on every process: a process whose node holds no copy (and no shared
        tier does) receives it from the first process of a node that holds one."""
        needs = [p for p, n in enumerate(self.node_of) if n not in holding]
        if choice.shared is not None or not needs or self.world == 1:
            return manifest
        src = min(p for p, n in enumerate(self.node_of) if n in holding)
        import torch
        dist = initialized_dist()
        data = manifest.to_json().encode() if self.me == src else b""
        n = torch.tensor([len(data)], dtype=torch.int64)
        dist.broadcast(n, src, group=self.group)
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if self.me == src else \
            torch.empty(int(n.item()), dtype=torch.uint8)
        dist.broadcast(buf, src, group=self.group)
        return manifest if self.me == src else Manifest.from_json(bytes(buf.numpy()).decode("utf-8"))

    def _route(self, choice, p: int, r: int) -> tuple[str, int | None]:
        """Where process ``p`` reads rank file ``r``: ("local", p), ("peer", the holder), or ("shared", None)."""
        hs = choice.holders.get(r, ())
        if self.node_of[p] in hs:
            return LOCAL, p
        if hs:
            node = hs[r % len(hs)]
            members = [q for q, n in enumerate(self.node_of) if n == node]
            return PEER, members[r % len(members)]
        return "shared", None

    def _read(self, choice, manifest: Manifest, path: str, layout, opened: list, state: dict):
        """Every process: the plans of every process's rank, the boxes sent to peers, then this
        process's own load through a ``Routed`` source."""
        t0 = time.perf_counter()
        model = self.target.layouts.model_of(layout)
        tr = restore.reads(layout)
        trs = self.gather(tr)
        state["gathered"] = True
        ck = Assembled(path, manifest, {})
        src_model, src_mesh = model_of(ck), mesh_of(ck)
        plans: dict[int, Any] = {}

        def rows_of(p: int):
            t = trs[p]
            if t is None:
                return None, []
            if t not in plans:
                plans[t] = plan_between(src_model, src_mesh, model, layout.mesh, ranks=[t])
            plan = plans[t]
            return plan, rank_rows(plan, t)

        home = opened[0] if opened and self.local is not None and self.node_of[self.me] in {
            n for n, hs in self.nodes_view for h in hs if (h[0], h[1]) == (choice.step, choice.ident)} else None
        routes: dict[int, Route] = {}
        need_shared = []
        parts = {}
        for r in range(manifest.nranks):
            how, who = self._route(choice, self.me, r)
            if how == LOCAL:
                routes[r] = Route(LOCAL, [self.node_of[self.me], r], StoreSource(home, Arena()))
                ck.files[r] = home
            elif how == PEER:
                routes[r] = Route(PEER, [self.node_of[who], r])
            else:
                need_shared.append(r)
            parts[str(r)] = how if how != "shared" else tier_name(self.shared, choice.shared)
        state["parts"] = parts
        if need_shared and tr is not None and not state["error"]:
            try:
                plan, rows = rows_of(self.me)
                wanted = sorted({int(x) for x in plan.copies["src_rank"][rows]} & set(need_shared))
                tier = self.shared[choice.shared]
                if not isinstance(tier, RemoteTier) and home is None and opened:
                    shared_ck = opened[0]  # the shared copy this process opened for the manifest
                else:
                    _, shared_ck = self._open_shared(choice, wanted)
                    opened.append(shared_ck)
                name = tier_name(self.shared, choice.shared)
                for r in need_shared:
                    routes[r] = Route(name, ["tier", choice.shared], StoreSource(shared_ck, Arena()))
                    ck.files[r] = shared_ck
            except (UclError, OSError) as e:
                state["error"] = f"process {self.me}: {e}"
        # boxes this process sends to peers, and those it receives
        sends: dict[int, list] = {}
        recvs: dict[int, list] = {}
        for p in range(self.world):
            if p != self.me and not any(self._route(choice, p, r) == (PEER, self.me) for r in range(manifest.nranks)):
                continue  # p reads nothing from this process: its plan is not compiled here
            plan, rows = rows_of(p)
            if plan is None:
                continue
            c = plan.copies
            for i in rows:
                r = int(c["src_rank"][i])
                how, who = self._route(choice, p, r)
                if how != PEER or (who != self.me and p != self.me):
                    continue
                slot = plan.slots[c["src_slot"][i]]
                box = (r, slot, c["src_start"][i], c["size"][i])
                (sends.setdefault(p, []) if who == self.me else recvs.setdefault(who, [])).append(box)
        t0 = self.timed("plan", t0)
        transfer = self._exchange(home, sends, recvs, manifest, state)
        t0 = self.timed("exchange", t0)
        routed = Routed(routes, transfer)
        try:
            if state["error"] or state["failed"]:
                raise StoreError(state["error"] or "a peer's copy failed its checks", code="UCL404")
            # this process's own reads go on while the peers' boxes are on the wire
            return restore.read_layout(self.target.layouts, ck, layout, source=routed)
        finally:
            t0 = self.timed("read", t0)
            transfer.finish()  # every message sent and received before the next collective
            self.mark = self.timed("exchange", t0)
            state["failed"] = state["failed"] or routed.failed
            for k, v in routed.bytes_from.items():
                state["bytes"][k] = state["bytes"].get(k, 0) + v

    def _exchange(self, home, sends: dict, recvs: dict, manifest, state: dict) -> "Transfer":
        """Start receiving the boxes this process reads from others, then read and send every peer
        the boxes it reads from this node (point to point over the group, in pieces of at most
        ``PIECE`` bytes, each sent as soon as it is read). Returns at once: the receives complete
        while this process reads its own boxes (``Transfer.get`` waits for a box's piece). A box that
        fails its checksums here is sent as zeros and reported (the load is tried again without this copy)."""
        state["exchanged"] = True
        transfer = Transfer(manifest)
        if self.world == 1:
            return transfer
        import torch
        dist = initialized_dist()
        if state["error"]:  # this process cannot take part: it says so, the others give up too
            sends, recvs = {}, {}
        flags = self.gather(bool(state["error"]))
        if any(flags):
            state["error"] = state["error"] or "another process failed before the transfer"
            return transfer
        for q, boxes in sorted(recvs.items()):
            for piece, n in _pieces(boxes, manifest):  # (empty boxes: no message, as the sender's)
                buf = torch.empty(n, dtype=torch.uint8)
                transfer.expect(piece, buf, dist.irecv(buf, q, group=self.group) if n else None)
        source = StoreSource(home, Arena()) if home is not None and sends else None
        for p, boxes in sorted(sends.items()):
            for piece, n in _pieces(boxes, manifest):
                buf = np.empty(n, dtype=np.uint8)
                at = 0
                for (r, slot, start, size), k in piece:
                    view = buf[at:at + k].view(_dtype(manifest, r, slot.key)).reshape(tuple(int(x) for x in size))
                    try:
                        if not source.read_into(r, slot, start, size, view):
                            view[...] = np.asarray(source.read(r, slot, start, size)).reshape(view.shape)
                    except StoreError:
                        state["failed"] = state["failed"] or [self.node_of[self.me], r]
                        buf[at:at + k] = 0
                    at += k
                if n:
                    t = torch.from_numpy(buf)
                    transfer.sending(t, dist.isend(t, p, group=self.group))
        if source is not None and source.bytes_read:
            state["bytes"][PEER] = state["bytes"].get(PEER, 0) + source.bytes_read
        return transfer


class Transfer:
    """The peer messages of one load in flight: ``get`` waits for the piece holding a box (and
    unpacks it), ``finish`` for every message, sent or received."""

    def __init__(self, manifest: Manifest):
        self.manifest = manifest
        self.works: list = []  # (work, buffer kept alive until it completes)
        self.pieces: list = []  # (work, buffer, boxes), unpacked on first use
        self.where: dict = {}  # box key -> index into pieces
        self.boxes: dict = {}  # box key -> array

    def expect(self, piece: list, buf, work) -> None:
        for b, _ in piece:
            self.where[_box_key(*b)] = len(self.pieces)
        self.pieces.append((work, buf, piece))
        if work is not None:
            self.works.append((work, buf))

    def sending(self, buf, work) -> None:
        self.works.append((work, buf))

    def get(self, key: tuple) -> np.ndarray | None:
        box = self.boxes.get(key)
        if box is None and key in self.where:
            i = self.where[key]
            work, buf, piece = self.pieces[i]
            if work is not None:  # a gloo work is waited for once: a second wait blocks
                work.wait()
                self.works = [(w, b) for w, b in self.works if w is not work]
                self.pieces[i] = (None, buf, piece)
            raw, at = buf.numpy(), 0
            for (r, slot, start, size), n in piece:
                self.boxes[_box_key(r, slot, start, size)] = raw[at:at + n].view(
                    _dtype(self.manifest, r, slot.key)).reshape(tuple(int(x) for x in size))
                at += n
            box = self.boxes.get(key)
        return box

    def finish(self) -> None:
        for work, _ in self.works:
            work.wait()
        self.works = []


def _pieces(boxes: list, manifest: Manifest) -> list:
    """The distinct boxes in messages of at most ``PIECE`` bytes (a bigger box alone): ``(piece, bytes)``
    with ``piece`` a list of ``(box, bytes)``; sender and receiver cut the same list the same way."""
    out, cur, n = [], [], 0
    for b in _unique(boxes):
        k = int(np.prod(b[3], dtype=np.int64)) * _dtype(manifest, b[0], b[1].key).itemsize
        if cur and n + k > PIECE:
            out.append((cur, n))
            cur, n = [], 0
        cur.append((b, k))
        n += k
    if cur:
        out.append((cur, n))
    return out


def _unique(boxes: list) -> list:
    seen, out = set(), []
    for b in boxes:
        k = _box_key(*b)
        if k not in seen:
            seen.add(k)
            out.append(b)
    return out


def _dtype(manifest: Manifest, rank: int, key: str) -> np.dtype:
    return np.dtype(Assembled("", manifest, {}).info(rank, key).storage_dtype)
