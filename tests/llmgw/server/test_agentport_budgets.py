"""The agent port's budgets on real loopback sockets, against the real control plane: connections
that have shown no client certificate have a small budget of their own, where the oldest makes
room for the newest, so a certified agent gets in whatever bare connections hold; agents past
`max_agent_connections` are told 503 with Retry-After; a flood of bare connections is logged
in a handful of lines."""

from __future__ import annotations

import logging
import ssl
from pathlib import Path

import attrs
import pytest
import trio

from llmgw.config import HttpSection, ServerConfig, ServerSection
from llmgw.http.fdlimits import unproven_budget
from llmgw.http.refusals import RefusalLog
from llmgw.pki.ca import CA
from llmgw.pki.files import NodePaths, issue_to_dir
from llmgw.pki.tls import client_ssl_context
from llmgw.server.app import ControlPlane
from llmgw.server.links.agentlistener import AGENTS_FULL_RETRY_S, LISTENER, UNPROVEN_SILENT_S
from llmgw.wire import agent_link as w
from testlib.controlplane import OFFLINE_ENGINES, make_state

pytestmark = pytest.mark.trio

WITHIN_S = 1.0  # the done-when of the issue: an agent's link is accepted within a second


@attrs.frozen
class Port:
    plane: ControlPlane
    ca: CA
    state: Path
    host: str
    port: int

    def stat(self, family: str, **labels: str) -> float:
        return getattr(self.plane.connections, family).get(listener=LISTENER, **labels)


async def start(tmp_path: Path, nursery: trio.Nursery, *, max_agent_connections: int, refusals=None) -> Port:
    state = tmp_path / "cp"
    ca = make_state(state)
    config = ServerConfig(
        engines=OFFLINE_ENGINES,
        server=ServerSection(state_dir=str(state), agent_listen="127.0.0.1:0", http_listen="127.0.0.1:0"),
        http=HttpSection(max_agent_connections=max_agent_connections),
    )
    plane = ControlPlane.open(config, state)
    if refusals is not None:
        plane.agent_port.refusals = refusals
    bound = await nursery.start(plane.serve)
    host, port = bound.agent_address
    return Port(plane=plane, ca=ca, state=state, host=host, port=port)


def node(port: Port, tmp_path: Path, node_id: str) -> NodePaths:
    return issue_to_dir(port.ca, node_id, tmp_path / f"node-{node_id}", validity_days=3)


async def upgrade(port: Port, files: NodePaths, node_id: str) -> tuple[trio.SSLStream, bytes]:
    """A certified agent's TLS handshake and WebSocket upgrade request; the stream and the head
    of the answer."""
    ctx = client_ssl_context(files.ca_cert, files.cert, files.key)
    stream = await trio.open_ssl_over_tcp_stream(port.host, port.port, ssl_context=ctx)
    await stream.send_all(
        (
            f"GET {w.AGENT_PATH} HTTP/1.1\r\nhost: x\r\nupgrade: websocket\r\nconnection: Upgrade\r\n"
            f"sec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\nsec-websocket-version: 13\r\n"
            f"{w.NODE_ID_HEADER}: {node_id}\r\n\r\n"
        ).encode()
    )
    answer = b""
    while b"\r\n\r\n" not in answer:
        chunk = await stream.receive_some(65536)
        assert chunk, answer
        answer += chunk
    return stream, answer


