"""`llmgw server add`'s parts: its steps, the server.toml and unit it writes, what it copies and
refuses, and its secrets, configure and verify steps against a scripted machine whose files live
in the test's directory. Against a real machine under systemd and a real PostgreSQL:
tests/integration/test_server_add_systemd.py."""

from __future__ import annotations

import hashlib
import os
import shutil
from datetime import datetime, timedelta, timezone
from pathlib import Path

import attrs
import pytest
import tomllib
import trio
from trio.testing import MockClock

from llmgw import cli
from llmgw import config as cfg
from llmgw.errors import ConfigError, MachineError, PeerError, UsageError
from llmgw.nodeadd import ssh
from llmgw.nodeadd.server import flow, install, layout
from llmgw.nodeadd.server.steps import NAMES, STEPS
from llmgw.nodeadd.steps import OK, STARTED, Checklist, Event
from llmgw.pki.ca import new_ca
from llmgw.pki.files import ca_paths, init_ca, issue_server_cert, load_ca
from llmgw.server.store.check import Seen

UNREACHABLE = "root@192.0.2.1"  # TEST-NET-1: nothing answers there; a run that dialled it would hang
STAGE = "/tmp/llmgw-node-add.test"
URL = "postgresql://llmgw@db1:5432/llmgw"
SOURCE = {
    "server": {"state_dir": "/srv/cp1", "agent_listen": "10.0.0.1:7443", "http_listen": "127.0.0.1:8080",
               "advertise": ["10.0.0.1"], "gateway_workers": 2},
    "store": {"url": URL, "password_file": "/etc/llmgw/pg.password"},
    "release": {"dir": "/srv/release"},
    "engines": {"llamacpp": {"version": ""}},
    "models": [{"name": "chat", "engine": "sim", "replicas": 2}],
}  # fmt: skip
SEEN = Seen(store="postgresql://db1:5432/llmgw", backend="postgresql", version=3, latest=3, identity="ab" * 32)

# -- the steps -----------------------------------------------------------------------------


def test_nothing_is_started_before_the_store_is_found_shared_there() -> None:
    assert NAMES[:2] == ("authority", "connect")
    assert NAMES.index("identify") < NAMES.index("ship") < NAMES.index("install") < NAMES.index("secrets")
    assert NAMES.index("configure") < NAMES.index("store") < NAMES.index("start") < NAMES.index("verify")
    c = Checklist(steps=STEPS)
    for name in NAMES:
        c.apply(Event(step=name, status=STARTED))
        c.apply(Event(step=name, status=OK))
    assert c.done and all(len(name) <= 10 for name in NAMES)


# -- server.toml ---------------------------------------------------------------------------


def test_its_server_toml_is_the_first_ones_with_its_own_addresses_state_and_password_file() -> None:
    rendered = layout.server_toml(SOURCE, store_url=URL, advertise=("10.0.0.2",), password_file=True)
    data = tomllib.loads(rendered.text)
    assert data["server"] == {
        "state_dir": layout.STATE_DIR,
        "agent_listen": "0.0.0.0:7443",  # 10.0.0.1 is the first machine's: the port, on every address
        "http_listen": "127.0.0.1:8080",  # loopback is loopback anywhere
        "advertise": ["10.0.0.2"],
        "gateway_workers": 2,
    }
    assert data["store"] == {"url": URL, "password_file": layout.PASSWORD_FILE}
    assert data["models"] == SOURCE["models"] and data["engines"] == SOURCE["engines"]  # the same catalog
    assert "release" not in data or "dir" not in data["release"]
    assert [n.split(" ", 1)[0] for n in rendered.notes] == ["agent_listen", "[release]"]
    assert SOURCE["server"]["state_dir"] == "/srv/cp1"  # the first one's, unchanged
    cfg.server_config_from_dict(data)  # `llmgw server` loads it


def test_a_store_read_from_libpqs_own_files_gets_no_password_file_and_wildcards_stay() -> None:
    source = {"server": {"agent_listen": "[::]:7443", "http_listen": "0.0.0.0:8080"}, "store": {"url": URL}}
    rendered = layout.server_toml(
        source, store_url=URL.replace("db1", "10.0.0.5"), advertise=("cp2",), password_file=False
    )
    data = tomllib.loads(rendered.text)
    assert data["store"] == {"url": URL.replace("db1", "10.0.0.5")}
    assert data["server"]["agent_listen"] == "[::]:7443" and data["server"]["http_listen"] == "0.0.0.0:8080"
    assert rendered.notes == ()


