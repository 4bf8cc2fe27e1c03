"""The gateway's subscriptions to its replicas' KV-cache events (`serve_cache_events`), on a
fake clock with memory streams for the connections: one per replica that publishes, of a model
routed by prefix; what arrives corrects the router; a publisher that closes, stalls or breaks
the protocol is subscribed to again after a backoff; a replica that leaves rotation has its
subscription closed."""

from __future__ import annotations

import attrs
import pytest
import trio
import trio.testing

from llmgw.config import GatewaySection
from llmgw.gateway.app import Gateway
from llmgw.gateway.prefix import Prompt
from llmgw.gateway.routing import Endpoint
from llmgw.gateway.services import serve_services
from llmgw.wire.gateway_link import ModelInfo
from testlib import kvpublisher as vp
from testlib.endpoints import StaticEndpoints
from testlib.gateway import parse_metrics
from testlib.zmtp import scripted_publisher

pytestmark = pytest.mark.trio

VLLM = (ModelInfo(name="m", engine="vllm", routing="prefix"),)


class NoKeys:
    def leave(self, key) -> None:
        pass


class Publishers:
    """`open_events` for the gateway: each connection's other end is handed to `serve`, which
    runs in the test's nursery; connections are recorded with their time."""

    def __init__(self, nursery: trio.Nursery, serve) -> None:
        self.nursery = nursery
        self.serve = serve
        self.connects: list[tuple[float, str, int]] = []
        self.closed: list[int] = []

    async def open(self, host: str, port: int) -> trio.abc.Stream:
        self.connects.append((trio.current_time(), host, port))
        ours, theirs = trio.testing.memory_stream_pair()
        n = len(self.connects)

        async def run() -> None:
            try:
                await self.serve(n, theirs)
            except (trio.BrokenResourceError, trio.ClosedResourceError, AssertionError):
                pass
            self.closed.append(n)

        self.nursery.start_soon(run)
        return ours


def talk() -> Prompt:
    p = Prompt.of({"messages": [{"role": "system", "content": "S" * 600}, {"role": "user", "content": "Hi"}]}, "m")
    assert p is not None
    return p


async def start(nursery: trio.Nursery, publishers: Publishers, *eps: Endpoint) -> tuple[Gateway, StaticEndpoints]:
    provider = StaticEndpoints(tuple(eps), None, VLLM)
    gw = Gateway(provider, NoKeys(), options=GatewaySection(), open_events=publishers.open)
    await nursery.start(serve_services, gw)
    return gw, provider


async def test_events_reach_the_router_and_a_closed_publisher_is_subscribed_to_again(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    a = Endpoint(replica_id="a", model="m", host="10.0.0.1", port=8001, events_port=5557)
    b = Endpoint(replica_id="b", model="m", host="10.0.0.2", port=8001)  # publishes nothing
    t = talk()
    go = trio.Event()

    async def serve(n: int, stream: trio.abc.Stream) -> None:
        if n == 1:
            await go.wait()
            await scripted_publisher(stream, [[b"kv-events", (0).to_bytes(8, "big"), vp.encode([vp.stored([1, 2])])]])
            await scripted_publisher_more(
                stream, [[b"kv-events", (1).to_bytes(8, "big"), vp.encode([vp.AllBlocksCleared()])]]
            )
            await stream.aclose()  # the engine stopped
        else:
            await scripted_publisher(stream, [[b"kv-events", (0).to_bytes(8, "big"), vp.encode([])]])
            assert await stream.receive_some() == b""  # until the gateway closes it

    publishers = Publishers(nursery, serve)
    gw, provider = await start(nursery, publishers, a, b)
    await trio.sleep(0.5)
    assert [(h, p) for _, h, p in publishers.connects] == [("10.0.0.1", 5557)]  # b publishes nothing
    gw.router.served(a, t)
    assert gw.router.prefix.matches(t, ["a"])
    go.set()
    await trio.sleep(0.1)
    assert gw.router.prefix.matches(t, ["a"]) == {}  # cleared: forgotten
    await trio.sleep(1.5)
    # Closed: subscribed again a second later; its numbers began again (a restarted engine).
    when = [c[0] for c in publishers.connects]
    assert len(when) == 2 and when[1] - when[0] == pytest.approx(1.5, abs=0.01)
    metrics = parse_metrics(gw.render_metrics())
    model = frozenset({("model", "m")})
    assert metrics[("llmgw_gateway_replica_cache_resets_total", model)] == 2  # cleared, then restarted
    assert metrics[("llmgw_gateway_replica_cache_event_failures_total", model)] == 1
    # Leaving rotation closes the subscription; so does a change of address.
    provider.set((b,), frozenset({"m"}), VLLM)
    await trio.sleep(0.5)
    assert publishers.closed == [1, 2]
    provider.set((a,), frozenset({"m"}), VLLM)
    await trio.sleep(0.5)
    provider.set((attrs.evolve(a, events_port=5558),), frozenset({"m"}), VLLM)
    await trio.sleep(0.5)
    assert publishers.closed == [1, 2, 3] and publishers.connects[-1][1:] == ("10.0.0.1", 5558)


async def scripted_publisher_more(stream: trio.abc.Stream, messages: list[list[bytes]]) -> None:
    from llmgw.gateway import kvevents as kv

    for frames in messages:
        for i, body in enumerate(frames):
            await stream.send_all(kv.frame(body, more=i < len(frames) - 1))


async def test_a_publisher_that_stalls_or_breaks_the_protocol_is_tried_again_backing_off(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    a = Endpoint(replica_id="a", model="m", host="10.0.0.1", port=8001, events_port=5557)

    async def serve(n: int, stream: trio.abc.Stream) -> None:
        if n % 2:
            await trio.sleep_forever()  # accepts, says nothing: the handshake times out
        await scripted_publisher(stream, [[b"kv-events", b"\0", b""]])  # a sequence of one byte
        await trio.sleep_forever()

    publishers = Publishers(nursery, serve)
    gw, _ = await start(nursery, publishers, a)
    timeout = gw.options.connect_timeout_s + gw.options.probe_timeout_s
    await trio.sleep(200)
    when = [c[0] for c in publishers.connects]
    gaps = [later - earlier for earlier, later in zip(when, when[1:], strict=False)]
    # Stalled ones take the handshake's timeout; the waits double from 1 s up to 30 s.
    waits = [round(g - (timeout if i % 2 == 0 else 0), 2) for i, g in enumerate(gaps)]
    assert waits[:6] == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0]
    assert set(waits[6:]) == {30.0}
    model = frozenset({("model", "m")})
    assert parse_metrics(gw.render_metrics())[("llmgw_gateway_replica_cache_event_failures_total", model)] == len(when)
    assert gw.router.endpoints["m"][0] == a  # the gateway routes on
