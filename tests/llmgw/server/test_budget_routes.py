"""The budget routes of the admin API (`llmgw.server.admin.budgetroutes`) over real HTTP on
loopback, through the client `llmgw ctl` uses and `llmgw ctl budgets` itself: set, set again,
listed with what each spent (the usage ledger's, for the period), removed; refusals that say
what to fix; each change in the audit log."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import trio

from llmgw.cli import main as llmgw_main
from llmgw.ctl.client import AdminClient
from llmgw.errors import LlmgwError, UsageError
from llmgw.server.app import ControlPlane
from llmgw.wire.gateway_link import UsageRow
from testlib.controlplane import make_state, serve_plane

pytestmark = pytest.mark.trio


@pytest.fixture
async def running(tmp_path: Path, nursery: trio.Nursery) -> tuple[ControlPlane, Path]:
    state = tmp_path / "cp"
    make_state(state, sans=["127.0.0.1"], days=3)
    plane, _ = await serve_plane(state, nursery)
    return plane, state


async def call(fn, *args):
    return await trio.to_thread.run_sync(fn, *args)


async def test_budgets_are_set_listed_with_their_spending_and_removed(running, capsys) -> None:
    plane, state = running
    client = AdminClient.locate(server=None, credential=None, state_dir=str(state))
    await call(client.request, "POST", "/admin/v1/keys", {"name": "alice"})
    # What alice used today before her budget, in the ledger: counted as spent.
    hour = int(time.time() // 3600 * 3600)
    await plane.store.record_usage(
        "gw-i1", 1, [UsageRow(hour=hour, key="alice", model="chat", prompt_tokens=30, completion_tokens=70)]
    )
    answer = await call(
        client.request,
        "POST",
        "/admin/v1/budgets",
        {"scope_kind": "key", "scope": "alice", "period": "day", "tokens": 1000},
    )
    assert answer["budget"]["id"] == "key:alice::day" and answer["budget"]["tokens"] == 1000
    code = await trio.to_thread.run_sync(
        llmgw_main,
        ["ctl", "budgets", "set", "--key", "alice", "--period", "day", "--tokens", "2000", "--state-dir", str(state)],
    )
    assert code == 0 and "budget key:alice::day: 2000 tokens a day" in capsys.readouterr().out
    code = await trio.to_thread.run_sync(llmgw_main, ["ctl", "budgets", "list", "--json", "--state-dir", str(state)])
    [listed] = json.loads(capsys.readouterr().out)
    assert (listed["tokens"], listed["spent"], listed["remaining"]) == (2000, 100, 1900), listed
    assert listed["resets_at"] - listed["period_start"] == 86400
    assert [b.tokens for b in await plane.store.budgets()] == [2000]  # one row, its new amount
    entries = [(e.action, e.target) for e in await plane.store.audit(action="budget")]
    assert ("budget.set", "key:alice::day") in entries
    code = await trio.to_thread.run_sync(
        llmgw_main, ["ctl", "budgets", "remove", "key:alice::day", "--state-dir", str(state)]
    )
    assert code == 0 and await plane.store.budgets() == []
    assert ("budget.remove", "key:alice::day") in [
        (e.action, e.target) for e in await plane.store.audit(action="budget")
    ]


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"scope_kind": "key", "scope": "ghost", "period": "day", "tokens": 5}, "no valid key named 'ghost'"),
        ({"scope_kind": "team", "scope": "red", "period": "day", "tokens": 5}, "no team named 'red'"),
        (
            {"scope_kind": "key", "scope": "alice", "period": "week", "tokens": 5},
            "period 'week' is none of minute, day, month",
        ),
        ({"scope_kind": "key", "scope": "alice", "period": "day", "tokens": 0}, "tokens must be a whole number from 1"),
        ({"scope_kind": "org", "scope": "alice", "period": "day", "tokens": 5}, "a key's or a team's"),
        ({"scope_kind": "key", "scope": "alice", "period": "day", "tokens": 5, "x": 1}, "unknown fields ['x']"),
    ],
)
async def test_a_bad_budget_is_400_saying_what_to_fix(running, body, says) -> None:
    plane, state = running
    client = AdminClient.locate(server=None, credential=None, state_dir=str(state))
    await call(client.request, "POST", "/admin/v1/keys", {"name": "alice"})
    with pytest.raises(LlmgwError) as info:
        await call(client.request, "POST", "/admin/v1/budgets", body)
    assert says in str(info.value) and "HTTP 400" in str(info.value), str(info.value)
    assert await plane.store.budgets() == []


async def test_removing_an_unknown_budget_is_404_naming_the_budgets(running) -> None:
    _, state = running
    client = AdminClient.locate(server=None, credential=None, state_dir=str(state))
    with pytest.raises(UsageError) as info:
        await call(client.request, "DELETE", "/admin/v1/budgets/key:nobody::day")
    assert "no budget 'key:nobody::day' (budgets: none)" in str(info.value) and "HTTP 404" in str(info.value)
