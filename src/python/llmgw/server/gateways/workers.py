"""The control plane's own gateway: worker processes that serve `[server] http_listen`, so that
no request is ever handled on the control plane's loop (docs/gateway.md, "The control plane's
workers").

Each worker is `llmgw gateway` run by `llmgw.gatewayd` exactly as a standalone gateway's workers
are (`serve_workers`: started together, each started again with backoff after it exits, SIGTERM
and its drain at stop, SIGKILL past it; no worker outlives the control plane), and subscribes to
the control plane over the gateway link like any gateway:

- Who they are: a gateway certificate named `WORKER_NAME`, which the control plane issues itself
  at each start into `STATE_DIR/run/gateway` (0700; the last start's is replaced). They dial the
  agent port on loopback (its own address when agent_listen names one) and check the control
  plane's certificate against a name it covers (`tls_name`).
- The port: each worker binds `http_listen` with SO_REUSEPORT, so the kernel spreads connections
  among them. The control plane first holds the port itself (`hold_port`: bound with
  SO_REUSEPORT, never listening, so no connection comes to it), which makes port 0 one port every
  worker takes and keeps any other program off it while a worker restarts. Under socket
  activation the sockets passed for http_listen are handed to every worker instead (the same
  file descriptors), and the control plane keeps them open: connections wait in their backlog
  while a worker restarts.
- Its settings: server.toml's `[gateway]` and `[http]` as the control plane read them at start,
  in `STATE_DIR/run/gateway/settings.json` (`[http] max_connections` and `body_budget_bytes` are
  then each worker's).
- The routes: what is not the gateway's (`relay.gateway_route`) each worker relays to the
  control plane's private socket (`llmgw.server.admin.privatesocket`): the admin API, the cluster page,
  /login and /metrics keep their URL.
- Ready: a worker listens only once it holds its first whole table (`table_first`), so no
  request finds it without one; the control plane is ready once every worker serves and routes
  by its rotation (a heartbeat said so), and `OwnGateway.serve` reports the address then.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import trio

from llmgw import log as logs
from llmgw import paths
from llmgw.config import ServerConfig
from llmgw.errors import MachineError
from llmgw.gatewayd import main as gatewayd
from llmgw.gatewayd.processes import WorkerCommand, serve_workers
from llmgw.log import get_logger
from llmgw.pki.ca import CA, cert_info
from llmgw.pki.files import ca_paths, gateway_paths, issue_gateway_to_dir, load_cert
from llmgw.selfexec import llmgw_command
from llmgw.server.front import cannot_listen, split_hostport
from llmgw.server.gateways.figures import WORKER_NAME, own_workers
from llmgw.server.links.gatewaylinks import GatewayFeed

log = get_logger("llmgw.server")

SETTINGS_FILE = "settings.json"  # beside the certificate: the control plane's [gateway] and [http]
LINK_TIMEOUT_S = 60.0  # at start, for every worker to route by the control plane's rotation
_WILDCARDS = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}


def worker_count(setting: int | str | None, default: int | str) -> int:
    """`[server] gateway_workers` as a number of processes: unset is the command's `default`;
    "auto" is one per CPU this process may run on."""
    value = default if setting is None else setting
    return len(os.sched_getaffinity(0)) if value == "auto" else int(value)


def issue_identity(ca: CA, state_dir: Path, *, validity_days: int) -> Path:
    """A new certificate for the workers (the gateway WORKER_NAME) in STATE_DIR/run/gateway,
    replacing the last start's; the directory."""
    pki = paths.workers_pki_dir(state_dir)
    files = gateway_paths(pki)
    for path in (files.key, files.cert, files.ca_cert):
        path.unlink(missing_ok=True)
    issue_gateway_to_dir(ca, WORKER_NAME, pki, validity_days=validity_days)
    return pki


def hold_port(host: str, port: int) -> list[socket.socket]:
    """(host, port) held for the workers: a socket per address `host` resolves to, bound with
    SO_REUSEPORT alone and never listening (port 0: the port the first one got). Without
    SO_REUSEADDR, no program may bind it but one of this user's with SO_REUSEPORT: the workers."""
    held: list[socket.socket] = []
    try:
        for family, type_, proto, _, sockaddr in socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        ):
            sock = socket.socket(family, type_, proto)
            held.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind((sockaddr[0], port, *sockaddr[2:]))
            port = sock.getsockname()[1]  # port 0: every address on the port the first one got
    except BaseException:
        for sock in held:
            sock.close()
        raise
    return held


