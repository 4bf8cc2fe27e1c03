"""The TLS of the agent port's links: the `ssl.SSLContext` of each end (the control plane's, an
agent's, a gateway's), and the alert after a refusal.

Owns how each end is configured (TLS 1.2 or newer, a certificate required of both ends) and
`send_tls_alert`, the one piece of trio I/O: telling the other end why its handshake failed.
The files the contexts load are laid out by `llmgw.pki.files`; putting that reason into words
is `llmgw.pki.tlsdiag`'s business.

Invariants:
- The agent link trusts the cluster CA and nothing else: a certificate from a public CA must
  not make anyone a node or the control plane (the system store is never loaded).
- An agent checks that the control plane's certificate covers the address it dialled.
- A key is looked at before OpenSSL reads it, and refused when others may read it, as
  `llmgw.private` refuses any private file.
"""

from __future__ import annotations

import ssl
from pathlib import Path

import trio

from llmgw import private
from llmgw.errors import MachineError
from llmgw.pki.ca import ROLE_GATEWAY, cert_info
from llmgw.pki.files import ca_paths, fs_errors, gateway_paths, load_cert

ALERT_TIMEOUT_S = 5.0  # a peer that does not read its alert must not hold a task


def server_ssl_context(state_dir: Path, *, certificate_optional: bool = False) -> ssl.SSLContext:
    """The agent port's side: present server.crt, require a node certificate from our CA.

    `certificate_optional`: a peer may also come without any certificate (one it presents must
    still be our CA's and valid); the endpoint then serves it the release files and nothing else."""
    paths = ca_paths(state_dir)
    _require(paths.ca_cert, f"create the certificate authority with `llmgw ca init --state-dir {state_dir}`")
    fix = f"issue it with `llmgw ca server-cert --state-dir {state_dir} --san ADDRESS`"
    _require(paths.server_cert, fix)
    _require(paths.server_key, fix)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.verify_mode = ssl.CERT_OPTIONAL if certificate_optional else ssl.CERT_REQUIRED
    _load(ctx, paths.ca_cert, paths.server_cert, paths.server_key, fix)
    return ctx


NODE_FIX = "add this node from the control plane with `llmgw node add USER@HOST`, which installs its certificate (by hand: `llmgw ca issue`, docs/operations.md)"


def client_ssl_context(ca_cert: Path, cert: Path, key: Path, *, fix: str = NODE_FIX) -> ssl.SSLContext:
    """The agent's side (and a gateway's): present the client certificate; believe only the
    cluster CA, and check that the control plane's certificate covers the address dialled.
    `fix`: what to do when a file is missing or wrong."""
    for path in (ca_cert, cert, key):
        _require(Path(path), fix)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # no load_default_certs(): the system store is not trusted here
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.check_hostname = True
    _load(ctx, Path(ca_cert), Path(cert), Path(key), fix)
    return ctx


def gateway_ssl_context(pki_dir: Path) -> ssl.SSLContext:
    """A gateway's side of the gateway link, from its pki directory (`llmgw.pki.files.gateway_paths`:
    gateway.key, gateway.crt, ca.crt): its certificate must be of the gateway role, which the
    control plane requires there (a node's is refused before any frame), so that is said here."""
    paths = gateway_paths(pki_dir)
    fix = (
        "issue this gateway's certificate on the control plane with `llmgw ca issue --gateway NAME --out DIR` "
        f"and copy gateway.key, gateway.crt and ca.crt from DIR into {paths.dir}"
    )
    _require(paths.cert, fix)
    info = cert_info(load_cert(paths.cert))
    if info.role != ROLE_GATEWAY:
        raise MachineError(
            f"{paths.cert} (CN={info.common_name}) is not a gateway certificate (its role: {info.role}), and the "
            f"control plane takes only a gateway's on the gateway link; {fix}"
        )
    return client_ssl_context(paths.ca_cert, paths.cert, paths.key, fix=fix)


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


def _require(path: Path, fix: str) -> None:
    with fs_errors("read", path):
        exists = path.exists()
    if not exists:
        raise MachineError(f"{path} does not exist; {fix}")


def _load(ctx: ssl.SSLContext, ca_cert: Path, cert: Path, key: Path, fix: str) -> None:
    with fs_errors("read", key):  # OpenSSL reads the key by name: look at it first, as files' key reads do
        private.require([(key, "a private key", False)])
    with fs_errors("read", ca_cert):
        try:
            ctx.load_verify_locations(cafile=str(ca_cert))
        except ssl.SSLError as exc:
            raise MachineError(f"{ca_cert} is not a PEM CA certificate ({exc.reason or exc}); {fix}") from None
    with fs_errors("read", key):
        try:
            ctx.load_cert_chain(certfile=str(cert), keyfile=str(key))
        except ssl.SSLError as exc:
            raise MachineError(
                f"cannot use {cert} with {key} ({exc.reason or exc}): not a certificate and its key; {fix}"
            ) from None
