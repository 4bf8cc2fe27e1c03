"""llmgw's simulated engine, `llmgw engine sim`: OpenAI-compatible, no weights, no GPU, and a
real multi-node rendezvous (rank 0 binds the dist-init port and serves only once every worker
has joined; workers serve nothing).

argv[0] is the caller's: the agent passes the command that runs its own llmgw. The key goes in
a private file given with `--api-key-file`, as llama-server's does; LLMGW_SIM_API_KEY, which the
sim reads when neither `--api-key` nor `--api-key-file` is given, is removed from the
environment it inherits. Its help is laid out like llama-server's (flags at column 0), so that
engine-check reads both the same way.
"""

from __future__ import annotations

from llmgw.config import Secret
from llmgw.engines.launch import PrivateFile, ReplicaLaunch, fabric_env, gpu_env, key_file
from llmgw.engines.spec import Arg, EngineSpec

API_KEY_ENV = "LLMGW_SIM_API_KEY"
KEY_FILE = "api-key"


def _args(launch: ReplicaLaunch) -> list[Arg]:
    args: list[Arg] = ["--model", launch.served_name, "--host", launch.host, "--port", str(launch.port)]
    if launch.node_rank == 0:  # workers serve nothing: they need no key
        args += ["--api-key-file", key_file(launch, KEY_FILE)]
    if launch.multi_node:
        args += ["--nnodes", str(launch.nnodes), "--node-rank", str(launch.node_rank)]
        args += ["--dist-init-addr", launch.dist_init_addr]
    return args


def _env(launch: ReplicaLaunch) -> dict[str, str]:
    # The sim touches no GPU and no fabric; the variables are set anyway so that a test of the
    # agent sees the environment a real engine would get.
    return {**gpu_env(launch), **fabric_env(launch)}


def _files(launch: ReplicaLaunch) -> list[PrivateFile]:
    if launch.node_rank != 0:
        return []
    return [PrivateFile(path=key_file(launch, KEY_FILE), content=Secret(launch.api_key.reveal() + "\n"))]


SPEC = EngineSpec(
    name="sim",
    title="the sim engine",
    flags_for="llmgw engine sim of this llmgw",
    default_executable=("llmgw",),
    subcommand=("engine", "sim"),
    max_nodes=None,
    managed=frozenset(
        {"--model", "--host", "--port", "--api-key", "--api-key-file", "--nnodes", "--node-rank", "--dist-init-addr"}
    ),
    args=_args,
    env=_env,
    files=_files,
    unset_env=frozenset({API_KEY_ENV}),
    help_style="column0",
    documented_env=(API_KEY_ENV,),
)
