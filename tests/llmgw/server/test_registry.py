"""Node liveness from heartbeats: joined means a heartbeat from the current agent process."""

from __future__ import annotations

from llmgw.server.state.registry import JOINED, JOINING, LOST, UNKNOWN, NodeRegistry
from llmgw.wire import agent_link as w

TTL = 30.0


def hello(node_id: str = "n1", started_at: float = 1000.0, boot_id: str = "boot-a") -> w.Hello:
    return w.Hello(
        protocol_version=w.PROTOCOL_VERSION,
        node_id=node_id,
        agent_version="0.1",
        boot_id=boot_id,
        started_at=started_at,
        inventory=w.Inventory(hostname=node_id, os="linux", arch="x86_64", python="3.11", cpu_model="cpu", cpu_cores=2),
    )


def connect(reg: NodeRegistry, now: float, **kw) -> int:
    return reg.connect(hello(**kw), address="127.0.0.2", cert_serial=1, cert_not_after=2e9, now=now)


def test_connected_is_joining_until_the_first_heartbeat() -> None:
    reg = NodeRegistry(heartbeat_ttl_s=TTL, started_at=0)
    conn = connect(reg, now=1)
    assert reg.liveness(reg.nodes["n1"], 2) == JOINING
    reg.heartbeat("n1", conn, 3)
    assert reg.liveness(reg.nodes["n1"], 3) == JOINED
    assert reg.liveness(reg.nodes["n1"], 3 + TTL) == JOINED
    assert reg.liveness(reg.nodes["n1"], 3 + TTL + 0.01) == LOST


def test_a_node_known_from_before_is_not_joined() -> None:
    # The spec's bug: a cordoned node re-added was known, so it "counted" without its new agent.
    reg = NodeRegistry(heartbeat_ttl_s=TTL, started_at=100)
    reg.know("n1", cordoned=True)
    assert reg.liveness(reg.nodes["n1"], 101) == UNKNOWN
    assert reg.liveness(reg.nodes["n1"], 100 + TTL + 1) == LOST
    conn = connect(reg, now=140)
    assert reg.liveness(reg.nodes["n1"], 141) == JOINING
    reg.heartbeat("n1", conn, 142)
    assert reg.liveness(reg.nodes["n1"], 142) == JOINED
    assert reg.nodes["n1"].cordoned


def test_a_restarted_agent_must_heartbeat_again() -> None:
    reg = NodeRegistry(heartbeat_ttl_s=TTL, started_at=0)
    old = connect(reg, now=1, started_at=1000.0)
    reg.heartbeat("n1", old, 2)
    new = connect(reg, now=5, started_at=2000.0)  # a new agent process
    assert reg.liveness(reg.nodes["n1"], 5) == JOINING
    reg.heartbeat("n1", old, 6)  # a late heartbeat on the replaced link counts for nothing
    assert reg.liveness(reg.nodes["n1"], 6) == JOINING
    reg.heartbeat("n1", new, 7)
    assert reg.liveness(reg.nodes["n1"], 7) == JOINED


def test_a_reconnect_of_the_same_process_stays_joined() -> None:
    reg = NodeRegistry(heartbeat_ttl_s=TTL, started_at=0)
    first = connect(reg, now=1)
    reg.heartbeat("n1", first, 2)
    reg.disconnect("n1", first)
    assert reg.liveness(reg.nodes["n1"], 3) == JOINED  # a dropped link is not a lost node, yet
    connect(reg, now=4)
    assert reg.liveness(reg.nodes["n1"], 4) == JOINED


def test_a_connection_that_never_heartbeats_becomes_lost() -> None:
    reg = NodeRegistry(heartbeat_ttl_s=TTL, started_at=0)
    connect(reg, now=1)
    assert reg.liveness(reg.nodes["n1"], 1 + TTL + 1) == LOST


