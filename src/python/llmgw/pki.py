"""The cluster's certificate authority, the certificates it issues, and the TLS of the agent link.

Owns the files under `<server state_dir>/ca/` (the CA and the certificate the agent endpoint
presents) and under `<agent state_dir>/pki/` (a node's key, request and certificate); signing a
node's request; the `ssl.SSLContext` of each end of the agent link. Why a handshake was refused
is `llmgw.tlsdiag`'s business; `describe_tls_failure` is re-exported here.

Invariants:
- A private key is never on disk with group or other access, not even for an instant: it is
  created 0600 from the start, fsynced and renamed into place (`llmgw.private`), so a reader
  sees the old file or the whole new one. A key, or the 0700 directory that holds it, found
  open to others or owned by another user is refused with the fixing command, not silently fixed.
- The CA key stays on the control plane. A node makes its own key and sends a request; the
  certificate it gets back names the node id the control plane chose, whatever the request
  asked for, because that CN is the node's identity on the agent link.
- The agent link trusts the cluster CA and nothing else: a certificate from a public CA must
  not make anyone a node or the control plane.
"""

from __future__ import annotations

import contextlib
import ipaddress
import re
import ssl
from collections.abc import Iterator, Sequence
from datetime import datetime, timedelta, timezone
from pathlib import Path

import attrs
import trio
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from llmgw import private
from llmgw.errors import MachineError, UsageError
from llmgw.tlsdiag import Side as Side
from llmgw.tlsdiag import describe_tls_failure as describe_tls_failure

# Certificates start this long before they are issued, so a node whose clock is a little behind
# the control plane's still accepts a certificate made a moment ago.
CLOCK_SKEW = timedelta(hours=1)
DEFAULT_CA_NAME = "llmgw cluster CA"
ALERT_TIMEOUT_S = 5.0  # a peer that does not read its alert must not hold a task

_NODE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")
_DNS_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_DNS_NAME = re.compile(rf"{_DNS_LABEL}(?:\.{_DNS_LABEL})*")
_MAX_CN = 64  # RFC 5280 ub-common-name

# What each private directory holds, as a refusal names it.
STATE_DIR_WHAT = "the control plane's state directory"
CA_DIR_WHAT = "the certificate authority's directory"
NODE_DIR_WHAT = "the node's key directory"


# -- where the files are -------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class CAPaths:
    """The control plane's files: the CA and the server certificate of the agent endpoint."""

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


def ca_paths(state_dir: Path) -> CAPaths:
    d = Path(state_dir) / "ca"
    return CAPaths(
        dir=d, ca_key=d / "ca.key", ca_cert=d / "ca.crt", server_key=d / "server.key", server_cert=d / "server.crt"
    )


def node_paths(state_dir: Path) -> NodePaths:
    return _node_files(Path(state_dir) / "pki")


def _node_files(d: Path) -> NodePaths:
    return NodePaths(dir=d, key=d / "node.key", csr=d / "node.csr", cert=d / "node.crt", ca_cert=d / "ca.crt")


# -- what a certificate says ---------------------------------------------------------------


@attrs.frozen(kw_only=True)
class CertInfo:
    """What an operator needs to know about a certificate. Times are aware UTC datetimes."""

    subject: str
    issuer: str
    common_name: str
    serial: int
    fingerprint_sha256: str  # AB:CD:..., as `openssl x509 -fingerprint -sha256` prints it
    not_before: datetime
    not_after: datetime
    sans: tuple[str, ...] = ()
    is_ca: bool = False

    def valid_at(self, when: datetime) -> bool:
        return self.not_before <= when <= self.not_after


def cert_info(cert: x509.Certificate) -> CertInfo:
    cns = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        sans = tuple(str(n.value) for n in san if isinstance(n, (x509.DNSName, x509.IPAddress)))
    except x509.ExtensionNotFound:
        sans = ()
    try:
        is_ca = cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    except x509.ExtensionNotFound:
        is_ca = False
    return CertInfo(
        subject=cert.subject.rfc4514_string(),
        issuer=cert.issuer.rfc4514_string(),
        common_name=str(cns[0].value) if cns else "",
        serial=cert.serial_number,
        fingerprint_sha256=cert.fingerprint(hashes.SHA256()).hex(":").upper(),
        not_before=cert.not_valid_before_utc,
        not_after=cert.not_valid_after_utc,
        sans=sans,
        is_ca=is_ca,
    )


