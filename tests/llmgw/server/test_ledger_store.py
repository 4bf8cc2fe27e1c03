"""The usage ledger and the teams in the store (`llmgw.server.store.ledger`), in both backends
(`store_backend`: the state directory's SQLite file, and a real PostgreSQL database): a report
added once however often it is sent, in one transaction with its sequence; totals by key, team
and model over hours; a team removed only while no valid key belongs to it."""

from __future__ import annotations

import time

import pytest

from llmgw.server.errors import TeamExists, TeamInUse, UnknownTeam
from llmgw.server.store import KeyRow
from llmgw.server.store.ledger import UsageTotal
from llmgw.wire.gateway_link import UsageRow
from testlib.stores import StoreUnderTest

H = 1765080000  # an hour's start (a multiple of 3600)


def _row(key: str, model: str, *, team: str = "", hour: int = H, n: int = 1, p: int = 10, c: int = 0, o: int = 5):
    return UsageRow(
        hour=hour,
        key=key,
        team=team,
        model=model,
        requests=n,
        prompt_tokens=p,
        cached_tokens=c,
        completion_tokens=o,
    )


def test_a_report_sent_twice_is_counted_once_and_survives_a_restart(store_backend: StoreUnderTest) -> None:
    store = store_backend.open()
    rows = (_row("k1", "m", team="t", c=4), _row("k2", "m"))
    assert store.record_usage("gw-a", 1, rows)
    assert not store.record_usage("gw-a", 1, rows)  # again (a reconnect, a new leader): nothing added
    assert store.record_usage("gw-b", 1, rows)  # another instance's first
    assert store.record_usage("gw-a", 2, (_row("k1", "m", team="t", hour=H + 3600),))
    assert not store.record_usage("gw-a", 1, rows)  # an older one: nothing
    store.close()
    store = store_backend.open()  # a restart
    assert store.usage_report_seq("gw-a") == 2 and store.usage_report_seq("gw-c") == 0
    assert store.usage() == [
        UsageTotal(key="k1", team="t", model="m", requests=3, prompt_tokens=30, cached_tokens=8, completion_tokens=15),
        UsageTotal(key="k2", team="", model="m", requests=2, prompt_tokens=20, completion_tokens=10),
    ]


def test_totals_by_key_team_and_model_over_hours(store_backend: StoreUnderTest) -> None:
    store = store_backend.open()
    store.record_usage(
        "gw",
        1,
        (
            _row("k1", "a", team="t", p=100),
            _row("k1", "b", team="t", hour=H + 3600),
            _row("k2", "a", team="u", hour=H + 7200, p=1, o=1),
        ),
    )
    by_team = store.usage(group=("team",))
    assert [(t.team, t.requests, t.prompt_tokens) for t in by_team] == [("t", 2, 110), ("u", 1, 1)]
    assert by_team[0].key == "" and by_team[0].model == ""
    assert [(t.model, t.requests) for t in store.usage(group=("model",))] == [("a", 2), ("b", 1)]
    assert store.usage(key="k1", model="b", group=()) == [UsageTotal(requests=1, prompt_tokens=10, completion_tokens=5)]
    # since and until cut at whole hours: since the hour holding it, until the hour before the one holding it
    assert [t.model for t in store.usage(since=H + 3600 + 59)] == ["b", "a"]
    assert [t.model for t in store.usage(until=H + 3600)] == ["a"]
    assert [t.model for t in store.usage(until=H + 3601)] == ["a", "b"]
    assert store.usage(team="nobody") == []
    with pytest.raises(ValueError):
        store.usage(group=("hour",))


def test_a_team_is_removed_only_while_no_valid_key_belongs_to_it(store_backend: StoreUnderTest) -> None:
    store = store_backend.open()
    store.add_team("research", now=1.0)
    with pytest.raises(TeamExists, match="research"):
        store.add_team("research")
    row = KeyRow(
        name="ci",
        token_sha256="ab" * 32,
        models=(),
        rate_per_minute=0,
        max_concurrency=0,
        created_at=time.time(),
        revoked_at=None,
        team="research",
    )
    assert store.add_api_key(row)
    assert store.api_keys()[0].team == "research"
    [team] = store.teams()
    assert (team.name, team.created_at, team.keys) == ("research", 1.0, 1)
    with pytest.raises(TeamInUse, match="1 valid key.*ci.*llmgw ctl keys revoke"):
        store.remove_team("research")
    store.revoke_api_key("ci")
    store.remove_team("research")
    assert store.teams() == [] and not store.has_team("research")
    with pytest.raises(UnknownTeam, match="no team named 'research'"):
        store.remove_team("research")
