"""The agent link on real loopback sockets, against the real control plane's agent port.

Every refusal is checked on both sides: the control plane logs `agent_refused` with the reason,
and the agent's session fails at once (well inside its 10 s connect timeout) with a reason that
says what is wrong and how to fix it.
"""

from __future__ import annotations

import logging
import random
import ssl
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import attrs
import pytest
import trio
import trio_websocket

from agent.link import AgentLink, Target
from llmgw.backoff import Backoff
from llmgw.config import ServerConfig, ServerSection
from llmgw.pki.ca import CA, cert_info
from llmgw.pki.files import NodePaths, ca_paths, init_ca, issue_to_dir, load_ca, load_cert
from llmgw.pki.tls import client_ssl_context
from llmgw.server.app import ControlPlane
from llmgw.server.errors import StoreBusy
from llmgw.wire import agent_link as w
from llmgw.wire.convert import decode, encode
from testlib.controlplane import OFFLINE_ENGINES, make_state
from testlib.waiting import await_true

pytestmark = pytest.mark.trio

REFUSAL_DEADLINE_S = 5  # far below CONNECT_TIMEOUT_S: a refusal must not wait for a timeout


@attrs.frozen
class Plane:
    state: Path
    ca: CA
    host: str
    port: int
    plane: ControlPlane


def hello_for(node_id: str):
    def make() -> w.Hello:
        return w.Hello(
            protocol_version=w.PROTOCOL_VERSION,
            node_id=node_id,
            agent_version="test",
            boot_id="boot",
            started_at=1.0,
            inventory=w.Inventory(
                hostname=node_id, os="linux", arch="x86_64", python="3.11", cpu_model="c", cpu_cores=1
            ),
        )

    return make


async def start_plane(
    state: Path, nursery: trio.Nursery, *, listen: str, sans: list[str], heartbeat_ttl_s: float = 5
) -> Plane:
    ca = make_state(state, sans=sans, days=30)
    config = ServerConfig(
        engines=OFFLINE_ENGINES,
        server=ServerSection(
            state_dir=str(state),
            agent_listen=f"{listen}:0",
            http_listen="127.0.0.1:0",
            heartbeat_interval_s=0.05,
            heartbeat_ttl_s=heartbeat_ttl_s,
        ),
    )
    control_plane = ControlPlane.open(config, state)
    bound = await nursery.start(control_plane.serve)
    host, port = bound.agent_address
    return Plane(state=state, ca=ca, host=host, port=port, plane=control_plane)


@pytest.fixture
async def plane(tmp_path: Path, nursery: trio.Nursery) -> Plane:
    return await start_plane(tmp_path / "cp", nursery, listen="127.0.0.1", sans=["127.0.0.1"])


def node_files(plane: Plane, tmp_path: Path, node_id: str, **kw) -> NodePaths:
    return issue_to_dir(
        plane.ca,
        node_id,
        tmp_path / f"node-{node_id}-{len(list(tmp_path.iterdir()))}",
        validity_days=kw.pop("days", 30),
        **kw,
    )


def link_for(plane: Plane, node_id: str, ctx: ssl.SSLContext, *, host: str | None = None) -> AgentLink:
    return AgentLink(
        target=Target(host=host or plane.host, port=plane.port),
        node_id=node_id,
        ssl_context=ctx,
        make_hello=hello_for(node_id),
        backoff=Backoff(first_s=0.01, max_s=0.05, jitter=True),
    )


async def session_failure(link: AgentLink) -> str:
    with trio.fail_after(REFUSAL_DEADLINE_S):
        try:
            await link.run_session()
        except Exception as exc:  # noqa: BLE001 - what the agent would log
            return link.reason_of(exc)
    raise AssertionError("the session ended without a failure")


def server_refusals(caplog: pytest.LogCaptureFixture) -> list[dict]:
    return [r.llmgw_fields for r in caplog.records if r.getMessage() == "agent_refused"]


async def test_a_node_with_a_good_certificate_joins(plane: Plane, tmp_path: Path, nursery: trio.Nursery) -> None:
    files = node_files(plane, tmp_path, "node-a")
    link = link_for(plane, "node-a", client_ssl_context(files.ca_cert, files.cert, files.key))
    nursery.start_soon(link.serve)
    registry = plane.plane.registry
    await await_true(
        lambda: "node-a" in registry.nodes
        and registry.liveness(registry.nodes["node-a"], trio.current_time()) == "joined",
        "join",
    )
    assert link.state.connected and link.state.desired is not None


