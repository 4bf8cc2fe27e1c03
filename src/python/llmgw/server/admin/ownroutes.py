"""The control plane's own routes — the admin API (`server/admin/api.py`), /metrics, and the cluster page
with /login (`server/admin/page.py`); anything else is 404 — and the roles behind them: `views` (what
the admin API and the page show, `state.clusterviews.ClusterViews`), `operations` (what the admin API
changes, `server/admin/operations.py`), `page` (the page, and the gate every admin call passes) and
`refusals` (a wrong credential, a spent login code, a page call from elsewhere: one count for
the admin API and the page, a few lines each interval and then a summary, however fast a client
repeats them; `RefusalLines`).

They are served on `http_listen`, where a gateway worker hands over every path that is not the
gateway's (`GatewayWorker.plane_routes`: relayed to the private socket from a worker process,
called directly on the control plane's loop), and on the private socket itself
(`server/admin/privatesocket.py`). Domain errors become statuses in the admin API alone (`admin.ANSWERS`).

/metrics is one exposition: the gateway's families first (`Gateways.render_metrics`: its
workers', each series labelled `worker`, or the gateway's on this loop), then the process's own,
each from the part that counts it (its listeners' connections, its background loops' restarts
and whether it leads, its event loop's lag and the stalls it skipped, its agents' links, its
moves, its task steps where asked); a family both have appears once (`metrics.merge`).
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from llmgw.config import ServerConfig
from llmgw.errors import cut
from llmgw.http.errors import HTTPError
from llmgw.http.messages import Request, Response, StreamingResponse, allow
from llmgw.http.refusallines import RefusalLines
from llmgw.metrics import MetricsRegistry, merge
from llmgw.pki.ca import CA
from llmgw.server.admin.api import AdminAPI, is_admin_path
from llmgw.server.admin.models import HubModels
from llmgw.server.admin.operations import Operations
from llmgw.server.admin.page import Page, page_origins
from llmgw.server.gateways.own import Gateways
from llmgw.server.links.agentlinks import AgentLinks
from llmgw.server.nodes.releases import Releases
from llmgw.server.settings import Settings
from llmgw.server.state.catalogtimes import CatalogTimes
from llmgw.server.state.changes import Changes
from llmgw.server.state.clusterviews import ClusterViews
from llmgw.server.state.drains import Drains
from llmgw.server.state.intent import NodeIntent
from llmgw.server.state.liveness import Reconciler
from llmgw.server.state.registry import NodeRegistry
from llmgw.server.state.replicas import Replicas
from llmgw.server.store.asyncstore import AsyncStore

METRICS_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class OwnRoutes:
    def __init__(
        self,
        *,
        config: Callable[[], ServerConfig],
        http_port: Callable[[], int],
        settings: Settings,
        store: AsyncStore,
        registry: NodeRegistry,
        replicas: Replicas,
        intent: NodeIntent,
        drains: Drains,
        reconciler: Reconciler,
        agent_links: AgentLinks,
        gateways: Gateways,
        releases: Releases,
        changes: Changes,
        catalog_times: CatalogTimes,
        admin_token: str,
        ca: CA,
        own_metrics: Sequence[Callable[[], str]],
        models: HubModels | None = None,
    ) -> None:
        """`config()`: the configuration running now (a reload replaces it); `http_port()`:
        `http_listen`'s port, as bound once it is (the page's origins have it); `own_metrics`:
        the renderers of the process's own families, in the order /metrics shows them. Does no
        I/O."""
        self.config = config
        self.http_port = http_port
        self.ca = ca
        self.gateway_metrics = gateways.render_metrics
        self.own_metrics = tuple(own_metrics)
        self.views = ClusterViews(registry=registry, replicas=replicas, drains=drains, config=config, changes=changes)
        if models is not None:
            self.views.model_detail = models.detail  # where each model comes from: the API's and the page's
        self.operations = Operations(
            settings=settings,
            store=store,
            registry=registry,
            replicas=replicas,
            intent=intent,
            drains=drains,
            reconciler=reconciler,
            links=agent_links,
            gateway_links=gateways.feed,
            releases=releases,
            changes=changes,
            catalog_times=catalog_times,
        )
        self.refusals = RefusalLines("http")
        # The cluster page: sessions, the gateways' history, the gate.
        self.page = Page(
            self.views,
            gateways.history_totals,
            gateways.keys,
            origins=self.page_origins,
            refusals=self.refusals,
            store=store,  # the audit log's
        )
        self.admin = AdminAPI(
            refusals=self.refusals,
            views=self.views,
            operations=self.operations,
            page=self.page,
            store=store,
            keys=gateways.keys,
            token=admin_token,
            gateways=gateways.feed.views,
            keys_reached=gateways.keys_reached,
            authority=self.authority,
            models=models,
            budgets=gateways.budgets,
        )

    async def handle(self, request: Request) -> Response | StreamingResponse:
        if is_admin_path(request.path):
            return await self.admin.handle(request)
        if request.path == "/metrics":
            allow(request, "GET")
            return Response(status=200, body=self.render_metrics().encode(), headers=(("content-type", METRICS_TYPE),))
        if Page.serves(request.path):  # the cluster page's files and /login
            return await self.page.handle(request)
        raise HTTPError(404, f"no route {cut(request.method, 20)} {cut(request.path)}", kind="not_found_error")

    def render_metrics(self) -> str:
        own = "".join(render() for render in self.own_metrics)
        return merge(self.gateway_metrics(), own)  # one exposition: a family both have appears once

    def page_origins(self) -> frozenset[str]:
        """Where the cluster page may be opened: the addresses server.toml gives this control
        plane, with http_listen's port as bound (`page.page_origins`)."""
        return page_origins(self.config().server, self.http_port(), socket.gethostname())

    def authority(self) -> dict[str, Any]:
        """The CA this control plane signs with, as the admin API shows it."""
        info = self.ca.info()
        return {
            "common_name": info.common_name,
            "fingerprint_sha256": info.fingerprint_sha256,
            "not_after": info.not_after.isoformat(),
        }


def restarts_metric(restarts: Mapping[str, int], leading: Callable[[], bool]) -> str:
    """The restarts of the control plane's background loops (`supervision.Background.restarts`)
    and whether it leads now."""
    registry = MetricsRegistry()
    family = registry.counter(
        "llmgw_background_restarts_total",
        "Times a background loop of the control plane was started again after a failure.",
        ("task",),
    )
    for task, count in sorted(restarts.items()):
        family.inc(count, task=task)
    registry.gauge("llmgw_control_plane_leading", "Whether this control plane leads (1) or stands by (0).").set(
        int(leading())
    )
    return registry.render()
