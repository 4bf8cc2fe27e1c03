"""A llama.cpp replica over several nodes, as its members on this node run it (`agent.replica_life`
calls these): rank 0 serves with llama-server, each other rank is a helper that lends its
devices through llama.cpp's RPC server, carried between the nodes by the agents' tunnel
(`agent.rpctunnel`, which says how it is protected).

A helper downloads no weights (llama-server sends the tensors from rank 0). It runs
`ggml-rpc-server` from the directory of the llama-server this node installed, on 127.0.0.1 at a
free port; once that accepts connections, its tunnel listens on this node's cluster address (the
link's, as for rank 0's engine: `agent.node_address`) at the replica's `dist_init_port`,
admitting rank 0's node alone, and the member is ready. The tunnel closes with the rpc-server;
one that cannot listen stops the rpc-server, to be started again by the restart policy.

Rank 0 opens a local end per helper (127.0.0.1, a free port each), waits until every helper's
tunnel answers (`HELPERS_WAIT_S`: the members start together; one not reached by then is an
exit of the engine, named with what failed), then starts llama-server with `--rpc` to those
ends and the layers split evenly over the members (`model_layers`, read from the GGUF's header,
and `llamacpp.rpc_layer_split`). A helper that ends a relayed connection (its rpc-server or agent gone) has rank 0's
llama-server stopped to be started again, waiting for the helpers anew; so a helper restarted
where it was forms the replica again, as a multi-node vLLM replica's rendezvous does.

The tunnel lives in the agent: an agent that restarts leaves its RPC members' processes
without it, so an agent adopting one stops it to start it afresh (`ADOPTED_SAID`).
"""

from __future__ import annotations

import ssl
from collections.abc import Callable
from pathlib import Path

import attrs
import trio
from cryptography import x509

from agent.peers import peer_client_ssl_context, peer_ssl_context
from agent.rpctunnel import LOCAL, Helper, TunnelServer
from llmgw.engines import spec_for
from llmgw.errors import LlmgwError
from llmgw.llamarecipe import RPC_SERVER
from llmgw.pki.files import NodePaths, load_cert
from llmgw.sizing.errors import MalformedGguf, MissingMetadata, NeedMore
from llmgw.sizing.gguf import parse_header
from llmgw.wire import agent_link as w

HEADER_READ = 1 << 20  # a GGUF header's first read; a tokenizer's vocabulary can take several MiB
HELPERS_WAIT_S = 180.0  # rank 0 waits this long for its helpers before it counts a failed start
FIRST_PROBE_S = 0.05  # a starting rpc-server is asked this soon again at first, doubling to PROBE_S
PROBE_S = 0.5
ADOPTED_SAID = (
    "its llama.cpp RPC went through the tunnel of the agent that started it, which is gone: "
    "stopping it to start it again with this agent's"
)


class RpcUnavailable(LlmgwError):
    """This node cannot take its part in a replica over llama.cpp's RPC (what it lacks, and the fix)."""


@attrs.frozen(kw_only=True)
class RpcIdentity:
    """This node's TLS for the tunnels: as a helper (its certificate, a client's required), as
    rank 0 (its certificate shown), and the cluster CA the helpers' must be of."""

    server_context: ssl.SSLContext
    client_context: ssl.SSLContext
    ca: x509.Certificate

    @classmethod
    def of(cls, files: NodePaths) -> RpcIdentity:
        return cls(
            server_context=peer_ssl_context(files),
            client_context=peer_client_ssl_context(files.cert, files.key),
            ca=load_cert(files.ca_cert),
        )


def spans_rpc(a: w.ReplicaAssignment) -> bool:
    """Whether the member is part of a replica over llama.cpp's RPC (rank 0 or a helper)."""
    spec = spec_for(a.engine)
    return spec.rpc_helpers and len(a.nodes) > 1


def is_helper(a: w.ReplicaAssignment) -> bool:
    return spans_rpc(a) and a.node_rank > 0


