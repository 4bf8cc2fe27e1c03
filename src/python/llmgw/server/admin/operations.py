"""What an operator does to the running control plane (the admin API's `Operations`): reload
server.toml, cordon, drain, remove a node, read a replica's logs, have nodes measure their
engines' speed again (`bench`), note a certificate issued, and the event-loop stall diagnostic.

Each change goes through the owner of what it changes and posts a change; nothing here pushes a
desired state itself. A reload replaces the configuration (`Settings`) and posts a catalog change
to the reconciler; a cordon goes through the node intent's owner (`NodeIntent`). Both answer once
the reconciler's next pass has pushed the result (`Reconciler.next_pass`), so `llmgw ctl` returns
when the agents have been told, as before. A drain is `Drains`' job. Domain errors are raised as
they are (`UnknownNode`, `UnknownReplica`, `NoConfigFile`, `ConfigError`, `StoreError`): only the
admin API turns them into statuses.
"""

from __future__ import annotations

import secrets
import time
from typing import Any, Protocol

import trio

from llmgw.log import get_logger
from llmgw.server.errors import DiagnosticOff, UnknownNode, UnknownReplica
from llmgw.server.links.agentlinks import AgentLinks
from llmgw.server.nodes.releases import Releases
from llmgw.server.settings import Settings
from llmgw.server.state.catalogtimes import CatalogTimes
from llmgw.server.state.changes import Changes
from llmgw.server.state.drains import DrainProgress, Drains
from llmgw.server.state.intent import NodeIntent
from llmgw.server.state.liveness import Reconciler
from llmgw.server.state.registry import NodeRegistry
from llmgw.server.state.replicas import Replicas
from llmgw.server.state.views import speed_view
from llmgw.server.store.asyncstore import AsyncStore
from llmgw.wire import agent_link as w

log = get_logger("llmgw.server")


class GatewayRevocations(Protocol):
    async def close_revoked(self, serials: set[int]) -> int:
        """Close the links of gateways whose certificate is one of `serials`; how many."""
        ...


