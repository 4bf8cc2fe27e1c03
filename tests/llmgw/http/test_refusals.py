"""The refusal summariser, on plain numbers for a clock: which refusals are logged one by one,
and the one summary per interval that counts the rest by reason and by peer network."""

from __future__ import annotations

import pytest

from llmgw.http import refusals
from llmgw.http.refusals import RefusalLog, peer_network


@pytest.mark.parametrize(
    ("peer", "network"),
    [
        ("203.0.113.7", "203.0.113.0/24"),
        ("203.0.113.7:51234", "203.0.113.0/24"),
        ("2001:db8:1:2:3:4:5:6", "2001:db8:1:2::/64"),
        ("[2001:db8:1:2::9]:443", "2001:db8:1:2::/64"),
        ("::ffff:198.51.100.20", "198.51.100.0/24"),  # a dual-stack socket's IPv4 peer
        ("fe80::1%eth0", "fe80::/64"),
        ("?", "?"),
        ("", "?"),
    ],
)
def test_a_peer_is_counted_under_its_slash_24_or_slash_64(peer: str, network: str) -> None:
    assert peer_network(peer) == network


def test_the_first_of_an_interval_are_logged_one_by_one_and_the_rest_summarised_once() -> None:
    log = RefusalLog(interval_s=10, burst=3)
    loud = [log.refused(100.0 + i * 0.004, "tls", f"192.0.2.{i % 5}") for i in range(2000)]
    assert loud[:3] == [True, True, True] and not any(loud[3:])
    assert log.due(109.9) == []  # the interval (100 to 110) has not ended
    [summary] = log.due(110.0)
    assert summary.count == 2000 and summary.logged == 3 and summary.began == 100.0
    assert summary.reasons == {"tls": 2000}
    assert summary.networks == {"192.0.2.0/24": 2000}  # five addresses, one network
    assert log.due(200.0) == []  # each summary once
    assert log.next_due() is None


def test_an_interval_with_no_more_than_the_burst_has_no_summary() -> None:
    log = RefusalLog(interval_s=10, burst=5)
    assert all(log.refused(float(t), "tls", "198.51.100.1") for t in range(5))
    assert log.next_due() == 10.0
    assert log.due(50.0) == []
    # A new interval begins at the next refusal, its burst whole again.
    assert log.refused(60.0, "tls", "198.51.100.1")
    assert log.next_due() == 70.0


def test_counts_by_reason_and_network_busiest_first() -> None:
    log = RefusalLog(interval_s=10, burst=0)
    for i in range(30):
        log.refused(1.0, "unproven", f"10.0.{i % 3}.9")  # 10 each from three /24s
    for i in range(50):
        log.refused(2.0, "tls", f"2001:db8::{i:x}")  # one /64
    log.refused(3.0, "paused", "")  # no peer: counted by reason only
    [summary] = log.due(11.0)
    assert summary.count == 81 and summary.logged == 0
    assert list(summary.reasons.items()) == [("tls", 50), ("unproven", 30), ("paused", 1)]
    assert list(summary.networks)[0] == "2001:db8::/64" and summary.networks["2001:db8::/64"] == 50
    assert {k: v for k, v in summary.networks.items() if k.startswith("10.")} == {
        "10.0.0.0/24": 10,
        "10.0.1.0/24": 10,
        "10.0.2.0/24": 10,
    }
    assert summary.fields()["over_s"] == 10


def test_refusals_never_logged_one_by_one_take_no_place_of_the_burst() -> None:
    log = RefusalLog(interval_s=10, burst=2)
    for _ in range(50):  # connections shed: logged at debug by their listener whatever happens
        assert not log.refused(0.0, "unproven", "192.0.2.1", loud=False)
    assert log.refused(1.0, "tls", "198.51.100.7")  # an agent's refusal right after is still seen
    [summary] = log.due(10.0)
    assert (summary.count, summary.logged) == (51, 1)
    assert summary.reasons == {"unproven": 50, "tls": 1}


def test_a_refusal_after_the_interval_closes_it_and_begins_the_next() -> None:
    log = RefusalLog(interval_s=10, burst=1)
    for t in (0.0, 1.0, 2.0):
        log.refused(t, "tls", "192.0.2.1")
    assert log.refused(15.0, "tls", "192.0.2.1")  # the first of a new interval: logged again
    log.refused(16.0, "tls", "192.0.2.1")
    first, second = log.due(30.0)
    assert (first.began, first.count) == (0.0, 3) and (second.began, second.count) == (15.0, 2)


def test_the_networks_counted_are_bounded_whatever_the_flood(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(refusals, "MAX_NETWORKS", 100)
    log = RefusalLog(interval_s=10, burst=0)
    for i in range(5000):  # 5000 /64s, as one IPv6 host can have
        log.refused(0.0, "tls", f"2001:db8:{i:x}::1")
    assert len(log._networks) == 101  # 100 apart, the rest as one
    [summary] = log.due(10.0)
    assert len(summary.networks) == refusals.TOP_NETWORKS + 1
    assert summary.networks[refusals.OTHER] == 5000 - refusals.TOP_NETWORKS
    assert sum(summary.networks.values()) == summary.count == 5000


def test_a_stop_flushes_the_open_interval_with_the_time_it_ran_and_nothing_twice() -> None:
    log = RefusalLog(interval_s=10, burst=2)
    for t in (0.0, 1.0, 2.0, 3.0):
        log.refused(t, "admin", "192.0.2.1:50000")
    for t in (20.0, 21.0, 22.0):  # the first closes the first interval and opens a second
        log.refused(t, "admin", "192.0.2.1:50001")
    first, second = log.flush(24.0)  # the ended interval, then the open one cut short
    assert (first.began, first.span_s, first.count, first.logged) == (0.0, 10.0, 4, 2)
    assert (second.began, second.count, second.logged) == (20.0, 3, 2) and second.span_s == 4.0
    assert log.next_due() is None and log.flush(100.0) == [] and log.due(100.0) == []


def test_a_flush_says_nothing_of_an_interval_whose_refusals_were_each_logged() -> None:
    log = RefusalLog(interval_s=10, burst=5)
    for t in range(5):
        log.refused(float(t), "admin", "192.0.2.1")
    assert log.flush(6.0) == [] and log.next_due() is None
