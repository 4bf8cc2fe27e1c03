"""A gateway's endpoint provider without a control plane, for the tests and the bench
(tools/bench/gateway_runner.py, phases 1-4): a fixed rotation, replaced with `set`.

The control plane's provider is `llmgw.server.state.rotation.GatewayEndpoints`; both meet
`llmgw.gateway.app.EndpointProvider`.
"""

from __future__ import annotations

import trio

from llmgw.gateway.routing import Endpoint, Rotation
from llmgw.wakeup import Wakeup
from llmgw.wire.gateway_link import ModelInfo


class StaticEndpoints:
    """An endpoint provider without a control plane: a fixed set, replaced with `set`."""

    def __init__(
        self, endpoints: tuple[Endpoint, ...] = (), models: frozenset[str] | None = None, details: tuple = ()
    ) -> None:
        self.changed = Wakeup()  # the rotation was replaced: the gateway's rotation follows
        self._rotation = Rotation(models=frozenset(), endpoints=())
        self.set(endpoints, models, details)

    def set(
        self, endpoints: tuple[Endpoint, ...], models: frozenset[str] | None = None, details: tuple[ModelInfo, ...] = ()
    ) -> None:
        models = frozenset(ep.model for ep in endpoints) if models is None else models
        self._rotation = Rotation(models=models, endpoints=tuple(endpoints), details=details)
        self.changed.fire()

    def gateway_rotation(self) -> Rotation:
        return self._rotation

    def rotation_changed(self) -> trio.Event:
        return self.changed.next()
