"""Routing decisions, pure: least outstanding, random ties, exclusions, drain, down until probed,
retry only while the client saw nothing, affinity."""

from __future__ import annotations

import random
from collections import Counter

import attrs

from llmgw.gateway.routing import Endpoint, Router, Verdict


def eps(*names: str, model: str = "m", draining: frozenset = frozenset()) -> list[Endpoint]:
    return [
        Endpoint(replica_id=n, model=model, host="10.0.0.1", port=8000 + i, draining=n in draining)
        for i, n in enumerate(names)
    ]


def router(*names: str, **kw) -> Router:
    r = Router(rng=random.Random(7), **kw)
    r.update({"m"}, eps(*names))
    return r


def test_least_outstanding_wins_and_ties_are_random() -> None:
    r = router("a", "b", "c")
    r.acquire(r.endpoints["m"][0])  # a has one
    picks = Counter(r.pick("m").replica_id for _ in range(200))
    assert set(picks) == {"b", "c"} and min(picks.values()) > 60
    for ep in r.endpoints["m"][1:]:
        r.acquire(ep)
        r.acquire(ep)
    assert r.pick("m").replica_id == "a"


def test_tried_replicas_are_excluded_and_none_left_is_none() -> None:
    r = router("a", "b")
    assert r.pick("m", exclude={"a"}).replica_id == "b"
    assert r.pick("m", exclude={"a", "b"}) is None
    assert r.pick("other") is None


def test_a_failed_replica_stays_down_however_long_until_a_probe_reaches_it() -> None:
    r = router("a", "b", probe_interval_s=1.0)
    a = r.endpoints["m"][0]
    verdict = r.failed(a, "connect", 10.0, client_saw_bytes=False)
    assert verdict == Verdict(retry=True, went_down=True)
    assert {r.pick("m").replica_id for _ in range(50)} == {"b"}
    assert r.state_of(a) == "down" and r.in_rotation("m") == [r.endpoints["m"][1]]
    # No timed return: the first probe is one interval on, and a failed one keeps it out.
    assert r.due_probes(10.5) == [] and r.next_probe_at() == 11.0
    assert r.due_probes(11.0) == [a]
    assert r.due_probes(11.5) == []  # that probe is still running: not started twice
    assert not r.probed(a, 11.0, reached=False)
    assert r.due_probes(1000.0) == [a]  # still down, long after any cooldown would have ended
    assert not r.probed(a, 1000.0, reached=False) and r.state_of(a) == "down"
    assert r.probed(a, 1001.0, reached=True)
    assert r.state_of(a) == "ready" and r.down == {} and r.next_probe_at() is None
    assert {r.pick("m").replica_id for _ in range(50)} == {"a", "b"}


def test_a_second_failure_of_a_down_replica_changes_nothing() -> None:
    r = router("a", "b")
    a = r.endpoints["m"][0]
    assert r.failed(a, "first_byte", 1.0, client_saw_bytes=False).went_down
    assert r.failed(a, "connect", 1.5, client_saw_bytes=False) == Verdict(retry=True, went_down=False)
    assert r.down["a"].reason == "first_byte" and r.down["a"].since == 1.0


def test_a_probe_begun_before_the_latest_failure_does_not_bring_it_back() -> None:
    r = router("a", "b")
    a = r.endpoints["m"][0]
    r.failed(a, "connect", 1.0, client_saw_bytes=False)
    [probed] = r.due_probes(2.0)
    assert r.probed(probed, 2.0, reached=True)
    r.failed(a, "first_byte", 2.5, client_saw_bytes=False)  # failed again while an older probe ran
    assert not r.probed(a, 2.0, reached=True) and r.state_of(a) == "down"