def cert_info_from_der(der: bytes) -> CertInfo:
    """For a TLS peer's certificate, as `getpeercert(binary_form=True)` returns it."""
    return cert_info(x509.load_der_x509_certificate(der))


def load_cert(path: Path) -> x509.Certificate:
    data = _read(Path(path), "this file is written by `llmgw ca init` or `llmgw ca issue`")
    try:
        return x509.load_pem_x509_certificate(data)
    except ValueError as exc:
        raise MachineError(f"{path} is not a PEM certificate ({exc}); restore it or issue it again") from None


# -- names ---------------------------------------------------------------------------------


def check_node_id(node_id: str) -> str:
    if not _NODE_ID.fullmatch(node_id):
        raise UsageError(
            f"node id {node_id!r} may use only letters, digits, '.', '_' and '-', must start with a letter "
            "or digit and be at most 63 characters; use the machine's hostname (e.g. 'llmgw-node04')"
        )
    return node_id


def parse_san(address: str) -> x509.GeneralName:
    """An address agents dial: an IP address becomes an IP SAN, anything else must be a DNS name."""
    try:
        return x509.IPAddress(ipaddress.ip_address(address))
    except ValueError:
        pass
    if len(address) <= 253 and _DNS_NAME.fullmatch(address):
        return x509.DNSName(address)
    host, _, port = address.rpartition(":")
    hint = f"give it without the port ({host.strip('[]')!r})" if host and port.isdigit() else "e.g. 10.0.0.1, fd00::1"
    raise UsageError(
        f"server address {address!r} is neither an IP address nor a DNS name; {hint}, or a name like llmgw.example.internal"
    )


def parse_sans(addresses: Sequence[str]) -> list[x509.GeneralName]:
    if isinstance(addresses, str):  # a lone string would be taken as a list of its characters
        addresses = [addresses]
    names: list[x509.GeneralName] = []
    for a in addresses:
        name = parse_san(a)
        if name not in names:
            names.append(name)
    if not names:
        raise UsageError("a server certificate needs at least one address agents dial; pass --san ADDRESS")
    return names


# -- the authority -------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class CA:
    """The cluster CA, loaded. Only the control plane ever holds one."""

    key: ec.EllipticCurvePrivateKey = attrs.field(repr=False)
    cert: x509.Certificate

    def info(self) -> CertInfo:
        return cert_info(self.cert)

    def cert_pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)

    def issue_server_cert(
        self, state_dir: Path, sans: Sequence[str], *, validity_days: int, now: datetime | None = None
    ) -> CertInfo:
        """A new key and certificate for the agent endpoint, covering exactly `sans`."""
        names = parse_sans(sans)
        first = str(names[0].value)
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, first)] if len(first) <= _MAX_CN else [])
        cert = (
            self._leaf(subject, key.public_key(), now=now, validity_days=validity_days)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            # RFC 5280 4.2.1.6: with an empty subject the SAN carries the identity and is critical.
            .add_extension(x509.SubjectAlternativeName(names), critical=len(subject) == 0)
            .sign(self.key, hashes.SHA256())
        )
        paths = ca_paths(state_dir)
        _make_private_dir(Path(state_dir), STATE_DIR_WHAT)
        _make_private_dir(paths.dir, CA_DIR_WHAT)
        _write_file(paths.server_key, _key_pem(key), mode=0o600)
        _write_file(paths.server_cert, cert.public_bytes(serialization.Encoding.PEM), mode=0o644)
        return cert_info(cert)

    def sign_csr(self, csr_pem: bytes, node_id: str, *, validity_days: int, now: datetime | None = None) -> bytes:
        """A node certificate (PEM) for the key in `csr_pem`, whose CN is `node_id` whatever the request says."""
        check_node_id(node_id)
        try:
            csr = x509.load_pem_x509_csr(csr_pem)
        except ValueError as exc:
            raise UsageError(f"not a PEM certificate signing request ({exc}); pass the node's node.csr") from None
        if not csr.is_signature_valid:
            raise UsageError(
                f"the certificate signing request for {node_id!r} has a bad signature: it was altered after the "
                "node made it; make a new one on the node"
            )
        public_key = csr.public_key()
        ok = (
            isinstance(public_key, ec.EllipticCurvePublicKey) and public_key.curve.name in ("secp256r1", "secp384r1")
        ) or (isinstance(public_key, rsa.RSAPublicKey) and public_key.key_size >= 2048)
        if not ok:
            raise UsageError(
                f"the request for {node_id!r} holds a {type(public_key).__name__} key; llmgw signs ECDSA P-256/P-384 "
                "or RSA of 2048 bits or more: make the request on the node with `llmgw agent csr`"
            )
        cert = (
            self._leaf(_cn(node_id), public_key, now=now, validity_days=validity_days)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            .sign(self.key, hashes.SHA256())
        )
        return cert.public_bytes(serialization.Encoding.PEM)

    def _leaf(
        self, subject: x509.Name, public_key, *, now: datetime | None, validity_days: int
    ) -> x509.CertificateBuilder:
        return (
            _builder(subject, self.cert.subject, public_key, now=now, validity_days=validity_days)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(_key_usage(digital_signature=True), critical=True)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()), critical=False)
        )


