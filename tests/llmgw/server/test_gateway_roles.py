"""The certificates' roles on real loopback sockets, against a real control plane: a gateway
certificate opens the gateway link (and gets the table, and shows in the admin API); a node
certificate cannot act as a gateway, and a gateway certificate cannot act as a node, on the
agent link or at the artifact mirror. Each refusal is said to the peer in words naming the fix,
well inside the link's connect timeout, and logged by the control plane."""

from __future__ import annotations

import http.client
import json
import logging
import ssl
from pathlib import Path

import attrs
import pytest
import trio

from agent.link import AgentLink
from agent.link import Target as AgentTarget
from llmgw.backoff import Backoff
from llmgw.config import ServerConfig, ServerSection
from llmgw.gatewayd import link as gl
from llmgw.http.refusals import BURST
from llmgw.paths import admin_token_path, read_admin_token
from llmgw.pki.ca import CA, cert_info, new_ca
from llmgw.pki.files import GatewayPaths, issue_gateway_to_dir, issue_to_dir, load_cert
from llmgw.pki.tls import client_ssl_context, gateway_ssl_context
from llmgw.server.app import ControlPlane
from llmgw.wire import agent_link as w
from testlib.controlplane import OFFLINE_ENGINES, hello, make_state
from testlib.waiting import await_true

pytestmark = pytest.mark.trio

REFUSAL_DEADLINE_S = 5  # far below the link's connect timeout: a refusal must not wait for one


@attrs.frozen
class Plane:
    state: Path
    ca: CA
    port: int
    http_port: int
    plane: ControlPlane


@pytest.fixture
async def plane(tmp_path: Path, nursery: trio.Nursery) -> Plane:
    state = tmp_path / "cp"
    ca = make_state(state, sans=["127.0.0.1"], days=30)
    config = ServerConfig(
        engines=OFFLINE_ENGINES,
        server=ServerSection(
            state_dir=str(state), agent_listen="127.0.0.1:0", http_listen="127.0.0.1:0", heartbeat_interval_s=0.2
        ),
    )
    control_plane = ControlPlane.open(config, state)
    bound = await nursery.start(control_plane.serve)
    return Plane(state, ca, bound.agent_address[1], bound.http_address[1], control_plane)


class Sink:
    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []

    def rotation_changed(self, message) -> None:
        self.calls.append(("rotation", message))

    def keys_changed(self, message) -> None:
        self.calls.append(("keys", message))

    def share_changed(self, message) -> None:
        self.calls.append(("share", message))

    def budgets_changed(self, message) -> None:
        self.calls.append(("budgets", message))

    def grants_changed(self, message) -> None:
        self.calls.append(("grants", message))

    def heard(self, now: float) -> None:
        pass

    def link_state(self, connected: bool, detail: str) -> None:
        self.calls.append(("link", (connected, detail)))

    def downs(self) -> list[str]:
        """Why the link went down, each time it did."""
        return [what[1] for kind, what in self.calls if kind == "link" and not what[0]]


def gateway_files(plane: Plane, tmp_path: Path, name: str = "gw1") -> GatewayPaths:
    return issue_gateway_to_dir(plane.ca, name, tmp_path / f"gw-{name}", validity_days=30)


def gateway_link(plane: Plane, name: str, tls: ssl.SSLContext, sink: Sink | None = None) -> gl.GatewayLink:
    return gl.GatewayLink(
        target=gl.Target(host="127.0.0.1", port=plane.port), tls=tls, name=name, instance="i1", sink=sink or Sink()
    )


async def failure(link: gl.GatewayLink | AgentLink) -> str:
    with trio.fail_after(REFUSAL_DEADLINE_S):
        try:
            await link.run_session()
        except Exception as exc:  # noqa: BLE001 - what the gateway (or agent) would log
            return link.reason_of(exc)
    raise AssertionError("the session ended without a failure")


def refusals(caplog: pytest.LogCaptureFixture) -> list[dict]:
    return [r.llmgw_fields for r in caplog.records if r.getMessage() == "agent_refused"]


