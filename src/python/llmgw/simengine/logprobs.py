"""Log probabilities of the sim engine's output tokens, made up deterministically. Pure.

Each token gets a probability p in [0.5, 0.95) from a hash of (model, prompt key, its position):
its logprob is ln p. Its alternatives are other words of the vocabulary (with the token's
leading space, if it has one), the k-th with probability (1 - p) / 2^k, so they fall off, all lie
below the token's own, and with it sum to less than 1. The token itself heads its top list, as
the most likely. Values are rounded to 6 decimals so that libm's last bits, which may differ
between machines, never show.

Shapes: chat's `choices[].logprobs` is `{"content": [entry, ...], "refusal": null}`, an entry
`{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}, ...]}`; legacy
completions' is `{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}`.
A streamed chunk carries the same for its one token.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from llmgw.simengine.text import WORDS, digest_from, hasher

MAX_TOP = 20  # OpenAI's limit on top_logprobs, and vLLM's default max_logprobs

_LN2 = math.log(2)


class Logprobs:
    """The log probabilities of one answer's tokens: `top` alternatives per token."""

    def __init__(self, model: str, prompt_key: str, top: int) -> None:
        self.base = hasher(model, prompt_key, "logprobs")
        self.top = top

    def of(self, index: int, piece: str) -> tuple[float, list[tuple[str, float]]]:
        """The logprob of the token `piece` at `index`, and its top list (itself first)."""
        d = digest_from(self.base, str(index))
        p = 0.5 + (d >> 16) % 4500 / 10000
        logprob = round(math.log(p), 6)
        if not self.top:
            return logprob, []
        rest = math.log(1 - p)
        space = " " if piece.startswith(" ") else ""
        chosen = piece.strip()
        alternatives = [(piece, logprob)]
        k, start = 1, d % len(WORDS)
        for i in range(len(WORDS)):
            if len(alternatives) == self.top:
                break
            word = WORDS[(start + i) % len(WORDS)]
            if word != chosen:
                alternatives.append((space + word, round(rest - k * _LN2, 6)))
                k += 1
        return logprob, alternatives

    def chat_entry(self, index: int, piece: str) -> dict[str, Any]:
        logprob, top = self.of(index, piece)
        return {
            "token": piece,
            "logprob": logprob,
            "bytes": list(piece.encode("utf-8", "surrogatepass")),
            "top_logprobs": [
                {"token": t, "logprob": lp, "bytes": list(t.encode("utf-8", "surrogatepass"))} for t, lp in top
            ],
        }

    def chat(self, pieces: Sequence[str], start: int = 0) -> dict[str, Any]:
        """Chat's `logprobs` for `pieces`, the first at position `start`."""
        return {"content": [self.chat_entry(start + i, p) for i, p in enumerate(pieces)], "refusal": None}

    def completion(self, pieces: Sequence[str], start: int = 0, offset: int = 0) -> dict[str, Any]:
        """Legacy completions' `logprobs` for `pieces`, the first at position `start` and at
        character `offset` of the text."""
        tokens, values, tops, offsets = [], [], [], []
        for i, piece in enumerate(pieces):
            logprob, top = self.of(start + i, piece)
            tokens.append(piece)
            values.append(logprob)
            tops.append(dict(top))
            offsets.append(offset)
            offset += len(piece)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}
