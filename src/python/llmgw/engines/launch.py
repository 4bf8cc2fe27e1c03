"""What a replica needs to start (`ReplicaLaunch`), what an engine spec makes of it (`Command`),
and the parts every engine shares: GPU and fabric pinning in the environment.

Pure: no I/O, no environment reads. `Command.env` holds only what llmgw adds; the supervisor
starts the engine with `Command.environment(its own)`.

Secrets: the per-replica API key never goes in argv, which every user of the machine can read
(`ps`, /proc/PID/cmdline). Where the engine reads its key from a file, the key is in
`Command.files`, which the caller writes (0600) into the member's `private_dir` (0700) before
starting the engine and removes when the member stops; otherwise it is in the environment
(/proc/PID/environ is readable by the process's owner only). `Command.unset_env` names the
variables to drop from the inherited environment, so that a stray one (LLAMA_API_KEY set for
the agent) cannot add a second key. `Command.secret_positions` says which argv entries to hide
when logging, should an engine ever take a secret as a flag.
"""

from __future__ import annotations

import ipaddress
import json
import posixpath
import re
from collections.abc import Iterable, Mapping

import attrs

from llmgw.config import Secret

REDACTED = "<redacted>"

# A flag, as opposed to a value: "-m", "--ctx-size", "--ctx-size=4096", "-nocb". Negative
# numbers ("-1") are values.
_FLAG = re.compile(r"^--?[A-Za-z][A-Za-z0-9_.-]*(=.*)?$")


@attrs.frozen(kw_only=True)
class ReplicaLaunch:
    """One process of one replica: what the control plane decided, in the engine's terms.

    A multi-node replica is `nnodes` of these, one per node, differing in `node_rank`; rank 0
    serves the API, the others only compute. `rank0_addr:dist_init_port` is where they meet.
    """

    engine: str
    model_path: str  # weights on this node (a file for llama.cpp, a directory for vLLM/SGLang); "" for sim
    served_name: str  # the model name clients use (the catalog's name)
    host: str
    port: int
    api_key: Secret  # per replica: only the gateway may use the engine's port
    gpus: tuple[int, ...] = ()  # indices as nvidia-smi numbers them; () = no GPU
    context: int = 0  # tokens; 0 = the engine's default (the model's own)
    extra_args: tuple[str, ...] = ()  # the catalog's `args`, appended as given
    nnodes: int = 1
    node_rank: int = 0
    rank0_addr: str = ""  # the address rank 0 binds and the others dial
    dist_init_port: int = 0
    ib_adapters: tuple[str, ...] = ()  # the fabric's adapters on this node, e.g. ("mlx5_0", "mlx5_1")
    socket_ifname: str = ""  # the network interface for rendezvous traffic, e.g. "ib0"
    # An absolute path to a directory only the engine's user may read, for the files that carry
    # its key (one directory per member; the caller makes it and removes it when the member stops).
    private_dir: str = ""
    # Where rank 0 publishes its KV-cache events (the catalog's cache_events, engines whose spec
    # has `cache_events`: vLLM, SGLang), on every address of the node (the engines bind "*"); 0: not.
    events_port: int = 0
    # Started able to park its model without stopping (`EngineSpec.park`: vLLM's sleep mode).
    parkable: bool = False
    # Rank 0 of an engine whose other ranks lend their devices over llama.cpp's RPC
    # (`EngineSpec.rpc_helpers`): each helper's rpc-server as llama-server dials it, "host:port",
    # in rank order (the agent's local ends of its tunnels to them: agent.rpctunnel).
    rpc_servers: tuple[str, ...] = ()
    # With `rpc_servers`: the model's repeating layers (its GGUF's `<arch>.block_count`, which the
    # agent reads from the file), spread evenly over the members (`llamacpp.rpc_layer_split`).
    model_layers: int = 0

    @property
    def multi_node(self) -> bool:
        return self.nnodes > 1

    @property
    def dist_init_addr(self) -> str:
        host = f"[{self.rank0_addr}]" if ":" in self.rank0_addr else self.rank0_addr
        return f"{host}:{self.dist_init_port}"


