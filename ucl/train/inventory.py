"""What survives, and the newest step that can be put together from it: which steps and which rank
files each node's local folder holds (exchanged over the job's process group), which steps the
shared ``root`` and each further tier hold whole, and, for the step chosen, where each rank file
is read from.

Two copies are the same checkpoint when their manifests list the same datasets with the same
checksums (``ident``): a node that kept a step of an abandoned run (saved again after a rewind)
holds another ident, and parts of two idents are never mixed."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import xxhash

from ..errors import StoreError
from ..store.manifest import Manifest, file_name
from ..store.reader import Checkpoint
from ..store.root import CheckpointRoot
from .lineage import abandoned, authority, of_state
from .local import node_file
from .tiers import RemoteTier, describe

LOCAL, PEER, ROOT = "local", "peer", "root"


def ident_of(manifest: Manifest) -> str:
    """The identity of a checkpoint's content: every rank's datasets and checksums, and its step."""
    step = manifest.state.get("step") if isinstance(manifest.state, dict) else None
    return xxhash.xxh3_64_hexdigest(json.dumps([step, manifest.datasets], sort_keys=True).encode())


def local_holdings(root: CheckpointRoot | None) -> list[list]:
    """``[step, ident, nranks, [ranks whose file is there], lineage]`` of every committed step of a node's
    local folder; a folder that cannot be read (half-written, damaged manifest) is left out."""
    out = []
    if root is None or not os.path.isdir(root.root):
        return out
    for step in root.steps():
        path = root.path_for(step)
        try:
            with Checkpoint.open(path) as ck:
                manifest = ck.manifest
        except (StoreError, OSError):
            continue
        held = node_file(path)
        if held is None:
            continue
        ranks = [r for r in held["ranks"] if isinstance(r, int) and 0 <= r < manifest.nranks
                 and os.path.isfile(os.path.join(path, file_name(r)))]
        out.append([step, ident_of(manifest), manifest.nranks, ranks, of_state(manifest.state)])
    return out


def shared_holdings(tiers: list) -> list[list]:
    """``[tier index, step, ident, nranks, lineage]`` of every committed step of the shared tiers (``root`` is
    index 0, then ``tiers=`` in order); a tier that cannot be read is left out."""
    out = []
    for i, tier in enumerate(tiers):
        try:
            if isinstance(tier, RemoteTier):
                for step in tier.steps():
                    m = Manifest.from_json(tier.manifest_text(step).decode("utf-8"))
                    out.append([i, step, ident_of(m), m.nranks, of_state(m.state)])
            elif os.path.isdir(tier.root):
                for step in tier.steps():
                    with Checkpoint.open(tier.path_for(step)) as ck:
                        out.append([i, step, ident_of(ck.manifest), ck.manifest.nranks, of_state(ck.manifest.state)])
        except (StoreError, OSError, ValueError):
            continue
    return out


@dataclass(frozen=True)
class Choice:
    """The step to restore and where each of its rank files is read from."""
    step: int
    ident: str
    nranks: int
    holders: dict = field(default_factory=dict)  # rank file -> nodes holding it locally, sorted
    shared: int | None = None  # index of the first shared tier holding it whole (0: root)


def choose(nodes_view: list[tuple[int, list]], shared: list[list], step: int | None,
           bad: frozenset = frozenset()) -> Choice | None:
    """The newest step (or ``step``) whose every rank file some copy holds: a node's local folder or
    the first shared tier that holds any (such) step. ``bad``: copies refused earlier (``(node, rank)`` or ``("tier", index)``)."""
    newest = authority([h[4] for _, hs in nodes_view for h in hs] + [h[4] for h in shared])
    nodes_view = [(n, [h for h in hs if not abandoned(h[0], h[4], newest)]) for n, hs in nodes_view]
    shared = [h for h in shared if not abandoned(h[1], h[4], newest)]
    cands: dict[tuple[int, str], dict] = {}
    # root first, each further tier only when the ones before hold no (such) step: a tier ahead of
    # root (root lost its newest) is not what a load of root's newest means
    usable = [h for h in shared if ("tier", h[0]) not in bad and (step is None or h[1] == step)]
    shared = [h for h in usable if h[0] == min(x[0] for x in usable)] if usable else []
    for node, holdings in nodes_view:
        for s, ident, nranks, ranks, _ in holdings:
            c = cands.setdefault((s, ident), {"nranks": nranks, "holders": {}, "shared": None})
            for r in ranks:
                if (node, r) not in bad:
                    c["holders"].setdefault(r, set()).add(node)
    for i, s, ident, nranks, _ in shared:
        if ("tier", i) in bad:
            continue
        c = cands.setdefault((s, ident), {"nranks": nranks, "holders": {}, "shared": None})
        if c["shared"] is None or i < c["shared"]:
            c["shared"] = i
    whole = [(s, c["shared"] is not None, sum(len(h) for h in c["holders"].values()), ident)
             for (s, ident), c in cands.items()
             if (step is None or s == step) and (c["shared"] is not None or len(c["holders"]) == c["nranks"])]
    if not whole:
        return None
    s, _, _, ident = max(whole)  # the newest; of two copies of one step, the one a shared tier holds
    c = cands[(s, ident)]
    return Choice(s, ident, c["nranks"], {r: tuple(sorted(n)) for r, n in c["holders"].items()}, c["shared"])


def steps_seen(nodes_view: list[tuple[int, list]], shared: list[list]) -> list[int]:
    return sorted({h[0] for _, hs in nodes_view for h in hs} | {h[1] for h in shared})


def tier_name(tiers: list, index: int) -> str:
    """How ``bytes_from`` names a shared tier: ``"root"``, or a further tier's path or URL."""
    return ROOT if index == 0 else describe(tiers[index])
