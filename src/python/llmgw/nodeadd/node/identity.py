"""Whether the machine being added is the node the cluster already knows by that name.

A node id starts as the machine's hostname, which any machine can take. Once the cluster knows
a node, what makes a machine that node is its certificate: issued by this CA for that node id
and not revoked, for a key made on the machine that never left it. `identify` refuses a machine
that takes a known node's hostname without holding such a certificate, unless the operator says
it replaces that node (`--reissue`, or `llmgw node remove` first); either way the replaced
machine's certificates are revoked when the new one is issued (`install.record`).

Pure: it reads the certificate it is given and asks `is_revoked`; no I/O of its own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from cryptography import x509
from cryptography.exceptions import InvalidSignature

from llmgw.pki.ca import cert_info


def why_not_the_holder(
    pem: bytes | None, *, ca_cert: x509.Certificate, node_id: str, is_revoked: Callable[[int], bool]
) -> str:
    """Empty if `pem` is a certificate this CA issued for `node_id` and has not revoked (its expiry
    does not matter: the key is checked when a new one is issued); else what it is, in words."""
    if pem is None:
        return "has no llmgw certificate"
    try:
        cert = x509.load_pem_x509_certificate(pem)
    except ValueError:
        return "has a node.crt that is not a certificate"
    try:
        cert.verify_directly_issued_by(ca_cert)
    except (ValueError, TypeError, InvalidSignature):
        return "holds a certificate from another CA"
    info = cert_info(cert)
    if info.common_name != node_id:
        return f"holds the certificate of node {info.common_name!r}"
    if is_revoked(info.serial):
        return f"holds a revoked certificate of {node_id!r} (serial {info.serial:x})"
    return ""


def refusal(node_id: str, known: dict[str, Any], target: str, why: str) -> str:
    """The `identify` failure for a machine that takes a known node's name without its certificate."""
    where = known.get("address") or "an address not recorded"
    if known.get("connected"):
        state = f"connected now from {where}"
    else:
        state = f"not connected now (state {known.get('state', '?')}, last from {where})"
    return (
        f"the cluster has a node {node_id!r} ({state}), and {target} {why}, so it is another machine with the same "
        f"hostname, or that machine reinstalled. If it replaces {node_id!r}: `llmgw node remove {node_id}` (which "
        f"revokes the old machine's certificates and closes its link) and run again, or run again with --reissue "
        f"(which revokes them when it issues this machine's). Otherwise give it its own name "
        f"(`sudo hostnamectl set-hostname NAME` there)"
    )