def link_url(agent_address: tuple[str, int]) -> str:
    """Where the workers dial the agent port: its own address, loopback for a wildcard."""
    host, port = agent_address
    host = _WILDCARDS.get(host, host)
    return f"wss://[{host}]:{port}" if ":" in host else f"wss://{host}:{port}"


def tls_name(state_dir: Path, host: str) -> str:
    """The name to check the control plane's certificate against when dialling `host`: `host`
    if the certificate covers it, else the first name it does cover."""
    sans = cert_info(load_cert(ca_paths(state_dir).server_cert)).sans
    if host in sans or not sans:
        return ""
    return sans[0]


class OwnGateway:
    """The control plane's gateway workers: `count` of them, linked to `feed`."""

    def __init__(self, *, count: int, config: ServerConfig, state_dir: Path, ca: CA, feed: GatewayFeed) -> None:
        self.count = count
        self.config = config
        self.state_dir = state_dir
        self.ca = ca
        self.feed = feed
        self.drain_s = gatewayd.DRAIN_S
        self.link_timeout_s = LINK_TIMEOUT_S

    async def serve(
        self,
        agent_address: tuple[str, int],
        sockets: list[trio.SocketListener],
        *,
        task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Run the workers until cancelled, then stop them (each drains its requests in flight).
        Started, with the address http_listen is bound to, once every one serves by the
        control plane's table. `sockets`: http_listen's, passed to us (socket activation)."""
        host, _ = split_hostport(self.config.server.http_listen)
        held = [] if sockets else self._hold()
        try:
            fds = tuple(s.socket.fileno() for s in sockets)
            address = _address(sockets[0].socket.getsockname() if sockets else held[0].getsockname())
            command = self._command(agent_address, (host or "0.0.0.0", address[1]), fds)
            async with trio.open_nursery() as nursery:
                pids = await nursery.start(serve_workers, command, self.count)
                await self._linked()
                log.info(
                    "gateway_workers_ready", workers=self.count, pids=",".join(map(str, pids)), listen=str(address)
                )
                task_status.started(address)
        finally:
            for sock in held:
                sock.close()

    def _hold(self) -> list[socket.socket]:
        host, port = split_hostport(self.config.server.http_listen)
        try:
            return hold_port(host, port)
        except OSError as exc:
            raise cannot_listen("http_listen", self.config.server.http_listen, exc) from None

    def _command(self, agent_address: tuple[str, int], listen: tuple[str, int], fds: tuple[int, ...]) -> WorkerCommand:
        pki = issue_identity(self.ca, self.state_dir, validity_days=self.config.ca.server_cert_validity_days)
        settings = pki / SETTINGS_FILE
        gatewayd.write_settings(settings, self.config.gateway, self.config.http, self.config.telemetry)
        url = link_url(agent_address)
        plan = gatewayd.plan(
            listen=_listen(listen),
            server_url=url,
            table_file=None,
            pki_dir=pki,
            name=WORKER_NAME,
            tls_name=tls_name(self.state_dir, _WILDCARDS.get(agent_address[0], agent_address[0])),
            listen_fds=fds,
            relay_socket=paths.admin_socket_path(self.state_dir),
            table_first=True,
            settings=settings,
        )
        level, fmt = logs.settings()
        argv = (*llmgw_command(), *gatewayd.worker_args(plan, log_level=level, log_format=fmt))
        return WorkerCommand(argv=argv, drain_s=self.drain_s, pass_fds=fds)

    async def _linked(self) -> None:
        """Until every worker routes by the control plane's rotation, as its heartbeat says."""
        with trio.move_on_after(self.link_timeout_s):
            while True:
                heard = self.feed.heard.next()
                linked = [link for link in own_workers(self.feed.links.values()) if link.last.rotation_version]
                if len(linked) >= self.count:
                    return
                await heard.wait()
        raise MachineError(
            f"the control plane's {self.count} gateway worker(s) did not link to it within {self.link_timeout_s:g} s "
            "over the gateway link; their gateway_link_down lines above say why"
        )


def _address(sockname: tuple) -> tuple[str, int]:
    return sockname[0], sockname[1]


def _listen(address: tuple[str, int]) -> str:
    host, port = address
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
