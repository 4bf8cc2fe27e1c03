"""The cluster page's HTTP side on a real control plane over loopback: its files, the one-time
login, the session cookie standing in for the credential, CSRF and Origin on changes, the audit
line, and the live feed."""

from __future__ import annotations

import logging
from pathlib import Path
from urllib.parse import urlsplit

import attrs
import pytest
import trio

from llmgw import paths
from llmgw.config import DebugSection
from llmgw.ctl.client import AdminClient
from llmgw.ctl.page import page_url
from llmgw.server.admin.logins import SessionBook
from llmgw.server.app import ControlPlane
from testlib.controlplane import make_state, serve_plane
from testlib.pageclient import Browser, Feed

pytestmark = pytest.mark.trio


@pytest.fixture
async def running(tmp_path: Path, nursery: trio.Nursery) -> tuple[ControlPlane, Path]:
    state = tmp_path / "cp"
    make_state(state, sans=["127.0.0.1"], days=3)
    plane, _ = await serve_plane(state, nursery)
    await plane.store.saw_node("n1", "127.0.0.5")
    plane.registry.know("n1", address="127.0.0.5")
    return plane, state


async def call(fn, *args, **kw):
    return await trio.to_thread.run_sync(lambda: fn(*args, **kw))


def client_of(state: Path) -> AdminClient:
    return AdminClient.locate(server=None, credential=None, state_dir=str(state))


async def test_the_page_and_its_files_are_served_with_a_strict_policy(running) -> None:
    plane, state = running
    browser = Browser(client_of(state).url)
    status, headers, body = await call(browser.request, "GET", "/")
    assert status == 200 and headers["content-type"].startswith("text/html") and b"/page/app.js" in body
    assert "script-src 'self'" in headers["content-security-policy"] and headers["x-frame-options"] == "DENY"
    scripts = [(name, "text/javascript") for name in ("app.js", "render.js", "nodelist.js", "plots.js")]
    for name, kind in (*scripts, ("style.css", "text/css")):
        status, headers, _ = await call(browser.request, "GET", f"/page/{name}")
        assert status == 200 and headers["content-type"].startswith(kind)
    assert (await call(browser.request, "GET", "/page/nothing.js"))[0] == 404
    assert (await call(browser.request, "GET", "/page/../server/admin/page.py"))[0] == 404
    assert (await call(browser.request, "POST", "/"))[0] == 405


async def test_a_login_url_works_once_and_sets_a_strict_http_only_cookie(running) -> None:
    plane, state = running
    client = client_of(state)
    login = await call(page_url, client, actions=False)
    token = paths.admin_token_path(state).read_text().strip()
    assert login["url"].startswith(client.url + "/login?code=") and token not in login["url"]
    browser = Browser(client.url)
    status, headers, _ = await call(browser.login, urlsplit(login["url"]).path + "?" + urlsplit(login["url"]).query)
    assert status == 303 and headers["location"] == "/"  # the code is gone from the address bar
    cookie = headers["set-cookie"]
    assert cookie.startswith("llmgw_session=") and "; HttpOnly; SameSite=Strict; Path=/; Max-Age=43200" in cookie
    assert headers["cache-control"] == "no-store" and headers["referrer-policy"] == "no-referrer"
    # The cookie reads the admin API as the credential does.
    status, body = await call(browser.json, "GET", "/admin/v1/nodes")
    assert status == 200 and [n["id"] for n in body["nodes"]] == ["n1"]
    status, session = await call(browser.json, "GET", "/admin/v1/page/session")
    assert status == 200 and session["actions"] is False and session["id"].startswith("s-") and session["csrf"]
    # A second use of the same URL: refused, saying what to do.
    again = Browser(client.url)
    status, headers, body = await call(again.login, urlsplit(login["url"]).path + "?" + urlsplit(login["url"]).query)
    assert status == 401 and "set-cookie" not in headers and b"used already" in body and b"llmgw ctl page" in body


async def test_without_a_session_or_the_credential_the_admin_api_refuses(running) -> None:
    plane, state = running
    browser = Browser(client_of(state).url)
    status, body = await call(browser.json, "GET", "/admin/v1/nodes")
    assert status == 401 and "needs the admin credential" in body["error"]["message"]
    assert (await call(browser.json, "GET", "/admin/v1/events"))[0] == 401
    browser.cookie = "llmgw_session=made-up"
    status, body = await call(browser.json, "GET", "/admin/v1/nodes")
    assert status == 401 and "expired or is unknown" in body["error"]["message"]
    # An expired session is no session.
    plane.page.sessions = SessionBook(session_ttl_s=0.0)
    path = plane.page.login_path(actions=True)
    assert (await call(browser.login, path))[0] == 303
    status, body = await call(browser.json, "GET", "/admin/v1/nodes")
    assert status == 401 and "expired" in body["error"]["message"]


