"""What the control plane shows: the admin API's views of nodes, replicas and models, and the
gateway's rotation. Pure functions of the registry, the placements and the catalog; `now` is
the trio clock's, given by the caller.

Two of the control plane's roles are the small objects at the end, each reading what it shows
at each call: `ClusterViews`, what the admin API and the cluster page's feed show
(`llmgw.server.admin.pagefeed.Views`), and `GatewayEndpoints`, the gateway's rotation
(`llmgw.gateway.app.EndpointProvider`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any

import trio

from llmgw.config import EnginesSection, Model, ServerConfig
from llmgw.engines import SPECS, cpubackend
from llmgw.engines.wants import gpu_verdicts
from llmgw.fabrics import FabricMap, fabric_map
from llmgw.gateway.routing import LEAST_OUTSTANDING, PREFIX, Endpoint, Rotation
from llmgw.server.state.changes import Changes
from llmgw.server.state.drains import DrainProgress
from llmgw.server.state.registry import JOINED, LOST, UNKNOWN, Node, NodeRegistry, Session
from llmgw.server.state.replicas import Replicas, Stored
from llmgw.wire import agent_link as w
from llmgw.wire import gateway_link as g

VIEW_BATCH = 200  # node views made between yields to the loop (`Views.node_page`)


def cluster_fabrics(registry: NodeRegistry) -> FabricMap:
    """The cluster's fabrics as placement sees them: by name and identity, with notes."""
    return fabric_map({n.node_id: n.inventory.fabrics for n in registry.nodes.values() if n.inventory})


def node_views(
    registry: NodeRegistry, drains: Mapping[str, DrainProgress], now: float, engines: EnginesSection | None = None
) -> list[dict[str, Any]]:
    return [listed_view(n, registry, drains, now, engines) for _, n in sorted(registry.nodes.items())]


def listed_view(
    node: Node, registry: NodeRegistry, drains: Mapping[str, DrainProgress], now: float, engines: EnginesSection | None
) -> dict[str, Any]:
    """A node as the admin API lists it: its view and its drain, if one is under way."""
    view = node_view(node, registry.liveness(node, now), now, engines)
    drain = drains.get(node.node_id)
    view["drain"] = drain.view() if drain else None
    return view


def _eligibility(inv: w.Inventory | None, engines: EnginesSection | None) -> list[dict[str, Any]]:
    """The control plane's verdicts for the GPU engines server.toml asks for (what decided whether
    the node was asked to install them); without the config, what the agent judged itself."""
    if inv is None:
        return []
    verdicts = gpu_verdicts(engines, inv) if engines is not None else inv.engine_eligibility
    return [{"engine": e.engine, "status": e.status, "reason": e.reason} for e in verdicts]


def engine_view(e: w.EngineStatus, inv: w.Inventory | None = None) -> dict[str, Any]:
    """An engine as the node reports it; `state` is "ok", "failed", "unavailable" or "installing"
    (with phase and percent). llama.cpp's `cpu_backend` is the one it loads on the node, and
    `cpu_note` what that costs there and the fix ("" when it is a good one)."""
    state = e.state or (w.ENGINE_OK if e.ok else w.ENGINE_FAILED)  # an agent older than `state`
    note = (
        cpubackend.note(e.cpu_backend, arch=inv.arch, cpu_model=inv.cpu_model, cpu_flags=inv.cpu_flags)
        if inv is not None and e.cpu_backend
        else ""
    )
    return {
        "name": e.name,
        "version": e.version,
        "ok": e.ok,
        "detail": e.detail,
        "state": state,
        "phase": e.phase if state == w.ENGINE_INSTALLING else "",
        "percent": e.percent if state == w.ENGINE_INSTALLING else None,
        "cpu_backend": e.cpu_backend,
        "cpu_note": note,
    }


