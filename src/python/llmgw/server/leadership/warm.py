"""What a control plane reads at start besides its store (`Warm`), which a standby holds ready so
that taking over reads the store alone (`llmgw.server.leadership.seat`).

Read in the order a start says its problems in: the state directory's permissions first (private
files open to others are refused before use), the certificate authority (a missing CA is the
first thing said), the agents' TLS context, the admin credential, and this llmgw's own release
file (`running_release`: what agents may fetch from the mirror).
"""

from __future__ import annotations

import ssl
from pathlib import Path

import attrs

from llmgw import paths
from llmgw.config import ServerConfig
from llmgw.pki.ca import CA
from llmgw.pki.files import load_ca
from llmgw.pki.tls import server_ssl_context
from llmgw.releasefiles import Running, running_release


@attrs.frozen(kw_only=True)
class Warm:
    ca: CA
    ssl_context: ssl.SSLContext
    admin_token: str = attrs.field(repr=False)
    running: Running | None


def read_warm(config: ServerConfig, state_dir: Path) -> Warm:
    """`Warm`, read from the state directory in the module docstring's order."""
    paths.check_state_dir(state_dir)
    ca = load_ca(state_dir)
    ssl_context = server_ssl_context(state_dir, certificate_optional=config.release.serve)
    admin_token = paths.read_admin_token(paths.ensure_admin_token(state_dir))
    return Warm(ca=ca, ssl_context=ssl_context, admin_token=admin_token, running=running_release())