async def test_a_gateway_certificate_opens_the_gateway_link_and_gets_the_table(
    plane: Plane, tmp_path: Path, nursery: trio.Nursery
) -> None:
    files = gateway_files(plane, tmp_path)
    credentials = gl.Credentials.load(files.dir)
    assert credentials.name == "gw1"
    sink = Sink()
    link = gateway_link(plane, credentials.name, credentials.ssl_context, sink)
    nursery.start_soon(link.serve)
    await await_true(lambda: ("grants", gl.g.GrantsChanged()) in sink.calls, "the table", timeout=10)
    assert [kind for kind, _ in sink.calls] == ["link", "rotation", "keys", "share", "budgets", "grants"]
    views = await trio.to_thread.run_sync(admin_get, plane, "/admin/v1/gateways")
    [view] = views["gateways"]
    assert (view["name"], view["instance"], view["share"]) == ("gw1", "i1", {"index": 0, "count": 1})
    assert view["cert_serial"] == f"{credentials.cert_serial:x}"


async def test_a_node_certificate_cannot_act_as_a_gateway(
    plane: Plane, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    node = issue_to_dir(plane.ca, "node-a", tmp_path / "node", validity_days=30)
    link = gateway_link(plane, "node-a", client_ssl_context(node.ca_cert, node.cert, node.key))
    said = await failure(link)
    assert said.startswith("the control plane refused this gateway (HTTP 403): the certificate of 'node-a'")
    assert "is not a gateway certificate (its role: llmgw-node)" in said
    assert "`llmgw ca issue --gateway NAME`" in said
    [refused] = refusals(caplog)
    assert refused["cn"] == "node-a" and refused["stage"] == "identity"
    assert plane.plane.gateway_feed.links == {}


async def test_a_certificate_refused_again_and_again_is_a_few_lines_then_counted(
    plane: Plane, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="llmgw.endpoint")
    node = issue_to_dir(plane.ca, "node-a", tmp_path / "node", validity_days=30)
    context = client_ssl_context(node.ca_cert, node.cert, node.key)
    for _ in range(20):  # a node's certificate at the gateway link, as fast as it is refused
        said = await failure(gateway_link(plane, "node-a", context))
        assert "is not a gateway certificate" in said
    lines = [r for r in caplog.records if r.getMessage() == "agent_refused"]
    assert len(lines) == 20 and len([r for r in lines if r.levelno == logging.WARNING]) == BURST
    # The rest at debug, counted for the listener's summary of the interval, under their stage.
    [summary] = plane.plane.agent_port.refusals.flush(trio.current_time())
    assert (summary.count, summary.logged, summary.reasons) == (20, BURST, {"identity": 20})


async def test_a_gateway_certificate_cannot_act_as_a_node_on_the_agent_link(
    plane: Plane, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    files = gateway_files(plane, tmp_path)
    link = AgentLink(
        target=AgentTarget(host="127.0.0.1", port=plane.port),
        node_id="gw1",
        ssl_context=gateway_ssl_context(files.dir),
        make_hello=lambda: hello("gw1"),
        backoff=Backoff(first_s=0.01, max_s=0.05),
    )
    said = await failure(link)
    assert said.startswith("the control plane refused this node (HTTP 403): the certificate of 'gw1'")
    assert "is not a node certificate (its role: llmgw-gateway)" in said
    assert "a gateway connects at /v1/gateway" in said
    [refused] = refusals(caplog)
    assert refused["cn"] == "gw1" and refused["stage"] == "identity"
    assert "gw1" not in plane.plane.registry.nodes


async def test_a_gateway_certificate_cannot_fetch_from_the_artifact_mirror(plane: Plane, tmp_path: Path) -> None:
    files = gateway_files(plane, tmp_path)
    node = issue_to_dir(plane.ca, "node-a", tmp_path / "node", validity_days=30)
    target = w.ARTIFACTS_PREFIX + "0" * 64

    def get(context: ssl.SSLContext) -> tuple[int, bytes]:
        conn = http.client.HTTPSConnection("127.0.0.1", plane.port, context=context, timeout=REFUSAL_DEADLINE_S)
        try:
            conn.request("GET", target)
            response = conn.getresponse()
            return response.status, response.read()
        finally:
            conn.close()

    status, body = await trio.to_thread.run_sync(get, gateway_ssl_context(files.dir))
    assert status == 403 and b"is not a node certificate (its role: llmgw-gateway)" in body
    # A node gets past the role to the mirror itself (which has no such archive).
    status, body = await trio.to_thread.run_sync(get, client_ssl_context(node.ca_cert, node.cert, node.key))
    assert status == 404, body


async def test_a_revoked_gateway_certificate_is_refused(plane: Plane, tmp_path: Path) -> None:
    files = gateway_files(plane, tmp_path)
    serial = cert_info(load_cert(files.cert)).serial
    await plane.plane.store.revoke_serial(serial, "gw1")
    said = await failure(gateway_link(plane, "gw1", gateway_ssl_context(files.dir)))
    assert f"(serial {serial:x}) was revoked; issue a new one with `llmgw ca issue --gateway gw1`" in said


async def test_revoking_a_connected_gateways_certificate_closes_its_link_saying_why(
    plane: Plane, tmp_path: Path, nursery: trio.Nursery
) -> None:
    files = gateway_files(plane, tmp_path)
    info = cert_info(load_cert(files.cert))
    # Recorded under its name, as `llmgw ca issue --gateway gw1` records it.
    await plane.plane.store.record_issued(
        info.serial, "gw1", info.not_after.timestamp(), revoke_others=False, also_revoke=()
    )
    sink = Sink()
    link = gateway_link(plane, "gw1", gateway_ssl_context(files.dir), sink)
    nursery.start_soon(link.serve)
    await await_true(lambda: ("share", gl.g.ShareChanged(index=0, count=1)) in sink.calls, "the table", timeout=10)
    removed = await trio.to_thread.run_sync(admin_call, plane, "DELETE", "/admin/v1/nodes/gw1")
    assert removed["revoked_serials"] == [f"{info.serial:x}"] and removed["link_closed"] is True
    closed = f"the control plane closed the link: the certificate of gateway 'gw1' (serial {info.serial:x}) was revoked"
    await await_true(lambda: any(why.startswith(closed) for why in sink.downs()), "the link closed")
    assert plane.plane.gateway_feed.links == {}
    # And it is refused when it dials again.
    refused = "the control plane refused this gateway (HTTP 403): the certificate of gateway 'gw1'"
    await await_true(lambda: link.state.last_error.startswith(refused), "refused", timeout=10)


async def test_a_gateway_named_other_than_its_certificate_is_refused(plane: Plane, tmp_path: Path) -> None:
    files = gateway_files(plane, tmp_path)
    said = await failure(gateway_link(plane, "gw2", gateway_ssl_context(files.dir)))
    assert "gateway name 'gw2' does not match its certificate CN 'gw1'" in said


async def test_a_gateway_certificate_of_another_cluster_is_refused_at_the_handshake(
    plane: Plane, tmp_path: Path
) -> None:
    other = issue_gateway_to_dir(new_ca(validity_days=30), "gw1", tmp_path / "other", validity_days=30)
    # It trusts our control plane, and presents another CA's certificate.
    other.ca_cert.write_bytes(plane.ca.cert_pem())
    said = await failure(gateway_link(plane, "gw1", gateway_ssl_context(other.dir)))
    assert said == (
        "the control plane does not trust the CA that issued this gateway's certificate: the two hold different "
        "clusters' CAs (or the CA was recreated); issue this gateway a new certificate on the control plane with "
        "`llmgw ca issue --gateway NAME`"
    )


def admin_get(plane: Plane, path: str) -> dict:
    return admin_call(plane, "GET", path)


def admin_call(plane: Plane, method: str, path: str) -> dict:
    token = read_admin_token(admin_token_path(plane.state))
    conn = http.client.HTTPConnection("127.0.0.1", plane.http_port, timeout=10)
    try:
        conn.request(method, path, headers={"authorization": f"Bearer {token}"})
        response = conn.getresponse()
        assert response.status == 200, response.read()
        return json.loads(response.read())
    finally:
        conn.close()
