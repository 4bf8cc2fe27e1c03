"""What the control plane shows of the gateway instances connected to it, from the last heartbeat
of each (`LinkedGateway.last`): the figures behind the cluster page's history (`history_totals`)
and, when its own gateway runs in worker processes, the gateway's families in its /metrics
(`render_workers`).

The rule for /metrics on `http_listen` (docs/gateway.md): it is the control plane's, relayed by
whichever worker took the connection — the families of each of its own workers (the gateway
named `WORKER_NAME`: everything a worker's own /metrics has, the gateway's families, its table's
staleness, its listener's connections) as the worker's last heartbeat said them, every series
labelled `worker` with the worker's instance (`w0-…`; a restarted worker is a new instance, its
counters start from zero as a restarted process's do), and the seconds since each worker was
heard (`llmgw.gateway.metrics.render_by_worker`); then the control plane's own families. So a
scrape sees every worker at once, whichever answers, each figure at most a heartbeat interval
old. Not `instance`: Prometheus sets that label itself on every series, from the scrape's
target. A standalone gateway's figures are not here: its own /metrics serves them, by the same
rule (`llmgw.gatewayd.figures`).
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from llmgw.gateway.history import Totals, totals_of_families
from llmgw.gateway.metrics import render_by_worker
from llmgw.pki.ca import CONTROL_PLANE_GATEWAY
from llmgw.server.links.gatewaylinks import LinkedGateway

WORKER_NAME = CONTROL_PLANE_GATEWAY  # the gateway name of the control plane's own workers (their certificate's CN)


def history_totals(links: Iterable[LinkedGateway]) -> dict[str, Totals]:
    """Every instance's totals by "name/instance", for the page's history (`History` sources);
    an instance not heard from yet is left out, so that its first heartbeat is its baseline."""
    return {f"{link.name}/{link.instance}": totals_of_families(link.last.metrics) for link in links if link.last.seq}


def own_workers(links: Iterable[LinkedGateway]) -> list[LinkedGateway]:
    return [link for link in links if link.name == WORKER_NAME]


def render_workers(links: Iterable[LinkedGateway], now: float | None = None) -> str:
    """The metric families of the control plane's own workers (`links` of WORKER_NAME), each
    series labelled `worker`, then the seconds since each was heard; `now`: unix time."""
    workers = ((link.instance, link.last.metrics or (), link.heard_at) for link in own_workers(links))
    return render_by_worker(workers, time.time() if now is None else now)
