"""The gateway's rotation: which placed replicas the gateway reaches, where and with which key,
and each catalog model's routes and whether any replica of it can become ready. Pure functions of
the registry, the placements and the catalog (`now` is the trio clock's, given by the caller),
and the control plane's `endpoints` role that reads them at each call, `GatewayEndpoints`
(`llmgw.gateway.app.EndpointProvider`).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence

import trio

from llmgw.config import Model
from llmgw.engines import SPECS
from llmgw.gateway.routing import LEAST_OUTSTANDING, PREFIX, Endpoint, Rotation
from llmgw.server.state.changes import Changes
from llmgw.server.state.registry import LOST, UNKNOWN, NodeRegistry
from llmgw.server.state.replicas import Replicas
from llmgw.wire import agent_link as w
from llmgw.wire import gateway_link as g


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
    another replica can take them. A parked replica (`Replicas.parked`) is left out until woken.

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
        if rid in replicas.parked:
            continue  # parked, or being parked: no request until it is woken
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
# A parked replica is woken by the request that finds none ready (llmgw.server.state.autoscale).
_ON_THE_WAY = frozenset({w.FETCHING, w.STARTING, w.RESTARTING, w.READY, w.PARKED})


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
    count: dict[str, int] = {}
    for rid, stored in replicas.placed.items():
        p = stored.placement
        count[p.model] = count.get(p.model, 0) + 1
        if rid in unknown:
            coming.add(p.model)
            continue
        rank0 = registry.nodes.get(p.nodes[0])
        gone = [n for n in p.nodes if (node := registry.nodes.get(n)) is None or registry.liveness(node, now) == LOST]
        if gone:
            lost.setdefault(p.model, set()).update(gone)
            continue
        status = next((s for s in rank0.replicas if s.replica_id == rid and s.node_rank == 0), None) if rank0 else None
        if status is None or status.state in _ON_THE_WAY or rid in replicas.parked:
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
    # More replicas wanted than placed, none held back: the reconciler's next pass places them
    # (a model on demand whose first request has just raised its count).
    coming.update(m.name for m in models if m.name not in pending and count.get(m.name, 0) < m.replicas)
    out = []
    for m in models:
        why = ""
        if m.name not in ready and m.name not in coming and not forming and m.engine not in installing:
            if m.name in pending:
                why = f"no replica can be placed: {pending[m.name]}"
            elif m.name in lost:
                why = f"the nodes of its replicas are lost: {', '.join(sorted(lost[m.name]))}"
            elif m.replicas == 0 and m.scaled:
                pass  # none while unused: the next request starts one (`llmgw.server.state.autoscale`)
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
                on_demand=m.scaled and m.bounds[0] == 0,
                max_queue=m.max_queue,
                queue_timeout_s=m.queue_timeout_s,
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
