"""The agent's link adapter (`agent.link`) against a scripted control plane, over memory streams
on MockClock: it checks the Welcome before anything else; while the control plane reads slowly
or not at all, what the agent's tasks send waits coalesced (the newest of each kind) and never
holds them, log replies wait for room with nothing read meanwhile, and a control plane that
takes nothing ends the session at the agent's send deadline. The real control plane on real
sockets is tests/agent/test_link.py's; both adapters together, tests/llmgw/server/test_agentlinks.py."""

from __future__ import annotations

import ssl

import attrs
import pytest
import trio
import trio.testing
import trio_websocket

from agent import link as agentlink
from agent.link import AgentLink, Target
from llmgw import linkclient
from llmgw.linkio import Targets
from llmgw.wire import agent_link as w
from llmgw.wire import agent_session as s
from llmgw.wire.convert import decode, encode
from testlib.memlink import Gate, gated_pair

pytestmark = pytest.mark.trio

INVENTORY = w.Inventory(hostname="a", os="linux", arch="x86_64", python="3.11", cpu_model="c", cpu_cores=1)
WELCOME = w.Welcome(node_id="node-a", server_version="0.1.0", heartbeat_interval_s=5.0)


def hello() -> w.Hello:
    return w.Hello(
        protocol_version=w.PROTOCOL_VERSION,
        node_id="node-a",
        agent_version="test",
        boot_id="b",
        started_at=1.0,
        inventory=INVENTORY,
    )


@attrs.define
class Agent:
    link: AgentLink
    control_plane: trio_websocket.WebSocketConnection  # the scripted end
    to_server: Gate
    to_agent: Gate
    answered: list[int] = attrs.field(factory=list)  # log requests answered, by id
    ended: list[str] = attrs.field(factory=list)
    done: trio.Event = attrs.field(factory=trio.Event)

    async def receive(self) -> w.AgentMessage:
        return decode(await self.control_plane.get_message(), w.AgentMessage)

    async def welcome(self, welcome: w.Welcome = WELCOME) -> None:
        assert isinstance(await self.receive(), w.Hello)
        await self.control_plane.send_message(encode(welcome))
        await self.control_plane.send_message(encode(w.DesiredState(generation=1)))
        await self.link.desired_changed()


async def start(nursery: trio.Nursery, *others: str) -> Agent:
    """An agent on a memory link to the scripted control plane "cp" (`others`: more control
    planes in its agent.toml, never dialled here)."""
    a, b, to_server, to_agent = gated_pair()
    link = AgentLink(
        target=Targets([Target(host=h, port=1) for h in ("cp", *others)]),
        node_id="node-a",
        ssl_context=ssl.create_default_context(),
        make_hello=hello,
    )

    async def run() -> None:
        try:
            await link.run_on(a)
            agent.ended.append("ended")
        except Exception as exc:  # noqa: BLE001 - what the agent would log
            agent.ended.append(link.reason_of(exc))
        agent.done.set()

    nursery.start_soon(run)
    request = await trio_websocket.wrap_server_stream(nursery, b)
    agent = Agent(link=link, control_plane=await request.accept(), to_server=to_server, to_agent=to_agent)

    def answer(req: w.LogsRequest) -> w.LogsReply:
        agent.answered.append(req.request_id)
        return w.LogsReply(request_id=req.request_id, replica_id=req.replica_id, text="x" * 1000)

    link.answer_logs = answer
    return agent


@pytest.mark.parametrize(
    ("welcome", "says"),
    [
        (
            attrs.evolve(WELCOME, node_id="node-b"),
            "the control plane welcomed node 'node-b' on the link of node 'node-a'",
        ),
        (attrs.evolve(WELCOME, server_version=""), "names no server version this agent can read"),
        (attrs.evolve(WELCOME, heartbeat_interval_s=0.0), "asks for a heartbeat every 0 s"),
    ],
)
async def test_a_welcome_the_agent_refuses_is_answered_with_its_link_error_and_ends_the_session(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery, welcome: w.Welcome, says: str
) -> None:
    agent = await start(nursery)
    assert isinstance(await agent.receive(), w.Hello)
    await agent.control_plane.send_message(encode(welcome))
    error = await agent.receive()
    assert isinstance(error, w.LinkError) and says in error.message, error
    with pytest.raises(trio_websocket.ConnectionClosed):
        await agent.receive()
    await agent.done.wait()
    [reason] = agent.ended
    assert reason.startswith("the control plane sent something this agent does not understand") and says in reason
    assert agent.link.state.sessions == 0 and not agent.link.state.connected


