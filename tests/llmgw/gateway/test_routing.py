"""Routing decisions, pure: least outstanding, random ties, exclusions, drain, down until probed,
retry only while the client saw nothing, prefix routing (`llmgw.gateway.prefix` has the rest)."""

from __future__ import annotations

import random
from collections import Counter

import attrs

from llmgw.gateway.kvevents import Cleared, Removed, Stored
from llmgw.gateway.prefix import PrefixTable, Prompt
from llmgw.gateway.routing import (
    LEAST,
    LEAST_OUTSTANDING,
    PREFIX,
    Endpoint,
    EventsReport,
    Route,
    Router,
    Verdict,
)


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
    a, b = r.endpoints["m"]
    assert r.pick("m", exclude={a}).replica_id == "b"
    assert r.pick("m", exclude={a, b}) is None
    assert r.pick("other") is None
    # A replica started again at another address (placed again after a member's node was lost:
    # its rank 0 on a new port, or another node) is another endpoint: a request that tried it
    # before may try it now.
    r.update({"m"}, [attrs.evolve(a, port=a.port + 1), b])
    assert r.pick("m", exclude={a, b}).replica_id == "a"


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
    assert r.down == {} and r.pick("m", exclude={r.endpoints["m"][1]}).port == 9999
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


def _talk(n: int, *turns: str) -> Prompt:
    messages = [{"role": "system", "content": "Be brief. " * 60}, {"role": "user", "content": f"Question {n}?"}]
    messages += [{"role": "assistant" if i % 2 == 0 else "user", "content": t} for i, t in enumerate(turns)]
    got = Prompt.of({"messages": messages}, "m")
    assert got is not None
    return got


def test_a_model_routed_by_prefix_goes_where_its_conversation_was_served() -> None:
    r = Router(rng=random.Random(7))
    r.update({"m"}, eps("a", "b", "c", "d"), {"m": PREFIX})
    first = _talk(1)
    ep, route = r.route("m", prompt=first)
    assert ep is not None and route == Route(PREFIX, "hash", 0) and route.header == "prefix;matched=0;hash"
    r.served(ep, first)
    later = _talk(1, "Brief answer. " * 30, "And then?")
    again, route = r.route("m", prompt=later)
    assert again is ep and route.reason == "hit" and route.matched_chars == first.ends[-1]
    assert route.header == f"prefix;matched={first.ends[-1]};hit" and route.metric == "prefix_hit"
    # Without a prompt (a body without one), or for a model routed by load: least outstanding.
    assert r.route("m")[1] is LEAST and r.route("m")[1].header == "least_outstanding"
    r.update({"m"}, eps("a", "b", "c", "d"), {"m": LEAST_OUTSTANDING})
    assert r.route("m", prompt=later)[1] is LEAST


def test_a_replica_leaving_rotation_loses_what_it_held_and_its_conversations_move() -> None:
    r = Router(rng=random.Random(7))
    r.update({"m"}, eps("a", "b", "c"), {"m": PREFIX})
    talks = [_talk(n) for n in range(60)]
    held = {}
    for t in talks:
        ep, _ = r.route("m", prompt=t)
        assert ep is not None
        r.served(ep, t)
        held[t.anchor] = ep.replica_id
    assert set(held.values()) == {"a", "b", "c"}
    r.update({"m"}, eps("a", "c"), {"m": PREFIX})  # b leaves
    for t in talks:
        ep, route = r.route("m", prompt=t)
        assert ep is not None and ep.replica_id != "b"
        if held[t.anchor] != "b":
            assert (ep.replica_id, route.reason) == (held[t.anchor], "hit")
        else:
            assert route.reason == "hash"
    r.update({"m"}, eps("a", "b", "c"), {"m": PREFIX})  # b is back, assumed empty: it holds nothing
    assert all(r.prefix.matches(t, ["b"]) == {} for t in talks)
    # A replica not in rotation is not recorded as holding what it served (its answer raced its removal).
    gone = Endpoint(replica_id="z", model="m", host="10.0.0.9", port=9)
    r.served(gone, talks[0])
    assert r.prefix.matches(talks[0], ["z"]) == {}


def test_the_only_candidate_takes_it_and_says_how_much_it_holds() -> None:
    r = Router(rng=random.Random(7))
    r.update({"m"}, eps("a"), {"m": PREFIX})
    t = _talk(1)
    ep, route = r.route("m", prompt=t)
    assert ep is not None and route == Route(PREFIX, "only", 0)
    r.served(ep, t)
    assert r.route("m", prompt=t)[1] == Route(PREFIX, "only", t.ends[-1])


