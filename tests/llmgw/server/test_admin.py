"""The admin API over real HTTP on loopback, called through the real client `llmgw ctl` uses."""

from __future__ import annotations

import http.client
from pathlib import Path
from urllib.parse import urlsplit

import attrs
import pytest
import trio

from llmgw import paths
from llmgw.config import DebugSection, ServerConfig, ServerSection
from llmgw.ctl.client import AdminClient
from llmgw.errors import PeerError, UsageError
from llmgw.pki.files import load_ca
from llmgw.server.app import ControlPlane
from testlib.controlplane import OFFLINE_ENGINES, make_state, serve_plane
from testlib.waiting import await_true

pytestmark = pytest.mark.trio


@pytest.fixture
async def running(tmp_path: Path, nursery: trio.Nursery) -> tuple[ControlPlane, Path]:
    state = tmp_path / "cp"
    make_state(state, sans=["127.0.0.1"], days=3)
    plane, _ = await serve_plane(state, nursery)
    return plane, state


async def call(fn, *args):
    return await trio.to_thread.run_sync(fn, *args)


async def test_the_client_finds_a_local_control_plane_by_its_state_dir(running) -> None:
    plane, state = running
    await plane.store.saw_node("n1", "127.0.0.5")
    plane.registry.know("n1", address="127.0.0.5")
    client = AdminClient.locate(server=None, credential=None, state_dir=str(state))
    [node] = await call(client.nodes)
    assert node["id"] == "n1" and node["state"] in ("unknown", "lost") and node["address"] == "127.0.0.5"
    assert (await call(client.cordon, "n1", True))["cordoned"] is True
    assert [r.cordoned for r in await plane.store.nodes()] == [True]
    assert (await call(client.cordon, "n1", False))["cordoned"] is False


async def test_the_authority_is_the_ca_the_control_plane_signs_with(running) -> None:
    plane, state = running
    client = AdminClient.locate(server=None, credential=None, state_dir=str(state))
    ca = await call(client.authority)
    info = load_ca(state).info()
    assert ca["fingerprint_sha256"] == info.fingerprint_sha256 and ca["common_name"] == info.common_name
    assert set(ca) == {"common_name", "fingerprint_sha256", "not_after"}  # the certificate's, never its key
    with pytest.raises(UsageError) as refused:
        await call(client.request, "POST", "/admin/v1/authority")
    assert "takes GET, not POST" in str(refused.value)


async def test_a_missing_or_wrong_credential_is_401_with_what_to_do(running, tmp_path: Path) -> None:
    plane, state = running
    url = paths.admin_url_path(state).read_text().strip()
    with pytest.raises(PeerError) as info:
        await call(AdminClient(url, "not-the-token").nodes)
    assert "wrong admin credential" in str(info.value) and "HTTP 401" in str(info.value)
    anonymous = AdminClient(url, "x")
    anonymous._token = ""
    with pytest.raises(PeerError) as info:
        await call(anonymous.nodes)
    assert "needs the admin credential" in str(info.value)


async def test_unknown_nodes_and_routes_are_clear_errors(running) -> None:
    _, state = running
    client = AdminClient.locate(server=None, credential=None, state_dir=str(state))
    with pytest.raises(UsageError) as info:
        await call(client.remove_node, "ghost")
    assert "no node 'ghost' is known" in str(info.value) and "HTTP 404" in str(info.value)
    with pytest.raises(UsageError) as info:
        await call(client.cordon, "ghost", True)
    assert "no node 'ghost'" in str(info.value)
    with pytest.raises(UsageError) as info:
        await call(client.request, "POST", "/admin/v1/nodes")
    assert "takes GET, not POST" in str(info.value)