async def test_a_certified_agent_gets_in_at_once_whatever_silent_bare_connections_hold(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    port = await start(tmp_path, nursery, max_agent_connections=16)
    unproven_limit = unproven_budget(16)
    assert port.plane.connections.unproven_limit.get(listener=LISTENER) == unproven_limit == 8
    files = node(port, tmp_path, "node-a")
    held: list[trio.abc.Stream] = []
    for _ in range(40):  # no TLS at all
        held.append(await trio.open_tcp_stream(port.host, port.port))
    no_cert = ssl.create_default_context(cafile=str(files.ca_cert))
    refused = 0
    for _ in range(20):  # TLS without a certificate, then silence
        tcp = await trio.open_tcp_stream(port.host, port.port)
        tls = trio.SSLStream(tcp, no_cert, server_hostname=port.host)
        try:
            await tls.do_handshake()
        except trio.BrokenResourceError:
            refused += 1  # turned away: the places were taken by peers heard from just now
        held.append(tls)
    # The first ones took the places; the rest were turned away at once, since the peers in the
    # places had been heard from within UNPROVEN_SILENT_S (as a thousand agents in their
    # handshakes after a cut are: none of them loses its place to a newcomer).
    with trio.fail_after(10):
        while port.stat("shed", reason="busy") < 60 - unproven_limit:
            await trio.sleep(0.01)
    assert port.stat("shed", reason="unproven") == 0 and refused == 20
    await trio.sleep(UNPROVEN_SILENT_S)  # silent that long: idle, a newcomer's to take

    started = trio.current_time()
    with trio.fail_after(10):
        link, answer = await upgrade(port, files, "node-a")
    took = trio.current_time() - started
    assert answer.startswith(b"HTTP/1.1 101 "), answer
    assert took < WITHIN_S, took
    assert port.stat("unproven") <= unproven_limit
    assert port.stat("shed", reason="unproven") == 1  # the silent one that made room
    assert port.stat("aborted", reason="tls") == 0
    for stream in [*held, link]:
        await trio.aclose_forcefully(stream)


async def test_an_agent_past_max_agent_connections_is_told_503_with_retry_after(
    tmp_path: Path, nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    port = await start(tmp_path, nursery, max_agent_connections=1)
    first, answer = await upgrade(port, node(port, tmp_path, "node-a"), "node-a")
    assert answer.startswith(b"HTTP/1.1 101 "), answer
    second, answer = await upgrade(port, node(port, tmp_path, "node-b"), "node-b")
    assert answer.startswith(b"HTTP/1.1 503 "), answer
    assert f"\r\nretry-after: {AGENTS_FULL_RETRY_S}\r\n".encode() in answer
    assert b"max_agent_connections" in answer
    assert port.stat("shed", reason="agents_full") == 1
    [refused] = [r.llmgw_fields for r in caplog.records if r.getMessage() == "agent_refused"]
    assert refused["stage"] == "capacity" and refused["cn"] == "node-b"
    await trio.aclose_forcefully(first)  # its place comes back: the next agent gets in
    with trio.fail_after(5):
        while port.plane.agent_port.agents_open:
            await trio.sleep(0.01)
    third, answer = await upgrade(port, node(port, tmp_path, "node-c"), "node-c")
    assert answer.startswith(b"HTTP/1.1 101 "), answer
    for stream in (second, third):
        await trio.aclose_forcefully(stream)


async def test_a_flood_of_bare_connections_is_logged_in_a_handful_of_lines(
    tmp_path: Path, nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    refusals = RefusalLog(interval_s=5)  # the flood fits in one or two
    port = await start(tmp_path, nursery, max_agent_connections=16, refusals=refusals)
    flood = 300
    for i in range(flood):  # connect, then close: what a port scanner or a health check does
        stream = await trio.open_tcp_stream(port.host, port.port)
        if i % 2:
            await stream.send_all(b"\x16\x03\x01\x00\x05hello")  # a TLS record of nonsense
        await stream.aclose()

    def handled() -> float:
        return sum(port.plane.connections.aborted.values.values()) + sum(port.plane.connections.shed.values.values())

    with trio.fail_after(20):
        while handled() < flood:
            await trio.sleep(0.05)
        while not [r for r in caplog.records if r.getMessage() == "connections_refused"]:
            await trio.sleep(0.05)
    lines = [r for r in caplog.records if r.levelno >= logging.INFO and r.name in ("llmgw.endpoint", "llmgw.listeners")]
    assert len(lines) <= 15, [(r.getMessage(), r.llmgw_fields) for r in lines]
    summaries = [r.llmgw_fields for r in lines if r.getMessage() == "connections_refused"]
    assert sum(s["count"] for s in summaries) >= flood // 2  # the summaries account for the flood
    assert all(set(s["networks"]) <= {"127.0.0.0/24"} for s in summaries), summaries
    assert all(s["listener"] == LISTENER for s in summaries)
