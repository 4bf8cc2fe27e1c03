"""Prefix-aware routing: which replica most likely holds a request's prompt in its cache. Pure:
no I/O, no clock; `llmgw.gateway.routing.Router` asks it, the gateway records what was served.

Engines keep the prompts they processed (llama.cpp's slots and its prompt cache, vLLM's and
SGLang's prefix caches): a conversation's next turn, or another request with the same long system
prompt, is prefilled only from where its text stops matching what the replica holds. So:

- **The prompt in blocks** (`Prompt.of`): a chat request's messages rendered in order (role and
  content, `_render`), a completion's prompt as it is, cut into blocks of `block_chars` bytes of
  its UTF-8 (and where its anchor ends, below); each block's hash covers every block before it
  (a chain), so one number names a whole prefix. After the anchor only whole blocks count (the
  next turn continues the last one), up to `max_blocks`. The hashes are the same in every
  process.
- **What each replica served** (`PrefixTable`): chain -> the replica that last served a prompt
  starting with it, bounded (`entries`, least recently used first out). A lookup walks the
  request's chains from the longest down and gives, per replica, the longest prefix it served.
- **The choice** (`choose`): the candidate with the longest match, unless its outstanding
  requests exceed the bound (`load_bound`: `load_factor` times the least loaded one's, and one
  more), then the next longest, and so on (bounded-load: a hot prefix cannot pile onto one
  replica). With no match within the bound the request gains nothing from any replica's cache,
  so it goes to the least loaded, ties (the usual case when load is even) broken by the
  conversation's own hash (`Prompt.anchor`: the text up to the end of its first user message,
  which every later turn starts with), which ranks the candidates by rendezvous hashing. That
  ranking is a function of the prompt and the replicas alone, the same in every gateway
  process: a conversation whose turns reach different gateways (several workers, several
  gateways behind a load balancer) finds the same replica without their sharing a table,
  unless its first turn found its ranked replica busier than another.

A replica that leaves rotation (`PrefixTable.forget`) has its entries dropped (lazily: each
entry names the replica's generation), so one that comes back, likely restarted with an empty
cache, starts afresh; a new replica has no entries and takes new conversations by the ranking
at once.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import zlib
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import attrs

BLOCK_CHARS = 256
MAX_BLOCKS = 256  # 64 KiB of prompt at the default block: longer prompts match on their start
TABLE_ENTRIES = 200_000  # chains remembered per gateway process (about 30 MiB at most)
LOAD_FACTOR = 1.25
# A completion's prompt has no turns: its first blocks stand for the conversation.
COMPLETION_ANCHOR_BLOCKS = 4

_MASK = (1 << 64) - 1
_PLAIN = frozenset({"role", "content", "name"})  # a message of these alone is rendered as text
# Anything else a message is, rendered by one encoder made once (`json.dumps` with options makes
# one per call: 3-4 µs, 15 ms for a small body of 4,000 numbers as messages).
_ENCODE = json.JSONEncoder(sort_keys=True, ensure_ascii=False, default=str).encode
MAX_MESSAGES = 1024  # rendered at most: a longer conversation is matched on its first ones


def _stable(data: bytes) -> int:
    """A 64-bit hash that is the same in every process (Python's `hash` is salted per process)."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


@attrs.frozen(kw_only=True)
class Prompt:
    """A request's prompt as routing sees it: `chains[i]` names its first i + 1 blocks, which
    end at `ends[i]` (bytes of its rendering); `anchor` its conversation (stable across
    processes), whose text is the first `anchor_blocks` blocks (the last of them may be short:
    blocks are cut so that one ends where the anchor does, and a conversation's next turn has
    the same chains up to there)."""

    chains: tuple[int, ...]
    ends: tuple[int, ...]
    anchor: int
    anchor_blocks: int
    size: int = 0  # bytes of its rendering read (at most `block_chars * max_blocks`)

    def matched_chars(self, blocks: int) -> int:
        """How much of the prompt its first `blocks` blocks are."""
        return self.ends[blocks - 1] if blocks else 0

    @classmethod
    def of(
        cls, body: Any, model: str, *, block_chars: int = BLOCK_CHARS, max_blocks: int = MAX_BLOCKS
    ) -> Prompt | None:
        """The prompt of a chat (`messages`) or completion (`prompt`: a string) request body;
        None when it has neither (nothing to route by)."""
        if not isinstance(body, dict):
            return None
        limit = block_chars * max_blocks
        messages = body.get("messages")
        if isinstance(messages, list):
            text, anchor_end = _render(messages, limit)
        else:
            prompt = body.get("prompt")
            if not isinstance(prompt, str):
                return None
            text = prompt[:limit].encode()
            anchor_end = block_chars * COMPLETION_ANCHOR_BLOCKS
        text = text[:limit]
        anchor_end = min(anchor_end, len(text))
        ends = [*range(block_chars, anchor_end, block_chars), anchor_end] if anchor_end else []
        anchor_blocks = len(ends)
        ends += range(anchor_end + block_chars, len(text) + 1, block_chars)
        # Running checksums of the text so far, one pair per block end: C-speed (15 us for 8 KiB
        # in 32 blocks against 39 for BLAKE2b) and the same in every process, so a JSON worker
        # may compute them. Not for security: a collision costs a cache miss, at most.
        head = model.encode() + b"\0"
        crc, adler = zlib.crc32(head), zlib.adler32(head)
        chains = []
        data, start = memoryview(text), 0
        for end in ends:
            crc, adler = zlib.crc32(data[start:end], crc), zlib.adler32(data[start:end], adler)
            chains.append(crc << 32 | adler)
            start = end
        anchor = chains[anchor_blocks - 1] if anchor_blocks else crc << 32 | adler
        return cls(chains=tuple(chains), ends=tuple(ends), anchor=anchor, anchor_blocks=anchor_blocks, size=len(text))


def _render(messages: list, limit: int) -> tuple[bytes, int]:
    """Chat messages as one text, in order (a role and its content a message; anything else a
    message carries, such as tool calls, as sorted JSON), stopped once past `limit` bytes; and
    where the first user message ends in it (the conversation's anchor)."""
    parts: list[bytes] = []
    size = 0
    anchor_end = -1
    for message in itertools.islice(messages, MAX_MESSAGES):
        if isinstance(message, dict):
            content = message.get("content")
            if isinstance(content, str) and message.keys() <= _PLAIN:
                part = f"{message.get('role')}:{message.get('name', '')}\n{content}\x1e".encode()
            else:
                part = _ENCODE(message).encode() + b"\x1e"
            is_user = message.get("role") == "user"
        else:
            part = _ENCODE(message).encode() + b"\x1e"
            is_user = False
        parts.append(part)
        size += len(part)
        if is_user and anchor_end < 0:
            anchor_end = size
        if size >= limit:
            break
    return b"".join(parts), (anchor_end if anchor_end >= 0 else size)


class PrefixTable:
    """Which replica last served each prompt chain, bounded to `entries` (least recently
    used out first). Replicas are named by id; `forget` drops one's entries. Each entry counts
    the bytes of prompt its block adds (`held_chars`: how much prompt a replica is taken to
    hold), so a replica whose engine says it holds less can be trimmed to that (`trim`)."""

    def __init__(self, entries: int = TABLE_ENTRIES) -> None:
        self.entries = entries
        self._table: OrderedDict[int, tuple[str, int, int]] = OrderedDict()  # chain -> replica, generation, bytes
        self._generation: dict[str, int] = {}
        self._chars: dict[str, int] = {}  # replica -> bytes its current entries stand for

    def __len__(self) -> int:
        return len(self._table)

    def held_chars(self, replica_id: str) -> int:
        """How many bytes of prompt `replica_id` is taken to hold (each shared block once)."""
        return self._chars.get(replica_id, 0)

    def _lose(self, entry: tuple[str, int, int]) -> None:
        rid, gen, size = entry
        if self._generation.get(rid, 0) == gen:
            self._chars[rid] -= size

    def record(self, prompt: Prompt, replica_id: str) -> None:
        """`replica_id` served `prompt`: it holds every prefix of it now."""
        gen = self._generation.get(replica_id, 0)
        table, chars, lose = self._table, self._chars, self._lose
        ends = prompt.ends
        added = 0
        # The longest first: the shorter prefixes, which more prompts share, are the most
        # recently used and the last to go.
        for i in range(len(ends) - 1, -1, -1):
            chain = prompt.chains[i]
            size = ends[i] - (ends[i - 1] if i else 0)
            before = table.get(chain)
            if before is not None:
                lose(before)
            table[chain] = (replica_id, gen, size)
            table.move_to_end(chain)
            added += size
        chars[replica_id] = chars.get(replica_id, 0) + added
        while len(table) > self.entries:
            lose(table.popitem(last=False)[1])

    def forget(self, replica_id: str) -> None:
        """`replica_id` left rotation: what it held counts no more (if it comes back, it is
        assumed to hold nothing)."""
        self._generation[replica_id] = self._generation.get(replica_id, 0) + 1
        self._chars.pop(replica_id, None)

    def drop(self, prompt_chains: Sequence[int], replica_id: str) -> int:
        """The engine says `replica_id` no longer holds these prefixes (its own report of its
        cache): entries naming it for them are removed; how many."""
        dropped = 0
        for chain in prompt_chains:
            entry = self._table.get(chain)
            if entry is not None and entry[0] == replica_id:
                self._lose(entry)
                del self._table[chain]
                dropped += 1
        return dropped

    def trim(self, replica_id: str, max_chars: int, *, scan: int = 20_000) -> int:
        """`replica_id` holds at most `max_chars` bytes of prompt (its engine says so): its least
        recently used entries go until what it is taken to hold fits. At most `scan` entries
        are looked at (the table's oldest first, every replica's): a call bounded in time
        trims what it can and the next one goes on. How many entries went."""
        excess = self._chars.get(replica_id, 0) - max(0, max_chars)
        if excess <= 0:
            return 0
        gen = self._generation.get(replica_id, 0)
        doomed = []
        for chain, (rid, g, size) in itertools.islice(self._table.items(), scan):
            if rid == replica_id and g == gen:
                doomed.append(chain)
                excess -= size
                if excess <= 0:
                    break
        for chain in doomed:
            self._lose(self._table.pop(chain))
        return len(doomed)

    def matches(self, prompt: Prompt, replica_ids: Sequence[str]) -> dict[str, int]:
        """The longest prefix each of `replica_ids` served, in blocks (absent: none)."""
        wanted = set(replica_ids)
        found: dict[str, int] = {}
        table, generation = self._table, self._generation
        chains = prompt.chains
        for i in range(len(chains) - 1, -1, -1):
            entry = table.get(chains[i])
            if entry is None:
                continue
            rid, gen, _ = entry
            if rid in wanted and rid not in found and generation.get(rid, 0) == gen:
                found[rid] = i + 1
                if len(found) == len(wanted):
                    break
        return found


@attrs.frozen(kw_only=True)
class Choice:
    """Which candidate (`index`), how many characters of the prompt it is known to hold
    (`matched_chars`), and why: "hit" (the replica holding the most of this conversation),
    "spill" (the one holding it was over the load bound, or the replica its rank names first was
    busier than another: that other took it), "hash" (no replica holds this conversation: its
    rendezvous rank chose among the least loaded)."""

    index: int
    matched_chars: int
    reason: str


def load_bound(least: int, factor: float) -> float:
    """The most outstanding requests a replica may have and still be chosen for its cache or
    its rank: `factor` times the least loaded candidate's, and one more."""
    return least * factor + 1


def rank(anchor: int, replica_keys: Sequence[int]) -> list[int]:
    """The candidates' indexes in the conversation's rendezvous order (highest score first):
    the same in every process for the same anchor and replicas, and a replica joining or
    leaving moves only the conversations that rank it (or ranked it) first."""
    scores = [(_mix(anchor ^ key), i) for i, key in enumerate(replica_keys)]
    scores.sort(reverse=True)
    return [i for _, i in scores]


def replica_key(replica_id: str) -> int:
    """A replica's number for `rank` (stable across processes)."""
    return _stable(replica_id.encode())


def _mix(x: int) -> int:
    """A 64-bit finaliser (splitmix64's): every input bit moves every output bit."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK
    return x ^ (x >> 31)


def choose(
    prompt: Prompt,
    replica_ids: Sequence[str],
    replica_keys: Sequence[int],
    loads: Sequence[int],
    table: PrefixTable,
    *,
    load_factor: float = LOAD_FACTOR,
    prefilling: Sequence[int] | None = None,
) -> Choice:
    """The candidate for `prompt`; `loads` are the candidates' outstanding requests,
    `replica_keys` their `replica_key`s, `prefilling` the bytes of prompt each has been sent and
    not yet begun answering (absent: none).

    A conversation some candidate holds (what it served covers the prompt's anchor, the system
    prompt and the first user message): among the candidates within the load bound, the one
    where the prompt's first token comes soonest by the work ahead of it, the prompts it is
    prefilling and the part of this prompt it does not hold (`Prompt.size` less what it served of
    this conversation); among equals the less loaded. A conversation held nowhere: the least
    loaded (least outstanding), among equals the one with the least prefill ahead. Remaining
    ties go by the conversation's rank (`rank` of its anchor: the same in every gateway process,
    so with nothing recorded, as in a gateway that did not serve the conversation, every process
    sends it to the same replica while loads are even).

    A match short of the anchor is text other conversations share (a common system prompt):
    following it would pile every conversation with that system prompt onto the first replica
    that served one, and another gateway, which served them elsewhere, would choose
    differently, sending a conversation's turns back and forth; so it counts for nothing here,
    and each replica prefills a shared system prompt once.

    Why the work and not the match alone: a conversation's replica busy prefilling another's
    long first turn would make this turn wait for all of it, while another replica might
    prefill the whole conversation sooner (measured with one-thread llama.cpp replicas, two
    requests at a time: the longest waits were turns behind another's first turn)."""
    bound = load_bound(min(loads), load_factor)
    matched = table.matches(prompt, replica_ids)
    own = {rid for rid, got in matched.items() if got >= prompt.anchor_blocks}
    size = prompt.size
    best: tuple[int, int] | None = None
    tied: list[int] = []
    for i, rid in enumerate(replica_ids):
        load = loads[i]
        if load > bound:
            continue
        ahead = prefilling[i] if prefilling else 0
        if own:
            held = prompt.matched_chars(matched[rid]) if rid in own else 0
            key = (ahead + size - held, load)
        else:  # held nowhere: least outstanding, then the least prefill ahead
            key = (load, ahead)
        if best is None or key < best:
            best, tied = key, [i]
        elif key == best:
            tied.append(i)
    if not tied:
        raise AssertionError("the least loaded candidate is within any bound")
    anchor = prompt.anchor
    chosen = tied[0] if len(tied) == 1 else max(tied, key=lambda i: _mix(anchor ^ replica_keys[i]))
    rid = replica_ids[chosen]
    if rid in own:
        reason = "hit"
    elif own:
        reason = "spill"  # held elsewhere: over the bound, or more prefill ahead there than all of it here
    else:  # held nowhere: "hash" when its rank's first choice took it
        first = max(range(len(replica_keys)), key=lambda i: _mix(anchor ^ replica_keys[i]))
        reason = "hash" if chosen == first else "spill"
    return Choice(index=chosen, matched_chars=prompt.matched_chars(matched.get(rid, 0)), reason=reason)
