"""Errors of llmgw.sizing, by who has to act.

`NeedMore` is not a fault: the prefix given ends before the header does, and the caller fetches
more of the file (an HTTP Range request from offset 0) and asks again. The others blame the
model file or the config that came with it: the operator replaces the file or fixes the config.
"""

from __future__ import annotations

from llmgw.errors import LlmgwError


class NeedMore(Exception):
    """The header goes on past the bytes given: fetch at least `needed` bytes from the file's start
    and parse again. The hint is a lower bound (a length read further on may ask for more), one
    field on: over a network fetch max(needed, 2 * have) to take few round trips."""

    def __init__(self, needed: int, have: int) -> None:
        self.needed = needed
        self.have = have
        super().__init__(f"the GGUF header needs at least {needed} bytes from the file's start; {have} were given")


class SizingError(LlmgwError):
    """The model's files cannot be sized: the operator fixes or replaces the named file or setting."""

    exit_status = 2


class NotGguf(SizingError):
    """The file does not start with GGUF's magic: it is another format, or not a model at all."""


class UnsupportedGguf(SizingError):
    """A GGUF this parser does not read: version 1, or a ggml type it does not know."""


class MalformedGguf(SizingError):
    """The header contradicts itself: a bad value type, a tensor of impossible shape, bad UTF-8."""


class GgufLimitExceeded(SizingError):
    """A count or length in the header is beyond a limit of `GgufLimits`: the file is hostile or
    broken, or the limit is too small for it (raise that limit)."""

    def __init__(self, limit: str, value: int, maximum: int, where: str) -> None:
        self.limit = limit
        self.value = value
        self.maximum = maximum
        super().__init__(
            f"{where}: {value} is over GgufLimits.{limit} ({maximum}); the file is broken or hostile, "
            f"or raise {limit} if it is a real model"
        )


class MissingMetadata(SizingError):
    """A key sizing needs is absent (from GGUF metadata or config.json): the file is not a model
    this estimate knows how to size, or its metadata is incomplete."""
