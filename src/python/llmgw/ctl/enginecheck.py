"""`llmgw ctl engine-check`: does an engine still take every flag llmgw gives it? Runs here and
needs no control plane: the engine's help comes from the command line, a file, or the installed
engine itself (`spec.help_command`); the checks are `llmgw.engines.check`'s."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from llmgw import config
from llmgw.cli import add_json_flag, add_leaf
from llmgw.errors import UsageError

if TYPE_CHECKING:
    from llmgw import engines

HELP_TIMEOUT_S = 120.0  # vLLM imports torch before it prints its help: tens of seconds on a small node

ENGINE_CHECK_EPILOG = """\
It builds the widest command llmgw would ever give ENGINE (multi-node, every optional flag) and
looks up each flag in the engine's own help: the given text, or else what the installed engine
prints (vLLM: `vllm serve --help=all`, with VLLM_TARGET_DEVICE=cpu unless set). Give the whole
help: a text that does not document --help itself was probably cut short, and is warned about.

exit status:
  0  every flag llmgw uses is documented
  1  warnings only (e.g. the help looks cut short)
  2  flags llmgw uses are missing, or the models' args are wrong; or nothing was checked
     (the engine could not be asked for its help, or a usage error)"""


def configure_engine_check(sub: Any) -> None:
    check = add_leaf(
        sub, "engine-check", "check that an engine still takes every flag llmgw gives it", run_engine_check
    )
    check.formatter_class = argparse.RawDescriptionHelpFormatter
    check.epilog = ENGINE_CHECK_EPILOG
    check.add_argument(
        "engine", metavar="ENGINE", choices=sorted(config.ENGINES), help=f"one of: {', '.join(sorted(config.ENGINES))}"
    )
    source = check.add_mutually_exclusive_group()
    source.add_argument("--help-output", metavar="TEXT", help='the engine\'s help, e.g. "$(llama-server --help 2>&1)"')
    source.add_argument("--help-file", type=Path, metavar="FILE", help="a file holding the engine's help")
    check.add_argument(
        "--binary",
        metavar="PATH",
        help="the installed engine to ask: llama-server, vllm, the Python that has sglang, or llmgw "
        "(default: found on PATH; for sim, this llmgw)",
    )
    check.add_argument(
        "--config", type=Path, metavar="FILE", help="also check the args of this server.toml's models on ENGINE"
    )
    add_json_flag(check)


def run_engine_check(args: argparse.Namespace) -> int:
    # Imported here, not by every `llmgw ctl` (0.05-0.08 CPU-s): the engine specs' names are
    # config.ENGINES (a test says they agree).
    from llmgw import engines

    spec = engines.spec_for(args.engine)
    if args.help_output is not None:
        text, source = args.help_output, "--help-output"
    elif args.help_file is not None:
        text, source = _read_help_file(args.help_file), str(args.help_file)
    else:
        text, source = _run_help(spec, args.binary)
    result = engines.check_engine(spec.name, text)
    if args.config is not None:
        problems = []
        for model in config.load_server_config(args.config).models:
            if model.engine == spec.name:
                problems += [f"model {model.name!r}: {p}" for p in engines.check_args(spec.name, model.args, text)]
        result = attrs.evolve(result, arg_problems=tuple(problems))
    if args.json:
        print(json.dumps({**result.to_dict(), "help_source": source}, indent=2))
    else:
        print(format_engine_check(result, spec, source))
    return result.status


def _read_help_file(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        raise UsageError(f"cannot read the help file {path}: {exc.strerror or exc}") from None


def _run_help(spec: engines.EngineSpec, binary: str | None) -> tuple[str, str]:
    from llmgw import engines

    executable: str | tuple[str, ...] | None = binary
    extra_env: dict[str, str] = {}
    if binary is None and spec.name == "sim":
        # The sim is this program: ask this llmgw, not whichever one is on PATH.
        executable = (sys.executable, "-m", "llmgw")
        extra_env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    command = spec.help_command(executable, environ=os.environ)
    shown = " ".join(command.argv)
    try:
        done = subprocess.run(
            command.argv,
            env={**os.environ, **extra_env, **command.env},
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            errors="replace",
            timeout=HELP_TIMEOUT_S,
            check=False,
        )
    except FileNotFoundError:
        raise engines.EngineHelpError(
            f"{command.argv[0]!r} not found, so {spec.title} cannot be asked for its help; "
            "pass --binary PATH, or the help itself with --help-output or --help-file"
        ) from None
    except PermissionError:
        raise engines.EngineHelpError(f"{command.argv[0]!r} is not executable; pass --binary PATH") from None
    except subprocess.TimeoutExpired:
        raise engines.EngineHelpError(f"`{shown}` printed no help within {HELP_TIMEOUT_S:.0f} s") from None
    if done.returncode != 0:
        said = "\n".join((done.stderr or done.stdout).strip().splitlines()[-10:]) or "(nothing)"
        raise engines.EngineHelpError(f"`{shown}` failed (exit status {done.returncode}); it said:\n{said}")
    return done.stdout or done.stderr, f"`{shown}`"


def format_engine_check(result: engines.EngineCheck, spec: engines.EngineSpec, source: str) -> str:
    from llmgw.engines.check import MISSING, OK

    missing = set(result.missing)
    lines = [
        f"{spec.title}: {result.documented} flags documented by {source}; "
        f"llmgw's flags were written for {result.flags_for}",
        *(f"  {'MISSING' if f in missing else 'ok':<8}{f}" for f in result.checked),
    ]
    lines += [
        f"  MISSING {v} (environment variable llmgw sets; the help no longer mentions it)" for v in result.missing_env
    ]
    lines += [f"args: {p}" for p in result.arg_problems]
    lines += [f"warning: {w}" for w in result.warnings]
    if result.status == MISSING:
        lines.append(
            f"result: {len(result.missing) + len(result.missing_env)} of llmgw's flags missing, "
            f"{len(result.arg_problems)} problems in models' args (exit 2)"
        )
    else:
        lines.append("result: " + ("ok (exit 0)" if result.status == OK else "warnings (exit 1)"))
    return "\n".join(lines)
