"""Which header fields cross the gateway, each way. Pure: fields in, fields out.

To the replica (`upstream_headers`): the client's fields as they came (byte pairs, repeats kept,
in order) but for the hop-by-hop ones and those `Connection` names (RFC 9110 §7.6.1), and what
the gateway sets itself: the host and length of its own request, the replica's key instead of
the client's, `X-Forwarded-For` (the client's list, then the client) and the request's id
(`X-Request-Id`: the client's own when it sent a usable one, `request_id`).

To the client (`relayed_headers`): the replica's fields but for the hop-by-hop ones and those
the gateway's own server writes (length, date, server) and the replica's own request id, then which
replica answered, the gateway's own time before it reached that replica, and the request's id
(which the gateway's handler adds to every other answer of its own, errors too).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from llmgw.gateway.routing import Endpoint
from llmgw.http.messages import Request
from llmgw.http.openai import REQUEST_ID, new_request_id

HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)
_NOT_FORWARDED = HOP_BY_HOP | {"host", "content-length", "authorization", "expect", REQUEST_ID}
_NOT_FORWARDED_BYTES = frozenset(name.encode() for name in _NOT_FORWARDED)
_NOT_FORWARDED_BYTES_XFF = _NOT_FORWARDED_BYTES | {b"x-forwarded-for"}  # which the gateway writes anew
_NOT_RELAYED = frozenset(name.encode() for name in HOP_BY_HOP | {"content-length", "date", "server", REQUEST_ID})
# A caller's own request id is kept when it is one a log line and a header can carry as it is.
_USABLE_ID = re.compile(r"[A-Za-z0-9._:/+=@-]{1,128}")


def request_id(given: str | None) -> str:
    """The request's id: the caller's `X-Request-Id` when usable, else a new one."""
    if given is not None and _USABLE_ID.fullmatch(given):
        return given
    return new_request_id()


def upstream_headers(request: Request, ep: Endpoint, rid: str = "") -> list[tuple[bytes, bytes]]:
    """The fields of the request to the replica `ep`, from the client's `request`; `rid`: its id."""
    raw = request.raw_headers
    client_host = request.client.rpartition(":")[0]
    dropped = _NOT_FORWARDED_BYTES_XFF if client_host else _NOT_FORWARDED_BYTES
    for k, v in raw:
        if k == b"connection":  # what it names is hop-by-hop too ("keep-alive" already is)
            named = {t.strip().lower() for t in v.split(b",")}
            if not named <= dropped:
                dropped = dropped | named
    headers = [(k, v) for k, v in raw if k not in dropped]
    if ep.api_key:
        headers.append((b"authorization", f"Bearer {ep.api_key}".encode()))
    if client_host:
        chain = [v for k, v in raw if k == b"x-forwarded-for"]
        chain.append(client_host.encode())
        headers.append((b"x-forwarded-for", b", ".join(chain)))
    if rid:
        headers.append((REQUEST_ID.encode(), rid.encode()))
    return headers


def relayed_headers(
    upstream: Iterable[tuple[bytes, bytes]], *, replica_id: str, overhead_s: float, request_id: str, route: str = ""
) -> tuple[tuple[bytes | str, bytes | str], ...]:
    """The fields of the answer to the client, from the replica's (`upstream`, as byte pairs
    with names in lower case: they go out as they came); `route`: how the replica was chosen
    (`routing.Route.header`), for a model routed by prefix."""
    fields = (
        *[(k, v) for k, v in upstream if k not in _NOT_RELAYED],
        ("x-llmgw-replica", replica_id),
        ("x-llmgw-overhead-ms", f"{overhead_s * 1000:.2f}"),
        (REQUEST_ID, request_id),
    )
    return (*fields, ("x-llmgw-route", route)) if route else fields