class Operations:
    def __init__(
        self,
        *,
        settings: Settings,
        store: AsyncStore,
        registry: NodeRegistry,
        replicas: Replicas,
        intent: NodeIntent,
        drains: Drains,
        reconciler: Reconciler,
        links: AgentLinks,
        gateway_links: GatewayRevocations | None,
        releases: Releases,
        changes: Changes,
        catalog_times: CatalogTimes | None = None,
    ) -> None:
        """`links`, `gateway_links`: the agents' and the gateways' links (which a removal closes);
        `releases`: this control plane's release files (a reload reads them again);
        `catalog_times`: when each model entered the catalog, noted at each reload."""
        self.catalog_times = catalog_times
        self.settings = settings
        self.store = store
        self.registry = registry
        self.replicas = replicas
        self.intent = intent
        self.drains = drains
        self.reconciler = reconciler
        self.links = links
        self.gateway_links = gateway_links
        self.releases = releases
        self.changes = changes
        self.node_coming = False  # a node certificate was issued since start: the mirror fetches

    async def reload(self) -> dict[str, Any]:
        """Read server.toml again; the catalog and engines change, nothing unchanged restarts."""
        new = self.settings.reread()
        await self.releases.catalog()  # the release's llama.cpp archives, as they are now
        self.changes.catalog_changed()  # engines may have changed for everyone: every node is pushed
        changed = await self.reconciler.next_pass()
        if self.catalog_times is not None and self.catalog_times.note(m.name for m in new.models):
            self.changes.rotation.fire()  # the gateways learn the new models' `created`
        log.info("config_reloaded", models=[m.name for m in new.models], nodes_changed=sorted(changed))
        return {"models": [m.name for m in new.models], "nodes_changed": sorted(changed)}

    async def start_drain(self, node_id: str, *, force: bool) -> DrainProgress:
        return await self.drains.start(node_id, force=force)

    async def set_cordoned(self, node_id: str, cordoned: bool) -> None:
        await self.intent.cordon(node_id, cordoned)
        await self.reconciler.next_pass()  # its agent has been told

    async def remove_node(self, node_id: str) -> dict[str, Any]:
        node = self.registry.nodes.get(node_id)
        # The certificate it connected with is revoked too, even if this control plane did not issue it.
        connected = node.link.cert_serial if node is not None and node.link is not None else None
        try:
            revoked = await self.store.remove_node(node_id, also_revoke=connected)
        except UnknownNode:
            if node is None:
                raise
            revoked = []
        serials = {int(serial) for serial in revoked}
        revoked = sorted(f"{serial:x}" for serial in serials)  # hex, as openssl and the refusals print it
        closed = await self.links.close_node(
            node_id, w.REVOKED, "this node was removed from the cluster and its certificate revoked"
        )
        # A gateway's certificates are recorded under its name (`llmgw ca issue --gateway`): its
        # links close too, and its next connection is refused as revoked.
        gateways = self.gateway_links
        if gateways is not None:
            closed = await gateways.close_revoked(serials) > 0 or closed
        self.registry.forget(node_id)
        log.info("node_removed", node=node_id, revoked_serials=revoked, link_closed=closed)
        self.changes.node_changed()
        return {"removed": node_id, "revoked_serials": revoked, "link_closed": closed}

    async def replica_logs(self, replica_id: str, lines: int) -> dict[str, Any]:
        stored = self.replicas.placed.get(replica_id)
        if stored is None:
            raise UnknownReplica(replica_id, sorted(self.replicas.placed))
        members = []
        for rank, node_id in enumerate(stored.placement.nodes):
            reply = await self.links.request_logs(node_id, replica_id, lines)
            members.append({"node": node_id, "rank": rank, "text": reply.text, "error": reply.error})
        return {"replica": replica_id, "members": members}

    async def bench(self, node_ids: list[str], wait_s: float) -> dict[str, Any]:
        """Have nodes measure their engines' speed again (agent.bench; every connected node when
        `node_ids` is empty): each is told in its desired state, and the answer waits at most
        `wait_s` for them to have measured (or failed, or to wait for their replicas to idle).
        Per node: `asked`, `done`, its `speeds` as they are then, and `error` if it was not asked."""
        nodes = self.registry.nodes
        for node_id in node_ids:
            if node_id not in nodes:
                raise UnknownNode(node_id, sorted(nodes))
        ids = node_ids or sorted(n for n, node in nodes.items() if node.link is not None and node.link.connected)
        token = f"bench-{secrets.token_hex(6)}"
        out: dict[str, dict[str, Any]] = {}
        asked = []
        for node_id in ids:
            node = nodes[node_id]
            if node.link is None or not node.link.connected:
                out[node_id] = {"asked": False, "error": f"node {node_id} is not connected; ask again once it is"}
            elif not any(e.name == "llamacpp" and e.ok for e in node.engines):
                out[node_id] = {"asked": False, "error": f"node {node_id} has no working llama.cpp to measure"}
            else:
                self.registry.ask_bench(node_id, token)
                await self.links.push_desired_state(node_id)
                asked.append(node_id)
        log.info("nodes_bench_asked", nodes=asked, request=token)
        with trio.move_on_after(wait_s):
            while True:
                changed = self.changes.nodes.next()
                if all(_answered(nodes.get(n), token) for n in asked):
                    break
                await changed.wait()
        for node_id in asked:
            node = nodes.get(node_id)
            out[node_id] = {"asked": True, "done": _answered(node, token)}
        return {
            "request": token,
            "nodes": [
                {
                    "node": node_id,
                    **out[node_id],
                    "speeds": [speed_view(x) for x in nodes[node_id].speeds] if node_id in nodes else [],
                }
                for node_id in ids
            ],
        }

    def certificate_recorded(self) -> None:
        """A node certificate was issued (`node add`, `ca issue`): a node will join."""
        self.node_coming = True
        self.changes.node_changed()

    def stall(self, seconds: float) -> dict[str, Any]:
        """Hold the event loop computing for `seconds`, as a pathological request would: nothing
        is read from any link meanwhile (`POST /admin/v1/debug/stall`, if `[debug] allow_stall`).
        Liveness must come through it: no healthy node lost, no replica moved."""
        if not self.settings.current.debug.allow_stall:
            raise DiagnosticOff("holding the control plane's event loop", "allow_stall")
        log.warning("debug_stall", seconds=seconds, what="holding the event loop on purpose ([debug] allow_stall)")
        began = time.monotonic()
        while time.monotonic() - began < seconds:
            pass  # deliberately on the loop, not in a thread: this is the stall
        held = time.monotonic() - began
        log.warning("debug_stall_done", held_s=round(held, 3))
        return {"stalled_s": round(held, 3)}


def _answered(node: Any, token: str) -> bool:
    """Whether a node has answered bench request `token`: every backend measured, failed or waiting."""
    if node is None or node.link is None or not node.link.connected:
        return True  # gone meanwhile: nothing more will come
    speeds = node.speeds
    return bool(speeds) and all(x.request == token and x.state != w.SPEED_MEASURING for x in speeds)
