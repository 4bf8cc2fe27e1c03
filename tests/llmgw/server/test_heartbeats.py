"""Heartbeats that stretch as the cluster grows (`llmgw.server.links.heartbeats`) and the liveness
they bound (`llmgw.server.state.registry`), on a fake clock: the registry is pure, every call given
`now`."""

from __future__ import annotations

import pytest

from llmgw.server.links.heartbeats import HeartbeatRule
from llmgw.server.state.registry import JOINED, LOST, NodeRegistry
from llmgw.wire import agent_link as w

RULE = HeartbeatRule(interval_s=5.0, ttl_s=30.0, max_rate=50.0)  # the defaults


@pytest.mark.parametrize(
    ("agents", "interval", "ttl"),
    [
        (0, 5, 30),
        (1, 5, 30),
        (250, 5, 30),
        (251, 10, 60),
        (500, 10, 60),
        (1000, 20, 120),
        (5000, 100, 600),
        (5001, 105, 630),
    ],
)
def test_the_interval_is_the_floor_until_the_rate_would_pass_its_bound_then_grows_with_the_cluster(
    agents: int, interval: float, ttl: float
) -> None:
    assert RULE.interval(agents) == interval
    assert RULE.ttl(RULE.interval(agents)) == ttl  # six intervals, as configured at the floor


def test_the_cluster_as_a_whole_never_heartbeats_faster_than_the_bound() -> None:
    for rule in (RULE, HeartbeatRule(interval_s=2.0, ttl_s=10.0, max_rate=7.5)):
        for agents in range(1, 20_001, 7):
            rate = agents / rule.interval(agents)
            assert rate <= max(rule.max_rate, agents / rule.interval_s) + 1e-9
            if agents > rule.interval_s * rule.max_rate:
                assert rate <= rule.max_rate + 1e-9
                # Stretched no more than a step (the floor) past what the bound needs.
                assert rule.interval(agents) < agents / rule.max_rate + rule.interval_s


def test_a_rate_of_zero_keeps_every_agent_at_the_configured_interval() -> None:
    rule = HeartbeatRule(interval_s=5.0, ttl_s=30.0, max_rate=0.0)
    assert rule.interval(1) == rule.interval(100_000) == 5.0 and rule.ttl(5.0) == 30.0


def hello(node_id: str) -> w.Hello:
    inventory = w.Inventory(hostname=node_id, os="linux", arch="x86_64", python="3.11", cpu_model="c", cpu_cores=1)
    return w.Hello(
        protocol_version=w.PROTOCOL_VERSION,
        node_id=node_id,
        agent_version="test",
        boot_id="b",
        started_at=1.0,
        inventory=inventory,
    )


def joined(registry: NodeRegistry, node_id: str, now: float, interval: float) -> int:
    conn = registry.connect(hello(node_id), address="10.0.0.1", cert_serial=1, cert_not_after=1e12, now=now)
    registry.told(node_id, conn, RULE.ttl(interval))
    registry.heartbeat(node_id, conn, now)
    return conn


def test_a_dead_node_is_lost_within_the_ttl_of_the_interval_it_was_told_and_not_before() -> None:
    registry = NodeRegistry(heartbeat_ttl_s=30.0, started_at=0.0)
    interval = RULE.interval(1000)  # 20 s
    conn = joined(registry, "n1", 0.0, interval)
    t = 0.0
    for _ in range(10):  # heartbeats every interval: joined throughout, though 30 s pass between none
        t += interval
        assert registry.liveness(registry.nodes["n1"], t - 1e-6) == JOINED
        registry.heartbeat("n1", conn, t)
    # It dies: lost six intervals after its last heartbeat, not at the floor's 30 s.
    assert registry.liveness(registry.nodes["n1"], t + 30.0 + 1) == JOINED
    assert registry.next_deadline(t + 1) == pytest.approx(t + 120.0, abs=0.01)
    assert registry.liveness(registry.nodes["n1"], t + 120.0) == JOINED
    assert registry.liveness(registry.nodes["n1"], t + 120.0 + 0.01) == LOST


def test_a_longer_interval_told_counts_at_once_a_shorter_one_from_the_next_heartbeat() -> None:
    registry = NodeRegistry(heartbeat_ttl_s=30.0, started_at=0.0)
    conn = joined(registry, "n1", 0.0, 5.0)
    node = registry.nodes["n1"]
    registry.told("n1", conn, RULE.ttl(20.0))  # the cluster grew: its next heartbeat may be 20 s off
    assert registry.liveness(node, 100.0) == JOINED and registry.liveness(node, 120.01) == LOST
    registry.heartbeat("n1", conn, 20.0)
    registry.told("n1", conn, RULE.ttl(5.0))  # it shrank: the agent may still be asleep on 20 s
    assert registry.liveness(node, 20.0 + 119.0) == JOINED  # judged by the longer until it heartbeats
    registry.heartbeat("n1", conn, 40.0)
    assert registry.liveness(node, 40.0 + 30.0) == JOINED
    assert registry.liveness(node, 40.0 + 30.01) == LOST  # from then on by the shorter
    assert registry.ttl_of("n1", conn) == 30.0


def test_a_reconnect_of_the_same_agent_keeps_what_it_was_told() -> None:
    registry = NodeRegistry(heartbeat_ttl_s=30.0, started_at=0.0)
    joined(registry, "n1", 0.0, 100.0)  # told 100 s: lost after 600 s
    again = registry.connect(hello("n1"), address="10.0.0.1", cert_serial=1, cert_not_after=1e12, now=50.0)
    assert registry.ttl_of("n1", again) == 600.0
    assert registry.liveness(registry.nodes["n1"], 599.0) == JOINED
