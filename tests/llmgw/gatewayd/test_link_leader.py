"""A gateway's link among several control planes, over memory streams on MockClock: a standby's
Redirect sends it to the leader at once, a standby that knows no leader is a failure and the
next in turn is dialled after the backoff. The agent's link does the same
(tests/agent/test_link_memory.py); the real processes are tests/integration/test_leader_takeover.py's."""

from __future__ import annotations

import random
import ssl

import pytest
import trio
import trio.testing
import trio_websocket

from llmgw.gatewayd import link as gl
from llmgw.linkio import Target, Targets
from llmgw.wire import agent_link as w
from llmgw.wire import gateway_link as g
from llmgw.wire.convert import decode, encode

pytestmark = pytest.mark.trio

ROTATION = g.RotationChanged(models=("chat",), endpoints=(), version=1)


class Sink:
    def __init__(self) -> None:
        self.rotations: list[g.RotationChanged] = []
        self.states: list[tuple[bool, str]] = []
        self.got = trio.Event()

    def rotation_changed(self, message: g.RotationChanged) -> None:
        self.rotations.append(message)
        self.got.set()

    def keys_changed(self, message: object) -> None:
        pass

    share_changed = keys_changed

    def heard(self, now: float) -> None:
        pass

    def link_state(self, connected: bool, detail: str) -> None:
        self.states.append((connected, detail))


class ControlPlanes:
    """Scripted control planes by host: a standby answers the hello with its Redirect, the leader
    welcomes and sends its table."""

    def __init__(self, nursery: trio.Nursery, standbys: dict[str, w.Redirect]) -> None:
        self.nursery = nursery
        self.standbys = standbys
        self.dialled: list[tuple[str, float]] = []

    async def dial(self, target: Target) -> trio.abc.Stream:
        self.dialled.append((target.host, trio.current_time()))
        a, b = trio.testing.memory_stream_pair()
        self.nursery.start_soon(self._serve, target.host, b)
        return a

    async def _serve(self, host: str, stream: trio.abc.Stream) -> None:
        ws = await (await trio_websocket.wrap_server_stream(self.nursery, stream)).accept()
        hello = decode(await ws.get_message(), g.GatewayMessage)
        redirect = self.standbys.get(host)
        if redirect is not None:
            await ws.send_message(encode(redirect))
            await ws.send_message(encode(w.LinkError(code=w.NOT_LEADER, message=redirect.message)))
            await ws.aclose()
            return
        welcome = g.GatewayWelcome(
            name=hello.name, instance=hello.instance, server_version="test", heartbeat_interval_s=5.0
        )
        for message in (welcome, ROTATION, g.KeysChanged(keys=()), g.ShareChanged(index=0, count=1)):
            await ws.send_message(encode(message))
        for seq in range(1, 1000):
            await ws.send_message(encode(g.TableHeartbeat(seq=seq)))
            await trio.sleep(5)


def link_to(planes: ControlPlanes, sink: Sink, *hosts: str) -> gl.GatewayLink:
    return gl.GatewayLink(
        target=Targets([Target(host=h, port=7443) for h in hosts]),
        tls=ssl.create_default_context(),
        name="gw1",
        instance="i1",
        sink=sink,
        rng=random.Random(3),
        dial=planes.dial,
    )


async def test_a_standby_sends_the_gateway_to_the_leader_at_once(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    planes = ControlPlanes(nursery, {"cp-a": w.Redirect(leader="wss://cp-b:7443", message="cp-b leads")})
    sink = Sink()
    link = link_to(planes, sink, "cp-a", "cp-b")
    await nursery.start(link.serve)
    await sink.got.wait()
    assert planes.dialled == [("cp-a", 0.0), ("cp-b", 0.0)]
    assert sink.rotations == [ROTATION] and link.state.connected and link.target.host == "cp-b"
    assert sink.states[0] == (False, "cp-b leads")  # what the gateway said of the standby's answer


async def test_a_standby_that_knows_no_leader_sends_the_gateway_to_the_next_in_the_round_at_once(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    """During a takeover the next may lead already: the backoff is between rounds, not dials."""
    none = w.Redirect(leader="", message="no control plane leads at the moment (a takeover is under way)")
    planes = ControlPlanes(nursery, {"cp-a": none})
    sink = Sink()
    link = link_to(planes, sink, "cp-a", "cp-b")
    await nursery.start(link.serve)
    await sink.got.wait()
    assert planes.dialled == [("cp-a", 0.0), ("cp-b", 0.0)]
    assert sink.states[0] == (False, none.message)


async def test_with_every_control_plane_a_standby_knowing_no_leader_the_gateway_backs_off_by_rounds(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    none = w.Redirect(leader="", message="no control plane leads at the moment")
    planes = ControlPlanes(nursery, {"cp-a": none, "cp-b": none})
    link = link_to(planes, Sink(), "cp-a", "cp-b")
    with trio.move_on_after(30):
        await link.serve()
    times = [t for _, t in planes.dialled]
    assert times[0] == times[1] == 0.0 and times[2] > 0  # a round, then its backoff
    assert all(times[i] == times[i + 1] for i in range(0, len(times) - 1, 2))
