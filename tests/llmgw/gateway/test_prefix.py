"""llmgw.gateway.prefix: the prompt in blocks, the table of what each replica served, the
bounded-load choice. Pure: no sockets, no clock."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter

from llmgw.gateway.prefix import MAX_MESSAGES, Choice, PrefixTable, Prompt, choose, load_bound, rank, replica_key

SYSTEM = "You are a careful assistant. " * 40  # 1,160 characters: four whole blocks and more
IDS = ["r-a", "r-b", "r-c"]
KEYS = [replica_key(r) for r in IDS]


def chat(*turns: str, system: str = SYSTEM) -> dict:
    messages = [{"role": "system", "content": system}]
    for n, text in enumerate(turns):
        messages.append({"role": "user" if n % 2 == 0 else "assistant", "content": text})
    return {"model": "m", "messages": messages}


def prompt(body: dict, **kw) -> Prompt:
    got = Prompt.of(body, "m", **kw)
    assert got is not None
    return got


def test_a_conversations_next_turn_starts_with_every_block_of_the_last() -> None:
    first = prompt(chat("What is a rope? " * 10))
    second = prompt(chat("What is a rope? " * 10, "A rope is a cord. " * 20, "And a knot?"))
    assert len(first.chains) >= 5
    assert second.chains[: len(first.chains)] == first.chains
    assert len(second.chains) > len(first.chains)
    assert first.anchor == second.anchor  # the same conversation: system prompt and first question
    other = prompt(chat("What is a knot? " * 10))
    assert other.chains[:4] == first.chains[:4]  # the shared system prompt's whole blocks
    assert other.chains[5:] != first.chains[5 : len(other.chains)]
    assert other.anchor != first.anchor


def test_blocks_end_where_the_anchor_does_then_only_whole_ones_count_up_to_max_blocks() -> None:
    assert prompt({"prompt": "x" * 255}).ends == (255,)  # all anchor (a completion's first 4 blocks)
    assert prompt({"prompt": "x" * 2000}).ends == (256, 512, 768, 1024, 1280, 1536, 1792)
    talk = chat("Why? " * 30)  # the anchor ends at 1,326: a block of its own from 1,280
    anchor_end = prompt(talk).ends[prompt(talk).anchor_blocks - 1]
    assert anchor_end % 256 and prompt(talk).ends[: prompt(talk).anchor_blocks - 1] == (256, 512, 768, 1024, 1280)
    assert len(prompt({"prompt": "x" * 10_000}, block_chars=100, max_blocks=7).chains) == 7
    # Blocks are of the UTF-8: a character of 3 bytes counts 3.
    assert prompt({"prompt": "€" * 86}).ends == (256, 258)  # 86 characters, 258 bytes


def test_the_model_and_every_byte_of_the_prefix_are_in_the_chain() -> None:
    base = prompt({"prompt": "a" * 512})
    assert Prompt.of({"prompt": "a" * 512}, "other") != base
    changed = prompt({"prompt": "a" * 300 + "b" + "a" * 211})
    assert changed.chains[0] == base.chains[0] and changed.chains[1] != base.chains[1]


def test_what_is_not_a_prompt_gives_none_and_odd_messages_still_render() -> None:
    assert Prompt.of({"input": "x"}, "m") is None
    assert Prompt.of({"prompt": ["a", "b"]}, "m") is None
    assert Prompt.of([1, 2], "m") is None
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi " * 200}]}, "odd", 3]}
    assert len(prompt(parts).chains) >= 2
    tools = {"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}] * 30}
    assert len(prompt(tools).chains) >= 2


def test_the_prompt_and_rank_are_the_same_in_another_process() -> None:
    """Python salts `hash` per process; the chains, the conversation's anchor and the ranking
    must not be: two gateways send a conversation to the same replica without sharing a table,
    and a JSON worker process computes the chains of a large body."""
    body = chat("Where does the river go? " * 8)
    here = prompt(body)
    code = (
        "import json, sys; from llmgw.gateway.prefix import Prompt, rank, replica_key; "
        "p = Prompt.of(json.loads(sys.argv[1]), 'm'); "
        "print(json.dumps([p.chains, p.anchor, rank(p.anchor, [replica_key(r) for r in sys.argv[2:]])]))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(
        [sys.executable, "-c", code, json.dumps(body), *IDS], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == [list(here.chains), here.anchor, rank(here.anchor, KEYS)]


def test_the_table_gives_each_replicas_longest_served_prefix() -> None:
    table = PrefixTable()
    short = prompt(chat("q " * 100))
    long = prompt(chat("q " * 100, "a " * 300, "q2"))
    table.record(short, "r-a")
    table.record(long, "r-b")  # the shared blocks now name r-b, the latest to serve them
    got = table.matches(long, IDS)
    assert got == {"r-b": len(long.chains)}
    table.record(short, "r-a")
    got = table.matches(long, IDS)
    assert got == {"r-a": len(short.chains), "r-b": len(long.chains)}
    assert table.matches(long, ["r-c"]) == {}


def test_the_table_is_bounded_least_recently_used_out_first() -> None:
    table = PrefixTable(entries=10)
    old = prompt({"prompt": "o" * 256 * 4})
    new = prompt({"prompt": "n" * 256 * 8})
    table.record(old, "r-a")
    table.record(new, "r-b")
    assert len(table) == 10
    assert table.matches(old, IDS) == {"r-a": 2}  # its two oldest blocks went first
    table.record(old, "r-a")  # used again: the newest
    table.record(prompt({"prompt": "z" * 256 * 4}), "r-c")
    assert table.matches(old, IDS) == {"r-a": 4}
    assert len(table) == 10


def test_a_replica_that_leaves_has_its_entries_dropped_and_comes_back_empty() -> None:
    table = PrefixTable()
    p = prompt(chat("question " * 50))
    table.record(p, "r-a")
    table.forget("r-a")
    assert table.matches(p, IDS) == {}
    table.record(p, "r-a")  # served again after it came back
    assert table.matches(p, IDS) == {"r-a": len(p.chains)}
    assert table.drop(p.chains[2:], "r-b") == 0  # another's report drops nothing of r-a's
    assert table.drop(p.chains[2:], "r-a") == len(p.chains) - 2  # its engine no longer holds these
    assert table.matches(p, IDS) == {"r-a": 2}


def test_the_next_turn_goes_where_the_conversation_is_while_that_replica_is_within_the_bound() -> None:
    table = PrefixTable()
    first = prompt(chat("Tell me of ropes. " * 10))
    second = prompt(chat("Tell me of ropes. " * 10, "Ropes are cords. " * 30, "And knots?"))
    taken = choose(first, IDS, KEYS, [0, 0, 0], table)
    assert taken.reason == "hash" and taken.matched_chars == 0
    where = taken.index
    table.record(first, IDS[where])
    loads = [2, 2, 2]
    loads[where] = 3  # busier than the others, within the bound (2 * 1.25 + 1)
    then = choose(second, IDS, KEYS, loads, table)
    assert (then.index, then.reason, then.matched_chars) == (where, "hit", first.ends[-1])
    loads[where] = 4  # over the bound: another replica takes it
    spilled = choose(second, IDS, KEYS, loads, table)
    assert spilled.index != where and spilled.reason == "spill" and spilled.matched_chars == 0


def test_a_shared_system_prompt_alone_does_not_pull_conversations_to_one_replica() -> None:
    """Conversations sharing a system prompt but not their first question go by their rank,
    whichever replica served the system prompt first: spread, and the same in any gateway."""
    table = PrefixTable()
    table.record(prompt(chat("The first question. " * 5)), "r-a")
    chosen = Counter()
    for n in range(300):
        p = prompt(chat(f"Question number {n}. " * 5))
        c = choose(p, IDS, KEYS, [0, 0, 0], table)
        assert c.reason == "hash" and c.index == rank(p.anchor, KEYS)[0]
        chosen[c.index] += 1
    assert min(chosen.values()) > 70  # about 100 each


def test_one_hot_conversation_cannot_pile_onto_its_replica() -> None:
    table = PrefixTable()
    hot = prompt(chat("The hot question. " * 20))
    table.record(hot, "r-a")
    loads = [0, 0, 0]
    for _ in range(30):  # thirty requests of it outstanding at once
        c = choose(hot, IDS, KEYS, loads, table)
        loads[c.index] += 1
    assert max(loads) <= load_bound(min(loads), 1.25) + 1  # the bound holds at each choice, before its +1
    assert max(loads) / min(loads) <= 1.5  # 11/9/10 or so, not 30/0/0


def test_a_new_replica_takes_new_conversations_at_once_and_a_leaving_one_moves_only_its_own() -> None:
    anchors = [prompt(chat(f"Conversation {n}. " * 4)).anchor for n in range(600)]
    before = {a: IDS[rank(a, KEYS)[0]] for a in anchors}
    grown = [*IDS, "r-d"]
    after = {a: grown[rank(a, [*KEYS, replica_key("r-d")])[0]] for a in anchors}
    moved = [a for a in anchors if before[a] != after[a]]
    assert all(after[a] == "r-d" for a in moved)  # only to the newcomer
    assert 100 < len(moved) < 200  # about a quarter
    shrunk = ["r-a", "r-c"]
    gone = {a: shrunk[rank(a, [KEYS[0], KEYS[2]])[0]] for a in anchors}
    assert all(gone[a] == before[a] for a in anchors if before[a] != "r-b")


def test_a_conversation_of_many_messages_is_read_as_far_as_its_first_max_messages() -> None:
    """Bounded work per body: 4,000 numbers as messages (a small body, parsed on the loop) cost
    15 ms to render one by one with `json.dumps`; they are rendered by one encoder, and no
    further than MAX_MESSAGES."""
    many = list(range(4000))
    assert prompt({"messages": many}).chains == prompt({"messages": many[:MAX_MESSAGES]}).chains
    assert prompt({"messages": many}).chains != prompt({"messages": many[: MAX_MESSAGES - 1]}).chains


def test_a_conversation_held_nowhere_goes_to_the_least_loaded_by_its_rank_among_them() -> None:
    table = PrefixTable()
    p = next(t for t in (prompt(chat(f"New {n}. " * 5)) for n in range(100)) if rank(t.anchor, KEYS)[0] == 0)
    order = rank(p.anchor, KEYS)
    assert choose(p, IDS, KEYS, [3, 3, 3], table) == Choice(index=order[0], matched_chars=0, reason="hash")
    # Its ranked replica busy, another idle: waiting would gain it nothing, so the idle one.
    busy = [0, 0, 0]
    busy[order[0]] = 1
    taken = choose(p, IDS, KEYS, busy, table)
    assert taken.index == order[1] and taken.reason == "spill"


def test_a_turn_waits_for_its_replica_unless_the_prefill_ahead_there_is_more_than_the_whole_prompt() -> None:
    """The conversation's replica (r-a) holds all but its last turn. A short prefill ahead of it
    there is still sooner than the whole prompt elsewhere; another conversation's long first
    turn is not."""
    table = PrefixTable()
    first = prompt(chat("The first question. " * 20))
    table.record(first, "r-a")
    later = prompt(chat("The first question. " * 20, "An answer. " * 10, "Go on."))
    new = later.size - first.ends[-1]  # what r-a lacks of it
    assert 0 < new < later.size
    held = choose(later, IDS, KEYS, [1, 0, 0], table, prefilling=[later.size - new - 1, 0, 0])
    assert held == Choice(index=0, matched_chars=first.ends[-1], reason="hit")
    moved = choose(later, IDS, KEYS, [1, 0, 0], table, prefilling=[later.size, 0, 0])
    assert moved.index != 0 and moved.reason == "spill" and moved.matched_chars == 0
    # Between two without the conversation, the one with less prefill ahead.
    assert choose(later, IDS, KEYS, [1, 1, 1], table, prefilling=[10**6, 5, 7]).index == 1