def init_ca(
    state_dir: Path, *, validity_days: int, common_name: str = DEFAULT_CA_NAME, now: datetime | None = None
) -> CertInfo:
    """Create the cluster CA. Never replaces one: every node certificate hangs off it."""
    paths = ca_paths(state_dir)
    for p in (paths.ca_key, paths.ca_cert):
        with _fs("check", p):
            exists = p.exists()
        if exists:
            raise UsageError(
                f"a certificate authority already exists: {p}; `llmgw ca init` will not replace it, because "
                "removing it would orphan every node certificate it issued (each node would need `llmgw node add USER@HOST --reissue` "
                "again). Use `llmgw ca show` to see it"
            )
    if not 0 < len(common_name) <= _MAX_CN:
        raise UsageError(f"the CA's name {common_name!r} must be 1 to {_MAX_CN} characters")
    key = ec.generate_private_key(ec.SECP256R1())
    name = _cn(common_name)
    cert = (
        _builder(name, name, key.public_key(), now=now, validity_days=validity_days)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(cert_sign=True), critical=True)
        .sign(key, hashes.SHA256())
    )
    _make_private_dir(Path(state_dir), STATE_DIR_WHAT)
    _make_private_dir(paths.dir, CA_DIR_WHAT)
    _write_file(paths.ca_key, _key_pem(key), mode=0o600, exclusive=True)
    _write_file(paths.ca_cert, cert.public_bytes(serialization.Encoding.PEM), mode=0o644, exclusive=True)
    return cert_info(cert)


def load_ca(state_dir: Path) -> CA:
    paths = ca_paths(state_dir)
    with _fs("read", paths.ca_key):
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
        key = serialization.load_pem_private_key(key_pem, password=None)
    except (ValueError, TypeError) as exc:
        raise MachineError(
            f"{paths.ca_key} is not an unencrypted PEM private key ({exc}); restore it from a backup"
        ) from None
    if not isinstance(key, ec.EllipticCurvePrivateKey) or not _same_key(key.public_key(), cert.public_key()):
        raise MachineError(f"{paths.ca_key} is not the key of {paths.ca_cert}; restore both from the same backup")
    return CA(key=key, cert=cert)


# -- the node side -------------------------------------------------------------------------


def make_key_and_csr(node_id: str) -> tuple[bytes, bytes]:
    """A new node key and a request for it (both PEM), CN=node_id."""
    check_node_id(node_id)
    key_pem = _key_pem(ec.generate_private_key(ec.SECP256R1()))
    return key_pem, make_csr(key_pem, node_id)


def make_csr(key_pem: bytes, node_id: str) -> bytes:
    """A request for an existing key, so a node can ask again without changing its identity."""
    check_node_id(node_id)
    key = serialization.load_pem_private_key(key_pem, password=None)
    if not isinstance(key, (ec.EllipticCurvePrivateKey, rsa.RSAPrivateKey)):
        raise UsageError(f"a node key must be ECDSA or RSA, not {type(key).__name__}")
    csr = x509.CertificateSigningRequestBuilder().subject_name(_cn(node_id)).sign(key, hashes.SHA256())
    return csr.public_bytes(serialization.Encoding.PEM)


