"""A gateway worker on its link to a scripted control plane, over memory streams on MockClock: the
first request it holds for a model with no replica is in a heartbeat at once, not at the next
interval (what starts a model on demand), and the models' load is in every heartbeat."""

from __future__ import annotations

import random
import ssl
from functools import partial

import pytest
import trio
import trio.testing
import trio_websocket

from llmgw.gateway.services import serve_services
from llmgw.gatewayd import link as gl
from llmgw.gatewayd.table import GatewayTable
from llmgw.gatewayd.worker import GatewayWorker
from llmgw.http.limits import Limits
from llmgw.http.openai import error_body
from llmgw.http.server import serve_connection
from llmgw.linkio import Target
from llmgw.wire import gateway_link as g
from llmgw.wire.convert import decode, encode
from testlib import memnet
from testlib.gateway import chat
from testlib.gatewaytable import TOKEN, key, route

pytestmark = pytest.mark.trio

INTERVAL_S = 5.0
CHAT = g.ModelInfo(name="chat", engine="sim", on_demand=True)


class ControlPlane:
    """Welcomes the gateway, sends its table (the model "chat", no replica of it), then what
    `send` is given and a TableHeartbeat every interval; keeps each heartbeat with its time."""

    def __init__(self, nursery: trio.Nursery) -> None:
        self.nursery = nursery
        self.beats: list[tuple[float, g.GatewayHeartbeat]] = []
        self.to_send, self._outbox = trio.open_memory_channel[g.RotationChanged](8)
        self.heard_one = trio.Event()

    async def dial(self, target: Target) -> trio.abc.Stream:
        a, b = trio.testing.memory_stream_pair()
        self.nursery.start_soon(self._serve, b)
        return a

    async def _serve(self, stream: trio.abc.Stream) -> None:
        ws = await (await trio_websocket.wrap_server_stream(self.nursery, stream)).accept()
        hello = decode(await ws.get_message(), g.GatewayMessage)
        welcome = g.GatewayWelcome(
            name=hello.name, instance=hello.instance, server_version="test", heartbeat_interval_s=INTERVAL_S
        )
        rotation = g.RotationChanged(models=("chat",), endpoints=(), details=(CHAT,), version=1)
        for message in (
            welcome,
            rotation,
            g.KeysChanged(keys=(key("tests"),), version=1),
            g.ShareChanged(index=0, count=1),
        ):
            await ws.send_message(encode(message))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._read, ws)
            nursery.start_soon(self._write, ws)

    async def _read(self, ws: trio_websocket.WebSocketConnection) -> None:
        while True:
            beat = decode(await ws.get_message(), g.GatewayMessage)
            assert isinstance(beat, g.GatewayHeartbeat)
            self.beats.append((trio.current_time(), beat))
            self.heard_one.set()
            self.heard_one = trio.Event()

    async def _write(self, ws: trio_websocket.WebSocketConnection) -> None:
        seq = 0
        while True:
            with trio.move_on_after(INTERVAL_S):
                await ws.send_message(encode(await self._outbox.receive()))
                continue
            seq += 1
            await ws.send_message(encode(g.TableHeartbeat(seq=seq)))

    async def beat_where(self, predicate) -> tuple[float, g.GatewayHeartbeat]:
        """The first heartbeat from now on that `predicate` holds for."""
        seen = len(self.beats)
        while True:
            for at, beat in self.beats[seen:]:
                if predicate(beat):
                    return at, beat
            seen = len(self.beats)
            await self.heard_one.wait()


def chat_load(beat: g.GatewayHeartbeat) -> g.ModelLoad | None:
    return next((m for m in beat.models if m.model == "chat"), None)


async def test_the_first_request_held_for_a_model_with_no_replica_is_reported_at_once(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    net = memnet.MemoryNet(nursery)
    (sim,) = memnet.start_sims(net, 1)
    worker = GatewayWorker(GatewayTable(now=trio.current_time()), instance="i1", connect=net.connect)
    await nursery.start(serve_services, worker.gateway)
    plane = ControlPlane(nursery)
    link = gl.GatewayLink(
        target=Target(host="cp", port=7443),
        tls=ssl.create_default_context(),
        name="gw1",
        instance="i1",
        sink=worker.table,
        load=worker.load,
        at_once=worker.gateway.at_once,
        rng=random.Random(3),
        dial=plane.dial,
    )
    nursery.start_soon(link.serve)
    await worker.table.whole.wait()
    await plane.beat_where(lambda beat: beat.rotation_version == 1)
    await trio.sleep(INTERVAL_S / 2)  # midway between two heartbeats
    assert all(beat.models == () for _, beat in plane.beats)  # no request yet

    answers: list[int] = []

    async def call() -> None:
        client, server = trio.testing.memory_stream_pair()
        nursery.start_soon(partial(serve_connection, worker.handle, server, limits=Limits(), errors=error_body))
        answers.append((await memnet.request(client, "POST", "/v1/chat/completions", chat(), token=TOKEN))[0])

    async with trio.open_nursery() as calls:
        asked_at = trio.current_time()
        calls.start_soon(call)
        at, beat = await plane.beat_where(lambda beat: chat_load(beat) is not None)
        assert at - asked_at < 0.1 and beat.metrics is None  # at once, not at the interval
        assert chat_load(beat) == g.ModelLoad(model="chat", queued=1, requests_total=1)
        calls.start_soon(call)
        await trio.sleep(INTERVAL_S)  # a second request held: no news, the interval's heartbeat says it
        assert [at for at, _ in plane.beats if at >= asked_at] == [asked_at, asked_at + INTERVAL_S / 2]
        _, beat = plane.beats[-1]
        assert beat.metrics is not None and chat_load(beat) == g.ModelLoad(
            model="chat", queued=2, requests_total=2, oldest_wait_s=INTERVAL_S / 2
        )
        await plane.to_send.send(
            g.RotationChanged(models=("chat",), endpoints=(route(sim),), details=(CHAT,), version=2)
        )
    assert answers == [200, 200]
    _, beat = await plane.beat_where(lambda beat: beat.rotation_version == 2)
    assert beat.models == (g.ModelLoad(model="chat", requests_total=2),)
