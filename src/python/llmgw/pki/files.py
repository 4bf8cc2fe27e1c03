"""Where the cluster's keys and certificates live, and reading and writing them.

Owns the layout of `<server state_dir>/ca/` (the CA and the certificate the agent port
presents), of `<agent state_dir>/pki/` (a node's key, request and certificate) and of a
gateway's pki directory (gateway.key, gateway.crt, ca.crt), and every read and write of those files; what goes into them is made by `llmgw.pki.ca`. File system
errors become `MachineError`s that name the path and what to do (`fs_errors`).

Invariants:
- A private key is never on disk with group or other access, not even for an instant: it is
  created 0600 from the start, fsynced and renamed into place (`llmgw.private`), so a reader
  sees the old file or the whole new one. A key, or the 0700 directory that holds it, found
  open to others or owned by another user is refused with the fixing command, not silently fixed.
- The CA is never replaced (every node certificate hangs off it), and a node's key is never
  replaced by these functions: its identity changes only when someone deletes node.key.
- The CA key stays on the control plane. A node makes its own key; only its request leaves.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

import attrs

from llmgw import private
from llmgw.errors import MachineError, UsageError
from llmgw.pki.ca import (
    CA,
    DEFAULT_CA_NAME,
    CertInfo,
    WrongKey,
    cert_info,
    check_gateway_name,
    check_issued_by,
    check_key_of,
    check_node_id,
    make_csr,
    make_key_and_csr,
    new_ca,
    new_key_pem,
    parse_cert,
    parse_key,
)

if TYPE_CHECKING:
    from cryptography import x509

# What each private directory holds, as a refusal names it.
STATE_DIR_WHAT = "the control plane's state directory"
CA_DIR_WHAT = "the certificate authority's directory"
NODE_DIR_WHAT = "the node's key directory"


# -- where the files are -------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class CAPaths:
    """The control plane's files: the CA and the server certificate of the agent port."""

    dir: Path
    ca_key: Path
    ca_cert: Path
    server_key: Path
    server_cert: Path


@attrs.frozen(kw_only=True)
class NodePaths:
    """A node's files. `key` never leaves the node; `ca_cert` is the cluster CA it trusts."""

    dir: Path
    key: Path
    csr: Path
    cert: Path
    ca_cert: Path


@attrs.frozen(kw_only=True)
class GatewayPaths:
    """A gateway's files (`llmgw ca issue --gateway NAME --out DIR` writes them, or `llmgw gateway
    add` on its machine): its key, its certificate of the gateway role, and the cluster CA it
    trusts; `csr`, the request for its key that `llmgw gateway csr` writes."""

    dir: Path
    key: Path
    cert: Path
    ca_cert: Path
    csr: Path


def gateway_paths(pki_dir: Path) -> GatewayPaths:
    d = Path(pki_dir)
    return GatewayPaths(
        dir=d, key=d / "gateway.key", cert=d / "gateway.crt", ca_cert=d / "ca.crt", csr=d / "gateway.csr"
    )


def ca_paths(state_dir: Path) -> CAPaths:
    d = Path(state_dir) / "ca"
    return CAPaths(
        dir=d, ca_key=d / "ca.key", ca_cert=d / "ca.crt", server_key=d / "server.key", server_cert=d / "server.crt"
    )


def node_paths(state_dir: Path) -> NodePaths:
    return _node_files(Path(state_dir) / "pki")


def _node_files(d: Path) -> NodePaths:
    return NodePaths(dir=d, key=d / "node.key", csr=d / "node.csr", cert=d / "node.crt", ca_cert=d / "ca.crt")


# -- the control plane's files -------------------------------------------------------------


def init_ca(
    state_dir: Path, *, validity_days: int, common_name: str = DEFAULT_CA_NAME, now: datetime | None = None
) -> CertInfo:
    """Create the cluster CA. Never replaces one: every node certificate hangs off it."""
    paths = ca_paths(state_dir)
    for p in (paths.ca_key, paths.ca_cert):
        with fs_errors("check", p):
            exists = p.exists()
        if exists:
            raise UsageError(
                f"a certificate authority already exists: {p}; `llmgw ca init` will not replace it, because "
                "removing it would orphan every node certificate it issued (each node would need `llmgw node add USER@HOST --reissue` "
                "again). Use `llmgw ca show` to see it"
            )
    ca = new_ca(validity_days=validity_days, common_name=common_name, now=now)
    _make_private_dir(Path(state_dir), STATE_DIR_WHAT)
    _make_private_dir(paths.dir, CA_DIR_WHAT)
    _write_file(paths.ca_key, ca.key_pem(), mode=0o600, exclusive=True)
    _write_file(paths.ca_cert, ca.cert_pem(), mode=0o644, exclusive=True)
    return ca.info()


