"""A gateway alone in its own process, for `tools/bench/gateway.py` to measure its CPU and memory,
and for the tests that put gateway processes behind a load balancer (`testlib.gatewayproc`).

    PYTHONPATH=src/python:tests:tools python3 -m bench.gateway_runner SPEC.json [--port P] [--reuse-port]

SPEC is `{"endpoints": [{"replica_id", "model", "host", "port", "api_key"}]}`, with an optional
`"token"`. It serves a `Gateway` with those `StaticEndpoints` on 127.0.0.1 (port P, or a free
one), with one API key and no store: the key whose token is SPEC's `token` (so several gateways
take the same key), or a new one. It prints
`{"port": P, "token": T, "pid": PID}` on one line once it listens, and runs until SIGTERM or
SIGINT. With `--reuse-port` its socket is bound with SO_REUSEPORT, so several runners share one
port as the workers of one gateway and the kernel spreads the connections among them. The
open-file limit is raised to its hard limit so thousands of streams fit.

`llmgw gateway --table-file` is the product's own standalone gateway; this runner is the bench's
stand-in for one gateway worker, where the bench counts each process's CPU itself.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import secrets
import socket
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

HOST = "127.0.0.1"
KEY_NAME = "bench"
BACKLOG = 4096  # the kernel caps it at net.core.somaxconn


async def reuse_port_listener(host: str, port: int) -> trio.SocketListener:
    """A listening socket on (host, port) that other processes may bind as well (SO_REUSEPORT):
    the kernel then hands each new connection to one of them."""
    sock = trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart binds past TIME_WAIT
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        await sock.bind((host, port))
        sock.listen(BACKLOG)
    except BaseException:
        sock.close()
        raise
    return trio.SocketListener(sock)


async def serve(spec: dict, port: int, reuse_port: bool) -> None:
    token = spec.get("token") or "llmgw-" + secrets.token_urlsafe(32)
    keys = KeyTable([GatewayKey(name=KEY_NAME, token_sha256=token_hash(token))])  # its table: that key alone
    endpoints = tuple(Endpoint(**ep) for ep in spec["endpoints"])
    gateway = Gateway(StaticEndpoints(endpoints), keys)
    sockets = [await reuse_port_listener(HOST, port)] if reuse_port else None
    async with trio.open_nursery() as nursery:
        await nursery.start(gateway.serve_rotation)
        await nursery.start(gateway.serve_probes)
        listeners = await nursery.start(
            partial(serve_http, errors=error_body, sockets=sockets), gateway.handle, HOST, port
        )
        _, bound = bound_address(listeners)
        print(json.dumps({"port": bound, "token": token, "pid": os.getpid()}), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("spec", type=Path, help="the JSON spec (see above)")
    parser.add_argument("--port", type=int, default=0, help="the port to listen on (default: a free one)")
    parser.add_argument("--reuse-port", action="store_true", help="bind with SO_REUSEPORT (several runners, one port)")
    args = parser.parse_args(argv)
    if args.reuse_port and not args.port:
        parser.error("--reuse-port needs --port: the runners that share a port must name it")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return run_service("bench_gateway", serve, json.loads(args.spec.read_text()), args.port, args.reuse_port)


if __name__ == "__main__":
    raise SystemExit(main())