async def test_without_a_running_server_the_client_says_so(tmp_path: Path) -> None:
    from llmgw.errors import MachineError

    with pytest.raises(MachineError) as info:
        AdminClient.locate(server=None, credential=None, state_dir=str(tmp_path))
    assert "admin.url is missing" in str(info.value) and "llmgw server" in str(info.value)
    with pytest.raises(UsageError):
        AdminClient.locate(server="http://127.0.0.1:1", credential=None, state_dir=None)


async def test_replicas_and_models_say_what_is_pending_and_why(tmp_path: Path, nursery: trio.Nursery) -> None:
    from llmgw.config import Model

    state = tmp_path / "cp"
    make_state(state, sans=["127.0.0.1"], days=3)
    config = ServerConfig(
        engines=OFFLINE_ENGINES,
        server=ServerSection(state_dir=str(state), agent_listen="127.0.0.1:0", http_listen="127.0.0.1:0"),
        models=(Model(name="big", engine="sim", nodes_per_replica=2),),
    )
    plane = ControlPlane.open(config, state)
    await nursery.start(plane.serve)
    plane.replicas.reconcile(trio.current_time())
    client = AdminClient.locate(server=None, credential=None, state_dir=str(state))
    [replica] = (await call(client.request, "GET", "/admin/v1/replicas"))["replicas"]
    assert replica["state"] == "pending" and replica["detail"].startswith("needs 2 nodes on one fabric")
    [model] = (await call(client.request, "GET", "/admin/v1/models"))["models"]
    assert model["ready"] == 0 and model["replicas"] == 1 and model["pending"] == [replica["detail"]]


async def test_reload_changes_the_catalog_and_a_bad_file_changes_nothing(tmp_path: Path, nursery: trio.Nursery) -> None:
    from llmgw.config import load_server_config

    state = tmp_path / "cp"
    make_state(state, sans=["127.0.0.1"], days=3)
    toml = tmp_path / "server.toml"
    head = f'[server]\nstate_dir = "{state}"\nagent_listen = "127.0.0.1:0"\nhttp_listen = "127.0.0.1:0"\n'
    toml.write_text(head + '[[models]]\nname = "one"\nengine = "sim"\n')
    plane = ControlPlane.open(load_server_config(toml), state, toml)
    await nursery.start(plane.serve)
    client = AdminClient.locate(server=None, credential=None, state_dir=str(state))
    toml.write_text(head + '[[models]]\nname = "one"\nengine = "sim"\n[[models]]\nname = "two"\nengine = "sim"\n')
    result = await call(client.request, "POST", "/admin/v1/reload")
    assert result["models"] == ["one", "two"] and [m.name for m in plane.config.models] == ["one", "two"]
    toml.write_text(head + '[[models]]\nname = "one"\nengine = "sim"\nreplicas = "2"\n')
    with pytest.raises(PeerError) as info:
        await call(client.request, "POST", "/admin/v1/reload")
    assert "expected int, got str '2' @ $.models[0].replicas" in str(info.value) and "nothing changed" in str(
        info.value
    )
    assert [m.name for m in plane.config.models] == ["one", "two"]


async def test_domain_errors_are_answered_with_their_status_and_message(running) -> None:
    _, state = running  # started without a configuration file
    client = AdminClient.locate(server=None, credential=None, state_dir=str(state))
    with pytest.raises(UsageError) as info:
        await call(client.request, "GET", "/admin/v1/replicas/nope-0/logs")
    assert "no replica 'nope-0' (replicas: none)" in str(info.value) and "HTTP 404" in str(info.value)
    with pytest.raises(UsageError) as info:
        await call(client.request, "POST", "/admin/v1/nodes/ghost/drain")
    assert "no node 'ghost' is known" in str(info.value) and "HTTP 404" in str(info.value)
    with pytest.raises(PeerError) as info:
        await call(client.request, "POST", "/admin/v1/reload")
    assert "started without --config; there is no file to reload" in str(info.value) and "HTTP 409" in str(info.value)


