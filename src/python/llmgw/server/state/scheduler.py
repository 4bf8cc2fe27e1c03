"""Placement: which replicas of which models run on which nodes. A pure function.

`plan(snapshot, catalog, placed)` reads a frozen view of the cluster and the catalog and
returns a `Plan`; it does no I/O and keeps no state, so tests run it in memory and the
reconciler performs what it returns. Rules, in the order they are applied:

- Existing placements are kept while still valid (stable): a restart or an unrelated change
  reshuffles nothing. A placement stops being valid when a node it uses is lost or removed, or
  its model left the catalog or changed engine, GPUs, nodes or memory -- unless it runs an older
  definition of its model (`runs`: a rollout replaces it one replica at a time,
  `llmgw.server.state.rollouts`), which it is judged by. Replicas beyond the catalog's count are
  stopped, newest first.
- New replicas go only on nodes that are joined, not cordoned, not draining, and have the
  model's engine installed and checked; they must fit the node's free GPUs and memory after
  what is already placed there.
- A replica spanning several nodes goes only on nodes that are close (`closeness`): that share
  one fabric (by identity, not by name), or for llama.cpp, whose RPC needs no fabric, else one
  subnet of their addresses. A fabric comes before a subnet, and the fullest group of each kind
  first. Its members are the group's first by the rules below, ranked by speed then the weights
  they hold: rank 0 (which serves, and alone reads llama.cpp's weights) the fastest.
- Replicas of one model spread across nodes: a node already holding one comes last. Replicas
  placed together while no other node was there (nodes join one at a time) are named by
  `crowded`, for the control plane to move with a replacement first (`llmgw.server.state.moves`).
- Among the nodes that fit, the faster first, by the generation speed each node measured for the
  backend a replica would use (`speed_of`: llama.cpp's CPU figure, or its best GPU backend's for a
  model that takes GPUs; agent.bench), after spreading and before the weights already held.
  Figures within SPEED_STEP of each other rank alike (a measurement's noise orders nothing), and a
  node without a figure ranks as the middle of those with one, so that with no figures at all
  placement is as it was.
- A replica that cannot be placed is pending with the reason, e.g.
  "needs 2 nodes on one fabric, 1 available on ib-a"; replicas of one model held back for the
  same reason are one `Pending` with their count.
"""

from __future__ import annotations

import heapq
import math
import statistics
from collections.abc import Collection, Mapping, Sequence

import attrs

from llmgw.config import Model
from llmgw.server.state.closeness import group_kinds, group_name, group_order, groups_of

GIB = 1 << 30
# Speeds within this ratio of each other rank alike: one measurement of one completion, on a node
# doing other things, moves by that much between runs.
SPEED_STEP = 1.25
CPU_BACKEND = "cpu"


@attrs.frozen(kw_only=True)
class NodeView:
    node_id: str
    schedulable: bool  # joined, not cordoned, not draining
    engines: frozenset[str]  # installed and checked here
    gpus: int
    memory_bytes: int
    fabrics: tuple[str, ...] = ()  # placement keys "name@identity"
    alive: bool = True  # False: lost or removed; its replicas are rebuilt elsewhere
    why_not: str = ""  # for pending reasons: "cordoned", "lost", ...
    avoid: frozenset[str] = frozenset()  # models that failed here: place them elsewhere
    gpu_memory_bytes: int = 0  # the smallest of its GPUs' memory (0: no GPU, or not reported)
    holds: frozenset[str] = frozenset()  # the SHA-256 of the whole weights files its cache holds
    # (engine, backend, generated tokens a second) of each backend it measured (agent.bench).
    speeds: tuple[tuple[str, str, float], ...] = ()
    subnet: str = ""  # of the address it is reached at (`closeness.subnet_of`; "": none known)

    def groups(self, model: Model) -> tuple[str, ...]:
        """The groups of close nodes it is in for a replica of `model` over several nodes."""
        return groups_of(model.engine, self.fabrics, self.subnet)


def speed_of(node: NodeView, model: Model) -> float:
    """The generation speed measured on `node` for the backend a replica of `model` would use
    there: the best GPU backend's for a model that takes GPUs, else the CPU's; 0: no figure."""
    mine = [(backend, tps) for engine, backend, tps in node.speeds if engine == model.engine and tps > 0]
    if model.gpus_per_replica:
        return max((tps for backend, tps in mine if backend != CPU_BACKEND), default=0.0)
    return max((tps for backend, tps in mine if backend == CPU_BACKEND), default=0.0)


