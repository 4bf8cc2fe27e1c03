"""The gateway's KV-cache event subscriber against real libzmq publishers on loopback (pyzmq's
PUB, the socket vLLM's ZmqEventPublisher uses, and XPUB, which shows the subscription), with
batches encoded by msgspec as vLLM encodes them; then a gateway whose replica publishes: what the
engine says reaches the router; publishers that send garbage, reset, stall or claim a huge frame
cost their subscription only, and the gateway routes on throughout."""

from __future__ import annotations

import functools
import socket
import struct

import pytest
import trio

from llmgw.config import GatewaySection
from llmgw.gateway import kvevents as kv
from llmgw.gateway.app import Gateway
from llmgw.gateway.prefix import Prompt
from llmgw.gateway.routing import BYTES_PER_TOKEN, Endpoint
from llmgw.gateway.services import serve_services
from llmgw.wire.gateway_link import ModelInfo
from testlib import kvpublisher as vp
from testlib import record_kvevents as rec
from testlib.endpoints import StaticEndpoints
from testlib.gateway import parse_metrics
from testlib.waiting import await_true

pytestmark = pytest.mark.trio


async def read(sub: kv.Subscription, n: int) -> list[tuple[int, list[kv.Event]]]:
    got = []
    async for frames in sub.messages():
        seq, payload = kv.batch_of(frames)
        got.append((seq, await kv.decode_batch_async(payload)))
        if len(got) == n:
            return got
    raise AssertionError("unreachable")


async def test_libzmq_publishers_are_read_as_vllm_sends_them() -> None:
    pub = vp.Publisher(xpub=True)
    try:
        with trio.fail_after(20):
            async with await trio.open_tcp_stream("127.0.0.1", pub.port) as stream:
                sub = kv.Subscription(stream)
                await sub.open()
                await trio.to_thread.run_sync(pub.wait_subscribed)
                assert pub.subscriptions == [b"\x01kv-events"]  # libzmq took our subscription as one
                h = bytes(range(32))
                batches = [
                    [vp.stored([1, 2, 3])],
                    [vp.stored([h], parent=3), vp.BlockRemoved([1], "GPU")],
                    [vp.AllBlocksCleared()],
                ]
                for seq, events in enumerate(batches):
                    pub.send(seq, vp.encode(events, rank=0))
                got = await read(sub, 3)
    finally:
        pub.close()
    assert got == [
        (0, [kv.Stored(hashes=(1, 2, 3), parent=None, block_size=16, tokens=48)]),
        (1, [kv.Stored(hashes=(h,), parent=3, block_size=16, tokens=16), kv.Removed(hashes=(1,))]),
        (2, [kv.Cleared()]),
    ]

    plain = vp.Publisher(xpub=False)  # vLLM's own socket type: it drops what precedes a subscription
    try:
        with trio.fail_after(20):
            async with await trio.open_tcp_stream("127.0.0.1", plain.port) as stream:
                sub = kv.Subscription(stream)
                await sub.open()
                async with trio.open_nursery() as nursery:

                    async def keep_sending() -> None:
                        for seq in range(1000):
                            plain.send(seq, vp.encode([vp.stored([seq])]))
                            await trio.sleep(0.02)

                    nursery.start_soon(keep_sending)
                    (first, _), (second, _) = await read(sub, 2)
                    nursery.cancel_scope.cancel()
    finally:
        plain.close()
    assert second == first + 1


class Hostile:
    """A TCP server on loopback that treats each connection as `how` says."""

    def __init__(self, how: str) -> None:
        self.how = how
        self.connections = 0

    async def handle(self, stream: trio.SocketStream) -> None:
        self.connections += 1
        try:
            if self.how == "garbage":
                await stream.send_all(b"\x00garbage, not ZMTP\r\n" * 10)
            elif self.how == "reset":
                await stream.receive_some(64)
                stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            elif self.how == "huge":
                await stream.send_all(kv.GREETING)
                await stream.receive_some(64)
                await stream.send_all(kv.ready(b"PUB") + b"\x02" + struct.pack(">Q", 1 << 50))
                await trio.sleep(5)
            elif self.how == "stall":
                await trio.sleep(60)
        except trio.BrokenResourceError:
            pass
        finally:
            await stream.aclose()


