"""How `llmgw ctl nodes` shows a node's engines: an install under way with its percentage and
phase, a failure with why, the GPU engines a node was not asked for with why (pure)."""

from __future__ import annotations

import attrs

from llmgw.config import EngineSource, EnginesSection, LlamacppSource
from llmgw.ctl import engines as texts
from llmgw.ctl.tables import format_nodes, vulkan_text
from llmgw.server.state.registry import Node
from llmgw.server.state.views import engine_view, node_view
from llmgw.wire import agent_link as w


def view(*statuses: w.EngineStatus, inv: w.Inventory | None = None, config: EnginesSection | None = None) -> dict:
    node = Node(node_id="node-a")
    node.engines = statuses
    node.inventory = inv
    return node_view(node, "joined", 0.0, config or EnginesSection())


CPU = w.Inventory(
    hostname="a", os="linux", arch="x86_64", python="3.11", cpu_model="c", cpu_cores=2, gpu_status=w.GPUS_NONE
)


def test_an_install_under_way_shows_its_percentage_and_phase() -> None:
    building = w.EngineStatus(
        name="llamacpp", version="b6000", ok=False, state=w.ENGINE_INSTALLING, phase="build", percent=40
    )
    v = view(building, w.EngineStatus(name="sim", version="1", ok=True, state=w.ENGINE_OK), inv=CPU)
    assert v["engines"][0] == {
        "name": "llamacpp",
        "version": "b6000",
        "ok": False,
        "detail": "",
        "state": "installing",
        "phase": "build",
        "percent": 40,
        "cpu_backend": "",
        "cpu_note": "",
    }
    assert texts.notes(v)[0] == "installing llama.cpp 40% (build)"
    row = format_nodes([v]).splitlines()[1]
    assert "llamacpp(installing 40%),sim" in row and "failed" not in row


def test_an_upgrade_keeps_the_version_in_use_and_says_so() -> None:
    upgrading = w.EngineStatus(name="vllm", version="0.32.0", ok=True, state=w.ENGINE_INSTALLING, phase="install")
    assert texts.notes(view(upgrading))[0] == "installing vLLM (install); vLLM 0.32.0 stays in use until it is checked"


def test_a_failure_says_why_and_a_gpu_engine_not_asked_for_says_why() -> None:
    failed = w.EngineStatus(name="vllm", version="0.32.1", ok=False, detail="pip could not install", state="failed")
    assert texts.notes(view(failed)) == ["vllm failed: pip could not install"]
    named = EnginesSection(sglang=EngineSource(version="0.5.23"))
    notes = texts.notes(view(inv=CPU, config=named))
    assert notes == [
        "vllm: not applicable (no NVIDIA GPU; vLLM runs on NVIDIA GPUs, llama.cpp serves this node)",
        "sglang: not applicable (no NVIDIA GPU; SGLang runs on NVIDIA GPUs, llama.cpp serves this node)",
    ]
    assert "not applicable" in format_nodes([view(inv=CPU)]).splitlines()[1]  # the VLLM column


def test_an_agent_older_than_the_state_field_reads_by_ok() -> None:
    assert engine_view(w.EngineStatus(name="sim", version="1", ok=True))["state"] == "ok"
    old_failed = engine_view(w.EngineStatus(name="llamacpp", version="", ok=False, detail="x"))
    assert (old_failed["state"], old_failed["phase"], old_failed["percent"]) == ("failed", "", None)


KVM64 = w.Inventory(
    hostname="a",
    os="linux",
    arch="x86_64",
    python="3.11",
    cpu_model="Common KVM processor",
    cpu_cores=2,
    cpu_flags=("fpu", "lm", "sse2"),
    gpu_status=w.GPUS_NONE,
)


