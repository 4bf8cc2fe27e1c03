"""Errors of the sim engine, by blame. A replica fails as a whole: every `ReplicaFailed` ends
the process with status 3, so whoever supervises it (the agent) restarts the replica. A request
the engine cannot answer is the client's: `SchemaRefused` becomes a 400."""

from __future__ import annotations

from llmgw.errors import PeerError


class ReplicaFailed(PeerError):
    """This member cannot go on, so the replica it belongs to has failed."""

    exit_status = 3


class MemberLost(ReplicaFailed):
    """Another member of the replica died, hung or hung up after joining."""


class RendezvousFailed(ReplicaFailed):
    """The members did not all meet: rank 0 unreachable, a worker refused, or time ran out."""


class SimulatedCrash(ReplicaFailed):
    """`--fail-after-s` elapsed: the crash a test asked for."""


class SchemaRefused(ValueError):
    """A request's JSON schema asks for something the sim engine cannot produce (a keyword it
    does not support, bounds no value meets, nesting with no end). The client's fault, or the
    sim's limit: `structured` answers 400 naming the request parameter the schema came from.
    `message` names the keyword and where it is in the schema (a JSON pointer). `lasting`:
    the same schema is refused wherever it is met (False: only there, e.g. too deep)."""

    def __init__(self, message: str, *, lasting: bool = True) -> None:
        self.message = message
        self.lasting = lasting
        super().__init__(message)
