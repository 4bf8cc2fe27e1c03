"""What a standby control plane answers on http_listen (`llmgw.server.leadership.standby.StandbyFront`), and
`llmgw ctl`'s admin client following it to the leader (`llmgw.ctl.client`), over real loopback
sockets: the client is the synchronous one `llmgw ctl` runs, in a thread. The two control
planes as real processes are tests/integration/test_leader_takeover.py's."""

from __future__ import annotations

import json
import logging
from functools import partial

import pytest
import trio
import trio.testing

from llmgw.ctl.client import AdminClient
from llmgw.errors import PeerError
from llmgw.http.errors import HTTPError
from llmgw.http.messages import Request, Response
from llmgw.http.openai import error_body
from llmgw.http.refusals import BURST, INTERVAL_S
from llmgw.http.server import bound_address, serve_http
from llmgw.server.leadership.standby import Leader, StandbyFront

pytestmark = pytest.mark.trio

TOKEN = "the-cluster-admin-credential"
LEADS = Leader(agent_url="wss://127.0.0.1:7443", admin_url="", epoch=4)
NONE = Leader(why_none="no control plane leads at the moment (a takeover is under way)", retry_after_s=5.0)


class LeaderAPI:
    """A leader's admin API that records what it was sent."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, str, bytes]] = []

    async def handle(self, request: Request) -> Response:
        body = bytes(await request.read())
        self.seen.append((request.method, request.path, request.headers.get("authorization", ""), body))
        return Response.json(200, {"node": {"id": "node-a", "cordoned": True}})


async def serve(nursery: trio.Nursery, handler) -> str:
    listeners = await nursery.start(partial(serve_http, errors=error_body), handler, "127.0.0.1", 0)
    host, port = bound_address(listeners)
    return f"http://{host}:{port}"


async def call(url: str, method: str, path: str, body=None, token: str = TOKEN):
    return await trio.to_thread.run_sync(lambda: AdminClient(url, token).request(method, path, body))


async def raw(url: str, path: str, token: str | None = TOKEN) -> tuple[int, dict[str, str], dict]:
    import http.client
    from urllib.parse import urlsplit

    def get():
        parts = urlsplit(url)
        conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
        conn.request("GET", path, headers={"authorization": f"Bearer {token}"} if token else {})
        response = conn.getresponse()
        out = response.status, {k.lower(): v for k, v in response.getheaders()}, json.loads(response.read() or b"null")
        conn.close()
        return out

    return await trio.to_thread.run_sync(get)


async def test_ctl_follows_a_standby_to_the_leader_once_with_the_same_call(nursery: trio.Nursery) -> None:
    leader = LeaderAPI()
    leader_url = await serve(nursery, leader.handle)
    known = Leader(agent_url=LEADS.agent_url, admin_url=leader_url, epoch=4)
    standby_url = await serve(nursery, StandbyFront(admin_token=TOKEN, leader=lambda: known).handle)
    answer = await call(standby_url, "POST", "/admin/v1/nodes/node-a/cordon", {"why": "x"})
    assert answer == {"node": {"id": "node-a", "cordoned": True}}
    assert leader.seen == [("POST", "/admin/v1/nodes/node-a/cordon", f"Bearer {TOKEN}", b'{"why": "x"}')]


async def test_a_standbys_admin_answer_names_the_leader_with_retry_after(nursery: trio.Nursery) -> None:
    known = Leader(agent_url=LEADS.agent_url, admin_url="http://10.0.0.2:8080", epoch=4)
    url = await serve(nursery, StandbyFront(admin_token=TOKEN, leader=lambda: known).handle)
    status, headers, body = await raw(url, "/admin/v1/nodes")
    assert status == 503 and headers["retry-after"] == "1"
    assert body["error"]["code"] == "not_leader" and body["error"]["type"] == "unavailable_error"
    assert body["error"]["leader"] == {
        "agent_url": "wss://127.0.0.1:7443",
        "admin_url": "http://10.0.0.2:8080",
        "epoch": 4,
    }
    assert "the leader's admin API is at http://10.0.0.2:8080" in body["error"]["message"]


async def test_a_standby_tells_nothing_without_the_admin_credential(nursery: trio.Nursery) -> None:
    known = Leader(agent_url=LEADS.agent_url, admin_url="http://10.0.0.2:8080", epoch=4)
    url = await serve(nursery, StandbyFront(admin_token=TOKEN, leader=lambda: known).handle)
    for token in (None, "wrong"):
        status, _, body = await raw(url, "/admin/v1/nodes", token)
        assert status == 401 and "leader" not in body["error"] and "10.0.0.2" not in json.dumps(body)


async def test_a_standby_that_knows_no_leader_says_so_and_ctl_does_not_loop(nursery: trio.Nursery) -> None:
    url = await serve(nursery, StandbyFront(admin_token=TOKEN, leader=lambda: NONE).handle)
    status, headers, body = await raw(url, "/admin/v1/nodes")
    assert status == 503 and headers["retry-after"] == "5" and body["error"]["leader"] is None
    with pytest.raises(PeerError) as info:
        await call(url, "GET", "/admin/v1/nodes")
    assert "no control plane leads at the moment (a takeover is under way); try again shortly" in str(info.value)
    assert "(HTTP 503 from" in str(info.value)


async def test_ctl_follows_once_and_not_round_two_standbys(nursery: trio.Nursery) -> None:
    """Two standbys naming each other (each read a stale lease): one hop, then the answer as it is."""
    first_url = ""

    def points_back() -> Leader:
        return Leader(agent_url="wss://x:1", admin_url=first_url, epoch=3)

    second_url = await serve(nursery, StandbyFront(admin_token=TOKEN, leader=points_back).handle)
    first_url = await serve(
        nursery,
        StandbyFront(admin_token=TOKEN, leader=lambda: Leader(agent_url="wss://y:1", admin_url=second_url)).handle,
    )
    with pytest.raises(PeerError, match=f"HTTP 503 from {second_url}"):
        await call(first_url, "GET", "/admin/v1/nodes")


async def test_health_and_the_gateways_routes_and_metrics_of_a_standby(nursery: trio.Nursery) -> None:
    known = Leader(agent_url=LEADS.agent_url, admin_url="http://10.0.0.2:8080", epoch=4)
    url = await serve(nursery, StandbyFront(admin_token=TOKEN, leader=lambda: known, tries=lambda: 7).handle)
    status, _, body = await raw(url, "/health", None)
    assert status == 503 and body == {"status": "standby", "leader": known.view()}  # a load balancer skips it
    status, _, body = await raw(url, "/v1/models", None)
    assert status == 503 and body["error"]["code"] == "not_leader"
    assert "serves no gateway; send requests to a gateway" in body["error"]["message"]

    def metrics() -> str:
        import urllib.request

        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
            return response.read().decode()

    text = await trio.to_thread.run_sync(metrics)
    assert "\nllmgw_control_plane_leading 0\n" in text and "\nllmgw_lease_tries_total 7\n" in text


async def test_a_flood_of_wrong_credentials_is_a_few_lines_and_one_summary(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    front = StandbyFront(admin_token=TOKEN, leader=lambda: LEADS)
    async with trio.open_nursery() as nursery:
        await nursery.start(front.refusals.serve)
        for i in range(200):  # 200 a second, from one /24
            request = Request.of(
                "GET",
                "/admin/v1/nodes",
                headers={"authorization": "Bearer wrong"},
                client=f"203.0.113.{i % 9}:4{i:04d}",
            )
            with pytest.raises(HTTPError) as refused:
                await front.handle(request)
            assert refused.value.status == 401
            await trio.sleep(0.005)
        await trio.sleep(INTERVAL_S)  # nothing more comes: the summary is logged all the same
        nursery.cancel_scope.cancel()
    assert len([r for r in caplog.records if r.getMessage() == "admin_credential_refused"]) == BURST
    [summary] = [r.llmgw_fields for r in caplog.records if r.getMessage() == "requests_refused"]  # type: ignore[attr-defined]
    assert summary["count"] == 200 and summary["logged_each"] == BURST and summary["reasons"] == {"admin": 200}
    assert summary["networks"] == {"203.0.113.0/24": 200}
