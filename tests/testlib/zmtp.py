"""The publisher's side of ZMTP 3.0 over any trio stream, scripted, for the tests of the
gateway's KV-cache event subscriber (`llmgw.gateway.kvevents`) on memory streams."""

from __future__ import annotations

import trio

from llmgw.gateway import kvevents as kv


async def scripted_publisher(
    stream: trio.abc.Stream,
    messages: list[list[bytes]],
    *,
    socket_type: bytes = b"PUB",
    greeting: bytes = kv.GREETING,
) -> bytes:
    """The publisher's side: greeting, READY, the subscription (returned), then `messages`."""
    buf = bytearray()

    async def exactly(n: int) -> bytes:
        while len(buf) < n:
            chunk = await stream.receive_some()
            assert chunk, "the subscriber closed"
            buf.extend(chunk)
        out = bytes(buf[:n])
        del buf[:n]
        return out

    await stream.send_all(greeting)
    assert await exactly(64) == kv.GREETING
    await stream.send_all(kv.ready(socket_type))
    flags, size = await exactly(2)
    assert flags == 0x04
    assert (await exactly(size))[:6] == b"\x05READY"
    flags, size = await exactly(2)
    subscription = await exactly(size)
    await stream.send_all(kv.frame(b"\x04PING\x00\x00", command=True))  # a command between messages is skipped
    for frames in messages:
        for i, body in enumerate(frames):
            await stream.send_all(kv.frame(body, more=i < len(frames) - 1))
    return subscription
