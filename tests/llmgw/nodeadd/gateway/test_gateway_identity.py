"""`llmgw gateway add`'s identify and identity steps against a scripted machine whose files live
in the test's directory: the key is made there (as the gateway's user, by `llmgw gateway csr`,
whose code this runs), the request signed here with the gateway role, the serial recorded in a
real store before the certificate is installed, and a run again keeps, renews or reissues."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import trio
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from llmgw import config as cfg
from llmgw.errors import MachineError, UsageError
from llmgw.nodeadd import ssh
from llmgw.nodeadd.gateway import install, layout
from llmgw.nodeadd.steps import OK, WARN
from llmgw.pki.ca import CA, ROLE_GATEWAY, cert_info, make_key_and_csr
from llmgw.pki.files import gateway_paths, init_ca, load_ca, write_gateway_key_and_csr
from llmgw.server.store import Store

STAGE = "/tmp/llmgw-node-add.test"
PKI = gateway_paths(Path(layout.PKI_DIR))


class _Machine:
    """A gateway's machine: the probe's answer, and the commands gateway add runs on its files,
    which live under `root` (a remote path /x is root/x)."""

    def __init__(self, root: Path, *, hostname: str = "gw-a", systemd: bool = True) -> None:
        self.target = ssh.Target(user="root", host="10.0.0.31")
        self.user = "root"
        self.root = root
        self.probe = f"hostname={hostname}\narch=x86_64\nsystemd={'yes' if systemd else 'no'}\nos_id=debian\n"
        self.owners: dict[str, str] = {}  # remote path -> the owner `install -o` gave it
        self.ran: list[list[str]] = []

    def path(self, remote: str) -> Path:
        return self.root / remote.lstrip("/")

    async def run(self, argv, *, sudo=False, timeout_s):
        argv = list(argv)
        self.ran.append(argv)
        if argv[:2] == ["sh", "-c"]:
            return self._ok(self.probe)
        if argv[:2] == ["cat", "--"]:
            p = self.path(argv[2])
            return self._ok(p.read_text()) if p.exists() else self._fail("No such file or directory")
        if argv[:2] == ["test", "-e"]:
            return self._ok("") if self.path(argv[2]).exists() else self._fail("")
        if argv[:3] == ["rm", "-f", "--"]:
            for remote in argv[3:]:
                self.path(remote).unlink(missing_ok=True)
            return self._ok("")
        if argv[:2] == ["runuser", "-u"] and argv[argv.index("--") + 1 :][-6:-4] == ["gateway", "csr"]:
            assert argv[2] == layout.USER  # the key is the gateway user's own
            write_gateway_key_and_csr(self.path(argv[-3]), argv[-1])
            return self._ok("")
        if argv[:5] == ["install", "-m", "0644", "-o", layout.USER]:
            src, dest = argv[-2], argv[-1]
            shutil.copyfile(self.path(src), self.path(dest))
            self.owners[dest] = argv[4]
            return self._ok("")
        return self._fail(f"unexpected: {argv}")

    async def put(self, local: Path, remote: str, mode: int = 0o755, *, timeout_s: float = 600) -> None:
        self.path(remote).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(local, self.path(remote))

    @staticmethod
    def _ok(out: str) -> ssh.Result:
        return ssh.Result(exit_status=0, stdout=out, stderr="")

    @staticmethod
    def _fail(err: str) -> ssh.Result:
        return ssh.Result(exit_status=1, stdout="", stderr=err)


class _StoreAdmin:
    """The admin API's certificate routes, answered from the store as the control plane answers them."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir
        self.recorded: list[tuple[int, str, bool, tuple[int, ...]]] = []

    def record_certificate(self, serial, node_id, not_after, *, revoke_others=False, also_revoke=()):
        self.recorded.append((serial, node_id, revoke_others, tuple(also_revoke)))
        with _store(self.state_dir) as store:
            revoked = store.record_issued(
                serial, node_id, not_after, revoke_others=revoke_others, also_revoke=also_revoke
            )
        return [int(n) for n in revoked]

    def is_revoked(self, serial: int) -> bool:
        with _store(self.state_dir) as store:
            return store.is_revoked(serial)