def write_node_key_and_csr(state_dir: Path, node_id: str) -> NodePaths:
    """Make (or keep) the node's key and write a request for it. An existing key is kept:
    the node's identity changes only when someone deletes node.key on purpose."""
    check_node_id(node_id)
    paths = node_paths(state_dir)
    _make_private_dir(paths.dir, NODE_DIR_WHAT)
    if not paths.key.exists():
        with contextlib.suppress(FileExistsError):  # another run made it first: keep that one
            _write_file(paths.key, _key_pem(ec.generate_private_key(ec.SECP256R1())), mode=0o600, exclusive=True)
    key_pem = _read_private(paths.key, "the node key")
    try:
        csr = make_csr(key_pem, node_id)
    except (ValueError, TypeError) as exc:
        raise MachineError(f"{paths.key} is not a PEM private key ({exc}); delete it to make a new one") from None
    _write_file(paths.csr, csr, mode=0o644)
    return paths


def install_node_cert(state_dir: Path, cert_pem: bytes, ca_cert_pem: bytes) -> NodePaths:
    """Store the certificate the control plane issued, after checking it is for this node's key."""
    paths = node_paths(state_dir)
    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
        ca = x509.load_pem_x509_certificate(ca_cert_pem)
    except ValueError as exc:
        raise UsageError(f"the node certificate or the CA certificate given with it is not PEM ({exc})") from None
    if not paths.key.exists():
        raise MachineError(
            f"{paths.key} does not exist; make the node's key and request before installing a certificate"
        )
    try:
        key = serialization.load_pem_private_key(_read_private(paths.key, "the node key"), password=None)
    except (ValueError, TypeError) as exc:
        raise MachineError(f"{paths.key} is not a PEM private key ({exc}); delete it and make a new request") from None
    if not _same_key(cert.public_key(), key.public_key()):
        raise UsageError(
            f"the certificate for {cert_info(cert).common_name!r} is not for the key in {paths.key}; "
            f"issue it from this node's request {paths.csr}"
        )
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature) as exc:
        raise UsageError(f"the node certificate was not issued by the CA certificate given with it ({exc})") from None
    _write_file(paths.cert, cert_pem, mode=0o644)
    _write_file(paths.ca_cert, ca_cert_pem, mode=0o644)
    return paths


def issue_to_dir(ca: CA, node_id: str, out_dir: Path, *, validity_days: int, now: datetime | None = None) -> NodePaths:
    """The manual path, for an operator adding a node by hand: a key, its certificate and the CA
    certificate in `out_dir` (flat), to be copied into the node's pki directory."""
    key_pem, csr_pem = make_key_and_csr(node_id)
    cert_pem = ca.sign_csr(csr_pem, node_id, validity_days=validity_days, now=now)
    paths = _node_files(Path(out_dir))
    if paths.dir.exists() and not paths.dir.is_dir():
        raise UsageError(f"{paths.dir} is a file; node.key, node.crt and ca.crt go into a directory: name one")
    with _fs("create", paths.dir):
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


def write_cert(path: Path, cert_pem: bytes) -> None:
    """Write a certificate (public, 0644) whole or not at all."""
    _write_file(Path(path), cert_pem, mode=0o644)


# -- TLS of the agent link -----------------------------------------------------------------


def server_ssl_context(state_dir: Path) -> ssl.SSLContext:
    """The agent endpoint's side: present server.crt, require a node certificate from our CA."""
    paths = ca_paths(state_dir)
    _require(paths.ca_cert, f"create the certificate authority with `llmgw ca init --state-dir {state_dir}`")
    fix = f"issue it with `llmgw ca server-cert --state-dir {state_dir} --san ADDRESS`"
    _require(paths.server_cert, fix)
    _require(paths.server_key, fix)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.verify_mode = ssl.CERT_REQUIRED
    _load(ctx, paths.ca_cert, paths.server_cert, paths.server_key, fix)
    return ctx


def client_ssl_context(ca_cert: Path, cert: Path, key: Path) -> ssl.SSLContext:
    """The agent's side: present the node certificate; believe only the cluster CA, and check
    that the control plane's certificate covers the address dialled."""
    fix = "add this node from the control plane with `llmgw node add USER@HOST`, which installs its certificate (by hand: `llmgw ca issue`, docs/operations.md)"
    for path in (ca_cert, cert, key):
        _require(Path(path), fix)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # no load_default_certs(): the system store is not trusted here
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.check_hostname = True
    _load(ctx, Path(ca_cert), Path(cert), Path(key), fix)
    return ctx


def _require(path: Path, fix: str) -> None:
    with _fs("read", path):
        exists = path.exists()
    if not exists:
        raise MachineError(f"{path} does not exist; {fix}")