async def test_the_answers_table_picks_the_most_specific_class() -> None:
    from llmgw.errors import ConfigError, MachineError
    from llmgw.server.admin.api import answer
    from llmgw.server.errors import ApiKeyExists, StoreBusy, StoreUnavailable

    busy = answer(StoreBusy(Path("/s/llmgw.db"), 1.0))
    assert busy.status == 503 and busy.kind == "unavailable_error" and busy.headers == (("retry-after", "2"),)
    away = answer(StoreUnavailable("postgresql://db:5432/llmgw", "connection refused"))
    assert away.status == 503 and away.kind == "unavailable_error" and away.headers == (("retry-after", "5"),)
    assert answer(ApiKeyExists("key 'a' exists")).status == 409  # not 400, its base class's answer
    bad = answer(ConfigError("server.toml", ["expected int @ $.models[0].replicas"]))
    assert bad.status == 422 and bad.message.startswith("server.toml has problems; nothing changed:\nserver.toml: ")
    assert answer(MachineError("no disk")) is None  # not a domain error: a bug, answered 500 by the server


# -- certificates: how `llmgw node add` and `llmgw ca issue` reach the database while it runs --


async def test_a_recorded_certificate_is_read_back_and_revokes_the_node_ids_others(running) -> None:
    plane, state = running
    client = AdminClient.locate(server=None, credential=None, state_dir=str(state))
    big = 2**158 + 12345  # x509 serials exceed what a JSON number keeps: sent as decimal strings
    assert await call(client.is_revoked, big) is False  # never recorded: nothing says it is revoked
    assert await call(lambda: client.record_certificate(big, "node-a", 2e9)) == []
    shown = await call(client.request, "GET", f"/admin/v1/certificates/{big}")
    assert shown == {
        "serial": str(big),
        "recorded": True,
        "node_id": "node-a",
        "not_after": 2e9,
        "revoked": False,
        "revoked_at": None,
    }
    revoked = await call(lambda: client.record_certificate(7, "node-a", 2e9, revoke_others=True, also_revoke=[99]))
    assert revoked == [99, big]
    assert await call(client.is_revoked, big) and await call(client.is_revoked, 99)
    assert not await call(client.is_revoked, 7)
    # What `llmgw node remove` revokes is what was recorded here.
    assert (await call(client.remove_node, "node-a"))["revoked_serials"] == ["7"]


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"serial": 5, "node_id": "n", "not_after": 1.0}, "'serial': a serial is a positive whole number in decimal"),
        ({"serial": "0x5", "node_id": "n", "not_after": 1.0}, "got '0x5'"),
        ({"serial": "5", "node_id": "bad id", "not_after": 1.0}, "'node_id': node id 'bad id' may use only"),
        ({"serial": "5", "node_id": None, "not_after": 1.0}, "'node_id' must be the node id"),
        ({"serial": "5", "node_id": "n", "not_after": "soon"}, "'not_after' must be the certificate's expiry"),
        ({"serial": "5", "node_id": "n", "not_after": 1.0, "revoke_others": "yes"}, "'revoke_others' must be true"),
        ({"serial": "5", "node_id": "n", "not_after": 1.0, "also_revoke": [5]}, "'also_revoke': a serial is"),
        ({"serial": "5", "node_id": "n", "not_after": 1.0, "extra": 1}, "unknown fields ['extra']"),
    ],
)
async def test_a_bad_certificate_record_is_400_naming_the_field_and_records_nothing(running, body, says) -> None:
    plane, state = running
    client = AdminClient.locate(server=None, credential=None, state_dir=str(state))
    with pytest.raises(PeerError) as info:
        await call(client.request, "POST", "/admin/v1/certificates", body)
    assert says in str(info.value) and "HTTP 400" in str(info.value)
    assert await plane.store.certificate(5) is None


async def test_the_certificate_routes_need_the_credential(running) -> None:
    _, state = running
    url = paths.admin_url_path(state).read_text().strip()
    stranger = AdminClient(url, "not-the-token")
    for attempt in (lambda: stranger.record_certificate(5, "n", 2e9), lambda: stranger.is_revoked(5)):
        with pytest.raises(PeerError, match="wrong admin credential"):
            await call(attempt)


