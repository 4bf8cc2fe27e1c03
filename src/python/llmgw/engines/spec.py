"""`EngineSpec`: what llmgw knows about one engine's command line, and how a launch becomes a
`Command`. One instance per engine lives in that engine's module; `llmgw.engines` lists them.

Pure: building a command reads nothing and starts nothing. The key goes in a private file
(`files`) where the engine reads one, else in the environment; never in argv. Arguments that
carry a secret would be given as `Secret`, so the built command knows which argv entries to
hide when it is logged.
"""

from __future__ import annotations

import posixpath
from collections.abc import Callable, Mapping, Sequence

import attrs

from llmgw.config import Secret
from llmgw.engines.errors import LaunchError
from llmgw.engines.launch import Command, PrivateFile, ReplicaLaunch, check_launch, managed_conflicts
from llmgw.wire import gateway_link as g

Arg = str | Secret


@attrs.frozen(kw_only=True)
class Park:
    """How an engine parks its model without stopping (vLLM's sleep mode: the weights put away
    in host memory, the GPU memory freed, woken in a fraction of a second instead of a reload),
    on its API port, asked by the agent of rank 0: POST `sleep`, POST `wake`, and GET `state`
    whose JSON says under `state_key` whether it is parked now."""

    sleep: str
    wake: str
    state: str
    state_key: str