def speed_ranks(model: Model, nodes: Sequence[NodeView]) -> dict[str, float]:
    """Each node's rank by speed for `model` (lower: faster), in steps of SPEED_STEP; a node
    without a figure takes the median rank of those with one, and with none at all every node
    ranks 0."""
    measured = {n.node_id: speed_of(n, model) for n in nodes}
    ranks = {k: -math.floor(math.log(v) / math.log(SPEED_STEP)) for k, v in measured.items() if v > 0}
    middle = statistics.median(ranks.values()) if ranks else 0
    return {n.node_id: ranks.get(n.node_id, middle) for n in nodes}


@attrs.frozen(kw_only=True)
class Placement:
    replica_id: str
    model: str
    nodes: tuple[str, ...]  # rank order: nodes[0] is rank 0
    gpus_per_node: int = 0
    memory_bytes: int = 0
    engine: str = ""
    fabric: str = ""  # the group key the members share (`closeness`; "" for single-node)


@attrs.frozen(kw_only=True)
class Pending:
    """Replicas of `model` that cannot be placed, all for the same reason: one entry per reason,
    so the reconciler reports each once however many replicas it holds back."""

    model: str
    reason: str
    replicas: int = 1


@attrs.frozen(kw_only=True)
class Plan:
    keep: tuple[Placement, ...]
    start: tuple[Placement, ...]
    stop: tuple[Placement, ...]
    pending: tuple[Pending, ...]

    @property
    def placements(self) -> tuple[Placement, ...]:
        return self.keep + self.start


def _fits(model: Model, placement: Placement) -> bool:
    return (
        placement.engine == model.engine
        and len(placement.nodes) == model.nodes_per_replica
        and placement.gpus_per_node == model.gpus_per_replica
        and placement.memory_bytes == int(model.memory_gb * GIB)
    )


@attrs.define
class _Free:
    gpus: dict[str, int]
    memory: dict[str, int]
    per_model: dict[tuple[str, str], int]  # (model, node) -> replicas

    def take(self, p: Placement) -> None:
        for n in p.nodes:
            self.gpus[n] -= p.gpus_per_node
            self.memory[n] -= p.memory_bytes
            self.per_model[(p.model, n)] = self.per_model.get((p.model, n), 0) + 1


def plan(
    nodes: Sequence[NodeView],
    catalog: Sequence[Model],
    placed: Sequence[Placement],
    reserved: Sequence[Placement] = (),
    runs: Mapping[str, Model] | None = None,
    busy: Collection[str] = (),
) -> Plan:
    """`reserved`: placements outside the catalog's count (a move's replacement, until its
    original stops) that the plan neither keeps nor stops, but whose GPUs, memory and replica
    ids (their slots) no new placement takes. `runs`: by replica id, the older definition of
    its model a placement runs (its model's replicas are being replaced: it counts as one of
    them, and is valid if it fits what it runs). `busy`: replica ids an agent still reports
    though they are no longer placed (one just stopped, whose engine may still say it is ready):
    no new placement takes one, so that a report of the id is always of the replica placed."""
    by_id = {n.node_id: n for n in nodes}
    models = {m.name: m for m in catalog}
    runs = runs or {}
    keep: list[Placement] = []
    stop: list[Placement] = []
    for p in sorted(placed, key=lambda p: p.replica_id):
        model = models.get(p.model)
        shape = runs.get(p.replica_id, model) if model is not None else None
        valid = (
            shape is not None
            and _fits(shape, p)
            and all(n in by_id and by_id[n].alive and shape.engine in by_id[n].engines for n in p.nodes)
        )
        (keep if valid else stop).append(p)
    # Too many replicas of a model (its count went down): stop the newest.
    kept: dict[str, list[Placement]] = {}
    for p in keep:
        kept.setdefault(p.model, []).append(p)
    extra: set[str] = set()
    for name, model in models.items():
        mine = kept.get(name, [])
        for p in sorted(mine, key=replica_slot, reverse=True)[: max(0, len(mine) - model.replicas)]:
            extra.add(p.replica_id)
            stop.append(p)
    if extra:
        keep = [p for p in keep if p.replica_id not in extra]
        kept = {name: [p for p in mine if p.replica_id not in extra] for name, mine in kept.items()}
    free = _Free(
        gpus={n.node_id: n.gpus for n in nodes},
        memory={n.node_id: n.memory_bytes for n in nodes},
        per_model={},
    )
    for p in keep:
        free.take(p)
    reserved_slots: dict[str, set[int]] = {}
    for rid in busy:
        name, _, tail = rid.rpartition("-")
        if tail.isdigit():
            reserved_slots.setdefault(name, set()).add(int(tail))
    for p in reserved:
        reserved_slots.setdefault(p.model, set()).add(replica_slot(p))
        if all(n in by_id for n in p.nodes):
            free.take(p)
    start: list[Placement] = []
    pending: list[Pending] = []
    for model in catalog:
        have = kept.get(model.name, [])
        used_slots = {replica_slot(p) for p in have} | reserved_slots.get(model.name, set())
        missing = model.replicas - len(have)
        if missing <= 0:
            continue
        pool = _Pool(model, nodes, free)
        slot = 0
        for placed_now in range(missing):
            while slot in used_slots:
                slot += 1
            placement = pool.place(f"{model.name}-{slot}")
            if placement is None:
                # Nothing changed since: the rest of this model's replicas fail alike, as one entry.
                pending.append(
                    Pending(model=model.name, reason=_why_not(model, nodes, free), replicas=missing - placed_now)
                )
                break
            used_slots.add(slot)
            free.take(placement)
            start.append(placement)
    return Plan(keep=tuple(keep), start=tuple(start), stop=tuple(stop), pending=tuple(pending))


