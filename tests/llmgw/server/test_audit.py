"""The audit log on a served control plane (issue 48): every admin action made through the real
admin API — with the credential, as `llmgw ctl` sends it, and from a cluster page session — is
recorded with who, from where and what changed, read back by GET /admin/v1/audit with its filters
and by `llmgw ctl audit`; no token, cookie, CSRF token or login code is in it. Then the entry
made directly (`audit.record`) when the store refuses it, `small`, and the leader's pruning on a
fake clock."""

from __future__ import annotations

import json
import logging
import subprocess
import time
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio
from trio.testing import wait_all_tasks_blocked

from llmgw import paths
from llmgw.config import ServerConfig, load_server_config
from llmgw.ctl.client import AdminClient
from llmgw.errors import PeerError
from llmgw.server.admin import audit
from llmgw.server.admin import pagefeed as feed
from llmgw.server.app import ControlPlane
from llmgw.server.errors import StoreBusy
from testlib.controlplane import OFFLINE_ENGINES, make_state
from testlib.hubrepos import gguf_repo
from testlib.hubserver import HubServer
from testlib.pageclient import Browser, Feed
from testlib.proc import run_llmgw

pytestmark = pytest.mark.trio

REPO = "llmgw-tests/Tiny-GGUF"
HUB_TOKEN = "hf_AUDIT_secret_never_kept_0123456789"


async def call(fn, *args, **kw):
    return await trio.to_thread.run_sync(lambda: fn(*args, **kw))


@pytest.fixture
async def served(tmp_path: Path, nursery: trio.Nursery):
    """A control plane with a server.toml (reload), [debug] allow_stall, [hub] on a test Hub whose
    gated repository takes HUB_TOKEN, and one known node."""
    with HubServer([gguf_repo(REPO, model="Tiny", gated="auto", token=HUB_TOKEN)]) as hub:
        state = tmp_path / "cp"
        make_state(state, sans=["127.0.0.1"], days=3)
        toml = tmp_path / "server.toml"
        toml.write_text(
            f'[server]\nstate_dir = "{state}"\nagent_listen = "127.0.0.1:0"\nhttp_listen = "127.0.0.1:0"\n'
            f'[hub]\nendpoint = "{hub.url}"\n[debug]\nallow_stall = true\n'
            '[[models]]\nname = "chat"\nengine = "sim"\n'
        )
        config = load_server_config(toml)
        config = ServerConfig(
            server=config.server, hub=config.hub, debug=config.debug, engines=OFFLINE_ENGINES, models=config.models
        )
        plane = ControlPlane.open(config, state, toml)
        await nursery.start(plane.serve)
        await plane.store.saw_node("n1", "127.0.0.5")
        plane.registry.know("n1", address="127.0.0.5")
        yield plane, state, AdminClient.locate(server=None, credential=None, state_dir=str(state))


