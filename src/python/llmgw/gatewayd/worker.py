"""One gateway worker: the OpenAI routes served by the gateway (`llmgw.gateway`) from a table of
its own (`GatewayTable`), which its own link to the control plane fills (or a table file, or on
the control plane's own loop its memory: `llmgw.server.gateways.inprocess`). Every request on a gateway's
port enters here (`GatewayWorker.handle`), and the gateway's own go on to `Gateway.handle`.

    GET /health    200 while the worker holds a table with a replica ready to serve; 503 with a
                   `reason` before its first table, with no replica ready, or while draining.
                   Always: `ready` (replicas per model), `link_up`, `link_detail`, `staleness_s`
                   (seconds since the control plane was last heard), `keys` (how many it holds),
                   `share` (this worker's share of the keys' limits: `index` of `count` instances)
                   and `instance` (this worker's name on the link)
    /v1/...        503 with Retry-After until the first whole table came (no key is known yet)
    GET /metrics   the gateway's families, then `llmgw_gateway_table_staleness_seconds`,
                   `llmgw_gateway_link_up`, `llmgw_gateway_table_received` and the listener's
                   connection counts; in a gateway of its own (`figures`), those of every
                   worker, each series labelled `worker` (`llmgw.gatewayd.figures`)
    anything else  the gateway's (`Gateway.handle`)

A worker of the control plane's own gateway has `plane_routes`: every path that is not the
gateway's (`relay.gateway_route`: /v1/... and /health) goes there instead — the admin API, the
cluster page, /login and /metrics, which is then the control plane's (its families and its
workers' figures, docs/gateway.md): relayed to the control plane's private socket from a worker
process (`llmgw.server.gateways.workers`: `Relay.handle`), or handled on the control plane's own loop
(`llmgw.server.gateways.inprocess`: `ControlPlane.handle_own`).

`serve` starts the gateway's services (`gateway.services`: its rotation, its prober, what its
replicas' caches hold), then its listener (`gateway.front`: SO_REUSEPORT when workers share the
port; a drain on cancellation), then the table's source, which it does not
wait for: a worker serves at once, 503 until its first table, so a control plane that is away at
start delays only the table. The control plane's own workers listen only once their first table
came (`table_first`): their control plane is there, and a connection is better left to a sibling
or to the backlog than answered 503. The source runs under `llmgw.supervision.Background`: it is started
again after a failure while the gateway serves on from the table it had.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import trio

from llmgw.config import GatewaySection
from llmgw.errors import MachineError
from llmgw.gateway.app import Gateway
from llmgw.gateway.checks import RETRY_AFTER_S
from llmgw.gateway.front import serve_draining
from llmgw.gateway.metrics import families_of
from llmgw.gateway.services import serve_services
from llmgw.gateway.upstream import Connect
from llmgw.gatewayd.figures import SharedFigures
from llmgw.gatewayd.table import GatewayTable
from llmgw.http.errors import HTTPError
from llmgw.http.limits import Limits
from llmgw.http.listeners import ConnectionStats
from llmgw.http.messages import Handler, Request, Response, StreamingResponse, allow
from llmgw.http.relay import gateway_route
from llmgw.log import get_logger
from llmgw.metrics import MetricsRegistry
from llmgw.supervision import Background
from llmgw.wire import gateway_link as g

if TYPE_CHECKING:
    from llmgw.telemetry.otel import Tracing

log = get_logger("llmgw.gatewayd")

# What fills a worker's table: called as `source(sink=table, task_status=...)` (the link client,
# `serve_gateway_link` with its server and identity bound, or a table file's `serve_table_file`).
Source = Callable[..., Awaitable[Any]]

DRAIN_S = 30.0  # on stop: how long requests in flight may take to finish (the control plane's too)
JSON_CLOSE_S = 5.0  # on stop: for the JSON worker process, if a large body started one
USAGE_FLUSH_S = 3.0  # on stop, once drained: for the last usage report's acknowledgement (`Usage.flushed`)
METRICS_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class GatewayWorker:
    def __init__(
        self,
        table: GatewayTable,
        *,
        instance: str = "",
        options: GatewaySection | None = None,
        connect: Connect | None = None,
        plane_routes: Handler | None = None,
        figures: SharedFigures | None = None,
        connections: ConnectionStats | None = None,
        tracing: Tracing | None = None,
    ) -> None:
        """`instance`: this worker's name on the link; `connect`: how the upstream pool reaches
        engines (tests: memory streams); `plane_routes`: what answers the paths that are not the
        gateway's (the control plane's); `figures`: where the workers of a gateway of its own
        share their figures, so that its /metrics has every worker's whichever answers (None: its
        own, unlabelled); `connections`: its listener's counts (on the control plane's loop, the
        control plane's own); `tracing`: its traces (`llmgw.telemetry.start`), None when off."""
        self.table = table
        self.instance = instance
        self.plane_routes = plane_routes
        self.figures = figures
        self.gateway = Gateway(
            table.endpoints, table.keys, options=options, connect=connect, tracing=tracing, budgets=table.budgets
        )
        self.connections = connections if connections is not None else ConnectionStats()
        self.background = Background(log)
        r = self.registry = MetricsRegistry()
        self.staleness = r.gauge(
            "llmgw_gateway_table_staleness_seconds",
            "Seconds since the control plane was last heard on this worker's link (since the worker started, "
            "if it never was).",
        )
        self.link_up = r.gauge("llmgw_gateway_link_up", "1 while this worker's link to the control plane is up.")
        self.received = r.gauge(
            "llmgw_gateway_table_received", "1 once this worker holds a whole table (its rotation and its keys)."
        )

    async def handle(self, request: Request) -> Response | StreamingResponse:
        if self.plane_routes is not None and not gateway_route(request.path):
            return await self.plane_routes(request)
        if request.path == "/health":
            allow(request, "GET")
            status, body = self.table.health(self.gateway.clock(), self.gateway.ready(), draining=self.gateway.draining)
            return Response.json(status, {**body, "instance": self.instance})
        if request.path == "/metrics":
            allow(request, "GET")
            text = self.render_metrics() if self.figures is None else await self.figures.scrape(self.metric_families)
            return Response(status=200, body=text.encode(), headers=(("content-type", METRICS_TYPE),))
        if not self.table.received and request.path.startswith("/v1/"):
            raise HTTPError(
                503,
                f"this gateway has no table from the control plane yet ({self.table.link_detail}); try again shortly",
                kind="server_error",
                code="model_not_ready",
                headers=(("retry-after", str(RETRY_AFTER_S)),),
            )
        return await self.gateway.handle(request)

    def load(self, metrics: bool = True) -> g.GatewayHeartbeat:
        """What its link's heartbeats say: requests in flight and answered since it started, the
        rotation it routes by and the keys it holds, its requests on each replica, each model's
        requests (`Gateway.model_loads`) and, if `metrics`, its /metrics (else None:
        `GatewayHeartbeat.metrics`)."""
        gateway = self.gateway
        outstanding = sorted((r, n) for r, n in gateway.router.outstanding.items() if n > 0)
        return g.GatewayHeartbeat(
            seq=0,
            in_flight=gateway.in_flight_total,
            requests_total=int(sum(gateway.metrics.requests.values.values())),
            rotation_version=gateway.rotation_version,
            keys_version=self.table.keys_version,
            outstanding=tuple(g.ReplicaLoad(replica_id=r, outstanding=n) for r, n in outstanding),
            models=gateway.model_loads(),
            metrics=self.metric_families() if metrics else None,
        )

    def _registries(self) -> tuple[MetricsRegistry, ...]:
        """Its /metrics, family by family, each gauge set from the state it mirrors."""
        self.gateway.metrics.mirror(self.gateway.router, self.gateway.queued, self.gateway.in_flight)
        self.staleness.set(round(self.table.staleness(self.gateway.clock()), 3))
        self.link_up.set(1 if self.table.link_up else 0)
        self.received.set(1 if self.table.received else 0)
        return self.gateway.metrics.registry, self.registry, self.connections.registry

    def render_metrics(self) -> str:
        return "".join(r.render() for r in self._registries())

    def metric_families(self) -> tuple[g.MetricFamily, ...]:
        return families_of(*self._registries())

    async def serve(
        self,
        source: Source,
        host: str,
        port: int,
        *,
        limits: Limits = Limits(),
        drain_s: float = DRAIN_S,
        reuse_port: bool = False,
        sockets: list[trio.SocketListener] | None = None,
        table_first: bool = False,
        cannot_listen: Callable[[OSError], Exception] | None = None,
        task_status: trio.TaskStatus[list[trio.SocketListener]] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Serve until cancelled, then drain (`gateway.front`); reports its listeners once it
        listens. `sockets`: listening already (passed to this process), in place of binding.
        `table_first`: take no connection before the first whole table came (the control
        plane's workers: meanwhile the kernel gives connections to the other workers, or they
        wait in the backlog of a socket passed to us), rather than answer 503 until then.
        `cannot_listen(exc)`: the error for a port it cannot listen on, naming the setting to
        change (by default `--listen`'s)."""
        serve_http = partial(
            serve_draining,
            self.handle,
            self.gateway,
            host,
            port,
            limits=limits,
            stats=self.connections,
            drain_s=drain_s,
            reuse_port=reuse_port,
            sockets=sockets,
            cannot_listen=cannot_listen or partial(listen_error, host, port),
        )
        # The table's source (the link) outlives a stop until the requests are drained and the
        # usage counted meanwhile is acknowledged, for at most USAGE_FLUSH_S (`serve_then_flush`).
        linked = trio.CancelScope(shield=True)

        async def serve_source() -> None:
            with linked:
                await self.background.run("table_source", partial(source, sink=self.table))

        async def serve_then_flush(*, task_status: trio.TaskStatus[list[trio.SocketListener]]) -> None:
            try:
                await serve_http(task_status=task_status)
            finally:
                with trio.CancelScope(shield=True), trio.move_on_after(USAGE_FLUSH_S):
                    await self.gateway.usage.flushed()
                linked.cancel()

        try:
            async with trio.open_nursery() as nursery:
                try:
                    await nursery.start(serve_services, self.gateway)
                    if self.figures is not None:  # written before it listens: a scrape sees every worker serving
                        await nursery.start(self.figures.serve, self.metric_families)
                    if table_first:
                        nursery.start_soon(serve_source)
                        await self.table.whole.wait()
                    listeners = await nursery.start(serve_then_flush)
                except BaseException:
                    linked.cancel()  # stopped before it served: nothing to report
                    raise
                if not table_first:
                    nursery.start_soon(serve_source)
                task_status.started(listeners)
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(JSON_CLOSE_S):
                await self.gateway.json.aclose()


def listen_error(host: str, port: int, exc: OSError) -> MachineError:
    return MachineError(
        f"cannot listen on {host}:{port} (--listen): {exc.strerror or exc}; is another program on that port "
        "(a gateway started without SO_REUSEPORT, another server)? Stop it, or pass another --listen"
    )
