"""SGLang's `python -m sglang.launch_server`: one node or several.

Flags checked against SGLang 0.5.23 (its `--help`, tests/fixtures/help/sglang.txt). Several
nodes: tensor parallel over every GPU of every node (`--tp-size` is the total), with
`--nnodes N --node-rank R --dist-init-addr HOST:PORT` on each; rank 0 serves the API.

SGLang reads its key only from `--api-key` (no environment variable), so the key is in argv,
where other users of the node can read it (`ps`); `Command.for_log` hides it. Ranks above 0
serve no HTTP and are not given it.
"""

from __future__ import annotations

from llmgw.engines.launch import ReplicaLaunch, fabric_env, gpu_env
from llmgw.engines.spec import Arg, EngineSpec


def _args(launch: ReplicaLaunch) -> list[Arg]:
    args: list[Arg] = ["--model-path", launch.model_path, "--served-model-name", launch.served_name]
    args += ["--host", launch.host, "--port", str(launch.port)]
    if launch.node_rank == 0:
        args += ["--api-key", launch.api_key]
    if launch.context:
        args += ["--context-length", str(launch.context)]
    args += ["--tp-size", str(max(1, len(launch.gpus)) * launch.nnodes)]
    if launch.multi_node:
        args += ["--nnodes", str(launch.nnodes), "--node-rank", str(launch.node_rank)]
        args += ["--dist-init-addr", launch.dist_init_addr]
    return args


def _env(launch: ReplicaLaunch) -> dict[str, str]:
    return {**gpu_env(launch), **fabric_env(launch)}


SPEC = EngineSpec(
    name="sglang",
    title="SGLang",
    flags_for="SGLang 0.5.23",
    default_executable=("python3",),
    subcommand=("-m", "sglang.launch_server"),
    max_nodes=None,
    managed=frozenset(
        {"--model-path", "--model", "--served-model-name", "--host", "--port", "--api-key"}
        | {"--tp-size", "--tensor-parallel-size", "--tp", "--nnodes", "--node-rank"}
        | {"--dist-init-addr", "--nccl-init-addr"}
    ),
    args=_args,
    env=_env,
    help_style="argparse",
)
