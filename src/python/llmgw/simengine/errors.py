"""Errors of the sim engine, by blame. A replica fails as a whole: every `ReplicaFailed` ends
the process with status 3, so whoever supervises it (the agent) restarts the replica."""

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
