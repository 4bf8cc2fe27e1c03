"""Errors of the llmgw package, split by who has to act.

Every message names the bad value and the fix. Callers never match on message text; they
catch a class. The CLI maps each class to an exit status (see `exit_status`).
"""

from __future__ import annotations


class LlmgwError(Exception):
    """Base class. `str(err)` is the whole message shown to the operator."""

    exit_status = 1


class UsageError(LlmgwError):
    """The command line is wrong: the operator fixes the arguments."""

    exit_status = 2


class ConfigError(LlmgwError):
    """A configuration file is wrong or missing: the operator fixes the file.

    `problems` holds one line per problem, each naming its path in the file, so that one run
    reports every mistake rather than the first.
    """

    exit_status = 2

    def __init__(self, path: str, problems: list[str]) -> None:
        self.path = path
        self.problems = list(problems)
        super().__init__("\n".join(f"{path}: {p}" for p in self.problems))


class MachineError(LlmgwError):
    """This machine lacks something: a file, a permission, a tool. The operator installs or fixes it."""


class PeerError(LlmgwError):
    """The other end (control plane, agent, engine, SSH host) refused or failed."""


SHOWN_CHARS = 100  # of a bad value in a message; the rest is counted, not shown


PATH_CHARS = 200  # of a request's path in a message


def cut(text: str, limit: int = PATH_CHARS) -> str:
    """`text` as it is when short, else its start and how long it was (a path, a method, a name
    in a message: they come from the peer, and may be as long as a request head)."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def shown(value: object, limit: int = SHOWN_CHARS) -> str:
    """`repr(value)` for a message, cut to about `limit` characters: a bad value may be a
    request's whole body, and a message (or the log line it becomes) must not be."""
    if isinstance(value, str) and len(value) > limit:
        return f"{value[:limit]!r}... ({len(value)} characters)"
    text = repr(value)
    if len(text) > limit:
        return f"{text[:limit]}... ({type(value).__name__} of {len(text)} characters as text)"
    return text


def leaves(exc: BaseException) -> list[BaseException]:
    """The exceptions inside (nested) exception groups, or [exc] itself.

    trio nurseries wrap whatever a task raises in an exception group; code that must react to
    one kind of failure looks at the leaves. (`except*` would do this, but nodes run 3.10.)
    """
    group = getattr(exc, "exceptions", None)
    if not isinstance(group, tuple):
        return [exc]
    return [leaf for inner in group for leaf in leaves(inner)]


def find(exc: BaseException, kind: type[BaseException] | tuple[type[BaseException], ...]) -> BaseException | None:
    """The first leaf of `exc` that is an instance of `kind`, if any."""
    return next((e for e in leaves(exc) if isinstance(e, kind)), None)


def only(exc: BaseException, kind: type[BaseException] | tuple[type[BaseException], ...]) -> bool:
    """Whether every leaf of `exc` is an instance of `kind`."""
    return all(isinstance(e, kind) for e in leaves(exc))
