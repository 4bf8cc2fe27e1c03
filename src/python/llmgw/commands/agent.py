"""`llmgw agent`: the node side. The only module of llmgw that imports the `agent` package."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import attrs

from llmgw import config as cfg
from llmgw import driverpaths
from llmgw.cli import Parser, add_group, add_leaf

DEFAULT_CONFIG = "/etc/llmgw/agent.toml"
# Kept equal to agent.supervise's (imported only when a command runs); a test checks they agree.
DEFAULT_PID_FILE = "/run/llmgw-agent.pid"
DEFAULT_LOG = "/var/log/llmgw-agent.log"


def configure(parser: Parser) -> None:
    sub = add_group(parser, "verb")
    run = add_leaf(
        sub, "run", "run the agent: connect to the control plane and keep the node's work running", run_agent
    )
    run.add_argument("--config", default=DEFAULT_CONFIG, type=Path, help=f"agent.toml (default {DEFAULT_CONFIG})")
    for flag, key, what in (
        ("--llamacpp-bin", "llamacpp_bin", "a llama-server you installed (used instead of the one server.toml pins)"),
        ("--vllm-bin", "vllm_bin", 'a vllm command you installed (used when vLLM\'s version is "")'),
        (
            "--sglang-python",
            "sglang_python",
            'the Python of your SGLang environment (used when SGLang\'s version is "")',
        ),
    ):
        run.add_argument(flag, dest=key, metavar="PATH", help=f"{what}; overrides agent.toml")
    where = run.add_argument_group("where the driver tools are (default: agent.toml's value, else the usual place)")
    driverpaths.add_options(where, absolute=True, overrides="agent.toml")
    csr = add_leaf(
        sub,
        "csr",
        "make this node's private key (kept here) and a certificate signing request for the control plane",
        run_csr,
    )
    csr.add_argument("--config", default=DEFAULT_CONFIG, type=Path, help=f"agent.toml (default {DEFAULT_CONFIG})")
    sup = add_leaf(
        sub,
        "supervise",
        "run the agent under llmgw's own supervisor, for nodes without systemd: start it again when it exits "
        "(waiting 1 s, doubling up to 30 s), its output appended to a log file; SIGTERM stops both",
        run_supervise,
    )
    sup.add_argument("--config", default=DEFAULT_CONFIG, type=Path, help=f"agent.toml (default {DEFAULT_CONFIG})")
    sup.add_argument(
        "--pid-file",
        default=DEFAULT_PID_FILE,
        type=Path,
        metavar="PATH",
        help=f"holds the supervisor's pid, locked while it runs: one supervisor per file (default {DEFAULT_PID_FILE})",
    )
    sup.add_argument(
        "--log",
        default=DEFAULT_LOG,
        type=Path,
        metavar="PATH",
        help=f"the supervisor's and the agent's output, appended (default {DEFAULT_LOG})",
    )
    sup.add_argument(
        "--daemon",
        action="store_true",
        help="detach, and return once the supervisor runs, printing its pid",
    )
    stop = add_leaf(
        sub,
        "stop",
        "stop the agent supervisor (`llmgw agent supervise`) and its agent; not running is not an error",
        run_stop,
    )
    stop.add_argument(
        "--pid-file", default=DEFAULT_PID_FILE, type=Path, metavar="PATH", help=f"default {DEFAULT_PID_FILE}"
    )
    stop.add_argument(
        "--timeout",
        default=20.0,
        type=float,
        metavar="S",
        help="how long to wait for it to stop after SIGTERM (default 20)",
    )


def run_agent(args: argparse.Namespace) -> int:
    from agent.main import run_agent as serve
    from llmgw.commands._service import run_service

    config = cfg.load_agent_config(args.config)
    overrides = {k: getattr(args, k) for k in ("llamacpp_bin", "vllm_bin", "sglang_python") if getattr(args, k)}
    return run_service("agent", serve, attrs.evolve(config, **overrides, **checked_driver_paths(args)))


def checked_driver_paths(args: argparse.Namespace) -> dict[str, str]:
    """--nvidia-smi, --ib-root and --sminfo as given, each checked to be there: a path given on the
    command line that is wrong would otherwise look like a node without that hardware."""
    paths = driverpaths.given(args)
    for key, path in paths.items():
        if not _present(key, Path(path)):
            raise driverpaths.missing(key, path, "this machine")
    return paths


def _present(key: str, path: Path) -> bool:
    if driverpaths.by_key(key).kind == "dir":
        return path.is_dir()
    return path.is_file() and os.access(path, os.X_OK)


def run_csr(args: argparse.Namespace) -> int:
    # Not agent.main's imports (trio, the link, the engines: 0.4 CPU-s): a key and a CSR need none.
    from agent.node_id import node_id_of
    from llmgw.pki.files import write_node_key_and_csr

    config = cfg.load_agent_config(args.config)
    node_id = node_id_of(config)
    files = write_node_key_and_csr(Path(config.state_dir), node_id)
    print(f"key (stays on this node): {files.key}")
    print(f"certificate signing request for node {node_id!r}: {files.csr}")
    print(f"on the control plane: llmgw ca issue {node_id} --csr node.csr --out node.crt")
    print(f"then copy node.crt to {files.cert} and the CA's ca.crt to {files.ca_cert}")
    return 0


def run_supervise(args: argparse.Namespace) -> int:
    from agent import supervise

    cfg.load_agent_config(args.config)  # a broken agent.toml is an error here, not a restart loop in the log
    level, fmt = getattr(args, "log_level", "info"), getattr(args, "log_format", "kv")
    spec = supervise.Spec(
        argv=supervise.agent_argv(args.config, log_level=level, log_format=fmt),
        pid_file=args.pid_file.absolute(),
        log_file=args.log.absolute(),
        env=supervise.child_env(os.environ),
    )
    return supervise.run(spec, daemon=args.daemon, log_level=level, log_format=fmt)


def run_stop(args: argparse.Namespace) -> int:
    from agent import supervise

    return supervise.stop(args.pid_file.absolute(), timeout_s=args.timeout)
