"""The HTTP server's errors, by blame:

- `HTTPError`: a handler refuses a request; answered with its status, its message and headers
  (the listener's `ErrorBody` writes them: plain text by default, OpenAI's shape on the
  gateway's port, `llmgw.http.openai`).
- `BodyAborted`: a streamed body's producer ends its response on purpose (an upstream broke),
  having logged why: the client sees a truncated body, and no traceback is logged.
- `Abort`: the peer's fault, or a deadline it missed: the connection ends, answered first with
  `status` when one is given and nothing of the response is out yet.
- `SocketInUse`: a private Unix socket another live server answers on (`llmgw.http.unixsocket`):
  the operator stops that one first.

`peer_reason` tells a failure the peer caused (however deeply a nursery wrapped it) from a bug
of ours: the one rule every connection's containment uses (`llmgw.http.server`, and the agent
port's link).
"""

from __future__ import annotations

import errno
from pathlib import Path

import trio

from llmgw.errors import MachineError, leaves


class HTTPError(Exception):
    """Raised by handlers to answer with an error status and an explanation. `kind` classes the
    error for an error body that names one (OpenAI's `type`); "" leaves it to that body. `code`
    (a string a client can test, such as "model_not_found") and `param` (the request field at
    fault) are for such a body too; None where nothing more precise applies."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        kind: str = "",
        code: str | None = None,
        param: str | None = None,
        headers=(),
    ) -> None:
        self.status = status
        self.message = message
        self.kind = kind
        self.code = code
        self.param = param
        self.headers = tuple(headers)
        super().__init__(message)

    def __reduce__(self):  # pickled by a JSON worker's projection (llmgw.http.jsonworkers)
        return (_http_error, (self.status, self.message, self.kind, self.headers, self.code, self.param))


def _http_error(
    status: int, message: str, kind: str, headers: tuple, code: str | None = None, param: str | None = None
) -> HTTPError:
    return HTTPError(status, message, kind=kind, code=code, param=param, headers=headers)


def too_large(limit: int) -> HTTPError:
    return HTTPError(
        413, f"request body is larger than the limit of {limit} bytes for this route", code="request_too_large"
    )


class BodyAborted(Exception):
    """Raised by a streamed body's producer to end its response without the last chunk, for a
    reason it has logged itself (an upstream broke): the client sees a truncated body, and
    this is not logged as a bug."""


class Abort(Exception):
    """The peer's fault or a deadline: this connection ends. `status` > 0: answer it first
    (when the response has not begun). `reason` is what /metrics counts it under."""

    def __init__(self, reason: str, status: int = 0, message: str = "", headers=()) -> None:
        self.reason, self.status, self.message, self.headers = reason, status, message, tuple(headers)
        super().__init__(f"{reason}: {message}" if message else reason)


class SocketInUse(MachineError):
    """A server already answers on the Unix socket this one would listen on."""

    def __init__(self, path: Path) -> None:
        self.path = path
        super().__init__(
            f"another server answers on {path} (a live process listens there, probably another llmgw "
            "server with this state directory); stop it first, or give this one its own state directory"
        )


def peer_reason(exc: BaseException) -> str | None:
    """Why a connection broke, when every failure inside `exc` is the peer's; None when any
    is not (a bug of ours)."""
    reasons = []
    for leaf in leaves(exc):
        if isinstance(leaf, Abort):
            reasons.append(leaf.reason)
        elif isinstance(leaf, trio.TooSlowError):
            reasons.append("send_timeout")
        elif isinstance(leaf, trio.BrokenResourceError):
            cause = leaf.__cause__
            reset = isinstance(cause, OSError) and cause.errno in (errno.ECONNRESET, errno.EPIPE)
            reasons.append("reset" if reset else "closed")
        elif isinstance(leaf, trio.ClosedResourceError):
            reasons.append("closed")
        else:
            return None
    return reasons[0] if reasons else None
