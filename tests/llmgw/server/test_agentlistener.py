"""The agent port's routes once TLS is done (`AgentListener.serve_peer`), over memory streams on
MockClock: its HTTP is the shared server's (a whole head past the limit is 431, as on the
gateway's port), a peer without a certificate gets the release files and nothing else, its head
is due by the handshake's deadline and until it is routed it may be closed for a newcomer; a
node's revoked certificate is refused at the mirror, and at the weights tracker as at the mirror.
The real sockets and TLS are tests/llmgw/server/test_agentport_budgets.py's and
tests/agent/test_link.py's; the tracker's choices, tests/llmgw/server/test_tracker.py's."""

from __future__ import annotations

import hashlib
import json
import logging
from datetime import datetime, timedelta, timezone
from pathlib import Path

import attrs
import pytest
import trio
import trio.testing

from llmgw.http.send import LINGER_S
from llmgw.pki.ca import ROLE_GATEWAY, CertInfo
from llmgw.server.links.agentlistener import (
    HANDSHAKE_TIMEOUT_S,
    LISTENER,
    NO_CERTIFICATE_CLIENT,
    NO_GATEWAY_LINK,
    AgentListener,
    Place,
)
from llmgw.server.links.tracker import Tracker
from llmgw.server.nodes.artifacts import Artifacts
from llmgw.server.nodes.releases import Releases
from llmgw.server.state.registry import NodeRegistry
from llmgw.wire import agent_link as w
from testlib.controlplane import hello
from testlib.httpexchange import converse

pytestmark = pytest.mark.trio

NOW = datetime.now(timezone.utc)
CERT = CertInfo(
    subject="CN=node-a",
    issuer="CN=llmgw",
    common_name="node-a",
    serial=0xA1,
    fingerprint_sha256="",
    not_before=NOW - timedelta(days=1),
    not_after=NOW + timedelta(days=30),
)
SUMS = "SHA256SUMS"
RELEASE = "llmgw-0.3.0-linux-amd64.pyz"
ARCHIVE = b"an engine archive" * 100


class Store:
    def __init__(self) -> None:
        self.revoked: set[int] = set()

    async def is_revoked(self, serial: int) -> bool:
        await trio.lowlevel.checkpoint()
        return serial in self.revoked


@pytest.fixture
def port(tmp_path: Path) -> AgentListener:
    releases = tmp_path / "release"
    releases.mkdir()
    (releases / RELEASE).write_bytes(b"zipapp")
    (releases / SUMS).write_text(f"{hashlib.sha256(b'zipapp').hexdigest()}  {RELEASE}\n")
    mirror = tmp_path / "artifacts"
    mirror.mkdir()
    (mirror / "engine.tar.gz").write_bytes(ARCHIVE)
    return AgentListener(
        store=Store(),
        artifact_store=Artifacts(mirror),
        release_files=Releases(directory=releases, running=None),
        max_connections=4,
        weights_tracker=Tracker(NodeRegistry(heartbeat_ttl_s=30.0, started_at=0.0), lambda: 1.0),
    )


def get(target: str) -> bytes:
    return f"GET {target} HTTP/1.1\r\nhost: cp\r\n\r\n".encode()


async def test_a_peer_without_a_certificate_gets_the_release_files_and_nothing_else(
    port: AgentListener, caplog: pytest.LogCaptureFixture
) -> None:
    answered = await converse(lambda s: port.serve_peer(s, None, "10.0.0.9"), get(f"/v1/release/{SUMS}"))
    assert answered.status == 200 and RELEASE.encode() in answered.body
    answered = await converse(lambda s: port.serve_peer(s, None, "10.0.0.9"), get(f"/v1/release/{RELEASE}"))
    assert answered.status == 200 and answered.body == b"zipapp"
    for target in ("/v1/agent", "/v1/artifacts/" + hashlib.sha256(ARCHIVE).hexdigest()):
        answered = await converse(lambda s: port.serve_peer(s, None, "10.0.0.9"), get(target))
        assert answered.status == 403 and answered.body == NO_CERTIFICATE_CLIENT.encode() + b"\n"
    assert port.stats.aborted.get(listener=LISTENER, reason="tls") == 2
    refused = [r.llmgw_fields for r in caplog.records if r.getMessage() == "agent_refused"]
    assert [r["stage"] for r in refused] == ["tls", "tls"]


