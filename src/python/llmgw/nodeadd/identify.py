"""The `identify` and `address` steps every onboarding flow shares: what the machine is, and where
it will dial the control plane.

`probe_machine` reads the machine in one round trip (hostname, architecture, init system,
os-release: llmgw.nodeadd.layout's probe) into the flow's `Facts`; `check_sudo` refuses a login
that cannot become root without a password. What a flow then decides from them (a node's id, a
gateway's name, a control plane's CA) is its own identify step's. Nothing is written on the
machine here. `agent_address` is a decision on this machine only: the address must be one the
server certificate covers and `agent_listen` can be reached at.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Sequence

from llmgw.errors import ConfigError, MachineError, PeerError
from llmgw.nodeadd import layout, ssh
from llmgw.nodeadd.context import SHORT_S, Facts, Options, said
from llmgw.nodeadd.release import release_arch
from llmgw.pki.ca import CertInfo

# -- identify ------------------------------------------------------------------------------


async def probe_machine(
    s: ssh.SshSession, facts: Facts, *, machine: str = "machine", tools: Sequence[str] = (), without_systemd: str = ""
) -> layout.Probe:
    """The probe's answer, with `facts` filled from it (hostname, machine, arch, systemd).
    `tools`: the flow's known tools the probe looks for; `without_systemd`: for a flow that
    installs a systemd service, what to tell the operator of a machine without systemd (after
    its target), which is refused."""
    res = await s.run(["sh", "-c", layout.probe_script(tools)], timeout_s=SHORT_S)
    if res.exit_status != 0:
        raise PeerError(f"{s.target}: probing the {machine} failed ({said(res)})")
    found = layout.parse_probe(res.stdout, tools)
    facts.hostname = found.hostname
    facts.machine = found.arch
    facts.arch = release_arch(found.arch)
    facts.systemd = found.systemd
    if without_systemd and not found.systemd:
        raise MachineError(f"{s.target} {without_systemd}")
    return found


async def check_sudo(s: ssh.SshSession) -> None:
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
    """The control plane's agent port as the machine at `host` will dial it: an address the
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