async def test_a_change_needs_a_session_that_may_act_its_csrf_token_and_this_origin(running, caplog) -> None:
    plane, state = running
    client = client_of(state)
    reader, actor = Browser(client.url), Browser(client.url)
    await call(reader.login, plane.page.login_path())
    await call(actor.login, plane.page.login_path(actions=True))
    _, read_session = await call(reader.json, "GET", "/admin/v1/page/session")
    _, act_session = await call(actor.json, "GET", "/admin/v1/page/session")
    cordon = "/admin/v1/nodes/n1/cordon"
    caplog.set_level(logging.INFO, logger="llmgw.page")

    status, body = await call(actor.json, "POST", cordon, origin=actor.origin)
    assert status == 403 and "CSRF" in body["error"]["message"]
    status, body = await call(actor.json, "POST", cordon, origin=actor.origin, **{"x-llmgw-csrf": read_session["csrf"]})
    assert status == 403 and "CSRF" in body["error"]["message"]  # another session's token is no token
    status, body = await call(
        actor.json, "POST", cordon, origin="http://evil.example", **{"x-llmgw-csrf": act_session["csrf"]}
    )
    assert status == 403 and "Origin" in body["error"]["message"]
    status, body = await call(actor.json, "POST", cordon, **{"x-llmgw-csrf": act_session["csrf"]})
    assert status == 403  # no Origin at all: not the page's own fetch
    status, body = await call(
        reader.json, "POST", cordon, origin=reader.origin, **{"x-llmgw-csrf": read_session["csrf"]}
    )
    assert status == 403 and "read-only" in body["error"]["message"] and "--actions" in body["error"]["message"]
    assert not plane.registry.nodes["n1"].cordoned

    status, body = await call(actor.json, "POST", cordon, origin=actor.origin, **{"x-llmgw-csrf": act_session["csrf"]})
    assert status == 200 and body["node"]["cordoned"] is True
    audit = [r.llmgw_fields for r in caplog.records if r.getMessage() == "admin_call"]
    assert audit[-1] == {"method": "POST", "path": cordon, "status": 200, "by": act_session["id"]}
    # The refusals before it were audited too, each with its session.
    refused = [(a["by"], a["status"]) for a in audit[:-1]]
    assert refused == [(act_session["id"], 403)] * 4 + [(read_session["id"], 403)]
    logged = repr([(r.getMessage(), getattr(r, "llmgw_fields", None)) for r in caplog.records])
    assert act_session["csrf"] not in logged and actor.cookie.split("=", 1)[1] not in logged

    # A session cannot make more logins: only the credential can.
    status, body = await call(
        actor.json, "POST", "/admin/v1/page/login", origin=actor.origin, **{"x-llmgw-csrf": act_session["csrf"]}
    )
    assert status == 403 and "admin credential" in body["error"]["message"]
    # Logging out ends the session.
    status, _ = await call(
        actor.json, "POST", "/admin/v1/page/logout", origin=actor.origin, **{"x-llmgw-csrf": act_session["csrf"]}
    )
    assert status == 200
    assert (await call(actor.json, "GET", "/admin/v1/nodes"))[0] == 401


async def test_a_change_is_taken_from_this_control_planes_addresses_not_from_whatever_host_is_named(running) -> None:
    plane, state = running
    actor = Browser(client_of(state).url)
    await call(actor.login, plane.page.login_path(actions=True))
    _, session = await call(actor.json, "GET", "/admin/v1/page/session")
    cordon, csrf = "/admin/v1/nodes/n1/cordon", {"x-llmgw-csrf": session["csrf"]}
    # A page at a name rebound to this machine: its Host and its Origin agree, and neither is ours.
    rebound = f"rebound.example:{actor.port}"
    status, body = await call(actor.json, "POST", cordon, host=rebound, origin=f"http://{rebound}", **csrf)
    message = body["error"]["message"]
    assert status == 403 and "none of its addresses" in message and f"http://127.0.0.1:{actor.port}" in message
    assert "page_origins" in message and not plane.registry.nodes["n1"].cordoned
    # http_listen is 127.0.0.1: the machine's other names for itself are its addresses too.
    status, body = await call(actor.json, "POST", cordon, origin=f"http://localhost:{actor.port}", **csrf)
    assert status == 200 and body["node"]["cordoned"] is True


async def test_the_feed_sends_the_cluster_then_each_change(running) -> None:
    plane, state = running
    browser = Browser(client_of(state).url)
    await call(browser.login, plane.page.login_path())
    feed = Feed(browser)
    response = await call(feed.open)
    try:
        assert response.status == 200 and response.headers["content-type"].startswith("text/event-stream")
        kind, first = await call(feed.next)
        assert kind == "cluster" and [n["id"] for n in first["nodes"]] == ["n1"] and not first["nodes"][0]["cordoned"]
        assert {"fabrics", "notes", "replicas", "models", "keys"} <= set(first)
        await call(client_of(state).cordon, "n1", True)  # `llmgw ctl cordon`, with the credential
        # What changed, by id, from the version the page has.
        kind, second = await call(feed.next)
        assert kind == "changes" and second["base"] == first["version"]
        assert [n["id"] for n in second["nodes"]] == ["n1"] and second["nodes"][0]["cordoned"] is True
    finally:
        feed.close()


async def test_a_page_session_cannot_stall_the_loop_even_one_that_may_act(running) -> None:
    """The stall diagnostic takes the admin credential itself: it is for an operator at a shell."""
    plane, state = running
    plane.settings.current = attrs.evolve(plane.config, debug=DebugSection(allow_stall=True))
    actor = Browser(client_of(state).url)
    await call(actor.login, plane.page.login_path(actions=True))
    _, session = await call(actor.json, "GET", "/admin/v1/page/session")
    status, body = await call(
        actor.json, "POST", "/admin/v1/debug/stall?seconds=5", origin=actor.origin, **{"x-llmgw-csrf": session["csrf"]}
    )
    assert status == 401 and "needs the admin credential" in body["error"]["message"]
