"""The gateway link's table as this control plane sends it (`llmgw.wire.gateway_link`): the
rotation and the valid API keys, each numbered by version and followed as its source changes.
What is sent, and when, is `llmgw.server.links.gatewaylinks`'s; how it is said is here.

- The rotation follows `changes.rotation` (as the control plane's own gateway follows it), which
  fires on every agent heartbeat too: a new version is made only when what it says changed, and
  the look over every node and replica is taken at most once a rest (`changes.rest`).
- The keys follow `KeyRing.changed`, likewise: a new version only when the valid keys changed.

`changed(kind)` is called with the kind of part that has a new version (`RotationChanged`,
`KeysChanged`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import attrs
import trio

from llmgw.gateway.routing import Rotation
from llmgw.server.state.changes import rest
from llmgw.server.state.keys import KeyRing, gateway_key
from llmgw.server.state.rotation import GatewayEndpoints
from llmgw.server.store import KeyRow
from llmgw.wire import gateway_link as g


def rotation_message(rotation: Rotation, version: int = 0) -> g.RotationChanged:
    """The rotation as the gateway link says it: the catalog's models, sorted, the replicas
    ready now, in the order `gateway_rotation` gives them (by replica id), and those whose state
    is not known yet, sorted."""
    return g.RotationChanged(
        version=version,
        models=tuple(sorted(rotation.models)),
        unknown=tuple(sorted(rotation.unknown)),
        details=tuple(sorted(rotation.details, key=lambda d: d.name)),
        endpoints=tuple(
            g.RouteEndpoint(
                replica_id=e.replica_id,
                model=e.model,
                host=e.host,
                port=e.port,
                api_key=e.api_key,
                draining=e.draining,
                events_port=e.events_port,
            )
            for e in rotation.endpoints
        ),
    )


def keys_message(rows: Iterable[KeyRow], version: int = 0) -> g.KeysChanged:
    """The valid keys as the gateway link says them (the hash of each token, never the token), by name."""
    return g.KeysChanged(keys=tuple(gateway_key(r) for r in sorted(rows, key=lambda r: r.name)), version=version)


class TableSource:
    """The rotation and the keys as sent now (`rotation`, `keys`), each at version 1 to begin."""

    def __init__(self, endpoints: GatewayEndpoints, keys: KeyRing, changed: Callable[[type], None]) -> None:
        self.endpoints = endpoints
        self.key_ring = keys
        self.changed = changed
        self.rotation = rotation_message(endpoints.gateway_rotation(), version=1)
        self.keys = keys_message(keys.valid(), version=1)

    def routes_to(self, replica_id: str) -> bool:
        """Whether the rotation sent routes new requests to `replica_id` (not draining)."""
        return any(e.replica_id == replica_id and not e.draining for e in self.rotation.endpoints)

    def keys_due(self) -> int:
        """The version of the keys that holds the valid keys as they are now (if they changed and
        the change is not sent yet, the next one)."""
        now = keys_message(self.key_ring.valid())
        return self.keys.version + (self.keys.keys != now.keys)

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Follow both sources until cancelled; started once each has been looked at."""
        async with trio.open_nursery() as nursery:
            await nursery.start(self._follow_rotation)
            await nursery.start(self._follow_keys)
            task_status.started()

    async def _follow_rotation(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        started = False
        while True:
            changed = self.endpoints.rotation_changed()
            began = time.perf_counter()
            rotation = rotation_message(self.endpoints.gateway_rotation(), version=self.rotation.version)
            took = time.perf_counter() - began
            if rotation != self.rotation:
                self.rotation = attrs.evolve(rotation, version=rotation.version + 1)
                self.changed(g.RotationChanged)
            if not started:
                started = True
                task_status.started()
            await changed.wait()
            # The rotation is a look over every node and replica: while nodes keep joining, the
            # changes meanwhile are taken in one (`changes.rest`; after a millisecond's look, 3 ms).
            await rest(took)

    async def _follow_keys(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        started = False
        while True:
            changed = self.key_ring.changed.next()
            keys = keys_message(self.key_ring.valid(), version=self.keys.version)
            if keys != self.keys:
                self.keys = attrs.evolve(keys, version=keys.version + 1)
                self.changed(g.KeysChanged)
            if not started:
                started = True
                task_status.started()
            await changed.wait()