def helpers_of(a: w.ReplicaAssignment) -> tuple[Helper, ...]:
    """Rank 0's helpers, in rank order, where it dials them."""
    if len(a.member_addrs) != len(a.nodes) or not a.dist_init_port:
        raise RpcUnavailable(
            f"replica {a.replica_id} spans {len(a.nodes)} nodes over llama.cpp's RPC but its assignment names "
            f"{len(a.member_addrs)} member addresses and port {a.dist_init_port}: the control plane is older than "
            "this agent; upgrade it"
        )
    return tuple(
        Helper(node=a.nodes[rank], address=a.member_addrs[rank], port=a.dist_init_port)
        for rank in range(1, len(a.nodes))
    )


def model_layers(path: str) -> int:
    """The repeating layers of the GGUF at `path` (`<arch>.block_count`, in the first part of a
    split model), which rank 0 spreads over the members (`llamacpp.rpc_layer_split`). Reads the
    header alone, growing the read as `parse_header` asks; blocking (call it in a thread)."""
    size = HEADER_READ
    with open(path, "rb") as f:
        while True:
            f.seek(0)
            prefix = f.read(size)
            try:
                header = parse_header(prefix)
                break
            except NeedMore as more:
                if len(prefix) < size:
                    raise MalformedGguf(f"{path} ends at byte {len(prefix)}, inside its GGUF header") from None
                size = max(more.needed, 2 * size)
    arch = header.metadata.get("general.architecture")
    layers = header.metadata.get(f"{arch}.block_count")
    if not isinstance(layers, int) or isinstance(layers, bool) or layers < 1:
        raise MissingMetadata(
            f"{path} has no layer count ({arch}.block_count is {layers!r}): llama.cpp's RPC split cannot be set; "
            "serve it on one node or use a GGUF converted by llama.cpp's tools"
        )
    return layers


def rpc_server_beside(prefix: tuple[str, ...]) -> str:
    """The `ggml-rpc-server` in the directory of this node's llama-server (`prefix`: its argv)."""
    path = Path(prefix[0]).with_name(RPC_SERVER)
    if not path.is_file():
        raise RpcUnavailable(
            f"this node's llama.cpp has no {RPC_SERVER} beside {prefix[0]}: it cannot lend its devices to another "
            "node; install a build with the RPC backend (-DGGML_RPC=ON: the release's, or the agent's own build)"
        )
    return str(path)


async def wait_accepting(port: int) -> None:
    """Until the rpc-server on 127.0.0.1:`port` accepts a connection (closed at once: it then
    waits for its next client). Asked every 50 ms at first, doubling to `PROBE_S`."""
    interval = FIRST_PROBE_S
    while True:
        try:
            stream = await trio.open_tcp_stream(LOCAL, port)
        except OSError:
            await trio.sleep(interval)
            interval = min(2 * interval, PROBE_S)
            continue
        await trio.aclose_forcefully(stream)
        return


async def serve_helper(
    identity: RpcIdentity, a: w.ReplicaAssignment, rpc_port: int, host: str, ready: Callable[[], None]
) -> str:
    """Beside a helper's rpc-server while it runs: once it accepts connections, its tunnel on
    `host`:`dist_init_port` for rank 0's node, and `ready()`. Returns only when the tunnel
    cannot listen: what to say (the rpc-server is then stopped)."""
    await wait_accepting(rpc_port)
    server = TunnelServer(identity.server_context, admits=a.nodes[0], target=(LOCAL, rpc_port))
    async with trio.open_nursery() as nursery:
        try:
            await nursery.start(server.serve, host, a.dist_init_port)
        except OSError as exc:
            return (
                f"cannot listen for node {a.nodes[0]}'s llama.cpp RPC at {host}:{a.dist_init_port}: "
                f"{exc.strerror or exc}; stopping the rpc-server to start it again"
            )
        ready()
        await trio.sleep_forever()
    raise AssertionError("unreachable")
