"""`llmgw gateway`: the gateway alone, on any machine, as many as wanted behind a load balancer
(docs/gateway.md, "Running gateways of their own"). The process started is the parent: it runs
the workers (this command again, with the hidden `--worker-index` and `--parent-fd`) and keeps
them running (`llmgw.gatewayd`). Its verbs install, remove and identify a gateway on a machine:
`llmgw gateway add USER@HOST`, `remove NAME`, `csr` (llmgw.commands._gatewayverbs)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from llmgw.cli import Parser
from llmgw.commands._gatewayverbs import add_verbs
from llmgw.commands._service import run_service
from llmgw.errors import UsageError

DEFAULT_LISTEN = "0.0.0.0:8080"
DEFAULT_PKI_DIR = "/var/lib/llmgw-gateway/pki"  # kept equal to llmgw.gatewayd.identity's (a test checks)


def workers_arg(value: str) -> int:
    """`--workers N` or `auto`: one per CPU this process may run on."""
    if value == "auto":
        return len(os.sched_getaffinity(0))
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of workers, 1 or more, or auto; got {value!r}")
    return int(value)


def configure(parser: Parser) -> None:
    parser.usage = (
        "%(prog)s --server wss://HOST:PORT [--server ...] [--listen ADDR:PORT] [--workers N|auto] [--pki-dir DIR] "
        "[--name NAME]\n"
        "       %(prog)s --table-file FILE [--listen ADDR:PORT] [--workers N|auto] [--name NAME]\n"
        "       %(prog)s add USER@HOST [--name NAME] [--listen ADDR:PORT] [--workers N|auto] [--reissue] ...\n"
        "       %(prog)s remove NAME [--ssh USER@HOST]\n"
        "       %(prog)s csr --name NAME [--pki-dir DIR]"
    )
    parser.description = (
        "Run the OpenAI-compatible gateway alone until SIGTERM or Ctrl-C: worker processes sharing one port, each "
        "with its own link to the control plane, serving from the last table it received while the control plane "
        "is away."
    )
    source = parser.add_mutually_exclusive_group()  # one of them without a verb: `run` says so
    source.add_argument(
        "--server",
        action="append",
        metavar="wss://HOST:PORT",
        help="the control plane's agent port ([server] agent_listen), reached with this gateway's certificate; "
        "give it once per control plane when several share a store: the gateway dials them in turn and follows a "
        "standby to the leader",
    )
    source.add_argument(
        "--table-file",
        type=Path,
        metavar="FILE",
        help="serve the table in FILE (JSON, the link's messages) and no control plane: for tests and benchmarks",
    )
    parser.add_argument(
        "--listen",
        default=DEFAULT_LISTEN,
        metavar="ADDR:PORT",
        help=f"where clients and load balancers reach it; every worker listens there (default {DEFAULT_LISTEN})",
    )
    parser.add_argument(
        "--workers",
        default=1,
        type=workers_arg,
        metavar="N|auto",
        help="worker processes sharing the port (SO_REUSEPORT), each about one core's worth; auto: one per CPU "
        "(default 1)",
    )
    parser.add_argument(
        "--pki-dir",
        type=Path,
        default=Path(DEFAULT_PKI_DIR),
        metavar="DIR",
        help=f"gateway.key, gateway.crt (the gateway role) and ca.crt (default {DEFAULT_PKI_DIR})",
    )
    parser.add_argument(
        "--name", metavar="NAME", help="the gateway's name; default: its certificate's CN, which it must match"
    )
    parser.add_argument(
        "--telemetry",
        type=Path,
        metavar="FILE",
        help="a TOML file with a [telemetry] table (server.toml's): export traces to the OpenTelemetry collector "
        "it names (docs/operations.md, Traces); default: no traces",
    )
    parser.add_argument("--worker-index", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--parent-fd", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--figures-dir", type=Path, help=argparse.SUPPRESS)  # the parent's, for /metrics
    # What the control plane tells the workers of its own gateway (`llmgw.server.gateways.workers`).
    parser.add_argument("--server-name", default="", help=argparse.SUPPRESS)
    parser.add_argument("--listen-fd", type=int, action="append", default=[], help=argparse.SUPPRESS)
    parser.add_argument("--relay-socket", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--table-first", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--settings", type=Path, help=argparse.SUPPRESS)
    add_verbs(parser)


def run(args: argparse.Namespace) -> int:
    from llmgw.gatewayd import main
    from llmgw.selfexec import llmgw_command

    if args.server is None and args.table_file is None:
        raise UsageError(
            "give --server wss://HOST:PORT (the control plane's agent port) or --table-file FILE to run the "
            "gateway, or a verb: add USER@HOST, remove NAME, csr (`llmgw gateway --help`)"
        )
    plan = main.plan(
        listen=args.listen,
        server_url=args.server,
        table_file=args.table_file,
        pki_dir=args.pki_dir,
        name=args.name,
        tls_name=args.server_name,
        listen_fds=tuple(args.listen_fd),
        relay_socket=args.relay_socket,
        table_first=args.table_first,
        settings=args.settings,
        figures_dir=args.figures_dir,
        telemetry_file=args.telemetry,
    )
    if args.worker_index is not None:
        return run_service("gateway_worker", main.serve_gateway_worker, plan, args.worker_index, args.parent_fd)
    logs = {"log_level": getattr(args, "log_level", "info"), "log_format": getattr(args, "log_format", "kv")}
    command = (*llmgw_command(), *main.worker_args(plan, **logs))
    return run_service("gateway", main.serve_gateway, plan, args.workers, command)
