"""Engine specs: what each engine's command line and environment are for a replica."""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import pytest

from llmgw import config
from llmgw.config import Secret
from llmgw.engines import SPECS, LaunchError, ReplicaLaunch, build_command, llamacpp, spec_for
from llmgw.engines.launch import PrivateFile

KEY = "k-0123456789abcdef"
PRIVATE = "/var/lib/llmgw-agent/keys/m-1-r0"


def launch(engine: str, **kw: object) -> ReplicaLaunch:
    fields: dict = dict(
        engine=engine,
        model_path="/w/qwen",
        served_name="qwen",
        host="10.0.0.5",
        port=8001,
        api_key=Secret(KEY),
        private_dir=PRIVATE,
    )
    fields.update(kw)
    return ReplicaLaunch(**fields)


def two_nodes(engine: str, rank: int, **kw: object) -> ReplicaLaunch:
    return launch(
        engine,
        gpus=(2, 3),
        nnodes=2,
        node_rank=rank,
        rank0_addr="10.0.0.5",
        dist_init_port=29500,
        ib_adapters=("mlx5_0", "mlx5_1"),
        socket_ifname="ib0",
        **kw,
    )


def test_the_engines_are_the_catalogs() -> None:
    assert tuple(SPECS) == config.ENGINES


def test_llamacpp_command_and_environment() -> None:
    cmd = build_command(launch("llamacpp", gpus=(1,), context=8192, extra_args=("-np", "4")), "/opt/llama-server")
    assert cmd.argv == (
        "/opt/llama-server",
        "--model",
        "/w/qwen",
        "--alias",
        "qwen",
        "--host",
        "10.0.0.5",
        "--port",
        "8001",
        "--api-key-file",
        f"{PRIVATE}/api-key",
        "--ctx-size",
        "8192",
        "--n-gpu-layers",
        "999",
        "--slot-prompt-similarity",
        "0",
        "-np",
        "4",
    )
    assert cmd.env == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "1"}
    # One key per line, as --api-key-file reads it; the caller writes it before the start.
    [key_file] = cmd.files
    assert key_file.path == f"{PRIVATE}/api-key" and key_file.content.reveal() == KEY + "\n"


