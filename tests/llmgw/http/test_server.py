"""The HTTP server (`llmgw.http.server`, the trio loop around the codec's server role), driven
over in-memory streams with a fake clock."""

# Over 450 lines, one thing: one connection served as a client sees it (the head, the body, the
# answer, the deadlines, the budget), each case on the same in-memory client.

from __future__ import annotations

import json
import math
from functools import partial

import h11
import pytest
import trio
import trio.testing

from llmgw.http.body import MAX_BODY_CHUNKS, BodyBudget
from llmgw.http.errors import BodyAborted, HTTPError, peer_reason
from llmgw.http.jsonbody import read_json
from llmgw.http.limits import Limits
from llmgw.http.listeners import ConnectionStats
from llmgw.http.messages import Request, Response, StreamingResponse, allow
from llmgw.http.openai import error_body
from llmgw.http.server import serve_connection

pytestmark = pytest.mark.trio


async def echo(request: Request) -> Response:
    if request.path == "/boom":
        raise RuntimeError("handler bug")
    if request.path == "/refuse":
        raise HTTPError(409, "no, because")
    return Response.json(200, {"method": request.method, "path": request.path, "body": (await request.read()).decode()})


class Client:
    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream = stream
        self.conn = h11.Connection(h11.CLIENT)

    async def send(self, method: str, target: str, body: bytes = b"", headers=()) -> None:
        hdrs = [("host", "test"), ("content-length", str(len(body))), *headers]
        await self.stream.send_all(self.conn.send(h11.Request(method=method, target=target, headers=hdrs)))
        await self.stream.send_all(self.conn.send(h11.Data(data=body)) if body else b"")
        await self.stream.send_all(self.conn.send(h11.EndOfMessage()))

    async def response(self) -> tuple[int, bytes, dict[str, str]]:
        status, body, headers = None, b"", {}
        while True:
            event = self.conn.next_event()
            if event is h11.NEED_DATA:
                self.conn.receive_data(await self.stream.receive_some(65536))
                continue
            if isinstance(event, h11.Response):
                status = event.status_code
                headers = {k.decode(): v.decode() for k, v in event.headers}
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                if self.conn.our_state is h11.DONE and self.conn.their_state is h11.DONE:
                    self.conn.start_next_cycle()
                return status, body, headers
            elif isinstance(event, h11.ConnectionClosed):
                raise EOFError


async def serve(handler, limits: Limits, stream, stats: ConnectionStats | None = None) -> None:
    await serve_connection(handler, stream, limits=limits, stats=stats)


async def start(nursery: trio.Nursery, limits: Limits = Limits()) -> Client:
    client_stream, server_stream = trio.testing.memory_stream_pair()
    nursery.start_soon(serve, echo, limits, server_stream)
    return Client(client_stream)


async def test_keep_alive_serves_several_requests_in_order() -> None:
    async with trio.open_nursery() as nursery:
        c = await start(nursery)
        for i in range(3):
            await c.send("POST", f"/r{i}?x=1", body=b"hello")
            status, body, headers = await c.response()
            assert status == 200 and f'"path":"/r{i}"'.encode() in body and b'"body":"hello"' in body
            assert headers["content-type"] == "application/json"
        nursery.cancel_scope.cancel()


async def test_pipelined_requests_are_answered_in_order() -> None:
    async with trio.open_nursery() as nursery:
        c = await start(nursery)
        raw = b"GET /a HTTP/1.1\r\nhost: t\r\n\r\nGET /b HTTP/1.1\r\nhost: t\r\n\r\n"
        await c.stream.send_all(raw)
        c.conn.send(h11.Request(method="GET", target="/a", headers=[("host", "t")]))
        c.conn.send(h11.EndOfMessage())
        assert b'"/a"' in (await c.response())[1]
        c.conn.send(h11.Request(method="GET", target="/b", headers=[("host", "t")]))
        c.conn.send(h11.EndOfMessage())
        assert b'"/b"' in (await c.response())[1]
        nursery.cancel_scope.cancel()