async def test_the_links_local_address_is_the_nodes_address_as_the_control_plane_sees_it(
    plane: Plane, tmp_path: Path, nursery: trio.Nursery
) -> None:
    # Where the engines listen (the link's local address) is where the gateway dials them (the peer's).
    files = node_files(plane, tmp_path, "node-a")
    link = AgentLink(
        target=Target(host=plane.host, port=plane.port),
        node_id="node-a",
        ssl_context=client_ssl_context(files.ca_cert, files.cert, files.key),
        make_hello=hello_for("node-a"),
        source_address="127.0.0.5",
    )
    assert link.address.current == ""  # not known before the first connect
    nursery.start_soon(link.serve)
    with trio.fail_after(5):
        assert await link.address.wait_known() == "127.0.0.5"
    registry = plane.plane.registry
    await await_true(lambda: "node-a" in registry.nodes and registry.nodes["node-a"].address, "the node's address")
    assert registry.nodes["node-a"].address == link.address.current


async def test_another_cas_certificate(plane: Plane, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    other_state = tmp_path / "other"
    init_ca(other_state, validity_days=30)
    files = issue_to_dir(load_ca(other_state), "node-a", tmp_path / "other-node", validity_days=30)
    trusted = ca_paths(plane.state).ca_cert  # the agent trusts the right CA; its own cert is foreign
    reason = await session_failure(link_for(plane, "node-a", client_ssl_context(trusted, files.cert, files.key)))
    assert "does not trust the CA that issued this node's certificate" in reason, reason
    [refused] = server_refusals(caplog)
    assert refused["stage"] == "tls" and "not issued by this cluster's CA" in refused["reason"], refused


async def test_cn_not_equal_to_the_claimed_node_id(
    plane: Plane, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    files = node_files(plane, tmp_path, "node-b")
    reason = await session_failure(link_for(plane, "node-a", client_ssl_context(files.ca_cert, files.cert, files.key)))
    assert "HTTP 403" in reason and "node id 'node-a' does not match its certificate CN 'node-b'" in reason
    [refused] = server_refusals(caplog)
    assert refused["stage"] == "identity" and "does not match its certificate CN 'node-b'" in refused["reason"]


async def test_an_expired_certificate(plane: Plane, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    long_ago = datetime.now(timezone.utc) - timedelta(days=10)
    files = node_files(plane, tmp_path, "node-a", days=1, now=long_ago)
    reason = await session_failure(link_for(plane, "node-a", client_ssl_context(files.ca_cert, files.cert, files.key)))
    assert "expired" in reason, reason
    [refused] = server_refusals(caplog)
    assert refused["stage"] == "tls" and "certificate has expired" in refused["reason"], refused


async def test_no_client_certificate(plane: Plane, caplog: pytest.LogCaptureFixture) -> None:
    ctx = ssl.create_default_context(cafile=str(ca_paths(plane.state).ca_cert))
    reason = await session_failure(link_for(plane, "node-a", ctx))
    assert "requires a node certificate and this agent sent none" in reason, reason
    [refused] = server_refusals(caplog)
    assert refused["stage"] == "tls" and "a client connected without a certificate" in refused["reason"], refused


async def test_a_revoked_certificate(plane: Plane, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    files = node_files(plane, tmp_path, "node-a")
    serial = cert_info(load_cert(files.cert)).serial
    await plane.plane.store.revoke_serial(serial, "node-a")
    reason = await session_failure(link_for(plane, "node-a", client_ssl_context(files.ca_cert, files.cert, files.key)))
    assert "HTTP 403" in reason and "was revoked by `llmgw node remove`" in reason
    [refused] = server_refusals(caplog)
    assert refused["stage"] == "identity" and f"serial {serial:x}" in refused["reason"]


class RefusingStore:
    """The control plane's store with the calls named in `refused` failing, as they do while
    the database is locked or damaged; everything else goes to the real store."""

    def __init__(self, store, refused: set[str]) -> None:
        self._store = store
        self.refused = refused

    def __getattr__(self, name: str):
        call = getattr(self._store, name)
        if name not in self.refused:
            return call

        async def refuse(*args, **kwargs):
            raise StoreBusy(self._store.path, self._store.busy_timeout_s)

        return refuse


async def test_a_revocation_check_the_store_cannot_answer_refuses_the_node_until_it_can(
    plane: Plane, tmp_path: Path, nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    store = RefusingStore(plane.plane.store, {"is_revoked", "saw_node"})
    plane.plane.agent_port.store = plane.plane.agent_links.store = store
    files = node_files(plane, tmp_path, "node-a")
    ctx = client_ssl_context(files.ca_cert, files.cert, files.key)
    reason = await session_failure(link_for(plane, "node-a", ctx))
    # Fails closed, at once, saying why; the agent retries by itself.
    assert "HTTP 503" in reason and "database is busy" in reason and "the agent retries" in reason, reason
    [refused] = server_refusals(caplog)
    assert refused["stage"] == "identity" and "database is busy" in refused["reason"], refused

    # The check works again while recording the node still fails: it joins all the same.
    store.refused = {"saw_node"}
    link = link_for(plane, "node-a", ctx)
    nursery.start_soon(link.serve)
    registry = plane.plane.registry
    await await_true(
        lambda: "node-a" in registry.nodes
        and registry.liveness(registry.nodes["node-a"], trio.current_time()) == "joined",
        "join",
    )
    [not_recorded] = [r.llmgw_fields for r in caplog.records if r.getMessage() == "node_not_recorded"]
    assert not_recorded["node"] == "node-a" and "is locked by another process" in not_recorded["reason"]
    # Known without a row in the store: a cordon still finds it, and records it.
    store.refused = set()
    await plane.plane.operations.set_cordoned("node-a", True)
    assert [(n.node_id, n.cordoned) for n in await store.nodes()] == [("node-a", True)]


async def test_server_certificate_not_covering_the_dialled_address(
    tmp_path: Path, nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    # The server listens on 127.0.0.2, its certificate names only 127.0.0.1.
    plane = await start_plane(tmp_path / "cp2", nursery, listen="127.0.0.2", sans=["127.0.0.1"])
    files = node_files(plane, tmp_path, "node-a")
    reason = await session_failure(link_for(plane, "node-a", client_ssl_context(files.ca_cert, files.cert, files.key)))
    assert "127.0.0.2" in reason and "llmgw ca server-cert" in reason, reason
    await await_true(lambda: server_refusals(caplog), "the server's log of it")
    [refused] = server_refusals(caplog)
    assert refused["stage"] == "tls" and "refused this control plane's certificate" in refused["reason"], refused


async def test_a_refused_agent_keeps_retrying_with_backoff(plane: Plane, tmp_path: Path, nursery: trio.Nursery) -> None:
    files = node_files(plane, tmp_path, "node-b")
    link = link_for(plane, "node-a", client_ssl_context(files.ca_cert, files.cert, files.key))
    nursery.start_soon(link.serve)
    await await_true(lambda: link.state.attempts >= 4, "retries")
    assert "does not match its certificate CN" in link.state.last_error
    assert not link.state.connected


async def test_removing_a_node_closes_its_open_link(
    plane: Plane, tmp_path: Path, nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    files = node_files(plane, tmp_path, "node-a")
    link = link_for(plane, "node-a", client_ssl_context(files.ca_cert, files.cert, files.key))
    nursery.start_soon(link.serve)
    await await_true(lambda: link.state.connected, "connect")
    result = await plane.plane.operations.remove_node("node-a")
    assert result["link_closed"] is True
    await await_true(lambda: "revoked by `llmgw node remove`" in link.state.last_error, "refusal after removal")
    assert "node-a" not in plane.plane.registry.nodes
    logged = [r.llmgw_fields for r in caplog.records if r.levelno >= logging.WARNING and r.getMessage() == "link_down"]
    assert any("removed from the cluster" in f["reason"] for f in logged)


async def test_another_protocol_version_is_told_and_closed(
    plane: Plane, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    files = node_files(plane, tmp_path, "node-a")
    link = link_for(plane, "node-a", client_ssl_context(files.ca_cert, files.cert, files.key))
    link.make_hello = lambda: attrs.evolve(hello_for("node-a")(), protocol_version=w.PROTOCOL_VERSION + 1)
    reason = await session_failure(link)
    assert f"the agent speaks protocol {w.PROTOCOL_VERSION + 1}" in reason and "run the same llmgw release" in reason
    [refused] = server_refusals(caplog)
    assert refused["stage"] == "hello"


async def test_an_unknown_message_gets_an_error_frame_then_close(plane: Plane, tmp_path: Path) -> None:
    files = node_files(plane, tmp_path, "node-a")
    ctx = client_ssl_context(files.ca_cert, files.cert, files.key)
    with trio.fail_after(REFUSAL_DEADLINE_S):
        tcp = await trio.open_tcp_stream(plane.host, plane.port)
        stream = trio.SSLStream(tcp, ctx, server_hostname=plane.host, https_compatible=True)
        await stream.do_handshake()
        async with trio.open_nursery() as nursery:
            ws = await trio_websocket.wrap_client_stream(
                nursery, stream, plane.host, "/v1/agent", extra_headers=[(b"x-llmgw-node-id", b"node-a")]
            )
            await ws.send_message(encode(hello_for("node-a")()))
            assert isinstance(decode(await ws.get_message(), w.ServerMessage), w.Welcome)
            assert isinstance(decode(await ws.get_message(), w.ServerMessage), w.DesiredState)
            await ws.send_message('{"type": "reboot_now"}')
            error = decode(await ws.get_message(), w.ServerMessage)
            assert isinstance(error, w.LinkError) and error.code == w.UNKNOWN_TYPE
            assert "unknown message type 'reboot_now'" in error.message
            with pytest.raises(trio_websocket.ConnectionClosed):
                await ws.get_message()
            nursery.cancel_scope.cancel()


async def test_backoff_starts_over_after_a_session_that_was_up(
    plane: Plane, tmp_path: Path, nursery: trio.Nursery
) -> None:
    files = node_files(plane, tmp_path, "node-a")
    link = link_for(plane, "node-a", client_ssl_context(files.ca_cert, files.cert, files.key))
    ceilings: list[float] = []  # what each wait was drawn below: the backoff's step

    class Recording(random.Random):
        def uniform(self, a: float, b: float) -> float:
            ceilings.append(b)
            return super().uniform(a, b)

    link.rng = Recording(0)
    nursery.start_soon(link.serve)
    for round_ in range(3):
        await await_true(lambda r=round_: link.state.sessions == r + 1 and link.state.connected, "connect")
        with trio.fail_after(5):  # the control plane drops the link
            assert await plane.plane.agent_links.close_node("node-a", "test", "dropped by the test")
        await await_true(lambda r=round_: len(ceilings) == r + 1, "reconnect")
    # Each reconnect after a working session is the first attempt again.
    assert ceilings == [link.backoff.first_s] * 3


# -- the server closes what it refuses, what expires and what falls silent ----------------------------


async def raw_upgrade(plane: Plane, files: NodePaths, *, claim: str, path: str = "/v1/agent") -> trio.SSLStream:
    """A TLS connection with `files`' certificate that asks to upgrade, claiming node `claim`."""
    ctx = client_ssl_context(files.ca_cert, files.cert, files.key)
    tcp = await trio.open_tcp_stream(plane.host, plane.port)
    stream = trio.SSLStream(tcp, ctx, server_hostname=plane.host, https_compatible=True)
    await stream.do_handshake()
    await stream.send_all(
        f"GET {path} HTTP/1.1\r\nhost: {plane.host}\r\nupgrade: websocket\r\nconnection: Upgrade\r\n"
        f"sec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\nsec-websocket-version: 13\r\n"
        f"x-llmgw-node-id: {claim}\r\n\r\n".encode()
    )
    return stream


@pytest.mark.parametrize("case", ["cn-mismatch", "revoked", "wrong-path"])
async def test_a_refused_agent_connection_is_closed_by_the_server_at_once(
    plane: Plane, tmp_path: Path, case: str
) -> None:
    files = node_files(plane, tmp_path, "node-b")
    if case == "revoked":
        await plane.plane.store.revoke_serial(cert_info(load_cert(files.cert)).serial, "node-b")
    stream = await raw_upgrade(
        plane,
        files,
        claim="node-a" if case == "cn-mismatch" else "node-b",
        path="/elsewhere" if case == "wrong-path" else "/v1/agent",
    )
    answer = b""
    with trio.fail_after(1):  # told why, then closed: not held open for the peer's leisure
        while chunk := await stream.receive_some(65536):
            answer += chunk
    expected = b"404" if case == "wrong-path" else b"403"
    assert answer.startswith(b"HTTP/1.1 " + expected), answer
    await stream.aclose()


async def test_a_link_is_closed_when_its_certificate_expires(
    plane: Plane, tmp_path: Path, nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    expires_in_s = 2.0
    issued = datetime.now(timezone.utc) - timedelta(days=1) + timedelta(seconds=expires_in_s)
    files = node_files(plane, tmp_path, "node-a", days=1, now=issued)
    link = link_for(plane, "node-a", client_ssl_context(files.ca_cert, files.cert, files.key))
    nursery.start_soon(link.serve)
    await await_true(lambda: link.state.connected, "connect")
    await await_true(
        lambda: not link.state.connected, "the link closed at the certificate's expiry", timeout=expires_in_s + 2
    )
    expired = [r.llmgw_fields for r in caplog.records if r.getMessage() == "agent_certificate_expired"]
    assert expired and expired[0]["node"] == "node-a"
    await await_true(lambda: "expired" in link.state.last_error, "the agent told why")
    await await_true(lambda: not plane.plane.registry.nodes["node-a"].link.connected, "the control plane's view")


async def test_a_silent_link_is_closed_after_the_heartbeat_ttl(tmp_path: Path, nursery: trio.Nursery) -> None:
    plane = await start_plane(tmp_path / "cp", nursery, listen="127.0.0.1", sans=["127.0.0.1"], heartbeat_ttl_s=1)
    files = node_files(plane, tmp_path, "node-a")
    ctx = client_ssl_context(files.ca_cert, files.cert, files.key)
    tcp = await trio.open_tcp_stream(plane.host, plane.port)
    stream = trio.SSLStream(tcp, ctx, server_hostname=plane.host, https_compatible=True)
    await stream.do_handshake()
    async with trio.open_nursery() as inner:
        ws = await trio_websocket.wrap_client_stream(
            inner, stream, plane.host, "/v1/agent", extra_headers=[(b"x-llmgw-node-id", b"node-a")]
        )
        await ws.send_message(encode(hello_for("node-a")()))
        started = trio.current_time()
        messages = []
        with trio.fail_after(3):
            with pytest.raises(trio_websocket.ConnectionClosed):
                while True:  # an agent that says hello, then nothing: no heartbeat
                    messages.append(decode(await ws.get_message(), w.ServerMessage))
        assert 0.9 < trio.current_time() - started < 2.5
        assert isinstance(messages[-1], w.LinkError) and messages[-1].code == w.SILENT
        inner.cancel_scope.cancel()


async def test_a_stalled_process_closes_no_link_and_loses_no_node(
    tmp_path: Path, nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    """A blocking call holds the loop for more than twice the TTL (here the agent's loop too: they
    share this process). When it resumes, the link's silence timer and the reconciler fire at
    deadlines long past, before any frame is read: they count the silence in liveness time, which
    skipped the stall, so the link stays and the node stays joined."""
    caplog.set_level(logging.INFO)
    ttl = 1.0
    plane = await start_plane(tmp_path / "cp", nursery, listen="127.0.0.1", sans=["127.0.0.1"], heartbeat_ttl_s=ttl)
    files = node_files(plane, tmp_path, "node-a")
    link = link_for(plane, "node-a", client_ssl_context(files.ca_cert, files.cert, files.key))
    nursery.start_soon(link.serve)
    registry = plane.plane.registry

    def joined() -> bool:
        node = registry.nodes.get("node-a")
        return node is not None and registry.liveness(node, registry.clock.now()) == "joined"

    def logged(event: str) -> list[dict]:
        return [r.llmgw_fields for r in caplog.records if r.getMessage() == event]

    changes = plane.plane.changes
    await await_true(joined, "join")
    await await_true(lambda: logged("node_joined"), "the reconciler has seen the join", changed=changes.settled.next)
    agent_link = registry.nodes["node-a"].link
    beat = agent_link.last_heartbeat_at
    time.sleep(2.5 * ttl)  # the stall: a blocking call on the loop
    # What the stall could set off fires as the loop resumes, at deadlines long past: the
    # reconciler's look at them (a joined node's heartbeats wake nothing: it looks at its
    # deadlines) and the link's silence timer. Then two more heartbeats read on the same link,
    # and time for the reconciler to look again.
    for _ in range(2):
        await await_true(lambda b=beat: agent_link.last_heartbeat_at != b, "a heartbeat")
        beat = agent_link.last_heartbeat_at
    await trio.sleep(ttl)
    assert logged("agent_link_silent") == [] and logged("node_lost") == []
    assert len(logged("agent_connected")) == 1  # the same link throughout
    assert link.state.connected and joined()
    lagged = logged("event_loop_lagged")
    assert lagged and lagged[0]["lag_s"] >= 2.0 * ttl and lagged[0]["cause"] == "blocked_or_paused", lagged
    assert registry.clock.stalls >= 1 and registry.clock.stalled_s >= 2.0 * ttl
