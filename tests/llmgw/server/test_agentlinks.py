"""The control plane's end of the agent link (`llmgw.server.links.agentlinks`) against the agent's
(`agent.link`), over memory streams on MockClock: the Welcome before the link is published, the
first desired state made once the node is recorded, and what a slow or stopped agent does to
the pushers (nothing), to the desired states (the newest, one at a time), to log requests (a
bound, answered at once past it) and to the link (cut at the send deadline). The real sockets,
TLS and every refusal are tests/agent/test_link.py's."""

from __future__ import annotations

import ssl
import time
from datetime import datetime, timedelta, timezone

import attrs
import pytest
import trio
import trio.testing

from agent.link import AgentLink, Target
from llmgw.linkio import Targets
from llmgw.pki.ca import CertInfo
from llmgw.server.links import linkserver
from llmgw.server.links.agentlinks import AgentLinks
from llmgw.server.links.agentlistener import AgentListener
from llmgw.server.links.heartbeats import HeartbeatRule
from llmgw.server.state.registry import NodeRegistry
from llmgw.server.store import NodeRow
from llmgw.wire import agent_link as w
from llmgw.wire import agent_session as s
from testlib.memlink import Gate, gated_pair

pytestmark = pytest.mark.trio

NOW = datetime.now(timezone.utc)
CERT = CertInfo(
    subject="CN=node-a",
    issuer="CN=llmgw",
    common_name="node-a",
    serial=0xA1,
    fingerprint_sha256="",
    not_before=NOW - timedelta(days=1),
    not_after=NOW + timedelta(days=30),
)


def hello() -> w.Hello:
    inventory = w.Inventory(hostname="a", os="linux", arch="x86_64", python="3.11", cpu_model="c", cpu_cores=1)
    return w.Hello(
        protocol_version=w.PROTOCOL_VERSION,
        node_id="node-a",
        agent_version="test",
        boot_id="b",
        started_at=1.0,
        inventory=inventory,
    )


class Store:
    """The two calls of the store a link makes; `on_saw` runs as the node is recorded."""

    def __init__(self) -> None:
        self.on_saw = lambda: None

    async def is_revoked(self, serial: int) -> bool:
        await trio.lowlevel.checkpoint()
        return False

    async def saw_node(self, node_id: str, address: str) -> NodeRow:
        await trio.lowlevel.checkpoint()
        self.on_saw()
        return NodeRow(node_id=node_id, first_seen=0, last_seen=0, address=address, cordoned=False, draining=False)


@attrs.define
class Link:
    """One agent's link: its adapter, the streams' gates, how its session ended."""

    agent: AgentLink
    to_server: Gate
    to_agent: Gate
    ended: list[str] = attrs.field(factory=list)
    done: trio.Event = attrs.field(factory=trio.Event)  # its session ended


