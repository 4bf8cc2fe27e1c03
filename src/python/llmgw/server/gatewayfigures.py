"""What the control plane shows of the gateway instances connected to it, from the last heartbeat
of each (`GatewayLink.last`): the figures behind the cluster page's history (`history_totals`)
and, when its own gateway runs in worker processes, the gateway's families in its /metrics
(`render_workers`).

The rule for /metrics on `http_listen` (docs/gateway.md): it is the control plane's, relayed by
whichever worker took the connection — its own families, then the gateway families of each of
its own workers (the gateway named `WORKER_NAME`) as the worker's last heartbeat said them, every
series labelled `worker` with the worker's instance (`w0-…`; a restarted worker is a new
instance, its counters start from zero as a restarted process's do): requests by model and
status, the two latency histograms, requests in flight by model, requests outstanding on each
replica, and the seconds since the worker was last heard. So a scrape sees every worker at once,
whichever answers, each figure at most a heartbeat interval old. Not `instance`: Prometheus sets
that label itself on every series, from the scrape's target. A standalone gateway's figures are
not here: its own /metrics serves them.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from llmgw.gateway.history import Totals, totals_of_figures
from llmgw.metrics import MetricsRegistry
from llmgw.server.gatewayfeed import GatewayLink

WORKER_NAME = "control-plane"  # the gateway name of the control plane's own workers (their certificate's CN)


def history_totals(links: Iterable[GatewayLink]) -> dict[str, Totals]:
    """Every instance's totals by "name/instance", for the page's history (`History` sources);
    an instance not heard from yet is left out, so that its first heartbeat is its baseline."""
    return {f"{link.name}/{link.instance}": totals_of_figures(link.last.models) for link in links if link.last.seq}


def own_workers(links: Iterable[GatewayLink]) -> list[GatewayLink]:
    return [link for link in links if link.name == WORKER_NAME]


def render_workers(links: Iterable[GatewayLink], now: float | None = None) -> str:
    """The gateway families of the control plane's own workers (`links` of WORKER_NAME), labelled
    by worker; `now`: unix time, for the seconds since each was heard."""
    now = time.time() if now is None else now
    r = MetricsRegistry()
    requests = r.counter(
        "llmgw_gateway_requests_total", "Requests answered, by worker, model and status.", ("worker", "model", "status")
    )
    duration = r.histogram(
        "llmgw_gateway_request_duration_seconds",
        "Time from request to the end of the response, by worker and model.",
        ("worker", "model"),
    )
    ttfb = r.histogram(
        "llmgw_gateway_time_to_first_byte_seconds",
        "Time from request to the first byte of the response body, by worker and model.",
        ("worker", "model"),
    )
    in_flight = r.gauge(
        "llmgw_gateway_in_flight", "Requests being answered now, by worker and model.", ("worker", "model")
    )
    outstanding = r.gauge(
        "llmgw_gateway_replica_outstanding", "Requests outstanding on each replica, by worker.", ("worker", "replica")
    )
    heard = r.gauge(
        "llmgw_gateway_worker_heard_seconds",
        "Seconds since the worker's last heartbeat, whose figures these are.",
        ("worker",),
    )
    for link in own_workers(links):
        worker, beat = link.instance, link.last
        heard.set(round(max(0.0, now - link.heard_at), 3), worker=worker)
        for load in beat.outstanding:
            outstanding.set(load.outstanding, worker=worker, replica=load.replica_id)
        for f in beat.models:
            in_flight.set(f.in_flight, worker=worker, model=f.model)
            for status in f.requests:
                requests.inc(status.count, worker=worker, model=f.model, status=status.status)
            for family, histogram in ((duration, f.duration), (ttfb, f.ttfb)):
                if histogram is not None:
                    family.set(list(histogram.counts), histogram.sum_s, worker=worker, model=f.model)
    return r.render()