def _flag(argv: tuple[str, ...], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_llamacpp_over_rpc_rank_0_sets_an_even_split_and_stays_on_tcp() -> None:
    rpc = two_nodes("llamacpp", 0, rpc_servers=("127.0.0.1:41001",), model_layers=8)
    cmd = build_command(attrs.evolve(rpc, gpus=()), "/opt/llama-server")
    assert _flag(cmd.argv, "--rpc") == "127.0.0.1:41001"
    # No GPU here: 4 layers on this CPU; 4 and the output layer (counted by --n-gpu-layers) on the helper.
    assert (_flag(cmd.argv, "--n-gpu-layers"), _flag(cmd.argv, "--tensor-split")) == ("5", "5")
    assert cmd.env["GGML_RPC_NO_RDMA"] == "1" and cmd.env["CUDA_VISIBLE_DEVICES"] == ""
    # Two GPUs a node: every layer on a device; the helper's two, then this node's two (4 layers
    # and the output layer), each node's layers shared by its GPUs.
    with_gpus = build_command(rpc)
    assert (_flag(with_gpus.argv, "--n-gpu-layers"), _flag(with_gpus.argv, "--tensor-split")) == ("9", "4,4,5,5")
    three = build_command(
        launch(
            "llamacpp",
            nnodes=3,
            rank0_addr="10.0.0.5",
            dist_init_port=29500,
            rpc_servers=("127.0.0.1:41001", "127.0.0.1:41002"),
            model_layers=8,
        )
    )
    assert _flag(three.argv, "--rpc") == "127.0.0.1:41001,127.0.0.1:41002"
    # 8 layers over 3: 2 on rank 0's CPU, 3 on each helper, the last with the output layer.
    assert (_flag(three.argv, "--n-gpu-layers"), _flag(three.argv, "--tensor-split")) == ("7", "3,4")
    # The operator's split, after llmgw's, wins.
    own = build_command(attrs.evolve(rpc, gpus=(), extra_args=("--n-gpu-layers", "999")))
    assert own.argv[-2:] == ("--n-gpu-layers", "999")
    with pytest.raises(LaunchError, match="needs the model's layer count"):
        build_command(attrs.evolve(rpc, model_layers=0))
    # A llama.cpp replica on one node is as before: no --rpc, no RDMA switch, no split.
    alone = build_command(launch("llamacpp"))
    assert "--rpc" not in alone.argv and "GGML_RPC_NO_RDMA" not in alone.env and "--tensor-split" not in alone.argv


@pytest.mark.parametrize("layers", [1, 2, 7, 8, 31, 80])
@pytest.mark.parametrize("members", [2, 3, 5])
@pytest.mark.parametrize("gpus", [0, 1, 3])
def test_the_rpc_split_gives_each_member_its_share_as_llama_cpp_assigns_layers(layers, members, gpus) -> None:
    """llama.cpp's assignment (src/llama-model.cpp, load_tensors) replayed on the flags: layers
    before the offloaded ones on rank 0's CPU, each offloaded one to the device whose cumulative
    share first exceeds its position; each member's layers within one of layers / members."""
    ngl, split = llamacpp.rpc_layer_split(layers, members, gpus)
    devices = max(gpus, 1)
    owner = [rank for rank in range(1, members) for _ in range(devices)] + [0] * gpus
    assert len(split) == len(owner)
    cumulative = [sum(split[: i + 1]) / sum(split) for i in range(len(split))]
    start = max(layers + 1 - ngl, 0)
    held = [0] * members
    for il in range(layers + 1):  # the output layer is number `layers`
        if il < start:
            rank = 0
        else:
            rank = owner[next(i for i, c in enumerate(cumulative) if c > (il - start) / ngl)]
        held[rank] += il < layers
    assert sum(held) == layers
    assert max(held) - min(held) <= 1 and held[0] == layers // members, held


def test_a_llamacpp_helper_runs_the_rpc_server_on_loopback() -> None:
    helper = two_nodes("llamacpp", 1, host="127.0.0.1", port=41007, extra_args=("--threads", "6", "-np", "2"))
    cmd = llamacpp.rpc_server_command(helper, "/opt/llama/ggml-rpc-server")
    assert cmd.argv == ("/opt/llama/ggml-rpc-server", "-H", "127.0.0.1", "-p", "41007", "-t", "6")
    assert cmd.env == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "2,3", "GGML_RPC_NO_RDMA": "1"}
    assert cmd.files == ()  # it serves no API: no key
    plain = llamacpp.rpc_server_command(attrs.evolve(helper, extra_args=()), "/x/ggml-rpc-server")
    assert plain.argv[-2:] == ("-t", str(llamacpp.physical_cores()))  # not the rpc-server's own 1
    with pytest.raises(LaunchError, match="listens on 127.0.0.1 only, not '10.0.0.6'"):
        llamacpp.rpc_server_command(attrs.evolve(helper, host="10.0.0.6"), "/x/ggml-rpc-server")
    with pytest.raises(LaunchError, match="rank 0 of 2 runs llama-server"):
        llamacpp.rpc_server_command(attrs.evolve(helper, node_rank=0), "/x/ggml-rpc-server")


def test_a_cpu_replica_sees_no_gpu_and_gets_no_optional_flags() -> None:
    cmd = build_command(launch("llamacpp"))
    assert cmd.argv[0] == "llama-server"
    assert "--ctx-size" not in cmd.argv and "--n-gpu-layers" not in cmd.argv
    # Conversations find their own prompt again (see llamacpp._args); the operator's value, after,
    # wins; without the prompt cache in RAM, llama-server's own choice of slot stays.
    assert cmd.argv[-2:] == ("--slot-prompt-similarity", "0")
    off = build_command(launch("llamacpp", extra_args=("--cache-ram", "0")))
    assert "--slot-prompt-similarity" not in off.argv
    # Empty, not unset: unset would let the engine take GPU 0 on a GPU node.
    assert cmd.env["CUDA_VISIBLE_DEVICES"] == ""


