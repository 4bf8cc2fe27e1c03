"""`llmgw server add` on a real systemd machine (testlib.machine: a Debian 12 root booted with
systemd-nspawn, its own network namespace, a real sshd), against a real PostgreSQL
(testlib.postgres) that this machine and the new control plane's machine both reach.

What an operator's second control plane gets is what is tested: the release installed, the
control plane's user and state directory made, the CA, the engine-key secret, the admin
credential and the store's password placed 0600 and that user's own, server.toml naming the
same store and catalog, the unit enabled and running as that user, its admin API answering (to
the command, through an SSH forward; to `llmgw ctl` there) with this cluster's CA. Refused: a
store the machine cannot reach (nothing started), a machine holding another CA (nothing
changed). Adding again changes nothing and says so.

The secrets never leave as words: every command sshd ran on the machine is recorded by its
login shell (a wrapper the test installs), the process table is watched while the command runs,
and neither these, the command's output, the unit's journal nor any table of the store holds
any of them.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import tomllib
from cryptography import x509

from llmgw.nodeadd.server import layout
from llmgw.pki.ca import cert_info, new_ca
from llmgw.pki.files import load_ca
from llmgw.server.store import Store
from testlib.exposure import cmdlines_holding
from testlib.machine import Machine, machine_fixture
from testlib.nodeadd import ADD_TIMEOUT_S, CATALOG, VERSION
from testlib.postgres import Database, PostgresServer, running_server
from testlib.proc import run_llmgw

HOSTNAME = "cp2"
UNIT = layout.UNIT_NAME
COMMANDS_LOG = "/var/log/llmgw-test-ssh-commands.log"
# The machine's login shell: records each command sshd hands it, then runs it as sh would.
LOGGING_SHELL = f"""#!/bin/sh
printf '%s\\n' "$*" >> {COMMANDS_LOG}
exec /bin/sh "$@"
"""


def _login_logged(m: Machine) -> None:
    """root's login shell on the machine records each command sshd hands it (LOGGING_SHELL)."""
    shell = m.path("/usr/local/sbin/llmgw-test-login")
    shell.write_text(LOGGING_SHELL)
    shell.chmod(0o755)
    passwd = m.path("/etc/passwd")
    passwd.write_text(re.sub(r"^(root:[^\n]*:)[^:\n]*$", r"\g<1>/usr/local/sbin/llmgw-test-login", passwd.read_text(),
                             count=1, flags=re.M))  # fmt: skip


# The onboarding tests' fixtures: release_dir, the release (testlib.nodeadd.VERSION) they all share.
pytest_plugins = ("testlib.nodeadd",)
machine = machine_fixture(HOSTNAME, before_boot=_login_logged)


@pytest.fixture()
def pg(machine: Machine) -> Iterator[PostgresServer]:
    """Reached from here on loopback and on this side of the machine's link, and from the machine."""
    with running_server(
        listen=("127.0.0.1", machine.host_addr), clients=(machine.host_addr, machine.node_addr)
    ) as server:
        yield server


class Plane:
    """The first control plane's files on this machine: a CA, its secrets, a server.toml naming
    the PostgreSQL store (which it has opened, so it holds llmgw's schema)."""

    def __init__(self, root: Path, machine: Machine, pg: PostgresServer, db: Database) -> None:
        self.root = root
        self.machine = machine
        self.pg = pg
        self.db = db
        self.state = root / "state"
        self.config = root / "server.toml"
        self.known_hosts = root / "known_hosts"
        root.mkdir(parents=True)
        self.write_config(host="127.0.0.1")
        done = run_llmgw("ca", "init", "--config", str(self.config))
        assert done.returncode == 0, done.stderr
        Store.open(self.state, db.settings).close()  # as a first start does: the schema made

    def write_config(self, *, host: str) -> None:
        self.config.write_text(
            "[server]\n"
            f'state_dir = "{self.state}"\n'
            f'agent_listen = "{self.machine.host_addr}:7443"\n'
            'http_listen = "127.0.0.1:0"\n'
            f'advertise = ["{self.machine.host_addr}"]\n'
            "gateway_workers = 1\n"
            "\n[store]\n"
            f'url = "{self.pg.url(self.db.name, host=host)}"\n'
            f'password_file = "{self.db.password_file}"\n' + CATALOG
        )

    def secrets(self) -> dict[str, str]:
        """Each secret a control plane holds, as text a leak would show."""
        key_lines = (self.state / "ca" / "ca.key").read_text().splitlines()
        return {
            "the CA key": max(key_lines, key=len),  # a line of its base64 body
            "the engine-key secret": (self.state / "engine-keys.secret").read_text().strip(),
            "the admin credential": (self.state / "admin.token").read_text().strip(),
            "the store's password": self.pg.password,
        }

    def add(self, *extra: str) -> tuple[int, str, str]:
        done = run_llmgw(
            "server", "add", self.machine.target, "--config", str(self.config), "--known-hosts",
            str(self.known_hosts), "-i", str(self.machine.client_key), "--plain", "--start-timeout", "120", *extra,
            timeout=ADD_TIMEOUT_S,
        )  # fmt: skip
        return done.returncode, done.stdout, done.stderr


