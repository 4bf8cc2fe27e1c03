"""The agent port's routing and the link's upgrade on the shared HTTP server, over memory streams:
the request is routed from its head alone, handed to the link's session as the server parsed it
(`upgrade_request`: the session judges it, tests/llmgw/wire/test_session.py has every rule),
and the link's WebSocket is accepted from the bytes the server had read (`Upgrade`); what is
refused, or is no HTTP at all, is answered in plain HTTP."""

from __future__ import annotations

import pytest
import trio
import trio.testing
import trio_websocket

from llmgw.http.errors import HTTPError
from llmgw.http.messages import Request, Upgrade
from llmgw.http.server import serve_connection
from llmgw.server.links import agentport
from llmgw.server.links.agentport import Route
from llmgw.wire import agent_link as w
from llmgw.wire import agent_session as s
from llmgw.wire import session as ls
from llmgw.wire.errors import UpgradeRefused
from llmgw.wire.gateway_link import GATEWAY_PATH
from testlib.httpexchange import Answered, exchange

pytestmark = pytest.mark.trio

UPGRADE = (
    b"GET /v1/agent HTTP/1.1\r\nhost: cp\r\nupgrade: websocket\r\nconnection: Upgrade\r\n"
    b"sec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\nsec-websocket-version: 13\r\nx-llmgw-node-id: node-a\r\n\r\n"
)


async def test_the_route_is_decided_from_the_head_alone() -> None:
    def at(target: str) -> Route:
        return agentport.route(Request.of("GET", target))

    assert at(w.ARTIFACTS_PREFIX + "0" * 64) is Route.MIRROR
    assert at(w.RELEASE_PREFIX + "SHA256SUMS") is Route.RELEASE
    assert at("/v1/releasex") is Route.LINK  # only under the prefix
    assert at(w.AGENT_PATH) is Route.LINK
    assert at("/elsewhere") is Route.LINK  # the link's session answers 404
    assert at(GATEWAY_PATH) is Route.GATEWAY
    assert at(GATEWAY_PATH + "?x=1") is Route.GATEWAY  # the gateway link's session answers 404


def check(request: Request) -> None:
    """The link's session judges the upgrade request the server parsed."""
    session = s.ServerSession("node-a", heartbeat_interval_s=5.0, desired_state=lambda: w.DesiredState(generation=1))
    session.upgrade(agentport.upgrade_request(request), ls.Standing(serial=1))


async def parsed(data: bytes) -> tuple[Request | None, Answered]:
    """The request the agent port's server hands its handler for `data`, and what it answered."""
    seen: list[Request] = []

    async def capture(request: Request) -> Upgrade:
        seen.append(request)
        raise HTTPError(418, "seen")

    answered = await exchange(capture, data, upgrades=True)
    return (seen[0] if seen else None), answered


async def test_a_head_trickled_in_is_parsed_whole() -> None:
    client, server = trio.testing.memory_stream_pair()
    seen: list[Request] = []

    async def capture(request: Request) -> Upgrade:
        seen.append(request)
        raise HTTPError(418, "seen")

    async with trio.open_nursery() as nursery:

        async def trickle() -> None:
            for i in range(len(UPGRADE)):
                await client.send_all(UPGRADE[i : i + 1])
                await trio.sleep(0)

        nursery.start_soon(trickle)
        await serve_connection(capture, server, keep_alive=False, upgrades=True)
    [request] = seen
    assert request.target == b"/v1/agent" and request.pipelined == 0
    check(request)


@pytest.mark.parametrize(
    ("data", "status"),
    [
        (b"\x00" * 100, 400),  # no HTTP at all
        (b"GET / HTTP/1.1\r\nhost: cp\r\nx-long: " + b"a" * 20000 + b"\r\n\r\n", 431),  # too large, arriving whole
        (b"GET / HTTP/1.1\r\n" + b"x-long: " + b"a" * 20000, 431),  # too large, unfinished
        (b"GET / HT", 0),  # cut short: nothing to answer
    ],
)
async def test_garbage_too_large_or_cut_heads_reach_no_handler(data: bytes, status: int) -> None:
    seen: list[Request] = []

    async def capture(request: Request) -> Upgrade:
        seen.append(request)
        raise AssertionError("routed")

    answered = await exchange(capture, data, eof=True, upgrades=True)
    assert not seen and answered.status == status, answered