def test_a_server_toml_llmgw_server_would_refuse_is_never_written() -> None:
    with pytest.raises(ConfigError, match="the server.toml server add writes"):
        layout.server_toml({"models": [{"name": "x", "engine": "nope"}], "store": {"url": URL}}, store_url=URL,
                           advertise=("cp2",), password_file=False)  # fmt: skip


def test_a_sqlite_store_or_a_url_with_a_password_is_refused_saying_what_to_do() -> None:
    with pytest.raises(UsageError) as info:
        layout.refuse_sqlite(cfg.StoreSection(), Path("/etc/llmgw/server.toml"))
    assert "store is SQLite (/etc/llmgw/server.toml's [store])" in str(info.value)
    assert "llmgw server migrate-store --to postgresql://" in str(info.value)
    layout.refuse_sqlite(cfg.StoreSection(url=URL), None)
    with pytest.raises(UsageError, match="no two control planes can share"):
        layout.check_store_url("sqlite")
    with pytest.raises(UsageError) as info:
        layout.check_store_url("postgresql://llmgw:hunter2@db1/llmgw")
    assert "hunter2" not in str(info.value) and "@ --store" in str(info.value)


def test_what_is_copied_is_what_every_leader_needs_and_nothing_of_a_running_servers_own(tmp_path: Path) -> None:
    copied = layout.secrets(tmp_path, "/etc/llmgw/pg.password")
    assert [c.what for c in copied] == [
        "the CA certificate", "the CA key", "the engine-key secret", "the admin credential", "the store's password",
    ]  # fmt: skip
    assert {c.remote for c in copied} == {
        f"{layout.STATE_DIR}/ca/ca.crt", f"{layout.STATE_DIR}/ca/ca.key", f"{layout.STATE_DIR}/engine-keys.secret",
        f"{layout.STATE_DIR}/admin.token", layout.PASSWORD_FILE,
    }  # fmt: skip
    assert all(c.mode == 0o600 for c in copied if c.secret) and not any(c.local.name == "server.key" for c in copied)
    assert [c.what for c in layout.secrets(tmp_path, "")][-1] == "the admin credential"


def test_the_unit_runs_the_server_as_its_user_with_the_sandbox_and_says_what_it_leaves_out() -> None:
    unit = layout.systemd_unit()
    assert f"User={layout.USER}\n" in unit and f"ExecStart={layout.BIN} server --config {layout.CONFIG}\n" in unit
    assert f"ReadWritePaths={layout.STATE_DIR}\n" in unit and "ProtectSystem=strict\n" in unit
    for key, _ in layout.NOT_HARDENED:
        assert f"#   {key}: " in unit


# -- refusals on the machine -----------------------------------------------------------------


def test_a_machine_holding_another_ca_is_refused_and_the_same_one_is_not(tmp_path: Path) -> None:
    init_ca(tmp_path, validity_days=30)
    ca = load_ca(tmp_path)
    install.refuse_another_ca(ca.cert_pem(), ca, "root@cp2")
    other = new_ca(validity_days=30, common_name="theirs")
    with pytest.raises(UsageError) as info:
        install.refuse_another_ca(other.cert_pem(), ca, "root@cp2")
    assert "root@cp2 holds another CA in /var/lib/llmgw ('theirs'" in str(info.value)
    assert "Nothing was changed there" in str(info.value) and f"sudo mv {layout.STATE_DIR}" in str(info.value)
    with pytest.raises(UsageError, match="is not a certificate"):
        install.refuse_another_ca(b"junk", ca, "root@cp2")


def test_the_agent_ports_certificate_there_is_kept_only_while_it_fits(tmp_path: Path) -> None:
    init_ca(tmp_path, validity_days=3650)
    ca = load_ca(tmp_path)
    assert install.cert_misfit(None, ca, ("10.0.0.2",)) == "there was none"
    issue_server_cert(ca, tmp_path, ["10.0.0.2"], validity_days=400)
    pem = ca_paths(tmp_path).server_cert.read_bytes()
    assert install.cert_misfit(pem, ca, ("10.0.0.2",)) == ""
    assert install.cert_misfit(pem, ca, ("10.0.0.2", "cp2")) == "the one there is for 10.0.0.2"
    soon = (datetime.now(timezone.utc) + timedelta(days=390)).timestamp()
    assert install.cert_misfit(pem, ca, ("10.0.0.2",), now=soon).startswith("the one there ends ")
    theirs = new_ca(validity_days=30)
    assert install.cert_misfit(pem, theirs, ("10.0.0.2",)) == "the one there is another CA's"


