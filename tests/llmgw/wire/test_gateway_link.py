"""The gateway link's messages survive the round trip through the one converter (whose
`encode` serves both links), its metric families (read and written by hand) as well as any, and
the limit-sharing rule gives each instance its part."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.wire import agent_link as w
from llmgw.wire import gateway_link as g
from llmgw.wire.convert import GATEWAY_TYPES, TYPES, decode, encode
from llmgw.wire.errors import WireError

ENDPOINT = g.RouteEndpoint(replica_id="r1", model="chat", host="::1", port=8000, api_key="secret", draining=True)
MESSAGES = [
    g.GatewayHello(protocol_version=1, name="gw1", instance="i1", gateway_version="0.3", started_at=1.5),
    g.GatewayHeartbeat(seq=2, in_flight=3, requests_total=4),
    g.GatewayHeartbeat(seq=2, metrics=()),  # an instance without figures
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


LABEL = st.text(max_size=8)
NUMBER = st.floats(allow_nan=False, allow_infinity=False) | st.integers(min_value=-(2**53), max_value=2**53)
SAMPLE = st.builds(
    g.Sample,
    labels=st.lists(LABEL, max_size=3).map(tuple),
    value=NUMBER,
    counts=st.lists(st.integers(min_value=0, max_value=2**63 - 1), max_size=4).map(tuple),
    sum=NUMBER,
)
FAMILY = st.builds(
    g.MetricFamily,
    name=LABEL,
    help=LABEL,
    kind=st.sampled_from(["counter", "gauge", "histogram"]),
    labels=st.lists(LABEL, max_size=3).map(tuple),
    buckets=st.lists(NUMBER, max_size=3).map(tuple),
    samples=st.lists(SAMPLE, max_size=5).map(tuple),
)


@settings(max_examples=200, deadline=None)
@given(st.lists(FAMILY, max_size=4).map(tuple) | st.none())
def test_any_metric_families_survive_the_round_trip(metrics) -> None:
    """Whatever the families hold, they come back equal (a whole number as its float); their
    sense (labels per series, counts per bucket) is the session's to check."""
    beat = g.GatewayHeartbeat(seq=1, metrics=metrics)
    assert decode(encode(beat), g.GatewayMessage) == beat


def test_a_sample_leaves_out_its_fields_at_their_defaults() -> None:
    """A gauge's series is its labels and value, a histogram's its labels, counts and sum: with a
    series per replica, what a heartbeat of thousands weighs."""
    frame = json.loads(encode(MESSAGES[3]))
    assert [f["samples"] for f in frame["metrics"]] == [
        [{"labels": ["chat", "200"], "value": 8}, {"labels": ["chat", "503"], "value": 1}],
        [{"labels": ["chat"], "counts": [1, 2, 0], "sum": 1.5}],
    ]
    assert "buckets" not in frame["metrics"][0] and frame["metrics"][1]["buckets"] == [0.1, 1.0]
    assert json.loads(encode(g.GatewayHeartbeat(seq=1)))["metrics"] is None  # as the last that had them


FAMILY_FRAME = '{"type": "gateway_heartbeat", "seq": 1, "metrics": [%s]}'


@pytest.mark.parametrize(
    ("family", "says"),
    [
        (
            '{"name": "x", "help": "h", "kind": "gauge", "samples": [{"value": 1.0}, {"value": true}]}',
            "samples[1]: value: expected a finite number, got True",
        ),
        (
            '{"name": "x", "help": "h", "kind": "gauge", "samples": [{"labels": ["a", 2]}]}',
            "samples[0]: labels: expected a string, got 2",
        ),
        (
            '{"name": "x", "help": "h", "kind": "histogram", "samples": [{"counts": [1, -2]}]}',
            "samples[0]: counts: expected a whole number from 0 to 2**63 - 1, got -2",
        ),
        (
            '{"name": "x", "help": "h", "kind": "gauge", "samples": [{"sum": NaN}]}',
            "samples[0]: sum: expected a finite number, got nan",
        ),
        ('{"name": "x", "help": "h", "kind": "gauge", "samples": [{"what": 1}]}', "samples[0]: unknown fields 'what'"),
        ('{"name": "x", "help": "h", "kind": "gauge", "samples": {}}', "samples: expected a list, got {}"),
        ('{"help": "h", "kind": "gauge"}', "missing fields 'name'"),
        ('{"name": 3, "help": "h", "kind": "gauge"}', "name: expected a string, got 3"),
        (
            '{"name": "x", "help": "h", "kind": "gauge", "buckets": [1, "2"]}',
            "buckets: expected a finite number, got '2'",
        ),
        ("7", "expected an object, got 7"),
        ("null", "expected an object, got None"),
    ],
)
def test_a_malformed_metric_family_is_refused_naming_the_series_and_field(family: str, says: str) -> None:
    with pytest.raises(WireError) as info:
        decode(FAMILY_FRAME % family, g.GatewayMessage)
    assert info.value.code == w.BAD_MESSAGE
    assert str(info.value) == f"malformed gateway_heartbeat: {says} @ gateway_heartbeat.metrics[0]"


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


def test_one_message_to_many_peers_is_encoded_once() -> None:
    """The rotation goes to every gateway instance as one object: its frame is made once."""
    rotation = g.RotationChanged(models=("chat",), endpoints=(ENDPOINT,) * 3, version=4)
    frame = encode(rotation)
    assert encode(rotation) is frame  # the same object: the same frame, not made again
    again = g.RotationChanged(models=("chat",), endpoints=(ENDPOINT,) * 3, version=4)
    assert encode(again) == frame  # an equal one: an equal frame
    assert decode(encode(g.RotationChanged(models=("chat",), endpoints=(), version=5)), g.ControlMessage).version == 5
