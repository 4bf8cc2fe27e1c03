"""Does an installed engine take the flags llmgw gives it? Asked before the engine is offered.

The engine prints its whole help (`EngineSpec.help_command`: `vllm serve --help=all`, SGLang's
launch_server `--help`), and llmgw.engines.check looks up every flag of the widest command llmgw
would build. A version that renamed one is refused, with the flags it lacks, instead of failing
minutes into a model load on a node nobody watches. Pure: the installer runs the command.
"""

from __future__ import annotations

from collections.abc import Mapping

from agent.install.errors import EngineCheckFailed
from llmgw.engines.check import MISSING, check_engine
from llmgw.engines.registry import spec_for

HELP_TIMEOUT_S = 300.0  # vLLM imports torch before it prints its help: tens of seconds on a cold disk


def help_run(engine: str, executable: str, environ: Mapping[str, str]) -> tuple[list[str], dict[str, str]]:
    """The argv that prints `engine`'s whole help, and the environment to run it in (`environ`,
    with what the help needs added unless `environ` sets it, e.g. VLLM_TARGET_DEVICE)."""
    command = spec_for(engine).help_command(executable, environ=environ)
    return list(command.argv), {**environ, **command.env}


def judge_help(engine: str, argv: list[str], output: str) -> None:
    """Raise EngineCheckFailed if the help lacks a flag or variable llmgw relies on."""
    spec = spec_for(engine)
    result = check_engine(engine, output)
    if result.status != MISSING:
        return
    lacks = [*result.missing, *result.missing_env, *result.arg_problems]
    raise EngineCheckFailed(
        f"`{' '.join(argv)}` does not document {', '.join(lacks)}, which llmgw gives {spec.title} "
        f"(its flags are written for {spec.flags_for}); pin a version that takes them in server.toml, "
        f"or compare with `llmgw ctl engine-check {engine}`"
    )