@attrs.frozen(kw_only=True)
class EngineSpec:
    name: str  # as the catalog names it: llamacpp, vllm, sglang, sim
    title: str  # as people name it, in messages
    flags_for: str  # the engine version whose command line the flags were written against
    default_executable: tuple[str, ...]  # when the caller names none (found on PATH)
    subcommand: tuple[str, ...]  # between the executable and the arguments ("serve", "-m MODULE")
    max_nodes: int | None  # None: any number
    # Flags llmgw always sets and an operator's args may not override (with their aliases): the
    # model, the name, where it listens, the key, the GPUs and nodes it spans. Others (context,
    # GPU layers) are the operator's to tune: given in args, they win over llmgw's.
    managed: frozenset[str]
    # The engine's own arguments for `launch` (not the operator's), and what it adds to the environment.
    args: Callable[[ReplicaLaunch], Sequence[Arg]]
    env: Callable[[ReplicaLaunch], Mapping[str, str]]
    # The files the engine reads its key from, in `launch.private_dir` (the caller writes them
    # before the engine starts), and the variables to drop from the environment it inherits.
    files: Callable[[ReplicaLaunch], Sequence[PrivateFile]] = lambda launch: ()
    unset_env: frozenset[str] = frozenset()
    # Flags those files set (SGLang reads its flags from a YAML file): checked against the help
    # like the ones in argv.
    flags_in_files: tuple[str, ...] = ()
    # How to make it print its whole help, and what that needs in the environment, given the
    # environment it will run in (so a variable the operator set is not overridden).
    help_args: tuple[str, ...] = ("--help",)
    help_env: Callable[[Mapping[str, str]], Mapping[str, str]] = lambda environ: {}
    help_style: str = "argparse"  # how its help lays out options (see llmgw.engines.helptext)
    # Environment variables llmgw relies on that the help documents (e.g. the API key's): a
    # rename would go unnoticed by the flag check, and a key that is not read means an open port.
    documented_env: tuple[str, ...] = ()
    # Text that appears only in a help that is not the whole list, and what to do instead.
    partial_help_marker: str = ""
    partial_help_fix: str = ""
    # The OpenAI routes it serves at `flags_for`, given a model's args (an embedding model's flag
    # changes them): the gateway forwards those alone to its replicas (`wire.gateway_link.ModelInfo`).
    routes: Callable[[Sequence[str]], tuple[str, ...]] = lambda args: (g.CHAT, g.COMPLETIONS)
    # Whether it keeps the prompts it processed for the next request that starts the same way
    # (llama.cpp's slots and prompt cache, vLLM's and SGLang's prefix caches): its models are
    # routed by prefix unless the catalog says otherwise (`llmgw.gateway.prefix`).
    prefix_cache: bool = False
    # Whether it publishes KV-cache events (`launch.kv_events_config`): the catalog's cache_events.
    cache_events: bool = False
    # How it parks a model without stopping, where it can (`launch.parkable` starts it able to);
    # None: an idle replica of it is stopped instead.
    park: Park | None = None
    # Whether ranks >= 1 of a multi-node replica lend their devices over llama.cpp's RPC (a
    # `rpc_server_command` each, on loopback behind the agents' tunnel) instead of running the
    # engine, and rank 0 is given them as `launch.rpc_servers`.
    rpc_helpers: bool = False

    def build(self, launch: ReplicaLaunch, executable: str | Sequence[str] | None = None) -> Command:
        """The command for `launch`: the engine's arguments, then the operator's `extra_args`.

        `executable` is argv[0] (a path) or the argv prefix that runs the engine (the agent
        passes its own interpreter and llmgw for sim); default: `default_executable`.
        Raises `LaunchError` for a launch this engine cannot run.
        """
        problems = self.problems(launch)
        if problems:
            raise LaunchError(f"cannot launch {launch.served_name!r} on {self.title}: " + "; ".join(problems))
        prefix = self.default_executable if executable is None else _as_argv(executable)
        argv: list[str] = [*prefix, *self.subcommand]
        secret: set[int] = set()
        for arg in self.args(launch):
            if isinstance(arg, Secret):
                secret.add(len(argv))
                argv.append(arg.reveal())
            else:
                argv.append(arg)
        argv.extend(launch.extra_args)
        return Command(
            argv=tuple(argv),
            env=dict(self.env(launch)),
            secret_positions=frozenset(secret),
            files=tuple(self.files(launch)),
            unset_env=self.unset_env,
        )

    def problems(self, launch: ReplicaLaunch) -> list[str]:
        problems = []
        if launch.engine != self.name:
            problems.append(f"the launch is for engine {launch.engine!r}, not {self.name!r}")
        problems.extend(check_launch(launch, engine_title=self.title, max_nodes=self.max_nodes))
        if self.files(launch) and not posixpath.isabs(launch.private_dir):
            problems.append(
                f"{self.title} reads its key from a file, and private_dir {launch.private_dir!r} is not an "
                "absolute path to a directory only the engine's user can read (a bug in the caller)"
            )
        conflicts = managed_conflicts(launch.extra_args, self.managed)
        if conflicts:
            problems.append(
                f"args set {', '.join(conflicts)}, which llmgw sets itself for every replica; "
                "remove them from the model's args"
            )
        return problems

    def help_command(
        self, executable: str | Sequence[str] | None = None, *, environ: Mapping[str, str] | None = None
    ) -> Command:
        """The command that prints the engine's whole help, run with `environ` updated by `env`."""
        prefix = self.default_executable if executable is None else _as_argv(executable)
        return Command(argv=(*prefix, *self.subcommand, *self.help_args), env=dict(self.help_env(environ or {})))


def has_flag(args: Sequence[str], *names: str) -> bool:
    """Whether `args` set one of the flags `names` (alone, or as --flag=value)."""
    return any(a in names or a.split("=", 1)[0] in names for a in args)


def flag_value(args: Sequence[str], *names: str) -> str | None:
    """The value given to the last of the flags `names` in `args` (--flag V or --flag=V)."""
    found = None
    for i, a in enumerate(args):
        name, eq, value = a.partition("=")
        if name in names:
            found = value if eq else (args[i + 1] if i + 1 < len(args) else "")
    return found


def _as_argv(executable: str | Sequence[str]) -> tuple[str, ...]:
    argv = (executable,) if isinstance(executable, str) else tuple(executable)
    if not argv or not all(argv):
        raise ValueError(f"executable must name a program, got {executable!r}")
    return argv
