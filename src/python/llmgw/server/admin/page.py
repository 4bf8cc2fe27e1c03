"""The cluster page: its files, its login, and the gate every admin API call passes.

Routes of its own, outside /admin/v1/ (no credential needed: they hold nothing):

    GET  /                 the page (llmgw/page/index.html)
    GET  /page/NAME        its scripts and style sheet (package data, read once)
    GET  /login?code=C     consume a one-time login code: set the session cookie, 303 to /

and under the admin API, through `guard`:

    POST /admin/v1/page/login     the credential mints a login code: {"actions": bool} -> {path, expires_in_s}
    GET  /admin/v1/page/session   a page session's id, CSRF token, whether it may act, expiry
    POST /admin/v1/page/logout    end this session and clear its cookie
    GET  /admin/v1/events         the live feed (server/admin/events.py)

Query parameters are read as the admin API reads them (`llmgw.http.params`): `/login` takes
`code`, once; every other route takes none, and a parameter it does not take is a 400 naming it.

`guard` decides who is calling, before any admin route runs: a live session cookie, or else
the admin credential (the bearer check admin.py has always made). A page session may read
everything the admin API serves; it may change something only if its login code allowed
actions, only with its CSRF token in `x-llmgw-csrf`, and only from a page of this control
plane's own origin (`Origin`, one of `page_origins`). Every call that changes something is
logged (`admin_call`) with who made it — the session's public id or "admin-credential", never
a secret — and every one that succeeds is written to the audit log (`llmgw.server.admin.audit`),
as is each login.

This control plane's origins are the addresses it is configured or advertised at, never the
request's own `Host` (which whoever sends the request chooses, a rebound DNS name's page too):
http_listen's address, or where it listens on every address (0.0.0.0, ::), which no browser
can name, the loopback names (127.0.0.1, localhost, [::1]) and the machine's host name when
nothing is advertised; the loopback names too for a loopback http_listen; each of `advertise`
at http_listen's port; `admin_url`; and `page_origins`. All with the port it is bound to.
"""

from __future__ import annotations

import html
import importlib.resources
import ipaddress
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import attrs
import trio

import llmgw.page
from llmgw.config import ServerSection
from llmgw.errors import cut, shown
from llmgw.gateway.history import History, Sources
from llmgw.http import params
from llmgw.http.errors import HTTPError
from llmgw.http.jsonbody import read_json
from llmgw.http.messages import Request, Response, StreamingResponse
from llmgw.http.refusallines import RefusalLines
from llmgw.log import get_logger
from llmgw.server.admin import audit, events, usageroutes
from llmgw.server.admin import pagefeed as feed
from llmgw.server.admin.logins import (
    CSRF_HEADER,
    LoginRefused,
    PageSession,
    SessionBook,
    clear_cookie,
    cookie_value,
    csrf_ok,
    set_cookie,
)
from llmgw.wakeup import Wakeup

if TYPE_CHECKING:
    from llmgw.server.state.keys import KeyRing
    from llmgw.server.store.asyncstore import AsyncStore


log = get_logger("llmgw.page")

CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
}
# The page loads nothing from anywhere else and may not be framed (clickjacking of the actions).
SECURITY_HEADERS = (
    (
        "content-security-policy",
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
        "base-uri 'none'; form-action 'self'; frame-ancestors 'none'",
    ),
    ("x-content-type-options", "nosniff"),
    ("x-frame-options", "DENY"),
    ("referrer-policy", "no-referrer"),
)
SAFE_METHODS = ("GET", "HEAD")
USAGE_PANEL_HOURS, USAGE_PANEL_ROWS = 24, 50  # the usage panel: its time range, and its largest rows
LOGIN_CODE = "the one-time code of a login URL (`llmgw ctl page` prints one)"
OWN_ROUTES = ("/admin/v1/events", "/admin/v1/page/login", "/admin/v1/page/session", "/admin/v1/page/logout")
CREDENTIAL = "admin-credential"

Inner = Callable[[Request], Awaitable[Response | StreamingResponse]]

WILDCARDS = ("", "0.0.0.0", "::")
LOOPBACK_NAMES = ("127.0.0.1", "localhost", "::1")  # one machine's own names for itself
DEFAULT_PORTS = {"http": 80, "https": 443}


def origin(scheme: str, host: str, port: int | None) -> str:
    """An origin as a browser writes it in `Origin` (RFC 6454 §6.2): the scheme and host in
    lower case, an IPv6 address in brackets, the port unless it is the scheme's default."""
    host = host.lower()
    host = f"[{host}]" if ":" in host else host
    return f"{scheme}://{host}" if port in (None, DEFAULT_PORTS.get(scheme)) else f"{scheme}://{host}:{port}"