def kv_events_config(launch: ReplicaLaunch, *, vllm: bool) -> list[str]:
    """`--kv-events-config` for rank 0 of a replica that publishes its KV-cache events
    (`llmgw.gateway.kvevents` reads them); nothing otherwise. The events carry token ids and
    have no authentication (docs/gateway.md says to firewall the port), so the endpoint is bound
    where the API listens when the engine can: SGLang binds a given address with `"bind": true`
    (an IPv4 one: its publisher does not turn on libzmq's IPv6); vLLM binds only when the host
    is "*" (any other it dials instead), so every address of the node."""
    if not launch.events_port or launch.node_rank != 0:
        return []
    host = "*"
    if not vllm and _ipv4_address(launch.host):
        host = launch.host
    config: dict[str, object] = {
        "publisher": "zmq",
        "endpoint": f"tcp://{host}:{launch.events_port}",
        "topic": "kv-events",
    }
    if vllm:
        config["enable_kv_cache_events"] = True  # vLLM's switch; SGLang publishes whenever the flag is given
    elif host != "*":
        config["bind"] = True
    return ["--kv-events-config", json.dumps(config, separators=(",", ":"))]


def _ipv4_address(host: str) -> bool:
    """A node's own IPv4 address (not the wildcard): what a publisher can bind alone."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    return address.version == 4 and not address.is_unspecified


@attrs.frozen(kw_only=True)
class PrivateFile:
    """A file the engine reads a secret from: written before it starts, readable by its owner only."""

    path: str  # inside the launch's private_dir
    content: Secret


@attrs.frozen(kw_only=True)
class Command:
    """A process to start: argv (argv[0] is the executable), the variables to add to its
    environment and to remove from it, and the private files to write before it starts."""

    argv: tuple[str, ...]
    env: Mapping[str, str] = attrs.field(factory=dict, converter=dict, repr=lambda env: repr(_hide_env(env)))
    secret_positions: frozenset[int] = frozenset()  # argv entries that hold a secret
    files: tuple[PrivateFile, ...] = ()
    unset_env: frozenset[str] = frozenset()

    def environment(self, base: Mapping[str, str]) -> dict[str, str]:
        """The engine's whole environment, given the one it inherits."""
        return {**{k: v for k, v in base.items() if k not in self.unset_env}, **self.env}

    def for_log(self) -> dict[str, object]:
        """The command with its secrets hidden: safe to log and to show."""
        argv = [REDACTED if i in self.secret_positions else a for i, a in enumerate(self.argv)]
        shown: dict[str, object] = {"argv": argv, "env": _hide_env(self.env)}
        if self.files:
            shown["files"] = [f.path for f in self.files]
        return shown


# Environment variables whose name says they hold a secret (LLAMA_API_KEY, VLLM_API_KEY, ...):
# `Command.for_log` hides them by name, as llmgw.log does for fields.
_SECRET_ENV = re.compile(r"(^|_)(KEY|TOKEN|SECRET|PASSWORD)S?$")


def _hide_env(env: Mapping[str, str]) -> dict[str, str]:
    return {k: REDACTED if _SECRET_ENV.search(k) else v for k, v in env.items()}


# RFC 6750's b64token: what an `Authorization: Bearer` credential may hold.
_KEY = re.compile(r"[A-Za-z0-9._~+/=-]+")


