"""The audit log: every admin action, recorded in the store with who made it, when, from where
and what it changed (`audit_log`, `Store.record_audit`), read back by `GET /admin/v1/audit`,
`llmgw ctl audit` and the cluster page.

Who: `ADMIN` ("admin") for the admin credential — there is one, `admin.token` in the control
plane's state directory, and every copy of it (`llmgw ctl --credential FILE` elsewhere) is the
same credential, so the source tells the machines apart — or "page:" and a cluster page
session's public id ("page:s-1a2b3c4d", which `llmgw ctl page` made). From where: the peer's
host (relayed by a gateway worker: the client it relayed). When: the control plane's clock.

How an action gets here: the admin API's gate (`page.Page.guard`) opens a `Call` for each
request (`open_call`); a route that changes something says what (`describe(request, action,
target, **detail)`); once the route has answered with success the gate writes the entry
(`record_call`). A change no route described is recorded all the same, as `admin.call` with its
method and path. A refused change (4xx, 5xx) changed nothing and is not recorded here (the
`admin_call` log line has it). A page login, which is no admin API call, is written directly
(`record`).

Nothing secret: a field named like a secret (`SECRET_FIELDS`) is written as "(given)" or left
out, whatever the route passed, and a detail is kept small (strings cut at `MAX_TEXT`, lists at
`MAX_ITEMS`). A store that refuses the write does not undo the action, which has happened: the
entry is logged instead (`audit_not_recorded`, every field), so it is not lost.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs
import trio

from llmgw.errors import shown
from llmgw.http import params
from llmgw.http.errors import HTTPError
from llmgw.http.messages import Request, Response, allow, client_host
from llmgw.log import get_logger
from llmgw.server.errors import StoreError

if TYPE_CHECKING:
    from llmgw.server.store import AuditRow
    from llmgw.server.store.asyncstore import AsyncStore

log = get_logger("llmgw.audit")

ADMIN = "admin"  # the admin credential's name
PAGE = "page:"  # a page session's actor: PAGE + its public id
UNDESCRIBED = "admin.call"  # a change whose route said nothing: its method and path
SECRET_FIELDS = frozenset({"token", "secret", "password", "credential", "cookie", "csrf", "code", "authorization"})
MAX_TEXT = 200
MAX_ITEMS = 64
MAX_DEPTH = 4

DAY_S = 86400.0
DEFAULT_KEEP_DAYS = 365.0


def page_actor(session_id: str) -> str:
    return PAGE + session_id


@attrs.define
class Call:
    """One admin API call being served: who makes it, from where, and what it changes once a
    route has said (`describe`)."""

    actor: str
    source: str
    action: str = ""
    target: str = ""
    detail: dict[str, Any] = attrs.field(factory=dict)


_calls: weakref.WeakKeyDictionary[Request, Call] = weakref.WeakKeyDictionary()


def open_call(request: Request, actor: str) -> Call:
    """The gate's: `request` is served for `actor`; the routes may now `describe` it."""
    call = Call(actor=actor, source=source_of(request))
    _calls[request] = call
    return call


def describe(request: Request, action: str, target: str = "", **detail: Any) -> None:
    """What the admin call `request` changes: `action` ("key.create", "node.drain": a family, a
    dot, a verb), what it acted on (a key's, node's or model's name) and the fields that changed.
    Called by the route that makes the change, before it answers; written by the gate once the
    answer is a success. A request that is no admin call (a test's) is ignored."""
    call = _calls.get(request)
    if call is not None:
        call.action, call.target, call.detail = action, target, small(detail)


def source_of(request: Request) -> str:
    return client_host(request.client)


def small(detail: dict[str, Any]) -> dict[str, Any]:
    """`detail` with nothing secret in it and small enough to keep: a secret's field says
    "(given)" (or is left out when empty), strings are cut at MAX_TEXT, lists at MAX_ITEMS."""
    return _small(detail, 0)


def _small(value: Any, depth: int) -> Any:
    if isinstance(value, dict):
        out = {}
        for key, item in list(value.items())[:MAX_ITEMS]:
            key = str(key)[:MAX_TEXT]
            if key.lower() in SECRET_FIELDS:
                if item:
                    out[key] = "(given)"
                continue
            out[key] = _small(item, depth + 1) if depth < MAX_DEPTH else "…"
        return out
    if isinstance(value, (list, tuple, set, frozenset)):
        items = sorted(value) if isinstance(value, (set, frozenset)) else list(value)
        kept = [_small(v, depth + 1) if depth < MAX_DEPTH else "…" for v in items[:MAX_ITEMS]]
        return kept + ([f"… {len(items) - MAX_ITEMS} more"] if len(items) > MAX_ITEMS else [])
    if isinstance(value, str):
        return value if len(value) <= MAX_TEXT else value[: MAX_TEXT - 1] + "…"
    if value is None or isinstance(value, (bool, int, float)):
        return value
    return _small(str(value), depth)