async def test_a_locked_database_is_503_with_the_stores_message_and_records_nothing(running) -> None:
    import sqlite3

    from llmgw.server.store import store_path

    plane, state = running
    client = AdminClient.locate(server=None, credential=None, state_dir=str(state))
    other = sqlite3.connect(str(store_path(state)), isolation_level=None)
    other.execute("BEGIN IMMEDIATE")  # a sqlite3 shell in a transaction
    try:
        with pytest.raises(PeerError) as info:
            await call(lambda: client.record_certificate(5, "node-a", 2e9))
    finally:
        other.execute("ROLLBACK")
        other.close()
    message = str(info.value)
    assert f"{store_path(state)} is locked by another process" in message and "try again" in message
    assert "HTTP 503" in message
    assert await plane.store.certificate(5) is None


async def test_a_postgresql_store_that_goes_away_is_503_with_retry_after_until_it_is_back(
    tmp_path: Path, nursery: trio.Nursery, postgres_server, postgres_db
) -> None:
    """PostgreSQL stopped under a running control plane: an admin write is answered 503 with
    Retry-After and the store's message (which names the database by its hosts, ports and name
    only), the server stays up, and the first write after PostgreSQL is back is recorded."""
    state = tmp_path / "cp"
    make_state(state, sans=["127.0.0.1"], days=3)
    plane, _ = await serve_plane(state, nursery, store=postgres_db.settings)
    client = AdminClient.locate(server=None, credential=None, state_dir=str(state))
    await call(lambda: client.record_certificate(5, "node-a", 2e9))
    await call(postgres_server.stop)
    try:
        status, headers, body = await call(_post_certificate, state, 6)
    finally:
        await call(postgres_server.start)
    assert status == 503 and int(headers["retry-after"]) >= 1, (status, headers)
    message = body["error"]["message"]
    assert f"postgresql://127.0.0.1:{postgres_server.port}/{postgres_db.name} cannot be reached" in message
    assert "nothing changed" in message and postgres_server.password not in message
    await call(lambda: client.record_certificate(7, "node-a", 2e9))
    assert await plane.store.certificate(5) is not None and await plane.store.certificate(7) is not None
    assert await plane.store.certificate(6) is None


def _post_certificate(state: Path, serial: int) -> tuple[int, dict[str, str], dict]:
    """POST a certificate to the admin API, raw: the status, the headers and the body as they are."""
    import json

    url = urlsplit(paths.admin_url_path(state).read_text().strip())
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    try:
        body = json.dumps({"serial": str(serial), "node_id": "node-a", "not_after": 2e9})
        token = paths.read_admin_token(paths.admin_token_path(state))
        conn.request("POST", "/admin/v1/certificates", body=body, headers={"authorization": f"Bearer {token}"})
        response = conn.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, json.loads(response.read())
    finally:
        conn.close()


# -- the stall diagnostic --------------------------------------------------------------------

STALL = "/admin/v1/debug/stall"


def metrics_of(url: str) -> dict[str, float]:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
    try:
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    finally:
        conn.close()
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("llmgw_event_loop")
    }


async def test_the_stall_diagnostic_is_refused_unless_server_toml_allows_it(running) -> None:
    plane, state = running
    assert plane.config.debug.allow_stall is False  # off by default
    client = AdminClient.locate(server=None, credential=None, state_dir=str(state))
    with pytest.raises(PeerError) as info:
        await call(client.request, "POST", f"{STALL}?seconds=5")
    assert "HTTP 403" in str(info.value) and "allow_stall = true" in str(info.value) and "[debug]" in str(info.value)
    with pytest.raises(PeerError) as info:
        await call(AdminClient(client.url, "not-the-token").request, "POST", f"{STALL}?seconds=5")
    assert "HTTP 401" in str(info.value)


