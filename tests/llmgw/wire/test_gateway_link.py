"""The gateway link's messages survive the round trip through the one converter (whose
`encode` serves both links), and the limit-sharing rule gives each instance its part."""

from __future__ import annotations

import pytest

from llmgw.wire import agent_link as w
from llmgw.wire import gateway_link as g
from llmgw.wire.convert import GATEWAY_TYPES, TYPES, decode, encode
from llmgw.wire.errors import WireError

ENDPOINT = g.RouteEndpoint(replica_id="r1", model="chat", host="::1", port=8000, api_key="secret", draining=True)
MESSAGES = [
    g.GatewayHello(protocol_version=1, name="gw1", instance="i1", gateway_version="0.3", started_at=1.5),
    g.GatewayHeartbeat(seq=2, in_flight=3, requests_total=4),
    g.GatewayHeartbeat(
        seq=3,
        in_flight=1,
        requests_total=9,
        rotation_version=7,
        outstanding=(g.ReplicaLoad(replica_id="r1", outstanding=1),),
        metrics=(
            g.MetricFamily(
                name="llmgw_gateway_requests_total",
                help="Requests answered, by model and status.",
                kind="counter",
                labels=("model", "status"),
                samples=(g.Sample(labels=("chat", "200"), value=8), g.Sample(labels=("chat", "503"), value=1)),
            ),
            g.MetricFamily(
                name="llmgw_gateway_request_duration_seconds",
                help="Time from request to the end of the response.",
                kind="histogram",
                labels=("model",),
                buckets=(0.1, 1.0),
                samples=(g.Sample(labels=("chat",), counts=(1, 2, 0), sum=1.5),),
            ),
        ),
    ),
    g.GatewayWelcome(name="gw1", instance="i1", server_version="0.3", heartbeat_interval_s=2.0),
    g.RotationChanged(models=("chat", "code"), endpoints=(ENDPOINT,), version=3),
    g.RotationChanged(models=("chat",), endpoints=(), unknown=("r1", "r2")),
    g.KeysChanged(keys=(g.GatewayKey(name="a", token_sha256="0" * 64, models=("chat",), max_concurrency=2),)),
    g.ShareChanged(index=1, count=3),
    g.TableHeartbeat(seq=9),
    w.Redirect(leader="wss://cp-b:7443", message="the leader is cp-b"),
    w.LinkError(code="x", message="y"),
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_gateway_message_survives_the_round_trip(message) -> None:
    union = g.GatewayMessage if type(message) in (g.GatewayHello, g.GatewayHeartbeat) else g.ControlMessage
    assert decode(encode(message), union) == message


def test_the_two_links_share_the_converter_and_link_error_and_redirect_alone() -> None:
    assert set(GATEWAY_TYPES) & set(TYPES) == {"link_error", "redirect"}
    assert GATEWAY_TYPES["rotation_changed"] is g.RotationChanged
    with pytest.raises(WireError) as info:  # a gateway message is no agent link's
        decode(encode(MESSAGES[0]), w.AgentMessage)
    assert info.value.code == w.UNKNOWN_TYPE


def test_the_engine_key_is_not_in_the_repr_of_a_rotation() -> None:
    assert "secret" not in repr(g.RotationChanged(models=(), endpoints=(ENDPOINT,)))


@pytest.mark.parametrize(
    ("limit", "count", "parts"),
    [
        (10, 1, [10]),
        (10, 2, [5, 5]),
        (10, 3, [4, 3, 3]),  # the remainder to the first instances: the sum is the limit
        (2, 3, [1, 1, 1]),  # at least one each: never a key no instance can serve
        (0, 3, [0, 0, 0]),  # no limit stays none
    ],
)
def test_concurrency_is_divided_among_the_instances(limit: int, count: int, parts: list[int]) -> None:
    assert [g.share_of_concurrency(limit, g.ShareChanged(index=i, count=count)) for i in range(count)] == parts


def test_a_rate_is_divided_and_its_burst_is_at_least_one() -> None:
    assert g.share_of_rate(60, g.ShareChanged(index=0, count=2)) == (30.0, 30.0)
    assert g.share_of_rate(1, g.ShareChanged(index=1, count=4)) == (0.25, 1.0)
    assert g.share_of_rate(0, g.ShareChanged(index=0, count=2)) == (0.0, 0.0)
