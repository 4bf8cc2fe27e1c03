"""`llmgw gateway` as a whole: what it was asked (`GatewayPlan`, checked before anything starts),
the parent that keeps the workers running (`serve_gateway`) and one worker (`serve_gateway_worker`).

Everything a worker needs is checked in the parent first, so a mistake is told once, before any
worker starts: the table file parses, the certificate files are there and name the gateway.
Each worker checks them again (it builds its own TLS context: a context does not cross
processes) and takes an instance name of its own for its link.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import attrs
import trio

from llmgw.config import GatewaySection
from llmgw.errors import UsageError
from llmgw.gatewayd.identity import credentials
from llmgw.gatewayd.processes import WorkerCommand, parent_link, serve_workers
from llmgw.gatewayd.sources import link_source, serve_table_file
from llmgw.gatewayd.table import GatewayTable
from llmgw.gatewayd.tablefile import TableFile, load_table
from llmgw.gatewayd.worker import DRAIN_S, GatewayWorker, Source
from llmgw.http.limits import Limits
from llmgw.log import get_logger
from llmgw.wire.gateway_session import new_instance

log = get_logger("llmgw.gatewayd")


@attrs.frozen(kw_only=True)
class GatewayPlan:
    host: str
    port: int
    server_url: str | None  # the control plane's link, or
    table_file: Path | None  # a table read from a file (then `table` holds it)
    table: TableFile | None = None
    pki_dir: Path
    name: str  # the certificate's CN with a link; --name or "gateway" with a table file
    gateway: GatewaySection = GatewaySection()
    http: Limits = Limits()
    drain_s: float = DRAIN_S

    @property
    def listen(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def plan(
    *, listen: str, server_url: str | None, table_file: Path | None, pki_dir: Path, name: str | None
) -> GatewayPlan:
    """The gateway asked for, checked: a `UsageError`, `ConfigError` or `MachineError` if not."""
    host, port = split_listen(listen)
    if server_url is not None:
        if not server_url.startswith("wss://"):
            raise UsageError(f"--server {server_url!r} must be the control plane's agent endpoint, wss://HOST:PORT")
        creds = credentials(pki_dir, name)  # its files are there and a gateway's: told now, not by each worker
        return GatewayPlan(
            host=host, port=port, server_url=server_url, table_file=None, pki_dir=pki_dir, name=creds.name
        )
    assert table_file is not None
    return GatewayPlan(
        host=host,
        port=port,
        server_url=None,
        table_file=table_file,
        table=load_table(table_file),
        pki_dir=pki_dir,
        name=name or "gateway",
    )


def split_listen(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UsageError(f"--listen {value!r} must be ADDR:PORT (0.0.0.0:8080, [::]:8080), with a port from 1 to 65535")
    return host.strip("[]"), int(port)


def worker_args(plan: GatewayPlan, *, log_level: str, log_format: str) -> tuple[str, ...]:
    """The command line of this gateway's workers, after llmgw's own command."""
    args = ["--log-level", log_level, "--log-format", log_format, "gateway", "--listen", plan.listen]
    if plan.server_url is not None:
        args += ["--server", plan.server_url, "--pki-dir", str(plan.pki_dir.absolute()), "--name", plan.name]
    else:
        assert plan.table_file is not None
        args += ["--table-file", str(plan.table_file.absolute()), "--name", plan.name]
    return tuple(args)


# -- the parent -----------------------------------------------------------------------------


async def serve_gateway(plan: GatewayPlan, workers: int, command: tuple[str, ...]) -> None:
    """Run `workers` workers (`command`, this llmgw run again) until cancelled, then stop them."""
    worker_command = WorkerCommand(argv=command, drain_s=plan.drain_s)
    async with trio.open_nursery() as nursery:
        pids = await nursery.start(serve_workers, worker_command, workers)
        log.info(
            "gateway_ready",
            name=plan.name,
            listen=plan.listen,
            workers=workers,
            pids=",".join(map(str, pids)),
            table=plan.server_url or str(plan.table_file),
        )


# -- a worker -------------------------------------------------------------------------------


def source_of(plan: GatewayPlan, instance: str, worker: GatewayWorker) -> Source:
    if plan.server_url is not None:
        creds = credentials(plan.pki_dir, plan.name)
        return link_source(plan.server_url, creds.ssl_context, name=creds.name, instance=instance, load=worker.load)
    assert plan.table is not None and plan.table_file is not None
    return partial(serve_table_file, plan.table, plan.table_file)


async def serve_gateway_worker(plan: GatewayPlan, index: int, parent_fd: int | None) -> None:
    """One worker: serve on the shared port until cancelled or the parent is gone, then drain."""
    instance = f"w{index}-{new_instance()}"  # the link's instance: one per process, a restart a new one
    worker = GatewayWorker(GatewayTable(now=trio.current_time()), instance=instance, options=plan.gateway)
    source = source_of(plan, instance, worker)
    parent = parent_link(parent_fd)
    async with trio.open_nursery() as nursery:
        serve = partial(worker.serve, limits=plan.http, drain_s=plan.drain_s, reuse_port=True)
        await nursery.start(serve, source, plan.host, plan.port)
        log.info("gateway_worker_serving", worker=index, instance=instance, listen=plan.listen)
        if parent is not None:
            await parent.ready()
            nursery.start_soon(parent.watch, nursery.cancel_scope)