def _load(ctx: ssl.SSLContext, ca_cert: Path, cert: Path, key: Path, fix: str) -> None:
    with _fs("read", key):  # OpenSSL reads the key by name: look at it first, as `_read_private` would
        private.require([(key, "a private key", False)])
    with _fs("read", ca_cert):
        try:
            ctx.load_verify_locations(cafile=str(ca_cert))
        except ssl.SSLError as exc:
            raise MachineError(f"{ca_cert} is not a PEM CA certificate ({exc.reason or exc}); {fix}") from None
    with _fs("read", key):
        try:
            ctx.load_cert_chain(certfile=str(cert), keyfile=str(key))
        except ssl.SSLError as exc:
            raise MachineError(
                f"cannot use {cert} with {key} ({exc.reason or exc}): not a certificate and its key; {fix}"
            ) from None


# describe_tls_failure (llmgw.tlsdiag, re-exported above) says why a handshake failed.


async def send_tls_alert(stream: trio.SSLStream) -> None:
    """After a failed handshake, send the alert OpenSSL wrote for the other end, then close.

    trio (0.35, python-trio/trio#3413) raises BrokenResourceError and drops that alert, so the
    other end sees a bare EOF and cannot say why it was refused; a node whose certificate
    expired would only log "connection closed". Both ends call this where they catch the
    failure. It reads trio's private outgoing buffer; if that ever disappears this sends nothing.
    """
    outgoing = getattr(stream, "_outgoing", None)
    try:
        if isinstance(outgoing, ssl.MemoryBIO) and outgoing.pending:
            with trio.move_on_after(ALERT_TIMEOUT_S):
                await stream.transport_stream.send_all(outgoing.read())
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass  # the other end is gone already: nobody to tell
    finally:
        await trio.aclose_forcefully(stream)


# -- files ---------------------------------------------------------------------------------


def _builder(
    subject: x509.Name, issuer: x509.Name, public_key, *, now: datetime | None, validity_days: int
) -> x509.CertificateBuilder:
    if validity_days < 1:
        raise UsageError(f"validity must be at least 1 day, got {validity_days}; pass --validity-days N")
    if now is None:
        now = datetime.now(timezone.utc)
    elif now.tzinfo is None:
        raise ValueError("now must be an aware datetime")  # a bug in the caller, not an operator's mistake
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - CLOCK_SKEW)
        .not_valid_after(now + timedelta(days=validity_days))
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
    )


def _cn(name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])


def _key_usage(*, cert_sign: bool = False, digital_signature: bool = False) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=digital_signature,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=cert_sign,
        crl_sign=cert_sign,
        encipher_only=False,
        decipher_only=False,
    )


def _same_key(a, b) -> bool:
    spki = (serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return a.public_bytes(*spki) == b.public_bytes(*spki)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


@contextlib.contextmanager
def _fs(action: str, path: Path) -> Iterator[None]:
    """File system errors, as the operator has to act on them."""
    try:
        yield
    except FileExistsError:
        raise  # the caller's decision: keep the file or refuse
    except OSError as exc:
        at = path if action == "write" else exc.filename or path  # a write's filename is the temporary file
        if isinstance(exc, PermissionError):
            raise MachineError(
                f"cannot {action} {at}: permission denied; run as the user that owns it (e.g. with sudo)"
            ) from None
        raise MachineError(f"cannot {action} {at}: {exc.strerror or exc}") from None


def _read(path: Path, fix: str) -> bytes:
    with _fs("read", path):
        try:
            return path.read_bytes()
        except FileNotFoundError:
            raise MachineError(f"{path} does not exist; {fix}") from None


def _read_private(path: Path, what: str) -> bytes:
    """A key file, refused when group or others may read it, or another user owns it: the key
    must be assumed leaked (`llmgw.private`)."""
    with _fs("read", path):
        return private.read(path, what)


def _make_private_dir(d: Path, what: str) -> None:
    with _fs("create", d):
        private.make_dir(d, what)


def _write_file(path: Path, data: bytes, *, mode: int, exclusive: bool = False) -> None:
    """Write `path` whole or not at all, durably, never readable by others while it is written
    (`llmgw.private.write`). `exclusive` refuses to replace an existing file (FileExistsError)."""
    with _fs("write", path):
        private.write(path, data, mode=mode, exclusive=exclusive)