async def record(
    store: AsyncStore,
    *,
    actor: str,
    source: str,
    action: str,
    target: str = "",
    detail: dict[str, Any] | None = None,
) -> AuditRow | None:
    """Write one entry (what `record_call` and a page login do; anything else that acts for an
    operator outside the admin API's routes may call it too). `detail` is made `small` here.
    The row written, or None if the store refused it: then the entry is logged instead."""
    detail = small(detail or {})
    try:
        row = await store.record_audit(actor=actor, source=source, action=action, target=target, detail=detail)
    except StoreError as exc:
        log.warning(
            "audit_not_recorded",
            actor=actor,
            source=source,
            action=action,
            target=target,
            detail=detail,
            reason=str(exc),
            after="the action was made; this line is its only record",
        )
        return None
    log.info("audit", actor=actor, source=source, action=action, target=target)
    return row


async def record_call(store: AsyncStore, request: Request, call: Call) -> AuditRow | None:
    """The gate's, once `request` was answered with success: the entry its route described, or
    `UNDESCRIBED` with its method and path."""
    if not call.action:
        return await record(
            store,
            actor=call.actor,
            source=call.source,
            action=UNDESCRIBED,
            target=request.path,
            detail={"method": request.method},
        )
    return await record(
        store, actor=call.actor, source=call.source, action=call.action, target=call.target, detail=call.detail
    )


def close_call(request: Request) -> None:
    """The gate's, once the routes have answered: `describe` on `request` does nothing after."""
    _calls.pop(request, None)


ROUTE = "/admin/v1/audit"
DEFAULT_LIMIT = 100
MAX_LIMIT = 10_000  # the store's MAX_AUDIT_ROWS
MAX_FILTER = 200
QUERY = {
    "since": "unix seconds: entries from then on",
    "until": "unix seconds: entries before then",
    "action": "an action (key.create) or its family (key)",
    "actor": "admin, page (every page session) or page:SESSION",
    "target": "a key's, node's or model's name",
    "limit": f"how many entries at most, newest first, 1 to {MAX_LIMIT} (default {DEFAULT_LIMIT})",
}


async def listing(store: AsyncStore, request: Request) -> Response:
    """GET /admin/v1/audit[?since=&until=&action=&actor=&target=&limit=]: newest first."""
    allow(request, "GET")
    q = params.query(request, QUERY)
    filters: dict[str, Any] = {}
    for name in ("since", "until"):
        if name in q:
            filters[name] = _seconds(q[name], name)
    for name in ("action", "actor", "target"):
        value = q.get(name, "")
        if len(value) > MAX_FILTER:
            raise HTTPError(400, f"{name} is {len(value)} characters; give at most {MAX_FILTER}")
        filters[name] = value
    filters["limit"] = params.whole_number(q["limit"], "limit", 1, MAX_LIMIT) if "limit" in q else DEFAULT_LIMIT
    rows = await store.audit(**filters)
    return Response.json(200, {"entries": [view(r) for r in rows]})


def _seconds(given: str, name: str) -> float:
    try:
        value = float(given)
    except ValueError:
        value = float("nan")
    if not 0 <= value < 1e11:  # NaN too
        raise HTTPError(400, f"{name} must be a time in unix seconds (a number from 0), got {shown(given)}")
    return value


def view(row: AuditRow) -> dict[str, Any]:
    """An entry as the admin API, `llmgw ctl audit` and the page show it."""
    return {
        "id": row.id,
        "at": row.at,
        "actor": row.actor,
        "source": row.source,
        "action": row.action,
        "target": row.target,
        "detail": row.detail,
    }


async def serve_pruning(
    store: AsyncStore,
    keep_days: Callable[[], float],
    *,
    now: Callable[[], float] = time.time,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """The leader's: once at start and then every day, forget the entries older than
    `keep_days()` days (0: keep them all). `now()`: unix seconds (time.time). A store that
    refuses is tried again the next day (logged): the log only grows a day longer."""
    task_status.started()
    while True:
        days = float(keep_days())
        if days > 0:
            try:
                gone = await store.prune_audit(now() - days * DAY_S)
            except StoreError as exc:
                log.warning("audit_prune_failed", reason=str(exc), retry="in a day")
            else:
                if gone:
                    log.info("audit_pruned", entries=gone, kept_days=days)
        await trio.sleep(DAY_S)