async def test_the_stall_diagnostic_holds_the_loop_and_the_metrics_and_the_log_say_so(
    running, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO")
    plane, state = running
    plane.settings.current = attrs.evolve(plane.config, debug=DebugSection(allow_stall=True))
    client = AdminClient.locate(server=None, credential=None, state_dir=str(state))
    for bad in ("0", "-1", "x", "601", "nan", "inf", ""):
        with pytest.raises(PeerError) as info:
            await call(client.request, "POST", f"{STALL}?seconds={bad}")
        assert "HTTP 400" in str(info.value) and "seconds must be a number" in str(info.value)
    before = await call(metrics_of, client.url)
    result = await call(client.request, "POST", f"{STALL}?seconds=0.8")
    assert result["stalled_s"] >= 0.8
    # The ticker's first tick after the stall: it counts the lag, credits the stall and warns.
    await await_true(
        lambda: plane.loop_lag.lag_max(trio.current_time()) >= 0.7, "the loop-lag ticker's tick after the stall"
    )
    after = await call(metrics_of, client.url)
    assert after["llmgw_event_loop_lag_max_seconds"] >= 0.7, after
    # Computing on the loop: busy, as far as this machine gave the process a CPU meanwhile.
    assert after["llmgw_event_loop_busy_max_seconds"] > 0.1
    # (Histograms have no samples before the first tick, 50 ms after the start.)
    assert after["llmgw_event_loop_lag_seconds_count"] > before.get("llmgw_event_loop_lag_seconds_count", 0)
    assert after['llmgw_event_loop_lag_seconds_bucket{le="0.5"}'] < after["llmgw_event_loop_lag_seconds_count"]
    # Credited to liveness time: the lag less the ticker's interval and MIN_STALL_S.
    assert after["llmgw_event_loop_stalls_total"] >= before["llmgw_event_loop_stalls_total"] + 1
    assert after["llmgw_event_loop_stalled_seconds_total"] - before["llmgw_event_loop_stalled_seconds_total"] >= 0.4
    lagged = [r.llmgw_fields for r in caplog.records if r.getMessage() == "event_loop_lagged"]
    assert any(w["lag_s"] >= 0.7 and w["cause"] in ("busy", "waiting_for_cpu") for w in lagged), lagged
    assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("debug_stall")] == [
        "debug_stall",
        "debug_stall_done",
    ]


async def test_thousands_of_nodes_are_listed_a_page_at_a_time_by_id_and_by_state(running) -> None:
    plane, state = running
    for i in range(1200):
        plane.registry.know(f"n{i:05d}", address="127.0.0.5", cordoned=i % 3 == 0)
    client = AdminClient.locate(server=None, credential=None, state_dir=str(state))
    everyone = await call(client.nodes)  # every page, followed
    assert [n["id"] for n in everyone] == [f"n{i:05d}" for i in range(1200)]
    page = await call(lambda: client.cluster(limit=500, after="n00099"))
    assert [n["id"] for n in page["nodes"]] == [f"n{i:05d}" for i in range(100, 600)]
    assert page["next"] == "n00599"
    last = await call(lambda: client.cluster(limit=500, after="n00999"))
    assert len(last["nodes"]) == 200 and last["next"] is None
    # None has reconnected since the control plane started: all unknown, none joined.
    assert len(await call(lambda: client.nodes(state="unknown"))) == 1200
    assert await call(lambda: client.nodes(state="joined")) == []
    for query, says in (
        ("limit=0", "limit must be a whole number from 1 to 10000, got '0'"),
        ("state=up", "state must be one of joined, joining, lost, unknown, got 'up'"),
        ("page=2", "has no query parameter 'page'"),
    ):
        status, body, _ = await call(client._exchange, "GET", f"/admin/v1/nodes?{query}", None)
        assert status == 400 and says in body["error"]["message"], body
