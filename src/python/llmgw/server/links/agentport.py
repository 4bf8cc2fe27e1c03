"""What arrives on the agent port and where it goes, from the request head alone.

The agent port (server.toml's agent_listen) is one TLS listener, for five things: the agent
link, a WebSocket at AGENT_PATH, the artifact mirror, `GET ARTIFACTS_PREFIX + SHA256`
(`llmgw.server.nodes.artifacts`), and the weights tracker, `GET PEERS_PREFIX + SHA256`
(`llmgw.server.links.tracker`), all for node certificates only; the gateway link, a WebSocket at
GATEWAY_PATH (`llmgw.server.links.gatewaylinks`), for gateway certificates only; and the release files,
`GET RELEASE_PREFIX + NAME` (`llmgw.server.nodes.releases`), for any peer (a node fetching its release
has no certificate yet). Its HTTP is the shared server's (`llmgw.http.server`, one request per
connection): `AgentListener` routes each request by `route`; the mirror and the release files
answer as ordinary handlers; a link's request is checked by its session's `upgrade`
(`llmgw.wire.agent_session.ServerSession`, `llmgw.wire.gateway_session.GatewayServerSession`;
`upgrade_request` hands it over: the path, the peer's name, RFC 6455's opening handshake, all
before any WebSocket handling), and the link runtime's `Upgrade` answer
(`llmgw.server.links.linkserver`) hands the connection to trio-websocket's public
`wrap_server_stream`, which reads the request again from the bytes already read (`accept_link`,
through `llmgw.linkio.LinkStream`). Refusals before the WebSocket are plain HTTP on that
connection.

Why one port and not a listener of its own for the mirror: `node add`, agent.toml and the
firewall rules in docs/security.md name one control-plane port for everything a node needs,
and the mirror wants the same client certificates as the link; a second port would be one more
thing to open and to get wrong, for a request the head already tells apart.
"""

from __future__ import annotations

import enum

import trio
import trio_websocket

from llmgw.http.messages import Request
from llmgw.linkio import LinkStream
from llmgw.wire import agent_link as w
from llmgw.wire.gateway_link import GATEWAY_PATH
from llmgw.wire.session import UpgradeRequest


class Route(enum.Enum):
    MIRROR = "mirror"  # answered by llmgw.server.nodes.artifacts
    PEERS = "peers"  # the weights tracker, llmgw.server.links.tracker: node certificates only
    WEIGHTS = "weights"  # pieces the control plane seeds (llmgw.server.nodes.weightsorigin): node certificates only
    RELEASE = "release"  # answered by llmgw.server.nodes.releases, to a peer without a certificate too
    LINK = "link"  # the agent link: ServerSession.upgrade checks its path and node id
    GATEWAY = "gateway"  # the gateway link: GatewayServerSession.upgrade checks its path and name


def route(request: Request) -> Route:
    """Where a request goes, from its target as sent. Everything that is not the mirror's, the
    releases' or the gateway link's is the agent link's to accept or refuse (404 for another path)."""
    if request.target.startswith(w.ARTIFACTS_PREFIX.encode()):
        return Route.MIRROR
    if request.target.startswith(w.RELEASE_PREFIX.encode()):
        return Route.RELEASE
    if request.target.startswith(w.PEERS_PREFIX.encode()):
        return Route.PEERS
    if request.target.startswith(w.WEIGHTS_PREFIX.encode()):
        return Route.WEIGHTS
    if request.target.startswith(GATEWAY_PATH.encode()):
        return Route.GATEWAY
    return Route.LINK


def upgrade_request(request: Request) -> UpgradeRequest:
    """The link's upgrade request as `ServerSession.upgrade` checks it (RFC 6455's rules are the
    session's): the head as the codec parsed it, and how many bytes came after it."""
    return UpgradeRequest(
        method=request.method.encode("ascii"),
        target=request.target,
        http_version=request.http_version,
        headers=request.raw_headers,
        early=request.pipelined,
    )


async def accept_link(
    nursery: trio.Nursery, stream: trio.abc.Stream, prefix: bytes
) -> trio_websocket.WebSocketConnection:
    """Accept the link's WebSocket on `stream` (its reader runs in `nursery`), the request
    already checked by `ServerSession.upgrade`: trio-websocket reads it again from `prefix`, the
    bytes the HTTP server had read (`llmgw.http.messages.Upgrade`)."""
    request = await trio_websocket.wrap_server_stream(nursery, LinkStream(stream, prefix=prefix))
    return await request.accept()