@pytest.fixture()
def plane(tmp_path: Path, machine: Machine, pg: PostgresServer) -> Plane:
    return Plane(tmp_path / "plane", machine, pg, pg.create_database())


class ArgvWatch:
    """Every process of this machine and the container whose argv holds a secret, looked for
    again and again while a command runs (/proc is shared: the container's processes are there)."""

    def __init__(self, secrets: dict[str, str]) -> None:
        self.secrets = secrets
        self.found: list[tuple[str, list[str]]] = []
        self.rounds = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        while not self._stop.wait(0.02):
            self.rounds += 1
            for what, secret in self.secrets.items():
                self.found += [(what, argv) for _, argv in cmdlines_holding(secret)]

    def __enter__(self) -> ArgvWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _lines(out: str) -> dict[str, str]:
    return {line.split()[1]: line for line in out.splitlines() if line.startswith(("ok", "warn", "failed"))}


def _stat(machine: Machine, path: str) -> list[str]:
    return machine.run("stat", "-c", "%a %U %G", path).stdout.split()


def _store_text(pg: PostgresServer, db: Database) -> str:
    """Every row of every table of the store, as text."""
    with pg.connect(db) as conn:
        tables = [r[0] for r in conn.execute("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")]
        return "\n".join(f"{t}: {conn.execute(f'SELECT * FROM {t}').fetchall()!r}" for t in tables)


