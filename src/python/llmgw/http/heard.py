"""When a connection's peer last sent something: `Heard`, a TCP stream that notes it, the listener
whose connections are `Heard` (under the agent port's TLS), and `heard_at`, which finds it under a
stream's wrappers. What tells a peer that is slow to be served (a thousand agents handshaking at
once) from one that holds its connection and says nothing: a budget at its cap sheds the one
silent longest (`llmgw.http.listeners.IdleConnections.shed_silent`).
"""

from __future__ import annotations

from collections.abc import Callable

import trio


class Heard(trio.abc.HalfCloseableStream):
    """A TCP connection that notes when its peer last sent something (`heard_at`, trio's clock):
    what tells a peer that is slow to be served (a thousand agents handshaking at once, each
    sending at once whatever it is asked) from one that holds its connection and says nothing."""

    def __init__(self, inner: trio.SocketStream) -> None:
        self.inner = inner
        self.socket = inner.socket
        self.heard_at = trio.current_time()

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        data = await self.inner.receive_some(max_bytes)
        if data:
            self.heard_at = trio.current_time()
        return data

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self.inner.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.inner.wait_send_all_might_not_block()

    async def send_eof(self) -> None:
        await self.inner.send_eof()

    async def aclose(self) -> None:
        await self.inner.aclose()

    def setsockopt(self, *args: object) -> None:
        self.inner.setsockopt(*args)  # type: ignore[arg-type]

    def getsockopt(self, *args: object) -> object:
        return self.inner.getsockopt(*args)  # type: ignore[arg-type]


class HeardListener(trio.abc.Listener[Heard]):
    """A TCP listener whose connections are `Heard` (put under an SSLListener)."""

    def __init__(self, transport_listener: trio.SocketListener) -> None:
        self.transport_listener = transport_listener
        self.socket = transport_listener.socket

    async def accept(self) -> Heard:
        return Heard(await self.transport_listener.accept())

    async def aclose(self) -> None:
        await self.transport_listener.aclose()


def heard_at(stream: trio.abc.Stream) -> Callable[[], float] | None:
    """When the peer of `stream` (under any wrappers: TLS) last sent something, if it is `Heard`."""
    inner = stream
    while not isinstance(inner, Heard) and hasattr(inner, "transport_stream"):
        inner = inner.transport_stream
    if isinstance(inner, Heard):
        return lambda: inner.heard_at
    return None