class _store:
    def __init__(self, state_dir: Path) -> None:
        self.store = Store.open(state_dir)

    def __enter__(self) -> Store:
        return self.store

    def __exit__(self, *exc: object) -> None:
        self.store.close()


@pytest.fixture
def ca(tmp_path: Path) -> CA:
    init_ca(tmp_path / "plane", validity_days=30)
    return load_ca(tmp_path / "plane")


def _opts(tmp_path: Path, *, reissue: bool = False, name: str = "") -> install.Options:
    return install.Options(
        target="root@10.0.0.31",
        server_config=cfg.server_config_from_dict({"server": {"agent_listen": "0.0.0.0:7443"}}),
        state_dir=tmp_path / "plane",
        known_hosts=tmp_path / "known_hosts",
        reissue=reissue,
        name=name,
    )


def _auth(tmp_path: Path, ca: CA, *, nodes=(), gateways=()) -> install.Authority:
    return install.Authority(
        ca=ca,
        server_cert=None,  # type: ignore[arg-type]  # not read by these steps
        admin=_StoreAdmin(tmp_path / "plane"),  # type: ignore[arg-type]
        nodes=list(nodes),
        gateways=list(gateways),
    )


def _add(tmp_path: Path, machine: _Machine, auth: install.Authority, **opts) -> tuple[install.Facts, str, str]:
    """identify, then identity, as a run of gateway add does them; the facts and both steps' words."""
    o = _opts(tmp_path, **opts)
    facts = install.Facts(stage=STAGE)

    async def steps() -> tuple[str, str]:
        status, said = await install.identify(o, machine, facts, auth)
        assert status in (OK, WARN)
        return said, await install.identity(o, machine, facts, auth)

    identified, identity = trio.run(steps)
    return facts, identified, identity


def _held(machine: _Machine) -> x509.Certificate:
    return x509.load_pem_x509_certificate(machine.path(str(PKI.cert)).read_bytes())


def _machine_key(machine: _Machine):
    return serialization.load_pem_private_key(machine.path(str(PKI.key)).read_bytes(), password=None)


# -- identify ------------------------------------------------------------------------------


def test_a_machine_without_systemd_is_refused_before_anything_is_written(tmp_path: Path, ca: CA) -> None:
    machine = _Machine(tmp_path / "m", systemd=False)
    with pytest.raises(MachineError, match="does not run systemd.*`llmgw gateway --server wss://HOST:PORT` there"):
        _add(tmp_path, machine, _auth(tmp_path, ca))
    assert [a[0] for a in machine.ran] == ["sh"]


def test_a_nodes_name_is_refused_and_another_given(tmp_path: Path, ca: CA) -> None:
    machine = _Machine(tmp_path / "m", hostname="node-a")
    with pytest.raises(UsageError, match="'node-a' is a node of the cluster"):
        _add(tmp_path, machine, _auth(tmp_path, ca, nodes=[{"id": "node-a"}]))
    facts, said, _ = _add(tmp_path, machine, _auth(tmp_path, ca, nodes=[{"id": "node-a"}]), name="node-a-gw")
    assert facts.name == "node-a-gw" and said == "gateway 'node-a-gw' (--name), x86_64, systemd"


# -- identity ------------------------------------------------------------------------------


