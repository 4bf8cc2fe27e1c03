"""The admin API: what `llmgw ctl` and `llmgw node remove` call, under /admin/v1/.

Every request carries the admin credential as `Authorization: Bearer TOKEN`; without it, or
with a wrong one, the answer is 401 with what to do. Routes:

    GET    /admin/v1/nodes[?limit=N&after=NODE&state=S]  the nodes with their state and inventory, by id
                                           (a page of N after NODE, and the next page's `after`)
    GET    /admin/v1/replicas              every replica: nodes, state, port; then what is pending and why
    GET    /admin/v1/replicas/ID/logs?lines=N   the tail of each member's engine log (N: 1-10000, default 100)
    GET    /admin/v1/models                the catalog with ready replicas per model (and, for a model
                                           from the Hub, its repository, commit, files and estimate)
    POST   /admin/v1/models                add a model from the Hub; DELETE /admin/v1/models/NAME removes
                                           one; POST /admin/v1/models/NAME/update changes one (or retries a
                                           stopped rollout); GET /admin/v1/models/search?q=TEXT
                                           (server/admin/modelroutes.py)
    POST   /admin/v1/reload                read server.toml again (catalog, engines)
    POST   /admin/v1/nodes/NODE/cordon     no new work for the node
    POST   /admin/v1/nodes/NODE/uncordon
    POST   /admin/v1/nodes/NODE/drain[?force=1]   move its replicas off, one at a time, then cordon
    DELETE /admin/v1/nodes/NODE            forget the node, revoke its certificates, close its link
    POST   /admin/v1/bench                 nodes measure their engines' speed again: {nodes, wait_s}, the
                                           figures once they have (server/admin/benchroute.py)
    GET    /admin/v1/keys                  the gateway's API keys (never their tokens)
    POST   /admin/v1/keys                  create one: {name, models, rate_per_minute, max_concurrency};
                                           the answer holds the token, shown this once
    DELETE /admin/v1/keys/NAME             revoke a key; its next request is refused
    GET    /admin/v1/teams, /admin/v1/usage  the teams (POST creates one, DELETE /admin/v1/teams/NAME
                                           removes one) and the usage ledger's totals
                                           (server/admin/usageroutes.py)
    GET    /admin/v1/budgets               token budgets, with spent and remaining; POST sets one, DELETE
                                           /admin/v1/budgets/ID removes one (server/admin/budgetroutes.py)
    GET    /admin/v1/gateways              the gateway instances connected (server/links/gatewaylinks.py): name,
                                           instance, since when, last heard, requests in flight, share
    GET    /admin/v1/events                the cluster page's live feed (server/admin/events.py)
    GET    /admin/v1/audit[?since=T&until=T&action=A&actor=X&target=N&limit=N]   the audit log, newest
                                           first (server/admin/audit.py)
    POST   /admin/v1/page/login            a one-time login URL for the cluster page (server/admin/page.py)
    POST   /admin/v1/certificates          record a node certificate just issued (`llmgw node add`, `llmgw ca
                                           issue`): {serial, node_id, not_after, revoke_others, also_revoke}
    GET    /admin/v1/certificates/SERIAL   what the control plane holds of a serial: recorded, revoked
    POST   /admin/v1/debug/stall?seconds=S hold the event loop for S seconds (a diagnostic: `[debug]
                                           allow_stall`, else 403; the credential itself, not a page session)

Inputs are read strictly (`llmgw.http.params`), each refusal a 400 naming the input, the value
given (cut short when long) and what is accepted: ids in paths are percent-decoded and must match
their grammar (node ids as `check_node_id`, `REPLICA`, key names as `keys.KEY_NAME`); a route
takes only the query parameters listed above, each once (`lines` from 1 to `MAX_LOG_LINES`,
`force` 1/0/true/false); JSON bodies take only their fields, of their types, within their
ranges (a key's limits up to `keys.MAX_LIMIT`, serials positive and at most 20 octets per
RFC 5280, `not_after` from 1970 to the end of 9999: the certificate routes, `certificates`).
docs/security.md, "The admin API", lists them.

Domain errors become statuses here and nowhere else (`ANSWERS`): an unknown node, replica or
key is 404, a bad server.toml 422 (nothing changed), a reload without a file 409, a diagnostic
that server.toml does not allow 403. A change the store cannot record (another process holds its
lock, the disk fails) is answered 503 with `Retry-After` and the store's message; nothing
changed, and the same request may be sent again.

The control plane is seen through two protocols, the calls this module makes, so that the admin
API does not import what builds them: `Views` (what it shows: `llmgw.server.state.clusterviews.ClusterViews`)
and `Operations` (what it changes: `llmgw.server.admin.operations.Operations`).
"""

