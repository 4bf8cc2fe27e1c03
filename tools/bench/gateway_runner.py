"""A gateway alone in its own process, for `tools/bench/gateway.py` to measure its CPU and memory.

    PYTHONPATH=src/python python3 tools/bench/gateway_runner.py SPEC.json

SPEC is `{"endpoints": [{"replica_id", "model", "host", "port", "api_key"}]}`.
It serves a `Gateway` with those `StaticEndpoints` on 127.0.0.1 (a free port), makes one API
key (its table holds that key alone: no store), prints `{"port": P, "token": T, "pid": PID}` on one line once it
listens, and runs until SIGTERM or SIGINT. The open-file limit is raised to its hard limit so
thousands of streams fit.
"""

from __future__ import annotations

import json
import os
import resource
import secrets
import sys
from functools import partial
from pathlib import Path

import trio

from llmgw.commands._service import run_service
from llmgw.gateway.app import Gateway
from llmgw.gateway.keys import KeyTable, token_hash
from llmgw.gateway.routing import Endpoint
from llmgw.http.openai import error_body
from llmgw.http.server import bound_address, serve_http
from llmgw.wire.gateway_link import GatewayKey
from testlib.endpoints import StaticEndpoints


async def serve(spec: dict) -> None:
    token = "llmgw-" + secrets.token_urlsafe(32)
    keys = KeyTable([GatewayKey(name="bench", token_sha256=token_hash(token))])
    endpoints = tuple(Endpoint(**ep) for ep in spec["endpoints"])
    gateway = Gateway(StaticEndpoints(endpoints), keys)
    async with trio.open_nursery() as nursery:
        await nursery.start(gateway.serve_rotation)
        await nursery.start(gateway.serve_probes)
        listeners = await nursery.start(partial(serve_http, errors=error_body), gateway.handle, "127.0.0.1", 0)
        _, port = bound_address(listeners)
        print(json.dumps({"port": port, "token": token, "pid": os.getpid()}), flush=True)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        raise SystemExit(__doc__)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return run_service("bench_gateway", serve, json.loads(Path(argv[0]).read_text()))


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
