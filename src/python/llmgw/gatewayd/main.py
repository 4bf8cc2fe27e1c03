"""`llmgw gateway` as a whole: what it was asked (`GatewayPlan`, checked before anything starts),
the parent that keeps the workers running (`serve_gateway`) and one worker (`serve_gateway_worker`).
The control plane runs its own gateway's workers with this plan too (`llmgw.server.gateways.workers`):
listening sockets it hands them (`listen_fds`), the name its certificate covers when they dial
it on loopback (`tls_name`), its private socket to relay its own routes to (`relay_socket`), and
to listen only once the first table came (`table_first`).

Everything a worker needs is checked in the parent first, so a mistake is told once, before any
worker starts: the table file parses, the certificate files are there and name the gateway.
Each worker checks them again (it builds its own TLS context: a context does not cross
processes) and takes an instance name of its own for its link.
"""

from __future__ import annotations

import gc
import json
import shutil
import socket
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import trio

from llmgw import paths, telemetry
from llmgw.config import GatewaySection, TelemetrySection, to_dict
from llmgw.config.convert import structure
from llmgw.errors import ConfigError, UsageError
from llmgw.gatewayd import figures
from llmgw.gatewayd.identity import credentials
from llmgw.gatewayd.processes import WorkerCommand, parent_link, serve_workers
from llmgw.gatewayd.sources import link_source, serve_table_file
from llmgw.gatewayd.table import GatewayTable
from llmgw.gatewayd.tablefile import TableFile, load_table
from llmgw.gatewayd.worker import DRAIN_S, GatewayWorker, Source
from llmgw.http.limits import Limits
from llmgw.http.relay import Relay
from llmgw.log import get_logger
from llmgw.wire.gateway_session import new_instance

if TYPE_CHECKING:
    from llmgw.telemetry.otel import Tracing

log = get_logger("llmgw.gatewayd")


