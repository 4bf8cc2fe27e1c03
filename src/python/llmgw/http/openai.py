"""OpenAI's error shape, for the ports whose clients parse it: the gateway and the admin API (one
format for both, so a client of either parses one) and the sim engine, which stands in for an
OpenAI-compatible engine.

    {"error": {"message": "...", "type": "not_found_error", "code": 404}}

`error_body` is the `ErrorBody` those listeners are served with (`serve_http(errors=...)`): the
generic server (`llmgw.http.server`) knows an error's status, message and headers only. The
`type` is the error's `kind`, or for one that names none, "server_error" for a 5xx status and
"invalid_request_error" otherwise.
"""

from __future__ import annotations

from llmgw.http.errors import HTTPError
from llmgw.http.messages import Headers, Response


def error_response(status: int, message: str, kind: str = "", headers: Headers = ()) -> Response:
    kind = kind or ("server_error" if status >= 500 else "invalid_request_error")
    return Response.json(status, {"error": {"message": message, "type": kind, "code": status}}, tuple(headers))


def error_body(error: HTTPError) -> Response:
    """`error` in OpenAI's shape."""
    return error_response(error.status, error.message, error.kind, error.headers)
