"""A gateway alone in one process, for phases 1-4 of `tools/bench/gateway.py` to measure its CPU
and memory as that process's own.

    PYTHONPATH=src/python:tests:tools python3 -m bench.gateway_runner SPEC.json [--port P]

SPEC is `{"endpoints": [{"replica_id", "model", "host", "port", "api_key"}]}`, and optionally
`"details": [{"name", "routing", ...}]` (what the rotation says of each model: `ModelInfo`, e.g.
its routing policy, as tools/bench/prefix.py sets it), `"options": {...}` (`[gateway]` keys) and
`"telemetry": {...}` (`[telemetry]` keys: traces to a collector, tools/bench/gateway.py --otlp-endpoint). It serves a
`Gateway` with those `StaticEndpoints` on 127.0.0.1 (port P, or a free one), with one new API
key and no store. It prints `{"port": P, "token": T, "pid": PID}` on one line once it listens,
and runs until SIGTERM or SIGINT. The open-file limit is raised to its hard limit so thousands of
streams fit.

`llmgw gateway --table-file` is the product's own standalone gateway: a parent and its worker
processes, which phase 5 (the workers) measures. This runner is the one-process stand-in the
other phases count CPU time and RSS on.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import secrets
from functools import partial
from pathlib import Path

import trio

from llmgw import telemetry
from llmgw.commands._service import run_service
from llmgw.config import GatewaySection, TelemetrySection
from llmgw.gateway.app import Gateway
from llmgw.gateway.budgets import Budgets
from llmgw.gateway.keys import KeyTable, token_hash
from llmgw.gateway.routing import Endpoint
from llmgw.gateway.services import serve_services
from llmgw.http.openai import error_body
from llmgw.http.server import bound_address, serve_http
from llmgw.wire.gateway_link import BudgetsChanged, GatewayBudget, GatewayKey, ModelInfo
from testlib.endpoints import StaticEndpoints

HOST = "127.0.0.1"
KEY_NAME = "bench"
OTHER_BUDGET = GatewayBudget(id="key:other::day", scope_kind="key", scope="other", period="day", tokens=1000)


async def serve(spec: dict, port: int) -> None:
    token = "llmgw-" + secrets.token_urlsafe(32)
    keys = KeyTable([GatewayKey(name=KEY_NAME, token_sha256=token_hash(token))])  # its table: that key alone
    endpoints = tuple(Endpoint(**ep) for ep in spec["endpoints"])
    details = tuple(ModelInfo(**d) for d in spec.get("details", ()))
    options = GatewaySection(**spec.get("options", {}))
    tracing = telemetry.start(TelemetrySection(**spec.get("telemetry", {})))  # None without one
    # Token budgets as a worker's table holds them: one of another key, so the bench's key takes
    # the path of every key without a budget (`Budgets.applies`).
    budgets = Budgets()
    budgets.replace(BudgetsChanged(budgets=(OTHER_BUDGET,), version=1))
    gateway = Gateway(
        StaticEndpoints(endpoints, details=details), keys, options=options, tracing=tracing, budgets=budgets
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(serve_services, gateway)
        listeners = await nursery.start(partial(serve_http, errors=error_body), gateway.handle, HOST, port)
        _, bound = bound_address(listeners)
        print(json.dumps({"port": bound, "token": token, "pid": os.getpid()}), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("spec", type=Path, help="the JSON spec (see above)")
    parser.add_argument("--port", type=int, default=0, help="the port to listen on (default: a free one)")
    args = parser.parse_args(argv)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return run_service("bench_gateway", serve, json.loads(args.spec.read_text()), args.port)


if __name__ == "__main__":
    raise SystemExit(main())