async def test_what_the_agent_sends_waits_coalesced_while_the_control_plane_reads_nothing(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    agent = await start(nursery)
    await agent.welcome()
    assert agent.link.state.server_version == "0.1.0"
    assert isinstance(await agent.receive(), w.Heartbeat)  # the first, at once
    agent.to_server.close()
    started = trio.current_time()
    for i in range(100):  # the replica supervisor and the engine installer report
        status = w.ReplicaStatus(replica_id="r1", model="m", state=w.STARTING, restarts=i)
        assert await agent.link.send(w.ReplicasChanged(replicas=(status,)))
        assert await agent.link.send(w.EnginesChanged(engines=(w.EngineStatus(name="sim", version=str(i), ok=True),)))
        assert trio.current_time() == started  # queued: no sender waits on the control plane
    await trio.sleep(17)  # three heartbeats come due meanwhile
    agent.to_server.open()
    received = []

    def newest(kind: type) -> list:
        return [m for m in received if isinstance(m, kind)]

    while not (newest(w.Heartbeat) and len(newest(w.ReplicasChanged)) > 1 and newest(w.EnginesChanged)):
        received.append(await agent.receive())
    # The one written when the gate closed, then the newest of each kind, in the order first queued.
    assert [type(m) for m in received] == [w.ReplicasChanged, w.EnginesChanged, w.ReplicasChanged, w.Heartbeat]
    assert [m.replicas[0].restarts for m in newest(w.ReplicasChanged)] == [0, 99]
    assert [m.engines[0].version for m in newest(w.EnginesChanged)] == ["99"]
    assert [m.seq for m in newest(w.Heartbeat)] == [4]


async def test_log_replies_wait_for_room_and_the_agent_reads_nothing_meanwhile(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    agent = await start(nursery)
    await agent.welcome()
    assert isinstance(await agent.receive(), w.Heartbeat)  # the first, at once; the next in 5 s
    agent.to_server.close()
    asked = s.MAX_LOGS_ASKED + 4  # more than a control plane of this release asks at once
    for i in range(1, asked + 1):
        await agent.control_plane.send_message(encode(w.LogsRequest(request_id=i, replica_id="r1")))
    await trio.sleep(1)  # on MockClock this returns once every task is blocked: the agent did all it could
    # One reply held in the write, MAX_LOGS_ASKED waiting; no further request taken.
    assert agent.answered == list(range(1, s.MAX_LOGS_ASKED + 2))
    agent.to_server.open()
    replies = []
    while len(replies) < asked:
        message = await agent.receive()
        if isinstance(message, w.LogsReply):
            replies.append(message.request_id)
    assert replies == list(range(1, asked + 1)) and agent.answered == replies


async def heartbeats(agent: Agent, interval_s: float = WELCOME.heartbeat_interval_s) -> None:
    """The scripted control plane says it is there, as a real one does."""
    for seq in range(1, 1000):
        await agent.control_plane.send_message(encode(w.ServerHeartbeat(seq=seq)))
        await trio.sleep(interval_s)


async def test_a_control_plane_that_takes_nothing_ends_the_session_at_the_send_deadline(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    agent = await start(nursery)
    await agent.welcome()
    assert isinstance(await agent.receive(), w.Heartbeat)
    nursery.start_soon(heartbeats, agent)  # it speaks, and takes nothing
    agent.to_server.close()
    started = trio.current_time()
    assert await agent.link.send(w.ReplicasChanged(replicas=()))
    await agent.done.wait()
    # Its deadline, then at most a second for the WebSocket's close, which nobody reads either.
    assert linkclient.SEND_TIMEOUT_S <= trio.current_time() - started <= linkclient.SEND_TIMEOUT_S + 1
    assert agent.ended == [
        f"the control plane took no message for {linkclient.SEND_TIMEOUT_S:g} s: the link is as good as down"
    ]
    assert not await agent.link.send(w.ReplicasChanged(replicas=()))  # no session: the next hello carries it


async def test_a_control_plane_that_says_nothing_for_five_heartbeats_is_left(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    """Stopped (SIGSTOP, a frozen VM) or cut off while its kernel still takes our frames: it
    reads nothing and says nothing, and the agent, which has another to go to, leaves it after
    five of its heartbeats."""
    agent = await start(nursery, "cp-b")
    await agent.welcome()
    started = trio.current_time()
    await agent.done.wait()
    # Five heartbeats' time, then at most a second for the WebSocket's close, which nobody answers.
    assert 25 <= trio.current_time() - started <= 26
    assert agent.ended == [
        "nothing from the control plane for 25 s (its heartbeats stopped: paused, or cut off); dialling again"
    ]


async def test_the_one_control_plane_there_is_is_waited_for_on_its_link_however_long_it_says_nothing(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    """Stalled or paused: leaving it would gain nothing (there is no other), and it finds the link
    open when it resumes (tests/integration/test_control_plane_stall.py)."""
    agent = await start(nursery)
    await agent.welcome()
    await trio.sleep(100 * WELCOME.heartbeat_interval_s)
    assert agent.ended == [] and agent.link.state.connected


async def test_heartbeats_of_the_control_plane_keep_the_link_up(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    agent = await start(nursery, "cp-b")
    await agent.welcome()
    nursery.start_soon(heartbeats, agent)
    await trio.sleep(10 * 5 * WELCOME.heartbeat_interval_s)
    assert agent.ended == [] and agent.link.state.connected


# -- several control planes -------------------------------------------------------------------


class ControlPlanes:
    """Scripted control planes by host, dialled over memory streams: a standby answers the hello
    with `redirect`, a leader welcomes and heartbeats; `dialled` says in which order."""

    def __init__(self, nursery: trio.Nursery, *, standbys: dict[str, w.Redirect], down: set[str] = frozenset()) -> None:
        self.nursery = nursery
        self.standbys = standbys
        self.down = set(down)
        self.dialled: list[tuple[str, float]] = []
        self.sessions: dict[str, tuple[trio.CancelScope, trio.abc.Stream]] = {}

    async def kill(self, host: str) -> None:
        """The control plane at `host` dies: its connection is closed, and it answers no more."""
        self.down.add(host)
        scope, stream = self.sessions.pop(host)
        scope.cancel()
        await trio.aclose_forcefully(stream)

    async def dial(self, target: Target) -> trio.abc.Stream:
        self.dialled.append((target.host, trio.current_time()))
        if target.host in self.down:
            raise ConnectionRefusedError(111, "Connection refused")
        a, b = trio.testing.memory_stream_pair()
        self.nursery.start_soon(self._serve, target.host, b)
        return a

    async def _serve(self, host: str, stream: trio.abc.Stream) -> None:
        with trio.CancelScope() as scope:
            self.sessions[host] = (scope, stream)
            await self._converse(host, stream)

    async def _converse(self, host: str, stream: trio.abc.Stream) -> None:
        request = await trio_websocket.wrap_server_stream(self.nursery, stream)
        ws = await request.accept()
        assert isinstance(decode(await ws.get_message(), w.AgentMessage), w.Hello)
        redirect = self.standbys.get(host)
        if redirect is not None:
            await ws.send_message(encode(redirect))
            await ws.send_message(encode(w.LinkError(code=w.NOT_LEADER, message=redirect.message)))
            await ws.aclose()
            return
        await ws.send_message(encode(WELCOME))
        await ws.send_message(encode(w.DesiredState(generation=1)))
        for seq in range(1, 1000):
            await ws.send_message(encode(w.ServerHeartbeat(seq=seq)))
            await trio.sleep(WELCOME.heartbeat_interval_s)


def several(planes: ControlPlanes, *hosts: str) -> AgentLink:
    return AgentLink(
        target=Targets([Target(host=h, port=7443) for h in hosts]),
        node_id="node-a",
        ssl_context=ssl.create_default_context(),
        make_hello=hello,
        dial=planes.dial,
    )


async def test_a_standby_sends_the_agent_to_the_leader_at_once(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    planes = ControlPlanes(nursery, standbys={"cp-a": w.Redirect(leader="wss://cp-b:7443", message="cp-b leads")})
    link = several(planes, "cp-a", "cp-b", "cp-c")
    nursery.start_soon(link.serve)
    await link.desired_changed()
    assert planes.dialled == [("cp-a", 0.0), ("cp-b", 0.0)]  # no backoff before the leader
    assert link.state.connected and link.target == Target(host="cp-b", port=7443)


async def test_one_round_passes_a_standby_that_knows_no_leader_and_one_down_without_waiting(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    """During a takeover the next control plane may lead already: the backoff is between rounds
    of every control plane, not between dials."""
    none = w.Redirect(leader="", message="no control plane leads at the moment")
    planes = ControlPlanes(nursery, standbys={"cp-a": none}, down={"cp-b"})
    link = several(planes, "cp-a", "cp-b", "cp-c")
    nursery.start_soon(link.serve)
    await link.desired_changed()
    assert planes.dialled == [("cp-a", 0.0), ("cp-b", 0.0), ("cp-c", 0.0)]
    assert link.target.host == "cp-c"


async def test_when_every_control_plane_fails_the_backoff_applies_between_rounds(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    planes = ControlPlanes(nursery, standbys={}, down={"cp-a", "cp-b"})
    link = several(planes, "cp-a", "cp-b")
    with trio.move_on_after(120):
        await link.serve()
    rounds = [planes.dialled[i : i + 2] for i in range(0, len(planes.dialled) - 1, 2)]
    assert all([h for h, _ in r] == ["cp-a", "cp-b"] and r[0][1] == r[1][1] for r in rounds)  # a round: no wait
    assert 5 <= len(rounds) <= 40  # between rounds: 0.5 s doubling to 30 s, with jitter


async def test_two_standbys_that_name_each_other_do_not_spin(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    """Each read a lease the other held (stale): redirects are followed at once a few times in a
    row, then the backoff applies, so a wrong answer costs time, not a loop."""
    planes = ControlPlanes(
        nursery,
        standbys={
            "cp-a": w.Redirect(leader="wss://cp-b:7443", message="cp-b leads"),
            "cp-b": w.Redirect(leader="wss://cp-a:7443", message="cp-a leads"),
        },
    )
    link = several(planes, "cp-a", "cp-b")
    with trio.move_on_after(60):
        await link.serve()
    at_once = [t for _, t in planes.dialled if t == 0.0]
    # A round of both, each followed MAX_REDIRECTS times at most, then the backoff.
    assert len(at_once) <= len(("cp-a", "cp-b")) * (linkclient.MAX_REDIRECTS + 1)
    assert len(planes.dialled) < 150  # the backoff grows towards its 30 s between the rounds


async def test_after_the_leader_goes_the_agent_dials_the_next_control_plane(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    planes = ControlPlanes(nursery, standbys={})
    link = several(planes, "cp-a", "cp-b")
    nursery.start_soon(link.serve)
    await link.desired_changed()
    assert link.target.host == "cp-a"
    killed_at = trio.current_time()
    await planes.kill("cp-a")
    await link.desired_changed()  # a new session's first desired state
    assert link.target.host == "cp-b" and link.state.sessions == 2
    assert planes.dialled[-1] == ("cp-b", pytest.approx(killed_at, abs=agentlink.LINK_BACKOFF.first_s + 1))


async def test_a_report_refused_between_the_hello_and_the_welcome_follows_the_welcome(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    """The sim engine's check ends while the hello waits for its welcome: `send` refuses the
    report (no session yet), and the hello said no engines. Without the catch-up the control
    plane held "no engines" until the next change, and placed nothing there (seen in CI)."""
    engines: list[w.EngineStatus] = []
    a, b, _, _ = gated_pair()
    link = AgentLink(
        target=Target(host="cp", port=1),
        node_id="node-a",
        ssl_context=ssl.create_default_context(),
        make_hello=lambda: attrs.evolve(hello(), engines=tuple(engines)),
    )
    nursery.start_soon(link.run_on, a)
    control_plane = await (await trio_websocket.wrap_server_stream(nursery, b)).accept()
    said = decode(await control_plane.get_message(), w.AgentMessage)
    assert isinstance(said, w.Hello) and said.engines == ()

    engines.append(w.EngineStatus(name="sim", version="1", ok=True))
    assert not await link.send(w.EnginesChanged(engines=tuple(engines)))  # refused: not welcomed yet

    await control_plane.send_message(encode(WELCOME))
    caught_up = decode(await control_plane.get_message(), w.AgentMessage)
    assert caught_up == w.EnginesChanged(engines=(w.EngineStatus(name="sim", version="1", ok=True),))


async def test_the_catch_up_names_each_kind_that_changed_and_nothing_else() -> None:
    said = hello()
    assert agentlink.catch_up(said, said) == []
    replica = w.ReplicaStatus(replica_id="r-0", model="m", state=w.READY)
    now = attrs.evolve(said, inventory=attrs.evolve(INVENTORY, hostname="b"), replicas=(replica,))
    assert agentlink.catch_up(said, now) == [
        w.InventoryChanged(inventory=now.inventory),
        w.ReplicasChanged(replicas=(replica,)),
    ]
