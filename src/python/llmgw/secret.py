"""`Secret`: a value that must never be printed, such as a token in server.toml.

Its home is `llmgw.config` (import it from there); it is defined here, alone, so that
`llmgw.log`, which every process imports and which redacts a Secret wherever one appears, does
not import the whole config (its schema and its cattrs converter: 0.06-0.08 CPU-s) in the
processes that read no config, such as a sim engine or `llmgw ctl`.
"""

from __future__ import annotations

import attrs


@attrs.frozen(repr=False)
class Secret:
    """A value that must never be printed. `reveal()` is the one way to read it."""

    _value: str

    def reveal(self) -> str:
        return self._value

    def __repr__(self) -> str:
        return "Secret('<redacted>')"

    __str__ = __repr__