def node_view(node: Node, state: str, now: float, engines: EnginesSection | None = None) -> dict[str, Any]:
    s = node.session
    inv = node.inventory
    hello = s.hello if s else None
    return {
        "id": node.node_id,
        "state": state,
        "cordoned": node.cordoned,
        "draining": node.draining,
        "connected": bool(s and s.connected),
        "address": node.address,
        "agent_version": hello.agent_version if hello else None,
        "agent_started_at": hello.started_at if hello else None,
        "last_heartbeat_age_s": round(now - s.last_heartbeat_at, 3) if s and s.last_heartbeat_at is not None else None,
        "cpu": {"model": inv.cpu_model, "cores": inv.cpu_cores, "flags": list(inv.cpu_flags)} if inv else None,
        "arch": inv.arch if inv else None,
        "memory_total_bytes": inv.memory_total_bytes if inv else None,
        "gpus": [{"index": g.index, "name": g.name, "memory_total_mib": g.memory_total_mib} for g in inv.gpus]
        if inv
        else [],
        "gpu_status": inv.gpu_status if inv else None,
        "gpu_detail": inv.gpu_detail if inv else "",
        "eligibility": _eligibility(inv, engines),
        "fabric_problems": list(inv.fabric_problems) if inv else [],
        "disk_free_bytes": inv.disk_free_bytes if inv else None,
        "fabrics": [{"name": f.name, "identity": f.identity, "adapters": list(f.adapters)} for f in inv.fabrics]
        if inv
        else [],
        "engines": [engine_view(e, inv) for e in node.engines],
        "replicas": [{"replica": r.replica_id, "rank": r.node_rank, "state": r.state} for r in node.replicas],
        "cert_serial": f"{s.cert_serial:x}" if s else None,
        "cert_not_after": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(s.cert_not_after)) if s else None,
        "cert_expires_in_days": round((s.cert_not_after - time.time()) / 86400, 1) if s else None,
    }


def replica_views(registry: NodeRegistry, replicas: Replicas) -> list[dict[str, Any]]:
    """Each placed replica with what its members report, then what could not be placed."""
    reported = {(s.replica_id, node.node_id): s for node in registry.nodes.values() for s in node.replicas}
    out = [
        replica_view(rid, stored, [reported.get((rid, n)) for n in stored.placement.nodes])
        for rid, stored in sorted(replicas.placed.items())
    ]
    return out + pending_views(replicas)


async def replica_views_sliced(registry: NodeRegistry, replicas: Replicas) -> list[dict[str, Any]]:
    """`replica_views`, made VIEW_BATCH at a time with the loop free between (ten thousand
    replicas are tens of milliseconds of views)."""
    reported = {(s.replica_id, node.node_id): s for node in registry.nodes.values() for s in node.replicas}
    placed = sorted(replicas.placed.items())
    out: list[dict[str, Any]] = []
    for start in range(0, len(placed), VIEW_BATCH):
        if start:
            await trio.lowlevel.checkpoint()
        out += (
            replica_view(rid, stored, [reported.get((rid, n)) for n in stored.placement.nodes])
            for rid, stored in placed[start : start + VIEW_BATCH]
        )
    return out + pending_views(replicas)


def replica_view(rid: str, stored: Stored, members: Sequence[w.ReplicaStatus | None]) -> dict[str, Any]:
    """A placed replica with what each member (in rank order; None: nothing reported) says."""
    p = stored.placement
    states = [m.state if m else "assigned" for m in members]
    rank0 = members[0]
    return {
        "replica": rid,
        "model": p.model,
        "engine": p.engine,
        "nodes": list(p.nodes),
        "state": states[0] if len(set(states)) == 1 else ",".join(states),
        "member_states": states,
        "port": rank0.port if rank0 else 0,
        "pids": [m.pid if m else 0 for m in members],  # per member, on its node; 0 while none runs
        "restarts": sum(m.restarts for m in members if m),
        "detail": "; ".join(m.detail for m in members if m and m.detail),
        "fabric": p.fabric,
    }


def pending_views(replicas: Replicas) -> list[dict[str, Any]]:
    """A row per replica the scheduler holds back, as ctl counts them."""
    out = []
    for pend in replicas.pending:
        row = {"replica": None, "model": pend.model, "state": "pending", "detail": pend.reason, "nodes": []}
        out.extend(dict(row) for _ in range(pend.replicas))
    return out


