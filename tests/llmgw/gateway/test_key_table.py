"""A gateway's `KeyTable`: replaced whole by each table, its in-flight counts and buckets carried
over, and this instance's share of every key's limits (the rule of `llmgw.wire.gateway_link`)."""

from __future__ import annotations

import hashlib
import types

import pytest

from llmgw.gateway import keys
from llmgw.gateway.keys import KeyTable, token_hash
from llmgw.wire.gateway_link import GatewayKey, ShareChanged


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def key(name: str, **limits: int) -> GatewayKey:
    return GatewayKey(name=name, token_sha256=token_hash(f"token-{name}"), **limits)


def test_a_key_missing_from_a_new_table_is_refused_and_the_others_stay() -> None:
    table = KeyTable([key("a"), key("b")])
    assert table.authenticate("token-a") == key("a") and table.authenticate("token-b") == key("b")
    assert table.authenticate("token-c") is None and table.authenticate("token-a ") is None
    table.replace([key("b"), key("c")])
    assert table.authenticate("token-a") is None
    assert table.authenticate("token-b") == key("b") and table.authenticate("token-c") == key("c")
    assert len(table) == 2


def test_a_connection_sending_its_key_again_is_not_hashed_again_and_sees_every_new_table(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    a, b = key("a"), key("b")
    table = KeyTable([a, b])
    hashed: list[bytes] = []
    counting = types.SimpleNamespace(sha256=lambda data: hashed.append(data) or hashlib.sha256(data))
    monkeypatch.setattr(keys, "hashlib", counting)
    connection: dict = {}
    assert [table.authenticate("token-a", connection) for _ in range(3)] == [a] * 3
    assert hashed == [b"token-a"]
    # Another token on the same connection is hashed, and then is the one kept.
    assert table.authenticate("token-b", connection) == b
    assert table.authenticate("token-a ", connection) is None and table.authenticate("token-", connection) is None
    assert hashed == [b"token-a", b"token-b", b"token-a ", b"token-"]
    assert table.authenticate("token-a", connection) == a
    # What is kept is the token's hash, not its key: a key revoked is refused at the next request.
    table.replace([b])
    assert table.authenticate("token-a", connection) is None
    assert len(hashed) == 5
    # Another connection keeps its own.
    assert table.authenticate("token-b", {}) == b
    assert len(hashed) == 6 and hashed[-1] == b"token-b"


def test_requests_in_flight_survive_a_new_table() -> None:
    table = KeyTable([key("a", max_concurrency=2)])
    a = table.authenticate("token-a")
    assert table.admit(a) is None and table.admit(a) is None
    assert table.admit(a) is not None  # two in flight: the limit
    table.replace([key("a", max_concurrency=3)])  # its limit grows; the two in flight still count
    assert table.in_flight("a") == 2
    a = table.authenticate("token-a")
    assert table.admit(a) is None
    assert table.admit(a) is not None
    # Gone from the table while in flight: its requests still leave, and the count ends at zero.
    table.replace([])
    for _ in range(3):
        table.leave(a)
    assert table.in_flight("a") == 0
    table.leave(a)
    assert table.in_flight("a") == 0


def test_a_bucket_keeps_its_tokens_across_tables_and_refits_to_a_new_rate() -> None:
    clock = FakeClock()
    table = KeyTable([key("a", rate_per_minute=2)], clock=clock)
    a = table.authenticate("token-a")
    assert table.admit(a) is None and table.admit(a) is None
    table.replace([key("a", rate_per_minute=2)])  # the same key again: not a fresh burst
    assert table.admit(a) is not None
    table.replace([key("a", rate_per_minute=60)])  # a faster rate: a token a second from now on
    a = table.authenticate("token-a")
    clock.now += 1.0
    assert table.admit(a) is None
    assert table.admit(a) is not None


@pytest.mark.parametrize(
    ("limit", "count", "shares"),
    [(5, 2, [3, 2]), (4, 4, [1, 1, 1, 1]), (2, 3, [1, 1, 1]), (10, 1, [10]), (0, 3, [0, 0, 0])],
)
def test_the_concurrency_limit_is_divided_among_the_instances(limit: int, count: int, shares: list[int]) -> None:
    got = []
    for index in range(count):
        table = KeyTable([key("a", max_concurrency=limit)], share=ShareChanged(index=index, count=count))
        a = table.authenticate("token-a")
        admitted = 0
        while admitted < 50 and table.admit(a) is None:
            admitted += 1
        got.append(admitted if limit else 0)
    assert got == shares
    assert limit == 0 or sum(shares) == max(limit, count)  # at least one each: past the limit only then


def test_the_rate_is_divided_among_the_instances_and_the_message_says_so() -> None:
    clock = FakeClock()
    table = KeyTable([key("a", rate_per_minute=60)], share=ShareChanged(index=1, count=3), clock=clock)
    a = table.authenticate("token-a")
    assert all(table.admit(a) is None for _ in range(20))  # a burst of 60 / 3
    for _ in range(20):
        table.leave(a)
    limited = table.admit(a)
    assert limited is not None
    assert limited.retry_after_s == pytest.approx(3.0)  # 20 a minute here
    assert (
        limited.message
        == "key 'a' is limited to 60 requests per minute across 3 gateway instances (20 a minute on this one)"
    )


def test_a_new_share_applies_at_the_next_request() -> None:
    table = KeyTable([key("a", max_concurrency=4)])
    a = table.authenticate("token-a")
    for _ in range(3):
        assert table.admit(a) is None
    table.set_share(ShareChanged(index=0, count=2))  # two instances now: 2 each
    refused = table.admit(a)
    assert refused is not None
    assert "its share of the key's limit of 4 across 2 instances" in refused.message
    table.set_share(ShareChanged(index=0, count=1))
    assert table.admit(a) is None
