"""What a node id rests on once the cluster knows the node: the certificate its machine holds.
A second machine that takes a known node's hostname is refused unless the operator says it
replaces it, and a certificate issued for a node id revokes every other one of that node id."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
from cryptography import x509

from llmgw.errors import UsageError
from llmgw.nodeadd import ssh
from llmgw.nodeadd.context import Authority
from llmgw.nodeadd.node import identify, identity, install
from llmgw.nodeadd.node.install import Facts, Options
from llmgw.pki.ca import CA, cert_info, make_key_and_csr
from llmgw.pki.files import init_ca, load_ca
from llmgw.server.store import Store


def _ca(directory: Path) -> CA:
    init_ca(directory, validity_days=30)
    return load_ca(directory)


def _cert(ca: CA, node_id: str) -> bytes:
    _, csr = make_key_and_csr(node_id)
    return ca.sign_csr(csr, node_id, validity_days=30)


def _serial(pem: bytes) -> int:
    return x509.load_pem_x509_certificate(pem).serial_number


def test_only_this_cas_unrevoked_certificate_for_the_node_id_makes_a_machine_that_node(tmp_path: Path) -> None:
    ca = _ca(tmp_path / "ca")
    other = _ca(tmp_path / "other")
    mine = _cert(ca, "node-a")

    def why(pem: bytes | None, revoked: frozenset[int] = frozenset()) -> str:
        return identity.why_not_the_holder(pem, ca_cert=ca.cert, node_id="node-a", is_revoked=revoked.__contains__)

    assert why(mine) == ""
    assert why(None) == "has no llmgw certificate"
    assert why(b"not a certificate") == "has a node.crt that is not a certificate"
    assert why(_cert(other, "node-a")) == "holds a certificate from another CA"
    assert why(_cert(ca, "node-b")) == "holds the certificate of node 'node-b'"
    assert why(mine, frozenset({_serial(mine)})).startswith("holds a revoked certificate of 'node-a' (serial ")


def test_the_refusal_says_how_to_replace_the_node_or_rename_the_machine() -> None:
    connected = {"id": "node-a", "connected": True, "state": "joined", "address": "10.0.0.21"}
    text = identity.refusal("node-a", connected, "root@10.0.0.99", "has no llmgw certificate")
    assert text.startswith(
        "the cluster has a node 'node-a' (connected now from 10.0.0.21), and root@10.0.0.99 has no llmgw "
        "certificate, so it is another machine with the same hostname"
    )
    assert "`llmgw node remove node-a`" in text and "--reissue" in text and "hostnamectl set-hostname" in text
    gone = {"id": "node-a", "connected": False, "state": "lost", "address": "10.0.0.21"}
    assert "(not connected now (state lost, last from 10.0.0.21))" in identity.refusal(
        "node-a", gone, "root@10.0.0.99", "has no llmgw certificate"
    )


class _StoreAdmin:
    """The admin API's certificate routes, answered from the store as the control plane answers them."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir

    def record_certificate(self, serial, node_id, not_after, *, revoke_others=False, also_revoke=()):
        store = Store.open(self.state_dir)
        try:
            revoked = store.record_issued(
                serial, node_id, not_after, revoke_others=revoke_others, also_revoke=also_revoke
            )
        finally:
            store.close()
        return [int(n) for n in revoked]

    def is_revoked(self, serial: int) -> bool:
        store = Store.open(self.state_dir)
        try:
            return store.is_revoked(serial)
        finally:
            store.close()


def test_a_certificate_issued_for_a_node_id_revokes_the_replaced_machines(tmp_path: Path) -> None:
    ca = _ca(tmp_path)
    first = _cert(ca, "node-a")  # the machine that was node-a
    store = Store.open(tmp_path)
    admin = _StoreAdmin(tmp_path)
    try:
        info = cert_info(x509.load_pem_x509_certificate(first))
        store.record_issued(info.serial, "node-a", info.not_after.timestamp())
        elsewhere = _cert(ca, "node-b")
        store.record_issued(_serial(elsewhere), "node-b", info.not_after.timestamp())

        # The machine replacing it holds no certificate (old=None): the first machine's is revoked all the same.
        second = _cert(ca, "node-a")
        revoked = install.record(admin, "node-a", cert_info(x509.load_pem_x509_certificate(second)), None, ca)
        assert revoked == [f"{_serial(first):x}"]
        assert store.is_revoked(_serial(first))
        assert not store.is_revoked(_serial(second))
        assert not store.is_revoked(_serial(elsewhere))  # another node id is left alone

        # The same machine renewing: the certificate it held goes too, and is named once.
        third = _cert(ca, "node-a")
        old = x509.load_pem_x509_certificate(second)
        revoked = install.record(admin, "node-a", cert_info(x509.load_pem_x509_certificate(third)), old, ca)
        assert revoked == [f"{_serial(second):x}"]

        # A certificate of this CA the machine held, never recorded here, is revoked too.
        unrecorded = x509.load_pem_x509_certificate(_cert(ca, "node-a"))
        fourth = cert_info(x509.load_pem_x509_certificate(_cert(ca, "node-a")))
        assert install.record(admin, "node-a", fourth, unrecorded, ca) == sorted(
            [f"{_serial(third):x}", f"{unrecorded.serial_number:x}"], key=lambda h: int(h, 16)
        )
    finally:
        store.close()