async def test_a_node_gets_the_mirror_until_its_certificate_is_revoked(port: AgentListener) -> None:
    target = "/v1/artifacts/" + hashlib.sha256(ARCHIVE).hexdigest()
    answered = await converse(lambda s: port.serve_peer(s, CERT, "10.0.0.1"), get(target))
    assert answered.status == 200 and answered.body == ARCHIVE
    port.store.revoked.add(CERT.serial)
    answered = await converse(lambda s: port.serve_peer(s, CERT, "10.0.0.1"), get(target))
    assert answered.status == 403 and b"was revoked" in answered.body
    assert port.agents_open == 0  # each connection's place given back


async def test_a_gateway_certificate_gets_no_mirror_and_a_port_without_a_gateway_link_says_so(
    port: AgentListener,
) -> None:
    gateway = attrs.evolve(CERT, common_name="gw1", role=ROLE_GATEWAY)
    target = "/v1/artifacts/" + hashlib.sha256(ARCHIVE).hexdigest()
    answered = await converse(lambda s: port.serve_peer(s, gateway, "10.0.0.1"), get(target))
    assert answered.status == 403 and b"is not a node certificate (its role: llmgw-gateway)" in answered.body
    answered = await converse(lambda s: port.serve_peer(s, gateway, "10.0.0.1"), get("/v1/gateway"))
    assert answered.status == 404 and answered.body == NO_GATEWAY_LINK.encode() + b"\n"


async def test_a_whole_head_past_the_limit_is_431_as_on_every_port(port: AgentListener) -> None:
    head = b"GET /v1/agent HTTP/1.1\r\nhost: cp\r\nx-big: " + b"a" * port.limits.max_head_bytes + b"\r\n\r\n"
    answered = await converse(lambda s: port.serve_peer(s, CERT, "10.0.0.1"), head)
    assert answered.status == 431, answered
    assert port.stats.aborted.get(listener=LISTENER, reason="too_large") == 1


