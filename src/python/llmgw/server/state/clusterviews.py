"""The control plane's `views` role: `ClusterViews`, what the admin API and the cluster page's feed
show of the cluster (`llmgw.server.admin.pagefeed.Views`) and when it may have changed, and its
`PageLook`, one look at the cluster for the feed with what each view is made of. The views
themselves are `llmgw.server.state.views`'.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import trio

from llmgw.config import EnginesSection, Model, ServerConfig
from llmgw.fabrics import FabricMap, fabric_map
from llmgw.server.state.changes import Changes
from llmgw.server.state.drains import DrainProgress
from llmgw.server.state.registry import JOINED, AgentLinkRecord, Node, NodeRegistry
from llmgw.server.state.replicas import Replicas
from llmgw.server.state.views import (
    VIEW_BATCH,
    cluster_fabrics,
    listed_view,
    model_views,
    node_view,
    node_views,
    page_node_view,
    pending_views,
    replica_view,
    replica_views,
    replica_views_sliced,
)
from llmgw.wire import agent_link as w

# -- the cluster page's feed ---------------------------------------------------------------
# The feed (`llmgw.server.admin.pagefeed`) keeps each node's and replica's view encoded, with what it was
# made of, and makes it again only when that changed. What a view is made of: the objects the
# control plane replaces whenever they change (the hello, the inventory, the tuples of engines
# and replicas a node reports, a placement, the engines' section of the configuration), which a
# tuple comparison matches by identity before it compares values, and a copy of everything that
# changes in place (liveness, cordon, drain, the link's state). A joined node's heartbeat is not
# among them: it only moves the node's deadline, so heartbeats alone never change the page.


def _cert_days(s: AgentLinkRecord | None, wall: float) -> float | None:
    return round((s.cert_not_after - wall) / 86400, 1) if s else None


def page_node_inputs(
    node: Node, state: str, wall: float, engines: EnginesSection | None, drain: DrainProgress | None
) -> tuple[Any, ...]:
    """What `page_node_view` makes the node's view of (see above). Keep it in step with
    `node_view`: tests/llmgw/server/test_feed.py checks the feed against views made afresh after
    every kind of change."""
    s = node.link
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
        # Each model's view completed with where it comes from (`HubModels.detail`, set by its owner).
        self.model_detail: Callable[[list[dict[str, Any]]], list[dict[str, Any]]] = lambda listed: listed
        # A scaled model's bounds, the count it wants and its last decision (the autoscaler's).
        self.scale_of: Callable[[Model], dict[str, Any] | None] = lambda model: None
        # The models' rollouts under way or stopped, by model (`Rollouts.views`, set by its owner).
        self.rollouts: Callable[[], Mapping[str, dict[str, Any]]] = dict

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
        listed = model_views(
            self.config().models,
            self.replica_views() if replica_views is None else replica_views,
            self.scale_of,
            self.rollouts(),
        )
        return self.model_detail(listed)

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
