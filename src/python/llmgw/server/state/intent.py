"""The operator's intent for each node — cordoned, draining — and its one writer, `NodeIntent`.

Every change goes the same three steps, in this order:

1. the store (`AsyncStore.set_cordoned` / `set_draining`): a refusal (`StoreError`, `UnknownNode`)
   raises before anything changed, and a restart finds the marks where the operator left them;
2. memory: the registry's `Node`, which the scheduler, the views and the gateway's rotation read;
3. the change (`Changes.intent_changed`): the reconciler looks again and pushes the node's
   desired state (it says `cordoned`), and the gateway's rotation follows (a draining node's
   replicas take no new requests).

A node the store has no row for but the registry knows (its connection could not be recorded
while the store was busy) gets its row with the first mark (`known_at`). The registry reads the
marks back from the store when a node joins (`server/links/agentlinks.py`) and at start (`server/app.py`).
"""

from __future__ import annotations

from llmgw.server.state.changes import Changes
from llmgw.server.state.registry import Node, NodeRegistry
from llmgw.server.store.asyncstore import AsyncStore


class NodeIntent:
    def __init__(self, *, store: AsyncStore, registry: NodeRegistry, changes: Changes) -> None:
        self.store = store
        self.registry = registry
        self.changes = changes

    async def cordon(self, node_id: str, cordoned: bool) -> None:
        """No new work for the node (`cordoned`), or again (not). `UnknownNode` if neither the
        store nor the registry knows it."""
        known = self.registry.nodes.get(node_id)
        await self.store.set_cordoned(node_id, cordoned, known_at=known.address if known else None)
        node = self._node(node_id)
        node.cordoned = cordoned
        self.changes.intent_changed(node_id)

    async def start_draining(self, node: Node) -> None:
        """A drain begins: the node takes no new replicas and its replicas no new requests."""
        await self.store.set_draining(node.node_id, True, known_at=node.address)
        node = self._node(node.node_id)
        node.draining = True
        self.changes.intent_changed(node.node_id)

    async def drained(self, node_id: str) -> None:
        """A drain finished: the node is cordoned and no longer draining, in one write. Its
        replicas are gone whatever the store says, so memory follows even when the store refuses
        (`StoreError`, `UnknownNode` raised after, for the caller to report): only a restart would
        find the old marks."""
        known = self.registry.nodes.get(node_id)
        try:
            await self.store.set_drained(node_id, known_at=known.address if known else None)
        finally:
            node = self.registry.nodes.get(node_id)
            if node is not None:  # removed meanwhile: nothing left in memory to mark
                node.cordoned, node.draining = True, False
            self.changes.intent_changed(node_id)

    def _node(self, node_id: str) -> Node:
        return self.registry.nodes.get(node_id) or self.registry.know(node_id)
