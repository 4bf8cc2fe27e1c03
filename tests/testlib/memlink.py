"""The agent link without sockets: memory stream pairs (trio.testing) whose reader can be made
slow or stopped (`Gate`), and a WebSocket pair over one. For tests on `MockClock`."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import trio
import trio.testing
import trio_websocket

from llmgw.pki.ca import ROLE_GATEWAY, CertInfo


class Gate:
    """One direction of a memory stream pair whose reader takes a write only while the gate is
    open, and then `delay_s` later (a slow reader). A closed gate holds the writer in its
    `send_all`, as a full socket buffer would; `held` is set when a write waits at it (and
    renewed when the gate opens)."""

    def __init__(self, stream: trio.testing.MemorySendStream, *, delay_s: float = 0.0) -> None:
        self.delay_s = delay_s
        self.writes = 0  # taken by the reader
        self.held = trio.Event()
        self._open = trio.Event()
        self._open.set()
        self._pump = stream.send_all_hook
        stream.send_all_hook = self._take

    def close(self) -> None:
        if self._open.is_set():
            self._open = trio.Event()

    def open(self) -> None:
        self._open.set()
        self.held = trio.Event()  # for the next time it closes

    async def _take(self) -> None:
        if not self._open.is_set():
            self.held.set()
            await self._open.wait()
        if self.delay_s:
            await trio.sleep(self.delay_s)
        self.writes += 1
        assert self._pump is not None
        await self._pump()


def gated_pair() -> tuple[trio.testing.StapledStream, trio.testing.StapledStream, Gate, Gate]:
    """(a, b, what a writes to b, what b writes to a)."""
    a, b = trio.testing.memory_stream_pair()
    return a, b, Gate(a.send_stream), Gate(b.send_stream)


async def websocket_pair(
    nursery: trio.Nursery, client_stream: trio.abc.Stream, server_stream: trio.abc.Stream
) -> tuple[trio_websocket.WebSocketConnection, trio_websocket.WebSocketConnection]:
    """A client and a server WebSocket over the two ends, upgraded; their readers run in `nursery`."""
    accepted: list[trio_websocket.WebSocketConnection] = []

    async def accept() -> None:
        request = await trio_websocket.wrap_server_stream(nursery, server_stream)
        accepted.append(await request.accept())

    async with trio.open_nursery() as opening:
        opening.start_soon(accept)
        client = await trio_websocket.wrap_client_stream(nursery, client_stream, "cp", "/v1/agent")
    return client, accepted[0]


def gateway_cert(name: str = "gw1") -> CertInfo:
    """What the control plane reads from a gateway's certificate (role gateway, valid a month)."""
    now = datetime.now(timezone.utc)
    return CertInfo(
        subject=f"OU=llmgw-gateway,CN={name}",
        issuer="CN=llmgw",
        common_name=name,
        serial=0xB1,
        fingerprint_sha256="",
        not_before=now - timedelta(days=1),
        not_after=now + timedelta(days=30),
        role=ROLE_GATEWAY,
    )
