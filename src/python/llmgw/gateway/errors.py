"""Errors of the gateway, by blame. The handler turns each into its HTTP answer; none escapes it."""

from __future__ import annotations

from llmgw.errors import PeerError


class UpstreamError(PeerError):
    """A replica's engine failed us."""


class UpstreamUnavailable(UpstreamError):
    """Failed before any byte of the response arrived (refused, reset, timed out): the request
    can safely go to another replica, because the engine produced nothing."""


class UpstreamSilent(UpstreamUnavailable):
    """Nothing came back in time: a connect or data unacknowledged that timed out, an address
    unreachable. Another connection to the same address would fare no better."""


class UpstreamNoFirstByte(UpstreamSilent):
    """The engine took the request but sent no response head within the first-byte timeout,
    and a probe of it failed too (or the read timeout passed)."""


class UpstreamBroken(UpstreamError):
    """Failed after the response began. Retried elsewhere only while nothing of it went to the
    client (a body read whole); a stream already relayed is cut short."""


class UpstreamTooLarge(UpstreamError):
    """An answer larger than the gateway buffers: 502, not retried (another replica would
    answer the same) and no fault of the replica's health."""