def origin_of(url: str) -> str:
    """The origin of `url` (`http://HOST:PORT/any/path`): its scheme, host and port."""
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:  # out of range: no browser names it, and no change fails on it
        return f"{parts.scheme.lower()}://{parts.netloc.lower()}"
    return origin(parts.scheme.lower(), parts.hostname or "", port)


def page_origins(server: ServerSection, http_port: int, hostname: str) -> frozenset[str]:
    """Where this control plane's page may be opened (the module docstring's rule), for
    `[server]` as configured, http_listen bound to `http_port` and the machine named
    `hostname`: the only origins a page session's change is taken from."""
    listen_host = server.http_listen.rpartition(":")[0].strip("[]")
    hosts = set(server.advertise)
    if listen_host in WILDCARDS:
        hosts.update(LOOPBACK_NAMES)
        if not server.advertise:
            hosts.add(hostname)  # as admin_url's default names it (`server.seat.advertised`)
    else:
        hosts.add(listen_host)
        if listen_host in LOOPBACK_NAMES or _is_loopback(listen_host):
            hosts.update(LOOPBACK_NAMES)
    origins = {origin("http", host, http_port) for host in hosts}
    if server.admin_url:
        origins.add(origin_of(server.admin_url))
    origins.update(origin_of(o) for o in server.page_origins)
    return frozenset(origins)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host) in (ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("::1"))
    except ValueError:
        return False


@attrs.frozen(kw_only=True)
class Caller:
    who: str  # "admin-credential" or a session's public id
    session: PageSession | None = None

    @property
    def actor(self) -> str:
        """Who the audit log says made the call: "admin", or "page:" and the session's id."""
        return audit.ADMIN if self.session is None else audit.page_actor(self.session.id)


def load_assets() -> dict[str, bytes]:
    """The page's files by name, from the package (a directory, a pex or the release zipapp)."""
    root = importlib.resources.files(llmgw.page)
    return {
        f.name: f.read_bytes()
        for f in root.iterdir()
        if f.is_file() and any(f.name.endswith(suffix) for suffix in CONTENT_TYPES)
    }


def _content_type(name: str) -> str:
    return next(t for suffix, t in CONTENT_TYPES.items() if name.endswith(suffix))


