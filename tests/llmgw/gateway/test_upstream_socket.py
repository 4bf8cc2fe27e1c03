"""The upstream pool on a real loopback socket, against an engine that streams as fast as it can
in the smallest chunks HTTP allows: the relay reads the socket at once when data is there
(`llmgw.http.fastio`), and must still yield to the loop between reads and between the pieces of
one read, so that no task step of the gateway's loop computes for 20 ms (`looplag.StepTimer`,
CPU time per step)."""

from __future__ import annotations

import socket
import threading

import pytest
import trio

from llmgw.gateway.upstream import UpstreamPool
from llmgw.looplag import StepTimer

pytestmark = pytest.mark.trio

CHUNKS = 400_000  # one byte each: 2.4 MB of framing for 400 kB of body
LONG_STEP_S = 0.020


def engine(listener: socket.socket) -> None:
    """Answer one request with a chunked body of CHUNKS one-byte chunks, written in 60 kB blocks."""
    conn, _ = listener.accept()
    with conn:
        head = b""
        while b"\r\n\r\n" not in head:
            head += conn.recv(65536)
        length = int(head.split(b"content-length: ")[1].split(b"\r\n")[0])
        rest = head.split(b"\r\n\r\n", 1)[1]
        while len(rest) < length:
            rest += conn.recv(65536)
        conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        block = b"1\r\nx\r\n" * 10_000
        for _ in range(CHUNKS // 10_000):
            conn.sendall(block)
        conn.sendall(b"0\r\n\r\n")


async def test_a_stream_of_tiny_chunks_never_holds_the_loop() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    thread = threading.Thread(target=engine, args=(listener,), daemon=True)
    thread.start()
    timer = StepTimer()
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await trio.sleep(0)
            ticks += 1

    pool = UpstreamPool(connect_timeout_s=5.0)
    received = 0
    trio.lowlevel.add_instrument(timer)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ticker)
            response = await pool.send("127.0.0.1", port, "POST", "/v1/chat/completions", [], b"{}")
            async for piece in response.body():
                received += len(piece)
            await response.aclose()
            nursery.cancel_scope.cancel()
    finally:
        trio.lowlevel.remove_instrument(timer)
        await pool.aclose()
        listener.close()
        thread.join(10)
    assert received == CHUNKS
    assert timer.longest < LONG_STEP_S, f"a task step computed for {timer.longest * 1000:.1f} ms"
    assert ticks > 20  # the loop ran others' steps meanwhile
