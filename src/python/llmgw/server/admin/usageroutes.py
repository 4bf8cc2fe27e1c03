"""The admin API's routes for who used what (issue 48): the teams keys belong to, and the ledger.

    GET    /admin/v1/teams              the teams, with how many valid keys each has
    POST   /admin/v1/teams              create one: {name}; 201
    DELETE /admin/v1/teams/NAME         remove one; 409 while a valid key belongs to it
    GET    /admin/v1/usage              the ledger's totals: ?key=&team=&model= (one each, all when
                                        left out), since=&until= (unix seconds, an ISO 8601 date or
                                        time in UTC, or a while ago: 90m, 24h, 7d; cut at whole
                                        hours), group= (a comma list of key, team, model; default
                                        all three; "" one total)

A key's team is named when it is made (`POST /admin/v1/keys` {team}); its usage is counted under
the team it had then. The ledger's hours are UTC. Each change is described for the audit log
(`team.create`, `team.remove`). The routes are reached, and their caller authorized, through
`api.AdminAPI`; domain errors become statuses there (`api.ANSWERS`).
"""

from __future__ import annotations

import datetime as dt
import re
import time
from typing import TYPE_CHECKING, Any

from llmgw.errors import shown
from llmgw.http import params
from llmgw.http.errors import HTTPError
from llmgw.http.jsonbody import read_json
from llmgw.http.messages import Request, Response, allow
from llmgw.log import get_logger
from llmgw.server.admin import audit
from llmgw.server.errors import TeamError
from llmgw.server.state.keys import KEY_NAME, KEY_NAME_RULE, MODEL_NAME
from llmgw.server.store.ledger import GROUPS, UsageTotal

if TYPE_CHECKING:
    from llmgw.server.store.asyncstore import AsyncStore

log = get_logger("llmgw.admin")

TEAMS = "/admin/v1/teams"
USAGE = "/admin/v1/usage"
_TEAM = re.compile(r"^/admin/v1/teams/([^/]+)$")
TEAM_NAME, TEAM_NAME_RULE = KEY_NAME, KEY_NAME_RULE  # the same grammar as a key's name
USAGE_QUERY = {
    "key": "a key's name",
    "team": "a team's name",
    "model": "a model's name",
    "since": "unix seconds, an ISO 8601 date or time (UTC), or a while ago (90m, 24h, 7d)",
    "until": "as since",
    "group": "a comma list of key, team, model",
}
_AGO = re.compile(r"(\d{1,6})([mhd])")
_AGO_S = {"m": 60, "h": 3600, "d": 86400}
_SECONDS = re.compile(r"\d{1,12}(\.\d{1,9})?")


def serves(path: str) -> bool:
    return path in (TEAMS, USAGE) or _TEAM.match(path) is not None


async def usage_routes(store: AsyncStore, request: Request, now: float | None = None) -> Response:
    if request.path == USAGE:
        allow(request, "GET")
        return Response.json(200, await usage_view(store, params.query(request, USAGE_QUERY), now))
    params.query(request, {})
    found = _TEAM.match(request.path)
    if found is not None:
        allow(request, "DELETE")
        name = team_name(params.path_segment(found.group(1), "team name"))
        await store.remove_team(name)
        audit.describe(request, "team.remove", name)
        log.info("team_removed", team=name)
        return Response.json(200, {"removed": name})
    if request.method in ("GET", "HEAD"):
        teams = [{"name": t.name, "created_at": t.created_at, "keys": t.keys} for t in await store.teams()]
        return Response.json(200, {"teams": teams})
    allow(request, "POST")
    body = await read_json(request)
    if not isinstance(body, dict) or sorted(body) != ["name"]:
        raise HTTPError(400, f"the body must be a JSON object with a team's name alone: {{name}}, got {shown(body)}")
    name = team_name(body["name"])
    await store.add_team(name)
    audit.describe(request, "team.create", name)
    log.info("team_created", team=name)
    return Response.json(201, {"team": {"name": name, "keys": 0}})


def team_name(name: Any) -> str:
    if not isinstance(name, str) or not TEAM_NAME.fullmatch(name):
        raise TeamError(f"team name {shown(name)} is not valid: {TEAM_NAME_RULE}")
    return name


async def usage_view(store: AsyncStore, q: dict[str, str], now: float | None = None) -> dict[str, Any]:
    """The ledger's totals as `GET /admin/v1/usage` answers them (the cluster page's panel too)."""
    now = time.time() if now is None else now
    for field, grammar in (("key", KEY_NAME), ("team", TEAM_NAME), ("model", MODEL_NAME)):
        value = q.get(field, "")
        if value and not grammar.fullmatch(value):
            raise HTTPError(400, f"{field} {shown(value)} is not a {field}'s name")
    since = when(q["since"], "since", now) if q.get("since") else None
    until = when(q["until"], "until", now) if q.get("until") else None
    group = [g.strip() for g in q.get("group", ",".join(GROUPS)).split(",") if g.strip()]
    bad = [g for g in group if g not in GROUPS]
    if bad:
        raise HTTPError(400, f"group takes a comma list of {', '.join(GROUPS)}, got {shown(q['group'])}")
    rows = await store.usage(
        key=q.get("key", ""), team=q.get("team", ""), model=q.get("model", ""), since=since, until=until, group=group
    )
    total = UsageTotal(
        requests=sum(r.requests for r in rows),
        prompt_tokens=sum(r.prompt_tokens for r in rows),
        cached_tokens=sum(r.cached_tokens for r in rows),
        completion_tokens=sum(r.completion_tokens for r in rows),
    )
    return {
        "group": group,
        "since": _iso(since // 3600 * 3600) if since is not None else None,
        "until": _iso(-(-until // 3600) * 3600) if until is not None else None,
        "usage": [usage_row(r, group) for r in rows],
        "total": usage_row(total, []),
    }


def usage_row(t: UsageTotal, group: list[str]) -> dict[str, Any]:
    named: dict[str, Any] = {g: getattr(t, g) for g in GROUPS if g in group}
    return {
        **named,
        "requests": t.requests,
        "prompt_tokens": t.prompt_tokens,
        "cached_tokens": t.cached_tokens,
        "completion_tokens": t.completion_tokens,
        "total_tokens": t.prompt_tokens + t.completion_tokens,
    }


def when(value: str, name: str, now: float) -> float:
    """A time of `since` or `until`: unix seconds, an ISO 8601 date or time (UTC unless it says),
    or a while before `now` (90m, 24h, 7d)."""
    if (ago := _AGO.fullmatch(value)) is not None:
        return now - int(ago.group(1)) * _AGO_S[ago.group(2)]
    if _SECONDS.fullmatch(value):
        return float(value)
    try:
        parsed = dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise HTTPError(
            400,
            f"{name} {shown(value)} is not a time: give unix seconds, an ISO 8601 date or time in UTC "
            "(2026-12-07, 2026-12-07T13:00), or a while ago (90m, 24h, 7d)",
        ) from None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=dt.timezone.utc)
    return parsed.timestamp()


def _iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))