async def test_a_gateway_reads_its_replicas_events_and_survives_hostile_publishers(nursery: trio.Nursery) -> None:
    pub = vp.Publisher(xpub=True)
    a = Endpoint(replica_id="a", model="m", host="127.0.0.1", port=9, events_port=pub.port)
    b = Endpoint(replica_id="b", model="m", host="127.0.0.1", port=10)
    details = (ModelInfo(name="m", engine="vllm", routing="prefix"),)
    provider = StaticEndpoints((a, b), None, details)
    gw = Gateway(provider, NoKeys(), options=GatewaySection(connect_timeout_s=1.0, probe_timeout_s=1.0))
    await nursery.start(serve_services, gw)
    t = Prompt.of({"messages": [{"role": "system", "content": "S" * 600}, {"role": "user", "content": "Hi"}]}, "m")
    assert t is not None
    try:
        await trio.to_thread.run_sync(pub.wait_subscribed)
        gw.router.served(a, t)
        assert gw.router.route("m", prompt=t)[1].reason == "hit"
        pub.send(0, vp.encode([vp.stored([1, 2])]))
        pub.send(1, vp.encode([vp.AllBlocksCleared()]))
        await await_true(lambda: gw.router.prefix.matches(t, ["a"]) == {}, "the router told the cache was cleared")
    finally:
        pub.close()
    model = frozenset({("model", "m")})
    assert parse_metrics(gw.render_metrics())[("llmgw_gateway_replica_cache_resets_total", model)] == 1

    listeners = []
    for how in ("garbage", "reset", "huge", "stall"):
        hostile = Hostile(how)
        [listener] = await nursery.start(functools.partial(trio.serve_tcp, hostile.handle, 0, host="127.0.0.1"))
        listeners.append((hostile, listener.socket.getsockname()[1]))
    # All four at once: none holds the others up.
    hostiles = tuple(
        Endpoint(replica_id=f"h{n}", model="m", host="127.0.0.1", port=11 + n, events_port=port)
        for n, (_, port) in enumerate(listeners)
    )
    provider.set((b, *hostiles), None, details)

    def failures() -> float:
        return parse_metrics(gw.render_metrics()).get(("llmgw_gateway_replica_cache_event_failures_total", model), 0)

    # A publisher counts a connection when it accepts it, the gateway a failure once it has read
    # what went wrong: wait for both (on a loaded machine the second can come a while after).
    await await_true(
        lambda: all(h.connections >= 2 for h, _ in listeners[:3]) and failures() >= 7,
        "each hostile publisher tried twice, and each failure counted",
        timeout=20,
    )
    assert failures() >= 7  # the first one's end, two of each of the three quick ones
    ep, route = gw.router.route("m", prompt=t)
    assert ep is not None and route.policy == "prefix"  # the gateway routes on
    assert listeners[3][0].connections == 1  # the stalled one: still in its handshake timeout, or backing off


class Replay:
    """A TCP server on loopback that plays a recorded publisher to each connection: the
    publisher's greeting and READY, then, once the subscription is in and `go` is set, the
    messages in pieces of every size from 1 byte up; then it holds the connection open."""

    def __init__(self, recorded: bytes) -> None:
        self.recorded = recorded
        self.go = trio.Event()
        self.subscriptions: list[bytes] = []

    async def handle(self, stream: trio.SocketStream) -> None:
        data = self.recorded
        cut = rec.handshake_length(data)
        heard = bytearray()
        await stream.send_all(data[:cut])
        expected = kv.GREETING + kv.ready(b"SUB") + kv.frame(b"\x01" + kv.TOPIC)
        while len(heard) < len(expected):
            chunk = await stream.receive_some()
            if not chunk:
                return
            heard += chunk
        self.subscriptions.append(bytes(heard))
        await self.go.wait()
        size = 1
        while cut < len(data):
            await stream.send_all(data[cut : cut + size])
            cut += size
            size = size % 97 + 1
        await trio.sleep_forever()


@pytest.mark.parametrize(("stem", "engine"), rec.RECORDINGS)
async def test_a_gateway_reads_a_stream_recorded_from_the_engines_own_publisher(
    nursery: trio.Nursery, stem: str, engine: str
) -> None:
    replay = Replay(rec.recording(stem))
    [listener] = await nursery.start(functools.partial(trio.serve_tcp, replay.handle, 0, host="127.0.0.1"))
    a = Endpoint(replica_id="a", model="m", host="127.0.0.1", port=9, events_port=listener.socket.getsockname()[1])
    b = Endpoint(replica_id="b", model="m", host="127.0.0.1", port=10)
    details = (ModelInfo(name="m", engine=engine, routing="prefix"),)
    gw = Gateway(StaticEndpoints((a, b), None, details), NoKeys(), options=GatewaySection())
    await nursery.start(serve_services, gw)
    long = Prompt.of({"messages": [{"role": "system", "content": "S" * 2000}, {"role": "user", "content": "Hi"}]}, "m")
    assert long is not None
    await await_true(lambda: replay.subscriptions, "the gateway subscribed")
    assert replay.subscriptions == [kv.GREETING + kv.ready(b"SUB") + kv.frame(b"\x01kv-events")]
    gw.router.served(a, long)
    assert gw.router.prefix.held_chars("a") > 6 * 16 * BYTES_PER_TOKEN
    replay.go.set()
    model = frozenset({("model", "m")})

    def metric(name: str) -> float:
        return parse_metrics(gw.render_metrics()).get((f"llmgw_gateway_replica_{name}_total", model), 0)

    await await_true(lambda: metric("cache_resets") == 1, "the recorded AllBlocksCleared read")
    # Before it, the recorded eviction left 6 blocks of 16 tokens: what the router held of the
    # 2,000-character prompt was trimmed to fit them; then all of it was forgotten.
    assert metric("cache_trimmed") >= 1
    assert gw.router.prefix.matches(long, ["a"]) == {} and gw.router.prefix.held_chars("a") == 0
    assert metric("cache_events_missed") == 0 and metric("cache_event_failures") == 0


class NoKeys:
    def leave(self, key) -> None:
        pass