def test_the_cpu_backend_llama_cpp_loaded_is_shown_and_the_baseline_in_a_vm_says_why_and_the_fix() -> None:
    host = w.EngineStatus(name="llamacpp", version="b11434", ok=True, state=w.ENGINE_OK, cpu_backend="haswell")
    sim = w.EngineStatus(name="sim", version="1", ok=True, state=w.ENGINE_OK)
    v = view(host, sim, inv=CPU)
    assert (v["engines"][0]["cpu_backend"], v["engines"][0]["cpu_note"]) == ("haswell", "")
    assert "llamacpp[haswell],sim" in format_nodes([v]).splitlines()[1]
    assert not [n for n in texts.notes(v) if n.startswith("llamacpp")]
    baseline = w.EngineStatus(name="llamacpp", version="b11434", ok=True, state=w.ENGINE_OK, cpu_backend="x64")
    v = view(baseline, sim, inv=KVM64)
    assert "llamacpp[x64],sim" in format_nodes([v]).splitlines()[1]
    [note] = [n for n in texts.notes(v) if n.startswith("llamacpp")]
    assert note.startswith("llamacpp: llama.cpp loaded its x64 CPU backend, without AVX2: this CPU hides")
    assert "generic virtual CPU model kvm64" in note and "`qm set VMID --cpu host`" in note
    assert v["engines"][0]["cpu_note"] == note.removeprefix("llamacpp: ")


def test_an_engine_unavailable_on_the_node_says_so_with_the_reason() -> None:
    why = "this node cannot build llama.cpp: missing on the agent's PATH (/usr/bin): cmake; install them: apt-get ..."
    gone = w.EngineStatus(name="llamacpp", version="b11434", ok=False, detail=why, state=w.ENGINE_UNAVAILABLE)
    v = view(gone, w.EngineStatus(name="sim", version="1", ok=True, state=w.ENGINE_OK), inv=CPU)
    assert v["engines"][0]["state"] == "unavailable"
    assert "llamacpp(unavailable),sim" in format_nodes([v]).splitlines()[1]
    assert texts.notes(v)[0] == f"llamacpp: unavailable: {why}"


def test_the_table_counts_and_names_each_nodes_replicas() -> None:
    def holding(*replicas: str) -> dict:
        node = Node(node_id="node-a")
        node.replicas = tuple(w.ReplicaStatus(replica_id=r, model="m", state=w.READY) for r in replicas)
        return node_view(node, "joined", 0.0, EnginesSection())

    lines = format_nodes([holding(), holding("chat-1", "chat-2"), holding(*(f"m-{i}" for i in range(5)))]).splitlines()
    header = lines[0].split()
    assert header[:3] == ["NODE", "STATE", "REPLICAS"]
    assert [line.split()[2] for line in lines[1:]] == ["0", "2:", "5:"]
    assert "2: chat-1,chat-2 " in lines[2] and "5: m-0,m-1,m-2,+2 " in lines[3]


def test_each_backends_measured_speed_is_a_line_under_the_nodes_table() -> None:
    node = Node(node_id="node-a")
    node.engines = (w.EngineStatus(name="llamacpp", version="b11434", ok=True, state=w.ENGINE_OK),)
    node.speeds = (
        w.BackendSpeed(engine="llamacpp", backend="cpu", state=w.SPEED_OK, prompt_tps=850.4, gen_tps=42.2),
        w.BackendSpeed(
            engine="llamacpp",
            backend="cuda",
            device="CUDA0",
            state=w.SPEED_FAILED,
            prompt_tps=9000.0,
            gen_tps=300.0,
            detail="llama-server exited with 1 before it served",
        ),
        w.BackendSpeed(
            engine="llamacpp", backend="vulkan", state=w.SPEED_WAITING, detail="its replicas are busy (1.5 cores)"
        ),
    )
    v = node_view(node, "joined", 0.0, EnginesSection())
    assert texts.notes(v) == [
        "llama.cpp cpu: 850 prompt tok/s, 42 gen tok/s",
        "llama.cpp cuda (CUDA0): 9000 prompt tok/s, 300 gen tok/s; measurement failed: llama-server exited with 1 "
        "before it served",
        "llama.cpp vulkan: waiting: its replicas are busy (1.5 cores)",
    ]


