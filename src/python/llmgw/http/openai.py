"""OpenAI's error shape, for the ports whose clients parse it: the gateway and the admin API (one
format for both, so a client of either parses one) and the sim engine, which stands in for an
OpenAI-compatible engine.

    {"error": {"message": "...", "type": "invalid_request_error", "param": "model", "code": "model_not_found"}}

`error_body` is the `ErrorBody` those listeners are served with (`serve_http(errors=...)`): the
generic server (`llmgw.http.server`) knows an error's status, message and headers only. The
`type` is the error's `kind`, or for one that names none, "server_error" for a 5xx status and
"invalid_request_error" otherwise. `code` is a string a client tests (`e.code` in OpenAI's SDK)
or null, `param` the request field at fault or null, as OpenAI's API sends them; the gateway's
codes are in docs/gateway.md's error table.
"""

from __future__ import annotations

import random

from llmgw.http.errors import HTTPError
from llmgw.http.messages import Headers, Response

REQUEST_ID = "x-request-id"


def new_request_id() -> str:
    """A new id, unique but not secret (a caller may send its own): 96 bits of the random
    module's generator, seeded from the OS at start and again in a forked child, so that an id
    costs no system call (`secrets` asks the kernel each time) and says nothing of the traffic
    (a counter would)."""
    return f"req_{random.getrandbits(96):024x}"


def error_response(
    status: int,
    message: str,
    kind: str = "",
    headers: Headers = (),
    *,
    code: str | None = None,
    param: str | None = None,
) -> Response:
    kind = kind or ("server_error" if status >= 500 else "invalid_request_error")
    error = {"message": message, "type": kind, "param": param, "code": code}
    return Response.json(status, {"error": error}, tuple(headers))


def error_body(error: HTTPError) -> Response:
    """`error` in OpenAI's shape, with a request id as every answer of OpenAI's API has one: the
    handler's (the gateway's, the caller's own), or a new one for an error the server answers
    itself before any handler saw the request (a body over the limit, a head cut short)."""
    headers = error.headers
    if not any(name.lower() == REQUEST_ID for name, _ in headers):
        headers = (*headers, (REQUEST_ID, new_request_id()))
    return error_response(error.status, error.message, error.kind, headers, code=error.code, param=error.param)
