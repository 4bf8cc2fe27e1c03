"""Whom a node's weights port serves: the cluster's members, as the control plane lists them. A
node that joined after this node's list was made (the tracker's last answer, from when this node
last fetched) is served once the control plane is asked again: a node that only holds files hears
of no newcomer otherwise. One the control plane does not list is refused, and however many come,
the control plane is asked at most every MEMBERS_REFRESH_S. Real TLS on loopback with node
certificates of one CA; the control plane's list in memory; the tracker's answer to that ask."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from functools import partial
from pathlib import Path

import pytest
import trio

from agent.peers import Members, Offer, Peer, PeerClient, PeerFailed, PeerServer, peer_ssl_context
from llmgw.http.messages import Request
from llmgw.pki.ca import new_ca
from llmgw.pki.files import issue_to_dir
from llmgw.server.links.tracker import Tracker, handle
from llmgw.server.state.registry import NodeRegistry
from llmgw.wire import agent_link as w

pytestmark = pytest.mark.trio

CONTENT = b"weights" * 1000
DIGEST = hashlib.sha256(CONTENT).hexdigest()
OFFER = Offer(size=len(CONTENT), complete=True, have=None, hashes=dict, read=lambda at, n: CONTENT[at : at + n])


@pytest.fixture
def ca():
    return new_ca(validity_days=3)


class ControlPlane:
    """The members the control plane lists; counts the asks."""

    def __init__(self, members: Iterable[str]) -> None:
        self.members = frozenset(members)
        self.asks = 0

    def ask(self) -> frozenset[str]:
        self.asks += 1
        return self.members


async def serve(nursery: trio.Nursery, tmp_path: Path, ca, members: Members) -> Peer:
    """node-a's weights port, offering one file."""
    files = issue_to_dir(ca, "node-a", tmp_path / "node-a", validity_days=3)
    server = PeerServer(lambda digest: OFFER if digest == DIGEST else None, peer_ssl_context(files), members)
    port = await nursery.start(server.serve, 0)
    return Peer(node="node-a", address="127.0.0.1", port=port, complete=True)


def client(tmp_path: Path, ca, node: str) -> PeerClient:
    files = issue_to_dir(ca, node, tmp_path / node, validity_days=3)
    return PeerClient(files.ca_cert, files.cert, files.key)


async def test_a_node_that_joined_after_the_list_was_made_is_served_after_one_ask(tmp_path: Path, ca) -> None:
    control_plane = ControlPlane({"node-a", "node-b", "node-c"})
    members = Members(control_plane.ask)
    members.ids = frozenset({"node-a", "node-b"})  # the tracker's last answer, before node-c joined
    async with trio.open_nursery() as nursery:
        peer = await serve(nursery, tmp_path, ca, members)
        listed = await trio.to_thread.run_sync(
            partial(client(tmp_path, ca, "node-b").pieces, peer, DIGEST, hashes=False)
        )
        assert listed["complete"] and control_plane.asks == 0  # a member: nothing asked
        newcomer = client(tmp_path, ca, "node-c")
        answer = await trio.to_thread.run_sync(partial(newcomer.pieces, peer, DIGEST, hashes=False))
        assert answer["size"] == len(CONTENT) and answer["complete"]
        assert control_plane.asks == 1 and members.ids == control_plane.members
        nursery.cancel_scope.cancel()


async def test_a_node_the_control_plane_does_not_list_is_refused_and_it_is_asked_once(tmp_path: Path, ca) -> None:
    control_plane = ControlPlane({"node-a", "node-b"})  # node-x was removed (its certificate is still valid)
    members = Members(control_plane.ask)
    members.ids = control_plane.members
    async with trio.open_nursery() as nursery:
        peer = await serve(nursery, tmp_path, ca, members)
        removed = client(tmp_path, ca, "node-x")
        for _ in range(3):
            with pytest.raises(PeerFailed):
                await trio.to_thread.run_sync(partial(removed.pieces, peer, DIGEST, hashes=False))
        assert control_plane.asks == 1  # within MEMBERS_REFRESH_S: the list asked for the first only
        nursery.cancel_scope.cancel()


async def test_a_control_plane_that_cannot_be_asked_leaves_the_list_as_it_was(tmp_path: Path, ca) -> None:
    def unreachable() -> frozenset[str]:
        raise OSError(111, "Connection refused")

    members = Members(unreachable)
    members.ids = frozenset({"node-a"})
    async with trio.open_nursery() as nursery:
        peer = await serve(nursery, tmp_path, ca, members)
        with pytest.raises(PeerFailed):
            await trio.to_thread.run_sync(partial(client(tmp_path, ca, "node-c").pieces, peer, DIGEST, hashes=False))
        assert members.ids == {"node-a"}
        nursery.cancel_scope.cancel()


async def test_the_tracker_answers_the_members_alone() -> None:
    registry = NodeRegistry(heartbeat_ttl_s=1e9, started_at=0.0)
    for node in ("node-b", "node-a"):
        registry.know(node, address="127.0.0.1")
    tracker = Tracker(registry, lambda: 0.0)
    response = await handle(Request.of("GET", w.MEMBERS_TARGET), tracker, "node-a")
    assert response.status == 200 and json.loads(response.body) == {"members": ["node-a", "node-b"]}
    assert tracker.files == {} and tracker.origins_chosen == 0  # no file asked about, no origin chosen
