"""`llmgw ca` end to end: init, show, server-cert and issue through the real command line."""

from __future__ import annotations

import json
import stat
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from cryptography import x509

from llmgw import cli
from llmgw.commands import _options as options
from llmgw.pki.ca import ROLE_GATEWAY, CertInfo, cert_info
from llmgw.pki.files import ca_paths, load_cert, write_node_key_and_csr
from testlib.controlplane import make_state, serve_plane
from testlib.proc import run_llmgw

Capsys = pytest.CaptureFixture[str]


@pytest.fixture(autouse=True)
def no_machine_config(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The tests' own state dirs and configs only, whatever this machine has in /etc or the environment."""
    monkeypatch.delenv("LLMGW_STATE_DIR", raising=False)
    monkeypatch.setattr(options, "DEFAULT_SERVER_CONFIG", tmp_path / "absent/server.toml")


@pytest.fixture
def state(tmp_path: Path, capsys: Capsys) -> Path:
    d = tmp_path / "state"
    assert cli.main(["ca", "init", "--state-dir", str(d)]) == 0
    capsys.readouterr()
    return d


def days_left(info: CertInfo) -> float:
    return (info.not_after - datetime.now(timezone.utc)) / timedelta(days=1)


def test_init_creates_the_ca_and_a_server_cert_for_localhost(tmp_path: Path, capsys: Capsys) -> None:
    d = tmp_path / "state"
    assert cli.main(["ca", "init", "--state-dir", str(d)]) == 0
    out = capsys.readouterr().out
    paths = ca_paths(d)
    ca_info = cert_info(load_cert(paths.ca_cert))
    server_info = cert_info(load_cert(paths.server_cert))
    assert f"created the certificate authority in {paths.dir}" in out
    assert "subject:     CN=llmgw cluster CA" in out
    assert f"fingerprint: {ca_info.fingerprint_sha256}" in out
    assert f"expires:     {ca_info.not_after:%Y-%m-%d %H:%M:%S} UTC" in out
    assert "addresses:   localhost, 127.0.0.1" in out
    assert server_info.sans == ("localhost", "127.0.0.1")
    assert 3649 < days_left(ca_info) <= 3650 and 824 < days_left(server_info) <= 825
    assert stat.S_IMODE(paths.ca_key.stat().st_mode) == 0o600
    assert stat.S_IMODE(paths.server_key.stat().st_mode) == 0o600
    assert stat.S_IMODE(paths.dir.stat().st_mode) == 0o700


def test_init_takes_addresses_and_validity_from_the_config(tmp_path: Path, capsys: Capsys) -> None:
    d = tmp_path / "from-config"
    conf = tmp_path / "server.toml"
    conf.write_text(
        f'[server]\nstate_dir = "{d}"\nadvertise = ["10.0.0.1", "llmgw.example.internal"]\n\n'
        "[ca]\nca_validity_days = 100\nserver_cert_validity_days = 10\n"
    )
    assert cli.main(["ca", "init", "--config", str(conf)]) == 0
    paths = ca_paths(d)
    server_info = cert_info(load_cert(paths.server_cert))
    assert server_info.sans == ("10.0.0.1", "llmgw.example.internal")
    assert 9 < days_left(server_info) <= 10
    assert 99 < days_left(cert_info(load_cert(paths.ca_cert))) <= 100


def test_san_and_validity_flags_win_over_the_config(tmp_path: Path, capsys: Capsys) -> None:
    conf = tmp_path / "server.toml"
    conf.write_text('[server]\nadvertise = ["10.0.0.1"]\n')
    d = tmp_path / "s"
    argv = ["ca", "init", "--config", str(conf), "--state-dir", str(d), "--validity-days", "5"]
    assert cli.main([*argv, "--san", "fd00::1", "--san", "cp.internal"]) == 0
    paths = ca_paths(d)
    assert cert_info(load_cert(paths.server_cert)).sans == ("fd00::1", "cp.internal")
    assert 4 < days_left(cert_info(load_cert(paths.ca_cert))) <= 5


def test_state_dir_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Capsys) -> None:
    monkeypatch.setenv("LLMGW_STATE_DIR", str(tmp_path / "env-state"))
    assert cli.main(["ca", "init"]) == 0
    assert ca_paths(tmp_path / "env-state").ca_cert.exists()


