"""The cluster's certificate authority and the certificates it issues, as pure crypto.

Owns making keys, certificates and signing requests, signing a node's request, and reading what
a certificate says (`CertInfo`). Bytes and objects in, bytes and objects out: no file, no
socket, no clock read unless `now` is left out, so all of it is testable without a disk. Where
the results are stored is `llmgw.pki.files`' business.

Invariants:
- A node certificate names the node id the control plane chose, whatever the request asked
  for, because that CN is the node's identity on the agent link.
- A certificate's role is its Subject's OU, which only the CA writes: ROLE_GATEWAY on a gateway
  certificate (`CA.gateway_cert`); none on a node certificate, so one issued before roles
  existed is a node's as it always was (`CertInfo.role`). A node certificate cannot act as a
  gateway, nor a gateway certificate as a node: the agent port checks the role of each route
  (`llmgw.wire.session`, `llmgw.wire.gateway_session`).
- Every certificate starts `CLOCK_SKEW` before it is made and carries a random 159-bit serial,
  so two never share one.
- A failure the operator must fix raises `UsageError` naming the bad value and the fix. A key or
  certificate that does not parse raises `ValueError` (or `TypeError`), and a key that is not a
  certificate's raises `WrongKey`, for the caller, who knows which file it came from, to word.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Sequence
from datetime import datetime, timedelta, timezone

import attrs
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.hazmat.primitives.asymmetric.types import PrivateKeyTypes
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from llmgw.errors import UsageError, shown

# Certificates start this long before they are issued, so a node whose clock is a little behind
# the control plane's still accepts a certificate made a moment ago.
CLOCK_SKEW = timedelta(hours=1)
DEFAULT_CA_NAME = "llmgw cluster CA"

_NODE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")
_DNS_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_DNS_NAME = re.compile(rf"{_DNS_LABEL}(?:\.{_DNS_LABEL})*")
_MAX_CN = 64  # RFC 5280 ub-common-name

# The roles a client certificate of the cluster CA gives (`CertInfo.role`): a node's, on the
# agent link and the artifact mirror, or a gateway's, on the gateway link. A node certificate
# carries no OU (those issued before roles existed neither); a gateway's carries ROLE_GATEWAY.
ROLE_NODE = "llmgw-node"
ROLE_GATEWAY = "llmgw-gateway"
# The gateway name of the control plane's own workers (`llmgw.server.gateways.workers`), whose certificate
# it issues itself: `llmgw ca issue --gateway` refuses it for a gateway of its own.
CONTROL_PLANE_GATEWAY = "control-plane"


class WrongKey(Exception):
    """A private key that is not the one a certificate is for (or not of a kind the CA uses)."""


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
    role: str = ROLE_NODE  # the Subject's OU; ROLE_NODE where there is none

    def valid_at(self, when: datetime) -> bool:
        return self.not_before <= when <= self.not_after


def cert_info(cert: x509.Certificate) -> CertInfo:
    cns = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    ous = cert.subject.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME)
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
        # Several OUs is not something this CA writes: "," joins them, which is no role.
        role=",".join(str(ou.value) for ou in ous) if ous else ROLE_NODE,
    )


def cert_info_from_der(der: bytes) -> CertInfo:
    """For a TLS peer's certificate, as `getpeercert(binary_form=True)` returns it."""
    return cert_info(x509.load_der_x509_certificate(der))


def parse_cert(pem: bytes) -> x509.Certificate:
    """A PEM certificate; `ValueError` if `pem` is not one."""
    return x509.load_pem_x509_certificate(pem)


def parse_key(pem: bytes) -> PrivateKeyTypes:
    """An unencrypted PEM private key; `ValueError` or `TypeError` if `pem` is not one."""
    return serialization.load_pem_private_key(pem, password=None)


