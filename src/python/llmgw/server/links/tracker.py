"""The weights tracker: which nodes hold or fetch each file, and which one node fetches it from
its source, so that a file crosses the internet once per cluster.

Agents ask it on the agent port, with their node certificate (`GET /v1/weights/peers/SHA256`,
optionally `?unreachable=NODE,NODE`: the nodes the asker could not reach), every few seconds
while they fetch a file (`agent.swarm`). The answer:

    {"origin": bool,        the asker fetches the file from its source
     "authority": NODE,     whose piece hashes the asker believes: a node holding the whole file
                            (it verified it), else the origin; "" when there is neither yet
     "peers": [{"node", "address", "port", "complete"}],
                            the other nodes that hold the file (whole or in part, as their weights
                            reports say) or asked for it lately, each at the port it serves
                            weights on
     "members": [NODE, ...]} the cluster's nodes: a node serves weights to these only

and `GET /v1/weights/peers/members` answers `{"members": [...]}` alone: a node that holds files
and fetches none asks it when a node it does not know comes for pieces (one that joined since).

The origin of a file is chosen when a node asks for it and no node the asker can reach holds it
whole: the node that was origin stays origin while it keeps asking (within `ORIGIN_TTL_S`) and is
joined; otherwise the asker becomes origin (a new one resumes where the pieces are: the others
keep theirs). An asker's word that it cannot reach the origin does not replace it: one node's
trouble (a peer busy, a connection reset) must not send a second node to the internet; an origin
cut off from everyone is cut off from the control plane too, and stops being joined. A file held
whole by a joined node the asker can reach needs no origin: it comes from the holders.

With server.toml's `[downloads] weights_origin = "control_plane"` (nodes without internet), no
node is ever origin of a file the catalog names with its size: the control plane downloads it
(`llmgw.server.nodes.weightsorigin`) and is named as its authority and as a peer,
`{"node": "@control-plane", "control_plane": true, "complete": bool}`, which nodes reach at the
agent port they link to (`GET /v1/weights/SHA256[/pieces]`, as a node's weights port answers).

Everything here is in memory, rebuilt from the agents' asks and weights reports: a control plane
that restarts, or a standby that takes over, has it back within a few seconds of asks.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from urllib.parse import parse_qs, unquote

import attrs

from llmgw.http.errors import HTTPError
from llmgw.http.messages import Request, Response, allow
from llmgw.server.nodes.weightsorigin import CONTROL_PLANE, WeightsOrigin
from llmgw.server.state.registry import NodeRegistry
from llmgw.wire.agent_link import MEMBERS_TARGET, PEERS_PREFIX

FETCHER_TTL_S = 10.0  # an asker counts as fetching the file (a peer to others) this long after its ask
ORIGIN_TTL_S = 15.0  # an origin that has not asked for this long is replaced by the next asker
MAX_FILES = 4096  # files tracked before those no node asked for lately are forgotten
_SHA = re.compile(r"^[0-9a-f]{64}$")


@attrs.define
class _File:
    askers: dict[str, float] = attrs.field(factory=dict)  # node -> when it last asked
    origin: str = ""


class Tracker:
    def __init__(
        self, registry: NodeRegistry, now: Callable[[], float], *, origin: WeightsOrigin | None = None
    ) -> None:
        """`origin`: the control plane's own download of weights ([downloads] weights_origin =
        "control_plane"), which then seeds every file the catalog names; None: a node does."""
        self.registry = registry
        self.now = now
        self.origin = origin
        self.files: dict[str, _File] = {}
        self.origins_chosen = 0  # for tests and the log

    def _joined(self, node_id: str, now: float) -> bool:
        node = self.registry.nodes.get(node_id)
        return node is not None and self.registry.liveness(node, now) == "joined"

    def ask(self, asker: str, sha256: str, unreachable: frozenset[str] = frozenset()) -> dict:
        now = self.now()
        if sha256 not in self.files and len(self.files) >= MAX_FILES:
            self._forget_idle(now)
        entry = self.files.setdefault(sha256, _File())
        entry.askers[asker] = now
        for node, at in list(entry.askers.items()):
            if now - at > max(FETCHER_TTL_S, ORIGIN_TTL_S):
                del entry.askers[node]
        peers: dict[str, dict] = {}
        whole: list[str] = []
        for node_id in sorted(self.registry.nodes):
            node = self.registry.nodes[node_id]
            if node_id == asker or not node.weights.port or not node.address or not self._joined(node_id, now):
                continue
            held = next((f for f in node.weights.files if f.sha256 == sha256), None)
            fetching = now - entry.askers.get(node_id, -FETCHER_TTL_S * 2) <= FETCHER_TTL_S
            if held is None and not fetching and entry.origin != node_id:
                continue
            complete = held is not None and held.complete
            peers[node_id] = {"node": node_id, "address": node.address, "port": node.weights.port, "complete": complete}
            if complete and node_id not in unreachable:
                whole.append(node_id)
        if whole:
            authority, origin = whole[0], False
        elif self.origin is not None and self.origin.want(sha256, now):
            # The control plane fetches it from the source, and seeds it: no node goes out.
            authority, origin = CONTROL_PLANE, False
            peers[CONTROL_PLANE] = {
                "node": CONTROL_PLANE,
                "control_plane": True,
                "complete": self.origin.complete(sha256),
            }
        else:
            current = entry.origin
            alive = (
                current
                and self._joined(current, now)
                and now - entry.askers.get(current, -ORIGIN_TTL_S * 2) <= ORIGIN_TTL_S
            )
            if not alive:
                entry.origin = asker
                self.origins_chosen += 1
            authority, origin = entry.origin, entry.origin == asker
        return {
            "origin": origin,
            "authority": authority,
            "peers": list(peers.values()),
            "members": self.members(),
        }

    def _forget_idle(self, now: float) -> None:
        """Files no node asked for lately: a node asking for digests at random grows nothing."""
        horizon = max(FETCHER_TTL_S, ORIGIN_TTL_S)
        for digest, entry in list(self.files.items()):
            if all(now - at > horizon for at in entry.askers.values()):
                del self.files[digest]

    def members(self) -> list[str]:
        """The cluster's nodes (a removed node is not among them): whom a node serves weights to."""
        return sorted(self.registry.nodes)


async def handle(request: Request, tracker: Tracker, node: str) -> Response:
    """Answer one ask (`node`'s, its certificate checked by the agent port)."""
    allow(request, "GET")
    path, _, query = request.target.decode("latin-1").partition("?")
    if path == MEMBERS_TARGET:
        return Response.json(200, {"members": tracker.members()})
    sha256 = path.removeprefix(PEERS_PREFIX)
    if not _SHA.match(sha256):
        raise HTTPError(404, "ask for a file by its sha256: /v1/weights/peers/SHA256 (64 hex digits)")
    away = parse_qs(query[:8192]).get("unreachable", [""])[0]
    unreachable = frozenset(unquote(n) for n in away.split(",")[:1000] if n)
    return Response.json(200, tracker.ask(node, sha256, unreachable))
