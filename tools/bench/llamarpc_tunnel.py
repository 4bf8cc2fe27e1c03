"""One end of llmgw's llama.cpp RPC tunnel (agent.rpctunnel) as a process of its own, for
tools/bench/llamarpc.py to run inside a namespace node in place of that node's agent: the same
classes with the same node certificates, doing what agent.replica_rpc has them do.

    python llamarpc_tunnel.py helper --cert C --key K --ca CA --admits node-0 \\
        --listen ADDR:PORT --rpc-port P
        once the rpc-server on 127.0.0.1:P accepts a connection, a TunnelServer on ADDR:PORT
        admitting node-0 alone (the helper's agent: replica_rpc.serve_helper)
    python llamarpc_tunnel.py serving --cert C --key K --ca CA --helper node-1=ADDR:PORT ...
        a TunnelClient's local ends on 127.0.0.1, one per helper, once every helper's tunnel
        answered (rank 0's agent: wait_reachable, then serve)

Each prints one JSON line on stdout when ready ({"ports": [...]}: the serving end's local ports
in the helpers' order, for llama-server's --rpc), then serves until SIGTERM or SIGINT. A failure
to get ready is one line on stderr and exit status 1.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path

import trio

from agent.replica_rpc import RpcIdentity, wait_accepting
from agent.rpctunnel import LOCAL, Helper, HelperUnreachable, TunnelClient, TunnelServer
from llmgw.pki.files import NodePaths

READY_WITHIN_S = 60.0  # the rpc-server's first accepted connection, or every helper reached


def _identity(opts: argparse.Namespace) -> RpcIdentity:
    cert = Path(opts.cert)
    files = NodePaths(
        dir=cert.parent, key=Path(opts.key), csr=cert.with_suffix(".csr"), cert=cert, ca_cert=Path(opts.ca)
    )
    return RpcIdentity.of(files)


def _ready(**what: object) -> None:
    print(json.dumps(what), flush=True)


async def _helper(opts: argparse.Namespace) -> None:
    identity = _identity(opts)
    host, port = opts.listen.rsplit(":", 1)
    with trio.move_on_after(READY_WITHIN_S) as waited:
        await wait_accepting(opts.rpc_port)
    if waited.cancelled_caught:
        raise SystemExit(f"no rpc-server accepted on {LOCAL}:{opts.rpc_port} within {READY_WITHIN_S:g} s")
    server = TunnelServer(identity.server_context, admits=opts.admits, target=(LOCAL, opts.rpc_port))
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve, host, int(port))
        _ready(ports=[server.port])
        await _until_signalled()
        nursery.cancel_scope.cancel()


async def _serving(opts: argparse.Namespace) -> None:
    identity = _identity(opts)
    helpers = []
    for given in opts.helper:
        node, where = given.split("=", 1)
        address, port = where.rsplit(":", 1)
        helpers.append(Helper(node=node, address=address, port=int(port)))
    client = TunnelClient(helpers, identity.client_context, identity.ca)
    try:
        await client.wait_reachable(within_s=READY_WITHIN_S, retry_s=0.2)
    except HelperUnreachable as exc:
        raise SystemExit(str(exc)) from None
    async with trio.open_nursery() as nursery:
        ports = await nursery.start(client.serve)
        _ready(ports=list(ports))
        await _until_signalled()
        nursery.cancel_scope.cancel()


async def _until_signalled() -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for _ in signals:
            return


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="one end of llmgw's llama.cpp RPC tunnel")
    parser.add_argument("role", choices=("helper", "serving"))
    parser.add_argument("--cert", required=True, help="this node's certificate (node.crt)")
    parser.add_argument("--key", required=True, help="this node's key (node.key)")
    parser.add_argument("--ca", required=True, help="the cluster CA's certificate (ca.crt)")
    parser.add_argument("--admits", default="node-0", help="helper: the serving node's id")
    parser.add_argument("--listen", help="helper: ADDR:PORT of its tunnel")
    parser.add_argument("--rpc-port", type=int, help="helper: the rpc-server's port on 127.0.0.1")
    parser.add_argument("--helper", action="append", default=[], help="serving: NODE=ADDR:PORT, in rank order")
    opts = parser.parse_args(argv)
    if opts.role == "helper" and (opts.listen is None or opts.rpc_port is None):
        parser.error("a helper's end needs --listen and --rpc-port")
    if opts.role == "serving" and not opts.helper:
        parser.error("a serving end needs at least one --helper")
    return opts


def main(argv: list[str] | None = None) -> int:
    opts = parse(argv)
    try:
        trio.run(_helper if opts.role == "helper" else _serving, opts)
    except SystemExit as exc:
        if isinstance(exc.code, str):
            print(f"llamarpc_tunnel {opts.role}: {exc.code}", file=sys.stderr)
            return 1
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