async def test_errors_are_plain_text_with_their_status_and_a_bug_is_a_500() -> None:
    async with trio.open_nursery() as nursery:
        c = await start(nursery)
        await c.send("GET", "/refuse")
        status, body, headers = await c.response()
        assert status == 409 and body == b"no, because\n" and headers["content-type"].startswith("text/plain")
        await c.send("GET", "/boom")
        status, body, _ = await c.response()
        assert status == 500 and b"the server's log has the traceback" in body
        await c.send("GET", "/after-a-bug")  # the connection survives a handler's bug
        assert (await c.response())[0] == 200
        nursery.cancel_scope.cancel()


async def test_a_listener_words_its_errors_in_its_own_shape() -> None:
    client_stream, server_stream = trio.testing.memory_stream_pair()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(partial(serve_connection, echo, server_stream, errors=error_body))
        c = Client(client_stream)
        await c.send("GET", "/refuse")
        status, body, _ = await c.response()
        assert status == 409 and json.loads(body) == {
            "error": {"message": "no, because", "type": "invalid_request_error", "param": None, "code": None}
        }
        await c.send("GET", "/boom")
        status, body, _ = await c.response()
        assert status == 500 and json.loads(body)["error"]["type"] == "server_error"
        nursery.cancel_scope.cancel()


async def test_body_over_the_limit_is_413_before_it_is_read() -> None:
    async with trio.open_nursery() as nursery:
        c = await start(nursery, Limits(max_body_bytes=10))
        await c.send("POST", "/x", body=b"x" * 11)
        status, body, headers = await c.response()
        assert status == 413 and b"larger than the limit of 10" in body
        assert headers["connection"] == "close"
        nursery.cancel_scope.cancel()


async def test_oversized_head_is_refused() -> None:
    async with trio.open_nursery() as nursery:
        c = await start(nursery, Limits(max_head_bytes=200))
        await c.send("GET", "/x", headers=[("x-big", "y" * 400)])
        status, _, _ = await c.response()
        assert status == 431
        nursery.cancel_scope.cancel()


async def test_malformed_request_is_400() -> None:
    async with trio.open_nursery() as nursery:
        c = await start(nursery)
        await c.stream.send_all(b"NOT HTTP AT ALL\r\n\r\n")
        c.conn.send(h11.Request(method="GET", target="/", headers=[("host", "t")]))
        status, body, _ = await c.response()
        assert status == 400 and b"malformed HTTP request" in body
        nursery.cancel_scope.cancel()


async def test_stalled_body_times_out_with_408(autojump_clock: trio.testing.MockClock) -> None:
    async with trio.open_nursery() as nursery:
        c = await start(nursery, Limits(body_timeout_s=5))
        await c.stream.send_all(b"POST /x HTTP/1.1\r\nhost: t\r\ncontent-length: 100\r\n\r\nonly-some")
        c.conn.send(h11.Request(method="POST", target="/x", headers=[("host", "t"), ("content-length", "100")]))
        before = trio.current_time()
        status, body, _ = await c.response()
        assert status == 408 and trio.current_time() - before == pytest.approx(5, abs=0.1)
        nursery.cancel_scope.cancel()


async def test_idle_connection_is_closed_after_the_head_timeout(autojump_clock: trio.testing.MockClock) -> None:
    client_stream, server_stream = trio.testing.memory_stream_pair()
    with trio.fail_after(100):
        await serve(echo, Limits(head_timeout_s=30), server_stream)
    assert trio.current_time() == pytest.approx(30, abs=0.1)
    assert await client_stream.receive_some(10) == b""


# -- streamed responses -------------------------------------------------------------------------


class Producer:
    """A streamed body that records what happened to it: chunks made, and how it ended."""

    def __init__(self, count: int, gap_s: float, fail_at: int | None = None) -> None:
        self.count, self.gap_s, self.fail_at = count, gap_s, fail_at
        self.made: list[float] = []
        self.ended: tuple[str, float] | None = None

    async def body(self):
        try:
            for i in range(self.count):
                await trio.sleep(self.gap_s)
                if i == self.fail_at:
                    raise RuntimeError("producer bug")
                self.made.append(trio.current_time())
                yield f"chunk {i}\n".encode()
            self.ended = ("finished", trio.current_time())
        except trio.Cancelled:
            self.ended = ("cancelled", trio.current_time())
            raise
        except GeneratorExit:
            self.ended = ("closed", trio.current_time())
            raise


