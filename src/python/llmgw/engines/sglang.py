"""SGLang's `python -m sglang.launch_server`: one node or several.

Flags checked against SGLang 0.5.23 (its `--help`, tests/fixtures/help/sglang.txt). Several
nodes: tensor parallel over every GPU of every node (`--tp-size` is the total), with
`--nnodes N --node-rank R --dist-init-addr HOST:PORT` on each; rank 0 serves the API.

SGLang reads its key only from `--api-key` (its help names no environment variable for it), but
it also reads any of its flags from a YAML file given with `--config FILE` (which must end in
.yaml or .yml, and must be one argv entry of its own, not `--config=FILE`): SGLang replaces
`--config FILE` by the file's `key: value` lines as `--key value` before parsing, inside its own
process, so /proc/PID/cmdline shows only the file's path. The key goes in such a private file,
`api-key: "KEY"`; `--config` is therefore llmgw's, and an operator's own is refused (its flags
can go in the model's `args`). Ranks above 0 serve no HTTP and are not given it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from llmgw.config import Secret
from llmgw.engines.launch import PrivateFile, ReplicaLaunch, fabric_env, gpu_env, key_file, kv_events_config
from llmgw.engines.spec import Arg, EngineSpec, has_flag
from llmgw.wire import gateway_link as g

KEY_FILE = "api-key.yaml"


def _args(launch: ReplicaLaunch) -> list[Arg]:
    args: list[Arg] = ["--model-path", launch.model_path, "--served-model-name", launch.served_name]
    args += ["--host", launch.host, "--port", str(launch.port)]
    if launch.node_rank == 0:
        args += ["--config", key_file(launch, KEY_FILE)]
    if launch.context:
        args += ["--context-length", str(launch.context)]
    args += ["--tp-size", str(max(1, len(launch.gpus)) * launch.nnodes)]
    if launch.multi_node:
        args += ["--nnodes", str(launch.nnodes), "--node-rank", str(launch.node_rank)]
        args += ["--dist-init-addr", launch.dist_init_addr]
    args += kv_events_config(launch, vllm=False)
    return args


def _env(launch: ReplicaLaunch) -> dict[str, str]:
    return {**gpu_env(launch), **fabric_env(launch)}


def _files(launch: ReplicaLaunch) -> list[PrivateFile]:
    if launch.node_rank != 0:
        return []
    # A JSON string is a YAML double-quoted scalar: the key is read back exactly, whatever it holds.
    text = f"api-key: {json.dumps(launch.api_key.reveal())}\n"
    return [PrivateFile(path=key_file(launch, KEY_FILE), content=Secret(text))]


def _routes(args: Sequence[str]) -> tuple[str, ...]:
    """An embedding model (`--is-embedding`) serves embeddings and rerank, any other the text routes."""
    if has_flag(args, "--is-embedding"):
        return (g.EMBEDDINGS, g.RERANK)
    return (g.CHAT, g.COMPLETIONS, g.RESPONSES)


SPEC = EngineSpec(
    name="sglang",
    title="SGLang",
    flags_for="SGLang 0.5.23",
    default_executable=("python3",),
    subcommand=("-m", "sglang.launch_server"),
    max_nodes=None,
    managed=frozenset(
        {"--model-path", "--model", "--served-model-name", "--host", "--port", "--api-key", "--config"}
        | {"--tp-size", "--tensor-parallel-size", "--tp", "--nnodes", "--node-rank"}
        | {"--dist-init-addr", "--nccl-init-addr", "--kv-events-config"}
    ),
    args=_args,
    env=_env,
    files=_files,
    flags_in_files=("--api-key",),
    help_style="argparse",
    routes=_routes,
    prefix_cache=True,
    cache_events=True,
)