@attrs.frozen(kw_only=True)
class GatewayPlan:
    host: str
    port: int
    servers: tuple[str, ...]  # every control plane's link (the first dialled first), or none and
    table_file: Path | None  # a table read from a file (then `table` holds it)
    table: TableFile | None = None
    pki_dir: Path
    name: str  # the certificate's CN with a link; --name or "gateway" with a table file
    gateway: GatewaySection = GatewaySection()
    http: Limits = Limits()
    drain_s: float = DRAIN_S
    tls_name: str = ""  # the name the control plane's certificate must cover, if not the host of server_url
    listen_fds: tuple[int, ...] = ()  # listening sockets passed to the workers, in place of binding `listen`
    relay_socket: Path | None = None  # where what is not the gateway's goes (`llmgw.http.relay`)
    table_first: bool = False  # listen only once the first whole table came (`GatewayWorker.serve`)
    settings: Path | None = (
        None  # `[gateway]`, `[http]` and `[telemetry]` as the control plane runs them (`write_settings`)
    )
    telemetry: TelemetrySection = TelemetrySection()  # the traces: off unless it names a collector
    telemetry_file: Path | None = None  # `--telemetry FILE`, where a gateway of its own read `telemetry`
    figures_dir: Path | None = None  # where a gateway of its own's workers share their figures (`figures`)

    @property
    def server_url(self) -> str | None:
        """The first control plane's link, None with a table file."""
        return self.servers[0] if self.servers else None

    @property
    def listen(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def plan(
    *,
    listen: str,
    server_url: str | Sequence[str] | None,
    table_file: Path | None,
    pki_dir: Path,
    name: str | None,
    **inner: Any,
) -> GatewayPlan:
    """The gateway asked for, checked: a `UsageError`, `ConfigError` or `MachineError` if not.
    `inner`: what the control plane tells its own workers (`tls_name`, `listen_fds`, `relay_socket`,
    `table_first`, `settings`), or a gateway of its own's parent its workers (`figures_dir`). `server_url`: the control plane's agent port, or every one's
    when several share a store (`--server` given more than once)."""
    host, port = split_listen(listen)
    if inner.get("settings") is not None:
        inner["gateway"], inner["http"], inner["telemetry"] = read_settings(inner["settings"])
    if inner.get("telemetry_file") is not None:
        inner["telemetry"] = telemetry.load_section(inner["telemetry_file"])
    if inner.get("telemetry") is not None and inner["telemetry"].headers_file:
        telemetry.read_headers(inner["telemetry"].headers_file)  # readable and private: told now, not by each worker
    servers = (server_url,) if isinstance(server_url, str) else tuple(server_url or ())
    if servers:
        for url in servers:
            if not url.startswith("wss://"):
                raise UsageError(f"--server {url!r} must be a control plane's agent port, wss://HOST:PORT")
        if len(set(servers)) != len(servers):
            raise UsageError(f"--server names one control plane twice ({', '.join(servers)}); name each once")
        creds = credentials(pki_dir, name)  # its files are there and a gateway's: told now, not by each worker
        return GatewayPlan(
            host=host, port=port, servers=servers, table_file=None, pki_dir=pki_dir, name=creds.name, **inner
        )
    assert table_file is not None
    return GatewayPlan(
        host=host,
        port=port,
        servers=(),
        table_file=table_file,
        table=load_table(table_file),
        pki_dir=pki_dir,
        name=name or "gateway",
        **inner,
    )


def write_settings(
    path: Path, gateway: GatewaySection, http: Limits, telemetry: TelemetrySection | None = None
) -> None:
    """The control plane's `[gateway]`, `[http]` and `[telemetry]` for its own workers (a 0600
    file: nothing in them is secret, `[telemetry]`'s headers being in a file of their own, but the
    directory is the workers' private one)."""
    limits = {f.name: getattr(http, f.name) for f in attrs.fields(Limits)}  # the listener's part of [http]
    data = {"gateway": to_dict(gateway), "http": limits, "telemetry": to_dict(telemetry or TelemetrySection())}
    paths.write_private(path, json.dumps(data).encode())


def read_settings(path: Path) -> tuple[GatewaySection, Limits, TelemetrySection]:
    """What `write_settings` wrote; a `ConfigError` naming the file if it cannot be read as that."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(str(path), [f"cannot be read: {exc.__class__.__name__}: {exc}"]) from None
    if not isinstance(data, dict):
        raise ConfigError(str(path), ["expected a JSON object with gateway and http"])
    gateway = structure(data.get("gateway", {}), GatewaySection, str(path))
    tracing = structure(data.get("telemetry", {}), TelemetrySection, str(path))
    return gateway, structure(data.get("http", {}), Limits, str(path)), tracing


def split_listen(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UsageError(f"--listen {value!r} must be ADDR:PORT (0.0.0.0:8080, [::]:8080), with a port from 1 to 65535")
    return host.strip("[]"), int(port)


def worker_args(plan: GatewayPlan, *, log_level: str, log_format: str) -> tuple[str, ...]:
    """The command line of this gateway's workers, after llmgw's own command."""
    args = ["--log-level", log_level, "--log-format", log_format, "gateway", "--listen", plan.listen]
    if plan.servers:
        for url in plan.servers:
            args += ["--server", url]
        args += ["--pki-dir", str(plan.pki_dir.absolute()), "--name", plan.name]
    else:
        assert plan.table_file is not None
        args += ["--table-file", str(plan.table_file.absolute()), "--name", plan.name]
    if plan.tls_name:
        args += ["--server-name", plan.tls_name]
    for fd in plan.listen_fds:
        args += ["--listen-fd", str(fd)]
    if plan.relay_socket is not None:
        args += ["--relay-socket", str(plan.relay_socket.absolute())]
    if plan.table_first:
        args += ["--table-first"]
    if plan.settings is not None:
        args += ["--settings", str(plan.settings.absolute())]
    if plan.telemetry_file is not None:
        args += ["--telemetry", str(plan.telemetry_file.absolute())]
    return tuple(args)


# -- the parent -----------------------------------------------------------------------------


async def serve_gateway(plan: GatewayPlan, workers: int, command: tuple[str, ...]) -> None:
    """Run `workers` workers (`command`, this llmgw run again) until cancelled, then stop them;
    they share their figures through a directory made for this run (`figures`), removed at the end."""
    directory = figures.make_dir()
    try:
        argv = (*command, "--figures-dir", str(directory))
        worker_command = WorkerCommand(argv=argv, drain_s=plan.drain_s, figures_dir=directory)
        async with trio.open_nursery() as nursery:
            pids = await nursery.start(serve_workers, worker_command, workers)
            log.info(
                "gateway_ready",
                name=plan.name,
                listen=plan.listen,
                workers=workers,
                pids=",".join(map(str, pids)),
                table=", ".join(plan.servers) or str(plan.table_file),
            )
    finally:
        shutil.rmtree(directory, ignore_errors=True)  # a file per worker; every worker has ended


# -- a worker -------------------------------------------------------------------------------


def source_of(plan: GatewayPlan, instance: str, worker: GatewayWorker) -> Source:
    if plan.servers:
        creds = credentials(plan.pki_dir, plan.name)
        return link_source(
            plan.servers,
            creds.ssl_context,
            name=creds.name,
            instance=instance,
            load=worker.load,
            at_once=worker.gateway.at_once,
            tls_name=plan.tls_name,
            usage=worker.gateway.usage,
            budgets=worker.table.budgets,
        )
    assert plan.table is not None and plan.table_file is not None
    return partial(serve_table_file, plan.table, plan.table_file)


async def serve_gateway_worker(plan: GatewayPlan, index: int, parent_fd: int | None) -> None:
    """One worker: serve on the shared port until cancelled or the parent is gone, then drain;
    its traces' exporter (`[telemetry]`) is stopped last, once its spans are handed over."""
    instance = f"w{index}-{new_instance()}"  # the link's instance: one per process, a restart a new one
    tracing = telemetry.start(plan.telemetry, instance=f"{plan.name}/{instance}")  # None: off
    if tracing is not None:
        log.info("gateway_traces", endpoint=tracing.endpoint, sample_ratio=plan.telemetry.sample_ratio)
    try:
        await _serve_worker(plan, index, parent_fd, instance, tracing)
    finally:
        if tracing is not None:  # what is queued goes to the collector, bounded
            with trio.CancelScope(shield=True):
                await tracing.aclose()


async def _serve_worker(
    plan: GatewayPlan, index: int, parent_fd: int | None, instance: str, tracing: Tracing | None
) -> None:
    relay = Relay(plan.relay_socket).handle if plan.relay_socket is not None else None
    shared = figures.SharedFigures(plan.figures_dir, index, instance) if plan.figures_dir is not None else None
    worker = GatewayWorker(
        GatewayTable(now=trio.current_time()),
        instance=instance,
        options=plan.gateway,
        plane_routes=relay,
        figures=shared,
        tracing=tracing,
    )
    source = source_of(plan, instance, worker)
    parent = parent_link(parent_fd)
    sockets = inherited_listeners(plan.listen_fds)
    async with trio.open_nursery() as nursery:
        serve = partial(
            worker.serve,
            limits=plan.http,
            drain_s=plan.drain_s,
            reuse_port=True,
            sockets=sockets,
            table_first=plan.table_first,
        )
        await nursery.start(serve, source, plan.host, plan.port)
        log.info("gateway_worker_serving", worker=index, instance=instance, listen=plan.listen)
        # What it made to start (modules, the TLS context, the first table) is left out of every
        # garbage collection from now on: a full collection that scans it all holds a request for
        # about 20 ms (measured in the control plane, `llmgw.gcpolicy.freeze_start_objects`).
        gc.freeze()
        if parent is not None:
            await parent.ready()
            nursery.start_soon(parent.watch, nursery.cancel_scope)


def inherited_listeners(fds: tuple[int, ...]) -> list[trio.SocketListener] | None:
    """The listening sockets passed to this worker as file descriptors, if any."""
    if not fds:
        return None
    return [trio.SocketListener(trio.socket.from_stdlib_socket(socket.socket(fileno=fd))) for fd in fds]
