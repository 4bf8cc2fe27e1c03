"""The relay on real sockets: a client over TCP, the relay (`llmgw.http.relay`) on the shared HTTP
server, and behind it an HTTP server on a Unix socket (`llmgw.http.unixsocket`) — a test
handler, or a hostile peer that is not HTTP at all. Deadlines are real and short; the bounds
asserted on them are generous (the machine is shared)."""

from __future__ import annotations

import json
import os
import socket
import stat
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial
from pathlib import Path

import h11
import pytest
import trio
import trio.testing

from llmgw.errors import MachineError
from llmgw.http.errors import SocketInUse
from llmgw.http.messages import Request, Response, StreamingResponse
from llmgw.http.relay import CLIENT_HEADER, Relay, RelayLimits
from llmgw.http.server import bound_address, serve_http
from llmgw.http.unixsocket import MAX_PATH_BYTES, connect_unix, open_unix_listener, serve_http_unix

pytestmark = pytest.mark.trio

FAST = RelayLimits(connect_timeout_s=1.0, first_byte_timeout_s=0.5, idle_timeout_s=0.5, max_whole_bytes=1 << 20)
SLACK_S = 5.0  # how late a deadline may be answered on a loaded machine


class Client:
    """An h11 client on one TCP connection, reading an answer as it arrives."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.conn = h11.Connection(h11.CLIENT)

    @classmethod
    async def open(cls, address: tuple[str, int]) -> Client:
        return cls(await trio.open_tcp_stream(*address))

    async def send(self, method: str, target: str, headers=(), body: bytes = b"") -> None:
        fields = [("host", "cp.example:8080"), ("content-length", str(len(body))), *headers]
        data = self.conn.send(h11.Request(method=method, target=target, headers=fields))
        data += self.conn.send(h11.Data(data=body)) if body else b""
        await self.stream.send_all(data + self.conn.send(h11.EndOfMessage()))

    async def event(self):
        while (event := self.conn.next_event()) is h11.NEED_DATA:
            self.conn.receive_data(await self.stream.receive_some(65536))
        return event

    async def head(self) -> tuple[int, dict[str, str]]:
        event = await self.event()
        assert isinstance(event, h11.Response), event
        return event.status_code, {k.decode(): v.decode() for k, v in event.headers}

    async def rest(self) -> bytes:
        body = b""
        while not isinstance(event := await self.event(), h11.EndOfMessage):
            assert isinstance(event, h11.Data), event
            body += event.data
        if self.conn.our_state is h11.DONE and self.conn.their_state is h11.DONE:
            self.conn.start_next_cycle()
        return body

    async def call(self, method: str, target: str, headers=(), body: bytes = b"") -> tuple[int, dict, bytes]:
        await self.send(method, target, headers, body)
        status, fields = await self.head()
        return status, fields, await self.rest()


async def start_relay(nursery: trio.Nursery, path: Path, limits: RelayLimits = FAST) -> tuple[str, int]:
    listeners = await nursery.start(serve_http, Relay(path, limits=limits).handle, "127.0.0.1", 0)
    return bound_address(listeners)


async def call(address, method: str, target: str, headers=(), body: bytes = b"") -> tuple[int, dict, bytes]:
    client = await Client.open(address)
    try:
        return await client.call(method, target, headers, body)
    finally:
        await client.stream.aclose()


async def echo(request: Request) -> Response:
    """What the upstream saw, as JSON, with a cookie and hop-by-hop fields of its own."""
    seen = {
        "method": request.method,
        "target": request.target.decode(),
        "fields": [[k.decode(), v.decode()] for k, v in request.raw_headers],
        "client": request.client,
        "body": (await request.read()).decode(),
    }
    return Response.json(201, seen, headers=(("set-cookie", "s=1; HttpOnly"), ("keep-alive", "timeout=5")))


async def test_an_admin_request_with_its_credential_and_body_round_trips(nursery, tmp_path: Path) -> None:
    path = await nursery.start(serve_http_unix, echo, tmp_path / "run" / "cp.sock")
    relay = await start_relay(nursery, path)
    sent = [
        ("authorization", "Bearer the-token"),
        ("cookie", "llmgw_session=abc"),
        ("origin", "http://cp.example:8080"),
        ("x-llmgw-csrf", "t1"),
        ("connection", "x-private"),
        ("x-private", "hop"),
        ("keep-alive", "timeout=9"),
        (CLIENT_HEADER, "6.6.6.6:666"),  # a client's own: not believed, not passed on
    ]
    client = await Client.open(relay)
    status, fields, body = await client.call("POST", "/admin/v1/keys?x=1", sent, b'{"name": "k"}')
    seen = json.loads(body)
    assert status == 201 and seen["method"] == "POST" and seen["target"] == "/admin/v1/keys?x=1"
    assert seen["body"] == '{"name": "k"}'
    got = dict(seen["fields"])
    for name in ("host", "authorization", "cookie", "origin", "x-llmgw-csrf"):
        assert got[name] == dict([("host", "cp.example:8080"), *sent])[name]
    assert "x-private" not in got and "keep-alive" not in got and got["content-length"] == "13"
    here = client.stream.socket.getsockname()
    assert [v for k, v in seen["fields"] if k == CLIENT_HEADER] == [f"{here[0]}:{here[1]}"]
    assert seen["client"] == "unix"  # the upstream's own view: the header is for it to believe
    assert fields["set-cookie"] == "s=1; HttpOnly" and "keep-alive" not in fields
    assert fields["content-length"] == str(len(body))
    # The relay's client connection stays open for the next request.
    status, _, body = await client.call("GET", "/admin/v1/nodes")
    assert status == 201 and json.loads(body)["method"] == "GET"
    await client.stream.aclose()


async def test_server_sent_events_arrive_as_they_are_sent_and_a_client_gone_closes_the_upstream(
    nursery, tmp_path: Path
) -> None:
    second = trio.Event()
    upstream_closed = trio.Event()

    async def feed() -> AsyncIterator[bytes]:
        try:
            yield b"event: cluster\ndata: {}\n\n"
            await second.wait()
            yield b": heartbeat\n\n"
            await trio.sleep_forever()
        finally:
            upstream_closed.set()

    async def events(request: Request) -> StreamingResponse:
        return StreamingResponse(status=200, body=feed(), headers=(("content-type", "text/event-stream"),))

    path = await nursery.start(serve_http_unix, events, tmp_path / "run" / "cp.sock")
    relay = await start_relay(nursery, path, RelayLimits(idle_timeout_s=30.0))
    client = await Client.open(relay)
    await client.send("GET", "/admin/v1/events")
    with trio.fail_after(SLACK_S):
        status, fields = await client.head()
        assert status == 200 and fields["content-type"] == "text/event-stream"
        assert fields["transfer-encoding"] == "chunked" and "content-length" not in fields
        first = await client.event()  # before the stream has ended, or the second event exists
    assert isinstance(first, h11.Data) and bytes(first.data) == b"event: cluster\ndata: {}\n\n"
    assert not upstream_closed.is_set()
    second.set()
    with trio.fail_after(SLACK_S):
        beat = await client.event()
    assert isinstance(beat, h11.Data) and bytes(beat.data) == b": heartbeat\n\n"
    await client.stream.aclose()  # the browser tab closed
    with trio.fail_after(SLACK_S):
        await upstream_closed.wait()  # the control plane's side of the stream ended with it


async def test_a_long_answer_is_streamed_with_its_length_and_a_head_gets_the_length(nursery, tmp_path: Path) -> None:
    big = os.urandom(3 << 20)

    async def large(request: Request) -> Response:
        return Response(status=200, body=big, headers=(("content-type", "application/octet-stream"),))

    path = await nursery.start(serve_http_unix, large, tmp_path / "run" / "cp.sock")
    relay = await start_relay(nursery, path)
    status, fields, body = await call(relay, "GET", "/metrics")
    assert status == 200 and fields["content-length"] == str(len(big)) and body == big
    client = await Client.open(relay)
    await client.send("HEAD", "/metrics")
    status, fields = await client.head()
    assert status == 200 and fields["content-length"] == str(len(big))
    assert isinstance(await client.event(), h11.EndOfMessage)


async def test_no_control_plane_is_503_with_retry_after_at_once(nursery, tmp_path: Path) -> None:
    path = tmp_path / "run" / "cp.sock"
    relay = await start_relay(nursery, path)
    start = trio.current_time()
    status, fields, body = await call(relay, "GET", "/admin/v1/nodes")
    assert status == 503 and fields["retry-after"] == "2"
    assert f"the control plane is not answering on its private socket {path}".encode() in body
    assert b"there is no socket" in body and b"the gateway keeps serving /v1/" in body
    # A socket left by a control plane that died: nobody listens on it.
    path.parent.mkdir(mode=0o700)
    left = socket.socket(socket.AF_UNIX)
    left.bind(str(path))
    left.close()
    status, fields, body = await call(relay, "GET", "/admin/v1/nodes")
    assert status == 503 and b"nothing listens on it" in body and fields["retry-after"] == "2"
    assert trio.current_time() - start < SLACK_S


async def test_a_control_plane_that_accepts_nothing_is_503_at_the_connect_deadline(nursery, tmp_path: Path) -> None:
    path = tmp_path / "run" / "cp.sock"
    path.parent.mkdir(mode=0o700)
    stalled = socket.socket(socket.AF_UNIX)
    stalled.bind(str(path))
    stalled.listen(0)  # and never accepts: a loop held up, its backlog filling
    queued = []
    while True:  # fill the backlog
        waiting = socket.socket(socket.AF_UNIX)
        waiting.setblocking(False)
        try:
            waiting.connect(str(path))
        except BlockingIOError:
            waiting.close()
            break
        queued.append(waiting)
    relay = await start_relay(nursery, path)
    start = trio.current_time()
    status, fields, body = await call(relay, "GET", "/admin/v1/nodes")
    took = trio.current_time() - start
    assert status == 503 and fields["retry-after"] == "2" and b"no connection within 1 s" in body, body
    assert FAST.connect_timeout_s <= took < FAST.connect_timeout_s + SLACK_S
    for s in [stalled, *queued]:
        s.close()


async def serve_raw(nursery: trio.Nursery, path: Path, peer: Callable[[trio.SocketStream], Awaitable[None]]) -> Path:
    """A hostile upstream: each connection given to `peer`, which speaks whatever it likes."""
    listener = open_unix_listener(path)

    async def one(stream: trio.SocketStream) -> None:
        try:
            await peer(stream)
        finally:
            await trio.aclose_forcefully(stream)

    nursery.start_soon(partial(trio.serve_listeners, one, [listener]))
    return path


async def request_target(stream: trio.SocketStream) -> bytes:
    """Read a request head; its target."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += await stream.receive_some(65536)
    return data.split(b" ")[1]