async def test_every_admin_action_is_recorded_with_who_where_and_what_and_nothing_secret(served) -> None:
    plane, state, client = served
    ask = client.request
    made = await call(
        ask, "POST", "/admin/v1/keys", {"name": "ci", "models": ["chat"], "rate_per_minute": 60, "max_concurrency": 2}
    )
    key_token = made["token"]
    await call(ask, "DELETE", "/admin/v1/keys/ci")
    with pytest.raises(PeerError):  # refused: nothing changed, nothing recorded
        await call(ask, "POST", "/admin/v1/keys", {"name": "bad name!"})
    await call(client.cordon, "n1", True)
    await call(client.cordon, "n1", False)
    await call(ask, "POST", "/admin/v1/nodes/n1/drain")
    await call(ask, "DELETE", "/admin/v1/nodes/n1")  # before the model: a node of no memory would refuse it
    await call(ask, "POST", "/admin/v1/reload")
    body = {"serial": "48879", "node_id": "n2", "not_after": 2e9, "revoke_others": True}
    await call(ask, "POST", "/admin/v1/certificates", body)
    added = {"name": "tiny", "hf": REPO, "quant": "Q8_0", "token": HUB_TOKEN, "args": ["--ctx-size", "512"]}
    await call(ask, "POST", "/admin/v1/models", added)
    await call(ask, "POST", "/admin/v1/models/tiny/update", {"args": ["--ctx-size", "1024"]})
    await call(ask, "DELETE", "/admin/v1/models/tiny")
    await call(ask, "POST", "/admin/v1/debug/stall?seconds=0.01")
    # A page session: the link the credential mints, the login, a change, the logout.
    link = await call(ask, "POST", "/admin/v1/page/login", {"actions": True})
    browser = Browser(client.url)
    await call(browser.sign_in, link["path"])
    await plane.store.saw_node("n3", "127.0.0.6")
    plane.registry.know("n3", address="127.0.0.6")
    assert await call(browser.change, "POST", "/admin/v1/nodes/n3/cordon") == 200
    assert await call(browser.change, "POST", "/admin/v1/page/logout") == 200

    entries = (await call(ask, "GET", "/admin/v1/audit"))["entries"]
    page = audit.page_actor(browser.id)
    assert [(e["actor"], e["action"], e["target"]) for e in reversed(entries)] == [
        ("admin", "key.create", "ci"),
        ("admin", "key.revoke", "ci"),
        ("admin", "node.cordon", "n1"),
        ("admin", "node.uncordon", "n1"),
        ("admin", "node.drain", "n1"),
        ("admin", "node.remove", "n1"),
        ("admin", "config.reload", ""),
        ("admin", "certificate.record", "n2"),
        ("admin", "model.add", "tiny"),
        ("admin", "model.update", "tiny"),
        ("admin", "model.remove", "tiny"),
        ("admin", "debug.stall", ""),
        ("admin", "page.link", ""),
        (page, "page.login", ""),
        (page, "node.cordon", "n3"),
        (page, "page.logout", browser.id),
    ]
    assert {e["source"] for e in entries} == {"127.0.0.1"}
    assert entries == sorted(entries, key=lambda e: (e["at"], e["id"]), reverse=True)
    assert all(time.time() - 60 < e["at"] <= time.time() for e in entries)
    detail = {e["action"]: e["detail"] for e in entries if e["actor"] == "admin"}
    assert detail["key.create"] == {"models": ["chat"], "rate_per_minute": 60, "max_concurrency": 2, "team": ""}
    assert detail["node.drain"] == {"force": False}
    assert detail["config.reload"] == {"models": ["chat"], "nodes_changed": []}
    assert detail["certificate.record"] == {
        "serial": "beef",
        "not_after": 2e9,
        "revoke_others": True,
        "revoked_serials": [],
    }
    assert detail["model.add"] == {
        "hf": REPO,
        "quant": "Q8_0",
        "args": ["--ctx-size", "512"],
        "replicas": 1,
        "nodes_per_replica": 1,
        "token": "(given)",
    }
    assert detail["model.update"] == {"args": ["--ctx-size", "1024"]}
    assert detail["debug.stall"] == {"seconds": 0.01}
    assert detail["page.link"] == {"actions": True}
    [login] = [e for e in entries if e["action"] == "page.login"]
    assert login["detail"] == {"actions": True, "expires_in_s": 43200}

    # Nothing secret: not the key's token, the Hub token, the credential, the cookie, the CSRF
    # token or the login code, in the answer or in the store's rows.
    stored = json.dumps([audit.view(r) for r in await plane.store.audit(limit=10_000)])
    credential = paths.admin_token_path(state).read_text().strip()
    code = link["path"].split("code=", 1)[1]
    for secret in (key_token, HUB_TOKEN, credential, browser.cookie.split("=", 1)[1], browser.csrf, code):
        assert secret not in stored and secret not in json.dumps(entries)

    # Filters: an action's family, every page session, a target, a time, a limit.
    def listed(query: str) -> list[tuple[str, str]]:
        return [(e["action"], e["target"]) for e in ask("GET", "/admin/v1/audit?" + query)["entries"]]

    assert await call(listed, "action=key") == [("key.revoke", "ci"), ("key.create", "ci")]
    assert await call(listed, "actor=page&action=node") == [("node.cordon", "n3")]
    assert await call(listed, "target=n1&limit=2") == [("node.remove", "n1"), ("node.drain", "n1")]
    assert len(await call(listed, "target=n1")) == 4
    cut = entries[2]["at"]
    assert len(await call(listed, f"since={cut!r}")) == 3
    assert await call(listed, f"until={entries[-1]['at']!r}") == []
    for bad, says in (("since=yesterday", "unix seconds"), ("limit=0", "limit"), ("who=me", "who")):
        with pytest.raises(PeerError) as refused:
            await call(ask, "GET", "/admin/v1/audit?" + bad)
        assert "HTTP 400" in str(refused.value) and says in str(refused.value)


