"""Routing decisions, pure: least outstanding, random ties, exclusions, drain, cooldown, affinity."""

from __future__ import annotations

import random
from collections import Counter

from llmgw.server.gateway.routing import Endpoint, Router


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
    picks = Counter(r.pick("m", 0.0).replica_id for _ in range(200))
    assert set(picks) == {"b", "c"} and min(picks.values()) > 60
    for ep in r.endpoints["m"][1:]:
        r.acquire(ep)
        r.acquire(ep)
    assert r.pick("m", 0.0).replica_id == "a"


def test_tried_replicas_are_excluded_and_none_left_is_none() -> None:
    r = router("a", "b")
    assert r.pick("m", 0.0, exclude={"a"}).replica_id == "b"
    assert r.pick("m", 0.0, exclude={"a", "b"}) is None
    assert r.pick("other", 0.0) is None


def test_a_failed_connection_takes_a_replica_out_until_the_cooldown_ends() -> None:
    r = router("a", "b", down_cooldown_s=5.0)
    r.mark_down("a", 10.0)
    assert {r.pick("m", 12.0).replica_id for _ in range(50)} == {"b"}
    assert r.state_of(r.endpoints["m"][0], 12.0) == "down"
    assert {r.pick("m", 15.0).replica_id for _ in range(50)} == {"a", "b"}


def test_a_draining_replica_gets_no_new_requests_while_another_can_take_them() -> None:
    r = Router(rng=random.Random(1))
    r.update({"m"}, eps("a", "b", draining=frozenset({"a"})))
    assert {r.pick("m", 0.0).replica_id for _ in range(50)} == {"b"}
    r.mark_down("b", 0.0)
    assert r.pick("m", 1.0).replica_id == "a"  # the only one left: a drain is not an outage


def test_an_update_keeps_outstanding_counts_and_release_balances_after_removal() -> None:
    r = router("a", "b")
    a = r.endpoints["m"][0]
    r.acquire(a)
    r.update({"m"}, eps("a", "b", "c"))
    assert r.outstanding == {"a": 1}
    r.update({"m"}, eps("b"))  # a left rotation with a request on it
    assert r.pick("m", 0.0).replica_id == "b"
    r.release(a)
    assert r.outstanding == {}
    assert r.models == {"m"}


def test_the_per_replica_cap_makes_a_full_model_pick_nothing() -> None:
    r = router("a", max_outstanding=2)
    a = r.endpoints["m"][0]
    r.acquire(a)
    assert r.pick("m", 0.0) is a
    r.acquire(a)
    assert r.pick("m", 0.0) is None
    r.release(a)
    assert r.pick("m", 0.0) is a


def test_prefix_affinity_prefers_one_replica_within_one_of_the_least() -> None:
    r = router("a", "b", "c", "d", affinity_chars=16)
    prompt = "You are a helpful assistant. Answer briefly."
    first = r.pick("m", 0.0, prompt=prompt)
    assert all(r.pick("m", 0.0, prompt=prompt) is first for _ in range(20))
    assert r.pick("m", 0.0, prompt=prompt[:16] + " something else") is first  # same prefix
    r.acquire(first)
    assert r.pick("m", 0.0, prompt=prompt) is first  # +1 over the least: still preferred
    r.acquire(first)
    assert r.pick("m", 0.0, prompt=prompt) is not first  # +2: load wins
    others = {r.pick("m", 0.0, prompt=f"{i:04d} different prefix").replica_id for i in range(40)}
    assert len(others) > 1
