"""The gateway's prober, a service beside its request handler: a replica out of rotation comes back
when a probe reaches it.

A replica leaves rotation when an attempt on it fails (`Gateway.replica_failed`, by the router's
rule, `Router.failed`), which fires `Gateway.went_down`. `serve_probes` probes each replica out
of rotation every `probe_interval_s` (`Router.due_probes`): a `GET /health` on a fresh
connection (`UpstreamPool.probe`), bounded by the connect and probe timeouts, the probes of one
round run together. One that answers is back (`Router.probed`), which wakes the requests queued
for a replica (`Gateway.wake`); meanwhile it sleeps until the next probe is due or another
replica goes down. Rather than a cooldown: an engine that is loading answers its `/health`
with 503 too and stays out until it is ready.

Started with `nursery.start(serve_probes, gateway)`, by `llmgw.gateway.services.serve_services`
with the other services beside the handler. The router is the one owner of who is down; the
prober and the handler change it on the same loop.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import trio

from llmgw.gateway.routing import Endpoint
from llmgw.log import get_logger

if TYPE_CHECKING:
    from llmgw.gateway.app import Gateway

log = get_logger("llmgw.gateway")


async def serve_probes(gw: Gateway, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Probe each replica out of rotation every `probe_interval_s`, until cancelled."""
    task_status.started()
    while True:
        went_down = gw.went_down.next()
        due = gw.router.due_probes(gw.clock())
        if due:
            async with trio.open_nursery() as nursery:
                for ep in due:
                    nursery.start_soon(_probe, gw, ep)
            continue
        next_at = gw.router.next_probe_at()
        with trio.move_on_at(math.inf if next_at is None else next_at):
            await went_down.wait()


async def _probe(gw: Gateway, ep: Endpoint) -> None:
    started = gw.clock()
    why = await gw.pool.probe(ep.host, ep.port)
    gw.metrics.probes.inc(result="failed" if why else "reached")
    down = gw.router.down.get(ep.replica_id)
    if gw.router.probed(ep, started, reached=why is None):
        assert down is not None
        log.info("gateway_replica_back", replica=ep.replica_id, model=ep.model, down_s=round(started - down.since, 3))
        gw.wake(ep.model)
    elif why is not None:
        log.debug("gateway_probe_failed", replica=ep.replica_id, model=ep.model, reason=why)