async def ctl(*args: str) -> subprocess.CompletedProcess:
    return await trio.to_thread.run_sync(lambda: run_llmgw("ctl", *args, timeout=60))


async def test_ctl_audit_prints_the_log_and_its_filters(served) -> None:
    plane, state, _ = served
    where = ("--state-dir", str(state))
    made = await ctl("keys", "create", "ci", "--models", "chat", "--rate-per-minute", "60", "--json", *where)
    token = json.loads(made.stdout)["token"]
    assert (await ctl("cordon", "n1", *where)).returncode == 0
    assert (await ctl("keys", "revoke", "ci", *where)).returncode == 0

    shown = await ctl("audit", *where)
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert lines[0].split() == ["TIME", "(UTC)", "ACTOR", "SOURCE", "ACTION", "TARGET", "DETAIL"]
    assert [line.split()[2:6] for line in lines[1:]] == [
        ["admin", "127.0.0.1", "key.revoke", "ci"],
        ["admin", "127.0.0.1", "node.cordon", "n1"],
        ["admin", "127.0.0.1", "key.create", "ci"],
    ]
    assert lines[3].endswith("max_concurrency=0 models=chat rate_per_minute=60 team=")  # the fields by name
    assert token not in shown.stdout

    keys = json.loads((await ctl("audit", "--action", "key", "--since", "1h", "--json", *where)).stdout)
    assert [(e["action"], e["target"], e["actor"]) for e in keys] == [
        ("key.revoke", "ci", "admin"),
        ("key.create", "ci", "admin"),
    ]
    assert set(keys[0]) == {"id", "at", "actor", "source", "action", "target", "detail"}
    later = await ctl("audit", "--since", "2999-01-01", *where)
    assert later.stdout.strip() == "no audit entries (for these filters)"
    newest = await ctl("audit", "--limit", "1", "--actor", "admin", *where)
    assert "key.revoke" in newest.stdout and "key.create" not in newest.stdout and "--limit" in newest.stdout
    wrong = await ctl("audit", "--since", "yesterday", *where)
    assert wrong.returncode != 0 and "--since 'yesterday' is not a time" in wrong.stderr


class RefusingStore:
    """The audit log's store as a busy database answers: every write refused."""

    async def record_audit(self, **entry: Any) -> None:
        raise StoreBusy("/state/llmgw.db", 1.0)


async def test_a_store_that_refuses_the_entry_leaves_it_in_the_log(caplog) -> None:
    caplog.set_level(logging.INFO, logger="llmgw.audit")
    row = await audit.record(
        RefusingStore(),  # type: ignore[arg-type]
        actor="admin",
        source="10.1.2.3",
        action="budget.set",
        target="team-a",
        detail={"tokens": 1000, "token": "sk-x"},
    )
    assert row is None
    [line] = [r.llmgw_fields for r in caplog.records if r.getMessage() == "audit_not_recorded"]
    assert {k: line[k] for k in ("actor", "source", "action", "target", "detail")} == {
        "actor": "admin",
        "source": "10.1.2.3",
        "action": "budget.set",
        "target": "team-a",
        "detail": {"tokens": 1000, "token": "(given)"},
    }
    assert "sk-x" not in repr(line)


