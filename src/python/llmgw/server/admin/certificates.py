"""The admin API's certificate routes: the serials of node certificates, recorded by the commands
that issue them (`llmgw node add`, `llmgw ca issue`) and read by `llmgw node add`, so that no
command but the control plane opens its database while it runs.

    POST   /admin/v1/certificates          {serial, node_id, not_after, revoke_others, also_revoke}
    GET    /admin/v1/certificates/SERIAL   what the control plane holds of a serial: recorded, revoked

The body is read strictly, as every admin input is (`llmgw.server.admin.api`): only these fields,
of their types, serials positive and at most 20 octets per RFC 5280, `not_after` from 1970 to the
end of 9999, at most `MAX_ALSO_REVOKE` serials revoked by one record. The route is reached, and
its caller authorized, through `api.AdminAPI`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from llmgw.errors import UsageError, shown
from llmgw.http import params
from llmgw.http.errors import HTTPError
from llmgw.http.jsonbody import read_json
from llmgw.http.messages import Request, Response, allow
from llmgw.log import get_logger
from llmgw.pki.ca import check_node_id
from llmgw.server.admin import audit

if TYPE_CHECKING:
    from llmgw.server.store.asyncstore import AsyncStore

log = get_logger("llmgw.admin")

# Serials travel as decimal strings: 159 bits, which a JSON reader would round as a number.

CERTIFICATES = "/admin/v1/certificates"
_RECORD_FIELDS = {"serial", "node_id", "not_after", "revoke_others", "also_revoke"}
MAX_SERIAL = (1 << 160) - 1  # RFC 5280 §4.1.2.2: a serial is positive and at most 20 octets
MAX_NOT_AFTER = 253402300799  # 9999-12-31T23:59:59Z, the last instant X.509's GeneralizedTime says
MAX_ALSO_REVOKE = 1000  # serials revoked by one record (node add revokes a node's few others)


async def certificates(store: AsyncStore, request: Request) -> Response:
    """The serials of node certificates: recorded by the commands that issue them, read by
    `llmgw node add`, so that no command but the control plane opens its database while it runs."""
    if request.path != CERTIFICATES:
        allow(request, "GET")
        params.query(request, {})
        serial = _serial(params.path_segment(request.path[len(CERTIFICATES) + 1 :], "serial"), "the path")
        row = await store.certificate(serial)
        return Response.json(
            200,
            {
                "serial": str(serial),
                "recorded": row is not None,
                "node_id": row.node_id if row else None,
                "not_after": row.not_after if row else None,
                "revoked": row is not None and row.revoked_at is not None,
                "revoked_at": row.revoked_at if row else None,
            },
        )
    allow(request, "POST")
    params.query(request, {})
    body = await read_json(request)
    if not isinstance(body, dict):
        raise HTTPError(400, f"the body must be a JSON object: {{{', '.join(sorted(_RECORD_FIELDS))}}}")
    unknown = sorted(set(body) - _RECORD_FIELDS)
    if unknown:
        raise HTTPError(400, f"unknown fields {unknown}; a certificate takes {', '.join(sorted(_RECORD_FIELDS))}")
    serial = _serial(body.get("serial"), "'serial'")
    node_id = body.get("node_id")
    if not isinstance(node_id, str):
        raise HTTPError(400, f"'node_id' must be the node id the certificate names, as a string; got {shown(node_id)}")
    try:
        check_node_id(node_id)
    except UsageError as exc:
        raise HTTPError(400, f"'node_id': {exc}") from None
    not_after = _seconds(body.get("not_after"))
    revoke_others = body.get("revoke_others", False)
    if not isinstance(revoke_others, bool):
        raise HTTPError(400, f"'revoke_others' must be true or false, got {shown(revoke_others)}")
    also = body.get("also_revoke", [])
    if not isinstance(also, list) or len(also) > MAX_ALSO_REVOKE:
        raise HTTPError(400, f"'also_revoke' must be a list of at most {MAX_ALSO_REVOKE} serials, got {shown(also)}")
    also_revoke = [_serial(s, "'also_revoke'") for s in also]
    revoked = await store.record_issued(
        serial, node_id, not_after, revoke_others=revoke_others, also_revoke=also_revoke
    )
    log.info("certificate_recorded", node=node_id, serial=str(serial), revoked_serials=revoked)
    audit.describe(
        request,
        "certificate.record",
        node_id,
        serial=f"{serial:x}",  # hex, as openssl and `node.remove` print it
        not_after=not_after,
        revoke_others=revoke_others,
        revoked_serials=[f"{int(s):x}" for s in revoked],
    )
    return Response.json(201, {"recorded": str(serial), "revoked_serials": revoked})


def _serial(given: object, where: str) -> int:
    if isinstance(given, str):
        try:
            return params.whole_number(given, "serial", 1, MAX_SERIAL)
        except HTTPError:
            pass
    raise HTTPError(
        400,
        f"{where}: a serial is a positive whole number in decimal, as a string, at most 2**160 - 1 (RFC 5280: "
        f"20 octets); got {shown(given)}",
    )


def _seconds(given: object) -> float:
    """A certificate's expiry as JSON gives it: a number of seconds since 1970 that X.509 can say."""
    # Not `math.isfinite(given)` first: an int of 400 digits does not convert to a float.
    if not isinstance(given, bool) and isinstance(given, (int, float)) and 0 <= given <= MAX_NOT_AFTER:
        return float(given)
    raise HTTPError(
        400,
        f"'not_after' must be the certificate's expiry in seconds since 1970, from 0 to {MAX_NOT_AFTER} "
        f"(the end of 9999); got {shown(given)}",
    )
