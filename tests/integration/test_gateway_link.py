"""The gateway link against a real cluster on loopback: `llmgw server`, two `llmgw agent`
processes and the sim engines they run, and this test's own gateway link client
(`llmgw.gatewayd.link`, with a certificate from `llmgw ca issue --gateway`) feeding a sink that
records when each part of the table arrived.

What the issue promises, measured: a revoked key, a replica leaving rotation (its engine killed)
and a drained node each reach the connected gateway within one second of the change (from the
admin call, or from the kill), and two instances of one gateway share its keys' limits (count
2, indexes 0 and 1) until one leaves (count 1). Every wait for the cluster is a bounded poll;
the figures measured are printed (run with `-- -s` to see them).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio

from llmgw.gatewayd.link import Credentials, GatewayLink, Target, serve_gateway_link
from llmgw.wire import gateway_link as g
from testlib.cluster import Cluster
from testlib.gatewayd import admin
from testlib.marked import kill_groups

CATALOG = """
[[models]]
name = "chat"
engine = "sim"
replicas = 1
"""
WITHIN_S = 1.0  # the promise: a change reaches every gateway within a second
READY_S = 60.0  # placement, engine start (a Python process each), health checks, on a loaded machine


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    # The control plane's own gateway on its loop (`gateway_workers = 0`): its worker processes
    # would be instances of their own among those sharing the keys' limits, and the instances
    # counted here are the test's two alone.
    c = Cluster(tmp_path, heartbeat_interval_s=0.2, heartbeat_ttl_s=3.0, server_toml="gateway_workers = 0\n")
    try:
        yield c
    finally:
        c.close()


class Sink:
    """A `TableSink` recording each part with trio's time of its arrival."""

    def __init__(self) -> None:
        self.parts: list[tuple[float, Any]] = []
        self.links: list[tuple[bool, str]] = []
        self._arrived = trio.lowlevel.ParkingLot()

    def _record(self, message: Any) -> None:
        self.parts.append((trio.current_time(), message))
        self._arrived.unpark_all()

    rotation_changed = keys_changed = share_changed = budgets_changed = grants_changed = _record

    def heard(self, now: float) -> None:
        pass

    def link_state(self, connected: bool, detail: str) -> None:
        self.links.append((connected, detail))

    def latest(self, kind: type) -> Any:
        return next((m for _, m in reversed(self.parts) if isinstance(m, kind)), None)

    async def arrival(self, what: str, predicate, *, after: float = -1.0, timeout: float = READY_S) -> float:
        """When the first part arriving after `after` (trio time) for which `predicate` holds came."""
        try:
            with trio.fail_after(timeout):
                while True:
                    for at, message in self.parts:
                        if at >= after and predicate(message):
                            return at
                    await self._arrived.park()
        except trio.TooSlowError:
            raise AssertionError(f"{what}: not within {timeout:g} s; parts: {self.parts[-6:]}") from None


def rotation_of(sink: Sink) -> tuple[g.RouteEndpoint, ...]:
    rotation = sink.latest(g.RotationChanged)
    return rotation.endpoints if rotation is not None else ()


def test_changes_reach_a_connected_gateway_within_a_second_and_instances_share_the_limits(
    cluster: Cluster, tmp_path: Path
) -> None:
    cluster.init_ca()
    cluster.set_catalog(CATALOG)
    for node_id in ("node-a", "node-b"):
        cluster.add_node(node_id)
    pki = tmp_path / "gw-pki"
    cluster.llmgw("ca", "issue", "--gateway", "gw1", "--config", str(cluster.server_config), "--out", str(pki))
    cluster.start_server()
    for node_id in ("node-a", "node-b"):
        cluster.start_agent(node_id)
    cluster.wait_replicas("the replica ready", lambda rs: [r["state"] for r in rs] == ["ready"], timeout=READY_S)
    cluster.ctl("keys", "create", "alice", "--models", "chat")
    cluster.ctl("keys", "create", "bob")
    measured = trio.run(partial(_scenario, cluster, Credentials.load(pki)))
    print(f"\ngateway link, from the change to the gateway's sink: {json.dumps(measured)}")
    assert all(seconds < WITHIN_S for seconds in measured.values()), measured