class Plane:
    """The agent link's end, whose desired state counts what it made; `until` waits on its changes."""

    def __init__(self) -> None:
        self.registry = NodeRegistry(heartbeat_ttl_s=30.0, started_at=0.0)
        self.store = Store()
        self.made: list[float] = []  # when each desired state was made
        self._changed = trio.lowlevel.ParkingLot()
        self.agents = AgentLinks(
            registry=self.registry,
            store=self.store,
            heartbeat_interval_s=5.0,
            desired_state=self.desired,
            on_change=self._changed.unpark_all,
            silence_timeout_s=30.0,
        )
        self.port = AgentListener(store=self.store, max_connections=8, agents=self.agents)

    def desired(self, node_id: str) -> w.DesiredState:
        node = self.registry.nodes[node_id]
        assert node.link is not None and node.link.connected  # recorded first
        self.made.append(trio.current_time())
        return w.DesiredState(generation=len(self.made))

    async def until(self, predicate) -> None:
        while not predicate():
            await self._changed.park()

    async def _serve(self, stream: trio.abc.Stream) -> None:
        # The connection as the agent port serves it once TLS has shown CERT.
        await self.port.serve_peer(stream, CERT, "10.0.0.1")

    def connect(self, nursery: trio.Nursery, *others: str) -> Link:
        """An agent linked over memory streams (`others`: more control planes its agent.toml
        names, never dialled here: with them it leaves a control plane that falls silent)."""
        a, b, to_server, to_agent = gated_pair()
        agent = AgentLink(
            target=Targets([Target(host=h, port=1) for h in ("cp", *others)]),
            node_id="node-a",
            ssl_context=ssl.create_default_context(),
            make_hello=hello,
        )
        agent.answer_logs = lambda req: w.LogsReply(
            request_id=req.request_id, replica_id=req.replica_id, text=f"tail of {req.replica_id}"
        )
        link = Link(agent=agent, to_server=to_server, to_agent=to_agent)

        async def run_agent() -> None:
            try:
                await agent.run_on(a)
                link.ended.append("ended")
            except Exception as exc:  # noqa: BLE001 - what the agent would log
                link.ended.append(agent.reason_of(exc))
            link.done.set()

        nursery.start_soon(self._serve, b)
        nursery.start_soon(run_agent)
        return link

    async def join(self, nursery: trio.Nursery, *others: str) -> Link:
        link = self.connect(nursery, *others)
        await link.agent.desired_changed()
        await self.until(lambda: "node-a" in self.agents.links)
        return link


@pytest.fixture
def plane() -> Plane:
    return Plane()


async def test_the_link_is_published_once_its_welcome_is_written_the_desired_state_made_after_the_node_is_recorded(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery, plane: Plane
) -> None:
    link = plane.connect(nursery)
    plane.store.on_saw = link.to_agent.close  # the agent stops reading as its node is recorded
    await link.to_agent.held.wait()  # the Welcome waits in a buffer the agent does not read
    node = plane.registry.nodes["node-a"]
    assert node.link is not None and node.link.connected  # recorded, connected
    assert "node-a" not in plane.agents.links and plane.made == []  # not published, nothing made
    link.to_agent.open()
    await link.agent.desired_changed()
    assert link.agent.state.desired == w.DesiredState(generation=1) and link.agent.state.server_version
    assert "node-a" in plane.agents.links and len(plane.made) == 1


async def test_pushers_never_wait_on_a_slow_agent_which_gets_the_newest_desired_state_at_its_pace(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery, plane: Plane
) -> None:
    link = await plane.join(nursery)
    link.to_agent.delay_s = 1.0  # the agent takes one frame a second
    for _ in range(100):  # a change every 50 ms for 5 s: the reconciler, the mirror, the admin API
        before = trio.current_time()
        await plane.agents.push_desired_state("node-a")
        assert trio.current_time() == before  # it only queued
        await trio.sleep(0.05)
    last_push = trio.current_time()
    with trio.fail_after(5):
        while link.agent.state.desired.generation != len(plane.made) or plane.made[-1] < last_push:
            await link.agent.desired_changed()
    assert 4 <= len(plane.made) <= 8, plane.made  # one a second, not one per change


async def test_an_agent_that_takes_nothing_is_cut_at_the_send_deadline(
    autojump_clock: trio.testing.MockClock,
    nursery: trio.Nursery,
    plane: Plane,
    caplog: pytest.LogCaptureFixture,
) -> None:
    link = await plane.join(nursery)
    link.to_agent.close()
    started = trio.current_time()
    for _ in range(50):
        await plane.agents.push_desired_state("node-a")
    assert trio.current_time() == started
    await plane.until(lambda: "node-a" not in plane.agents.links)
    assert trio.current_time() - started == pytest.approx(linkserver.SEND_TIMEOUT_S)
    assert not plane.registry.nodes["node-a"].link.connected
    assert len(plane.made) == 2  # the first, and the one stuck: the other pushes made nothing
    [cut] = [r.llmgw_fields for r in caplog.records if r.getMessage() == "agent_link_not_reading"]
    assert cut == {"node": "node-a", "after_s": linkserver.SEND_TIMEOUT_S}


