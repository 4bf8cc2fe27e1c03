"""Weights between nodes (agent.swarm, agent.peers, agent.pieces), in one process on loopback
with real TLS: three nodes' weights stores, each serving its files on a port of its own with
its node certificate, and the control plane's tracker (llmgw.server.links.tracker) over a
registry of those nodes; the test Hub (testlib.hubserver) is the source. One node downloads the
file from the source; the others take it in pieces from it and from each other; a corrupt peer
is named and avoided, a peer that goes away costs nothing, a cut source resumes, and a part
resumes after a restart of its node."""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest
import trio

from agent import pieces
from agent.peers import Members, Peer, PeerClient, PeerFailed, PeerServer, PeerUnreachable, peer_ssl_context
from agent.swarm import PER_PEER, Answer, Peering
from agent.weights import WeightsStore, blob_of
from agent.weights_report import held_now
from llmgw import weightpieces
from llmgw.pki.ca import new_ca
from llmgw.pki.files import NodePaths, issue_gateway_to_dir, issue_to_dir
from llmgw.pki.files import _node_files as node_paths_in
from llmgw.server.links.tracker import Tracker
from llmgw.server.state.registry import AgentLinkRecord, NodeRegistry
from llmgw.wire import agent_link as w
from testlib.hubrepo import HubRepo
from testlib.hubrepos import weights_source
from testlib.hubserver import HubServer

