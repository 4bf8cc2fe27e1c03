"""What the gateway forwards of a client's header fields, end to end: the client's request on a
socket to the gateway, the engine an in-process llmgw HTTP server on loopback recording the
fields as they arrived. Repeated fields arrive repeated and in order (a request's headers are
byte pairs from parse to forward); hop-by-hop fields and those `Connection` names do not; the
engine gets its own key and the client's `X-Forwarded-For` chain with the client added."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import trio

from llmgw.gateway.routing import Endpoint
from llmgw.http.messages import Request, Response
from llmgw.http.server import bound_address, serve_http
from testlib.gateway import start_gateway

pytestmark = pytest.mark.trio


class Engine:
    """An OpenAI-ish engine that answers every chat and keeps the header fields it was sent."""

    def __init__(self) -> None:
        self.seen: list[tuple[tuple[bytes, bytes], ...]] = []

    async def handle(self, request: Request) -> Response:
        await request.read()
        self.seen.append(request.raw_headers)
        return Response.json(200, {"object": "chat.completion", "choices": [{"message": {"content": "hi"}}]})


async def send_raw(port: int, data: bytes) -> bytes:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(data)
        answer = b""
        while chunk := await stream.receive_some(65536):
            answer += chunk
    return answer


async def test_repeated_headers_reach_the_engine_repeated_and_hop_by_hop_ones_do_not(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    engine = Engine()
    listeners = await nursery.start(serve_http, engine.handle, "127.0.0.1", 0)
    host, port = bound_address(listeners)
    endpoint = Endpoint(replica_id="r1", model="chat", host=host, port=port, api_key="engine-key")
    gw = await start_gateway(nursery, tmp_path, (endpoint,))
    body = json.dumps({"model": "chat", "messages": [{"role": "user", "content": "x"}]}).encode()
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\n"
        + f"authorization: Bearer {gw.token}\r\n".encode()
        + b"x-foo: one\r\nx-bar: between\r\nX-Foo: two\r\n"
        + b"x-forwarded-for: 10.1.1.1\r\nx-forwarded-for: 10.2.2.2\r\n"
        + b"connection: close, x-drop\r\nx-drop: secret\r\nkeep-alive: timeout=5\r\nte: trailers\r\n"
        + b"content-type: application/json\r\n"
        + f"content-length: {len(body)}\r\n\r\n".encode()
        + body
    )
    with trio.fail_after(15):
        answer = await send_raw(gw.port, request)
    assert answer.startswith(b"HTTP/1.1 200 "), answer
    [fields] = engine.seen
    names = [k for k, _ in fields]
    assert [v for k, v in fields if k == b"x-foo"] == [b"one", b"two"]
    assert names.index(b"x-foo") < names.index(b"x-bar") < len(names) - 1 - names[::-1].index(b"x-foo")
    assert not {b"x-drop", b"keep-alive", b"te", b"connection"} & set(names)
    assert [v for k, v in fields if k == b"authorization"] == [b"Bearer engine-key"]
    assert [v for k, v in fields if k == b"x-forwarded-for"] == [b"10.1.1.1, 10.2.2.2, 127.0.0.1"]
