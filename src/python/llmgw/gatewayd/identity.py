"""Who a gateway is: its certificate of the gateway role, its key and the cluster CA, in one
directory (`llmgw gateway --pki-dir DIR`), and the TLS context its link dials with.

The files are named here once (`gateway_files`): `gateway.key` (never leaves the machine, 0600),
`gateway.crt` (issued by `llmgw ca issue --gateway NAME`) and `ca.crt` (the CA it believes).
The gateway's name is its certificate's CN unless `--name` says it, and then they must agree:
the control plane refuses a link whose claimed name is not the certificate's.
"""

from __future__ import annotations

import ssl
from pathlib import Path

import attrs

from llmgw.errors import MachineError, UsageError
from llmgw.pki.ca import cert_info
from llmgw.pki.files import load_cert
from llmgw.pki.tls import client_ssl_context

DEFAULT_PKI_DIR = Path("/var/lib/llmgw-gateway/pki")
ISSUE_HINT = (
    "issue them on the control plane with `llmgw ca issue --gateway NAME --out DIR` and copy DIR's gateway.key, "
    'gateway.crt and ca.crt here (docs/gateway.md, "Running gateways of their own")'
)


@attrs.frozen(kw_only=True)
class GatewayFiles:
    dir: Path
    key: Path
    cert: Path
    ca_cert: Path


def gateway_files(pki_dir: Path) -> GatewayFiles:
    d = Path(pki_dir)
    return GatewayFiles(dir=d, key=d / "gateway.key", cert=d / "gateway.crt", ca_cert=d / "ca.crt")


def require(files: GatewayFiles) -> None:
    """Each file is there, or a `MachineError` naming the missing ones and how to get them."""
    missing = [p.name for p in (files.key, files.cert, files.ca_cert) if not p.exists()]
    if missing:
        raise MachineError(f"no {', '.join(missing)} in {files.dir} (--pki-dir); {ISSUE_HINT}")


def tls_context(files: GatewayFiles) -> ssl.SSLContext:
    """The link's client side: present the gateway certificate, believe only the cluster CA."""
    require(files)
    return client_ssl_context(files.ca_cert, files.cert, files.key)


def gateway_name(files: GatewayFiles, claimed: str | None) -> str:
    """The name the gateway gives on the link: its certificate's CN, which `claimed` must match."""
    require(files)
    cn = cert_info(load_cert(files.cert)).common_name
    if claimed and claimed != cn:
        raise UsageError(
            f"--name {claimed!r} is not the name in {files.cert} ({cn!r}); the control plane would refuse the "
            "link: leave --name out, or issue a certificate for that name"
        )
    return cn