def test_the_key_is_never_in_argv_and_in_a_private_file_where_the_engine_reads_one() -> None:
    for engine, where in (("llamacpp", "file"), ("sglang", "file"), ("sim", "file"), ("vllm", "env")):
        cmd = build_command(launch(engine))
        assert not any(KEY in a for a in cmd.argv), engine
        assert not cmd.secret_positions, engine
        in_files = [f for f in cmd.files if KEY in f.content.reveal()]
        in_env = [k for k, v in cmd.env.items() if KEY in v]
        assert (bool(in_files), bool(in_env)) == (where == "file", where == "env"), engine
        for f in cmd.files:
            assert f.path.startswith(PRIVATE + "/") and f.path in cmd.argv, engine  # in the member's own directory
        assert KEY not in str(cmd.for_log()) and KEY not in repr(cmd), engine


def test_sglang_reads_its_key_from_a_yaml_config_file() -> None:
    cmd = build_command(launch("sglang"), "/venv/bin/python")
    at = cmd.argv.index("--config") + 1
    # SGLang requires the .yaml suffix, and replaces the pair "--config FILE" (two entries) by its lines.
    assert cmd.argv[at] == f"{PRIVATE}/api-key.yaml"
    assert cmd.files == (PrivateFile(path=f"{PRIVATE}/api-key.yaml", content=cmd.files[0].content),)
    # A JSON string is a YAML double-quoted scalar: SGLang reads back exactly the key.
    name, value = cmd.files[0].content.reveal().rstrip("\n").split(": ", 1)
    assert (name, json.loads(value)) == ("api-key", KEY)
    assert "--api-key" not in cmd.argv


def test_a_key_file_without_a_private_dir_or_an_empty_key_is_refused() -> None:
    for engine in ("llamacpp", "sglang", "sim"):
        with pytest.raises(LaunchError, match="private_dir '' is not an absolute path"):
            build_command(launch(engine, private_dir=""))
        with pytest.raises(LaunchError, match="private_dir 'keys' is not an absolute path"):
            build_command(launch(engine, private_dir="keys"))
    # A worker serves nothing and gets no key: it needs no directory.
    assert build_command(two_nodes("sim", 1, private_dir="")).files == ()
    for key in ("", "two\nlines", "with space", "#comment"):
        with pytest.raises(LaunchError, match="API key is empty or holds characters"):
            build_command(launch("llamacpp", api_key=Secret(key)))


def test_a_key_variable_the_agent_inherited_does_not_reach_the_engine() -> None:
    # llama-server adds LLAMA_API_KEY's keys to its file's: a stray one would open the port to its holder.
    inherited = {"PATH": "/usr/bin", "LLAMA_API_KEY": "stray", "LLMGW_SIM_API_KEY": "stray"}
    llama = build_command(launch("llamacpp")).environment(inherited)
    assert "LLAMA_API_KEY" not in llama and llama["PATH"] == "/usr/bin" and llama["CUDA_VISIBLE_DEVICES"] == ""
    assert "LLMGW_SIM_API_KEY" not in build_command(launch("sim")).environment(inherited)
    # vLLM's comes from llmgw and wins over an inherited one.
    assert build_command(launch("vllm")).environment({"VLLM_API_KEY": "stray"})["VLLM_API_KEY"] == KEY


def test_for_log_hides_key_variables_by_name_and_shows_file_paths() -> None:
    shown = build_command(launch("vllm", gpus=(0,))).for_log()
    assert shown["env"] == {
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "CUDA_VISIBLE_DEVICES": "0",
        "VLLM_API_KEY": "<redacted>",
    }
    assert build_command(launch("llamacpp")).for_log()["files"] == [f"{PRIVATE}/api-key"]


def test_vllm_single_node() -> None:
    cmd = build_command(launch("vllm", gpus=(0, 1), context=4096))
    assert cmd.argv == (
        "vllm",
        "serve",
        "/w/qwen",
        "--served-model-name",
        "qwen",
        "--host",
        "10.0.0.5",
        "--port",
        "8001",
        "--max-model-len",
        "4096",
        "--tensor-parallel-size",
        "2",
    )
    assert cmd.env == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "0,1", "VLLM_API_KEY": KEY}


def events_config(cmd) -> dict:
    return json.loads(cmd.argv[cmd.argv.index("--kv-events-config") + 1])