class _Pool:
    """Where the replicas of one model go, one after another, each as `_candidates` would rank
    them (spread first: fewest replicas of the model on the node, then the faster (`speed_ranks`),
    then the nodes holding its weights, then most free GPUs, then the name) without a pass over every node per replica. The nodes that may run the model at all
    (schedulable, its engine, not failed with it) are found once. A single-node replica takes
    the least node of a heap whose keys are lower bounds of the real ones (a node's count of
    replicas only grows and its free GPUs only shrink within a plan): a node popped with a stale
    key goes back with its real one, a node that no longer fits leaves for good. A replica over
    several nodes counts, per group of close nodes (`closeness`), the nodes that fit now, and
    takes the least of the fullest fabric, else of the fullest subnet (llama.cpp)."""

    def __init__(self, model: Model, nodes: Sequence[NodeView], free: _Free) -> None:
        self.model, self.free = model, free
        self.memory = int(model.memory_gb * GIB)
        self.eligible = [n for n in nodes if n.schedulable and model.engine in n.engines and model.name not in n.avoid]
        # Nodes without the model's weights come after those holding them, other things equal:
        # a replica there downloads nothing (a drain or a failure moves replicas to holders first).
        files = model_files(model)
        self.lacks = {n.node_id: int(bool(files) and not files <= n.holds) for n in self.eligible}
        self.slower = speed_ranks(model, self.eligible)
        self.heap: list[tuple[int, float, int, int, str]] = []
        if model.nodes_per_replica == 1:
            self.heap = [self._key(n.node_id) for n in self.eligible]
            heapq.heapify(self.heap)

    def _key(self, node_id: str) -> tuple[int, float, int, int, str]:
        free = self.free
        return (
            free.per_model.get((self.model.name, node_id), 0),
            self.slower[node_id],
            self.lacks[node_id],
            -free.gpus[node_id],
            node_id,
        )

    def _fits(self, node_id: str) -> bool:
        return self.free.gpus[node_id] >= self.model.gpus_per_replica and self.free.memory[node_id] >= self.memory

    def place(self, replica_id: str) -> Placement | None:
        model = self.model
        if model.nodes_per_replica == 1:
            heap = self.heap
            while heap:
                key = heap[0]
                node_id = key[-1]
                if not self._fits(node_id):
                    heapq.heappop(heap)  # resources only shrink: it will not fit this model again
                    continue
                real = self._key(node_id)
                if real != key:
                    heapq.heapreplace(heap, real)
                    continue
                return Placement(
                    replica_id=replica_id,
                    model=model.name,
                    nodes=(node_id,),
                    gpus_per_node=model.gpus_per_replica,
                    memory_bytes=self.memory,
                    engine=model.engine,
                )
            return None
        by_group: dict[str, list[str]] = {}
        for n in self.eligible:
            if self._fits(n.node_id):
                for g in n.groups(model):
                    by_group.setdefault(g, []).append(n.node_id)
        need = model.nodes_per_replica
        # The fullest fabric, else the fullest subnet: the fullest of a kind too small, so is every other of it.
        for group in sorted(by_group, key=lambda g: (group_order(g), -len(by_group[g]), g)):
            members = by_group[group]
            if len(members) >= need:
                chosen = heapq.nsmallest(need, members, key=self._key)
                return Placement(
                    replica_id=replica_id,
                    model=model.name,
                    nodes=tuple(rank_order(chosen, self.slower, self.lacks)),
                    gpus_per_node=model.gpus_per_replica,
                    memory_bytes=self.memory,
                    engine=model.engine,
                    fabric=group,
                )
        return None


def rank_order(chosen: Sequence[str], slower: Mapping[str, float], lacks: Mapping[str, int]) -> list[str]:
    """The members of a multi-node replica in rank order: the faster first (by `speed_ranks`),
    then those holding the weights, else as chosen. Rank 0 serves the requests and is the one
    node of a llama.cpp replica that reads the weights."""
    return sorted(chosen, key=lambda n: (slower[n], lacks[n]))


