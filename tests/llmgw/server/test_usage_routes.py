"""The admin API's teams and usage routes (`llmgw.server.admin.usageroutes`) on a real store
(SQLite): the ledger's totals by the query's filters and groups, the times `since`/`until` take,
refusals naming what is wrong, and teams made and removed (409 while a key belongs to one)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import trio

from llmgw.http.errors import HTTPError
from llmgw.http.messages import Request
from llmgw.server.admin import usageroutes
from llmgw.server.errors import TeamError, TeamInUse, UnknownTeam
from llmgw.server.state.keys import KeyRing
from llmgw.server.store.asyncstore import AsyncStore
from llmgw.wire.gateway_link import UsageRow

pytestmark = pytest.mark.trio
H = 1765080000  # 2025-12-07T04:00:00Z


def _get(path: str, **query: str) -> Request:
    return Request.of("GET", path, query={k: [v] for k, v in query.items()})


async def test_usage_totals_by_filter_group_and_time(tmp_path: Path) -> None:
    store = AsyncStore.open(tmp_path)
    rows = (
        UsageRow(hour=H, key="alice", team="t", model="a", requests=2, prompt_tokens=10, completion_tokens=4),
        UsageRow(hour=H + 3600, key="bob", team="", model="a", requests=1, prompt_tokens=1, completion_tokens=1),
    )
    await store.record_usage("gw", 1, rows)
    answer = await usageroutes.usage_routes(store, _get("/admin/v1/usage"), now=H + 7200)
    body = json.loads(answer.body)
    assert body["group"] == ["key", "team", "model"] and body["since"] is None
    assert body["usage"][0] == {
        "key": "alice",
        "team": "t",
        "model": "a",
        "requests": 2,
        "prompt_tokens": 10,
        "cached_tokens": 0,
        "completion_tokens": 4,
        "total_tokens": 14,
    }
    assert body["total"]["requests"] == 3 and body["total"]["total_tokens"] == 16
    # 90m before H + 2h is H + 30m: from the hour holding it, H (the rows of H and H + 1h).
    for since in ("90m", str(H + 1800), "2025-12-07T04:30:00Z", "2025-12-07T04:30"):
        view = await usageroutes.usage_view(store, {"since": since, "group": "model"}, now=H + 7200)
        assert view["since"] == "2025-12-07T04:00:00Z" and view["usage"][0]["requests"] == 3, since
    view = await usageroutes.usage_view(store, {"until": "2025-12-07T05:00Z", "group": ""}, now=H + 7200)
    assert view["usage"] == [{**view["total"]}] and view["total"]["requests"] == 2
    view = await usageroutes.usage_view(store, {"team": "t", "group": "team"}, now=H)
    assert [r["team"] for r in view["usage"]] == ["t"]
    for bad, says in (
        ({"since": "yesterday"}, "since 'yesterday' is not a time"),
        ({"group": "hour"}, "group takes a comma list of key, team, model"),
        ({"key": "a b"}, "key 'a b' is not a key's name"),
    ):
        with pytest.raises(HTTPError, match=says):
            await usageroutes.usage_view(store, bad, now=H)
    with pytest.raises(HTTPError, match="no query parameter .hour."):
        await usageroutes.usage_routes(store, _get("/admin/v1/usage", hour="1"))
    store.close()


async def test_teams_are_made_listed_and_removed_only_without_keys(tmp_path: Path) -> None:
    store = AsyncStore.open(tmp_path)
    made = await usageroutes.usage_routes(store, Request.of("POST", "/admin/v1/teams", body=b'{"name": "research"}'))
    assert made.status == 201
    with pytest.raises(TeamError, match="team name 'no way' is not valid"):
        await usageroutes.usage_routes(store, Request.of("POST", "/admin/v1/teams", body=b'{"name": "no way"}'))
    keys = KeyRing(store)
    with pytest.raises(UnknownTeam, match="llmgw ctl teams create other"):
        await keys.create("k0", team="other")
    row, _ = await keys.create("k1", team="research")
    assert row.team == "research" and keys.gateway_keys()[0].team == "research"
    listed = json.loads((await usageroutes.usage_routes(store, _get("/admin/v1/teams"))).body)
    assert [(t["name"], t["keys"]) for t in listed["teams"]] == [("research", 1)]
    with pytest.raises(TeamInUse, match="k1"):
        await usageroutes.usage_routes(store, Request.of("DELETE", "/admin/v1/teams/research"))
    await keys.revoke("k1")
    removed = await usageroutes.usage_routes(store, Request.of("DELETE", "/admin/v1/teams/research"))
    assert json.loads(removed.body) == {"removed": "research"}
    await trio.lowlevel.checkpoint()
    store.close()