# -- identify, against a scripted node -----------------------------------------------------

PROBE = "hostname=node-a\narch=x86_64\nsystemd=yes\nos_id=debian\ntool=/usr/sbin/update-ca-certificates\n"


class _Node:
    """Answers the probe, has no agent.toml, and holds `cert` (None: no certificate)."""

    def __init__(self, cert: bytes | None) -> None:
        self.target = ssh.Target(user="root", host="10.0.0.99")
        self.user = "root"
        self.cert = cert

    async def run(self, argv, *, sudo=False, timeout_s):
        if argv[:2] == ["sh", "-c"]:
            return ssh.Result(exit_status=0, stdout=PROBE, stderr="")
        if argv == ["cat", "--", "/var/lib/llmgw-agent/pki/node.crt"] and self.cert is not None:
            return ssh.Result(exit_status=0, stdout=self.cert.decode(), stderr="")
        return ssh.Result(exit_status=1, stdout="", stderr="No such file or directory")


def _identify(tmp_path: Path, ca: CA, cert: bytes | None, known: list[dict], *, reissue: bool = False) -> str:
    opts = Options(
        target="root@10.0.0.99",
        server_config=None,  # type: ignore[arg-type]  # not read by identify
        state_dir=tmp_path,
        known_hosts=tmp_path / "known_hosts",
        reissue=reissue,
    )
    auth = Authority(ca=ca, server_cert=None, admin=_StoreAdmin(tmp_path), nodes=known)  # type: ignore[arg-type]
    return trio.run(identify.identify, opts, _Node(cert), Facts(), auth)


def test_identify_refuses_a_machine_taking_a_known_nodes_name_connected_or_not(tmp_path: Path) -> None:
    ca = _ca(tmp_path)
    for connected, state in ((True, "joined"), (False, "lost")):
        known = [{"id": "node-a", "connected": connected, "state": state, "address": "10.0.0.21"}]
        with pytest.raises(UsageError, match="another machine with the same hostname"):
            _identify(tmp_path, ca, None, known)
        with pytest.raises(UsageError, match="holds the certificate of node 'node-b'"):
            _identify(tmp_path, ca, _cert(ca, "node-b"), known)
        # The operator says it replaces node-a: it goes on, and says what --reissue will do.
        said = _identify(tmp_path, ca, None, known, reissue=True)
        assert "--reissue makes it 'node-a' and revokes the certificates of the machine it replaces" in said
        # The machine that is node-a: adding it again.
        said = _identify(tmp_path, ca, _cert(ca, "node-a"), known)
        assert said.endswith(f"; known to the cluster already ({state}): adding it again"), said
    # A node id the cluster does not know yet: nothing to hold.
    assert "known to the cluster" not in _identify(tmp_path, ca, None, [])


def test_identify_asks_the_control_plane_whether_the_held_certificate_is_revoked(tmp_path: Path) -> None:
    ca = _ca(tmp_path)
    held = _cert(ca, "node-a")
    known = [{"id": "node-a", "connected": False, "state": "lost", "address": "10.0.0.21"}]
    assert _identify(tmp_path, ca, held, known).endswith("adding it again")
    store = Store.open(tmp_path)
    try:
        store.remove_node("node-a", also_revoke=_serial(held))  # `llmgw node remove node-a`
    finally:
        store.close()
    with pytest.raises(UsageError, match=f"holds a revoked certificate of 'node-a' \\(serial {_serial(held):x}\\)"):
        _identify(tmp_path, ca, held, known)
