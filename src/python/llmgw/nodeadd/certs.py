"""The certificate rules of the flows that issue one (node add, gateway add): when a certificate
the machine holds may stay, and how a new one is recorded before it is installed.

The key is made on the machine and never leaves it; only its request is signed here. A held
certificate is kept while it fits (`fitting_cert`: ours, for this name and key, valid more than
KEEP_FOR_S, of the role asked) and the control plane has not revoked it; whether it is revoked
only the control plane knows (the flows ask its admin API). A new certificate's serial is
recorded through the admin API (`record`) before the certificate is installed, so `llmgw node
remove NAME` can revoke every certificate a name holds. Pure but `record`, one blocking request.
"""

from __future__ import annotations

import time
from datetime import datetime, timezone
from typing import Any

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization

from llmgw.ctl.client import AdminClient
from llmgw.pki.ca import CA, CertInfo, cert_info

KEEP_FOR_S = 7 * 86400  # a certificate with less left than this is renewed


def cert_or_none(pem: bytes | None) -> x509.Certificate | None:
    try:
        return x509.load_pem_x509_certificate(pem) if pem else None
    except ValueError:
        return None


def fitting_cert(pem: bytes | None, csr_pem: bytes, ca: CA, name: str, *, role: str | None = None) -> CertInfo | None:
    """The machine's certificate, if it can stay as far as it alone tells: ours, for `name` and
    the request's key, valid a while, and of `role` when one is asked."""
    cert = cert_or_none(pem)
    if cert is None:
        return None
    info = cert_info(cert)
    csr = x509.load_pem_x509_csr(csr_pem)
    try:
        cert.verify_directly_issued_by(ca.cert)
    except (ValueError, TypeError, InvalidSignature):
        return None
    same_key = _public_der(cert.public_key()) == _public_der(csr.public_key())
    fresh = info.not_after.timestamp() - time.time() > KEEP_FOR_S
    if not (same_key and fresh and info.common_name == name and info.valid_at(datetime.now(timezone.utc))):
        return None
    if role is not None and info.role != role:
        return None
    return info


def _public_der(key: Any) -> bytes:
    return key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


def record(
    admin: AdminClient, name: str, info: CertInfo, old: x509.Certificate | None, ca: CA, *, revoke_others: bool
) -> list[str]:
    """Have the control plane remember the new serial under `name`, and revoke the certificate
    it replaces on this machine (`old`, if ours); `revoke_others`: every other certificate of
    `name` too (a node id is one machine's; a gateway's name may be several machines').
    Returns the serials revoked, in hex. Blocking: one request."""
    also = [old.serial_number] if old is not None and old.issuer == ca.cert.subject else []
    revoked = admin.record_certificate(
        info.serial, name, info.not_after.timestamp(), revoke_others=revoke_others, also_revoke=also
    )
    return [f"{n:x}" for n in sorted(revoked)]
