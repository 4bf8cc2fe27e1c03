"""What the gateway learns of its replicas' caches, for routing by prefix (`gateway/prefix.py`):
two services beside the request handler, each started with `nursery.start`
(`llmgw.gateway.services.serve_services` starts them).

- `serve_cache_reports`: every CACHE_REPORT_INTERVAL_S, each llama.cpp replica of a model routed
  by prefix is asked what it holds (`GET /slots`, with its key; the answer parsed as any body is,
  off the loop when large): one that restarted since, on the same address, is no longer taken to
  hold what it served (`Router.engine_report`).
- `serve_cache_events`: a subscription to the KV-cache events of each replica that publishes
  them (vLLM's, SGLang's: `Endpoint.events_port`; the protocol is `gateway/kvevents.py`) of a
  model routed by prefix, kept while it is in rotation at that address, its events read into the
  router (`Router.engine_events`) as they come.

Neither decides whether a replica is up: a replica that does not answer is the prober's
business (`gateway/probes.py`). A failure with one replica costs that report or that
subscription (tried again later); a bug of ours is logged with its traceback and ends that one
alone, while the handler, the prober and the other replicas' reports go on.
"""

from __future__ import annotations

import trio

from llmgw.gateway.app import MAX_BUFFERED_BODY, Gateway
from llmgw.gateway.errors import UpstreamBroken, UpstreamTooLarge, UpstreamUnavailable
from llmgw.gateway.fields import slot_tasks
from llmgw.gateway.kvevents import Event, EventsError, Subscription, batch_of, decode_batch_async
from llmgw.gateway.routing import Endpoint
from llmgw.http.jsonbody import InvalidJson
from llmgw.http.jsonworkers import ParserBusy
from llmgw.log import get_logger

log = get_logger("llmgw.gateway")

# How often a llama.cpp replica of a model routed by prefix is asked what its cache holds.
CACHE_REPORT_INTERVAL_S = 2.0


# -- llama.cpp's /slots ------------------------------------------------------------------------


async def serve_cache_reports(gw: Gateway, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Every CACHE_REPORT_INTERVAL_S, a report from each llama.cpp replica of a model routed by
    prefix, each bounded by the probe's timeouts, until cancelled."""
    task_status.started()
    while True:
        eps = [
            ep
            for model in gw.router.policies
            if (info := gw.details.get(model)) is not None and info.engine == "llamacpp"
            for ep in gw.router.endpoints.get(model, ())
        ]
        async with trio.open_nursery() as nursery:
            for ep in eps:
                nursery.start_soon(_cache_report, gw, ep)
        await trio.sleep(CACHE_REPORT_INTERVAL_S)


async def _cache_report(gw: Gateway, ep: Endpoint) -> None:
    headers = [(b"authorization", f"Bearer {ep.api_key}".encode())] if ep.api_key else []
    try:
        with trio.fail_after(gw.options.connect_timeout_s + gw.options.probe_timeout_s):
            upstream = await gw.pool.send(ep.host, ep.port, "GET", "/slots", headers, b"")
            try:
                body = await upstream.read(MAX_BUFFERED_BODY) if upstream.status == 200 else b""
            finally:
                await upstream.aclose()
        if upstream.status != 200:
            log.debug("gateway_cache_report_refused", replica=ep.replica_id, status=upstream.status)
            return
        tasks = await gw.json.parse(body, slot_tasks, what="llama-server's /slots")
    except (
        trio.TooSlowError,
        UpstreamUnavailable,
        UpstreamBroken,
        UpstreamTooLarge,
        InvalidJson,
        ParserBusy,
    ) as exc:
        log.debug("gateway_cache_report_failed", replica=ep.replica_id, reason=str(exc) or type(exc).__name__)
        return
    except Exception:  # - a bug of ours: this report is lost, the gateway's other work goes on
        log.exception("gateway_cache_report_bug", replica=ep.replica_id)
        return
    gw.metrics.cache_reports.inc(model=ep.model)
    if gw.router.engine_report(ep, tasks):
        log.info("gateway_replica_cache_reset", replica=ep.replica_id, model=ep.model)
        gw.metrics.cache_resets.inc(model=ep.model)


# -- vLLM's and SGLang's KV-cache events ----------------------------------------------------------


async def serve_cache_events(gw: Gateway, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """A subscription per replica that publishes its events, following the rotation the gateway
    routes by (`Gateway.applied`), until cancelled."""
    running: dict[str, tuple[tuple[str, int], trio.CancelScope]] = {}
    async with trio.open_nursery() as nursery:
        task_status.started()
        while True:
            changed = gw.applied.next()
            wanted = {
                ep.replica_id: ep
                for model in gw.router.policies
                for ep in gw.router.endpoints.get(model, ())
                if ep.events_port
            }
            for rid, (where, scope) in list(running.items()):
                ep = wanted.get(rid)
                if ep is None or (ep.host, ep.events_port) != where:
                    scope.cancel()
                    del running[rid]
            for rid, ep in wanted.items():
                if rid not in running:
                    scope = trio.CancelScope()
                    running[rid] = ((ep.host, ep.events_port), scope)
                    nursery.start_soon(_subscribe, gw, ep, scope)
            await changed.wait()


async def _subscribe(gw: Gateway, ep: Endpoint, scope: trio.CancelScope) -> None:
    """Read `ep`'s KV-cache events into the router (`Router.engine_events`) until cancelled;
    a publisher that cannot be reached, or breaks the protocol, is tried again after a
    backoff (1 s doubling to 30 s; from 1 s again after a subscription that delivered)."""
    failures = 0
    timeout_s = gw.options.connect_timeout_s + gw.options.probe_timeout_s
    with scope:
        while True:
            delivered = False
            try:
                with trio.fail_after(timeout_s):
                    stream = await gw.open_events(ep.host, ep.events_port)
                async with stream:
                    sub = Subscription(stream)
                    with trio.fail_after(timeout_s):
                        await sub.open()
                    log.info("gateway_cache_events_subscribed", replica=ep.replica_id, port=ep.events_port)
                    async for frames in sub.messages():
                        seq, payload = batch_of(frames)
                        events = await decode_batch_async(payload)
                        _engine_events(gw, ep, seq, events)
                        delivered = True
                reason = "the publisher closed the connection"
            except (OSError, trio.TooSlowError, trio.BrokenResourceError, EventsError) as exc:
                reason = str(exc) or type(exc).__name__
            except Exception:  # - a bug of ours: this subscription stops, the gateway's other work goes on
                log.exception("gateway_cache_events_bug", replica=ep.replica_id)
                return
            failures = 1 if delivered else failures + 1
            (log.info if failures == 1 else log.debug)(
                "gateway_cache_events_lost", replica=ep.replica_id, port=ep.events_port, reason=reason
            )
            gw.metrics.cache_event_failures.inc(model=ep.model)
            await trio.sleep(min(30.0, 2.0 ** (failures - 1)))


def _engine_events(gw: Gateway, ep: Endpoint, seq: int, events: list[Event]) -> None:
    report = gw.router.engine_events(ep, seq, events)
    if report.restarted or report.cleared:
        why = "restarted" if report.restarted else "cleared"
        log.info("gateway_replica_cache_reset", replica=ep.replica_id, model=ep.model, why=why)
        gw.metrics.cache_resets.inc(model=ep.model)
    if report.missed:
        gw.metrics.cache_events_missed.inc(report.missed, model=ep.model)
    if report.trimmed:
        gw.metrics.cache_trimmed.inc(report.trimmed, model=ep.model)