async def start_streaming(nursery: trio.Nursery, producer: Producer) -> Client:
    async def handler(request: Request) -> Response | StreamingResponse:
        if request.path == "/stream":
            return StreamingResponse(status=200, body=producer.body(), headers=(("content-type", "text/event-stream"),))
        return await echo(request)

    client_stream, server_stream = trio.testing.memory_stream_pair()
    nursery.start_soon(serve, handler, Limits(), server_stream)
    return Client(client_stream)


async def read_events(c: Client):
    """h11 events of one response as they arrive, each with the (fake) time it arrived."""
    while True:
        event = c.conn.next_event()
        if event is h11.NEED_DATA:
            c.conn.receive_data(await c.stream.receive_some(65536))
            continue
        yield trio.current_time(), event
        if isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
            return


async def test_streamed_chunks_are_sent_as_produced_then_the_connection_is_reused(
    autojump_clock: trio.testing.MockClock,
) -> None:
    producer = Producer(count=3, gap_s=2)
    async with trio.open_nursery() as nursery:
        c = await start_streaming(nursery, producer)
        await c.send("GET", "/stream")
        arrivals, head = [], None
        async for at, event in read_events(c):
            if isinstance(event, h11.Response):
                head = event
            elif isinstance(event, h11.Data):
                arrivals.append((at, bytes(event.data)))
        assert head is not None and head.status_code == 200
        headers = {k.decode(): v.decode() for k, v in head.headers}
        assert headers["transfer-encoding"] == "chunked" and "content-length" not in headers
        assert headers["content-type"] == "text/event-stream"
        # Each chunk arrived when it was made, not all at the end.
        assert [body for _, body in arrivals] == [b"chunk 0\n", b"chunk 1\n", b"chunk 2\n"]
        assert [at for at, _ in arrivals] == pytest.approx(producer.made)
        assert producer.made == pytest.approx([2, 4, 6])
        assert producer.ended == ("finished", pytest.approx(6))
        c.conn.start_next_cycle()
        await c.send("GET", "/after")  # keep-alive survives a streamed response
        assert (await c.response())[0] == 200
        nursery.cancel_scope.cancel()


async def test_client_disconnect_cancels_the_producer_at_once(autojump_clock: trio.testing.MockClock) -> None:
    producer = Producer(count=5, gap_s=100)
    async with trio.open_nursery() as nursery:
        c = await start_streaming(nursery, producer)
        await c.send("GET", "/stream")
        async for _, event in read_events(c):
            if isinstance(event, h11.Data):
                break  # the first chunk, at t=100
        closed_at = trio.current_time()
        await c.stream.aclose()
        with trio.fail_after(1):  # not at the next chunk, 100 s later
            while producer.ended is None:
                await trio.sleep(0.01)
        assert producer.ended[0] in ("cancelled", "closed")
        assert producer.ended[1] == pytest.approx(closed_at, abs=0.1)
        assert len(producer.made) == 1
        nursery.cancel_scope.cancel()


async def test_failing_producer_truncates_the_body_and_closes(autojump_clock: trio.testing.MockClock) -> None:
    producer = Producer(count=3, gap_s=1, fail_at=1)
    async with trio.open_nursery() as nursery:
        c = await start_streaming(nursery, producer)
        await c.send("GET", "/stream")
        data = b""
        with pytest.raises(h11.RemoteProtocolError):  # closed before the last chunk: not a whole body
            async for _, event in read_events(c):
                if isinstance(event, h11.Data):
                    data += event.data
        assert data == b"chunk 0\n"
        nursery.cancel_scope.cancel()


async def test_request_pipelined_during_a_stream_is_answered_after_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    producer = Producer(count=2, gap_s=1)
    async with trio.open_nursery() as nursery:
        c = await start_streaming(nursery, producer)
        await c.stream.send_all(b"GET /stream HTTP/1.1\r\nhost: t\r\n\r\nGET /next HTTP/1.1\r\nhost: t\r\n\r\n")
        c.conn.send(h11.Request(method="GET", target="/stream", headers=[("host", "t")]))
        c.conn.send(h11.EndOfMessage())
        status, body, _ = await c.response()
        assert status == 200 and body == b"chunk 0\nchunk 1\n"
        c.conn.send(h11.Request(method="GET", target="/next", headers=[("host", "t")]))
        c.conn.send(h11.EndOfMessage())
        status, body, _ = await c.response()
        assert status == 200 and b'"/next"' in body
        nursery.cancel_scope.cancel()