def test_transitions_report_each_change_once() -> None:
    reg = NodeRegistry(heartbeat_ttl_s=TTL, started_at=0)
    conn = connect(reg, now=1)
    reg.heartbeat("n1", conn, 1)
    assert [(t.old, t.new) for t in reg.transitions(1)] == [(UNKNOWN, JOINED)]
    assert reg.transitions(2) == []
    assert [(t.old, t.new) for t in reg.transitions(1 + TTL + 1)] == [(JOINED, LOST)]


def test_next_deadline_is_when_the_oldest_heartbeat_expires() -> None:
    reg = NodeRegistry(heartbeat_ttl_s=TTL, started_at=-100)
    a = connect(reg, now=1, node_id="a")
    b = connect(reg, now=1, node_id="b")
    reg.heartbeat("a", a, 10)
    reg.heartbeat("b", b, 20)
    assert 10 + TTL <= reg.next_deadline(11) < 10 + TTL + 0.01


def test_forget_drops_the_node() -> None:
    reg = NodeRegistry(heartbeat_ttl_s=TTL, started_at=0)
    conn = connect(reg, now=1)
    reg.forget("n1")
    reg.heartbeat("n1", conn, 2)  # a heartbeat racing the removal is ignored
    assert "n1" not in reg.nodes


# -- liveness time: a stall of the control plane is nobody's silence ---------------------------


def test_a_stall_moves_every_deadline_by_its_length_and_a_silent_node_is_still_lost() -> None:
    """On a fake clock: the ticker reads it every 50 ms; the control plane stalls for 40 s (over
    the TTL); node a's heartbeats waited in its socket buffer meanwhile, node b had gone silent."""
    from llmgw.looplag import INTERVAL_S, StallClock

    interval = 5.0
    clock = StallClock(hold_s=interval)
    clock.watch(0.0)
    reg = NodeRegistry(heartbeat_ttl_s=TTL, started_at=clock.observe(0.0), clock=clock)
    a, b = connect(reg, now=clock.observe(0.0), node_id="a"), connect(reg, now=clock.observe(0.0), node_id="b")
    t = 0.0
    per_beat = round(interval / INTERVAL_S)

    def run_until(end: float, beating: tuple[str, ...]) -> None:
        """The loop running: the ticker every 50 ms, each beating node's heartbeat every interval."""
        nonlocal t
        start, ticks = t, round((end - t) / INTERVAL_S)
        for k in range(1, ticks + 1):
            t = start + k * INTERVAL_S
            now = clock.observe(t)
            if round(t / INTERVAL_S) % per_beat == 0:
                for node_id, conn in (("a", a), ("b", b)):
                    if node_id in beating:
                        reg.heartbeat(node_id, conn, now)

    run_until(20.0, ("a", "b"))
    assert [(x.node_id, x.new) for x in reg.transitions(clock.observe(t))] == [("a", JOINED), ("b", JOINED)]
    run_until(22.0, ("a",))  # b's last heartbeat was at 20
    t += 40.0  # the stall: nothing ran, a's heartbeats waited in its socket buffer
    now = clock.observe(t)  # whoever runs first after it (the reconciler, woken at a deadline long past)
    assert reg.transitions(now) == []  # nobody lost: 40 s of silence over a 30 s TTL were the control plane's
    reg.heartbeat("a", a, now)  # a's buffered heartbeat, read next
    assert reg.liveness(reg.nodes["b"], now) == JOINED
    # b is lost one TTL of liveness time after its last heartbeat: the loop's 40 s stall and the
    # hold of one interval after it later than on the loop's clock.
    expected_loss = 20.0 + TTL + 40.0 + interval
    run_until(expected_loss - 0.2, ("a",))
    assert reg.transitions(clock.observe(t)) == []
    run_until(expected_loss + 0.2, ("a",))
    assert [(x.node_id, x.new) for x in reg.transitions(clock.observe(t))] == [("b", LOST)]
    assert reg.liveness(reg.nodes["a"], clock.observe(t)) == JOINED
    # The reconciler's deadline for b, in trio's time, was where b was found lost.
    assert clock.loop_time(reg.next_deadline(clock.observe(t))) > t
