"""Errors of the gateway, by blame. The handler turns each into its HTTP answer; none escapes it."""

from __future__ import annotations

from llmgw.errors import PeerError, UsageError


class UpstreamError(PeerError):
    """A replica's engine failed us."""


class UpstreamUnavailable(UpstreamError):
    """Failed before any byte of the response arrived (refused, reset, timed out): the request
    can safely go to another replica, because the engine produced nothing."""


class UpstreamBroken(UpstreamError):
    """Failed after the response began: the client sees a truncated answer; no retry."""


class ApiKeyError(UsageError):
    """An API key operation the operator asked for cannot be done (duplicate name, unknown key)."""


class ApiKeyExists(ApiKeyError):
    """The name is taken."""


class UnknownApiKey(ApiKeyError):
    """No key has that name."""