async def test_log_requests_past_the_bound_are_answered_at_once_and_the_rest_when_the_agent_reads(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery, plane: Plane
) -> None:
    link = await plane.join(nursery)
    link.to_agent.close()
    replies: dict[str, w.LogsReply] = {}

    async def ask(replica: str) -> None:
        replies[replica] = await plane.agents.request_logs("node-a", replica, 10)

    async with trio.open_nursery() as callers:
        for i in range(s.MAX_LOGS_ASKED):
            callers.start_soon(ask, f"r{i}")
        await link.to_agent.held.wait()
        started = trio.current_time()
        late = await plane.agents.request_logs("node-a", "r-late", 10)
        assert trio.current_time() == started
        assert late.error == "node node-a has too many log requests unanswered; ask again later"
        link.to_agent.open()
    assert {r: (reply.text, reply.error) for r, reply in replies.items()} == {
        f"r{i}": (f"tail of r{i}", "") for i in range(s.MAX_LOGS_ASKED)
    }


async def test_a_logs_request_is_answered_when_the_link_ends_not_at_its_deadline(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery, plane: Plane
) -> None:
    link = await plane.join(nursery)
    link.to_agent.close()
    started = trio.current_time()
    reply = await plane.agents.request_logs("node-a", "r1", 10, timeout_s=60)
    assert reply.error == "node node-a's link closed before it answered"
    assert trio.current_time() - started == pytest.approx(linkserver.SEND_TIMEOUT_S)  # cut, not timed out
    reply = await plane.agents.request_logs("node-a", "r1", 10)
    assert reply.error == "node node-a is not connected; ask again later"


async def test_closing_a_node_tells_its_agent_why_and_ends_the_link(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery, plane: Plane
) -> None:
    link = await plane.join(nursery)
    assert await plane.agents.close_node("node-a", w.REVOKED, "this node was removed")
    await plane.until(lambda: not plane.registry.nodes["node-a"].link.connected)
    await link.done.wait()
    assert link.ended == ["the control plane closed the link: this node was removed"]
    assert not await plane.agents.close_node("node-a", w.REVOKED, "again")


async def test_an_agents_reports_and_heartbeats_reach_the_registry(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery, plane: Plane
) -> None:
    link = await plane.join(nursery)
    status = w.ReplicaStatus(replica_id="r1", model="m", state=w.READY, port=8000)
    assert await link.agent.send(w.ReplicasChanged(replicas=(status,)))
    await plane.until(lambda: plane.registry.nodes["node-a"].replicas == (status,))
    await plane.until(lambda: plane.registry.nodes["node-a"].link.last_heartbeat_at is not None)
    assert link.agent.state.connected and link.agent.state.server_version


def metric(text: str, name: str) -> float:
    [value] = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + " ")]
    return value