def test_kv_cache_events_are_bound_where_the_api_listens_when_the_engine_can() -> None:
    # SGLang binds a given IPv4 address with "bind": true; vLLM binds only "*" (it dials any other).
    assert events_config(build_command(launch("sglang", events_port=8002))) == {
        "publisher": "zmq",
        "endpoint": "tcp://10.0.0.5:8002",
        "topic": "kv-events",
        "bind": True,
    }
    assert events_config(build_command(launch("vllm", events_port=8002))) == {
        "publisher": "zmq",
        "endpoint": "tcp://*:8002",
        "topic": "kv-events",
        "enable_kv_cache_events": True,
    }
    for host in ("0.0.0.0", "fd00::5", "node-a.lan"):  # the wildcard, IPv6 (no libzmq IPv6 there), a name
        assert events_config(build_command(launch("sglang", host=host, events_port=8002)))["endpoint"] == "tcp://*:8002"
    ranks = [two_nodes("sglang", rank, events_port=8002) for rank in (0, 1)]
    assert "--kv-events-config" in build_command(ranks[0]).argv
    assert "--kv-events-config" not in build_command(ranks[1]).argv  # rank 0 alone publishes
    assert "--kv-events-config" not in build_command(launch("sglang")).argv


def test_vllm_two_nodes_rank0_serves_and_the_worker_is_headless() -> None:
    rank0 = build_command(two_nodes("vllm", 0))
    worker = build_command(two_nodes("vllm", 1))
    head = ("vllm", "serve", "/w/qwen", "--served-model-name", "qwen", "--host", "10.0.0.5", "--port", "8001")
    parallel = ("--tensor-parallel-size", "2", "--pipeline-parallel-size", "2")  # a node's GPUs; the nodes
    nodes = ("--distributed-executor-backend", "mp", "--nnodes", "2", "--node-rank")
    meet = ("--master-addr", "10.0.0.5", "--master-port", "29500")
    assert rank0.argv == (*head, *parallel, *nodes, "0", *meet)
    assert worker.argv == (*head, *parallel, *nodes, "1", *meet, "--headless")
    assert rank0.env["VLLM_API_KEY"] == KEY
    assert "VLLM_API_KEY" not in worker.env  # a headless worker serves nothing


def test_fabric_pinning_is_exact() -> None:
    env = build_command(two_nodes("vllm", 1)).env
    # "=" asks NCCL for exact names: "mlx5_1" alone would also select mlx5_10..mlx5_19.
    assert env["NCCL_IB_HCA"] == "=mlx5_0,mlx5_1"
    assert env["NCCL_SOCKET_IFNAME"] == "=ib0"
    assert env["GLOO_SOCKET_IFNAME"] == "ib0"
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert "NCCL_IB_HCA" not in build_command(launch("vllm")).env


def test_sglang_two_nodes_spans_every_gpu_with_tensor_parallel() -> None:
    rank0 = build_command(two_nodes("sglang", 0, context=32768), ("/venv/bin/python",))
    assert rank0.argv[:3] == ("/venv/bin/python", "-m", "sglang.launch_server")
    args = rank0.argv[3:]
    assert args[args.index("--tp-size") + 1] == "4"
    assert args[args.index("--context-length") + 1] == "32768"
    assert args[-6:] == ("--nnodes", "2", "--node-rank", "0", "--dist-init-addr", "10.0.0.5:29500")
    worker = build_command(two_nodes("sglang", 1))
    assert "--config" not in worker.argv and KEY not in worker.argv and worker.files == ()
    assert worker.env["NCCL_IB_HCA"] == "=mlx5_0,mlx5_1"


def test_an_ipv6_rank0_is_bracketed() -> None:
    cmd = build_command(attrs.evolve(two_nodes("sglang", 1), rank0_addr="fd00::5"))
    assert cmd.argv[cmd.argv.index("--dist-init-addr") + 1] == "[fd00::5]:29500"


def test_sim_runs_under_the_callers_llmgw() -> None:
    rank0 = build_command(two_nodes("sim", 0), ["/usr/bin/python3", "-m", "llmgw"])
    assert rank0.argv == (
        "/usr/bin/python3",
        "-m",
        "llmgw",
        "engine",
        "sim",
        "--model",
        "qwen",
        "--host",
        "10.0.0.5",
        "--port",
        "8001",
        "--api-key-file",
        f"{PRIVATE}/api-key",
        "--nnodes",
        "2",
        "--node-rank",
        "0",
        "--dist-init-addr",
        "10.0.0.5:29500",
    )
    assert rank0.files[0].content.reveal() == KEY + "\n"
    worker = build_command(two_nodes("sim", 1))
    assert "--api-key-file" not in worker.argv and worker.files == ()