async def test_small_keeps_secrets_out_and_details_small() -> None:
    got = audit.small(
        {
            "token": "sk-very-secret",
            "Password": "",
            "nested": {"csrf": "abc", "ok": 1, "code": "x"},
            "long": "x" * 1000,
            "many": list(range(100)),
            "when": 1.5,
            "set": {"b", "a"},
            "other": Path("/p"),
        }
    )
    assert got["token"] == "(given)" and "Password" not in got
    assert got["nested"] == {"csrf": "(given)", "ok": 1, "code": "(given)"}
    assert len(got["long"]) == audit.MAX_TEXT and got["long"].endswith("…")
    assert got["many"][: audit.MAX_ITEMS] == list(range(audit.MAX_ITEMS)) and got["many"][-1] == "… 36 more"
    assert (got["when"], got["set"], got["other"]) == (1.5, ["a", "b"], "/p")
    assert "sk-very-secret" not in json.dumps(got)


class PrunedStore:
    def __init__(self) -> None:
        self.cuts: list[float] = []

    async def prune_audit(self, before: float) -> int:
        self.cuts.append(before)
        return 1


async def test_the_leader_prunes_what_is_older_than_keep_days_at_start_and_once_a_day(autojump_clock) -> None:
    store, wall, keep = PrunedStore(), [1000 * audit.DAY_S], [365.0]
    async with trio.open_nursery() as nursery:
        await nursery.start(
            partial(audit.serve_pruning, store, lambda: keep[0], now=lambda: wall[0])  # type: ignore[arg-type]
        )
        await wait_all_tasks_blocked()
        assert store.cuts == [635 * audit.DAY_S]  # at start
        wall[0] += audit.DAY_S
        await trio.sleep(audit.DAY_S)
        await wait_all_tasks_blocked()
        assert store.cuts == [635 * audit.DAY_S, 636 * audit.DAY_S]  # a day later
        keep[0] = 0.0  # keep everything: nothing pruned
        await trio.sleep(audit.DAY_S)
        await wait_all_tasks_blocked()
        assert len(store.cuts) == 2
        nursery.cancel_scope.cancel()


async def test_audit_keep_days_is_a_number_of_days_from_0() -> None:
    from llmgw.config import server_config_from_dict
    from llmgw.errors import ConfigError

    assert server_config_from_dict({}).server.audit_keep_days == audit.DEFAULT_KEEP_DAYS == 365
    assert server_config_from_dict({"server": {"audit_keep_days": 0}}).server.audit_keep_days == 0
    for bad in (-1, float("nan")):
        with pytest.raises(ConfigError) as refused:
            server_config_from_dict({"server": {"audit_keep_days": bad}})
        assert "must be a number of days, 0 or more" in str(refused.value)
        assert "@ $.server.audit_keep_days" in str(refused.value)


async def test_the_page_feed_sends_the_newest_entries_then_each_new_one(served) -> None:
    plane, state, client = served
    for i in range(feed.AUDIT_SHOWN + 2):  # more than the page shows
        await plane.store.record_audit(actor="admin", source="127.0.0.1", action="key.create", target=f"k{i}")
    browser = Browser(client.url)
    await call(browser.sign_in, plane.page.login_path())
    page_feed = Feed(browser)
    await call(page_feed.open)
    try:
        kind, first = await call(page_feed.next)
        assert kind == "cluster" and len(first["audit"]) == feed.AUDIT_SHOWN
        assert first["audit"][0]["action"] == "page.login"  # the newest first: this page's own login
        assert first["audit"][1]["target"] == f"k{feed.AUDIT_SHOWN + 1}"
        await call(client.cordon, "n1", True)
        kind, second = await call(page_feed.next)
        assert kind == "changes" and second["audit"][0]["action"] == "node.cordon"
        assert second["audit"][0]["actor"] == "admin" and len(second["audit"]) == feed.AUDIT_SHOWN
    finally:
        page_feed.close()