async def test_a_peer_without_a_certificate_sends_its_head_by_the_handshakes_deadline(
    port: AgentListener, autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    started = trio.current_time()
    answered = await converse(
        lambda s: port.serve_peer(s, None, "10.0.0.9", deadline=started + HANDSHAKE_TIMEOUT_S), b"GET /v1/rel"
    )
    assert answered.status == 408  # a head begun and not finished: told, then the linger
    assert HANDSHAKE_TIMEOUT_S <= trio.current_time() - started <= HANDSHAKE_TIMEOUT_S + LINGER_S
    assert port.stats.aborted.get(listener=LISTENER, reason="head_timeout") == 1
    [closed] = [r.llmgw_fields for r in caplog.records if r.getMessage() == "agent_link_closed"]
    assert closed["reason"] == "head_timeout" and closed["cn"] == "-"


async def test_a_peer_without_a_certificate_may_be_closed_for_a_newcomer_until_it_is_routed(
    port: AgentListener, autojump_clock: trio.testing.MockClock
) -> None:
    # Silent after its handshake: the oldest waiting, closed to make room.
    client, server = trio.testing.memory_stream_pair()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(lambda: port.serve_peer(server, None, "10.0.0.9", place=Place(port, unproven=False)))
        await trio.testing.wait_all_tasks_blocked()
        assert port.unproven_idle.shed_oldest() == "10.0.0.9"
    assert await client.receive_some() == b""  # closed without a word, at once
    # Routed to the release files: no longer one to close for a newcomer.
    client, server = trio.testing.memory_stream_pair()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(lambda: port.serve_peer(server, None, "10.0.0.9"))
        await client.send_all(get(f"/v1/release/{RELEASE}"))
        answer = b""
        while b"zipapp" not in answer:
            answer += await client.receive_some()
        assert port.unproven_idle.shed_oldest() is None
        nursery.cancel_scope.cancel()


SHA = "5e" * 32  # a weights file's digest, asked of the tracker


def mirror_and_tracker() -> list[str]:
    return ["/v1/artifacts/" + hashlib.sha256(ARCHIVE).hexdigest(), w.PEERS_PREFIX + SHA]


async def test_a_node_asks_the_weights_tracker_with_its_certificate(port: AgentListener) -> None:
    assert port.tracker is not None
    registry = port.tracker.registry
    for node, address in (("node-a", "10.0.0.1"), ("node-b", "10.0.0.2"), ("node-h", "10.0.0.3")):
        conn = registry.connect(hello(node), address=address, cert_serial=1, cert_not_after=2e9, now=1.0)
        registry.heartbeat(node, conn, 1.0)  # joined, serving weights; node-h holds the file whole
        held = (w.HeldFile(sha256=SHA, size=10, complete=True),) if node == "node-h" else ()
        registry.weights_changed(node, conn, w.WeightsHeld(files=held, port=7000))
    node_b = attrs.evolve(CERT, common_name="node-b", serial=0xB2)

    async def ask(cert: CertInfo, target: str) -> dict:
        answered = await converse(lambda s: port.serve_peer(s, cert, "10.0.0.1"), get(target))
        assert answered.status == 200 and answered.headers[b"content-type"].startswith(b"application/json")
        return json.loads(answered.body)

    # The asker is the one its certificate names (node-a), and node-h is its authority.
    answer = await ask(CERT, w.PEERS_PREFIX + SHA)
    assert answer == {
        "origin": False,
        "authority": "node-h",
        "peers": [{"node": "node-h", "address": "10.0.0.3", "port": 7000, "complete": True}],
        "members": ["node-a", "node-b", "node-h"],
    }
    # The nodes the asker could not reach, in the query: node-b cannot reach the holder, so it
    # fetches the file from its source.
    answer = await ask(node_b, w.PEERS_PREFIX + SHA + "?unreachable=node-h,node-x")
    assert answer["origin"] is True and answer["authority"] == "node-b"
    assert port.agents_open == 0


@pytest.mark.parametrize("target", mirror_and_tracker())
async def test_the_tracker_refuses_whom_the_mirror_refuses(port: AgentListener, target: str) -> None:
    gateway = attrs.evolve(CERT, common_name="gw1", role=ROLE_GATEWAY)
    answered = await converse(lambda s: port.serve_peer(s, gateway, "10.0.0.1"), get(target))
    assert answered.status == 403 and b"is not a node certificate (its role: llmgw-gateway)" in answered.body
    answered = await converse(lambda s: port.serve_peer(s, None, "10.0.0.9"), get(target))
    assert answered.status == 403 and answered.body == NO_CERTIFICATE_CLIENT.encode() + b"\n"
    port.store.revoked.add(CERT.serial)
    answered = await converse(lambda s: port.serve_peer(s, CERT, "10.0.0.1"), get(target))
    assert answered.status == 403 and b"was revoked" in answered.body
    assert port.tracker is not None and port.tracker.files == {}  # none of them was heard
    assert port.agents_open == 0


@pytest.mark.parametrize(
    "sha",
    ["5E" * 32, "5e" * 31, "5e" * 33, "5e" * 31 + "zz", "", "../" + "5e" * 32, "%35" + "e" + "5e" * 31],
)
async def test_the_tracker_answers_a_bad_sha256_with_its_form(port: AgentListener, sha: str) -> None:
    answered = await converse(lambda s: port.serve_peer(s, CERT, "10.0.0.1"), get(w.PEERS_PREFIX + sha))
    assert answered.status == 404, answered
    assert answered.body == b"ask for a file by its sha256: /v1/weights/peers/SHA256 (64 hex digits)\n"
    assert port.tracker is not None and port.tracker.files == {}


async def test_the_tracker_takes_get_only_and_a_control_plane_without_one_says_so(port: AgentListener) -> None:
    answered = await converse(
        lambda s: port.serve_peer(s, CERT, "10.0.0.1"),
        f"POST {w.PEERS_PREFIX}{SHA} HTTP/1.1\r\nhost: cp\r\ncontent-length: 0\r\n\r\n".encode(),
    )
    assert answered.status == 405 and answered.headers[b"allow"] == b"GET, HEAD"
    port.tracker = None
    answered = await converse(lambda s: port.serve_peer(s, CERT, "10.0.0.1"), get(w.PEERS_PREFIX + SHA))
    assert answered.status == 404 and answered.body == b"this control plane tracks no weights\n"