def test_measure_speed_false_says_llamacpp_is_not_measured_and_how_to_measure() -> None:
    node = Node(node_id="node-a")
    node.engines = (w.EngineStatus(name="llamacpp", version="b11434", ok=True, state=w.ENGINE_OK),)
    quiet = EnginesSection(llamacpp=LlamacppSource(measure_speed=False))
    assert texts.notes(node_view(node, "joined", 0.0, quiet)) == [texts.NOT_MEASURED]
    assert "measure_speed = false" in texts.NOT_MEASURED and "`llmgw ctl nodes bench`" in texts.NOT_MEASURED
    assert texts.notes(node_view(node, "joined", 0.0, EnginesSection())) == []  # on: it is being measured
    # Measured once asked: the figures, nothing more.
    node.speeds = (w.BackendSpeed(engine="llamacpp", backend="cpu", state=w.SPEED_OK, prompt_tps=850, gen_tps=42),)
    assert texts.notes(node_view(node, "joined", 0.0, quiet)) == ["llama.cpp cpu: 850 prompt tok/s, 42 gen tok/s"]
    # No working llama.cpp: nothing to measure, nothing said about it.
    node.speeds = ()
    node.engines = (w.EngineStatus(name="llamacpp", version="b11434", ok=False, state=w.ENGINE_FAILED, detail="x"),)
    assert texts.NOT_MEASURED not in texts.notes(node_view(node, "joined", 0.0, quiet))


def test_ctl_nodes_bench_prints_the_figures_that_answer_its_request_or_why_not() -> None:
    from llmgw.ctl.bench import bench_text
    from llmgw.server.state.views import speed_view

    new = speed_view(
        w.BackendSpeed(engine="llamacpp", backend="cpu", state=w.SPEED_OK, prompt_tps=800, gen_tps=40, request="r")
    )
    old = {**new, "request": "before", "gen_tps": 10.0}
    answer = {
        "request": "r",
        "nodes": [
            {"node": "a", "asked": True, "done": True, "speeds": [new]},
            {"node": "b", "asked": True, "done": False, "speeds": [old]},
            {"node": "c", "asked": False, "error": "node c is not connected; ask again once it is", "speeds": []},
        ],
    }
    assert bench_text(answer).splitlines() == [
        "a: llama.cpp cpu: 800 prompt tok/s, 40 gen tok/s",
        "b: still measuring when the wait ended; see `llmgw ctl nodes` later",
        "c: not asked: node c is not connected; ask again once it is",
    ]


def test_a_nodes_vulkan_gpus_are_a_line_under_the_table_and_a_software_device_alone_is_none() -> None:
    radv = w.VulkanDevice(
        index=0,
        name="AMD Radeon RX 7900 XTX (RADV NAVI31)",
        type=w.VULKAN_DISCRETE,
        vendor_id="0x1002",
        driver_name="radv",
        api_version="1.3.230",
        heaps=(w.VulkanHeap(size_bytes=25753026560, device_local=True), w.VulkanHeap(size_bytes=32 << 30)),
    )
    lavapipe = w.VulkanDevice(
        index=1,
        name="llvmpipe (LLVM 15.0.6, 256 bits)",
        type=w.VULKAN_CPU,
        vendor_id="0x10005",
        driver_name="llvmpipe",
        api_version="1.3.230",
        software=True,
    )
    v = view(inv=attrs.evolve(CPU, vulkan=(radv, lavapipe), vulkan_status=w.VULKAN_PRESENT))
    assert [(d["type"], d["software"], d["vram_bytes"]) for d in v["vulkan"]] == [
        ("discrete", False, 25753026560),
        ("cpu", True, 0),
    ]
    assert vulkan_text(v) == "vulkan: AMD Radeon RX 7900 XTX (RADV NAVI31) (discrete, radv, Vulkan 1.3, 24.0 GiB)"
    assert vulkan_text(view(inv=attrs.evolve(CPU, vulkan=(lavapipe,), vulkan_status=w.VULKAN_PRESENT))) == ""
    assert vulkan_text(view(inv=attrs.evolve(CPU, vulkan_status=w.VULKAN_MISSING, vulkan_detail="no vulkaninfo"))) == ""
    failed = view(inv=attrs.evolve(CPU, vulkan_status=w.VULKAN_FAILED, vulkan_detail="vulkaninfo at X hangs"))
    assert vulkan_text(failed) == "vulkan: vulkaninfo at X hangs"
    assert (view()["vulkan"], view()["vulkan_status"]) == ([], None)  # a node not heard from yet