def test_the_key_is_made_there_and_the_certificate_signed_here_recorded_before_it_is_installed(
    tmp_path: Path, ca: CA
) -> None:
    machine = _Machine(tmp_path / "m")
    auth = _auth(tmp_path, ca)
    facts, said, issued = _add(tmp_path, machine, auth)
    assert said == "gateway 'gw-a' (its hostname), x86_64, systemd"
    cert = _held(machine)
    info = cert_info(cert)
    assert (info.common_name, info.role) == ("gw-a", ROLE_GATEWAY)
    assert cert.public_key() == _machine_key(machine).public_key()  # the machine's key; it never left
    assert issued.startswith(f"issued CN=gw-a (gateway role) for a new key, serial {info.serial:x}, until ")
    assert facts.cert_serial == f"{info.serial:x}"
    # Recorded under its name, revoking nothing else, and installed as the gateway user's.
    assert auth.admin.recorded == [(info.serial, "gw-a", False, ())]
    assert machine.path(str(PKI.ca_cert)).read_bytes() == ca.cert_pem()
    assert machine.owners == {str(PKI.cert): layout.USER, str(PKI.ca_cert): layout.USER}


def test_adding_again_keeps_a_fitting_certificate_and_reissue_replaces_and_revokes_it(tmp_path: Path, ca: CA) -> None:
    machine = _Machine(tmp_path / "m")
    auth = _auth(tmp_path, ca)
    _add(tmp_path, machine, auth)
    first = _held(machine)
    key = machine.path(str(PKI.key)).read_bytes()

    facts, _, kept = _add(tmp_path, machine, auth)
    assert kept.startswith(f"kept its certificate (serial {first.serial_number:x}, until ")
    assert _held(machine).serial_number == first.serial_number and len(auth.admin.recorded) == 1

    facts, _, reissued = _add(tmp_path, machine, auth, reissue=True)
    second = _held(machine)
    assert machine.path(str(PKI.key)).read_bytes() != key  # a new key
    assert reissued.endswith(f"; revoked the one it replaces (serial {first.serial_number:x})")
    assert "for a new key" in reissued
    assert auth.admin.is_revoked(first.serial_number) and not auth.admin.is_revoked(second.serial_number)


def test_a_revoked_or_node_certificate_is_not_kept(tmp_path: Path, ca: CA) -> None:
    machine = _Machine(tmp_path / "m")
    auth = _auth(tmp_path, ca)
    _add(tmp_path, machine, auth)
    first = _held(machine)
    with _store(tmp_path / "plane") as store:
        store.remove_node("gw-a")  # `llmgw gateway remove gw-a`: its certificates revoked
    _, _, renewed = _add(tmp_path, machine, auth)
    assert renewed.startswith("issued CN=gw-a (gateway role) for its key")  # the same key, a new certificate
    assert _held(machine).public_key() == _machine_key(machine).public_key()
    assert _held(machine).serial_number != first.serial_number

    # A node's certificate for this very key and name is not a gateway's: a new one is issued.
    node_cert = ca.sign_csr(machine.path(str(PKI.csr)).read_bytes(), "gw-a", validity_days=30)
    machine.path(str(PKI.cert)).write_bytes(node_cert)
    _, _, issued = _add(tmp_path, machine, auth)
    assert issued.startswith("issued CN=gw-a (gateway role) for its key")
    assert cert_info(_held(machine)).role == ROLE_GATEWAY


def test_another_machine_of_the_same_name_keeps_its_certificate_and_is_said(tmp_path: Path, ca: CA) -> None:
    _, csr = make_key_and_csr("gw-a")
    theirs = cert_info(x509.load_pem_x509_certificate(ca.sign_gateway_csr(csr, "gw-a", validity_days=30)))
    auth = _auth(
        tmp_path,
        ca,
        gateways=[
            {"name": "gw-a", "instance": "gw-a-0-1", "address": "10.0.0.40", "cert_serial": f"{theirs.serial:x}"}
        ],
    )
    auth.admin.record_certificate(theirs.serial, "gw-a", theirs.not_after.timestamp())
    machine = _Machine(tmp_path / "m")
    o = _opts(tmp_path)
    facts = install.Facts(stage=STAGE)
    status, said = trio.run(install.identify, o, machine, facts, auth)
    assert status == WARN and "connected already from 10.0.0.40 with another certificate" in said
    trio.run(install.identity, o, machine, facts, auth)
    assert not auth.admin.is_revoked(theirs.serial)