def test_a_machine_becomes_a_second_control_plane_refusing_what_it_must_and_converging(
    plane: Plane, machine: Machine, pg: PostgresServer, release_dir: Path
) -> None:
    secrets = plane.secrets()
    outputs = []

    # The store's url names 127.0.0.1: this machine reaches it there, the new one does not.
    with ArgvWatch(secrets) as watch:
        rc, out, err = plane.add("--accept-new-host-key", "--release", str(release_dir))
    outputs.append(out + err)
    assert rc != 0, out + err
    lines = _lines(out)
    assert lines["store"].startswith("failed"), out
    assert "cannot use the store at postgresql://127.0.0.1:" in lines["store"], out
    assert "the control plane there was not started" in lines["store"], out
    assert "start" not in lines, out
    assert machine.systemctl("is-active", UNIT) != "active"

    # Named by the address the machine reaches it at, it is the same store: the control plane starts.
    plane.write_config(host=machine.host_addr)
    started = time.monotonic()
    with ArgvWatch(secrets) as watch2:
        rc, out, err = plane.add("--release", str(release_dir))
    print(f"server add: {time.monotonic() - started:.1f} s")
    outputs.append(out + err)
    assert rc == 0, out + err
    lines = _lines(out)
    assert list(lines) == ["authority", "connect", "identify", "ship", "install", "secrets", "configure", "store",
                           "start", "verify"], out  # fmt: skip
    assert "cp2, x86_64, systemd; it holds this cluster's CA already" in lines["identify"], out  # from the refused run
    assert f"reaches postgresql://{machine.host_addr}:{pg.port}/{plane.db.name}, the same store" in lines["store"], out
    assert "started (systemctl restart" in lines["start"], out
    fingerprint = run_llmgw("ca", "show", "--config", str(plane.config), "--json").stdout
    assert "its admin API answers with this cluster's CA" in lines["verify"], out
    assert re.search(r"sha256 ([0-9A-F:]{23})", lines["verify"]).group(1) in fingerprint, out
    assert "agent_listen" in lines["configure"] and lines["configure"].startswith("warn"), out  # host_addr is ours
    assert f"the control plane on {machine.node_addr} runs llmgw {VERSION}" in out, out

    # Its files: the secrets 0600 and the service user's, the same bytes as here; server.toml root's.
    for path, mode in (("ca/ca.key", "600"), ("engine-keys.secret", "600"), ("admin.token", "600"),
                       ("store.password", "600"), ("ca/ca.crt", "644"), ("ca/server.key", "600")):  # fmt: skip
        assert _stat(machine, f"{layout.STATE_DIR}/{path}") == [mode, layout.USER, layout.USER], path
    assert _stat(machine, layout.STATE_DIR) == ["700", layout.USER, layout.USER]
    assert _stat(machine, layout.CONFIG) == ["640", "root", layout.USER]
    for name in ("ca/ca.key", "ca/ca.crt", "engine-keys.secret", "admin.token"):
        assert machine.path(f"{layout.STATE_DIR}/{name}").read_bytes() == (plane.state / name).read_bytes(), name
    assert machine.path(layout.PASSWORD_FILE).read_text() == plane.db.password_file.read_text()
    written = machine.path(layout.CONFIG).read_text()
    assert f'url = "postgresql://llmgw_test@{machine.host_addr}:{pg.port}/{plane.db.name}"' in written
    assert f'password_file = "{layout.PASSWORD_FILE}"' in written and 'name = "sim-small"' in written
    assert tomllib.loads(written)["server"]["advertise"] == [machine.node_addr]
    assert machine.path(layout.UNIT).read_text() == layout.systemd_unit()

    # The unit runs as its user; the credential copied opens its admin API to `llmgw ctl` there too.
    assert machine.systemctl("is-enabled", UNIT) == "enabled" and machine.systemctl("is-active", UNIT) == "active"
    pid = machine.systemctl("show", "-p", "MainPID", "--value", UNIT)
    assert machine.run("ps", "-o", "user=", "-p", pid).stdout.strip() == layout.USER
    security = machine.run("systemd-analyze", "security", "--no-pager", UNIT, check=False).stdout
    level = re.search(r"Overall exposure level for \S+: ([0-9.]+) (\w+)", security)
    assert level is not None, security
    assert float(level.group(1)) <= 3.0, security
    print(f"systemd-analyze security {UNIT}: {level.group(1)} {level.group(2)}")
    ctl = machine.run(layout.BIN, "ctl", "models", "--json", "--state-dir", layout.STATE_DIR, check=False)
    assert ctl.returncode == 0 and "sim-small" in ctl.stdout, ctl.stdout + ctl.stderr
    served = x509.load_pem_x509_certificate(machine.path(layout.SERVER_CERT).read_bytes())
    assert cert_info(served).sans == (machine.node_addr,)
    served.verify_directly_issued_by(load_ca(plane.state).cert)

    # Again: nothing changes, and it says so; the service is not restarted.
    rc, out, err = plane.add("--release", str(release_dir))
    outputs.append(out + err)
    assert rc == 0, out + err
    lines = _lines(out)
    assert out.splitlines()[-1].startswith("nothing changed: the control plane on"), out
    assert "running already, with the same files: not restarted" in lines["start"], out
    assert "the same as there" in lines["secrets"] and "the same as there" in lines["configure"], out
    assert "certificate kept" in lines["configure"], out
    assert machine.systemctl("show", "-p", "MainPID", "--value", UNIT) == pid

    # A machine holding another CA is another cluster's: refused, nothing changed there.
    other = new_ca(validity_days=30, common_name="another cluster")
    machine.path(layout.CA_CERT).write_bytes(other.cert_pem())
    key_before = machine.path(f"{layout.STATE_DIR}/ca/ca.key").read_bytes()
    rc, out, err = plane.add("--release", str(release_dir))
    outputs.append(out + err)
    assert rc != 0, out + err
    lines = _lines(out)
    assert lines["identify"].startswith("failed") and "holds another CA in /var/lib/llmgw ('another cluster'" in out
    assert "ship" not in lines, out
    assert machine.path(f"{layout.STATE_DIR}/ca/ca.key").read_bytes() == key_before
    assert machine.systemctl("show", "-p", "MainPID", "--value", UNIT) == pid

    # No secret was ever a word of a command, a line of output or the journal, or a value in the store.
    sent = machine.path(COMMANDS_LOG).read_text()
    assert "install -m 0600 -o llmgw -g llmgw" in sent and "check-store" in sent, sent[-2000:]
    journal = machine.journal(UNIT, 2000)
    store = _store_text(pg, plane.db)
    assert "nodes" in store  # the tables were read
    assert watch.rounds > 10 and watch2.rounds > 10
    for what, secret in secrets.items():
        assert secret not in sent, what
        assert all(secret not in o for o in outputs), what
        assert secret not in journal, what
        assert secret not in store, what
    assert watch.found == [] and watch2.found == []
    print("\n\n".join(outputs))
