"""The control plane's gateway on its own loop (`[server] gateway_workers = 0`: for tests, and for a
program that embeds the control plane): one `GatewayWorker`, as each worker process runs one,
whose table is fed in memory instead of over the gateway link. So a request on `http_listen`
enters at `GatewayWorker.handle` wherever the gateway runs, and the gateway's own go on to
`Gateway.handle`; what is not the gateway's the worker hands to the control plane's own routes
(`ControlPlane.handle_own`) directly, where a worker process relays it to the private socket.

`serve_own_table` is that worker's table source (`gatewayd.worker.Source`, as the link client
and a table file are): it gives the table (a `TableSink`) what the gateway link would give it,
made and followed as the link's is (`gatewaytable.TableSource`: the rotation and the valid keys,
each again whole, and numbered, when what it says changed), with the link up and the control
plane heard every heartbeat interval (the table's staleness, in /health). Token budgets too: the
budgets and this worker's grants (it is the instance INSTANCE of the `BudgetRing`'s book), and its
reports handed to the ring as they change, as its link would.

Unlike a worker process, this worker is no instance on the gateway link: it takes no share of
the keys' limits (alone, it has the whole of each, so the instances that share a key are the
gateways connected), and the control plane reads its requests on each replica and its figures
directly (`Gateway.quiesce`, `/metrics`). Its keys are the `KeyRing`'s own table
(`KeyRing.table`), which the ring changes before the admin API answers: a key made or revoked
counts from the very next request, with no wait for the workers (`keys_reached`).
"""

from __future__ import annotations

from functools import partial

import trio

from llmgw.config import ServerConfig
from llmgw.gateway.app import Gateway
from llmgw.gatewayd.table import GatewayTable
from llmgw.gatewayd.worker import GatewayWorker
from llmgw.http.listeners import ConnectionStats
from llmgw.http.messages import Handler
from llmgw.http.server import bound_address
from llmgw.server.front import cannot_listen, split_hostport
from llmgw.server.links.gatewaytable import TableSource
from llmgw.server.state.budgetring import BudgetRing
from llmgw.server.state.keys import KeyRing
from llmgw.server.state.rotation import GatewayEndpoints
from llmgw.wire import gateway_link as g
from llmgw.wire.gateway_link import TableSink

INSTANCE = "in-process"  # the worker's name in its /health (`instance`)


class InProcessGateway:
    """The gateway worker on the control plane's loop, its table fed from `endpoints` and `keys`."""

    def __init__(
        self,
        config: ServerConfig,
        *,
        endpoints: GatewayEndpoints,
        keys: KeyRing,
        plane_routes: Handler,
        connections: ConnectionStats,
        budgets: BudgetRing | None = None,
    ) -> None:
        """`plane_routes`: the control plane's own routes; `connections`: its listeners' counts,
        which `http_listen`'s join; `budgets`: the token budgets it enforces. Does no I/O."""
        self.config = config  # as read at start: `[gateway]`, `[http]` and the addresses are fixed
        self.endpoints = endpoints
        self.keys = keys
        self.budgets = budgets
        self.worker = GatewayWorker(
            GatewayTable(keys.table),
            instance=INSTANCE,
            options=config.gateway,
            plane_routes=plane_routes,
            connections=connections,
        )

    @property
    def gateway(self) -> Gateway:
        return self.worker.gateway

    async def serve(
        self,
        sockets: list[trio.SocketListener],
        *,
        drain_s: float,
        task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Serve `http_listen` (or `sockets`, passed to us) until cancelled, then drain; started
        with the address bound, once the table is whole (it is at once: it is this process's)."""
        server = self.config.server
        host, port = split_hostport(server.http_listen)
        source = partial(serve_own_table, self.endpoints, self.keys, server.heartbeat_interval_s, budgets=self.budgets)
        serve = partial(
            self.worker.serve,
            limits=self.config.http,
            drain_s=drain_s,
            sockets=sockets,
            table_first=True,
            cannot_listen=partial(cannot_listen, "http_listen", server.http_listen),
        )
        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(serve, source, host, port)
            task_status.started(bound_address(listeners))


async def serve_own_table(
    endpoints: GatewayEndpoints,
    keys: KeyRing,
    heartbeat_interval_s: float,
    *,
    sink: TableSink,
    budgets: BudgetRing | None = None,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Give `sink` the control plane's rotation and keys as the gateway link would, each again as
    it changes, until cancelled; started once the whole table is given."""

    def changed(kind: type) -> None:
        if kind is g.RotationChanged:
            sink.rotation_changed(table.rotation)
        else:
            sink.keys_changed(table.keys)

    table = TableSource(endpoints, keys, changed)  # what the link's table is made of, followed alike
    sink.link_state(True, "")
    sink.rotation_changed(table.rotation)
    sink.keys_changed(table.keys)
    sink.heard(trio.current_time())
    async with trio.open_nursery() as nursery:
        await nursery.start(table.serve)
        if budgets is not None and isinstance(sink, GatewayTable):
            await nursery.start(serve_own_budgets, budgets, sink)
        task_status.started()
        while True:  # as the link's heartbeats do: the table is as fresh as the control plane
            await trio.sleep(heartbeat_interval_s)
            sink.heard(trio.current_time())


async def serve_own_budgets(
    ring: BudgetRing, table: GatewayTable, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
) -> None:
    """The budgets and this worker's grants into `table`, its reports to `ring`, as the link
    carries them for a worker process; until cancelled."""
    told = ring.on_grants  # the feed's: the linked instances

    def on_grants(instances) -> None:
        told(instances)
        if INSTANCE in instances:
            table.grants_changed(ring.grants(INSTANCE))

    ring.on_grants = on_grants
    ring.link_opened(INSTANCE)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_follow, ring, table)
            task_status.started()
            while True:
                due = table.budgets.due.next()
                ring.report(INSTANCE, table.budgets.report())
                await due.wait()
    finally:
        ring.on_grants = told
        ring.link_closed(INSTANCE)


async def _follow(ring: BudgetRing, table: GatewayTable) -> None:
    while True:
        changed = ring.changed.next()
        table.budgets_changed(ring.message())
        await changed.wait()
