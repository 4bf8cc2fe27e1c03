"""The `identify` and `address` steps of `llmgw node add`: what the node is, and where its agent
will dial the control plane.

`identify` reads the node (hostname, architecture, init system, trust store, an agent.toml from
an earlier add) and, when the cluster knows a node by that hostname, asks whether this machine
holds that node's certificate (identity.py decides; the control plane says whether the serial
is revoked). Nothing is written on the node here. `address` is a decision on this machine only:
the address must be one the server certificate covers and `agent_listen` can be reached at.
"""

from __future__ import annotations

import ipaddress
import socket
from pathlib import Path

import trio
from cryptography import x509

from llmgw import config as cfg
from llmgw.errors import ConfigError, MachineError, PeerError, UsageError
from llmgw.nodeadd import identity, layout, ssh
from llmgw.nodeadd.context import SHORT_S, Authority, Facts, Options, said, view_of
from llmgw.nodeadd.release import release_arch
from llmgw.pki.ca import CertInfo, check_node_id
from llmgw.pki.files import node_paths

# -- identify ------------------------------------------------------------------------------


async def identify(opts: Options, s: ssh.Session, facts: Facts, auth: Authority) -> str:
    await probe(opts, s, facts)
    kb = view_of(auth.nodes, facts.node_id)
    again = ""
    if kb is not None:
        marks = "".join(f", {m}" for m in ("cordoned", "draining") if kb.get(m))
        again = f"; known to the cluster already ({kb['state']}{marks}): adding it again"
        why = await _why_not_the_holder(s, facts.node_id, auth)
        if why and not opts.reissue:
            raise UsageError(identity.refusal(facts.node_id, kb, str(s.target), why))
        if why:
            again = (
                f"; known to the cluster already ({kb['state']}{marks}), and this machine {why}: --reissue makes it "
                f"{facts.node_id!r} and revokes the certificates of the machine it replaces"
            )
    service = "systemd" if facts.systemd else "no systemd"
    store = f", {facts.trust_store.family} trust store" if facts.trust_store else ""
    return f"node id {facts.node_id!r} (its hostname), {facts.machine}, {service}{store}{again}"


async def probe(opts: Options, s: ssh.Session, facts: Facts) -> None:
    res = await s.run(["sh", "-c", layout.PROBE], timeout_s=SHORT_S)
    if res.exit_status != 0:
        raise PeerError(f"{s.target}: probing the node failed ({said(res)})")
    found = layout.parse_probe(res.stdout)
    hostname = found.hostname
    try:
        facts.node_id = check_node_id(hostname)
    except UsageError:
        raise PeerError(
            f"{s.target}: its hostname {hostname!r} cannot be a node id (letters, digits, '-' and '.'); "
            "give the machine a proper hostname (`sudo hostnamectl set-hostname NAME`) and run again"
        ) from None
    facts.machine = found.arch
    facts.arch = release_arch(facts.machine)
    facts.systemd = found.systemd
    if opts.system_trust:
        facts.trust_store = layout.trust_store(found, str(s.target))
    await check_sudo(s)
    current = await s.run(["cat", "--", layout.CONFIG], sudo=True, timeout_s=SHORT_S)
    if current.exit_status == 0:
        try:
            facts.existing = cfg.agent_config_from_dict(cfg.parse_toml(current.stdout, layout.CONFIG), layout.CONFIG)
        except ConfigError as exc:
            raise PeerError(
                f"{s.target}: its {layout.CONFIG} (from an earlier add, or written by hand) does not load: {exc}. "
                f"Fix it, or remove it to have it written afresh"
            ) from None


async def check_sudo(s: ssh.Session) -> None:
    """The login is root, or may use sudo without a password (a prompt would hang the run)."""
    if s.user == "root":
        return
    res = await s.run(["sudo", "-n", "true"], timeout_s=SHORT_S)
    if res.exit_status != 0:
        raise PeerError(
            f"{s.target}: {s.user} cannot use sudo without a password there ({said(res)}); "
            f"log in as root, or allow it: `echo '{s.user} ALL=(ALL) NOPASSWD: ALL' | "
            f"sudo tee /etc/sudoers.d/llmgw-{s.user}` on the machine"
        )


async def _why_not_the_holder(s: ssh.Session, node_id: str, auth: Authority) -> str:
    """Empty if the machine holds the known node's certificate, else what it holds (identity.why_not_the_holder)."""
    node = node_paths(Path(layout.STATE_DIR))
    res = await s.run(["cat", "--", str(node.cert)], sudo=True, timeout_s=SHORT_S)
    pem = res.stdout.encode() if res.exit_status == 0 else None
    revoked = False
    try:
        held = x509.load_pem_x509_certificate(pem).serial_number if pem is not None else None
    except ValueError:
        held = None  # not a certificate: why_not_the_holder says so
    if held is not None:
        revoked = await trio.to_thread.run_sync(auth.admin.is_revoked, held)
    return identity.why_not_the_holder(
        pem, ca_cert=auth.ca.cert, node_id=node_id, is_revoked=lambda n: revoked and n == held
    )


# -- address -------------------------------------------------------------------------------


def source_address(host: str, port: int = 22) -> str:
    """This machine's address on the route to `host` (no packet is sent: a UDP connect picks it)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    except socket.gaierror as exc:
        raise PeerError(f"cannot resolve {host}: {exc.strerror}") from None
    family, _, _, _, sockaddr = infos[0]
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect(sockaddr)
        except OSError as exc:
            raise MachineError(f"no route from this machine to {host}: {exc.strerror or exc}") from None
        return str(sock.getsockname()[0])


def agent_address(opts: Options, host: str, server_cert: CertInfo, *, who: str = "agent") -> tuple[str, int]:
    """The control plane's agent endpoint as the machine at `host` will dial it: an address the
    server certificate covers, and a fixed port; `who` dials it (the agent, or a gateway)."""
    listen_host, _, port_text = opts.server_config.server.agent_listen.rpartition(":")
    listen_host = listen_host.strip("[]")
    port = int(port_text)
    if port == 0:
        raise ConfigError(
            "server.toml",
            [
                f"[server].agent_listen is {opts.server_config.server.agent_listen}: port 0 is a new port each "
                "start, so no node can be told where to dial; give it a fixed port (e.g. 0.0.0.0:7443)"
            ],
        )
    address = opts.server_address or source_address(host)
    covered = {_norm(n) for n in server_cert.sans}
    if _norm(address) not in covered:
        how = "--server-address" if opts.server_address else f"this machine's address on the route to {host}"
        raise ConfigError(
            "server certificate",
            [
                f"{address} ({how}) is not among its addresses ({', '.join(server_cert.sans) or 'none'}), so the "
                f"{who} would refuse the control plane. Add it: `llmgw ca server-cert --state-dir {opts.state_dir} "
                f"--san {' --san '.join([*server_cert.sans, address])}`, add it to [server].advertise and restart "
                "`llmgw server`; or pass --server-address NAME for an address the certificate covers"
            ],
        )
    if listen_host not in ("", "0.0.0.0", "::") and _is_ip(address) and _norm(listen_host) != _norm(address):
        raise ConfigError(
            "server.toml",
            [
                f"[server].agent_listen is {opts.server_config.server.agent_listen}, so the {who} cannot reach "
                f"it at {address}; listen on 0.0.0.0 (or on {address}) and restart `llmgw server`"
            ],
        )
    return address, port


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def _norm(text: str) -> str:
    try:
        return str(ipaddress.ip_address(text.strip("[]")))
    except ValueError:
        return text.lower().rstrip(".")