def test_a_replica_the_control_plane_removes_or_moves_is_forgotten_down_state_and_all() -> None:
    r = router("a", "b")
    a = r.endpoints["m"][0]
    r.failed(a, "connect", 1.0, client_saw_bytes=False)
    r.update({"m"}, eps("b"))  # removed from rotation
    assert r.down == {} and r.due_probes(100.0) == [] and r.next_probe_at() is None
    assert not r.probed(a, 2.0, reached=True)  # a probe that was under way changes nothing
    r.update({"m"}, eps("a", "b"))  # back (the same address): in rotation at once
    assert r.state_of(r.endpoints["m"][0]) == "ready"

    r.failed(r.endpoints["m"][0], "connect", 3.0, client_saw_bytes=False)
    r.update({"m"}, [attrs.evolve(eps("a", "b")[0], port=9999), eps("a", "b")[1]])  # restarted elsewhere
    assert r.down == {} and r.pick("m", exclude={"b"}).port == 9999
    r.failed(r.endpoints["m"][1], "connect", 4.0, client_saw_bytes=False)
    r.update({"m"}, r.endpoints["m"])  # an update that keeps it keeps it down
    assert set(r.down) == {"b"}


def test_a_failure_of_a_replica_no_longer_in_rotation_marks_nothing() -> None:
    r = router("a", "b")
    a = r.endpoints["m"][0]
    r.update({"m"}, eps("b"))
    assert r.failed(a, "connect", 1.0, client_saw_bytes=False) == Verdict(retry=True, went_down=False)
    assert r.down == {}


def test_a_failure_is_retried_only_while_nothing_went_to_the_client() -> None:
    for reason in ("connect", "first_byte", "502", "broken"):
        r = router("a", "b")
        a, b = r.endpoints["m"]
        assert r.failed(a, reason, 0.0, client_saw_bytes=False) == Verdict(retry=True, went_down=True)
        # A stream already relayed in part: the replica still leaves rotation, the request is not retried.
        assert r.failed(b, reason, 0.0, client_saw_bytes=True) == Verdict(retry=False, went_down=True)
        assert r.pick("m") is None


def test_a_draining_replica_gets_no_new_requests_while_another_can_take_them() -> None:
    r = Router(rng=random.Random(1))
    r.update({"m"}, eps("a", "b", draining=frozenset({"a"})))
    assert {r.pick("m").replica_id for _ in range(50)} == {"b"}
    r.failed(r.endpoints["m"][1], "connect", 0.0, client_saw_bytes=False)
    assert r.pick("m").replica_id == "a"  # the only one left: a drain is not an outage
    assert r.state_of(r.endpoints["m"][0]) == "draining"


def test_an_update_keeps_outstanding_counts_and_release_balances_after_removal() -> None:
    r = router("a", "b")
    a = r.endpoints["m"][0]
    r.acquire(a)
    r.update({"m"}, eps("a", "b", "c"))
    assert r.outstanding == {"a": 1}
    r.update({"m"}, eps("b"))  # a left rotation with a request on it
    assert r.pick("m").replica_id == "b"
    r.release(a)
    assert r.outstanding == {}
    assert r.models == {"m"}


def test_the_per_replica_cap_makes_a_full_model_pick_nothing() -> None:
    r = router("a", max_outstanding=2)
    a = r.endpoints["m"][0]
    r.acquire(a)
    assert r.pick("m") is a
    r.acquire(a)
    assert r.pick("m") is None
    r.release(a)
    assert r.pick("m") is a


def test_prefix_affinity_prefers_one_replica_within_one_of_the_least() -> None:
    r = router("a", "b", "c", "d", affinity_chars=16)
    prompt = "You are a helpful assistant. Answer briefly."
    first = r.pick("m", prompt=prompt)
    assert all(r.pick("m", prompt=prompt) is first for _ in range(20))
    assert r.pick("m", prompt=prompt[:16] + " something else") is first  # same prefix
    r.acquire(first)
    assert r.pick("m", prompt=prompt) is first  # +1 over the least: still preferred
    r.acquire(first)
    assert r.pick("m", prompt=prompt) is not first  # +2: load wins
    others = {r.pick("m", prompt=f"{i:04d} different prefix").replica_id for i in range(40)}
    assert len(others) > 1