def load_ca(state_dir: Path) -> CA:
    paths = ca_paths(state_dir)
    with fs_errors("read", paths.ca_key):
        key_exists, cert_exists = paths.ca_key.exists(), paths.ca_cert.exists()
    if not key_exists and not cert_exists:
        raise MachineError(
            f"no certificate authority in {state_dir}; create one with `llmgw ca init --state-dir {state_dir}`"
        )
    if not key_exists:
        raise MachineError(
            f"the CA key {paths.ca_key} is missing (its certificate {paths.ca_cert} is there); restore it from "
            "a backup: a new CA would orphan every node certificate"
        )
    key_pem = _read_private(paths.ca_key, "the CA key")
    cert = load_cert(paths.ca_cert)
    try:
        return CA.from_pem(key_pem, cert)
    except WrongKey:
        raise MachineError(
            f"{paths.ca_key} is not the key of {paths.ca_cert}; restore both from the same backup"
        ) from None
    except (ValueError, TypeError) as exc:
        raise MachineError(
            f"{paths.ca_key} is not an unencrypted PEM private key ({exc}); restore it from a backup"
        ) from None


def issue_server_cert(
    ca: CA, state_dir: Path, sans: Sequence[str], *, validity_days: int, now: datetime | None = None
) -> CertInfo:
    """A new key and certificate for the agent port, covering exactly `sans`, written over
    the old ones (the endpoint presents them from its next start)."""
    key_pem, cert_pem = ca.server_cert(sans, validity_days=validity_days, now=now)
    paths = ca_paths(state_dir)
    _make_private_dir(Path(state_dir), STATE_DIR_WHAT)
    _make_private_dir(paths.dir, CA_DIR_WHAT)
    _write_file(paths.server_key, key_pem, mode=0o600)
    _write_file(paths.server_cert, cert_pem, mode=0o644)
    return cert_info(parse_cert(cert_pem))


def issue_to_dir(ca: CA, node_id: str, out_dir: Path, *, validity_days: int, now: datetime | None = None) -> NodePaths:
    """The manual path, for an operator adding a node by hand: a key, its certificate and the CA
    certificate in `out_dir` (flat), to be copied into the node's pki directory."""
    key_pem, csr_pem = make_key_and_csr(node_id)
    cert_pem = ca.sign_csr(csr_pem, node_id, validity_days=validity_days, now=now)
    paths = _node_files(Path(out_dir))
    if paths.dir.exists() and not paths.dir.is_dir():
        raise UsageError(f"{paths.dir} is a file; node.key, node.crt and ca.crt go into a directory: name one")
    with fs_errors("create", paths.dir):
        private.make_dir(paths.dir, check_existing=False)  # the operator's choice: a new one is 0700
    try:
        _write_file(paths.key, key_pem, mode=0o600, exclusive=True)
    except FileExistsError:
        raise UsageError(
            f"{paths.key} already exists; it may be a node's identity, so `llmgw ca issue` will not replace it: "
            "choose an empty directory with --out"
        ) from None
    _write_file(paths.csr, csr_pem, mode=0o644)
    _write_file(paths.cert, cert_pem, mode=0o644)
    _write_file(paths.ca_cert, ca.cert_pem(), mode=0o644)
    return paths


def issue_gateway_to_dir(
    ca: CA, name: str, out_dir: Path, *, validity_days: int, now: datetime | None = None
) -> GatewayPaths:
    """A gateway's key, its certificate (of the gateway role) and the CA certificate in
    `out_dir`, its pki directory or a directory to copy from. An existing key is never replaced."""
    key_pem, cert_pem = ca.gateway_cert(name, validity_days=validity_days, now=now)
    paths = gateway_paths(out_dir)
    if paths.dir.exists() and not paths.dir.is_dir():
        raise UsageError(f"{paths.dir} is a file; gateway.key, gateway.crt and ca.crt go into a directory: name one")
    with fs_errors("create", paths.dir):
        private.make_dir(paths.dir, check_existing=False)  # the operator's choice: a new one is 0700
    try:
        _write_file(paths.key, key_pem, mode=0o600, exclusive=True)
    except FileExistsError:
        raise UsageError(
            f"{paths.key} already exists; it may be a gateway's identity, so `llmgw ca issue` will not replace it: "
            "choose an empty directory with --out"
        ) from None
    _write_file(paths.cert, cert_pem, mode=0o644)
    _write_file(paths.ca_cert, ca.cert_pem(), mode=0o644)
    return paths


def write_gateway_key_and_csr(pki_dir: Path, name: str) -> GatewayPaths:
    """Make (or keep) a gateway's key in its pki directory and write a request for it, as a node's
    (`write_node_key_and_csr`): the key never leaves the machine, and an existing one is kept."""
    check_gateway_name(name)
    paths = gateway_paths(pki_dir)
    _make_private_dir(paths.dir, "a gateway's pki directory")
    _key_and_csr(paths.key, paths.csr, name, "the gateway key")
    return paths