def model_views(models: Sequence[Model], replica_views: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Each catalog model with its ready replicas and why any is pending; one pass over the
    replicas (there may be ten thousand), not one per model."""
    ready: dict[str, int] = {}
    pending: dict[str, list[str]] = {}
    for v in replica_views:
        if v["state"] == w.READY:
            ready[v["model"]] = ready.get(v["model"], 0) + 1
        elif v["state"] == "pending":
            pending.setdefault(v["model"], []).append(v["detail"])
    return [
        {
            "model": m.name,
            "engine": m.engine,
            "replicas": m.replicas,
            "ready": ready.get(m.name, 0),
            "pending": pending.get(m.name, []),
            "gpus_per_replica": m.gpus_per_replica,
            "nodes_per_replica": m.nodes_per_replica,
        }
        for m in models
    ]


def gateway_rotation(
    registry: NodeRegistry,
    replicas: Replicas,
    models: Sequence[Model],
    retiring: Collection[str],
    now: float,
    created: Mapping[str, float] | None = None,
) -> Rotation:
    """The catalog's models and, for each placed replica whose rank 0 reports ready with a
    port on a node not lost, where the gateway reaches it and with which key. A replica on
    a draining node, or being retired by a move, is marked draining: no new requests while
    another replica can take them.

    A replica whose rank 0 is on a node known from before this control plane started and not
    back yet (`UNKNOWN`: agents return on their own backoff, up to 30 s apart) is `unknown`:
    the control plane cannot say where it listens, but its engine most likely runs on, so a
    gateway that served it keeps it until its node returns or is lost."""
    endpoints = []
    unknown = set()
    for rid, stored in sorted(replicas.placed.items()):
        p = stored.placement
        rank0 = registry.nodes.get(p.nodes[0])
        if rank0 is not None and registry.liveness(rank0, now) == UNKNOWN:
            unknown.add(rid)
            continue
        if rank0 is None or not rank0.address or registry.liveness(rank0, now) == LOST:
            continue
        status = next((s for s in rank0.replicas if s.replica_id == rid and s.node_rank == 0), None)
        if status is None or status.state != w.READY or not status.port:
            continue
        draining = rid in retiring or any((n := registry.nodes.get(m)) is not None and n.draining for m in p.nodes)
        endpoints.append(
            Endpoint(
                replica_id=rid,
                model=p.model,
                host=rank0.address,
                port=status.port,
                api_key=stored.api_key,
                draining=draining,
                events_port=status.events_port,
            )
        )
    details = model_details(registry, replicas, models, endpoints, unknown, now, created or {})
    return Rotation(
        models=frozenset(m.name for m in models),
        endpoints=tuple(endpoints),
        unknown=frozenset(unknown),
        details=details,
    )


# Retry-After of a model none of whose replicas can become ready: nothing says when one will
# (a node to join, an operator to act), so the client is asked to come back in a while.
UNSERVABLE_RETRY_AFTER_S = 30
_ON_THE_WAY = frozenset({w.FETCHING, w.STARTING, w.RESTARTING, w.READY})


def model_details(
    registry: NodeRegistry,
    replicas: Replicas,
    models: Sequence[Model],
    endpoints: Sequence[Endpoint],
    unknown: Collection[str],
    now: float,
    created: Mapping[str, float],
) -> tuple[g.ModelInfo, ...]:
    """Each catalog model's `ModelInfo`: its engine's routes for its args, when it entered the
    catalog, and why no replica of it can become ready, if none can. One can while one is ready,
    or placed on a node not lost and not failed there (assigned, fetching, starting, restarting),
    or its state is not known yet, or a node is on its way (connected or expected back, not ready
    yet: it may take the model), or a node is installing its engine; else the reason is the scheduler's (nothing fits), or its nodes
    being lost."""
    ready = {e.model for e in endpoints}
    coming: set[str] = set()
    lost: dict[str, set[str]] = {}
    for rid, stored in replicas.placed.items():
        p = stored.placement
        if rid in unknown:
            coming.add(p.model)
            continue
        rank0 = registry.nodes.get(p.nodes[0])
        gone = [n for n in p.nodes if (node := registry.nodes.get(n)) is None or registry.liveness(node, now) == LOST]
        if gone:
            lost.setdefault(p.model, set()).update(gone)
            continue
        status = next((s for s in rank0.replicas if s.replica_id == rid and s.node_rank == 0), None) if rank0 else None
        if status is None or status.state in _ON_THE_WAY:
            coming.add(p.model)
    forming = replicas.nodes_on_their_way(now)
    # An engine a node is installing now may take a model nothing else can: it is on its way.
    installing = {
        e.name
        for n in registry.nodes.values()
        if registry.liveness(n, now) != LOST
        for e in n.engines
        if e.state == w.ENGINE_INSTALLING
    }
    pending: dict[str, str] = {}
    for pend in replicas.pending:
        pending.setdefault(pend.model, pend.reason)
    out = []
    for m in models:
        why = ""
        if m.name not in ready and m.name not in coming and not forming and m.engine not in installing:
            if m.name in pending:
                why = f"no replica can be placed: {pending[m.name]}"
            elif m.name in lost:
                why = f"the nodes of its replicas are lost: {', '.join(sorted(lost[m.name]))}"
            elif m.replicas == 0:
                why = "the catalog asks for no replica of it (replicas = 0)"
            else:
                why = "none of its replicas runs"
        spec = SPECS.get(m.engine)
        out.append(
            g.ModelInfo(
                name=m.name,
                engine=m.engine,
                routes=spec.routes(m.args) if spec is not None else (),
                created=int(created.get(m.name, 0)),
                unservable=why,
                retry_after_s=UNSERVABLE_RETRY_AFTER_S if why else 0,
                routing=routing_of(m),
            )
        )
    return tuple(out)


def routing_of(m: Model) -> str:
    """How the gateway routes `m`'s requests: the catalog's `routing`, else by prefix where its
    engine keeps a prefix cache."""
    if m.routing:
        return m.routing
    spec = SPECS.get(m.engine)
    return PREFIX if spec is not None and spec.prefix_cache else LEAST_OUTSTANDING


# -- the cluster page's feed ---------------------------------------------------------------
# The feed (`llmgw.server.admin.pagefeed`) keeps each node's and replica's view encoded, with what it was
# made of, and makes it again only when that changed. What a view is made of: the objects the
# control plane replaces whenever they change (the hello, the inventory, the tuples of engines
# and replicas a node reports, a placement, the engines' section of the configuration), which a
# tuple comparison matches by identity before it compares values, and a copy of everything that
# changes in place (liveness, cordon, drain, the link's state). A joined node's heartbeat is not
# among them: it only moves the node's deadline, so heartbeats alone never change the page.


def cpu_warning(cpu: Mapping[str, Any] | None) -> str:
    """What `llmgw doctor` says of a generic virtual CPU (its rules, llmgw.engines.cpubackend), from
    what the node reported: its model name, or x86 flags without AVX2/FMA."""
    if not cpu:
        return ""
    model, flags = cpu.get("model") or "", set(cpu.get("flags") or ())
    generic = bool(cpubackend.virtual_model(model))
    x86 = bool(flags & {"sse2", "lm", "fpu"})
    lacking = cpubackend.missing_x86(flags)
    if generic or (x86 and lacking):
        missing = f" (no {', '.join(lacking)})" if x86 and lacking else ""
        return (
            f"generic virtual CPU {model!r}{missing}: llama.cpp runs its slow scalar code; give the VM the host's "
            "CPU model (Proxmox: `qm set VMID --cpu host`), see `llmgw doctor`"
        )
    return ""


def _cert_days(s: Session | None, wall: float) -> float | None:
    return round((s.cert_not_after - wall) / 86400, 1) if s else None


def page_node_inputs(
    node: Node, state: str, wall: float, engines: EnginesSection | None, drain: DrainProgress | None
) -> tuple[Any, ...]:
    """What `page_node_view` makes the node's view of (see above). Keep it in step with
    `node_view`: tests/llmgw/server/test_feed.py checks the feed against views made afresh after
    every kind of change."""
    s = node.session
    return (
        state,
        node.cordoned,
        node.draining,
        node.address,
        s.connected if s else None,
        s.last_heartbeat_at if s and state != JOINED else None,
        s.hello if s else None,
        (s.cert_serial, s.cert_not_after) if s else None,
        _cert_days(s, wall),
        node.inventory,
        node.engines,
        node.replicas,
        engines,
        drain.view() if drain else None,
    )


def page_node_view(
    node: Node, state: str, now: float, engines: EnginesSection | None, drain: DrainProgress | None
) -> dict[str, Any]:
    """A node as the cluster page shows it: its admin view (`node_view`) and its drain, but
    instead of the heartbeat's age, which changes at every heartbeat, `heard_at`: when the last
    one came (liveness time, the clock of the frame's `now`) for a node that is not joined, None
    for a joined one (its heartbeats are on time); and instead of the CPU's flags, which only
    `llmgw doctor`'s rule reads, its `cpu_warning`."""
    view = node_view(node, state, now, engines)
    s = node.session
    del view["last_heartbeat_age_s"]
    view["heard_at"] = s.last_heartbeat_at if s and state != JOINED else None
    if view["cpu"] is not None:
        view["cpu_warning"] = cpu_warning(view["cpu"])
        del view["cpu"]["flags"]
    else:
        view["cpu_warning"] = ""
    view["drain"] = drain.view() if drain else None
    return view


Item = tuple[tuple[Any, ...], Callable[[], dict[str, Any]]]  # what a view is made of, and how to make it


class PageLook:
    """One look at the cluster for the cluster page's feed (`llmgw.server.admin.pagefeed.Look`): the nodes
    and placed replicas by id, each item with what its view is made of. Taken at one time; an
    item gone since is None."""

    def __init__(
        self,
        registry: NodeRegistry,
        replicas: Replicas,
        drains: Mapping[str, DrainProgress],
        engines: EnginesSection | None,
        fabrics_of: Callable[[dict[str, tuple[w.Fabric, ...]]], FabricMap] = fabric_map,
    ) -> None:
        """`fabrics_of`: the fabric map of the nodes' reports (`ClusterViews` keeps the last)."""
        self._registry, self._replicas, self._drains, self._engines = registry, replicas, drains, engines
        self._fabrics_of = fabrics_of
        self._fabric_reports: dict[str, tuple[w.Fabric, ...]] = {}  # as the nodes are looked at, in order
        self.now = registry.clock.now()
        self._wall = time.time()
        self.node_ids = sorted(registry.nodes)
        self.replica_ids = sorted(replicas.placed)
        # Each node's reports by replica, made when a replica first asks: every report is looked
        # at once per look, however many replicas a node runs.
        self._reports: dict[str, dict[str, w.ReplicaStatus]] = {}

    def node(self, node_id: str) -> Item | None:
        node = self._registry.nodes.get(node_id)
        if node is None:
            return None
        state, drain, engines = self._registry.liveness(node, self.now), self._drains.get(node_id), self._engines
        if node.inventory is not None:
            self._fabric_reports[node_id] = node.inventory.fabrics
        inputs = page_node_inputs(node, state, self._wall, engines, drain)
        return inputs, lambda: page_node_view(node, state, self.now, engines, drain)

    def replica(self, replica_id: str) -> Item | None:
        stored = self._replicas.placed.get(replica_id)
        if stored is None:
            return None
        members = tuple(self._report(n, replica_id) for n in stored.placement.nodes)
        return (stored, members), lambda: replica_view(replica_id, stored, members)

    def _report(self, node_id: str, replica_id: str) -> w.ReplicaStatus | None:
        reports = self._reports.get(node_id)
        if reports is None:
            node = self._registry.nodes.get(node_id)
            reports = self._reports[node_id] = {s.replica_id: s for s in node.replicas} if node else {}
        return reports.get(replica_id)

    def pending(self) -> list[dict[str, Any]]:
        return pending_views(self._replicas)

    def fabrics(self) -> FabricMap:
        """The fabrics of the nodes looked at (`cluster_fabrics`, once every node was)."""
        return self._fabrics_of(self._fabric_reports)


# -- the roles ------------------------------------------------------------------------------


class ClusterViews:
    """What the admin API and the cluster page show of the cluster, and when it may have changed."""

    def __init__(
        self,
        *,
        registry: NodeRegistry,
        replicas: Replicas,
        drains: Mapping[str, DrainProgress],
        config: Callable[[], ServerConfig],
        changes: Changes,
    ) -> None:
        """`config()`: the running configuration (a reload replaces it)."""
        self.registry = registry
        self.replicas = replicas
        self.drains = drains
        self.config = config
        self.changes = changes
        self._last_fabrics: tuple[dict[str, tuple[w.Fabric, ...]], FabricMap] | None = None

    def node_views(self) -> list[dict[str, Any]]:
        return node_views(self.registry, self.drains, self.registry.clock.now(), self.config().engines)

    async def node_page(
        self, *, limit: int | None = None, after: str = "", state: str = ""
    ) -> tuple[list[dict[str, Any]], str | None]:
        """The nodes by id after `after`, in `state` if given, at most `limit` of them (None:
        all), and the id the next page starts after (None: this is the last). Made a batch at a
        time, yielding between batches: thousands of nodes do not hold the loop."""
        now = self.registry.clock.now()
        chosen: list[Node] = []
        more = False
        for node_id in sorted(self.registry.nodes):
            if node_id <= after:
                continue
            node = self.registry.nodes[node_id]
            if state and self.registry.liveness(node, now) != state:
                continue
            if limit is not None and len(chosen) == limit:
                more = True
                break
            chosen.append(node)
        engines = self.config().engines
        views: list[dict[str, Any]] = []
        for start in range(0, len(chosen), VIEW_BATCH):
            if start:
                await trio.lowlevel.checkpoint()
            views += (
                listed_view(n, self.registry, self.drains, now, engines) for n in chosen[start : start + VIEW_BATCH]
            )
        return views, (chosen[-1].node_id if more and chosen else None)

    def node_view(self, node_id: str) -> dict[str, Any]:
        node, now = self.registry.nodes[node_id], self.registry.clock.now()
        return node_view(node, self.registry.liveness(node, now), now, self.config().engines)

    def replica_views(self) -> list[dict[str, Any]]:
        return replica_views(self.registry, self.replicas)

    async def replica_listing(self) -> list[dict[str, Any]]:
        """`replica_views` for the admin API: made a batch at a time, the loop free between."""
        return await replica_views_sliced(self.registry, self.replicas)

    def model_views(self, replica_views: Iterable[Mapping[str, Any]] | None = None) -> list[dict[str, Any]]:
        """The catalog's models, counted from `replica_views` (default: the replicas' views now)."""
        return model_views(self.config().models, self.replica_views() if replica_views is None else replica_views)

    def page_look(self) -> PageLook:
        return PageLook(self.registry, self.replicas, self.drains, self.config().engines, self._fabrics_of)

    def _fabrics_of(self, reports: dict[str, tuple[w.Fabric, ...]]) -> FabricMap:
        """The fabric map of these reports: the last one again while they are the same (with
        thousands of nodes a map takes 5-15 ms, and nodes' fabrics seldom change)."""
        last = self._last_fabrics
        if last is None or last[0] != reports:
            last = self._last_fabrics = (reports, fabric_map(reports))
        return last[1]

    def fabric_map(self) -> FabricMap:
        return cluster_fabrics(self.registry)

    def rotation_changed(self) -> trio.Event:
        return self.changes.rotation.next()

    def cluster_changed(self) -> trio.Event:
        """Set once the reconciler has looked at the next change of nodes or replicas."""
        return self.changes.settled.next()


class GatewayEndpoints:
    """The gateway's endpoints: the catalog's models and the placed replicas ready to serve."""

    def __init__(
        self,
        *,
        registry: NodeRegistry,
        replicas: Replicas,
        models: Callable[[], Sequence[Model]],
        retiring: Collection[str],
        changes: Changes,
        created: Mapping[str, float] | None = None,
    ) -> None:
        """`retiring`: the replicas a move is taking out of rotation (`Moves.retiring`, read live);
        `created`: when each model entered the catalog (read live)."""
        self.created = created if created is not None else {}
        self.registry = registry
        self.replicas = replicas
        self.models = models
        self.retiring = retiring
        self.changes = changes

    def gateway_rotation(self) -> Rotation:
        now = self.registry.clock.now()
        return gateway_rotation(self.registry, self.replicas, self.models(), self.retiring, now, self.created)

    def rotation_changed(self) -> trio.Event:
        return self.changes.rotation.next()
