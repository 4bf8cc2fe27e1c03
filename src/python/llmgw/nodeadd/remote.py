"""Remote commands for `llmgw node add`, built from argv and quoted, never from strings.

A remote shell parses whatever it is sent, so everything sent is built here: `command(argv)`
quotes each word with POSIX shell quoting, so a hostname, a path or a node id holding `;`,
`$(...)`, backticks, quotes or newlines is passed as one literal word and runs nothing.
`sudo_command` adds `sudo -n` (never prompt: a password prompt over a non-interactive session
would hang) unless the login is already root.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence

from llmgw.errors import UsageError


def command(argv: Sequence[str]) -> str:
    if not argv:
        raise ValueError("an empty command")  # a bug in the caller
    for word in argv:
        if "\x00" in word:
            raise UsageError(f"{word!r} contains a NUL byte, which no remote command can carry")
    return " ".join(shlex.quote(word) for word in argv)


def sudo_command(argv: Sequence[str], *, user: str) -> str:
    return command(argv if user == "root" else ["sudo", "-n", "--", *argv])


def pipeline(*commands: Sequence[str]) -> str:
    """Several commands run one after the other, stopping at the first failure (`&&`)."""
    return " && ".join(command(c) for c in commands)
