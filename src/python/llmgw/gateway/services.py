"""A gateway's services, started beside its request handler (`Gateway.handle`) wherever it runs: a
gateway worker (`llmgw.gatewayd.worker.GatewayWorker.serve`, in a gateway process of its own, in
the control plane's worker processes and on the control plane's own loop), the tests and the
benchmarks.

Each is a `serve_x(gateway, *, task_status)` started in this order with `nursery.start`, so that
each is ready before the next: the rotation the handler routes by (`Gateway.serve_rotation`),
the prober that brings replicas back (`gateway/probes.py`), and what the replicas' caches hold
(`gateway/cachewatch.py`: llama.cpp's reports, the KV-cache events of vLLM and SGLang). They
share the gateway's state with the handler on one loop; none of them runs per request.
"""

from __future__ import annotations

import trio

from llmgw.gateway.app import Gateway
from llmgw.gateway.cachewatch import serve_cache_events, serve_cache_reports
from llmgw.gateway.probes import serve_probes


async def serve_services(gateway: Gateway, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Run the gateway's services until cancelled; started once each is."""
    async with trio.open_nursery() as nursery:
        await nursery.start(gateway.serve_rotation)
        await nursery.start(serve_probes, gateway)
        await nursery.start(serve_cache_reports, gateway)
        await nursery.start(serve_cache_events, gateway)
        task_status.started()
