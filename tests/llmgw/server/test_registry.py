"""Node liveness from heartbeats: joined means a heartbeat from the current agent process."""

from __future__ import annotations

from llmgw.server.registry import JOINED, JOINING, LOST, UNKNOWN, Registry
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


def connect(reg: Registry, now: float, **kw) -> int:
    return reg.connect(hello(**kw), address="127.0.0.2", cert_serial=1, cert_not_after=2e9, now=now)


def test_connected_is_joining_until_the_first_heartbeat() -> None:
    reg = Registry(heartbeat_ttl_s=TTL, started_at=0)
    conn = connect(reg, now=1)
    assert reg.liveness(reg.nodes["n1"], 2) == JOINING
    reg.heartbeat("n1", conn, 3)
    assert reg.liveness(reg.nodes["n1"], 3) == JOINED
    assert reg.liveness(reg.nodes["n1"], 3 + TTL) == JOINED
    assert reg.liveness(reg.nodes["n1"], 3 + TTL + 0.01) == LOST


def test_a_node_known_from_before_is_not_joined() -> None:
    # The spec's bug: a cordoned node re-added was known, so it "counted" without its new agent.
    reg = Registry(heartbeat_ttl_s=TTL, started_at=100)
    reg.know("n1", cordoned=True)
    assert reg.liveness(reg.nodes["n1"], 101) == UNKNOWN
    assert reg.liveness(reg.nodes["n1"], 100 + TTL + 1) == LOST
    conn = connect(reg, now=140)
    assert reg.liveness(reg.nodes["n1"], 141) == JOINING
    reg.heartbeat("n1", conn, 142)
    assert reg.liveness(reg.nodes["n1"], 142) == JOINED
    assert reg.nodes["n1"].cordoned


def test_a_restarted_agent_must_heartbeat_again() -> None:
    reg = Registry(heartbeat_ttl_s=TTL, started_at=0)
    old = connect(reg, now=1, started_at=1000.0)
    reg.heartbeat("n1", old, 2)
    new = connect(reg, now=5, started_at=2000.0)  # a new agent process
    assert reg.liveness(reg.nodes["n1"], 5) == JOINING
    reg.heartbeat("n1", old, 6)  # a late heartbeat on the replaced link counts for nothing
    assert reg.liveness(reg.nodes["n1"], 6) == JOINING
    reg.heartbeat("n1", new, 7)
    assert reg.liveness(reg.nodes["n1"], 7) == JOINED


def test_a_reconnect_of_the_same_process_stays_joined() -> None:
    reg = Registry(heartbeat_ttl_s=TTL, started_at=0)
    first = connect(reg, now=1)
    reg.heartbeat("n1", first, 2)
    reg.disconnect("n1", first)
    assert reg.liveness(reg.nodes["n1"], 3) == JOINED  # a dropped link is not a lost node, yet
    connect(reg, now=4)
    assert reg.liveness(reg.nodes["n1"], 4) == JOINED


def test_a_connection_that_never_heartbeats_becomes_lost() -> None:
    reg = Registry(heartbeat_ttl_s=TTL, started_at=0)
    connect(reg, now=1)
    assert reg.liveness(reg.nodes["n1"], 1 + TTL + 1) == LOST


def test_transitions_report_each_change_once() -> None:
    reg = Registry(heartbeat_ttl_s=TTL, started_at=0)
    conn = connect(reg, now=1)
    reg.heartbeat("n1", conn, 1)
    assert [(t.old, t.new) for t in reg.transitions(1)] == [(UNKNOWN, JOINED)]
    assert reg.transitions(2) == []
    assert [(t.old, t.new) for t in reg.transitions(1 + TTL + 1)] == [(JOINED, LOST)]


def test_next_deadline_is_when_the_oldest_heartbeat_expires() -> None:
    reg = Registry(heartbeat_ttl_s=TTL, started_at=-100)
    a = connect(reg, now=1, node_id="a")
    b = connect(reg, now=1, node_id="b")
    reg.heartbeat("a", a, 10)
    reg.heartbeat("b", b, 20)
    assert 10 + TTL <= reg.next_deadline(11) < 10 + TTL + 0.01


def test_forget_drops_the_node() -> None:
    reg = Registry(heartbeat_ttl_s=TTL, started_at=0)
    conn = connect(reg, now=1)
    reg.forget("n1")
    reg.heartbeat("n1", conn, 2)  # a heartbeat racing the removal is ignored
    assert "n1" not in reg.nodes