SIZE = 5 * weightpieces.PIECE_MIN + 12345  # 6 pieces of 1 MiB, the last short
CONTENT = b"".join(hashlib.sha256(i.to_bytes(4, "big")).digest() for i in range(SIZE // 32 + 1))[:SIZE]
REPO = "org/swarm-GGUF"
FILE = "m-Q8_0.gguf"
NODES = ("node-a", "node-b", "node-c")


@pytest.fixture
def hub() -> Iterator[HubServer]:
    with HubServer([HubRepo(REPO, {FILE: CONTENT})]) as server:
        yield server


@pytest.fixture
def ca():
    return new_ca(validity_days=3)


def node_files(tmp_path: Path, ca, node: str) -> NodePaths:
    return issue_to_dir(ca, node, tmp_path / "pki" / node, validity_days=3)


class InProcessTracker:
    """The control plane's tracker, asked directly (the agent port's route is tested with the
    control plane): each ask as `node` would make it over HTTPS."""

    def __init__(self, tracker: Tracker, node: str) -> None:
        self.tracker, self.node = tracker, node

    def ask(self, digest: str, unreachable: set[str]) -> Answer:
        data = json.loads(json.dumps(self.tracker.ask(self.node, digest, frozenset(unreachable))))
        return Answer(
            origin=data["origin"],
            authority=data["authority"],
            peers=tuple(
                Peer(node=p["node"], address=p["address"], port=p["port"], complete=p["complete"])
                for p in data["peers"]
            ),
            members=frozenset(data["members"]),
        )


@attrs.define
class Node:
    name: str
    store: WeightsStore
    server: PeerServer
    scope: trio.CancelScope


class Cluster:
    """Nodes on loopback, each a WeightsStore and its PeerServer, known to one registry."""

    def __init__(self, tmp_path: Path, ca, nursery: trio.Nursery) -> None:
        self.tmp_path, self.ca, self.nursery = tmp_path, ca, nursery
        self.registry = NodeRegistry(heartbeat_ttl_s=1e9, started_at=0.0)
        self.tracker = Tracker(self.registry, time.monotonic)
        self.nodes: dict[str, Node] = {}

    async def start(self, name: str) -> Node:
        d = self.tmp_path / "pki" / name
        files = node_files(self.tmp_path, self.ca, name) if not d.exists() else node_paths_in(d)
        members = Members()
        store = WeightsStore(self.tmp_path / name / "weights")
        store.peering = Peering(
            node_id=name,
            tracker=InProcessTracker(self.tracker, name),  # type: ignore[arg-type]
            client=PeerClient(files.ca_cert, files.cert, files.key),
            members=members,
        )
        server = PeerServer(store.offer, peer_ssl_context(files), members)
        scope = trio.CancelScope()

        async def run(task_status=trio.TASK_STATUS_IGNORED) -> None:
            with scope:
                await server.serve(0, task_status=task_status)

        port = await self.nursery.start(run)
        store.serve_port = port
        node = self.registry.know(name, address="127.0.0.1")
        node.weights = w.WeightsHeld(port=port)
        # Joined: a link with a heartbeat (the registry's TTL is longer than the test).
        hello = w.Hello(
            protocol_version=w.PROTOCOL_VERSION,
            node_id=name,
            agent_version="t",
            boot_id="b",
            started_at=0.0,
            inventory=_inventory(),
        )
        node.link = AgentLinkRecord(
            conn_id=1,
            address="127.0.0.1",
            hello=hello,
            cert_serial=1,
            cert_not_after=0.0,
            connected_at=0.0,
            last_heartbeat_at=1e8,
        )
        self.nodes[name] = Node(name=name, store=store, server=server, scope=scope)
        return self.nodes[name]

    def report(self, name: str) -> None:
        """The node's weights report, as its agent sends it every few seconds."""
        self.registry.nodes[name].weights = held_now(self.nodes[name].store)

    def stop(self, name: str) -> None:
        self.nodes[name].scope.cancel()
        self.registry.nodes[name].link = None


def _inventory() -> w.Inventory:
    return w.Inventory(hostname="h", os="linux", arch="x86_64", python="3.11", cpu_model="c", cpu_cores=1)


@pytest.mark.trio
async def test_one_node_downloads_from_the_source_the_others_from_it(hub: HubServer, tmp_path: Path, ca) -> None:
    source = weights_source(hub, REPO, FILE)
    async with trio.open_nursery() as nursery:
        cluster = Cluster(tmp_path, ca, nursery)
        nodes = [await cluster.start(n) for n in NODES]
        async with trio.open_nursery() as fetching:
            for node in nodes:
                fetching.start_soon(node.store.prepare, source)
        for node in nodes:
            blob = blob_of(node.store.root, source.files[0])
            assert blob.read_bytes() == CONTENT
            assert not pieces.part_of(blob).exists() and not pieces.state_of(blob).exists()
        nursery.cancel_scope.cancel()
    # The file crossed the "internet" once: the bytes the Hub sent are the file's, once.
    assert hub.log.bytes_sent(FILE) == SIZE
    assert sum(n.store.peering.source_bytes for n in nodes) == SIZE
    assert sum(n.store.peering.peer_bytes for n in nodes) == 2 * SIZE
    assert cluster.tracker.origins_chosen == 1


def test_piece_geometry_is_the_same_everywhere() -> None:
    assert weightpieces.piece_size(2 << 30) == 16 << 20 and weightpieces.piece_count(2 << 30) == 128
    assert weightpieces.piece_size(100 << 20) == 1 << 20 and weightpieces.piece_count(100 << 20) == 100
    assert weightpieces.span(5, SIZE) == (5 << 20, 12345)
    assert weightpieces.piece_of(5 << 20, 12345, SIZE) == 5 and weightpieces.piece_of(5 << 20, 100, SIZE) is None


async def held_whole(cluster: Cluster, name: str, source: w.WeightsSource) -> Path:
    """`name` fetches the file (alone, or from the others) and reports it held."""
    await cluster.nodes[name].store.prepare(source)
    cluster.report(name)
    return blob_of(cluster.nodes[name].store.root, source.files[0])


@pytest.mark.trio
async def test_a_peer_sending_corrupt_pieces_is_named_and_avoided(
    hub: HubServer, tmp_path: Path, ca, caplog: pytest.LogCaptureFixture
) -> None:
    source = weights_source(hub, REPO, FILE)
    async with trio.open_nursery() as nursery:
        cluster = Cluster(tmp_path, ca, nursery)
        for n in NODES:
            await cluster.start(n)
        await held_whole(cluster, "node-a", source)
        bad = await held_whole(cluster, "node-b", source)
        # node-b's disk rots: every byte of its copy flipped (its size and piece list unchanged).
        bad.write_bytes(bytes(b ^ 0xFF for b in bad.read_bytes()))
        with caplog.at_level(logging.WARNING, logger="llmgw.agent.weights"):
            got = await held_whole(cluster, "node-c", source)
        nursery.cancel_scope.cancel()
    assert got.read_bytes() == CONTENT
    named = [r for r in caplog.records if r.getMessage() == "weights_peer_corrupt"]
    assert named and {r.llmgw_fields["peer"] for r in named} == {"node-b"}, caplog.records  # type: ignore[attr-defined]
    assert len(named) <= PER_PEER  # avoided after the first wrong piece (those already asked arrive too)
    assert hub.log.bytes_sent(FILE) == SIZE  # nothing more from the source


@pytest.mark.trio
async def test_a_peer_gone_costs_nothing(hub: HubServer, tmp_path: Path, ca) -> None:
    source = weights_source(hub, REPO, FILE)
    async with trio.open_nursery() as nursery:
        cluster = Cluster(tmp_path, ca, nursery)
        for n in NODES:
            await cluster.start(n)
        await held_whole(cluster, "node-a", source)
        await held_whole(cluster, "node-b", source)
        cluster.nodes["node-a"].scope.cancel()  # its port closes; the control plane does not know yet
        got = await held_whole(cluster, "node-c", source)
        nursery.cancel_scope.cancel()
    assert got.read_bytes() == CONTENT
    assert hub.log.bytes_sent(FILE) == SIZE


@pytest.mark.trio
async def test_a_cut_source_resumes_where_it_broke_off(
    hub: HubServer, tmp_path: Path, ca, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("agent.swarm.SOURCE_RETRY_S", 0.05)
    source = weights_source(hub, REPO, FILE)
    hub.faults.cut(FILE, after=2 * weightpieces.PIECE_MIN + 1000, times=2)
    async with trio.open_nursery() as nursery:
        cluster = Cluster(tmp_path, ca, nursery)
        for n in NODES[:2]:
            await cluster.start(n)
        async with trio.open_nursery() as fetching:
            for n in NODES[:2]:
                fetching.start_soon(cluster.nodes[n].store.prepare, source)
        nursery.cancel_scope.cancel()
    for n in NODES[:2]:
        assert blob_of(cluster.nodes[n].store.root, source.files[0]).read_bytes() == CONTENT
    # Each cut costs at most the piece it broke: the next request starts at the first piece missing.
    assert SIZE < hub.log.bytes_sent(FILE) <= SIZE + 2 * weightpieces.PIECE_MIN


@pytest.mark.trio
async def test_a_download_cut_off_resumes_from_its_pieces(
    hub: HubServer, tmp_path: Path, ca, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("agent.swarm.SYNC_S", 0.01)
    source = weights_source(hub, REPO, FILE)
    stall = hub.faults.stall(FILE, after=3 * weightpieces.PIECE_MIN + 10)
    async with trio.open_nursery() as nursery:
        cluster = Cluster(tmp_path, ca, nursery)
        node = await cluster.start("node-a")
        blob = blob_of(node.store.root, source.files[0])
        with trio.move_on_after(30):
            async with trio.open_nursery() as fetching:
                fetching.start_soon(node.store.prepare, source)
                await trio.to_thread.run_sync(stall.wait_reached)
                while listed(blob) < 3:
                    await trio.sleep(0.01)
                fetching.cancel_scope.cancel()  # the agent stops: three pieces are on disk and listed
        stall.release()
        # The agent starts again, with a new store over the same directory.
        cluster.stop("node-a")
        again = await cluster.start("node-a")
        await again.store.prepare(source)
        nursery.cancel_scope.cancel()
    assert blob.read_bytes() == CONTENT
    # The agent started again asked the source for what its three pieces do not cover, once.
    ranges = [r.range for r in hub.log.requests(kind="cdn", path=FILE)]
    assert ranges == [f"bytes=0-{SIZE - 1}", f"bytes={3 * weightpieces.PIECE_MIN}-{SIZE - 1}"], ranges


def listed(blob: Path) -> int:
    """Pieces the download's state file lists (0 before it is written)."""
    try:
        return len(json.loads(pieces.state_of(blob).read_text())["pieces"])
    except FileNotFoundError:
        return 0


def test_a_disk_too_small_says_so_before_a_byte_moves(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(pieces.os, "posix_fallocate", full)
    blob = tmp_path / ("a" * 64) / "m.gguf"
    with pytest.raises(pieces.DiskFull, match=r"needs 512.0 MiB .* nothing partial is used"):
        pieces.Part.open(blob, 1 << 29)
    assert not pieces.part_of(blob).exists() and not pieces.state_of(blob).exists()


@pytest.mark.trio
async def test_the_weights_port_serves_node_certificates_of_members_only(hub: HubServer, tmp_path: Path, ca) -> None:
    source = weights_source(hub, REPO, FILE)
    digest = source.files[0].sha256
    async with trio.open_nursery() as nursery:
        cluster = Cluster(tmp_path, ca, nursery)
        a = await cluster.start("node-a")
        await held_whole(cluster, "node-a", source)
        peer = Peer(node="node-a", address="127.0.0.1", port=a.store.serve_port)
        files = node_files(tmp_path, ca, "node-x")
        member = PeerClient(files.ca_cert, files.cert, files.key)
        a.server.members.ids = frozenset({*NODES, "node-x"})  # as the tracker's last answer listed them
        got = await trio.to_thread.run_sync(lambda: member.pieces(peer, digest, hashes=True))
        assert got["complete"] and len(got["hashes"]) == weightpieces.piece_count(SIZE)
        # Once the tracker has listed the members, a node it does not list (removed) is refused.
        a.server.members.ids = frozenset(NODES)
        fresh = PeerClient(files.ca_cert, files.cert, files.key)
        with pytest.raises(PeerUnreachable, match="refuses this node: this node serves weights to the nodes of its"):
            await trio.to_thread.run_sync(lambda: fresh.pieces(peer, digest, hashes=False))
        # A gateway's certificate, of the same CA, is refused too.
        gw = issue_gateway_to_dir(ca, "gw-1", tmp_path / "gw", validity_days=3)
        gateway = PeerClient(gw.ca_cert, gw.cert, gw.key)
        with pytest.raises(PeerUnreachable, match="refuses this node"):
            await trio.to_thread.run_sync(lambda: gateway.pieces(peer, digest, hashes=False))
        # Another CA's node with the same name: refused by the TLS handshake.
        other = node_files(tmp_path / "other", new_ca(validity_days=3), "node-b")
        stranger = PeerClient(other.ca_cert, other.cert, other.key)
        with pytest.raises(PeerFailed):
            await trio.to_thread.run_sync(lambda: stranger.pieces(peer, digest, hashes=False))
        # And a server that is not the node named is refused by the client.
        wrong = Peer(node="node-b", address="127.0.0.1", port=a.store.serve_port)
        b_files = node_files(tmp_path, ca, "node-b")
        with pytest.raises(PeerFailed, match="not node 'node-b'"):
            await trio.to_thread.run_sync(
                lambda: PeerClient(b_files.ca_cert, b_files.cert, b_files.key).pieces(wrong, digest, hashes=False)
            )
        nursery.cancel_scope.cancel()
