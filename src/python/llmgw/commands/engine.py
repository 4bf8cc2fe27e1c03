"""`llmgw engine`: inference engines that ship with llmgw. Today one, `sim`: the simulated
engine (`llmgw.simengine`) that stands in for a real one where there is no GPU.

Its command line is an engine's, not an llmgw command's: llmgw's engine spec for `sim` builds
it the way it builds llama-server's, and `llmgw ctl engine-check sim` reads its `--help`,
which therefore prints one line per flag, the flag at column 0 and its description at column
40, as llama-server's does, and documents `--help` itself.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping

from llmgw import __version__
from llmgw.cli import Parser, add_group, add_leaf
from llmgw.errors import LlmgwError, UsageError, find

API_KEY_ENV = "LLMGW_SIM_API_KEY"


class EngineHelpFormatter(argparse.RawDescriptionHelpFormatter):
    """llama-server's help layout: flags at column 0, descriptions at column 40, no wrapping."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, indent_increment=0, max_help_position=40, width=1000)


def configure(parser: Parser) -> None:
    sub = add_group(parser, "engine")
    sim = add_leaf(
        sub, "sim", "the simulated engine: OpenAI API, deterministic text, real multi-node rendezvous", run_sim
    )
    configure_sim(sim)


def configure_sim(parser: argparse.ArgumentParser) -> None:
    from llmgw.simengine import protocol
    from llmgw.simengine.options import DEFAULT_MAX_TOKENS, DEFAULT_PORT, DEFAULT_RENDEZVOUS_TIMEOUT_S

    parser.formatter_class = EngineHelpFormatter
    parser.epilog = (
        "Rank 0 serves /health, /v1/models, /v1/chat/completions and /v1/completions (streamed or not).\n"
        "/health answers 503 until every worker has joined and the startup delay has passed, then 200.\n"
        "Workers (--node-rank > 0) serve no HTTP: each connects to --dist-init-addr, retrying with backoff\n"
        "until --rendezvous-timeout-s, and holds the connection. Members exchange heartbeats every "
        f"{protocol.HEARTBEAT_S:g} s;\na member silent for {protocol.PEER_TIMEOUT_S:g} s, or whose connection "
        "drops, fails the replica: the member that notices exits 3.\n"
        "SIGTERM or SIGINT stop it cleanly (exit 0)."
    )
    p = parser.add_argument
    p("--version", action="version", version=f"llmgw sim engine {__version__}", help="print the version and exit")
    p(
        "--model",
        required=True,
        metavar="NAME",
        help="served model name: what /v1/models lists and requests must name (required)",
    )
    p("--host", default="127.0.0.1", metavar="HOST", help="address rank 0 serves HTTP on (default: 127.0.0.1)")
    p(
        "--port",
        type=_port,
        default=DEFAULT_PORT,
        metavar="PORT",
        help=f"HTTP port of rank 0; 0 picks a free one, logged in sim_listening (default: {DEFAULT_PORT})",
    )
    p(
        "--api-key",
        metavar="KEY",
        help=f"require 'Authorization: Bearer KEY' on every /v1 request, else 401 (env: {API_KEY_ENV}; default: none)",
    )
    p(
        "--api-key-file",
        metavar="FNAME",
        help="read the key from this file instead (its first line; keeps the key out of argv and the environment)",
    )
    p(
        "--prompt-token-ms",
        type=_non_negative,
        default=0.0,
        metavar="F",
        help="simulated time per prompt token before the first output token, ms (default: 0)",
    )
    p(
        "--output-token-ms",
        type=_non_negative,
        default=0.0,
        metavar="F",
        help="simulated time per output token, ms (default: 0)",
    )
    p(
        "--max-tokens-default",
        type=_positive_int,
        default=DEFAULT_MAX_TOKENS,
        metavar="N",
        help=f"max_tokens of a request that gives none (default: {DEFAULT_MAX_TOKENS})",
    )
    p(
        "--nnodes",
        type=_positive_int,
        default=1,
        metavar="N",
        help="number of nodes (members) in this replica (default: 1)",
    )
    p(
        "--node-rank",
        type=_non_negative_int,
        default=0,
        metavar="R",
        help="this member's rank, 0..N-1; rank 0 serves HTTP, the others serve nothing (default: 0)",
    )
    p(
        "--dist-init-addr",
        type=_addr,
        metavar="HOST:PORT",
        help="rank 0's rendezvous address: rank 0 binds it, workers connect to it (required when --nnodes > 1)",
    )
    p(
        "--rendezvous-timeout-s",
        type=_non_negative,
        default=DEFAULT_RENDEZVOUS_TIMEOUT_S,
        metavar="F",
        help=f"how long rank 0 waits for every worker, and a worker keeps retrying rank 0; then exit 3 (default: {DEFAULT_RENDEZVOUS_TIMEOUT_S:g})",
    )
    p(
        "--startup-delay-s",
        type=_non_negative,
        default=0.0,
        metavar="F",
        help="seconds between the rendezvous and serving, as if loading weights (default: 0)",
    )
    p(
        "--fail-after-s",
        type=_non_negative,
        default=None,
        metavar="F",
        help="exit 3 after F seconds, to simulate a crash (default: never)",
    )


def _port(text: str) -> int:
    value = _non_negative_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port (0..65535)")
    return value


def _positive_int(text: str) -> int:
    value = _non_negative_int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be 1 or more")
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} must not be negative")
    return value


def _non_negative(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text} must be a finite number, 0 or more")
    return value


def _addr(text: str) -> tuple[str, int]:
    from llmgw.simengine.options import parse_addr

    try:
        return parse_addr(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def api_key_of(args: argparse.Namespace, environ: Mapping[str, str]) -> str | None:
    """The key from --api-key or --api-key-file, else from `environ`; None: serve without one."""
    if args.api_key is not None and args.api_key_file is not None:
        raise UsageError("give --api-key or --api-key-file, not both")
    if args.api_key_file is None:
        return args.api_key if args.api_key is not None else environ.get(API_KEY_ENV) or None
    try:
        with open(args.api_key_file, encoding="utf-8") as f:
            key = f.readline().strip()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise UsageError(f"cannot read --api-key-file {args.api_key_file}: {reason}") from None
    if not key:
        raise UsageError(f"--api-key-file {args.api_key_file} holds no key on its first line; write the key there")
    return key


def run_sim(args: argparse.Namespace) -> int:
    from llmgw.commands._service import run_service
    from llmgw.simengine.main import serve_sim
    from llmgw.simengine.options import SimOptions

    options = SimOptions(
        model=args.model,
        host=args.host,
        port=args.port,
        api_key=api_key_of(args, os.environ),
        prompt_token_ms=args.prompt_token_ms,
        output_token_ms=args.output_token_ms,
        max_tokens_default=args.max_tokens_default,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        dist_init_addr=args.dist_init_addr,
        rendezvous_timeout_s=args.rendezvous_timeout_s,
        startup_delay_s=args.startup_delay_s,
        fail_after_s=args.fail_after_s,
    ).check()
    try:
        return run_service("sim", serve_sim, options)
    except Exception as exc:  # trio reports a task's failure inside exception groups
        failure = find(exc, LlmgwError)
        if failure is None:
            raise
        raise failure from None  # the CLI prints it and exits with its status (3: the replica failed)
