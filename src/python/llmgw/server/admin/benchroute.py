"""`POST /admin/v1/bench`: have nodes measure their engines' speed again (`llmgw ctl nodes bench`).

The body is `{"nodes": [NODE, ...], "wait_s": S}`, both optional: no nodes (or an empty list) asks
every connected node; `wait_s` (0 to MAX_WAIT_S, default DEFAULT_WAIT_S) bounds how long the answer
waits for the figures. The answer, from `Operations.bench`: the request's token and per node
whether it was asked, whether it answered within the wait, and its speeds as they are then.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

from llmgw.errors import UsageError, shown
from llmgw.http import params
from llmgw.http.errors import HTTPError
from llmgw.http.jsonbody import read_json
from llmgw.http.messages import Request, Response, allow
from llmgw.pki.ca import check_node_id
from llmgw.server.admin import audit

BENCH = "/admin/v1/bench"
# An agent takes at most a minute a backend (agent.bench.TIMEOUT_S): two backends and the link.
DEFAULT_WAIT_S = 150.0
MAX_WAIT_S = 600.0
MAX_NODES = 10_000


class Benches(Protocol):
    async def bench(self, node_ids: list[str], wait_s: float) -> dict[str, Any]: ...


async def bench(operations: Benches, request: Request) -> Response:
    allow(request, "POST")
    params.query(request, {})
    body = await read_json(request)
    if not isinstance(body, dict):
        raise HTTPError(400, 'the body must be a JSON object: {"nodes": [NODE, ...], "wait_s": SECONDS}, both optional')
    unknown = sorted(set(body) - {"nodes", "wait_s"})
    if unknown:
        raise HTTPError(400, f"unknown field {shown(unknown[0])}: the body takes nodes and wait_s")
    nodes = body.get("nodes", [])
    if not isinstance(nodes, list) or len(nodes) > MAX_NODES or not all(isinstance(n, str) for n in nodes):
        raise HTTPError(400, f"nodes must be a list of at most {MAX_NODES} node ids, got {shown(nodes)}")
    try:
        node_ids = list(dict.fromkeys(check_node_id(n) for n in nodes))
    except UsageError as exc:
        raise HTTPError(400, str(exc)) from None
    wait = body.get("wait_s", DEFAULT_WAIT_S)
    if (
        isinstance(wait, bool)
        or not isinstance(wait, (int, float))
        or not (math.isfinite(wait) and 0 <= wait <= MAX_WAIT_S)
    ):
        raise HTTPError(400, f"wait_s must be a number of seconds from 0 to {MAX_WAIT_S:g}, got {shown(wait)}")
    result = await operations.bench(node_ids, float(wait))
    audit.describe(request, "node.bench", ",".join(node_ids) or "*", bench=result["request"])
    return Response.json(200, result)