async def test_metrics_count_the_nodes_by_state_the_links_and_how_long_heartbeats_took_to_count(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery, plane: Plane
) -> None:
    link = await plane.join(nursery)
    await plane.until(lambda: plane.registry.nodes["node-a"].link.last_heartbeat_at is not None)
    plane.registry.know("node-b")  # known from before, never linked: unknown while the cluster forms
    text = plane.agents.render_metrics()
    assert metric(text, 'llmgw_nodes{state="joined"}') == 1 and metric(text, 'llmgw_nodes{state="unknown"}') == 1
    assert metric(text, 'llmgw_nodes{state="lost"}') == 0 and metric(text, "llmgw_agent_links") == 1
    assert metric(text, "llmgw_agent_heartbeat_interval_seconds") == 5.0
    counted = metric(text, "llmgw_agent_heartbeat_delay_seconds_count")
    assert counted >= 1 and metric(text, 'llmgw_agent_heartbeat_delay_seconds_bucket{le="0.5"}') == counted
    # A heartbeat the agent sent 3 s ago by its clock (a swamped control plane, or a clock ahead)
    # lands above 2.5 s; one from a clock behind ours counts as no delay, not a negative one.
    name = "llmgw_agent_heartbeat_delay_seconds"

    async def counted_as(count: float) -> None:
        with trio.fail_after(5):  # a joined node's heartbeat wakes nothing (`until`): looked at
            while metric(plane.agents.render_metrics(), f"{name}_count") < count:
                await trio.sleep(0.1)

    # (One at a time: a heartbeat not yet written is replaced by a newer one.)
    assert await link.agent.send(w.Heartbeat(seq=100, sent_at=time.time() - 3.0))
    await counted_as(counted + 1)
    assert await link.agent.send(w.Heartbeat(seq=101, sent_at=time.time() + 60.0))
    await counted_as(counted + 2)
    text = plane.agents.render_metrics()
    assert metric(text, f'{name}_bucket{{le="2.5"}}') == counted + 1
    assert metric(text, f'{name}_bucket{{le="5"}}') == counted + 2


# -- a control plane that does not lead --------------------------------------------------------


async def test_a_control_plane_that_does_not_lead_redirects_a_new_link_and_records_nothing(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery, plane: Plane
) -> None:
    plane.agents.leading = lambda: False
    plane.agents.redirect = lambda: w.Redirect(leader="wss://cp-b:7443", message="the leader is cp-b")
    link = plane.connect(nursery)
    await link.done.wait()
    assert link.ended == ["the leader is cp-b"]
    assert "node-a" not in plane.registry.nodes and plane.made == [] and plane.agents.links == {}


async def test_once_the_term_is_over_nothing_is_pushed_and_close_all_sends_the_agents_away(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery, plane: Plane
) -> None:
    leading = [True]
    plane.agents.leading = lambda: leading[0]
    link = await plane.join(nursery)
    assert len(plane.made) == 1
    leading[0] = False
    await plane.agents.push_desired_state("node-a")
    await plane.agents.mirror_changed()
    await trio.sleep(1)
    assert len(plane.made) == 1  # no desired state made for it
    assert await plane.agents.close_all(w.NOT_LEADER, "this control plane leads no more") == 1
    await link.done.wait()
    assert link.ended == ["the control plane closed the link: this control plane leads no more"]


async def test_the_control_plane_heartbeats_so_a_quiet_link_stays_up(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery, plane: Plane
) -> None:
    link = await plane.join(nursery, "cp-b")  # an agent that would leave a silent one
    await trio.sleep(20 * plane.agents.heartbeat_interval_s)  # no push, no logs: only heartbeats
    assert link.ended == [] and link.agent.state.connected and "node-a" in plane.agents.links


async def beats(plane: Plane, seconds: float) -> list[float]:
    """When node-a's heartbeats reached the registry over the next `seconds`."""
    seen: list[float] = []
    end = trio.current_time() + seconds
    while trio.current_time() < end:
        at = plane.registry.nodes["node-a"].link.last_heartbeat_at
        if at is not None and (not seen or at != seen[-1]):
            seen.append(at)
        await trio.sleep(0.25)
    return seen


