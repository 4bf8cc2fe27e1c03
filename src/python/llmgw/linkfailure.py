"""Why a session of a link to the control plane ended (an agent's, a gateway's), in the
operator's words and with the fix: the control plane's refusal as it said it, else what failed
on the way (TLS, TCP, a deadline). Said by the dialling end's runtime (`llmgw.linkclient`), for
an agent's link and a gateway's alike."""

from __future__ import annotations

import trio
import trio_websocket

from llmgw.errors import find, leaves, only
from llmgw.log import get_logger
from llmgw.pki.tlsdiag import Side, describe_tls_failure

log = get_logger("llmgw.link")


class SessionRefused(Exception):
    """The control plane (or TLS) refused this agent or gateway, or the session broke in a way
    it can name; `reason` says why and what to do."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(reason)


class Redirected(SessionRefused):
    """A control plane that does not lead answered with where the leader is: `leader`, a wss://
    URL, or "" when it knows of none now."""

    def __init__(self, leader: str, message: str) -> None:
        self.leader = leader
        super().__init__(message)


def reason_of(exc: BaseException, where: str, *, connect_timeout_s: float, side: Side = "client") -> str:
    """One line for `exc`, which ended a session with the control plane at `where`; `side`:
    "client" for an agent, "gateway" for a gateway (`llmgw.pki.tlsdiag`)."""
    refused = find(exc, SessionRefused)
    if refused is not None:
        return refused.reason
    rejected = find(exc, trio_websocket.ConnectionRejected)
    if rejected is not None:
        body = (rejected.body or b"").decode("utf-8", "replace").strip()
        who = "gateway" if side == "gateway" else "node"
        return f"the control plane refused this {who} (HTTP {rejected.status_code}): {body}"
    closed = find(exc, trio_websocket.ConnectionClosed)
    if closed is not None and describe_tls_failure(exc, side=side) is None:
        return f"the link closed: {closed.reason}"
    if only(
        exc,
        (
            OSError,
            trio.BrokenResourceError,
            trio.ClosedResourceError,
            trio.TooSlowError,
            trio_websocket.HandshakeError,
            trio_websocket.ConnectionClosed,
        ),
    ):
        return describe_failure(exc, where, connect_timeout_s, side)
    log.exception("link_failed_unexpectedly", server=where)
    return f"unexpected failure: {leaves(exc)[0]!r} (a bug in llmgw; the log above has the traceback)"


def describe_failure(exc: BaseException, where: str, connect_timeout_s: float, side: Side = "client") -> str:
    """One line for the operator: what failed (dialling `where`) and what to do."""
    tls = describe_tls_failure(exc, side=side)
    if tls:
        return tls
    root = _root_cause(exc)
    if isinstance(root, ConnectionRefusedError):
        return f"nothing listens at {where}: is `llmgw server` running there, and agent_listen set to this port?"
    if isinstance(root, trio.TooSlowError):
        return f"no answer from {where} within {connect_timeout_s:g} s: check the address, routes and firewalls"
    if isinstance(root, OSError):
        return f"cannot reach {where}: {root.strerror or root}"
    return f"the link to {where} failed: {root!r}"


def _root_cause(exc: BaseException) -> BaseException:
    seen = set()
    while id(exc) not in seen:
        seen.add(id(exc))
        group = getattr(exc, "exceptions", None)  # an exception group (3.10 has only the backport)
        if group:
            exc = group[0]  # trio's happy eyeballs: every address failed, the first says how
            continue
        nxt = exc.__cause__ or exc.__context__
        if nxt is None:
            break
        exc = nxt
    return exc