def check_launch(launch: ReplicaLaunch, *, engine_title: str, max_nodes: int | None) -> list[str]:
    """What is wrong with `launch` whatever the engine: one line per problem, each with its fix."""
    problems = []
    if not 1 <= launch.port <= 65535:
        problems.append(f"port {launch.port} is not a TCP port (1-65535)")
    if not launch.served_name:
        problems.append("served_name is empty; it is the model name clients ask for")
    if launch.nnodes < 1:
        problems.append(f"nnodes is {launch.nnodes}; a replica runs on at least one node")
    elif max_nodes is not None and launch.nnodes > max_nodes:
        problems.append(
            f"{engine_title} runs on one node, but the replica asks for {launch.nnodes}; "
            "set nodes_per_replica = 1 for this model"
        )
    elif not 0 <= launch.node_rank < launch.nnodes:
        problems.append(f"node_rank {launch.node_rank} is outside 0..{launch.nnodes - 1}")
    if launch.multi_node and (not launch.rank0_addr or not 1 <= launch.dist_init_port <= 65535):
        problems.append(
            f"a {launch.nnodes}-node replica needs rank0_addr and dist_init_port (got "
            f"{launch.rank0_addr!r}, {launch.dist_init_port})"
        )
    if launch.rpc_servers and (launch.node_rank != 0 or len(launch.rpc_servers) != launch.nnodes - 1):
        problems.append(
            f"rpc_servers {list(launch.rpc_servers)} are for rank 0 of a replica, one per other node "
            f"(rank {launch.node_rank} of {launch.nnodes}); a bug in the agent"
        )
    if launch.rpc_servers and launch.model_layers < 1:
        problems.append(
            f"rank 0 of a replica over llama.cpp's RPC needs the model's layer count to split it, got "
            f"{launch.model_layers}; a bug in the agent"
        )
    if any(g < 0 for g in launch.gpus) or len(set(launch.gpus)) != len(launch.gpus):
        problems.append(f"gpus {list(launch.gpus)} must be distinct non-negative indices")
    if launch.context < 0:
        problems.append(f"context {launch.context} is negative; 0 means the model's own")
    if launch.node_rank == 0 and not _KEY.fullmatch(launch.api_key.reveal()):
        # An empty key would leave the port open to anyone; a space or a line break would not
        # survive a key file or an Authorization header.
        problems.append(
            "the replica's API key is empty or holds characters other than letters, digits and "
            "-._~+/= (a bug in the control plane: it makes every key)"
        )
    return problems


def key_file(launch: ReplicaLaunch, name: str) -> str:
    """Where the file called `name` that carries the key goes: in the member's private directory."""
    return posixpath.join(launch.private_dir, name)


def flags_in(argv: Iterable[str]) -> list[str]:
    """The flags among `argv`, in order, without `=value` ("--ctx-size=8" -> "--ctx-size")."""
    return [a.split("=", 1)[0] for a in argv if _FLAG.match(a)]


def gpu_env(launch: ReplicaLaunch) -> dict[str, str]:
    """Pin the engine to its GPUs. An empty CUDA_VISIBLE_DEVICES hides every GPU, which is what
    a CPU replica on a GPU node must get (otherwise it would grab GPU 0)."""
    # PCI bus order is nvidia-smi's order; CUDA's default ("fastest first") is not.
    return {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in launch.gpus)}


def fabric_env(launch: ReplicaLaunch) -> dict[str, str]:
    """Pin NCCL (and gloo, which torch uses for CPU-side groups) to the replica's fabric.

    A replica given adapters on two fabrics starts, passes its health checks and hangs on its
    first all-reduce, so a multi-node replica uses exactly the adapters the placement chose.
    NCCL_IB_HCA's leading "=" asks for exact names: without it "mlx5_1" would also select
    mlx5_10..mlx5_19 (NCCL matches prefixes by default).
    """
    env = {}
    if launch.ib_adapters:
        env["NCCL_IB_HCA"] = "=" + ",".join(launch.ib_adapters)
    if launch.socket_ifname:
        # "=" again: exact interface name, not prefix.
        env["NCCL_SOCKET_IFNAME"] = "=" + launch.socket_ifname
        env["GLOO_SOCKET_IFNAME"] = launch.socket_ifname
    return env


def managed_conflicts(args: Iterable[str], managed: Iterable[str]) -> list[str]:
    """Operator args that would override a flag llmgw sets itself (the last one given wins in
    every engine here, so an operator's `--port` would silently move the replica away from the
    port the gateway dials)."""
    managed_set = set(managed)
    return sorted({f for f in flags_in(args) if f in managed_set})