def test_an_engine_that_reports_its_task_count_begun_again_is_taken_to_hold_nothing() -> None:
    r = Router(rng=random.Random(7))
    r.update({"m"}, eps("a", "b"), {"m": PREFIX})
    a = r.endpoints["m"][0]
    t = _talk(1)
    r.served(a, t)
    assert r.engine_report(a, [3, 7]) is False  # the first report: nothing to compare with
    assert r.engine_report(a, [9, 12]) is False and r.prefix.matches(t, ["a"])  # counting on: the same engine
    assert r.engine_report(a, []) is True  # no task since: begun again (restarted in place)
    assert r.prefix.matches(t, ["a"]) == {}
    r.served(a, t)
    assert r.engine_report(a, [0]) is False and r.prefix.matches(t, ["a"])
    gone = Endpoint(replica_id="z", model="m", host="10.0.0.9", port=9)
    assert r.engine_report(gone, []) is False  # not in rotation: not listened to


def test_kv_cache_events_numbered_again_or_a_cleared_cache_forget_what_the_replica_held() -> None:
    r = Router(rng=random.Random(7))
    r.update({"m"}, eps("a", "b"), {"m": PREFIX})
    a = r.endpoints["m"][0]
    t = _talk(1)
    r.served(a, t)
    assert r.engine_events(a, 0, [Stored(hashes=(1, 2), parent=None, block_size=16, tokens=32)]) == EventsReport()
    assert r.engine_events(a, 3, []) == EventsReport(missed=2)  # 1 and 2 never came
    assert r.prefix.matches(t, ["a"])
    assert r.engine_events(a, 0, []) == EventsReport(restarted=True)  # numbered from 0 again: a new engine
    assert r.prefix.matches(t, ["a"]) == {}
    r.served(a, t)
    assert r.engine_events(a, 1, [Cleared()]) == EventsReport(cleared=True)
    assert r.prefix.matches(t, ["a"]) == {} and r.prefix.held_chars("a") == 0
    gone = Endpoint(replica_id="z", model="m", host="10.0.0.9", port=9)
    assert r.engine_events(gone, 0, [Cleared()]) == EventsReport()  # not in rotation: not listened to
    # Leaving rotation forgets the numbering too: back, its first batch is not a restart.
    r.update({"m"}, eps("b"), {"m": PREFIX})
    r.update({"m"}, eps("a", "b"), {"m": PREFIX})
    assert r.engine_events(r.endpoints["m"][0], 0, []) == EventsReport()


def test_an_engine_that_evicts_has_the_router_forget_its_oldest_conversations_to_fit() -> None:
    """The engine holds 32 blocks of 16 tokens (2,048 bytes at 4 a token) once it evicts: of the
    conversations recorded on it, the most recently served that fit stay, the older go."""
    r = Router(rng=random.Random(7))
    r.update({"m"}, eps("a", "b"), {"m": PREFIX})
    a, b = r.endpoints["m"]
    talks = [Prompt.of({"prompt": f"{n:04d}" + "x" * 1020}, "m") for n in range(6)]  # 1,024 bytes each, 4 blocks
    for t in talks:
        assert t is not None
        r.served(a, t)
    r.served(b, talks[0])  # b served the oldest one later: the table names b for it now
    assert r.prefix.held_chars("a") == 5 * 1024 and r.prefix.held_chars("b") == 1024
    stored = Stored(hashes=tuple(range(60)), parent=None, block_size=16, tokens=960)
    assert r.engine_events(a, 0, [stored]).trimmed == 0  # no eviction: nothing said of what it lacks
    report = r.engine_events(a, 1, [Removed(hashes=tuple(range(28)))])  # 32 blocks left
    assert report.trimmed == 12 and r.prefix.held_chars("a") == 2 * 1024
    kept = [n for n, t in enumerate(talks) if t is not None and r.prefix.matches(t, ["a"])]
    assert kept == [4, 5]
    assert r.prefix.matches(talks[0], ["b"]) == {"b": 4}  # another replica's entries untouched
    # Removing what it never said it stored (before the subscription began) changes nothing.
    assert r.engine_events(a, 2, [Removed(hashes=(999,))]).trimmed == 0