async def test_a_client_that_leaves_cancels_a_working_handler() -> None:
    cancelled = trio.Event()

    async def slow(request: Request) -> Response:
        await request.read()  # the connection is watched once its body is settled
        try:
            await trio.sleep_forever()
        except trio.Cancelled:
            cancelled.set()
            raise

    client_stream, server_stream = trio.testing.memory_stream_pair()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(serve, slow, Limits(), server_stream)
        c = Client(client_stream)
        await c.send("POST", "/v1/completions", body=b"{}")
        await trio.testing.wait_all_tasks_blocked()
        await client_stream.aclose()
        with trio.fail_after(5):
            await cancelled.wait()


# -- hostile peers: deadlines, containment, counts -------------------------------------------------


async def serve_and_answer(handler, limits, feed, stats) -> tuple[bytes, float]:
    """Serve one connection whose client runs `feed(stream)` and reads everything; the bytes
    the client received and when the first of them arrived."""
    client_stream, server_stream = trio.testing.memory_stream_pair()
    answer, answered_at = b"", []

    async def read() -> None:
        nonlocal answer
        while chunk := await client_stream.receive_some(65536):
            answered_at.append(trio.current_time())
            answer += chunk

    async def feed_until_closed() -> None:
        try:
            await feed(client_stream)
        except trio.BrokenResourceError:
            pass  # the server closed the connection: what the test is about

    async with trio.open_nursery() as nursery:
        nursery.start_soon(feed_until_closed)
        nursery.start_soon(read)
        await serve(handler, limits, server_stream, stats)
        nursery.cancel_scope.cancel()
    return answer, (answered_at or [math.inf])[0]


def aborted(stats: ConnectionStats) -> dict[str, float]:
    return {key[1]: value for key, value in stats.aborted.values.items()}