HOSTILE = {
    b"/cut-head": b"HTTP/1.1 200 OK\r\nContent-Le",
    b"/garbage": b"SSH-2.0-OpenSSH_9.2\r\n\r\n",
    b"/huge-head": b"HTTP/1.1 200 OK\r\nx-big: " + b"a" * 200_000 + b"\r\n\r\n",
    b"/cut-body": b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n0123456789",
}


async def hostile(stream: trio.SocketStream) -> None:
    target = await request_target(stream)
    if target in HOSTILE:
        await stream.send_all(HOSTILE[target])
        return
    if target == b"/stall-stream":
        await stream.send_all(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nfirst\r\n")
    elif target == b"/fine":
        await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        return
    await trio.sleep_forever()  # /stall: took the request, answers nothing


@pytest.mark.parametrize(
    ("target", "status", "said"),
    [
        ("/cut-head", 502, b"closed the connection before answering"),
        ("/garbage", 502, b"not an HTTP answer"),
        ("/huge-head", 502, b"not an HTTP answer"),
        ("/cut-body", 502, b"closed the connection in the middle of an answer"),
        ("/stall", 504, b"sent no answer within 0.5 s"),
    ],
)
async def test_a_hostile_upstream_is_a_clear_502_or_504_and_the_relay_keeps_serving(
    nursery, tmp_path: Path, target: str, status: int, said: bytes
) -> None:
    path = await serve_raw(nursery, tmp_path / "run" / "cp.sock", hostile)
    relay = await start_relay(nursery, path)
    start = trio.current_time()
    got, _, body = await call(relay, "GET", target)
    assert (got, trio.current_time() - start < SLACK_S) == (status, True), body
    assert said in body and b"the gateway keeps serving /v1/" in body and str(path).encode() in body
    assert (await call(relay, "GET", "/fine"))[::2] == (200, b"ok")


async def test_an_upstream_silent_in_the_middle_of_a_stream_ends_it_short(nursery, tmp_path: Path) -> None:
    path = await serve_raw(nursery, tmp_path / "run" / "cp.sock", hostile)
    relay = await start_relay(nursery, path)
    client = await Client.open(relay)
    await client.send("GET", "/stall-stream")
    with trio.fail_after(SLACK_S):
        assert (await client.head())[0] == 200
        first = await client.event()
        assert isinstance(first, h11.Data) and bytes(first.data) == b"first"
        with pytest.raises(h11.RemoteProtocolError):  # closed without the last chunk: a cut body
            await client.event()
    assert (await call(relay, "GET", "/fine"))[::2] == (200, b"ok")


async def test_the_socket_is_private_a_stale_one_is_replaced_and_a_live_one_refused(nursery, tmp_path: Path) -> None:
    old = os.umask(0)  # the modes must not come from the umask
    try:
        path = tmp_path / "state" / "run" / "cp.sock"
        path.parent.parent.mkdir(mode=0o700)
        left = socket.socket(socket.AF_UNIX)
        path.parent.mkdir(mode=0o700)
        left.bind(str(path))  # a crashed server's: the file stays, nobody listens
        left.close()
        cancel = trio.CancelScope()

        async def serve_once(*, task_status=trio.TASK_STATUS_IGNORED) -> None:
            with cancel:
                await serve_http_unix(echo, path, task_status=task_status)

        await nursery.start(serve_once)
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600 and stat.S_IMODE(os.stat(path.parent).st_mode) == 0o700
    with pytest.raises(SocketInUse) as refused:
        open_unix_listener(path)
    assert f"another server answers on {path}" in str(refused.value) and "stop it first" in str(refused.value)
    stream = await connect_unix(path)  # still the first server's
    await stream.aclose()
    cancel.cancel()
    await trio.testing.wait_all_tasks_blocked()
    assert not path.exists()  # a stopped server removes its socket
    path.write_text("not a socket")
    with pytest.raises(MachineError) as other:
        open_unix_listener(path)
    assert "is not a socket" in str(other.value) and "mv " in str(other.value)


async def test_a_socket_path_longer_than_a_socket_address_is_served_and_reached(nursery, tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    path = deep / "cp.sock"
    assert len(os.fsencode(path)) > MAX_PATH_BYTES
    await nursery.start(serve_http_unix, echo, path)
    assert stat.S_ISSOCK(os.lstat(path).st_mode) and stat.S_IMODE(os.lstat(path).st_mode) == 0o600
    relay = await start_relay(nursery, path)
    status, _, body = await call(relay, "GET", "/admin/v1/nodes")
    assert status == 201 and json.loads(body)["target"] == "/admin/v1/nodes"
