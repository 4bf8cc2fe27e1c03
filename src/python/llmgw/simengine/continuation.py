"""Where a completions prompt already holds the start of the sim's own answer: `split`. Pure.

When the replica relaying a streamed answer dies, the gateway asks another replica for the rest
(request migration), sending what the client already received as the start of the answer. For
/v1/completions that is the original prompt P followed by the text T received so far: the first
m pieces of P's answer, as sent (the first without a leading space, so whatever separator P ends
with is P's). The sim answers such a prompt as P, from word m on, so T and the answer join into
the answer P would have had uninterrupted. (Chat says which message is the partial answer; `api`
reads it.)

The search is linear in the prompt: a request must not hold the event loop, and a prompt may be
megabytes. T's pieces after the first are " " and a vocabulary word each, so only the last
MAX_WORDS space-separated segments of the prompt can hold T, and T's first word is a vocabulary
word ending a segment: a few candidate split points, each looked at in a window of the longest
word's length. Their prefixes' keys come from one hash extended from split point to split point
(`text.prompt_hasher`), never from hashing each prefix again. A candidate is dropped at its first
word that is not the answer's, so a prompt that continues nothing costs one hash of the prompt.

Any prompt of that shape is a continuation, the client's own text included: an ordinary prompt
ending in a vocabulary word has about a 1% chance per such word of reading as one, and is then
answered deterministically all the same.
"""

from __future__ import annotations

import attrs

from llmgw.simengine.text import (
    MAX_WORDS,
    WORDS,
    digest_from,
    encode,
    hasher,
    natural_length,
    prompt_digest,
    prompt_hasher,
)

VOCABULARY = frozenset(WORDS)
LENGTHS = sorted({len(w) for w in WORDS})
LONGEST = max(LENGTHS)


@attrs.frozen(kw_only=True)
class Split:
    prompt_key: str  # the whole prompt's key
    answer_key: str  # the key of the prompt the answer is made for: P's, or the whole prompt's
    at: int  # where P ends in the prompt: the prompt's length when it continues nothing
    start: int  # m, the words of P's answer the prompt ends with; 0 when it continues none
    # Candidate prefixes whose key was computed: a segment ends in at most two vocabulary words
    # ("that", "at"), so at most 2 × MAX_WORDS.
    tried: int


@attrs.frozen(kw_only=True)
class _Candidate:
    at: int  # where T would begin: P is prompt[:at]
    first: str  # T's first word
    words: int  # m, T's pieces


def split(model: str, prompt: str, *, ignore_eos: bool = False) -> Split:
    """The prompt as P + T, T the first m pieces of P's answer (`complete(..., ignore_eos)`'s), the
    longest such T; else the whole prompt with m = 0."""
    candidates, tail = _candidates(prompt)
    h, done, tried = prompt_hasher(), 0, 0
    found: tuple[str, int, int] | None = None
    for candidate in candidates:  # the longest T first: the nearest to the prompt's start
        h.update(encode(prompt[done : candidate.at]))
        done = candidate.at
        key = h.copy().hexdigest()
        tried += 1
        if _begins(model, key, candidate, tail, ignore_eos):
            found = key, candidate.at, candidate.words
            break
    h.update(encode(prompt[done:]))
    whole = h.hexdigest()
    answer_key, at, start = found or (whole, len(prompt), 0)
    return Split(prompt_key=whole, answer_key=answer_key, at=at, start=start, tried=tried)


def whole(prompt: str) -> Split:
    """The prompt taken whole, continuing nothing."""
    key = prompt_digest(prompt)
    return Split(prompt_key=key, answer_key=key, at=len(prompt), start=0, tried=0)


def _candidates(prompt: str) -> tuple[list[_Candidate], list[str]]:
    """The places T may begin, the nearest to the prompt's start first, and `tail`: the prompt's
    last segments, each a whole word, the last first. A candidate of m words is its `first`, then
    `tail[m - 2]`, ..., `tail[0]`."""
    found: list[_Candidate] = []
    tail: list[str] = []  # the whole vocabulary words ending the prompt, after a space each, last first
    end = len(prompt)
    while True:
        low = max(0, end - LONGEST - 1)
        space = prompt.rfind(" ", low, end)
        begin = space + 1 if space >= 0 else low  # the segment's start, or as far as a word may reach
        for length in LENGTHS:
            at = end - length
            if at < begin:
                break
            if prompt[at:end] in VOCABULARY:
                found.append(_Candidate(at=at, first=prompt[at:end], words=len(tail) + 1))
        if space < 0 or len(tail) + 2 > MAX_WORDS:
            break  # the prompt's first segment, one longer than a word, or T as long as an answer may be
        segment = prompt[begin:end]
        bare = segment if tail or not segment.endswith(".") else segment[:-1]  # the last may end the answer
        if bare not in VOCABULARY:
            break
        tail.append(segment)
        end = space
    found.reverse()
    return found, tail


def _begins(model: str, key: str, candidate: _Candidate, tail: list[str], ignore_eos: bool) -> bool:
    """Whether T is the first pieces of the answer to the prompt whose key is `key`: its first
    word before anything else, as most candidates fail there."""
    base = hasher(model, key)  # as `text.complete` makes each word

    def word(i: int) -> str:
        return WORDS[digest_from(base, str(i)) % len(WORDS)]

    if word(0) != candidate.first:
        return False
    m = candidate.words
    natural = natural_length(model, key)  # >= MIN_WORDS: the first piece never ends the answer
    if not ignore_eos and m > natural:
        return False
    for i in range(1, m):
        end = "." if not ignore_eos and i == natural - 1 else ""
        if tail[m - 1 - i] != word(i) + end:
            return False
    return True
