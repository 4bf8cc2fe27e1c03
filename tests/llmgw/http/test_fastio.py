"""`llmgw.http.fastio` on real sockets: a write or read done at once when the socket allows it,
None or a short count when it would wait, trio's errors for a closed or broken connection; and
the listener, which no longer yields at every write, still yields to the loop while it streams
a body whose producer never waits to a client that reads as fast as it can (`looplag.StepTimer`:
no task step of 20 ms of CPU; `send_body` checkpoints every `CHECKPOINT_CHUNKS` chunks, and here
the socket's buffer filling now and then makes a write wait too). The upstream side's reads are
tests/llmgw/gateway/test_upstream_socket.py's."""

from __future__ import annotations

import socket
import struct
import subprocess

import pytest
import trio

from llmgw.http import fastio
from llmgw.http.messages import Request, StreamingResponse
from llmgw.http.server import serve_connection
from llmgw.looplag import StepTimer

pytestmark = pytest.mark.trio

EVENTS = 50_000  # of 1 kB each, to a client reading as fast as it can over TCP


def pair() -> tuple[trio.SocketStream, socket.socket]:
    ours, theirs = socket.socketpair()
    return trio.SocketStream(trio.socket.from_stdlib_socket(ours)), theirs


async def test_what_the_socket_takes_or_holds_now_and_no_more() -> None:
    stream, peer = pair()
    with peer:
        assert fastio.receive_now(stream, 100) is None  # nothing yet: the caller waits
        peer.sendall(b"hello")
        assert fastio.receive_now(stream, 100) == b"hello"
        assert fastio.send_now(stream, b"ping") == 4 and peer.recv(10) == b"ping"
        big = b"x" * (16 << 20)
        taken = fastio.send_now(stream, big)
        assert 0 < taken < len(big)  # what the buffers hold, not waiting for the rest
        assert fastio.send_now(stream, big) == 0  # full: nothing at all, the caller waits
        peer.shutdown(socket.SHUT_WR)
        assert fastio.receive_now(stream, 100) == b""  # the peer's end
    await stream.aclose()
    with pytest.raises(trio.ClosedResourceError):
        fastio.send_now(stream, b"x")
    with pytest.raises(trio.ClosedResourceError):
        fastio.receive_now(stream, 1)


async def test_a_reset_connection_is_broken() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listener.getsockname())
    server, _ = listener.accept()
    tcp = trio.SocketStream(trio.socket.from_stdlib_socket(server))
    client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    client.close()  # a reset
    try:
        with pytest.raises(trio.BrokenResourceError), trio.fail_after(10):
            while True:  # the first write may be taken before the reset is seen
                fastio.send_now(tcp, b"x" * 65536)
                await trio.sleep(0.01)
    finally:
        await tcp.aclose()
        listener.close()


async def test_a_producer_that_never_waits_does_not_hold_the_loop() -> None:
    event = b"data: " + b"x" * 1000 + b"\n\n"

    async def never_waits():
        for _ in range(EVENTS):
            yield event

    async def handler(request: Request) -> StreamingResponse:
        return StreamingResponse(status=200, body=never_waits(), headers=(("content-type", "text/event-stream"),))

    listener = socket.create_server(("127.0.0.1", 0))
    theirs = socket.create_connection(listener.getsockname())
    ours, _ = listener.accept()
    listener.close()
    stream = trio.SocketStream(trio.socket.from_stdlib_socket(ours))
    timer = StepTimer()
    theirs.sendall(b"GET / HTTP/1.1\r\nhost: t\r\nconnection: close\r\n\r\n")
    # A client in a process of its own that reads as fast as it can: the socket's buffer rarely
    # fills, so nearly every write is taken at once and yields nothing by itself.
    reader = subprocess.Popen(["wc", "-c"], stdin=theirs, stdout=subprocess.PIPE)
    theirs.close()
    trio.lowlevel.add_instrument(timer)
    try:
        await serve_connection(handler, stream)
    finally:
        trio.lowlevel.remove_instrument(timer)
        out, _ = reader.communicate(timeout=30)
    head = len(
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n"
    )
    framed = len(b"%x\r\n" % len(event)) + len(event) + 2
    assert int(out) == head + EVENTS * framed + len(b"0\r\n\r\n")  # every event came
    assert timer.longest < 0.020, f"a task step computed for {timer.longest * 1000:.1f} ms"