@pytest.mark.parametrize(
    ("replica", "says"),
    [
        (
            launch("llamacpp", nnodes=2, rank0_addr="a", dist_init_port=1, rpc_servers=("127.0.0.1:1", "127.0.0.1:2")),
            "rpc_servers ['127.0.0.1:1', '127.0.0.1:2'] are for rank 0 of a replica, one per other node",
        ),
        (launch("llamacpp", extra_args=("--rpc", "10.0.0.9:50052")), "args set --rpc, which llmgw sets itself"),
        (launch("vllm", nnodes=2), "needs rank0_addr and dist_init_port"),
        (launch("vllm", nnodes=2, node_rank=2, rank0_addr="a", dist_init_port=1), "node_rank 2 is outside 0..1"),
        (launch("sim", port=0), "port 0 is not a TCP port"),
        (launch("sim", gpus=(1, 1)), "must be distinct"),
        (launch("sim", served_name=""), "served_name is empty"),
        (launch("llamacpp", extra_args=("--port", "9000")), "args set --port, which llmgw sets itself"),
        (launch("vllm", extra_args=("-tp", "8")), "args set -tp"),
        (launch("sglang", extra_args=("--api-key=x",)), "args set --api-key"),
    ],
)
def test_a_launch_the_engine_cannot_run_is_refused_with_the_fix(replica: ReplicaLaunch, says: str) -> None:
    with pytest.raises(LaunchError, match="cannot launch") as err:
        build_command(replica)
    assert says in str(err.value)
    assert err.value.exit_status == 2


def test_operator_args_may_tune_what_llmgw_only_defaults() -> None:
    # The context given in args comes last and wins over llmgw's.
    cmd = build_command(launch("llamacpp", context=4096, extra_args=("-c", "8192")))
    assert cmd.argv[-2:] == ("-c", "8192")


def test_unknown_engine_and_mismatched_spec() -> None:
    with pytest.raises(LaunchError, match="unknown engine 'tgi'"):
        spec_for("tgi")
    with pytest.raises(LaunchError, match="for engine 'sim', not 'vllm'"):
        spec_for("vllm").build(launch("sim"))


def test_an_empty_executable_is_a_bug() -> None:
    with pytest.raises(ValueError, match="must name a program"):
        build_command(launch("sim"), [])


def test_the_launch_repr_does_not_show_the_key() -> None:
    assert KEY not in repr(launch("vllm"))


def test_help_commands() -> None:
    assert spec_for("llamacpp").help_command("/x/llama-server").argv == ("/x/llama-server", "--help")
    vllm = spec_for("vllm").help_command(environ={})
    assert vllm.argv == ("vllm", "serve", "--help=all")
    assert vllm.env == {"VLLM_TARGET_DEVICE": "cpu"}
    # An operator's own choice is kept.
    assert spec_for("vllm").help_command(environ={"VLLM_TARGET_DEVICE": "cuda"}).env == {}
    assert spec_for("sglang").help_command("/v/python").argv == ("/v/python", "-m", "sglang.launch_server", "--help")


def test_the_threads_of_a_helper_are_its_physical_cores(tmp_path: Path) -> None:
    """Hyperthread siblings count once; a CPU sysfs does not describe counts as a core."""
    for cpu, siblings in ((0, "0,2"), (1, "1,3"), (2, "0,2"), (3, "1,3"), (4, "4")):
        (tmp_path / f"cpu{cpu}" / "topology").mkdir(parents=True)
        (tmp_path / f"cpu{cpu}" / "topology" / "thread_siblings_list").write_text(siblings + "\n")
    assert llamacpp.physical_cores([0, 1, 2, 3, 4], sysfs=tmp_path) == 3
    assert llamacpp.physical_cores([0, 2], sysfs=tmp_path) == 1
    assert llamacpp.physical_cores([0, 7], sysfs=tmp_path) == 2
    assert llamacpp.physical_cores([], sysfs=tmp_path) == 1
