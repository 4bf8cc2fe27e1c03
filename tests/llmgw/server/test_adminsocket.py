"""The control plane's private socket (`llmgw.server.admin.privatesocket`) on a real control plane, and
the relay (`llmgw.http.relay`) in front of it on loopback, as a gateway worker will run it: the
admin API's client, the page's login flow and its live feed through the relay; the relayed
client's address believed there and nowhere else; the socket's privacy and its life."""

from __future__ import annotations

import http.client
import json
import logging
import os
import socket
import stat
from functools import partial
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import trio

from llmgw import paths
from llmgw.config import ServerConfig, ServerSection
from llmgw.ctl.client import AdminClient
from llmgw.ctl.page import page_url
from llmgw.errors import find
from llmgw.http.errors import SocketInUse
from llmgw.http.openai import error_body
from llmgw.http.relay import CLIENT_HEADER, Relay
from llmgw.http.server import bound_address, serve_http
from llmgw.http.unixsocket import connect_unix, open_unix_listener
from llmgw.server.app import ControlPlane
from testlib.controlplane import OFFLINE_ENGINES, make_state

pytestmark = pytest.mark.trio


@pytest.fixture
def state(tmp_path: Path) -> Path:
    state = tmp_path / "cp"
    make_state(state, sans=["127.0.0.1"], days=3)
    return state


class Running:
    """A control plane serving its private socket, the relay's URL in front of it, and how to
    stop the plane."""

    def __init__(self, plane: ControlPlane, relay_url: str, scope: trio.CancelScope, stopped: trio.Event) -> None:
        self.plane, self.relay_url, self.scope, self.stopped = plane, relay_url, scope, stopped
        self.direct_url = paths.admin_url_path(plane.state_dir).read_text().strip()
        self.token = paths.read_admin_token(paths.admin_token_path(plane.state_dir))


async def start(state: Path, nursery: trio.Nursery) -> Running:
    # The relay listens first, on a port of its own (a worker's would be http_listen's), so that
    # the control plane can be told it is one of its page's addresses.
    relay = Relay(paths.admin_socket_path(state))
    listeners = await nursery.start(partial(serve_http, relay.handle, "127.0.0.1", 0, errors=error_body))
    host, port = bound_address(listeners)
    relay_url = f"http://{host}:{port}"
    server = ServerSection(
        state_dir=str(state), agent_listen="127.0.0.1:0", http_listen="127.0.0.1:0", page_origins=(relay_url,)
    )
    plane = ControlPlane.open(ServerConfig(server=server, engines=OFFLINE_ENGINES), state)
    scope, stopped = trio.CancelScope(), trio.Event()

    async def run(*, task_status=trio.TASK_STATUS_IGNORED) -> None:
        try:
            with scope:
                await plane.serve(private_socket=True, task_status=task_status)
        finally:
            stopped.set()

    await nursery.start(run)
    await plane.store.saw_node("n1", "127.0.0.5")
    plane.registry.know("n1", address="127.0.0.5")
    return Running(plane, relay_url, scope, stopped)