def test_init_twice_is_refused_with_the_reason(state: Path, capsys: Capsys) -> None:
    assert cli.main(["ca", "init", "--state-dir", str(state)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"llmgw ca: a certificate authority already exists: {ca_paths(state).ca_key};")
    assert "orphan every node certificate" in err


def test_init_with_a_bad_address_creates_nothing(tmp_path: Path, capsys: Capsys) -> None:
    d = tmp_path / "s"
    assert cli.main(["ca", "init", "--state-dir", str(d), "--san", "10.0.0.1:7443"]) == 2
    assert "server address '10.0.0.1:7443' is neither" in capsys.readouterr().err
    assert not ca_paths(d).ca_key.exists()


def test_show_prints_the_ca_and_the_server_cert(state: Path, capsys: Capsys) -> None:
    assert cli.main(["ca", "show", "--state-dir", str(state)]) == 0
    out = capsys.readouterr().out
    paths = ca_paths(state)
    ca_info = cert_info(load_cert(paths.ca_cert))
    assert out.splitlines()[:4] == [
        f"CA certificate {paths.ca_cert}",
        "  subject:     CN=llmgw cluster CA",
        f"  fingerprint: {ca_info.fingerprint_sha256}",
        f"  expires:     {ca_info.not_after:%Y-%m-%d %H:%M:%S} UTC",
    ]
    assert f"server certificate {paths.server_cert}\n  subject:     CN=localhost\n" in out
    assert "  addresses:   localhost, 127.0.0.1\n" in out


def test_show_json(state: Path, capsys: Capsys) -> None:
    assert cli.main(["ca", "show", "--state-dir", str(state), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["ca"]["subject"] == "CN=llmgw cluster CA" and shown["ca"]["is_ca"] is True
    assert shown["server"]["sans"] == ["localhost", "127.0.0.1"]
    assert shown["server"]["path"] == str(ca_paths(state).server_cert)
    assert datetime.fromisoformat(shown["ca"]["not_after"]).tzinfo is not None
    assert int(shown["server"]["serial"]) > 0


def test_show_without_a_ca_says_how_to_make_one(tmp_path: Path, capsys: Capsys) -> None:
    assert cli.main(["ca", "show", "--state-dir", str(tmp_path)]) == 1
    assert f"create one with `llmgw ca init --state-dir {tmp_path}`" in capsys.readouterr().err


def test_server_cert_reissues_for_new_addresses(state: Path, capsys: Capsys) -> None:
    argv = ["ca", "server-cert", "--state-dir", str(state), "--san", "10.0.0.5", "--san", "::1"]
    assert cli.main([*argv, "--validity-days", "3"]) == 0
    out = capsys.readouterr().out
    assert "addresses:   10.0.0.5, ::1" in out and "restart `llmgw server`" in out
    info = cert_info(load_cert(ca_paths(state).server_cert))
    assert info.sans == ("10.0.0.5", "::1") and 2 < days_left(info) <= 3


def test_server_cert_needs_an_address(state: Path, capsys: Capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["ca", "server-cert", "--state-dir", str(state)])
    assert exit_info.value.code == 2
    assert "the following arguments are required: --san" in capsys.readouterr().err


def test_issue_signs_a_request_to_standard_output(state: Path, tmp_path: Path, capsys: Capsys) -> None:
    node = write_node_key_and_csr(tmp_path / "agent", "whatever-it-asked")
    assert cli.main(["ca", "issue", "node01", "--state-dir", str(state), "--csr", str(node.csr)]) == 0
    cert = x509.load_pem_x509_certificate(capsys.readouterr().out.encode())
    info = cert_info(cert)
    assert info.common_name == "node01"
    assert 364 < days_left(info) <= 365


def test_issue_writes_the_certificate_with_out(state: Path, tmp_path: Path, capsys: Capsys) -> None:
    node = write_node_key_and_csr(tmp_path / "agent", "node02")
    out = tmp_path / "node02.crt"
    argv = ["ca", "issue", "node02", "--state-dir", str(state), "--csr", str(node.csr), "--out", str(out)]
    assert cli.main([*argv, "--validity-days", "2"]) == 0
    assert f"node certificate {out}" in capsys.readouterr().out
    info = cert_info(load_cert(out))
    assert info.common_name == "node02" and 1 < days_left(info) <= 2


def test_issue_by_hand_writes_key_cert_and_ca_into_a_directory(state: Path, tmp_path: Path, capsys: Capsys) -> None:
    out = tmp_path / "by-hand"
    assert cli.main(["ca", "issue", "node03", "--state-dir", str(state), "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["ca.crt", "node.crt", "node.csr", "node.key"]
    assert stat.S_IMODE((out / "node.key").stat().st_mode) == 0o600
    assert (out / "ca.crt").read_bytes() == ca_paths(state).ca_cert.read_bytes()
    assert cert_info(load_cert(out / "node.crt")).common_name == "node03"
    assert "into the node's pki directory" in capsys.readouterr().out


def test_issue_gateway_writes_its_key_and_certificate_of_the_gateway_role(
    state: Path, tmp_path: Path, capsys: Capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "gw"
    assert cli.main(["ca", "issue", "--gateway", "gw1", "--state-dir", str(state), "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["ca.crt", "gateway.crt", "gateway.key"]
    assert stat.S_IMODE((out / "gateway.key").stat().st_mode) == 0o600
    info = cert_info(load_cert(out / "gateway.crt"))
    assert (info.common_name, info.role) == ("gw1", ROLE_GATEWAY)
    assert 364 < days_left(info) <= 365  # a node certificate's validity
    printed = capsys.readouterr().out
    assert f"gateway certificate {out / 'gateway.crt'}" in printed and "into the gateway's pki directory" in printed
    # The store knows its serial, under its name, as it knows a node's.
    from llmgw.server.store import Store

    store = Store.open(state)
    try:
        row = store.certificate(info.serial)
    finally:
        store.close()
    assert row is not None and row.node_id == "gw1" and row.revoked_at is None
    # Without --out: ./gateway-NAME.
    monkeypatch.chdir(tmp_path)
    assert cli.main(["ca", "issue", "--gateway", "gw2", "--state-dir", str(state), "--validity-days", "3"]) == 0
    assert 2 < days_left(cert_info(load_cert(tmp_path / "gateway-gw2" / "gateway.crt"))) <= 3


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--gateway", "gw 1"], "gateway name 'gw 1' may use only letters"),
        (["--gateway", "control-plane"], "is the control plane's own gateway workers'"),  # it issues that itself
        (["node01", "--gateway", "gw1"], "--gateway NAME makes a gateway's key and certificate by itself"),
        (["--gateway", "gw1", "--csr", "x.csr"], "give no NODE_ID and no --csr"),
        ([], "name the node: `llmgw ca issue NODE_ID --csr FILE`"),
    ],
)
def test_issue_gateway_usage_errors(state: Path, capsys: Capsys, argv: list[str], says: str) -> None:
    assert cli.main(["ca", "issue", *argv, "--state-dir", str(state)]) == 2
    assert says in capsys.readouterr().err


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        ([], "give --csr FILE to sign a node's request (the node keeps its key), or --out DIR"),
        (
            ["--csr", "x.csr", "--out", "{tmp}"],
            "with --csr, --out names the certificate file to write, and {tmp} is a directory",
        ),
        (["--csr", "{tmp}/missing.csr"], "cannot read the request {tmp}/missing.csr: No such file or directory"),
        (["--out", "{tmp}", "--validity-days", "0"], "validity must be at least 1 day, got 0"),
    ],
)
def test_issue_usage_errors_say_which_form(
    state: Path, tmp_path: Path, capsys: Capsys, extra: list[str], says: str
) -> None:
    argv = ["ca", "issue", "node04", "--state-dir", str(state), *(a.format(tmp=tmp_path) for a in extra)]
    assert cli.main(argv) == 2
    assert says.format(tmp=tmp_path) in capsys.readouterr().err


def test_issue_refuses_a_bad_node_id(state: Path, tmp_path: Path, capsys: Capsys) -> None:
    assert cli.main(["ca", "issue", "bad id", "--state-dir", str(state), "--out", str(tmp_path / "o")]) == 2
    assert "node id 'bad id' may use only letters" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_ca_commands_as_a_real_process(tmp_path: Path) -> None:
    env = {"LLMGW_STATE_DIR": str(tmp_path / "state")}
    conf = tmp_path / "server.toml"
    conf.write_text("")  # not this machine's /etc/llmgw/server.toml
    done = run_llmgw("ca", "init", "--config", str(conf), "--san", "127.0.0.1", "--san", "fd00::1", env=env)
    assert done.returncode == 0, done.stderr
    assert "created the certificate authority" in done.stdout
    done = run_llmgw("ca", "show", "--json", env=env)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["server"]["sans"] == ["127.0.0.1", "fd00::1"]
    done = run_llmgw("ca", "init", env=env)
    assert done.returncode == 2
    assert "already exists" in done.stderr


# -- where `ca issue` records the serial ----------------------------------------------------


def _issue(state: Path, tmp_path: Path, node_id: str) -> tuple[int, int]:
    """`llmgw ca issue NODE --csr`; (exit status, serial printed or 0)."""
    import io
    from contextlib import redirect_stdout

    node = write_node_key_and_csr(tmp_path / node_id, node_id)
    out = io.StringIO()
    with redirect_stdout(out):
        status = cli.main(["ca", "issue", node_id, "--state-dir", str(state), "--csr", str(node.csr)])
    printed = out.getvalue()
    return status, x509.load_pem_x509_certificate(printed.encode()).serial_number if printed else 0


@pytest.mark.trio
async def test_issue_while_the_control_plane_runs_records_through_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, nursery
) -> None:
    import trio

    from llmgw.ctl.client import AdminClient
    from llmgw.server.store import Store

    state = tmp_path / "state"
    make_state(state)  # as `ca init` leaves it; not through the CLI, which would point logging at setup's stderr
    plane, _ = await serve_plane(state, nursery)

    def opened(*_: object) -> Store:
        raise AssertionError("`ca issue` opened the database while the control plane runs")

    monkeypatch.setattr(Store, "open", opened)
    status, serial = await trio.to_thread.run_sync(_issue, state, tmp_path, "node05")
    assert status == 0
    row = await plane.store.certificate(serial)
    assert row is not None and row.node_id == "node05" and row.revoked_at is None
    client = AdminClient.locate(server=None, credential=None, state_dir=str(state))
    assert (await trio.to_thread.run_sync(client.remove_node, "node05"))["revoked_serials"] == [f"{serial:x}"]


@pytest.mark.trio
async def test_issue_while_the_control_plane_cannot_record_prints_no_certificate(
    tmp_path: Path, capsys: Capsys, nursery
) -> None:
    import sqlite3

    import trio

    from llmgw.server.store import store_path

    state = tmp_path / "state"
    make_state(state)  # as `ca init` leaves it; not through the CLI, which would point logging at setup's stderr
    plane, _ = await serve_plane(state, nursery)
    capsys.readouterr()
    other = sqlite3.connect(str(store_path(state)), isolation_level=None)
    other.execute("BEGIN IMMEDIATE")  # a sqlite3 shell in a transaction
    try:
        status, serial = await trio.to_thread.run_sync(_issue, state, tmp_path, "node06")
    finally:
        other.execute("ROLLBACK")
        other.close()
    err = capsys.readouterr().err
    assert (status, serial) == (1, 0)
    assert f"{store_path(state)} is locked by another process" in err and "nothing changed; try again" in err
    assert "HTTP 503" in err


def test_issue_with_no_control_plane_running_records_in_the_database(state: Path, tmp_path: Path) -> None:
    from llmgw import paths
    from llmgw.server.store import Store
    from testlib.cluster import free_port

    # A control plane that was killed leaves its admin.url behind; nothing answers there.
    paths.admin_url_path(state).write_text(f"http://127.0.0.1:{free_port()}\n")
    status, serial = _issue(state, tmp_path, "node07")
    paths.admin_url_path(state).unlink()
    status_again, serial_again = _issue(state, tmp_path, "node08")  # and one that stopped: no admin.url
    assert status == status_again == 0
    store = Store.open(state)
    try:
        assert [store.certificate(serial).node_id, store.certificate(serial_again).node_id] == ["node07", "node08"]
        # In the audit log too, as the admin API's route would have recorded it, from this shell.
        entries = [(r.actor, r.source, r.action, r.target, r.detail["serial"]) for r in store.audit()]
        assert entries == [
            ("admin", "local", "certificate.record", "node08", f"{serial_again:x}"),
            ("admin", "local", "certificate.record", "node07", f"{serial:x}"),
        ]
    finally:
        store.close()