from __future__ import annotations

import hmac
import json
import math
import re
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol

import attrs
import trio

from llmgw.errors import ConfigError, LlmgwError, UsageError, cut, shown
from llmgw.fabrics import FabricMap
from llmgw.http import params
from llmgw.http.errors import HTTPError
from llmgw.http.jsonbody import read_json
from llmgw.http.messages import Request, Response, StreamingResponse, allow
from llmgw.http.refusallines import RefusalLines
from llmgw.log import get_logger
from llmgw.pki.ca import check_node_id
from llmgw.server.admin import audit, budgetroutes, modelroutes, usageroutes
from llmgw.server.admin.benchroute import BENCH
from llmgw.server.admin.benchroute import bench as bench_route
from llmgw.server.admin.certificates import CERTIFICATES, certificates
from llmgw.server.errors import (
    ApiKeyError,
    ApiKeyExists,
    BudgetError,
    DiagnosticOff,
    NoConfigFile,
    StoreError,
    TeamError,
    TeamExists,
    TeamInUse,
    UnknownApiKey,
    UnknownBudget,
    UnknownNode,
    UnknownReplica,
    UnknownTeam,
)
from llmgw.server.state.drains import DrainProgress
from llmgw.server.state.keys import KEY_NAME, KEY_NAME_RULE, KeyRing, key_view
from llmgw.server.state.registry import STATES

if TYPE_CHECKING:
    from llmgw.server.admin.models import HubModels
    from llmgw.server.admin.page import Page
    from llmgw.server.state.budgetring import BudgetRing
    from llmgw.server.store.asyncstore import AsyncStore

log = get_logger("llmgw.admin")

PREFIX = "/admin/v1/"
_REPLICA_LOGS = re.compile(r"^/admin/v1/replicas/([^/]+)/logs$")
_KEY = re.compile(r"^/admin/v1/keys/([^/]+)$")
_NODE_ACTION = re.compile(r"^/admin/v1/nodes/([^/]+)(?:/(cordon|uncordon|drain))?$")
# GET /admin/v1/nodes, a page at a time for thousands of nodes: `next` names the id to give as
# `after` for the page after (null on the last); `state` keeps the nodes in that state.
MAX_NODES_PAGE = 10_000
NODE_STATES = STATES  # llmgw.server.state.registry's
# A listing is encoded this many items at a time, the loop free between: thousands of nodes make
# megabytes of JSON, tens of milliseconds in one call (in a thread too: the encoder holds the GIL).
ENCODE_SLICE = 200


async def listing_json(key: str, items: list[Any], rest: dict[str, Any]) -> bytes:
    """`{key: items, **rest}` as compact JSON and a newline, as `Response.json` writes it, encoded
    ENCODE_SLICE items at a time with a checkpoint between."""
    parts = [b'{"', key.encode(), b'":[']
    for start in range(0, len(items), ENCODE_SLICE):
        if start:
            await trio.lowlevel.checkpoint()
            parts.append(b",")
        chunk = json.dumps(items[start : start + ENCODE_SLICE], separators=(",", ":"))
        parts.append(chunk[1:-1].encode())
    tail = json.dumps(rest, separators=(",", ":"))
    parts.append(b"]" + (b"," + tail[1:].encode() if rest else b"}") + b"\n")
    return b"".join(parts)


NODE_QUERY = {
    "limit": f"how many nodes at most, 1 to {MAX_NODES_PAGE} (default: all)",
    "after": "the node id this page starts after (the previous page's next)",
    "state": ", ".join(NODE_STATES),
}
# A replica's id is its model's name (letters, digits, '.', '_', '-'; 63 at most) and its slot.
REPLICA = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
REPLICA_RULE = "a replica id is its model's name, '-' and a number (see `llmgw ctl replicas`)"
MAX_LOG_LINES = 10_000  # the agent reads at most 4 MiB of a log back for a tail anyway
LINES = f"the lines of each member's log to show, 1 to {MAX_LOG_LINES} (default 100)"
FORCE = "1 (or true) to stop replicas that cannot be moved, 0 (or false, the default) to stop the drain there"