# -- secrets and configure, against a scripted machine ---------------------------------------


class _Machine:
    """A machine whose files live under `root` (a remote path /x is root/x), each with the mode
    and owner `install` gave it; it answers the commands server add runs on them."""

    def __init__(self, root: Path, ca) -> None:
        self.target = ssh.Target(user="root", host="10.0.0.2")
        self.user = "root"
        self.root = root
        self.ca = ca
        self.meta: dict[str, list[str]] = {}
        self.ran: list[list[str]] = []
        self.units: dict[str, str] = {}
        self.restarts = [0]
        self.probe = "hostname=cp2\narch=x86_64\nsystemd=yes\nos_id=debian\n"

    def path(self, remote: str) -> Path:
        return self.root / remote.lstrip("/")

    async def run(self, argv, *, sudo=False, timeout_s):
        argv = list(argv)
        self.ran.append(argv)
        if argv[:2] == ["sh", "-c"]:
            return self._ok(self.probe)
        p = self.path(argv[-1])
        if argv[:3] == ["stat", "-c", "%a %U %G"]:
            return self._ok(" ".join(self.meta[argv[-1]]) + "\n") if p.exists() else self._fail("No such file")
        if argv[0] == "sha256sum":
            return self._ok(f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {argv[-1]}\n")
        if argv[:2] == ["cat", "--"]:
            return self._ok(p.read_text()) if p.exists() else self._fail("No such file or directory")
        if argv[0] == "install" and argv[1] == "-m":
            src, dest = argv[-2], argv[-1]
            self.path(dest).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(self.path(src), self.path(dest))
            self.meta[dest] = [argv[2].lstrip("0"), argv[4], argv[6]]
            return self._ok("")
        if argv[:3] == ["rm", "-f", "--"]:
            p.unlink(missing_ok=True)
            return self._ok("")
        if argv[:2] == ["runuser", "-u"] and argv[argv.index(layout.BIN) + 1 : argv.index(layout.BIN) + 3] == [
            "ca", "server-cert"
        ]:  # fmt: skip
            assert argv[2] == layout.USER
            sans = [argv[i + 1] for i, a in enumerate(argv) if a == "--san"]
            issue_server_cert(self.ca, self.path(layout.STATE_DIR), sans, validity_days=400)
            self.meta[layout.SERVER_CERT] = ["644", layout.USER, layout.USER]
            return self._ok("")
        if argv[0] == "systemctl":
            if argv[1] == "is-enabled":
                return self._ok(self.units.get(argv[2], "disabled") + "\n")
            if argv[1] == "enable":
                self.units[argv[2]] = "enabled"
            if argv[1] == "show":
                return self._ok(f"{self.restarts.pop(0) if len(self.restarts) > 1 else self.restarts[0]}\n")
            return self._ok("")
        if argv[0] == "journalctl":
            return self._ok("server_start_failed reason=address in use\n")
        return self._fail(f"unexpected: {argv}")

    async def put(self, local: Path, remote: str, mode: int = 0o755, *, timeout_s: float = 600) -> None:
        assert mode == 0o600  # a staged file is the login's alone
        self.path(remote).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(local, self.path(remote))

    @staticmethod
    def _ok(out: str) -> ssh.Result:
        return ssh.Result(exit_status=0, stdout=out, stderr="")

    @staticmethod
    def _fail(err: str) -> ssh.Result:
        return ssh.Result(exit_status=1, stdout="", stderr=err)


@attrs.frozen
class _Plane:
    state: Path
    held: install.Held
    opts: install.Options


def _plane(tmp_path: Path) -> _Plane:
    state = tmp_path / "cp1"
    init_ca(state, validity_days=3650)
    for name, text in (("engine-keys.secret", "5e" * 32), ("admin.token", "the-admin-token")):
        (state / name).write_text(text + "\n")
        os.chmod(state / name, 0o600)
    password = tmp_path / "pg.password"
    password.write_text("the-store-password\n")
    password.chmod(0o600)
    config = cfg.ServerConfig(store=cfg.StoreSection(url=URL, password_file=str(password)))
    opts = install.Options(
        target="root@10.0.0.2",
        server_config=config,
        state_dir=state,
        known_hosts=tmp_path / "kh",
        source=SOURCE,
        store_url=URL,
        look_store=lambda: SEEN,
    )
    return _Plane(state=state, held=flow.read_held(opts), opts=opts)


def _facts() -> install.Facts:
    facts = install.Facts(stage=STAGE)
    facts.advertise = ("10.0.0.2",)
    return facts


def test_secrets_go_as_files_their_users_own_never_as_words_and_again_nothing_changes(tmp_path: Path) -> None:
    plane = _plane(tmp_path)
    machine = _Machine(tmp_path / "machine", plane.held.ca)
    facts = _facts()
    said = trio.run(install.secrets, machine, facts, plane.held)
    assert said.startswith(
        "placed the CA certificate, the CA key, the engine-key secret, the admin credential, the store's"
    )
    for copied, data in plane.held.files:
        assert machine.path(copied.remote).read_bytes() == data
        assert machine.meta[copied.remote] == [f"{copied.mode:o}", layout.USER, layout.USER]
    assert not machine.path(f"{STAGE}/placing").exists()  # each staged copy removed once placed
    text = "\n".join(" ".join(argv) for argv in machine.ran)
    for secret in ("the-admin-token", "5e" * 32, "the-store-password", load_ca(plane.state).key_pem().decode()[40:80]):
        assert secret not in text

    machine.ran.clear()
    again = _facts()
    said = trio.run(install.secrets, machine, again, plane.held)
    assert said.startswith("the same as there: the CA certificate, the CA key") and again.changed == []
    assert not any(argv[0] == "install" for argv in machine.ran)


def test_configure_writes_server_toml_the_certificate_and_the_unit_once(tmp_path: Path) -> None:
    plane = _plane(tmp_path)
    machine = _Machine(tmp_path / "machine", plane.held.ca)
    facts = _facts()
    said = trio.run(install.configure, plane.opts, machine, facts, plane.held)
    assert f"wrote {layout.CONFIG}; wrote {layout.UNIT}; enabled {layout.UNIT_NAME}" in said
    assert "its agent port's certificate made there for 10.0.0.2 (there was none)" in said
    assert "agent_listen 10.0.0.1:7443 is this machine's address: 0.0.0.0:7443 there" in said
    assert machine.meta[layout.CONFIG] == ["640", "root", layout.USER]
    written = tomllib.loads(machine.path(layout.CONFIG).read_text())
    assert written["store"]["password_file"] == layout.PASSWORD_FILE and written["server"]["advertise"] == ["10.0.0.2"]
    assert ["systemctl", "daemon-reload"] in machine.ran

    machine.ran.clear()
    again = _facts()
    said = trio.run(install.configure, plane.opts, machine, again, plane.held)
    assert said.startswith(f"{layout.CONFIG} and {layout.UNIT} (enabled) the same as there")
    assert "certificate kept" in said and again.changed == []
    assert ["systemctl", "daemon-reload"] not in machine.ran


def test_a_missing_secret_here_is_said_before_the_machine_is_touched(tmp_path: Path) -> None:
    plane = _plane(tmp_path)
    (plane.state / "engine-keys.secret").unlink()
    with pytest.raises(MachineError, match="the engine-key secret is not at .*llmgw ca init"):
        flow.read_held(plane.opts)
    (plane.state / "admin.token").chmod(0o644)
    (plane.state / "engine-keys.secret").write_text("x")
    (plane.state / "engine-keys.secret").chmod(0o600)
    with pytest.raises(MachineError, match="admin.token has mode 0644"):
        flow.read_held(plane.opts)


def test_an_empty_store_is_refused_here(tmp_path: Path) -> None:
    plane = _plane(tmp_path)
    empty = attrs.evolve(SEEN, version=0, identity="")
    with pytest.raises(MachineError, match="holds no llmgw state: this control plane has never run on it"):
        flow.read_held(attrs.evolve(plane.opts, look_store=lambda: empty))


def test_identify_refuses_this_machine_one_without_systemd_and_one_of_another_cluster(tmp_path: Path) -> None:
    plane = _plane(tmp_path)
    machine = _Machine(tmp_path / "machine", plane.held.ca)
    machine.path("/etc/machine-id").parent.mkdir(parents=True)
    machine.path("/etc/machine-id").write_text("0123abcd\n")
    said = trio.run(install.identify, plane.opts, machine, _facts(), plane.held, "feedface")
    assert said == "cp2, x86_64, systemd; no CA there yet"
    with pytest.raises(UsageError, match="is this machine"):
        trio.run(install.identify, plane.opts, machine, _facts(), plane.held, "0123abcd")
    machine.path(layout.CA_CERT).parent.mkdir(parents=True)
    machine.path(layout.CA_CERT).write_bytes(plane.held.ca.cert_pem())
    said = trio.run(install.identify, plane.opts, machine, _facts(), plane.held, "feedface")
    assert said.startswith("cp2, x86_64, systemd; it holds this cluster's CA already")
    machine.path(layout.CA_CERT).write_bytes(new_ca(validity_days=30, common_name="theirs").cert_pem())
    with pytest.raises(UsageError, match="holds another CA"):
        trio.run(install.identify, plane.opts, machine, _facts(), plane.held, "feedface")
    machine.probe = machine.probe.replace("systemd=yes", "systemd=no")
    with pytest.raises(MachineError, match="does not run systemd"):
        trio.run(install.identify, plane.opts, machine, _facts(), plane.held, "feedface")


# -- verify --------------------------------------------------------------------------------


def _verify(plane: _Plane, machine: _Machine, answers: list, said: list[str], timeout_s: float = 60) -> str:
    async def ask() -> dict:
        got = answers.pop(0) if len(answers) > 1 else answers[0]
        if isinstance(got, Exception):
            raise got
        return got

    async def go() -> str:
        return await install.verify(machine, plane.held, timeout_s=timeout_s, progress=said.append, ask=ask)

    return trio.run(go, clock=MockClock(autojump_threshold=0))


def test_verify_waits_for_the_admin_api_then_wants_the_same_ca(tmp_path: Path) -> None:
    plane = _plane(tmp_path)
    info = plane.held.ca.info()
    ours = {"common_name": info.common_name, "fingerprint_sha256": info.fingerprint_sha256}
    down = PeerError("its admin API has not said where it answers yet")
    said: list[str] = []
    done = _verify(plane, _Machine(tmp_path / "m", plane.held.ca), [down, down, ours], said)
    assert done.startswith(f"its admin API answers with this cluster's CA {info.common_name!r}")
    assert said == ["waiting: its admin API has not said where it answers yet"]  # once, not each poll
    theirs = dict(ours, fingerprint_sha256="AA:" * 31 + "AA")
    with pytest.raises(PeerError, match="answers with another CA"):
        _verify(plane, _Machine(tmp_path / "m", plane.held.ca), [theirs], [])
    with pytest.raises(PeerError, match="did not answer within 5 s"):
        _verify(plane, _Machine(tmp_path / "m", plane.held.ca), [down], [], timeout_s=5)
    crashing = _Machine(tmp_path / "m", plane.held.ca)
    crashing.restarts = [0, 1, 3]
    with pytest.raises(PeerError) as info_:
        _verify(plane, crashing, [down], [])
    assert "keeps exiting: systemd started it again 3 times" in str(info_.value)
    assert "server_start_failed reason=address in use" in str(info_.value)


# -- the command line ------------------------------------------------------------------------


def test_a_sqlite_control_plane_is_refused_before_the_machine_is_touched(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = tmp_path / "state"
    config = tmp_path / "server.toml"
    config.write_text(f'[server]\nstate_dir = "{state}"\n')
    init_ca(state, validity_days=30)
    assert cli.main(["server", "add", UNREACHABLE, "--plain", "--config", str(config)]) == 2
    [line] = capsys.readouterr().out.splitlines()  # the authority's failure, and no connect step after it
    assert line.startswith("failed authority ") and "store is SQLite" in line and "migrate-store" in line


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--store", "sqlite"], "no two control planes can share"),
        (["--start-timeout", "0"], "--start-timeout must be positive"),
    ],
)
def test_a_bad_argument_is_refused_before_anything_is_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], said: str
) -> None:
    missing = tmp_path / "no-such-state"
    assert cli.main(["server", "add", UNREACHABLE, "--plain", "--state-dir", str(missing), *args]) == 2
    assert said in capsys.readouterr().err
    assert not missing.exists()


def test_the_docs_say_why_for_each_setting_the_unit_leaves_out() -> None:
    from testlib.proc import build_root

    text = (build_root() / "docs" / "high-availability.md").read_text()
    for key, _ in layout.NOT_HARDENED:
        assert f"`{key}`" in text, key
    assert layout.UNIT_NAME in text and layout.PASSWORD_FILE in text