def check_key_of(cert: x509.Certificate, key: PrivateKeyTypes) -> None:
    """`WrongKey` unless `key` is the private half of the key `cert` certifies."""
    if not _same_key(cert.public_key(), key.public_key()):
        raise WrongKey(f"the key is not the one the certificate for {cert.subject.rfc4514_string()!r} names")


def check_issued_by(cert: x509.Certificate, issuer: x509.Certificate) -> None:
    """`ValueError` (or `TypeError`, for a key that cannot sign) unless `issuer` signed `cert`."""
    try:
        cert.verify_directly_issued_by(issuer)
    except InvalidSignature as exc:
        raise ValueError(str(exc)) from None


# -- names ---------------------------------------------------------------------------------


def check_node_id(node_id: str) -> str:
    if not _NODE_ID.fullmatch(node_id):
        raise UsageError(
            f"node id {shown(node_id)} may use only letters, digits, '.', '_' and '-', must start with a letter "
            "or digit and be at most 63 characters; use the machine's hostname (e.g. 'llmgw-node04')"
        )
    return node_id


def check_gateway_name(name: str) -> str:
    if not _NODE_ID.fullmatch(name):
        raise UsageError(
            f"gateway name {shown(name)} may use only letters, digits, '.', '_' and '-', must start with a letter "
            "or digit and be at most 63 characters; use the machine's hostname (e.g. 'gw1')"
        )
    return name