async def test_the_agent_heartbeats_at_the_interval_it_is_told_and_follows_a_stretched_one(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery, plane: Plane
) -> None:
    # One agent at most 0.1 heartbeats a second: told 10 s in its Welcome (at most 250 at the
    # defaults would be told 5 s; the rule's own numbers are tests/llmgw/server/test_heartbeats.py's).
    plane.agents.heartbeats = HeartbeatRule(interval_s=5.0, ttl_s=30.0, max_rate=0.1)
    link = await plane.join(nursery, "cp-b")  # an agent that would leave a control plane silent too long
    conn = plane.agents.links["node-a"].conn_id
    assert link.agent.state.heartbeat_interval_s == 10.0 and plane.registry.ttl_of("node-a", conn) == 60.0
    seen = await beats(plane, 45.0)
    gaps = [b - a for a, b in zip(seen, seen[1:], strict=False)]
    assert len(gaps) >= 3 and all(g == pytest.approx(10.0, abs=0.5) for g in gaps), seen
    # The cluster "grows": the next heartbeat of the control plane tells 20 s.
    plane.agents.heartbeats = HeartbeatRule(interval_s=5.0, ttl_s=30.0, max_rate=0.05)
    with trio.fail_after(11):
        while link.agent.state.heartbeat_interval_s != 20.0:
            await trio.sleep(0.25)
    assert plane.registry.ttl_of("node-a", conn) == 120.0  # longer: at once
    await trio.sleep(20.0)  # the first heartbeat after the change may still be on the old interval
    seen = await beats(plane, 85.0)
    gaps = [b - a for a, b in zip(seen, seen[1:], strict=False)]
    assert len(gaps) >= 3 and all(g == pytest.approx(20.0, abs=0.5) for g in gaps), seen
    # Neither side took the longer silences for a dead peer (the agent's limit and the link's follow).
    assert link.ended == [] and link.agent.state.connected and "node-a" in plane.agents.links


async def test_a_link_waiting_on_a_short_silence_keeps_to_the_longer_one_its_agent_was_told_meanwhile(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery, plane: Plane
) -> None:
    # An agent that heartbeats once and then falls silent (frozen), told 5 s: a silence of 30 s
    # would close its link. Before those 30 s the cluster grows and the control plane tells 100 s
    # (a silence of 600 s): the wait begun on the 30 s must not close it at 30 s, and the link
    # is closed once silent for the 600.
    plane.agents.heartbeats = HeartbeatRule(interval_s=5.0, ttl_s=30.0, max_rate=10.0)
    link = plane.connect(nursery)

    async def once(writer, beat) -> None:
        writer.session.heartbeat(time.time())
        writer.wake()
        await trio.sleep_forever()

    link.agent._heartbeats = once  # type: ignore[method-assign]
    await link.agent.desired_changed()
    await plane.until(lambda: "node-a" in plane.agents.links)
    joined = trio.current_time()
    assert link.agent.state.heartbeat_interval_s == 5.0
    plane.agents.heartbeats = HeartbeatRule(interval_s=5.0, ttl_s=30.0, max_rate=0.01)
    with trio.fail_after(11):
        while link.agent.state.heartbeat_interval_s != 100.0:
            await trio.sleep(0.25)
    await trio.sleep(joined + 100.0 - trio.current_time())
    assert link.ended == [] and "node-a" in plane.agents.links
    with trio.fail_after(600.0):
        await link.done.wait()
    assert "nothing received for 600 s" in link.ended[0] and trio.current_time() - joined >= 600.0


async def test_measured_speeds_reach_the_registry_and_a_bench_request_rides_the_desired_state(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery, plane: Plane
) -> None:
    link = await plane.join(nursery)
    measuring = w.BackendSpeed(engine="llamacpp", backend="cpu", state=w.SPEED_MEASURING, request="bench-1")
    assert await link.agent.send(w.SpeedsChanged(speeds=(measuring,)))
    await plane.until(lambda: plane.registry.nodes["node-a"].speeds == (measuring,))
    assert plane.registry.nodes["node-a"].speeds == (measuring,)
    done = attrs.evolve(measuring, state=w.SPEED_OK, prompt_tps=850.0, gen_tps=42.0)
    node = plane.registry.nodes["node-a"]
    # Only a figure placement reads counts as a change of speed.
    assert plane.registry.speeds_changed("node-a", node.link.conn_id, (done,)) is True
    assert plane.registry.speeds_changed("node-a", node.link.conn_id, (attrs.evolve(done, request="x"),)) is False
    assert plane.registry.ask_bench("node-a", "bench-2") and node.bench_asked == "bench-2"
    assert not plane.registry.ask_bench("node-z", "bench-2")