class Views(Protocol):
    """What the admin API shows of the control plane."""

    def node_views(self) -> list[dict[str, Any]]: ...
    async def node_page(
        self, *, limit: int | None = None, after: str = "", state: str = ""
    ) -> tuple[list[dict[str, Any]], str | None]: ...
    def node_view(self, node_id: str) -> dict[str, Any]: ...
    def replica_views(self) -> list[dict[str, Any]]: ...
    async def replica_listing(self) -> list[dict[str, Any]]: ...
    def model_views(self, replica_views: Any = None) -> list[dict[str, Any]]: ...
    def fabric_map(self) -> FabricMap: ...


class Operations(Protocol):
    """What the admin API asks the control plane to do."""

    async def reload(self) -> dict[str, Any]: ...
    async def replica_logs(self, replica_id: str, lines: int) -> dict[str, Any]: ...
    async def start_drain(self, node_id: str, *, force: bool) -> DrainProgress: ...
    async def set_cordoned(self, node_id: str, cordoned: bool) -> None: ...
    async def remove_node(self, node_id: str) -> dict[str, Any]: ...
    async def bench(self, node_ids: list[str], wait_s: float) -> dict[str, Any]: ...
    def certificate_recorded(self) -> None: ...
    def stall(self, seconds: float) -> dict[str, Any]: ...


@attrs.frozen
class Answer:
    """How a domain error is answered: its status, its OpenAI error type, and its message in a
    frame (`{}` is the error's own)."""

    status: int
    kind: str = "invalid_request_error"
    frame: str = "{}"


# The one mapping of domain errors to HTTP statuses, looked up along the error's class hierarchy
# (the most specific class first). A `StoreError` also says when to try again (`Retry-After`).
ANSWERS: dict[type[LlmgwError], Answer] = {
    UnknownNode: Answer(404, "not_found_error"),
    UnknownReplica: Answer(404, "not_found_error"),
    UnknownApiKey: Answer(404, "not_found_error"),
    UnknownBudget: Answer(404, "not_found_error"),
    BudgetError: Answer(400),
    ApiKeyExists: Answer(409),
    UnknownTeam: Answer(404, "not_found_error"),
    TeamExists: Answer(409),
    TeamInUse: Answer(409),
    TeamError: Answer(400),
    ApiKeyError: Answer(400),
    NoConfigFile: Answer(409),
    DiagnosticOff: Answer(403, "permission_error"),
    ConfigError: Answer(422, frame="server.toml has problems; nothing changed:\n{}"),
    StoreError: Answer(503, "unavailable_error"),
}


def answer(exc: LlmgwError) -> HTTPError | None:
    """The HTTP error a domain error is answered with; None for one that has no answer (a bug)."""
    found = next((ANSWERS[c] for c in type(exc).__mro__ if c in ANSWERS), None)
    if found is None:
        return None
    headers = (("retry-after", str(math.ceil(exc.retry_after_s))),) if isinstance(exc, StoreError) else ()
    return HTTPError(found.status, found.frame.format(exc), kind=found.kind, headers=headers)


