"""The admin API: what `llmgw ctl` and `llmgw node remove` call, under /admin/v1/.

Every request carries the admin credential as `Authorization: Bearer TOKEN`; without it, or
with a wrong one, the answer is 401 with what to do. Routes:

    GET    /admin/v1/nodes                 every node with its state and inventory
    GET    /admin/v1/replicas              every replica: nodes, state, port; then what is pending and why
    GET    /admin/v1/replicas/ID/logs?lines=N   the tail of each member's engine log
    GET    /admin/v1/models                the catalog with ready replicas per model
    POST   /admin/v1/reload                read server.toml again (catalog, engines)
    POST   /admin/v1/nodes/NODE/cordon     no new work for the node
    POST   /admin/v1/nodes/NODE/uncordon
    POST   /admin/v1/nodes/NODE/drain[?force=1]   move its replicas off, one at a time, then cordon
    DELETE /admin/v1/nodes/NODE            forget the node, revoke its certificates, close its link
    GET    /admin/v1/keys                  the gateway's API keys (never their tokens)
    POST   /admin/v1/keys                  create one: {name, models, rate_per_minute, max_concurrency};
                                           the answer holds the token, shown this once
    DELETE /admin/v1/keys/NAME             revoke a key; its next request is refused
    GET    /admin/v1/events                the cluster page's live feed (server/events.py)
    POST   /admin/v1/page/login            a one-time login URL for the cluster page (server/page.py)

The cluster page's session cookie stands in for the credential (server/page.py decides who
calls, and checks CSRF and Origin on changes).

A change the store cannot record (another process holds its lock, the disk fails) is answered
503 with `Retry-After` and the store's message; nothing changed, and the same request may be
sent again.
"""

from __future__ import annotations

import hmac
import math
import re
from typing import TYPE_CHECKING
from urllib.parse import unquote

from llmgw.errors import ConfigError
from llmgw.http.server import HTTPError, Request, Response, StreamingResponse
from llmgw.log import get_logger
from llmgw.server.gateway.errors import ApiKeyError, ApiKeyExists, UnknownApiKey
from llmgw.server.gateway.keys import key_view
from llmgw.server.store import StoreError, UnknownNode

if TYPE_CHECKING:
    from llmgw.server.app import ControlPlane

log = get_logger("llmgw.admin")

PREFIX = "/admin/v1/"
_REPLICA_LOGS = re.compile(r"^/admin/v1/replicas/([^/]+)/logs$")
_KEY = re.compile(r"^/admin/v1/keys/([^/]+)$")
_NODE_ACTION = re.compile(r"^/admin/v1/nodes/([^/]+)(?:/(cordon|uncordon|drain))?$")


