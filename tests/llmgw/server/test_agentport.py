"""The agent port's routing, on memory streams: the head is read once, routed from the head
alone, handed to the link's session as it was read (`upgrade_request`: the session judges it,
tests/llmgw/wire/test_session.py has every rule), and the link's WebSocket is accepted from the
bytes already read; what is refused is answered in plain HTTP."""

from __future__ import annotations

import h11
import pytest
import trio
import trio.testing
import trio_websocket

from llmgw.server import agentport
from llmgw.server.agentport import Route
from llmgw.wire import agent_link as w
from llmgw.wire import session as s
from llmgw.wire.errors import UpgradeRefused

pytestmark = pytest.mark.trio

UPGRADE = (
    b"GET /v1/agent HTTP/1.1\r\nhost: cp\r\nupgrade: websocket\r\nconnection: Upgrade\r\n"
    b"sec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\nsec-websocket-version: 13\r\nx-llmgw-node-id: node-a\r\n\r\n"
)


def request(target: bytes, method: bytes = b"GET") -> h11.Request:
    return h11.Request(method=method, target=target, headers=[(b"host", b"cp")])


async def test_the_route_is_decided_from_the_head_alone() -> None:
    assert agentport.route(None) is Route.NOT_HTTP
    assert agentport.route(request(w.ARTIFACTS_PREFIX.encode() + b"0" * 64)) is Route.MIRROR
    assert agentport.route(request(w.RELEASE_PREFIX.encode() + b"SHA256SUMS")) is Route.RELEASE
    assert agentport.route(request(b"/v1/releasex")) is Route.LINK  # only under the prefix
    assert agentport.route(request(w.AGENT_PATH.encode())) is Route.LINK
    assert agentport.route(request(b"/elsewhere")) is Route.LINK  # the link's session answers 404


def check(head: agentport.Head) -> None:
    """The link's session judges the upgrade request the port read."""
    session = s.ServerSession("node-a", heartbeat_interval_s=5.0, desired_state=lambda: w.DesiredState(generation=1))
    session.upgrade(agentport.upgrade_request(head), s.Standing(serial=1))


async def head_of(data: bytes, *, close: bool = False) -> agentport.Head:
    client, server = trio.testing.memory_stream_pair()
    await client.send_all(data)
    if close:
        await client.aclose()
    return await agentport.read_head(server)


async def test_a_head_trickled_in_is_read_whole() -> None:
    client, server = trio.testing.memory_stream_pair()
    async with trio.open_nursery() as nursery:

        async def trickle() -> None:
            for i in range(len(UPGRADE)):
                await client.send_all(UPGRADE[i : i + 1])
                await trio.sleep(0)

        nursery.start_soon(trickle)
        head = await agentport.read_head(server)
    assert head.request is not None and head.request.target == b"/v1/agent" and head.trailing == b""


@pytest.mark.parametrize(
    "data", [b"\x00" * 100, b"GET / HTTP/1.1\r\n" + b"x-long: " + b"a" * 20000 + b"\r\n\r\n", b"GET / HT"]
)
async def test_garbage_too_large_or_cut_heads_route_nowhere(data: bytes) -> None:
    head = await head_of(data, close=True)
    assert agentport.route(head.request) is Route.NOT_HTTP


@pytest.mark.parametrize(
    ("data", "says"),
    [
        (UPGRADE.replace(b"GET", b"POST", 1), "expected a WebSocket upgrade (GET, HTTP/1.1)"),
        (UPGRADE.replace(b"node-a", b"node-b"), "node id 'node-b' does not match its certificate CN 'node-a'"),
        (b"GET /v1/agent HTTP/1.1\r\nhost: cp\r\nx-llmgw-node-id: node-a\r\n\r\n", "expected a WebSocket upgrade to"),
        (UPGRADE.replace(b"sec-websocket-version: 13", b"sec-websocket-version: 8"), "expected a WebSocket upgrade"),
        (
            b"GET /v1/agent HTTP/1.0\r\nupgrade: websocket\r\nconnection: Upgrade\r\nx-llmgw-node-id: node-a\r\n\r\n",
            "HTTP/1.0",
        ),
    ],
)
async def test_what_is_not_a_websocket_upgrade_for_this_node_is_refused(data: bytes, says: str) -> None:
    head = await head_of(data)
    with pytest.raises(UpgradeRefused) as info:
        check(head)
    assert info.value.status in (400, 403) and says in str(info.value), info.value


async def test_the_upgrade_request_is_handed_over_as_read() -> None:
    head = await head_of(UPGRADE + b"early")
    assert agentport.upgrade_request(head) == s.UpgradeRequest(
        method=b"GET",
        target=b"/v1/agent",
        http_version=b"1.1",
        headers=tuple(head.request.headers),
        early=5,
    )
    assert (b"x-llmgw-node-id", b"node-a") in head.request.headers


async def test_a_refusal_is_plain_http_that_says_why() -> None:
    client, server = trio.testing.memory_stream_pair()
    await client.send_all(UPGRADE)
    head = await agentport.read_head(server)
    await agentport.answer(server, head, 403, "node id 'x' does not match", timeout_s=1)
    await server.aclose()
    reader = h11.Connection(h11.CLIENT)
    reader.send(h11.Request(method="GET", target="/v1/agent", headers=[("host", "cp")]))
    while (chunk := await client.receive_some(65536)) != b"":
        reader.receive_data(chunk)
    reader.receive_data(b"")
    response = reader.next_event()
    assert isinstance(response, h11.Response) and response.status_code == 403
    assert reader.next_event().data == b"node id 'x' does not match\n"


async def test_the_link_is_accepted_from_the_parsed_request_on_the_bare_stream() -> None:
    client, server = trio.testing.memory_stream_pair()
    async with trio.open_nursery() as nursery:

        async def agent() -> str:
            ws = await trio_websocket.wrap_client_stream(
                nursery, client, "cp", w.AGENT_PATH, extra_headers=[(w.NODE_ID_HEADER.encode(), b"node-a")]
            )
            await ws.send_message("hello")
            return await ws.get_message()

        replies: list[str] = []

        async def run_agent() -> None:
            replies.append(await agent())

        nursery.start_soon(run_agent)
        head = await agentport.read_head(server)
        assert dict(head.request.headers)[w.NODE_ID_HEADER.encode()] == b"node-a"
        ws = await agentport.accept_link(nursery, server, head)
        assert await ws.get_message() == "hello"
        await ws.send_message("welcome")
        with trio.fail_after(5):
            while not replies:
                await trio.sleep(0)
        nursery.cancel_scope.cancel()
    assert replies == ["welcome"]


async def test_a_frame_sent_before_the_101_is_refused() -> None:
    # A client waits for the 101 before it sends a frame (RFC 6455 §4.1).
    client, server = trio.testing.memory_stream_pair()
    await client.send_all(UPGRADE + b"\x81\x85\x01\x02\x03\x04early")
    head = await agentport.read_head(server)
    with pytest.raises(UpgradeRefused) as info:
        check(head)
    assert info.value.status == 400 and "before the server's 101" in str(info.value)
