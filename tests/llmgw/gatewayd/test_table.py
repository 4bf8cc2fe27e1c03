"""A gateway's table, fed as the link client feeds it: each part replaced whole, kept while the
link is down, its staleness counted from the last frame, and /health's answer as data."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from llmgw.gateway.keys import token_hash
from llmgw.gatewayd.table import GatewayTable
from llmgw.wire.gateway_link import GatewayKey, KeysChanged, ModelInfo, RotationChanged, RouteEndpoint, ShareChanged

ROUTE = RouteEndpoint(replica_id="chat-0", model="chat", host="10.0.0.1", port=8000, api_key="engine-key")
KEY = GatewayKey(name="team-a", token_sha256=token_hash("token-a"), models=("chat",), max_concurrency=4)


def fed(table: GatewayTable, *, now: float) -> GatewayTable:
    table.link_state(True, "")
    table.rotation_changed(RotationChanged(models=("chat", "embed"), endpoints=(ROUTE,)))
    table.keys_changed(KeysChanged(keys=(KEY,)))
    table.share_changed(ShareChanged(index=1, count=2))
    table.heard(now)
    return table


def test_a_table_becomes_the_gateways_rotation_and_keys() -> None:
    table = fed(GatewayTable(), now=5.0)
    rotation = table.endpoints.gateway_rotation()
    assert rotation.models == frozenset({"chat", "embed"})
    [ep] = rotation.endpoints
    assert (ep.replica_id, ep.model, ep.host, ep.port, ep.api_key, ep.draining) == (
        "chat-0",
        "chat",
        "10.0.0.1",
        8000,
        "engine-key",
        False,
    )
    assert table.keys.authenticate("token-a") == KEY
    assert table.keys.share == ShareChanged(index=1, count=2)
    assert table.received


def test_a_new_rotation_wakes_the_gateway_and_replaces_the_old_whole() -> None:
    table = fed(GatewayTable(), now=0.0)
    changed = table.endpoints.rotation_changed()
    assert not changed.is_set()
    table.rotation_changed(RotationChanged(models=("chat",), endpoints=()))
    assert changed.is_set()
    assert table.endpoints.gateway_rotation().endpoints == ()
    assert not table.endpoints.rotation_changed().is_set()  # a fresh event for the next change


def test_replicas_a_rotation_calls_unknown_are_kept_from_the_last_until_a_rotation_says_which_they_are() -> None:
    other = RouteEndpoint(replica_id="chat-1", model="chat", host="10.0.0.2", port=8001)
    table = GatewayTable()
    table.rotation_changed(RotationChanged(models=("chat",), endpoints=(ROUTE, other)))
    # A control plane just started: chat-0's node is back, chat-1's not yet, chat-2 it never had.
    moved = RouteEndpoint(replica_id="chat-0", model="chat", host="10.0.0.1", port=9000)
    table.rotation_changed(RotationChanged(models=("chat",), endpoints=(moved,), unknown=("chat-1", "chat-2")))
    assert [(e.replica_id, e.port) for e in table.rotation.endpoints] == [("chat-0", 9000), ("chat-1", 8001)]
    table.rotation_changed(RotationChanged(models=("chat",), endpoints=(moved,)))  # chat-1's node lost
    assert [e.replica_id for e in table.rotation.endpoints] == ["chat-0"]
    fresh = GatewayTable()  # a gateway with no rotation before keeps nothing
    fresh.rotation_changed(RotationChanged(models=("chat",), endpoints=(), unknown=("chat-0",)))
    assert fresh.rotation.endpoints == () and fresh.received is False


def test_staleness_counts_from_the_last_frame_and_from_the_start_before_any() -> None:
    table = GatewayTable(now=10.0)
    assert table.staleness(12.5) == 2.5  # never heard: since the table was made
    table.heard(20.0)
    assert table.staleness(20.0) == 0.0
    table.link_state(False, "connection refused")
    assert table.staleness(31.0) == 11.0  # the link down: the last frame ages
    table.heard(40.0)
    assert table.staleness(40.5) == 0.5


def test_the_table_is_kept_while_the_link_is_down() -> None:
    table = fed(GatewayTable(), now=0.0)
    table.link_state(False, "control plane closed the connection")
    assert table.endpoints.gateway_rotation().endpoints[0].replica_id == "chat-0"
    assert table.keys.authenticate("token-a") == KEY
    status, body = table.health(100.0, {"chat": 1, "embed": 0}, draining=False)
    assert status == 200
    assert body == {
        "status": "ok",
        "ready": {"chat": 1, "embed": 0},
        "link_up": False,
        "link_detail": "control plane closed the connection",
        "staleness_s": 100.0,
        "keys": 1,
        "share": {"index": 1, "count": 2},
    }


@pytest.mark.parametrize(
    ("parts", "missing"), [((), "rotation and keys"), (("rotation",), "keys"), (("keys",), "rotation")]
)
def test_health_is_503_until_a_whole_table_came(parts: tuple[str, ...], missing: str) -> None:
    table = GatewayTable()
    table.link_state(False, "connection refused")
    if "rotation" in parts:
        table.rotation_changed(RotationChanged(models=("chat",), endpoints=(ROUTE,)))
    if "keys" in parts:
        table.keys_changed(KeysChanged(keys=(KEY,)))
    status, body = table.health(1.0, {"chat": 1}, draining=False)
    assert status == 503 and body["status"] == "no_table"
    assert body["reason"] == (f"no table from the control plane yet (missing: {missing}); the link: connection refused")


def test_health_is_503_with_no_replica_ready_and_while_draining() -> None:
    table = fed(GatewayTable(), now=0.0)
    status, body = table.health(0.0, {"chat": 0, "embed": 0}, draining=False)
    assert (status, body["status"]) == (503, "no_ready_replica")
    status, body = table.health(0.0, {"chat": 1}, draining=True)
    assert (status, body["status"]) == (503, "draining")


def test_health_is_200_with_no_replica_ready_when_a_model_is_on_demand() -> None:
    """Its requests are held while a replica starts: a load balancer must keep sending them here."""
    table = fed(GatewayTable(), now=0.0)
    table.rotation_changed(
        RotationChanged(
            models=("chat", "cold"),
            endpoints=(),
            details=(ModelInfo(name="chat"), ModelInfo(name="cold", on_demand=True)),
        )
    )
    status, body = table.health(0.0, {"chat": 0, "cold": 0}, draining=False)
    assert (status, body["status"]) == (200, "ok")
    table.rotation_changed(RotationChanged(models=("chat",), endpoints=(), details=(ModelInfo(name="chat"),)))
    assert table.health(0.0, {"chat": 0}, draining=False)[0] == 503


@pytest.mark.trio
async def test_the_gateway_follows_the_tables_rotation(autojump_clock: trio.testing.MockClock) -> None:
    from llmgw.gateway.app import Gateway

    table = GatewayTable(now=trio.current_time())
    gateway = Gateway(table.endpoints, table.keys)
    async with trio.open_nursery() as nursery:
        await nursery.start(gateway.serve_rotation)
        assert gateway.ready() == {}
        fed(table, now=trio.current_time())
        await trio.testing.wait_all_tasks_blocked()
        assert gateway.ready() == {"chat": 1, "embed": 0}
        table.rotation_changed(RotationChanged(models=("chat",), endpoints=()))
        await trio.testing.wait_all_tasks_blocked()
        assert gateway.ready() == {"chat": 0}
        nursery.cancel_scope.cancel()