def test_an_engines_partial_blocks_count_the_tokens_they_hold() -> None:
    """vLLM stores a prompt's last block with the tokens it has (`block_size` = those tokens):
    what the engine holds is the blocks' tokens, not the last event's size times the blocks."""
    r = Router(rng=random.Random(7))
    r.update({"m"}, eps("a", "b"), {"m": PREFIX})
    a = r.endpoints["m"][0]
    talks = [Prompt.of({"prompt": f"{n:04d}" + "x" * 1020}, "m") for n in range(4)]  # 1,024 bytes each
    for t in talks:
        assert t is not None
        r.served(a, t)
    full = Stored(hashes=tuple(range(40)), parent=None, block_size=16, tokens=640)
    partial = Stored(hashes=(100,), parent=39, block_size=3, tokens=3)
    assert r.engine_events(a, 0, [full, partial]).trimmed == 0
    # 8 full blocks evicted: 32 full blocks and the partial one left, 515 tokens, 2,060 bytes.
    assert r.engine_events(a, 1, [Removed(hashes=tuple(range(8)))]).trimmed == 8
    assert r.prefix.held_chars("a") == 2 * 1024  # by the last event's size (3 a block) it was 0
    # The same block stored again (whole now) is counted once, at its new size.
    assert r.engine_events(a, 2, [Stored(hashes=(100,), parent=39, block_size=16, tokens=16)]).trimmed == 0
    # 30 full blocks and the whole one: 496 tokens, 1,984 bytes: one 256-byte entry goes.
    assert r.engine_events(a, 3, [Removed(hashes=(8, 9))]).trimmed == 1
    assert r.prefix.held_chars("a") == 1792


def test_a_trim_looks_at_a_bounded_number_of_entries_and_the_next_goes_on() -> None:
    table = PrefixTable()
    for n in range(100):
        p = Prompt.of({"prompt": f"{n:04d}" + "y" * 252}, "m")  # one block each
        assert p is not None
        table.record(p, "a" if n % 2 else "b")
    assert table.held_chars("a") == 50 * 256
    assert table.trim("a", 0, scan=10) == 5  # of the 10 oldest entries, a's five
    assert table.trim("a", 0, scan=1_000) == 45 and table.held_chars("a") == 0
    assert table.held_chars("b") == 50 * 256 and len(table) == 50
    small = PrefixTable(entries=10)  # entries pushed out of a full table stop counting
    for n in range(30):
        p = Prompt.of({"prompt": f"{n:04d}" + "z" * 252}, "m")
        assert p is not None
        small.record(p, "a")
    assert small.held_chars("a") == 10 * 256
    small.forget("a")
    assert small.held_chars("a") == 0
    assert small.trim("a", 0) == 0


def test_a_drain_moves_a_conversation_to_the_next_in_its_rank_and_back_never_to_the_draining_one() -> None:
    r = Router(rng=random.Random(7))
    r.update({"m"}, eps("a", "b", "c"), {"m": PREFIX})
    t = _talk(3)
    first, _ = r.route("m", prompt=t)
    assert first is not None
    r.served(first, t)
    r.update({"m"}, eps("a", "b", "c", draining=frozenset({first.replica_id})), {"m": PREFIX})
    moved, route = r.route("m", prompt=t)
    assert moved is not None and moved.replica_id != first.replica_id and route.reason == "hash"
    r.served(moved, t)
    again, route = r.route("m", prompt=t)
    assert again is moved and route.reason == "hit"  # its next turns stay where it moved
    r.update({"m"}, eps("a", "b", "c", draining=frozenset({"a", "b", "c"})), {"m": PREFIX})
    assert r.route("m", prompt=t)[0] is not None  # every replica draining: still served (as by load)


def test_the_prefill_a_replica_was_given_counts_until_its_answer_begins_or_the_request_ends() -> None:
    r = Router(rng=random.Random(7))
    r.update({"m"}, eps("a", "b"), {"m": PREFIX})
    a, b = r.endpoints["m"]
    r.acquire(a, 3000)
    r.acquire(a, 500)
    r.acquire(b)  # routed by load, or all of its prompt held: nothing ahead
    assert r.prefilling == {"a": 3500}
    r.prefilled(a, 3000)  # the first one's answer began
    assert r.prefilling == {"a": 500}
    r.release(a)  # and ended
    r.release(a, 500)  # the second ended without an answer (failed, or its client left)
    r.release(b)
    assert r.prefilling == {} and r.outstanding == {}
    # The work ahead is what the choice weighs: a's own conversation goes to b while a prefills a lot.
    t = _talk(1)
    r.served(a, t)
    assert r.route("m", prompt=t)[0] is a
    r.acquire(a, 10**6)
    ep, route = r.route("m", prompt=t)
    assert ep is b and route.reason == "spill"