class Browser:
    """What a browser sends (the cookie it was given, the page's Origin), on fresh connections;
    `port` is the local port of its last connection (what the control plane should log)."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self.host, self.port = parts.hostname, parts.port
        self.origin = f"http://{self.host}:{self.port}"
        self.cookie = ""
        self.local = ""

    def request(self, method: str, path: str, headers: dict[str, str] | None = None) -> tuple[int, dict, bytes]:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=10)
        sent = dict(headers or {})
        if self.cookie:
            sent["cookie"] = self.cookie
        try:
            conn.connect()
            self.local = "%s:%d" % conn.sock.getsockname()[:2]
            conn.request(method, path, headers=sent)
            response = conn.getresponse()
            return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
        finally:
            conn.close()

    def json(self, method: str, path: str, **headers: str) -> tuple[int, Any]:
        status, _, body = self.request(method, path, headers)
        return status, json.loads(body)


async def call(fn, *args, **kw):
    return await trio.to_thread.run_sync(lambda: fn(*args, **kw))


def logged(caplog: pytest.LogCaptureFixture, message: str) -> list[dict]:
    return [r.llmgw_fields for r in caplog.records if r.getMessage() == message]


async def test_the_admin_client_and_the_page_login_work_through_the_relay(
    state: Path, nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    cp = await start(state, nursery)
    client = AdminClient(cp.relay_url, cp.token)
    [node] = await call(client.nodes)
    assert node["id"] == "n1"
    assert (await call(client.cordon, "n1", True))["cordoned"] is True
    assert cp.plane.registry.nodes["n1"].cordoned
    # The page: a login URL on the relay's address, its cookie, a change with CSRF and Origin.
    login = await call(page_url, client, actions=True)
    assert login["url"].startswith(cp.relay_url + "/login?code=")
    browser = Browser(cp.relay_url)
    parts = urlsplit(login["url"])
    status, headers, _ = await call(browser.request, "GET", f"{parts.path}?{parts.query}")
    assert status == 303 and "HttpOnly" in headers["set-cookie"]
    assert logged(caplog, "page_login")[-1]["client"] == browser.local  # the browser, not the relay
    browser.cookie = headers["set-cookie"].split(";")[0]
    status, session = await call(browser.json, "GET", "/admin/v1/page/session")
    assert status == 200 and session["actions"] is True
    uncordon = "/admin/v1/nodes/n1/uncordon"
    status, body = await call(
        browser.json, "POST", uncordon, origin=browser.origin, **{"x-llmgw-csrf": session["csrf"]}
    )
    assert status == 200 and body["node"]["cordoned"] is False
    status, body = await call(browser.json, "POST", uncordon, origin="http://evil.example")
    assert status == 403  # the page's rules hold through the relay
    status, _, page = await call(browser.request, "GET", "/")
    assert status == 200 and b"/page/app.js" in page


async def test_the_live_feed_arrives_through_the_relay_before_it_ends(state: Path, nursery: trio.Nursery) -> None:
    cp = await start(state, nursery)
    host, port = urlsplit(cp.relay_url).hostname, urlsplit(cp.relay_url).port
    stream = await trio.open_tcp_stream(host, port)
    await stream.send_all(
        f"GET /admin/v1/events HTTP/1.1\r\nhost: {host}:{port}\r\nauthorization: Bearer {cp.token}\r\n\r\n".encode()
    )
    got = b""
    with trio.fail_after(10):
        while b"event: cluster" not in got or b"\n\n" not in got.split(b"event: cluster", 1)[1]:
            got += await stream.receive_some(65536)
    head = got.split(b"\r\n\r\n", 1)[0].lower()
    assert head.startswith(b"http/1.1 200") and b"text/event-stream" in head and b"transfer-encoding: chunked" in head
    assert b'"n1"' in got  # the snapshot, while the stream stays open
    await stream.aclose()


async def test_the_relayed_client_address_is_believed_on_the_private_socket_only(
    state: Path, nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    cp = await start(state, nursery)
    forged = {CLIENT_HEADER: "6.6.6.6:666", "authorization": "Bearer wrong"}
    for url in (cp.direct_url, cp.relay_url):
        browser = Browser(url)
        status, _, _ = await call(browser.request, "GET", "/admin/v1/nodes", forged)
        assert status == 401
        assert logged(caplog, "admin_credential_refused")[-1]["client"] == browser.local
    # Straight on the socket, the header is what the control plane logs: only its own user can
    # connect there (the relay replaces a client's own).
    raw = await connect_unix(paths.admin_socket_path(state))
    await raw.send_all(
        f"GET /admin/v1/nodes HTTP/1.1\r\nhost: x\r\nauthorization: Bearer wrong\r\n"
        f"{CLIENT_HEADER}: 192.0.2.7:40000\r\n\r\n".encode()
    )
    with trio.fail_after(10):
        assert (await raw.receive_some(65536)).startswith(b"HTTP/1.1 401")
    await raw.aclose()
    assert logged(caplog, "admin_credential_refused")[-1]["client"] == "192.0.2.7:40000"


async def test_the_gateway_routes_are_not_served_there_and_metrics_are(state: Path, nursery: trio.Nursery) -> None:
    cp = await start(state, nursery)
    browser = Browser(cp.relay_url)
    for path in ("/v1/models", "/health"):
        status, body = await call(browser.json, "GET", path)
        assert status == 404 and "is the gateway's" in body["error"]["message"]
    status, _, metrics = await call(browser.request, "GET", "/metrics")
    assert status == 200 and b'listener="admin_socket"' in metrics and b"llmgw_background_restarts_total" in metrics
    status, _, health = await call(Browser(cp.direct_url).request, "GET", "/health")
    # http_listen still serves the gateway: a gateway worker's /health (no replica here to be ready)
    assert status == 503 and json.loads(health)["status"] == "no_ready_replica"


async def test_the_socket_is_private_replaces_a_stale_one_refuses_a_live_one_and_goes_at_stop(
    state: Path, nursery: trio.Nursery
) -> None:
    path = paths.admin_socket_path(state)
    path.parent.mkdir(mode=0o700)
    left = socket.socket(socket.AF_UNIX)
    left.bind(str(path))  # a control plane killed with SIGKILL leaves its socket behind
    left.close()
    old = os.umask(0)
    try:
        cp = await start(state, nursery)
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600 and stat.S_IMODE(os.stat(path.parent).st_mode) == 0o700
    assert (await call(AdminClient(cp.relay_url, cp.token).nodes))[0]["id"] == "n1"
    cp.scope.cancel()
    with trio.fail_after(10):
        await cp.stopped.wait()
    assert not path.exists()
    # A live server on the socket: the next control plane refuses to start, saying so.
    live = open_unix_listener(path)
    try:
        with pytest.raises(BaseException) as refused:  # from the plane's nursery: the CLI shows the leaf
            await start(state, nursery)
        in_use = find(refused.value, SocketInUse)
        assert in_use is not None and f"another server answers on {path}" in str(in_use)
    finally:
        live.socket.close()
