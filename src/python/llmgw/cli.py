"""The `llmgw` command: a registry of command groups, one module each (nomad style).

`COMMANDS` maps each command word to the module that implements it and a one-line summary.
Only the chosen command's module is imported, so `llmgw --help` and a command's start-up do
not pay for every other command's imports. A module provides:

    def configure(parser: Parser) -> None     # arguments, subcommands
    def run(args: argparse.Namespace) -> int  # the exit status

A usage error prints that command's help and exits 2. An `LlmgwError` prints its message and
exits with the status its class carries; anything else is a bug and says so.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import attrs

from llmgw import log
from llmgw.errors import LlmgwError, leaves


@attrs.frozen
class CommandSpec:
    name: str
    module: str
    summary: str


# Only commands that work are listed; `llmgw --help` prints exactly these.
COMMANDS: tuple[CommandSpec, ...] = (
    CommandSpec(
        "agent",
        "llmgw.commands.agent",
        "the node side: run the agent (or supervise it without systemd), make the node's key and CSR",
    ),
    CommandSpec("ca", "llmgw.commands.ca", "the cluster's certificate authority: init, show, server-cert, issue"),
    CommandSpec("config", "llmgw.commands.config", "check server.toml and agent.toml"),
    CommandSpec(
        "ctl", "llmgw.commands.ctl", "operate a running cluster: nodes, replicas, models, cordon, engine-check"
    ),
    CommandSpec(
        "doctor",
        "llmgw.commands.doctor",
        "check this node: CPU, GPUs, fabrics, disk, clock, service manager; exit 0/1/2",
    ),
    CommandSpec("engine", "llmgw.commands.engine", "run an inference engine that ships with llmgw (sim)"),
    CommandSpec(
        "gateway",
        "llmgw.commands.gateway",
        "run the OpenAI-compatible gateway alone, on any machine: workers on one port, fed by the control plane",
    ),
    CommandSpec(
        "node", "llmgw.commands.node", "add a machine as a node over SSH; remove a node and revoke its certificate"
    ),
    CommandSpec(
        "server",
        "llmgw.commands.server",
        "run the control plane: agent port, gateway, admin API; back up its state",
    ),
    CommandSpec(
        "up", "llmgw.commands.up", "a whole local cluster in one command: control plane, agents, sim models, gateway"
    ),
    CommandSpec("version", "llmgw.commands.version", "print version, commit, architecture and Python"),
)

EXIT_USAGE = 2
EXIT_BUG = 70
# Not a command: how a serving process starts its JSON worker (llmgw.http.jsonworkers), the same
# code run again. Spelled so no user types it by accident; not in `llmgw --help`.
INTERNAL_JSON_WORKER = "__json-worker"


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors show the whole help of the command at fault, and
    which takes options only as spelled: argparse's prefix matching would read a typo such as
    `up --node 3` as `--nodes 3`, and a flag added later would silently change what an old
    abbreviation means. Subcommand parsers are made with this class too (`add_subparsers`
    defaults to its parser's class), so the whole command tree refuses abbreviations."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.print_help(sys.stderr)
        self.exit(EXIT_USAGE, f"\n{self.prog}: error: {message}\n")


def _common_options() -> Parser:
    common = Parser(add_help=False)
    group = common.add_argument_group("logging")
    # SUPPRESS keeps a value given before the command word from being reset after it.
    group.add_argument("--log-level", choices=log.LEVELS, default=argparse.SUPPRESS, help="default: info")
    group.add_argument("--log-format", choices=log.FORMATS, default=argparse.SUPPRESS, help="kv (default) or json")
    return common


COMMON = _common_options()


def add_leaf(subparsers: Any, name: str, help: str, run: Callable[[argparse.Namespace], int]) -> Parser:
    """Add a subcommand that does something; used by command groups for their verbs."""
    parser = subparsers.add_parser(name, help=help, description=help, parents=[COMMON])
    parser.set_defaults(run=run)
    return parser


def add_json_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


def fabric_arg(text: str) -> Any:
    """argparse's `type` for `--fabric NAME[:ADAPTER,...]`: a FabricDecl, or the reason it is not one."""
    from llmgw.config import parse_fabric_flag

    try:
        return parse_fabric_flag(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_group(parser: Parser, dest: str) -> Any:
    """Subcommands of a command group; naming none is a usage error."""
    sub = parser.add_subparsers(dest=dest, metavar="COMMAND", parser_class=Parser)
    sub.required = True
    return sub


def _top_parser() -> Parser:
    return Parser(
        prog="llmgw",
        usage="llmgw [--log-level LEVEL] [--log-format FORMAT] COMMAND ...",
        description="llmgw turns machines you already own into one LLM serving cluster.",
        parents=[COMMON],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="commands:\n"
        + "\n".join(f"  {c.name:<12}{c.summary}" for c in COMMANDS)
        + "\n\nRun `llmgw COMMAND --help` for a command's options.",
    )


def _find_command(argv: list[str]) -> int | None:
    """Index of the command word: the first argument that is neither an option nor its value."""
    valued = {a for action in COMMON._actions for a in action.option_strings if action.nargs is None}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in valued:
            i += 2
            continue
        if not arg.startswith("-"):
            return i
        i += 1
    return None


def build_parser(command: str) -> Parser:
    spec = next(c for c in COMMANDS if c.name == command)
    module = importlib.import_module(spec.module)
    parser = Parser(prog=f"llmgw {command}", description=spec.summary, parents=[COMMON])
    module.configure(parser)
    if parser.get_default("run") is None:
        parser.set_defaults(run=getattr(module, "run", None))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv == [INTERNAL_JSON_WORKER]:
        from llmgw.http.jsonworkers import worker_main

        return worker_main()
    top = _top_parser()
    at = _find_command(argv)
    if at is None:
        top.parse_args(argv)  # handles --help (exit 0) and bad options (exit 2)
        top.print_help(sys.stderr)
        return EXIT_USAGE
    command = argv[at]
    if command not in {c.name for c in COMMANDS}:
        top.error(f"unknown command {command!r} (one of: {', '.join(c.name for c in COMMANDS)})")
    args = build_parser(command).parse_args(argv[:at] + argv[at + 1 :])
    log.setup(level=getattr(args, "log_level", "info"), fmt=getattr(args, "log_format", "kv"))
    try:
        return int(args.run(args) or 0)
    except LlmgwError as exc:
        print(f"llmgw {command}: {exc}", file=sys.stderr)
        return exc.exit_status
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader went away (`llmgw doctor --json | head`): not an error of ours. Point stdout
        # at /dev/null so the interpreter's final flush does not complain either.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except Exception as exc:  # noqa: BLE001 - the last line of defence: a bug, reported as one
        # A task of a nursery raised an LlmgwError: it arrives wrapped in an exception group.
        wrapped = [e for e in leaves(exc) if isinstance(e, LlmgwError)]
        if wrapped and all(isinstance(e, LlmgwError) for e in leaves(exc)):
            print(f"llmgw {command}: {wrapped[0]}", file=sys.stderr)
            return wrapped[0].exit_status
        traceback.print_exc()
        print(
            f"llmgw {command}: internal error (a bug in llmgw); the traceback above says where. "
            "Please report it with the output of `llmgw version`.",
            file=sys.stderr,
        )
        return EXIT_BUG