def check_own_gateway_name(name: str) -> str:
    """A name for a gateway of its own (`llmgw ca issue --gateway`, `llmgw gateway add`): a gateway
    name, and not the control plane's own workers' (CONTROL_PLANE_GATEWAY), whose certificate the
    control plane issues itself."""
    check_gateway_name(name)
    if name == CONTROL_PLANE_GATEWAY:
        raise UsageError(
            f"gateway name {name!r} is the control plane's own gateway workers', whose certificate it issues "
            "itself; name this gateway otherwise (its machine's hostname, e.g. 'gw1')"
        )
    return name


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

    @classmethod
    def from_pem(cls, key_pem: bytes, cert: x509.Certificate) -> CA:
        """The CA whose certificate is `cert`: `ValueError`/`TypeError` if `key_pem` is not an
        unencrypted PEM key, `WrongKey` if it is not an ECDSA key or not `cert`'s."""
        key = serialization.load_pem_private_key(key_pem, password=None)
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise WrongKey(f"a CA key is ECDSA, not {type(key).__name__}")
        check_key_of(cert, key)
        return cls(key=key, cert=cert)

    def info(self) -> CertInfo:
        return cert_info(self.cert)

    def cert_pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)

    def key_pem(self) -> bytes:
        return _key_pem(self.key)

    def server_cert(
        self, sans: Sequence[str], *, validity_days: int, now: datetime | None = None
    ) -> tuple[bytes, bytes]:
        """A new key and a certificate for the agent port covering exactly `sans` (both PEM)."""
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
        return _key_pem(key), cert.public_bytes(serialization.Encoding.PEM)

    def sign_csr(self, csr_pem: bytes, node_id: str, *, validity_days: int, now: datetime | None = None) -> bytes:
        """A node certificate (PEM) for the key in `csr_pem`, whose CN is `node_id` whatever the request says."""
        check_node_id(node_id)
        public_key = _requested_key(csr_pem, f"{node_id!r}", "the node", "`llmgw agent csr`")
        cert = (
            self._leaf(_cn(node_id), public_key, now=now, validity_days=validity_days)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            .sign(self.key, hashes.SHA256())
        )
        return cert.public_bytes(serialization.Encoding.PEM)

    def sign_gateway_csr(self, csr_pem: bytes, name: str, *, validity_days: int, now: datetime | None = None) -> bytes:
        """A gateway certificate (PEM) for the key in `csr_pem` (made on the gateway's machine by
        `llmgw gateway csr`): CN=`name` and OU=ROLE_GATEWAY whatever the request says, as
        `gateway_cert` makes them."""
        check_gateway_name(name)
        public_key = _requested_key(csr_pem, f"gateway {name!r}", "the gateway's machine", "`llmgw gateway csr`")
        return self._gateway_leaf(name, public_key, now=now, validity_days=validity_days)

    def gateway_cert(self, name: str, *, validity_days: int, now: datetime | None = None) -> tuple[bytes, bytes]:
        """A new key and a gateway certificate for it (both PEM): CN=`name`, OU=ROLE_GATEWAY, a
        client certificate for the gateway link and for nothing a node does."""
        check_gateway_name(name)
        key = ec.generate_private_key(ec.SECP256R1())
        return _key_pem(key), self._gateway_leaf(name, key.public_key(), now=now, validity_days=validity_days)

    def _gateway_leaf(self, name: str, public_key, *, now: datetime | None, validity_days: int) -> bytes:
        subject = x509.Name(
            [
                x509.NameAttribute(NameOID.COMMON_NAME, name),
                x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, ROLE_GATEWAY),
            ]
        )
        cert = (
            self._leaf(subject, public_key, now=now, validity_days=validity_days)
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


def new_ca(*, validity_days: int, common_name: str = DEFAULT_CA_NAME, now: datetime | None = None) -> CA:
    """A new cluster CA: a P-256 key and a self-signed certificate that may sign leaves only."""
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
    return CA(key=key, cert=cert)


# -- the node side -------------------------------------------------------------------------


def new_key_pem() -> bytes:
    """A new node key (P-256, PKCS#8 PEM, unencrypted)."""
    return _key_pem(ec.generate_private_key(ec.SECP256R1()))


def make_key_and_csr(node_id: str) -> tuple[bytes, bytes]:
    """A new node key and a request for it (both PEM), CN=node_id."""
    check_node_id(node_id)
    key_pem = new_key_pem()
    return key_pem, make_csr(key_pem, node_id)


def make_csr(key_pem: bytes, node_id: str) -> bytes:
    """A request for an existing key, so a node can ask again without changing its identity."""
    check_node_id(node_id)
    key = serialization.load_pem_private_key(key_pem, password=None)
    if not isinstance(key, (ec.EllipticCurvePrivateKey, rsa.RSAPrivateKey)):
        raise UsageError(f"a node key must be ECDSA or RSA, not {type(key).__name__}")
    csr = x509.CertificateSigningRequestBuilder().subject_name(_cn(node_id)).sign(key, hashes.SHA256())
    return csr.public_bytes(serialization.Encoding.PEM)


# -- builders ------------------------------------------------------------------------------


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


def _requested_key(csr_pem: bytes, whose: str, where: str, how: str):
    """The public key of a certificate signing request, checked: PEM, signed by that key (so not
    altered on the way), and of a kind llmgw signs; a `UsageError` saying which and the fix."""
    try:
        csr = x509.load_pem_x509_csr(csr_pem)
    except ValueError as exc:
        raise UsageError(f"not a PEM certificate signing request ({exc}); pass the request {how} wrote") from None
    if not csr.is_signature_valid:
        raise UsageError(
            f"the certificate signing request for {whose} has a bad signature: it was altered after "
            f"{where} made it; make a new one there"
        )
    public_key = csr.public_key()
    ok = (
        isinstance(public_key, ec.EllipticCurvePublicKey) and public_key.curve.name in ("secp256r1", "secp384r1")
    ) or (isinstance(public_key, rsa.RSAPublicKey) and public_key.key_size >= 2048)
    if not ok:
        raise UsageError(
            f"the request for {whose} holds a {type(public_key).__name__} key; llmgw signs ECDSA P-256/P-384 "
            f"or RSA of 2048 bits or more: make the request on {where} with {how}"
        )
    return public_key


def _same_key(a, b) -> bool:
    spki = (serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return a.public_bytes(*spki) == b.public_bytes(*spki)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