class Page:
    def __init__(
        self,
        views: feed.Views,
        history: Sources,
        keys: KeyRing,
        *,
        origins: Callable[[], frozenset[str]],
        refusals: RefusalLines | None = None,
        store: AsyncStore | None = None,
    ) -> None:
        """`views`: what the feed shows of the cluster; `history`: the gateways' figures for
        the plots (`llmgw.gateway.history`); `keys`: the API keys for the keys view;
        `origins()`: this control plane's origins now (`page_origins`), the only ones a
        session's change is taken from; `refusals`: where a spent login code or a refused page
        call is logged, with the admin API's wrong credentials (`RefusalLines`: a few lines
        each interval, then counted); `store`: where the audit log is written (None: nowhere)."""
        self.store = store
        self.origins = origins
        self.refusals = refusals or RefusalLines("http")
        self.views = views
        self.keys = keys
        self.sessions = SessionBook()
        self.history = History(history)
        self._assets: dict[str, bytes] | None = None
        self.touched = Wakeup()  # an operator's change succeeded: open pages show it now
        # What every open page is sent, made once per change (`serve_feed`).
        self.feed = feed.Feed(
            views,
            keys=keys.rows,
            audit=self.recent_audit if store is not None else None,
            usage=self.recent_usage if store is not None else None,
            touched=self.touched.next,
        )

    async def recent_usage(self) -> dict:
        """The usage panel's: the ledger's totals of the last USAGE_PANEL_HOURS per key, team and
        model, the largest USAGE_PANEL_ROWS (`usageroutes.usage_view`; `llmgw ctl usage` has the rest)."""
        assert self.store is not None
        view = await usageroutes.usage_view(self.store, {"since": f"{USAGE_PANEL_HOURS}h"})
        return {
            **view,
            "rows": len(view["usage"]),
            "usage": view["usage"][:USAGE_PANEL_ROWS],
            "hours": USAGE_PANEL_HOURS,
        }

    # -- the page's own routes ------------------------------------------------------------

    @staticmethod
    def serves(path: str) -> bool:
        return path in ("/", "/index.html", "/login") or path.startswith("/page/")

    async def handle(self, request: Request) -> Response:
        if request.path == "/login":
            _allow(request, "GET")  # a HEAD must not spend the code
            return await self._login(request)
        if request.method not in SAFE_METHODS:
            raise HTTPError(
                405,
                f"{cut(request.path)} takes GET, not {cut(request.method, 20)}",
                headers=(("allow", "GET"),),
            )
        params.query(request, {})
        if self._assets is None:
            self._assets = await trio.to_thread.run_sync(load_assets)
        name = "index.html" if request.path in ("/", "/index.html") else request.path.removeprefix("/page/")
        body = self._assets.get(name)
        if body is None or name == "index.html" and request.path.startswith("/page/"):
            raise HTTPError(404, f"the cluster page has no file {shown(request.path)}", kind="not_found_error")
        headers = (("content-type", _content_type(name)), ("cache-control", "no-cache"), *SECURITY_HEADERS)
        return Response(status=200, body=body, headers=headers)  # to a HEAD the server sends no body

    async def _login(self, request: Request) -> Response:
        now = trio.current_time()
        try:
            code = params.query(request, {"code": LOGIN_CODE}).get("code", "")
        except HTTPError as exc:  # a person reads this one in a browser: a page, not JSON
            return _refusal(exc.status, exc.message)
        try:
            login = self.sessions.redeem(code, now)
        except LoginRefused as exc:
            self.refusals.refused(
                log, "page_login_refused", kind="page_login", peer=request.client, client=request.client
            )
            return _refusal(401, str(exc))
        s = login.session
        log.info(
            "page_login", session=s.id, actions=s.can_act, client=request.client, expires_in_s=round(s.expires_at - now)
        )
        if self.store is not None:
            await audit.record(
                self.store,
                actor=audit.page_actor(s.id),
                source=audit.source_of(request),
                action="page.login",
                detail={"actions": s.can_act, "expires_in_s": round(s.expires_at - now)},
            )
            self.touched.fire()  # open pages show the login
        return Response(
            status=303,
            headers=(
                ("location", "/"),  # the code is not in the address bar after this
                ("set-cookie", set_cookie(login.cookie, s.expires_at - now)),
                ("cache-control", "no-store"),
                *SECURITY_HEADERS,
            ),
        )

    async def recent_audit(self, limit: int) -> list[dict]:
        """The audit log's newest `limit` entries, for the page."""
        assert self.store is not None
        return [audit.view(r) for r in await self.store.audit(limit=limit)]

    def login_path(self, *, actions: bool = False) -> str:
        """A one-time login URL's path, for whoever holds the credential (`llmgw up` in-process)."""
        return f"/login?code={self.sessions.mint_code(trio.current_time(), can_act=actions)}"

    # -- the gate of the admin API --------------------------------------------------------

    async def guard(
        self, request: Request, authorize: Callable[[Request], None], inner: Inner
    ) -> Response | StreamingResponse:
        caller = self._caller(request, authorize)
        changing = request.method not in SAFE_METHODS
        call = audit.open_call(request, caller.actor) if changing else None
        try:
            if changing and caller.session is not None:
                self._check_change(request, caller.session)
            own = await self._admin_route(request, caller)
            response = own if own is not None else await inner(request)
        except HTTPError as exc:
            if changing:  # a refused change is logged too
                log.info("admin_call", method=request.method, path=request.path, status=exc.status, by=caller.who)
            raise
        finally:
            if call is not None:
                audit.close_call(request)  # described or not, the routes are done with it
        if call is not None:
            log.info("admin_call", method=request.method, path=request.path, status=response.status, by=caller.who)
            if response.status < 400:
                if self.store is not None:
                    await audit.record_call(self.store, request, call)
                self.touched.fire()
        return response

    def _caller(self, request: Request, authorize: Callable[[Request], None]) -> Caller:
        cookie = cookie_value(request.headers.get("cookie", ""))
        if cookie:
            session = self.sessions.lookup(cookie, trio.current_time())
            if session is not None:
                return Caller(who=session.id, session=session)
            if "authorization" not in request.headers:
                raise HTTPError(
                    401,
                    "this page's session expired or is unknown (sessions end after 12 hours, and when the control "
                    "plane restarts); run `llmgw ctl page` for a new URL",
                    kind="authentication_error",
                )
        authorize(request)  # the admin credential, as `llmgw ctl` sends it; raises 401 without it
        return Caller(who=CREDENTIAL)

    def _check_change(self, request: Request, session: PageSession) -> None:
        sent = request.headers.get("origin", "")
        ours = self.origins()
        if sent.lower() not in ours:
            self.refusals.refused(
                log,
                "page_call_refused",
                kind="page_origin",
                peer=request.client,
                session=session.id,
                path=cut(request.path),
                reason="origin",
                origin=cut(sent),
            )
            raise HTTPError(
                403,
                f"a change through a page session must come from this control plane's own page: Origin {shown(sent)} "
                f"is none of its addresses ({', '.join(sorted(ours))}); if the page is opened there, add that origin "
                "to [server] page_origins in server.toml (or its host to advertise)",
                kind="permission_error",
            )
        if not csrf_ok(session, request.headers.get(CSRF_HEADER, "")):
            self.refusals.refused(
                log,
                "page_call_refused",
                kind="page_csrf",
                peer=request.client,
                session=session.id,
                path=cut(request.path),
                reason="csrf",
            )
            raise HTTPError(
                403,
                f"a change through a page session needs the session's CSRF token in {CSRF_HEADER}; reload the page",
                kind="permission_error",
            )
        if not session.can_act and request.path != "/admin/v1/page/logout":
            raise HTTPError(
                403,
                "this page session is read-only; for one that may cordon, drain and revoke, run "
                "`llmgw ctl page --actions`",
                kind="permission_error",
            )

    async def _admin_route(self, request: Request, caller: Caller) -> Response | StreamingResponse | None:
        path = request.path
        if path in OWN_ROUTES:
            params.query(request, {})
        if path == "/admin/v1/events":
            _allow(request, "GET")
            log.info("page_events_opened", by=caller.who, client=request.client)
            return StreamingResponse(
                status=200,
                body=events.stream(
                    self.feed,
                    history=self.history,
                    session_expires_at=caller.session.expires_at if caller.session else None,
                ),
                headers=(
                    ("content-type", "text/event-stream; charset=utf-8"),
                    ("cache-control", "no-cache"),
                    ("x-accel-buffering", "no"),  # a proxy in front must not hold the events back
                ),
            )
        if path == "/admin/v1/page/login":
            _allow(request, "POST")
            if caller.session is not None:
                raise HTTPError(403, "a page session cannot make logins; use the admin credential (`llmgw ctl page`)")
            body = await read_json(request)
            body = {} if body is None else body  # no body: no actions
            if (
                not isinstance(body, dict)
                or set(body) - {"actions"}
                or not isinstance(body.get("actions", False), bool)
            ):
                raise HTTPError(400, 'the body must be {"actions": true|false} (or empty)')
            actions = body.get("actions", False)
            audit.describe(request, "page.link", actions=actions)
            return Response.json(
                201,
                {
                    "path": self.login_path(actions=actions),
                    "expires_in_s": self.sessions.code_ttl_s,
                    "actions": actions,
                },
            )
        if path == "/admin/v1/page/session":
            _allow(request, "GET")
            s = caller.session
            if s is None:
                raise HTTPError(400, "only a page session has a session; the admin credential needs none")
            return Response.json(
                200,
                {
                    "id": s.id,
                    "csrf": s.csrf,
                    "actions": s.can_act,
                    "expires_in_s": round(s.expires_at - trio.current_time()),
                },
                headers=(("cache-control", "no-store"),),
            )
        if path == "/admin/v1/page/logout":
            _allow(request, "POST")
            if caller.session is not None:
                self.sessions.end(cookie_value(request.headers.get("cookie", "")))
            audit.describe(request, "page.logout", caller.session.id if caller.session else "")
            return Response.json(200, {"ended": caller.who}, headers=(("set-cookie", clear_cookie()),))
        return None

    # -- background -----------------------------------------------------------------------

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The gateway's history for the plots: sampled from the start, not from the first page."""
        await self.history.serve(task_status=task_status)

    async def serve_feed(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The open pages' feed: looks at the cluster while a page is open (`llmgw.server.admin.pagefeed`)."""
        await self.feed.serve(task_status=task_status)


def _refusal(status: int, message: str) -> Response:
    body = (
        "<!doctype html><html lang=en><meta charset=utf-8><title>llmgw: login refused</title>"
        f"<p>{html.escape(message)}</p></html>"
    ).encode()
    headers = (("content-type", "text/html; charset=utf-8"), ("cache-control", "no-store"), *SECURITY_HEADERS)
    return Response(status=status, body=body, headers=headers)


def _allow(request: Request, method: str) -> None:
    if request.method != method:
        raise HTTPError(
            405,
            f"{cut(request.path)} takes {method}, not {cut(request.method, 20)}",
            headers=(("allow", method),),
        )