def _key_and_csr(key: Path, csr: Path, name: str, what: str) -> None:
    """Make the private key at `key` unless there is one (kept: it is the identity), then write a
    request for `name` with it at `csr`."""
    if not key.exists():
        with contextlib.suppress(FileExistsError):  # another run made it first: keep that one
            _write_file(key, new_key_pem(), mode=0o600, exclusive=True)
    key_pem = _read_private(key, what)
    try:
        request = make_csr(key_pem, name)
    except (ValueError, TypeError) as exc:
        raise MachineError(f"{key} is not a PEM private key ({exc}); delete it to make a new one") from None
    _write_file(csr, request, mode=0o644)


# -- a node's files ------------------------------------------------------------------------


def write_node_key_and_csr(state_dir: Path, node_id: str) -> NodePaths:
    """Make (or keep) the node's key and write a request for it. An existing key is kept:
    the node's identity changes only when someone deletes node.key on purpose."""
    check_node_id(node_id)
    paths = node_paths(state_dir)
    _make_private_dir(paths.dir, NODE_DIR_WHAT)
    _key_and_csr(paths.key, paths.csr, node_id, "the node key")
    return paths


def install_node_cert(state_dir: Path, cert_pem: bytes, ca_cert_pem: bytes) -> NodePaths:
    """Store the certificate the control plane issued, after checking it is for this node's key."""
    paths = node_paths(state_dir)
    try:
        cert = parse_cert(cert_pem)
        issuer = parse_cert(ca_cert_pem)
    except ValueError as exc:
        raise UsageError(f"the node certificate or the CA certificate given with it is not PEM ({exc})") from None
    if not paths.key.exists():
        raise MachineError(
            f"{paths.key} does not exist; make the node's key and request before installing a certificate"
        )
    try:
        key = parse_key(_read_private(paths.key, "the node key"))
    except (ValueError, TypeError) as exc:
        raise MachineError(f"{paths.key} is not a PEM private key ({exc}); delete it and make a new request") from None
    try:
        check_key_of(cert, key)
    except WrongKey:
        raise UsageError(
            f"the certificate for {cert_info(cert).common_name!r} is not for the key in {paths.key}; "
            f"issue it from this node's request {paths.csr}"
        ) from None
    try:
        check_issued_by(cert, issuer)
    except (ValueError, TypeError) as exc:
        raise UsageError(f"the node certificate was not issued by the CA certificate given with it ({exc})") from None
    _write_file(paths.cert, cert_pem, mode=0o644)
    _write_file(paths.ca_cert, ca_cert_pem, mode=0o644)
    return paths


# -- certificates --------------------------------------------------------------------------


def load_cert(path: Path) -> x509.Certificate:
    data = _read(Path(path), "this file is written by `llmgw ca init` or `llmgw ca issue`")
    try:
        return parse_cert(data)
    except ValueError as exc:
        raise MachineError(f"{path} is not a PEM certificate ({exc}); restore it or issue it again") from None


def write_cert(path: Path, cert_pem: bytes) -> None:
    """Write a certificate (public, 0644) whole or not at all."""
    _write_file(Path(path), cert_pem, mode=0o644)


# -- file system ---------------------------------------------------------------------------


@contextlib.contextmanager
def fs_errors(action: str, path: Path) -> Iterator[None]:
    """File system errors, as the operator has to act on them: a `MachineError` saying which
    `action` on which path failed (with sudo suggested for a permission). FileExistsError
    passes through: keeping the file or refusing is the caller's decision."""
    try:
        yield
    except FileExistsError:
        raise
    except OSError as exc:
        at = path if action == "write" else exc.filename or path  # a write's filename is the temporary file
        if isinstance(exc, PermissionError):
            raise MachineError(
                f"cannot {action} {at}: permission denied; run as the user that owns it (e.g. with sudo)"
            ) from None
        raise MachineError(f"cannot {action} {at}: {exc.strerror or exc}") from None


def _read(path: Path, fix: str) -> bytes:
    with fs_errors("read", path):
        try:
            return path.read_bytes()
        except FileNotFoundError:
            raise MachineError(f"{path} does not exist; {fix}") from None


def _read_private(path: Path, what: str) -> bytes:
    """A key file, refused when group or others may read it, or another user owns it: the key
    must be assumed leaked (`llmgw.private`)."""
    with fs_errors("read", path):
        return private.read(path, what)


def _make_private_dir(d: Path, what: str) -> None:
    with fs_errors("create", d):
        private.make_dir(d, what)


def _write_file(path: Path, data: bytes, *, mode: int, exclusive: bool = False) -> None:
    """Write `path` whole or not at all, durably, never readable by others while it is written
    (`llmgw.private.write`). `exclusive` refuses to replace an existing file (FileExistsError)."""
    with fs_errors("write", path):
        private.write(path, data, mode=mode, exclusive=exclusive)