@pytest.mark.parametrize(
    ("data", "says"),
    [
        (UPGRADE.replace(b"GET", b"POST", 1), "expected a WebSocket upgrade (GET, HTTP/1.1)"),
        (UPGRADE.replace(b"node-a", b"node-b"), "node id 'node-b' does not match its certificate CN 'node-a'"),
        (b"GET /v1/agent HTTP/1.1\r\nhost: cp\r\nx-llmgw-node-id: node-a\r\n\r\n", "expected a WebSocket upgrade to"),
        (UPGRADE.replace(b"sec-websocket-version: 13", b"sec-websocket-version: 8"), "expected a WebSocket upgrade"),
        (UPGRADE.replace(b"/v1/agent", b"/v1/agent?x=1"), "no agent link at '/v1/agent?x=1'"),
        (
            b"GET /v1/agent HTTP/1.0\r\nupgrade: websocket\r\nconnection: Upgrade\r\nx-llmgw-node-id: node-a\r\n\r\n",
            "HTTP/1.0",
        ),
    ],
)
async def test_what_is_not_a_websocket_upgrade_for_this_node_is_refused(data: bytes, says: str) -> None:
    request, _ = await parsed(data)
    assert request is not None
    with pytest.raises(UpgradeRefused) as info:
        check(request)
    assert info.value.status in (400, 403, 404) and says in str(info.value), info.value


async def test_the_upgrade_request_is_handed_over_as_parsed() -> None:
    request, _ = await parsed(UPGRADE + b"early")
    assert request is not None
    assert agentport.upgrade_request(request) == ls.UpgradeRequest(
        method=b"GET",
        target=b"/v1/agent",
        http_version=b"1.1",
        headers=request.raw_headers,
        early=5,
    )
    assert (b"x-llmgw-node-id", b"node-a") in request.raw_headers


async def test_a_refusal_is_plain_http_that_says_why_and_closes() -> None:
    async def refuse(request: Request) -> Upgrade:
        raise HTTPError(403, "node id 'x' does not match")

    answered = await exchange(refuse, UPGRADE, upgrades=True)
    assert answered.status == 403 and answered.body == b"node id 'x' does not match\n"
    assert answered.headers[b"content-type"] == b"text/plain; charset=utf-8"
    assert answered.headers[b"connection"] == b"close"


async def test_the_link_is_accepted_from_the_bytes_the_server_read() -> None:
    client, server = trio.testing.memory_stream_pair()
    replies: list[str] = []
    async with trio.open_nursery() as nursery:

        async def agent() -> None:
            ws = await trio_websocket.wrap_client_stream(
                nursery, client, "cp", w.AGENT_PATH, extra_headers=[(w.NODE_ID_HEADER.encode(), b"node-a")]
            )
            await ws.send_message("hello")
            replies.append(await ws.get_message())

        async def link(stream: trio.abc.Stream, prefix: bytes) -> None:
            async with trio.open_nursery() as inner:
                ws = await agentport.accept_link(inner, stream, prefix)
                assert await ws.get_message() == "hello"
                await ws.send_message("welcome")
                await ws.aclose()
                inner.cancel_scope.cancel()

        async def handler(request: Request) -> Upgrade:
            check(request)
            return Upgrade(link)

        nursery.start_soon(agent)
        with trio.fail_after(5):
            await serve_connection(handler, server, keep_alive=False, upgrades=True)
    assert replies == ["welcome"]


async def test_a_frame_sent_before_the_101_is_refused() -> None:
    # A client waits for the 101 before it sends a frame (RFC 6455 §4.1).
    request, _ = await parsed(UPGRADE + b"\x81\x85\x01\x02\x03\x04early")
    assert request is not None
    with pytest.raises(UpgradeRefused) as info:
        check(request)
    assert info.value.status == 400 and "before the server's 101" in str(info.value)


async def test_an_upgrade_is_refused_where_the_listener_takes_none_or_the_request_has_a_body() -> None:
    async def upgrade(request: Request) -> Upgrade:
        return Upgrade(lambda stream, prefix: trio.sleep(0))

    answered = await exchange(upgrade, UPGRADE)  # upgrades=False: a bug of the route's
    assert answered.status == 500
    with_body = UPGRADE.replace(b"\r\n\r\n", b"\r\ncontent-length: 2\r\n\r\nhi")
    answered = await exchange(upgrade, with_body, upgrades=True)
    assert answered.status == 400 and b"an upgrade request has no body" in answered.body
