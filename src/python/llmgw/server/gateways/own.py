"""The control plane's side of its gateways: what they are told, what serves `http_listen` (the
front), and what the rest of the control plane asks of the gateways wherever they run.

- What they are told: the rotation (`endpoints`, `state.rotation.GatewayEndpoints`: the catalog's
  models and the replicas ready now), the valid API keys (`keys`, `server.keys.KeyRing`, their
  one writer) and the token budgets with each instance's grants (`budgets`,
  `state.budgetring.BudgetRing`), sent over the gateway link to every instance (`feed`,
  `server.gatewayfeed`); the gateway on this loop (`gateway_workers = 0`) gets them in memory.
- The front (`serve_front`): `gateway_workers` worker processes (`llmgw.server.gateways.workers.OwnGateway`,
  each a `llmgw gateway` worker linked to this control plane), or with 0 one gateway worker on
  this loop, its table fed in memory (`llmgw.server.gateways.inprocess`). Either way a request on
  `http_listen` enters at `GatewayWorker.handle`, the gateway's go on to `Gateway.handle` and
  the rest to the control plane's own routes.
- A move's wait for the requests on a replica it took out of rotation (`quiesce`) and their
  count (`outstanding`): the gateway on this loop's, if any, then every instance's connected
  over the link (`GatewayFeed`, the control plane's own workers among them).
- A key made or revoked reaching the control plane's own workers before the admin API answers
  (`keys_reached`).
- Their figures: the sources of the cluster page's history (`history_totals`) and the gateway's
  families in the control plane's /metrics (`render_metrics`).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path

import trio

from llmgw.config import Model, ServerConfig
from llmgw.gateway.app import Gateway
from llmgw.gateway.history import Totals, totals_of
from llmgw.http.listeners import ConnectionStats
from llmgw.http.messages import Handler
from llmgw.linkclient import SILENT_HEARTBEATS
from llmgw.log import get_logger
from llmgw.pki.ca import CA
from llmgw.server.gateways.figures import WORKER_NAME, history_totals, render_workers
from llmgw.server.gateways.inprocess import InProcessGateway
from llmgw.server.gateways.workers import OwnGateway
from llmgw.server.links.gatewaylinks import GatewayFeed
from llmgw.server.links.usagereports import UsageReports
from llmgw.server.state.budgetring import BudgetRing
from llmgw.server.state.changes import Changes
from llmgw.server.state.keys import KeyRing
from llmgw.server.state.registry import NodeRegistry
from llmgw.server.state.replicas import Replicas
from llmgw.server.state.rotation import GatewayEndpoints
from llmgw.server.store.asyncstore import AsyncStore
from llmgw.wire import agent_link as w
from llmgw.wire import gateway_link as g

log = get_logger("llmgw.server")

BUDGET_GRACE_S = 5.0
KEYS_REACH_S = 2.0  # a key made or revoked: the admin API answers once the workers hold it, or after this


class Gateways:
    """The gateways' rotation, keys and link; the front on `http_listen`; their part in moves, keys
    and figures."""

    def __init__(
        self,
        config: ServerConfig,
        *,
        workers: int,
        state_dir: Path,
        ca: CA,
        store: AsyncStore,
        registry: NodeRegistry,
        replicas: Replicas,
        models: Callable[[], Sequence[Model]],
        retiring: Collection[str],
        changes: Changes,
        created: Mapping[str, float],
        leading: Callable[[], bool],
        redirect: Callable[[], w.Redirect] | None,
        plane_routes: Handler,
        connections: ConnectionStats,
    ) -> None:
        """`workers`: how many gateway worker processes serve `http_listen` (0: one worker on
        this loop, `in_process`); `models()`, `retiring` and `created` are read at each use (the
        catalog, the replicas a move takes out of rotation, when each model entered the catalog);
        `leading()` and `redirect()`: the gateway link's, as the agent link's (`GatewayFeed`);
        `plane_routes`: the control plane's own routes, which the worker on this loop answers
        the paths that are not the gateway's with. Does no I/O."""
        self.config = config  # as read at start: `[server]`, `[gateway]`, `[http]` and `[ca]` are fixed
        self.workers = workers
        self.state_dir = state_dir
        self.ca = ca
        self.endpoints = GatewayEndpoints(
            registry=registry, replicas=replicas, models=models, retiring=retiring, changes=changes, created=created
        )
        self.keys = KeyRing(store)  # the API keys' one writer; the gateway on this loop reads its table
        # A closed link's grant stays counted until its gateway has surely noticed the link is gone
        # (it drops what it held then): SILENT_HEARTBEATS of ours unheard, and two more; at least
        # BUDGET_GRACE_S, so that a gateway back after a short cut finds its grant still its own.
        interval = config.server.heartbeat_interval_s
        grace_s = max(BUDGET_GRACE_S, (SILENT_HEARTBEATS + 2) * interval)
        self.budgets = BudgetRing(store, self.keys, grace_s=grace_s, hold_off_s=grace_s)
        self.feed = GatewayFeed(
            endpoints=self.endpoints,
            keys=self.keys,
            budgets=self.budgets,
            clock=registry.clock,  # a stall of the loop is not counted as a gateway's silence
            heartbeat_interval_s=config.server.heartbeat_interval_s,
            silence_timeout_s=config.server.heartbeat_ttl_s,
            leading=leading,
            redirect=redirect,
        )
        self.usage = UsageReports(store)  # the gateways' usage reports into the ledger
        self.feed.usage = self.usage
        self.in_process = (
            None
            if workers
            else InProcessGateway(
                config,
                endpoints=self.endpoints,
                keys=self.keys,
                plane_routes=plane_routes,
                connections=connections,
                budgets=self.budgets,
            )
        )

    @property
    def gateway(self) -> Gateway | None:
        """The gateway on this loop (`gateway_workers = 0`), None with worker processes."""
        return self.in_process.gateway if self.in_process is not None else None

    async def serve_front(
        self,
        agent_address: tuple[str, int],
        sockets: list[trio.SocketListener],
        *,
        drain_s: float,
        task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Serve `http_listen` (or `sockets`, passed to us) until cancelled, then drain; started
        with the address it is bound to, once every worker serves by the control plane's table."""
        if self.in_process is not None:
            # Its usage is written by this loop (no link), the last of it once it has drained.
            usage, writing = self.in_process.gateway.usage, trio.CancelScope(shield=True)

            async def write_usage() -> None:
                with writing:
                    await self.usage.serve_local(usage)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(write_usage)
                try:
                    await self.in_process.serve(sockets, drain_s=drain_s, task_status=task_status)
                finally:
                    writing.cancel()
            return
        own = OwnGateway(count=self.workers, config=self.config, state_dir=self.state_dir, ca=self.ca, feed=self.feed)
        own.drain_s = drain_s
        await own.serve(agent_address, sockets, task_status=task_status)

    async def quiesce(self, replica_id: str, timeout_s: float) -> bool:
        """Until no gateway has a request on `replica_id` (taken out of rotation): the one on
        this loop, if any, then every instance connected over the link (this plane's workers
        among them); bounded by `timeout_s` in all."""
        deadline = trio.current_time() + timeout_s
        gateway = self.gateway
        if gateway is not None and not await gateway.quiesce(replica_id, timeout_s):
            return False
        return await self.feed.quiesce(replica_id, max(0.0, deadline - trio.current_time()))

    def outstanding(self, replica_id: str) -> int:
        """The gateways' requests on `replica_id`, as each last said."""
        gateway = self.gateway
        here = gateway.router.outstanding.get(replica_id, 0) if gateway is not None else 0
        return here + self.feed.outstanding(replica_id)

    def model_loads(self) -> list[tuple[tuple[str, str], tuple[g.ModelLoad, ...]]]:
        """Each gateway instance's requests per model, as each last said ((name, instance), its
        loads): the gateway on this loop's now, if any, and every instance's connected."""
        gateway = self.gateway
        here = [(("", "this loop"), gateway.model_loads())] if gateway is not None else []
        return here + [(link.key, link.last.models) for link in self.feed.links.values()]

    def reported(self) -> list[trio.Event]:
        """Events set when a gateway next says something of its load: an instance's heartbeat
        over the link, or a request the gateway on this loop holds for a model with no replica."""
        gateway = self.gateway
        return [self.feed.heard.next()] + ([gateway.cold.next()] if gateway is not None else [])

    async def keys_reached(self) -> None:
        """Until this plane's workers hold the keys as they are now, for at most KEYS_REACH_S (then
        the answer goes anyway: a worker that is restarting gets the keys with its table). The
        gateway on this loop holds the key ring's own table: nothing to wait for."""
        if self.workers and not await self.feed.keys_reached(WORKER_NAME, KEYS_REACH_S):
            log.warning("gateway_workers_keys_late", after_s=KEYS_REACH_S)

    def history_totals(self) -> dict[str, Totals]:
        """The page history's sources: the gateway on this loop, if any, and every instance connected."""
        gateway = self.gateway
        here = {"": totals_of(gateway.metrics)} if gateway is not None else {}
        return {**here, **history_totals(self.feed.links.values())}

    def render_metrics(self) -> str:
        """The gateway's families for the control plane's /metrics: its workers' as they last said
        them, each series labelled `worker` (`gatewayfigures.render_workers`), or the gateway's
        on this loop, unlabelled."""
        gateway = self.gateway
        return render_workers(self.feed.links.values()) if gateway is None else gateway.render_metrics()