class AdminAPI:
    def __init__(self, plane: ControlPlane, token: str) -> None:
        self.plane = plane
        self._token = token.encode()

    def _authorize(self, request: Request) -> None:
        header = request.headers.get("authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not given.strip():
            raise HTTPError(
                401,
                "the admin API needs the admin credential (Authorization: Bearer ...); `llmgw ctl` reads it from "
                "the control plane's state directory (admin.token) or from --credential FILE",
                kind="authentication_error",
            )
        if not hmac.compare_digest(given.strip().encode(), self._token):
            log.warning("admin_credential_refused", client=request.client)
            raise HTTPError(
                401,
                "wrong admin credential: it does not match this control plane's admin.token",
                kind="authentication_error",
            )

    async def handle(self, request: Request) -> Response | StreamingResponse:
        # [i17 page hook] Who calls (a page session, or the credential via `_authorize`), the
        # page's own admin routes, and the audit line of every change: server/page.py.
        return await self.plane.page.guard(request, self._authorize, self._handle_authorized)

    async def _handle_authorized(self, request: Request) -> Response:
        try:
            return await self._route(request)
        except StoreError as exc:
            log.warning("admin_store_unavailable", path=request.path, reason=str(exc))
            retry = str(math.ceil(exc.retry_after_s))
            raise HTTPError(503, str(exc), kind="unavailable_error", headers=(("retry-after", retry),)) from None

    async def _route(self, request: Request) -> Response:
        if request.path == "/admin/v1/nodes":
            _allow(request, "GET")
            fabrics = self.plane.fabric_map()
            placed = [{"name": f.name, "identity": f.identity, "nodes": list(f.nodes)} for f in fabrics.fabrics]
            return Response.json(
                200, {"nodes": self.plane.node_views(), "fabrics": placed, "notes": list(fabrics.notes)}
            )
        if request.path == "/admin/v1/reload":
            _allow(request, "POST")
            try:
                return Response.json(200, await self.plane.reload())
            except ConfigError as exc:
                raise HTTPError(422, f"server.toml has problems; nothing changed:\n{exc}") from None
        logs = _REPLICA_LOGS.match(request.path)
        if logs is not None:
            _allow(request, "GET")
            lines = request.query.get("lines", ["100"])[0]
            if not lines.isdigit():
                raise HTTPError(400, f"lines must be a whole number, got {lines!r}")
            return Response.json(200, await self.plane.replica_logs(logs.group(1), int(lines)))
        if request.path == "/admin/v1/replicas":
            _allow(request, "GET")
            return Response.json(200, {"replicas": self.plane.replica_views()})
        if request.path == "/admin/v1/models":
            _allow(request, "GET")
            return Response.json(200, {"models": self.plane.model_views()})
        if request.path == "/admin/v1/keys" or _KEY.match(request.path):
            return await self._keys(request)
        m = _NODE_ACTION.match(request.path)
        if m is None:
            raise HTTPError(404, f"no admin route {request.method} {request.path}", kind="not_found_error")
        node_id, action = m.groups()
        try:
            if action == "drain":
                _allow(request, "POST")
                force = request.query.get("force", ["0"])[0] in ("1", "true")
                progress = await self.plane.start_drain(node_id, force=force)
                return Response.json(202, {"drain": progress.view()})
            if action in ("cordon", "uncordon"):
                _allow(request, "POST")
                await self.plane.set_cordoned(node_id, action == "cordon")
                log.info(f"node_{action}ed", node=node_id)
                return Response.json(200, {"node": self.plane.node_view(node_id)})
            _allow(request, "DELETE")
            result = await self.plane.remove_node(node_id)
            return Response.json(200, result)
        except UnknownNode as exc:
            raise HTTPError(404, str(exc), kind="not_found_error") from None

    async def _keys(self, request: Request) -> Response:
        ring = self.plane.gateway.keys
        try:
            if request.path != "/admin/v1/keys":
                _allow(request, "DELETE")
                name = unquote(_KEY.match(request.path).group(1))
                await ring.revoke(name)
                log.info("api_key_revoked", name=name)
                return Response.json(200, {"revoked": name})
            if request.method == "GET":
                return Response.json(200, {"keys": [key_view(r) for r in await ring.rows()]})
            _allow(request, "POST")
            body = request.json()
            if not isinstance(body, dict):
                raise HTTPError(400, "the body must be a JSON object: {name, models, rate_per_minute, max_concurrency}")
            unknown = sorted(set(body) - {"name", "models", "rate_per_minute", "max_concurrency"})
            if unknown:
                raise HTTPError(
                    400, f"unknown fields {unknown}; a key takes name, models, rate_per_minute, max_concurrency"
                )
            if not isinstance(body.get("name"), str):
                raise HTTPError(400, f"'name' must be a string, got {body.get('name')!r}")
            row, token = await ring.create(
                body["name"],
                models=body.get("models") or (),
                rate_per_minute=body.get("rate_per_minute", 0),
                max_concurrency=body.get("max_concurrency", 0),
            )
        except UnknownApiKey as exc:
            raise HTTPError(404, str(exc), kind="not_found_error") from None
        except ApiKeyExists as exc:
            raise HTTPError(409, str(exc)) from None
        except ApiKeyError as exc:
            raise HTTPError(400, str(exc)) from None
        log.info("api_key_created", name=row.name, models=list(row.models))
        return Response.json(201, {"key": key_view(row), "token": token})


def _allow(request: Request, method: str) -> None:
    if request.method != method:
        raise HTTPError(405, f"{request.path} takes {method}, not {request.method}", headers=(("allow", method),))


def is_admin_path(path: str) -> bool:
    return path.startswith(PREFIX)