async def _scenario(cluster: Cluster, credentials: Credentials) -> dict[str, float]:
    measured: dict[str, float] = {}
    server = f"wss://127.0.0.1:{cluster.port}"
    sink = Sink()
    async with trio.open_nursery() as nursery:
        await nursery.start(
            partial(
                serve_gateway_link, server, credentials.ssl_context, name=credentials.name, instance="i1", sink=sink
            )
        )
        await sink.arrival(
            "a ready replica in the rotation", lambda m: isinstance(m, g.RotationChanged) and m.endpoints
        )
        await sink.arrival(
            "both keys", lambda m: isinstance(m, g.KeysChanged) and {k.name for k in m.keys} == {"alice", "bob"}
        )
        measured["revoked_key_s"] = await _revoke(cluster, sink)
        measured["engine_stopped_s"] = await _kill_engine(cluster, sink)
        measured["node_drained_s"] = await _drain(cluster, sink)
        await _share(cluster, credentials, sink, nursery)
        nursery.cancel_scope.cancel()
    assert sink.links[0] == (True, "")
    return measured


async def _revoke(cluster: Cluster, sink: Sink) -> float:
    start = trio.current_time()
    await trio.to_thread.run_sync(admin, cluster, "DELETE", "/admin/v1/keys/alice")
    arrived = await sink.arrival(
        "the keys without alice",
        lambda m: isinstance(m, g.KeysChanged) and [k.name for k in m.keys] == ["bob"],
        after=start,
    )
    return round(arrived - start, 3)


async def _kill_engine(cluster: Cluster, sink: Sink) -> float:
    [endpoint] = rotation_of(sink)
    [replica] = [r for r in await trio.to_thread.run_sync(cluster.replicas) if r["replica"] == endpoint.replica_id]
    [pid] = replica["pids"]
    start = trio.current_time()
    kill_groups([pid])  # the engine dies: its agent sees it exit, reports, the rotation drops it
    arrived = await sink.arrival(
        "the rotation without the killed replica",
        lambda m: isinstance(m, g.RotationChanged) and endpoint.replica_id not in {e.replica_id for e in m.endpoints},
        after=start,
    )
    # Its agent starts it again: back in the rotation before the next step.
    await sink.arrival(
        "the replica back in the rotation",
        lambda m: isinstance(m, g.RotationChanged) and [e.replica_id for e in m.endpoints] == [endpoint.replica_id],
        after=arrived,
    )
    return round(arrived - start, 3)


async def _drain(cluster: Cluster, sink: Sink) -> float:
    [endpoint] = rotation_of(sink)
    [replica] = [r for r in await trio.to_thread.run_sync(cluster.replicas) if r["replica"] == endpoint.replica_id]
    [node] = replica["nodes"]
    start = trio.current_time()
    await trio.to_thread.run_sync(admin, cluster, "POST", f"/admin/v1/nodes/{node}/drain")
    arrived = await sink.arrival(
        f"{endpoint.replica_id} marked draining",
        lambda m: isinstance(m, g.RotationChanged)
        and any(e.replica_id == endpoint.replica_id and e.draining for e in m.endpoints),
        after=start,
    )
    return round(arrived - start, 3)


async def _share(cluster: Cluster, credentials: Credentials, first: Sink, nursery: trio.Nursery) -> None:
    """A second instance of the gateway: each holds half the limits; it leaves, the first holds all."""
    second = Sink()
    scope = trio.CancelScope()
    nursery.start_soon(_run_instance, credentials, cluster.port, second, scope)
    await second.arrival("the second instance's share", lambda m: m == g.ShareChanged(index=1, count=2))
    await first.arrival("the first instance's share of two", lambda m: m == g.ShareChanged(index=0, count=2))
    gateways = (await trio.to_thread.run_sync(admin, cluster, "GET", "/admin/v1/gateways"))["gateways"]
    assert [(v["instance"], v["share"]) for v in gateways] == [
        ("i1", {"index": 0, "count": 2}),
        ("i2", {"index": 1, "count": 2}),
    ]
    left = trio.current_time()
    scope.cancel()
    await first.arrival("the first instance alone", lambda m: m == g.ShareChanged(index=0, count=1), after=left)


async def _run_instance(credentials: Credentials, port: int, sink: Sink, scope: trio.CancelScope) -> None:
    link = GatewayLink(
        target=Target(host="127.0.0.1", port=port),
        tls=credentials.ssl_context,
        name=credentials.name,
        instance="i2",
        sink=sink,
    )
    with scope:
        await link.serve()