def crowded(nodes: Sequence[NodeView], placed: Sequence[Placement]) -> list[str]:
    """Single-node replicas that share their node with another replica of their model while a
    schedulable node holds none of that model: candidates for a spreading move, the newest of
    each crowded node first. Whether a free node can really take one (engine, GPUs, memory) is
    for `plan` to say."""
    by_id = {n.node_id: n for n in nodes}
    holding: dict[str, set[str]] = {}  # model -> nodes holding a replica of it
    groups: dict[tuple[str, str], list[Placement]] = {}
    for p in placed:
        holding.setdefault(p.model, set()).update(p.nodes)
        if len(p.nodes) == 1:
            groups.setdefault((p.model, p.nodes[0]), []).append(p)
    out = []
    for (model, node), group in sorted(groups.items()):
        if len(group) < 2 or not (node in by_id and by_id[node].alive):
            continue
        if not any(n.schedulable and n.node_id not in holding[model] for n in nodes):
            continue
        out.extend(p.replica_id for p in sorted(group, key=replica_slot, reverse=True)[:-1])
    return out


def model_files(model: Model) -> frozenset[str]:
    """The SHA-256 of every weights file a replica of `model` needs (none for a path source)."""
    if model.source.files:
        return frozenset(f.sha256 for f in model.source.files)
    return frozenset({model.source.sha256.lower()}) if model.source.url else frozenset()


def replica_slot(p: Placement) -> int:
    """A replica's number within its model (its id's tail: `model-3` is 3); an id without one sorts last."""
    tail = p.replica_id.rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else 1 << 30


def _candidates(model: Model, nodes: Sequence[NodeView], free: _Free) -> tuple[list[NodeView], str]:
    memory = int(model.memory_gb * GIB)
    ok, reasons = [], []
    for n in nodes:
        if not n.schedulable:
            reasons.append(f"{n.node_id} {n.why_not or 'not schedulable'}")
        elif model.engine not in n.engines:
            reasons.append(f"{n.node_id} has no working {model.engine}")
        elif model.name in n.avoid:
            reasons.append(f"{n.node_id} failed to run it")
        elif free.gpus[n.node_id] < model.gpus_per_replica:
            reasons.append(f"{n.node_id} has {free.gpus[n.node_id]} free GPUs")
        elif free.memory[n.node_id] < memory:
            reasons.append(f"{n.node_id} has {free.memory[n.node_id] / GIB:.1f} GiB free")
        else:
            ok.append(n)
    # Spread: nodes without a replica of this model first; then the faster, those holding its
    # weights, the most free GPUs, the name.
    files = model_files(model)
    # Ranked among every node that may run the model, as `_Pool` ranks them: a node without a
    # figure is the middle of those, whatever fits now.
    slower = speed_ranks(
        model, [n for n in nodes if n.schedulable and model.engine in n.engines and model.name not in n.avoid]
    )
    ok.sort(
        key=lambda n: (
            free.per_model.get((model.name, n.node_id), 0),
            slower[n.node_id],
            int(bool(files) and not files <= n.holds),
            -free.gpus[n.node_id],
            n.node_id,
        )
    )
    return ok, "; ".join(reasons) or "no nodes"


def _why_not(model: Model, nodes: Sequence[NodeView], free: _Free) -> str:
    """Why no further replica of `model` can be placed (`_Pool.place` found nowhere): the
    nodes that are no candidates and why, or for several nodes the fabrics' shortfall."""
    candidates, why = _candidates(model, nodes, free)
    if model.nodes_per_replica == 1:
        return f"needs 1 node with {_needs(model)}, none available ({why})"
    by_group: dict[str, int] = {}
    for n in candidates:
        for g in n.groups(model):
            by_group[g] = by_group.get(g, 0) + 1
    need, kinds = model.nodes_per_replica, group_kinds(model.engine)
    best = max(sorted(by_group), key=lambda g: by_group[g], default=None)
    left_out = f" ({why})" if why != "no nodes" else ""  # why the other nodes are not candidates
    if best is None:
        return f"needs {need} nodes on {kinds}, none of the nodes that fit is on a fabric{left_out}"
    return f"needs {need} nodes on {kinds}, {by_group[best]} available on {group_name(best)}{left_out}"


def _needs(model: Model) -> str:
    parts = [f"working {model.engine}"]
    if model.gpus_per_replica:
        parts.append(f"{model.gpus_per_replica} free GPUs")
    if model.memory_gb:
        parts.append(f"{model.memory_gb:g} GiB free")
    return ", ".join(parts)
