"""Who a gateway is: its certificate of the gateway role, its key and the cluster CA in one
directory (`llmgw gateway --pki-dir DIR`; the files are `llmgw.pki.files.gateway_paths`', as
`llmgw ca issue --gateway NAME --out DIR` writes them), read by the link's `Credentials.load`.

The gateway's name is its certificate's CN; `--name`, if given, must be the same, since the
control plane refuses a link whose claimed name is not the certificate's.
"""

from __future__ import annotations

from pathlib import Path

from llmgw.errors import UsageError
from llmgw.gatewayd.link import Credentials

DEFAULT_PKI_DIR = Path("/var/lib/llmgw-gateway/pki")


def credentials(pki_dir: Path, claimed: str | None) -> Credentials:
    """The gateway's credentials from `pki_dir`: a `MachineError` naming the file and the fix if
    one is missing or not a gateway's, a `UsageError` if `claimed` is not its name."""
    creds = Credentials.load(pki_dir)
    if claimed and claimed != creds.name:
        raise UsageError(
            f"--name {claimed!r} is not the name in the certificate of {pki_dir} ({creds.name!r}); the control plane "
            "would refuse the link: leave --name out, or issue a certificate for that name "
            f"(`llmgw ca issue --gateway {claimed}`)"
        )
    return creds