async def test_a_head_trickled_a_byte_a_second_is_cut_at_the_head_deadline(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # A per-read timeout restarts on every byte; a deadline does not.
    stats = ConnectionStats()
    head = b"GET /x HTTP/1.1\r\nhost: t\r\nx-pad: " + b"y" * 100 + b"\r\n\r\n"

    async def trickle(stream) -> None:
        for i in range(len(head)):
            await trio.sleep(1)
            await stream.send_all(head[i : i + 1])

    answer, answered_at = await serve_and_answer(echo, Limits(head_timeout_s=10), trickle, stats)
    assert answered_at == pytest.approx(10, abs=0.1)
    assert answer.startswith(b"HTTP/1.1 408 ") and b"request head not received within 10 s" in answer
    assert aborted(stats) == {"head_timeout": 1}


async def test_a_body_below_the_minimum_rate_is_408(autojump_clock: trio.testing.MockClock) -> None:
    stats = ConnectionStats()

    async def send_slowly(stream) -> None:
        await stream.send_all(b"POST /x HTTP/1.1\r\nhost: t\r\ncontent-length: 100000\r\n\r\n")
        for _ in range(60):
            await trio.sleep(1)
            await stream.send_all(b"z" * 100)  # 100 bytes a second

    limits = Limits(body_min_bytes_per_s=1024, body_timeout_s=60)
    answer, at = await serve_and_answer(echo, limits, send_slowly, stats)
    # 5 s of grace plus what the bytes received bought (1/1024 s each): far below 60 s.
    assert 5 < at < 6
    assert answer.startswith(b"HTTP/1.1 408 ") and b"slower than 1024 bytes per second" in answer
    assert aborted(stats) == {"body_too_slow": 1}


async def test_a_body_at_the_minimum_rate_is_taken_until_the_body_deadline(
    autojump_clock: trio.testing.MockClock,
) -> None:
    stats = ConnectionStats()

    async def send(stream) -> None:
        await stream.send_all(b"POST /x HTTP/1.1\r\nhost: t\r\ncontent-length: 30720\r\n\r\n")
        for _ in range(30):
            await trio.sleep(1)
            await stream.send_all(b"z" * 1024)

    limits = Limits(body_min_bytes_per_s=1024, body_timeout_s=20, max_body_bytes=1 << 20)
    answer, at = await serve_and_answer(echo, limits, send, stats)
    assert at == pytest.approx(20, abs=0.1)  # fast enough, but not whole by the body deadline
    assert b"request body not received within 20 s" in answer
    assert aborted(stats) == {"body_timeout": 1}


async def test_an_idle_keep_alive_connection_closes_quietly_after_the_keepalive_timeout(
    autojump_clock: trio.testing.MockClock,
) -> None:
    stats = ConnectionStats()
    client_stream, server_stream = trio.testing.memory_stream_pair()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(serve, echo, Limits(head_timeout_s=5, keepalive_timeout_s=40), server_stream, stats)
        c = Client(client_stream)
        await c.send("GET", "/one")
        assert (await c.response())[0] == 200
        answered = trio.current_time()
        assert await client_stream.receive_some(65536) == b""  # closed, with nothing more said
        assert trio.current_time() - answered == pytest.approx(40, abs=0.1)
    assert aborted(stats) == {}  # an idle keep-alive ending is no abort


async def test_a_client_that_stops_reading_is_cut_after_the_send_timeout(
    autojump_clock: trio.testing.MockClock,
) -> None:
    stats = ConnectionStats()
    ended: list[float] = []

    async def endless():
        try:
            while True:
                await trio.sleep(0.01)
                yield b"x" * 4096
        finally:
            ended.append(trio.current_time())

    async def handler(request: Request) -> StreamingResponse:
        return StreamingResponse(status=200, body=endless())

    # lockstep: a write completes only when the other side has read all of it.
    client_stream, server_stream = trio.testing.lockstep_stream_pair()

    async def client() -> None:
        await Client(client_stream).send("GET", "/stream")
        await client_stream.receive_some(200)  # the head, a chunk maybe; then it never reads again

    async with trio.open_nursery() as nursery:
        nursery.start_soon(client)
        with trio.fail_after(100):
            await serve(handler, Limits(send_timeout_s=7), server_stream, stats)
        nursery.cancel_scope.cancel()
    assert trio.current_time() == pytest.approx(7, abs=1)
    assert aborted(stats) == {"send_timeout": 1}


@pytest.mark.parametrize("cut", [1, 10, 30])
async def test_a_head_cut_short_by_the_client_ends_that_connection_only(cut: int) -> None:
    stats = ConnectionStats()
    client_stream, server_stream = trio.testing.memory_stream_pair()
    await client_stream.send_all(b"GET /health HTTP/1.1\r\nhost: t\r\nx-more: stuff\r\n\r\n"[:cut])
    await client_stream.aclose()  # FIN in the middle of the head
    with trio.fail_after(5):
        await serve(echo, Limits(), server_stream, stats)  # returns: raises nothing
    assert aborted(stats) == {"closed": 1}


async def test_an_error_answer_the_client_cannot_receive_ends_that_connection_only() -> None:
    # The first crash seen: garbage, then the peer gone before the 400 could be written.
    stats = ConnectionStats()
    client_stream, server_stream = trio.testing.memory_stream_pair()
    await client_stream.send_all(b"NOT HTTP AT ALL\r\n\r\n")
    client_stream.send_stream.close()  # fully closed: the server's write of its 400 fails
    client_stream.receive_stream.close()
    with trio.fail_after(5):
        await serve(echo, Limits(), server_stream, stats)
    assert aborted(stats) == {"malformed": 1}


@pytest.mark.parametrize(
    "body",
    [b"[" * 2000 + b"]" * 2000, b'{"a":' * 65 + b"1" + b"}" * 65, b'{"messages":' + b"[" * 4000],
    ids=["array-2000", "object-65", "unclosed-4000"],
)
async def test_json_nested_too_deep_is_a_400_naming_the_limit(body: bytes) -> None:
    async def handler(request: Request) -> Response:
        return Response.json(200, await read_json(request))

    async with trio.open_nursery() as nursery:
        client_stream, server_stream = trio.testing.memory_stream_pair()
        nursery.start_soon(serve, handler, Limits(), server_stream)
        c = Client(client_stream)
        await c.send("POST", "/x", body=body)
        status, answer, _ = await c.response()
        assert status == 400 and b"deeper than 64 levels" in answer
        await c.send("POST", "/x", body=b'{"ok": [[["still served"]]], "s": "[[[[[[[[[[[[[[[[[[[[[[["}')
        assert (await c.response())[0] == 200
        nursery.cancel_scope.cancel()


async def test_peer_failures_are_told_from_bugs() -> None:
    reset = trio.BrokenResourceError()
    reset.__cause__ = ConnectionResetError(104, "Connection reset by peer")
    assert peer_reason(reset) == "reset"
    assert peer_reason(trio.BrokenResourceError()) == "closed"
    assert peer_reason(trio.TooSlowError()) == "send_timeout"
    group = BaseExceptionGroup("nursery", [ExceptionGroup("inner", [reset])])
    assert peer_reason(group) == "reset"
    assert peer_reason(ExceptionGroup("mixed", [reset, KeyError("bug")])) is None
    assert peer_reason(RuntimeError("bug")) is None


async def test_a_producer_that_aborts_on_purpose_truncates_without_a_traceback(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    stats = ConnectionStats()

    async def upstream_breaks():
        yield b"data: part\n\n"
        await trio.sleep(1)
        raise BodyAborted("the replica's connection broke")

    async def handler(request: Request) -> StreamingResponse:
        return StreamingResponse(status=200, body=upstream_breaks())

    async def ask(stream) -> None:
        await Client(stream).send("GET", "/stream")

    answer, _ = await serve_and_answer(handler, Limits(), ask, stats)
    assert answer.startswith(b"HTTP/1.1 200 ") and b"data: part" in answer
    assert not answer.endswith(b"0\r\n\r\n")  # no last chunk: the client can tell it was cut
    assert aborted(stats) == {"body_aborted": 1}
    assert not [r for r in caplog.records if r.exc_info]


# -- the head before the body, the body budget, HEAD, framing -------------------------------------


async def refuse_from_head(request: Request) -> Response:
    """A handler like the gateway's: no credential, no body read."""
    if request.headers.get("authorization") != "Bearer k":
        raise HTTPError(401, "no key")
    return Response.json(200, {"size": len(await request.read())})


async def test_a_request_refused_from_its_head_is_answered_before_its_body_is_sent(
    autojump_clock: trio.testing.MockClock,
) -> None:
    stats = ConnectionStats()
    sent: list[int] = []

    async def head_only(stream) -> None:
        await stream.send_all(b"POST /v1/x HTTP/1.1\r\nhost: t\r\ncontent-length: 8000000\r\n\r\n")
        sent.append(0)
        await trio.sleep(3600)  # the body never comes: the answer must not wait for it

    answer, at = await serve_and_answer(refuse_from_head, Limits(), head_only, stats)
    assert at < 1 and answer.startswith(b"HTTP/1.1 401 ") and b"no key" in answer
    assert b"connection: close" in answer  # the unread body cannot be skipped: the connection ends


async def test_an_authorised_request_reads_its_body_and_keeps_the_connection() -> None:
    async with trio.open_nursery() as nursery:
        client_stream, server_stream = trio.testing.memory_stream_pair()
        nursery.start_soon(serve, refuse_from_head, Limits(), server_stream)
        c = Client(client_stream)
        for _ in range(2):
            await c.send("POST", "/v1/x", body=b"z" * 1000, headers=[("authorization", "Bearer k")])
            status, body, headers = await c.response()
            assert status == 200 and body == b'{"size":1000}\n' and "connection" not in headers
        nursery.cancel_scope.cancel()


async def test_bodies_wait_for_room_in_the_budget_then_get_503(autojump_clock: trio.testing.MockClock) -> None:
    release = trio.Event()
    budget = BodyBudget(1000, wait_s=2.0)

    async def hold(request: Request) -> Response:
        body = await request.read()
        if request.path == "/hold":
            await release.wait()
        return Response.json(200, {"size": len(body)})

    async def client(path: str, size: int, out: list) -> None:
        client_stream, server_stream = trio.testing.memory_stream_pair()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(partial(serve_connection, hold, server_stream, budget=budget))
            c = Client(client_stream)
            await c.send("POST", path, body=b"z" * size)
            out.append((path, *(await c.response())[:2], trio.current_time()))
            nursery.cancel_scope.cancel()

    answers: list = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(client, "/hold", 800, answers)
        await trio.testing.wait_all_tasks_blocked()
        assert budget.used == 800
        nursery.start_soon(client, "/refused", 300, answers)  # does not fit within 2 s
        await trio.sleep(2.5)
        assert answers[0][:2] == ("/refused", 503) and b"its limit of 1000" in answers[0][2]
        nursery.start_soon(client, "/waits", 300, answers)  # fits once /hold is over
        await trio.sleep(1)
        release.set()
    assert [(path, status) for path, status, _, _ in answers] == [("/refused", 503), ("/hold", 200), ("/waits", 200)]
    assert answers[2][3] - answers[1][3] < 0.01  # answered as soon as there was room
    assert budget.used == 0 and budget.refused == 1


async def test_a_chunked_body_is_counted_against_the_budget_as_it_arrives(
    autojump_clock: trio.testing.MockClock,
) -> None:
    budget = BodyBudget(10_000, wait_s=1.0)

    async def chunked(stream) -> None:
        await stream.send_all(
            b"POST /v1/x HTTP/1.1\r\nhost: t\r\nauthorization: Bearer k\r\ntransfer-encoding: chunked\r\n\r\n"
        )
        for _ in range(20):
            await stream.send_all(b"3e8\r\n" + b"z" * 1000 + b"\r\n")

    client_stream, server_stream = trio.testing.memory_stream_pair()
    answer = b""
    async with trio.open_nursery() as nursery:
        nursery.start_soon(chunked, client_stream)
        await serve_connection(refuse_from_head, server_stream, budget=budget)
        while chunk := await client_stream.receive_some(65536):
            answer += chunk
        nursery.cancel_scope.cancel()
    assert answer.startswith(b"HTTP/1.1 503 ") and b"retry-after: 1" in answer
    assert budget.used == 0


async def test_a_chunked_body_of_too_many_chunks_is_refused(autojump_clock: trio.testing.MockClock) -> None:
    stats = ConnectionStats()

    async def tiny_chunks(stream) -> None:
        await stream.send_all(
            b"POST /v1/x HTTP/1.1\r\nhost: t\r\nauthorization: Bearer k\r\ntransfer-encoding: chunked\r\n\r\n"
        )
        await stream.send_all(b"1\r\nz\r\n" * (MAX_BODY_CHUNKS + 1) + b"0\r\n\r\n")

    answer, _ = await serve_and_answer(refuse_from_head, Limits(), tiny_chunks, stats)
    assert answer.startswith(b"HTTP/1.1 400 ") and f"more than {MAX_BODY_CHUNKS} chunks".encode() in answer


async def test_a_chunked_body_in_few_chunks_is_read_whole() -> None:
    async with trio.open_nursery() as nursery:
        client_stream, server_stream = trio.testing.memory_stream_pair()
        nursery.start_soon(serve, refuse_from_head, Limits(), server_stream)
        head = b"POST /v1/x HTTP/1.1\r\nhost: t\r\nauthorization: Bearer k\r\ntransfer-encoding: chunked\r\n\r\n"
        await client_stream.send_all(head + (b"2710\r\n" + b"z" * 10_000 + b"\r\n") * 10 + b"0\r\n\r\n")
        c = Client(client_stream)
        c.conn.send(
            h11.Request(method="POST", target="/v1/x", headers=[("host", "t"), ("transfer-encoding", "chunked")])
        )
        c.conn.send(h11.EndOfMessage())
        status, body, _ = await c.response()
        assert status == 200 and body == b'{"size":100000}\n'
        nursery.cancel_scope.cancel()


async def test_content_length_with_transfer_encoding_is_400_and_closed(autojump_clock: trio.testing.MockClock) -> None:
    stats = ConnectionStats()

    async def both(stream) -> None:
        await stream.send_all(
            b"POST /x HTTP/1.1\r\nhost: t\r\ncontent-length: 5\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n"
            b"GET /smuggled HTTP/1.1\r\nhost: t\r\n\r\n"
        )

    answer, _ = await serve_and_answer(echo, Limits(), both, stats)
    assert answer.startswith(b"HTTP/1.1 400 ") and b"both Content-Length and Transfer-Encoding" in answer
    assert b"connection: close" in answer and b"/smuggled" not in answer
    assert answer.count(b"HTTP/1.1 ") == 1
    assert aborted(stats) == {"malformed": 1}


async def test_head_is_answered_as_get_without_the_body() -> None:
    async def routes(request: Request):
        allow(request, "GET")
        if request.path == "/stream":

            async def chunks():
                yield b"never sent"

            return StreamingResponse(status=200, body=chunks(), headers=(("content-type", "text/plain"),))
        return Response.json(200, {"hello": "world"})

    async with trio.open_nursery() as nursery:
        client_stream, server_stream = trio.testing.memory_stream_pair()
        nursery.start_soon(serve, routes, Limits(), server_stream)
        c = Client(client_stream)
        await c.send("HEAD", "/x")
        status, body, headers = await c.response()
        assert (status, body, headers["content-length"]) == (200, b"", str(len(b'{"hello":"world"}\n')))
        await c.send("HEAD", "/stream")
        status, body, headers = await c.response()
        assert (status, body, headers["content-type"]) == (200, b"", "text/plain")
        await c.send("GET", "/x")  # the connection is still good
        assert (await c.response())[1] == b'{"hello":"world"}\n'
        await c.send("POST", "/x")
        status, _, headers = await c.response()
        assert status == 405 and headers["allow"] == "GET, HEAD"
        nursery.cancel_scope.cancel()


async def test_a_route_with_a_smaller_limit_is_413_before_its_body_is_read(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async def small(request: Request) -> Response:
        return Response.json(200, await read_json(request, limit=100))

    async def head_only(stream) -> None:
        await stream.send_all(b"POST /x HTTP/1.1\r\nhost: t\r\ncontent-length: 101\r\n\r\n")
        await trio.sleep(3600)

    answer, at = await serve_and_answer(small, Limits(), head_only, ConnectionStats())
    assert at < 1 and answer.startswith(b"HTTP/1.1 413 ") and b"larger than the limit of 100 bytes" in answer


@pytest.mark.parametrize("lengths", [b"0, 0", b"5, 5", b"5,5 , 5"])
async def test_a_list_of_equal_content_lengths_is_taken_as_one(
    lengths: bytes, autojump_clock: trio.testing.MockClock
) -> None:
    """RFC 9112 §6.3: a Content-Length that is a list of one value repeated is that value (as
    h11 takes it); it once reached `int()` whole and was a 500 with a traceback."""
    stats = ConnectionStats()
    body = b"hello"[: int(lengths.split(b",")[0])]

    async def listed(stream) -> None:
        await stream.send_all(b"POST /x HTTP/1.1\r\nhost: t\r\ncontent-length: " + lengths + b"\r\n\r\n" + body)
        await stream.send_all(b"GET /next HTTP/1.1\r\nhost: t\r\nconnection: close\r\n\r\n")

    answer, _ = await serve_and_answer(echo, Limits(), listed, stats)
    assert answer.startswith(b"HTTP/1.1 200 ") and b'"body":"' + body + b'"' in answer
    assert b'"path":"/next"' in answer and aborted(stats) == {}


async def test_differing_listed_content_lengths_are_400(autojump_clock: trio.testing.MockClock) -> None:
    stats = ConnectionStats()

    async def differing(stream) -> None:
        await stream.send_all(b"POST /x HTTP/1.1\r\nhost: t\r\ncontent-length: 5, 6\r\n\r\nhello!")

    answer, _ = await serve_and_answer(echo, Limits(), differing, stats)
    assert answer.startswith(b"HTTP/1.1 400 ") and aborted(stats) == {"malformed": 1}


@pytest.mark.parametrize("name", [b"Authorization", b"cookie", b"Proxy-Authorization"])
async def test_a_credential_given_twice_is_400_whichever_would_win(
    name: bytes, autojump_clock: trio.testing.MockClock
) -> None:
    """A wrong key then a valid one was taken (the last value won): which of two credentials a
    server, a proxy before it and a log believe is a guess, so neither is."""
    stats = ConnectionStats()

    async def twice(stream) -> None:
        await stream.send_all(
            b"GET /x HTTP/1.1\r\nhost: t\r\n" + name + b": Bearer wrong\r\n" + name + b": Bearer right\r\n\r\n"
        )

    answer, _ = await serve_and_answer(echo, Limits(), twice, stats)
    assert answer.startswith(b"HTTP/1.1 400 ") and b"given more than once" in answer
    assert b"connection: close" in answer and aborted(stats) == {"malformed": 1}