class AdminAPI:
    def __init__(
        self,
        *,
        views: Views,
        operations: Operations,
        page: Page,
        store: AsyncStore,
        keys: KeyRing,
        token: str,
        gateways: Callable[[], list[dict[str, Any]]] = list,
        keys_reached: Callable[[], Awaitable[Any]] | None = None,
        authority: Callable[[], dict[str, Any]] = dict,
        refusals: RefusalLines | None = None,
        models: HubModels | None = None,
        budgets: BudgetRing | None = None,
    ) -> None:
        """`page`: the cluster page, whose gate every call passes (`Page.guard`); `store`: where
        certificate serials are recorded and read; `gateways()`: the gateway instances connected
        (`GatewayFeed.views`); `keys_reached()`: returns once the control plane's own gateway
        holds the keys as they are now (bounded), so a key made or revoked is known on
        http_listen when the answer comes; `authority()`: the CA this control plane signs with
        (its CN and fingerprint: `llmgw server add` checks a new control plane's against its own);
        `refusals`: where a wrong credential is logged, with the page's refusals (`RefusalLines`:
        a few lines each interval, then counted)."""
        self.refusals = refusals or RefusalLines("http")
        self.gateways = gateways
        self.authority = authority
        self.keys_reached = keys_reached
        self.views = views
        self.operations = operations
        self.page = page
        self.store = store
        self.keys = keys
        self.models = models  # the catalog's models added from the Hub (None: no such routes)
        self.budgets = budgets  # token budgets (None: no such routes)
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
            self.refusals.refused(
                log, "admin_credential_refused", kind="admin", peer=request.client, client=request.client
            )
            raise HTTPError(
                401,
                "wrong admin credential: it does not match this control plane's admin.token",
                kind="authentication_error",
            )

    async def handle(self, request: Request) -> Response | StreamingResponse:
        # Who calls (a cluster-page session, or the credential through `_authorize`), the page's
        # own admin routes, and the audit line of every change: server/admin/page.py.
        return await self.page.guard(request, self._authorize, self._handle_authorized)

    async def _handle_authorized(self, request: Request) -> Response:
        try:
            return await self._route(request)
        except LlmgwError as exc:
            error = answer(exc)
            if error is None:
                raise
            if isinstance(exc, StoreError):
                log.warning("admin_store_unavailable", path=request.path, reason=str(exc))
            raise error from None

    async def _route(self, request: Request) -> Response:
        if request.path == "/admin/v1/nodes":
            _allow(request, "GET")
            q = params.query(request, NODE_QUERY)
            limit = params.whole_number(q["limit"], "limit", 1, MAX_NODES_PAGE) if "limit" in q else None
            state = q.get("state", "")
            if state and state not in NODE_STATES:
                raise HTTPError(400, f"state must be one of {', '.join(NODE_STATES)}, got {shown(state)}")
            nodes, after = await self.views.node_page(limit=limit, after=q.get("after", ""), state=state)
            fabrics = self.views.fabric_map()
            placed = [{"name": f.name, "identity": f.identity, "nodes": list(f.nodes)} for f in fabrics.fabrics]
            rest = {"next": after, "fabrics": placed, "notes": list(fabrics.notes)}
            return Response(
                status=200,
                body=await listing_json("nodes", nodes, rest),
                headers=(("content-type", "application/json"),),
            )
        if request.path == "/admin/v1/reload":
            _allow(request, "POST")
            params.query(request, {})
            result = await self.operations.reload()
            audit.describe(request, "config.reload", **result)
            return Response.json(200, result)
        logs = _REPLICA_LOGS.match(request.path)
        if logs is not None:
            _allow(request, "GET")
            replica_id = _path_id(logs.group(1), "replica id", REPLICA, REPLICA_RULE)
            given = params.query(request, {"lines": LINES})
            lines = params.whole_number(given.get("lines", "100"), "lines", 1, MAX_LOG_LINES)
            return Response.json(200, await self.operations.replica_logs(replica_id, lines))
        if request.path == "/admin/v1/replicas":
            _allow(request, "GET")
            params.query(request, {})
            body = await listing_json("replicas", await self.views.replica_listing(), {})
            return Response(status=200, body=body, headers=(("content-type", "application/json"),))
        if request.path == "/admin/v1/models" and request.method in ("GET", "HEAD"):
            params.query(request, {})
            return Response.json(200, {"models": self.views.model_views(await self.views.replica_listing())})
        if self.models is not None and modelroutes.serves(request.path):
            return await modelroutes.model_routes(self.models, request)
        if request.path == audit.ROUTE:
            return await audit.listing(self.store, request)
        if request.path == BENCH:
            return await bench_route(self.operations, request)
        if request.path == "/admin/v1/gateways":
            _allow(request, "GET")
            params.query(request, {})
            return Response.json(200, {"gateways": self.gateways()})
        if request.path == AUTHORITY:
            _allow(request, "GET")
            params.query(request, {})
            return Response.json(200, {"ca": self.authority()})
        if request.path == STALL:
            _allow(request, "POST")
            # The credential itself, even under a page session's cookie: holding the control plane's
            # loop is for the operator at its shell, never a button on a page.
            self._authorize(request)
            seconds = _stall_seconds(request)
            audit.describe(request, "debug.stall", seconds=seconds)
            return Response.json(200, self.operations.stall(seconds))
        if request.path == "/admin/v1/keys" or _KEY.match(request.path):
            return await self._keys(request)
        if usageroutes.serves(request.path):
            return await usageroutes.usage_routes(self.store, request)
        if self.budgets is not None and budgetroutes.serves(request.path):
            return await budgetroutes.budget_routes(self.budgets, request)
        if request.path == CERTIFICATES or request.path.startswith(CERTIFICATES + "/"):
            response = await certificates(self.store, request)
            if request.method == "POST":
                self.operations.certificate_recorded()  # a node is on its way: its engines' sources are fetched
            return response
        m = _NODE_ACTION.match(request.path)
        if m is None:
            raise HTTPError(
                404,
                f"no admin route {cut(request.method, 20)} {cut(request.path)}",
                kind="not_found_error",
            )
        raw_node, action = m.groups()
        node_id = _node_id(raw_node)
        if action == "drain":
            _allow(request, "POST")
            force = params.flag(params.query(request, {"force": FORCE}).get("force", "0"), "force")
            progress = await self.operations.start_drain(node_id, force=force)
            audit.describe(request, "node.drain", node_id, force=force)
            return Response.json(202, {"drain": progress.view()})
        if action in ("cordon", "uncordon"):
            _allow(request, "POST")
            params.query(request, {})
            await self.operations.set_cordoned(node_id, action == "cordon")
            audit.describe(request, f"node.{action}", node_id)
            log.info(f"node_{action}ed", node=node_id)
            return Response.json(200, {"node": self.views.node_view(node_id)})
        _allow(request, "DELETE")
        params.query(request, {})
        removed = await self.operations.remove_node(node_id)
        audit.describe(request, "node.remove", node_id, revoked_serials=removed["revoked_serials"])
        return Response.json(200, removed)

    async def _keys_reached(self) -> None:
        if self.keys_reached is not None:
            await self.keys_reached()

    async def _keys(self, request: Request) -> Response:
        ring = self.keys
        params.query(request, {})
        if request.path != "/admin/v1/keys":
            _allow(request, "DELETE")
            name = _path_id(_KEY.match(request.path).group(1), "key name", KEY_NAME, KEY_NAME_RULE)
            await ring.revoke(name)
            audit.describe(request, "key.revoke", name)
            await self._keys_reached()
            log.info("api_key_revoked", name=name)
            return Response.json(200, {"revoked": name})
        if request.method in ("GET", "HEAD"):
            return Response.json(200, {"keys": [key_view(r) for r in await ring.rows()]})
        _allow(request, "POST")
        body = await read_json(request)
        if not isinstance(body, dict):
            raise HTTPError(400, "the body must be a JSON object: {name, models, rate_per_minute, max_concurrency}")
        unknown = sorted(set(body) - {"name", "models", "rate_per_minute", "max_concurrency", "team"})
        if unknown:
            raise HTTPError(
                400, f"unknown fields {unknown}; a key takes name, models, rate_per_minute, max_concurrency, team"
            )
        if not isinstance(body.get("name"), str):
            raise HTTPError(400, f"'name' must be a string, got {shown(body.get('name'))}")
        row, token = await ring.create(
            body["name"],
            models=() if body.get("models") is None else body["models"],
            rate_per_minute=body.get("rate_per_minute", 0),
            max_concurrency=body.get("max_concurrency", 0),
            team=body.get("team", ""),
        )
        audit.describe(
            request,
            "key.create",
            row.name,
            models=list(row.models),
            rate_per_minute=row.rate_per_minute,
            max_concurrency=row.max_concurrency,
            team=row.team,
        )
        await self._keys_reached()
        log.info("api_key_created", name=row.name, models=list(row.models))
        return Response.json(201, {"key": key_view(row), "token": token})


def _node_id(raw: str) -> str:
    node_id = params.path_segment(raw, "node id")
    try:
        return check_node_id(node_id)
    except UsageError as exc:
        raise HTTPError(400, str(exc)) from None


def _path_id(raw: str, what: str, grammar: re.Pattern[str], rule: str) -> str:
    decoded = params.path_segment(raw, what)
    if grammar.fullmatch(decoded) is None:
        raise HTTPError(400, f"{what} {shown(decoded)} is not valid: {rule}")
    return decoded


STALL = "/admin/v1/debug/stall"
AUTHORITY = "/admin/v1/authority"
MAX_STALL_S = 600.0


def _stall_seconds(request: Request) -> float:
    given = request.query.get("seconds", [""])[0]
    try:
        seconds = float(given)
    except ValueError:
        seconds = math.nan
    if not 0 < seconds <= MAX_STALL_S:
        raise HTTPError(400, f"seconds must be a number of seconds above 0 and at most {MAX_STALL_S:g}, got {given!r}")
    return seconds


def _allow(request: Request, method: str) -> None:
    allow(request, method)  # a HEAD where GET is allowed; the path cut short in a 405


def is_admin_path(path: str) -> bool:
    return path.startswith(PREFIX)
