"""What the sim engine says: deterministic text, and how tokens are counted. Pure.

A token is a word. The prompt is counted by splitting on whitespace; the completion is a
sequence of words chosen by hashing (model, prompt key, position), so the same request gets the
same answer on every run, every machine and every CPython, and a larger `max_tokens` extends
the same text rather than starting another. Each prompt also has a natural length of
`MIN_WORDS`..`MAX_WORDS` words, after which the answer ends by itself (finish_reason "stop")
unless `ignore_eos` asks for exactly `max_tokens`.

An answer may start further on (`start`): the continuation of a partial answer a request carries
(`continuation`). Word i is the same word whatever the start, and only the first word of the
whole answer lacks a leading space, so a partial answer of k words and the answer from word k
join into the uninterrupted text.

An answer may instead be tool calls (`ToolCall`, decided by `structured`): their arguments are
pieces too, and count as output tokens as the words of a text answer do.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import attrs

MIN_WORDS = 16
MAX_WORDS = 128

# Short, common, and free of characters that need escaping in JSON.
WORDS = (
    "the a of and to in is it that for on with as was at by be this from or an are not have but "
    "one all they we which their can there more when will would so what about if out up into time "
    "has two some could them see other than then now only its over also after use how our first "
    "well way even new want because any these give day most us model token cluster node engine "
    "replica gateway fabric sim river stone light cloud paper quiet green north signal answer"
).split()


@attrs.frozen(kw_only=True)
class ToolCall:
    id: str  # "call_" and 24 hex digits, a function of the request
    name: str
    arguments: tuple[str, ...]  # the arguments' JSON text, one piece per output token

    @property
    def arguments_text(self) -> str:
        return "".join(self.arguments)


@attrs.frozen(kw_only=True)
class Completion:
    pieces: tuple[str, ...]  # one per output token, each with its leading space
    # "stop" (natural end or a stop sequence), "length" (max_tokens) or "tool_calls"
    finish_reason: str
    tool_calls: tuple[ToolCall, ...] = ()  # when there are any, `pieces` is empty

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    @property
    def tokens(self) -> int:
        return len(self.pieces) + sum(len(call.arguments) for call in self.tool_calls)


def count_tokens(text: str) -> int:
    return len(text.split())


def encode(text: str) -> bytes:
    return text.encode("utf-8", "surrogatepass")


def prompt_hasher():
    """The hash whose hex digest is a prompt key, to extend with a canonical prompt (`encode`d):
    extended piece by piece, it gives each prefix's key as it goes (`continuation`)."""
    return hashlib.blake2b(digest_size=16)


def prompt_digest(canonical: str) -> str:
    """The prompt key of a canonical prompt: fixed-size, so what the answer costs does not grow
    with the prompt."""
    h = prompt_hasher()
    h.update(encode(canonical))
    return h.hexdigest()


def hasher(*parts: str):
    """A hash of `parts` to extend with `digest_from`: what every deterministic choice derives from."""
    h = hashlib.blake2b(digest_size=8)
    for part in parts:
        h.update(encode(part))
        h.update(b"\0")
    return h


def digest_from(base, *parts: str) -> int:
    h = base.copy()
    for part in parts:
        h.update(encode(part))
        h.update(b"\0")
    return int.from_bytes(h.digest(), "big")


def _digest(*parts: str) -> int:
    return int.from_bytes(hasher(*parts).digest(), "big")


def natural_length(model: str, prompt_key: str) -> int:
    return MIN_WORDS + _digest(model, prompt_key, "length") % (MAX_WORDS - MIN_WORDS + 1)


def word(model: str, prompt_key: str, index: int) -> str:
    return WORDS[_digest(model, prompt_key, str(index)) % len(WORDS)]


def complete(
    model: str,
    prompt_key: str,
    max_tokens: int,
    stop: Sequence[str] = (),
    ignore_eos: bool = False,
    start: int = 0,
) -> Completion:
    """The answer to a prompt from word `start` on: at most `max_tokens` words, cut before the
    first stop sequence. An answer whose natural end is at or before `start` is empty ("stop")."""
    natural = natural_length(model, prompt_key)
    end = start + max_tokens if ignore_eos else max(start, min(start + max_tokens, natural))
    base = hasher(model, prompt_key)  # hashed once, copied for each word
    pieces = [("" if i == 0 else " ") + WORDS[digest_from(base, str(i)) % len(WORDS)] for i in range(start, end)]
    if end == natural and not ignore_eos and pieces:
        pieces[-1] += "."
    reason = "length" if end < natural or ignore_eos else "stop"
    cut = cut_at_stop(pieces, stop)
    if cut is not None:
        return Completion(pieces=cut, finish_reason="stop")
    return Completion(pieces=tuple(pieces), finish_reason=reason)


def cut_at_stop(pieces: Sequence[str], stop: Sequence[str]) -> tuple[str, ...] | None:
    """The pieces before the earliest stop sequence (which is not included), or None."""
    text = "".join(pieces)
    found = [i for i in (text.find(s) for s in stop if s) if i >= 0]
    if not found:
        return None
    end, kept, at = min(found), [], 0
    for piece in pieces:
        if at >= end:
            break
        kept.append(piece[: end - at])
        at += len(piece)
    return tuple(kept)
