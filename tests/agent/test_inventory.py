"""The hello's inventory is what discovery found, and it crosses the wire intact."""

from __future__ import annotations

from pathlib import Path

from agent import inventory
from agent.discovery.snapshot import discover
from llmgw.config import AgentConfig, FabricDecl
from llmgw.wire import agent_link as w
from llmgw.wire.convert import decode, encode
from testlib.hardware import sources


def hello(inv: w.Inventory) -> w.Hello:
    return w.Hello(
        protocol_version=w.PROTOCOL_VERSION,
        node_id="n1",
        agent_version="test",
        boot_id="b",
        started_at=1.0,
        inventory=inv,
    )


def test_a_gpu_node_on_two_fabrics(tmp_path: Path) -> None:
    snap = discover(sources(weights_dir=tmp_path, proc="hgx-h100", pci="hgx-h100", gpu="h100", ib="two-fabrics"))
    inv = inventory.inventory_of(snap, [FabricDecl(name="ib-a"), FabricDecl(name="ib-b", adapters=("mlx5_2",))])
    assert inv.cpu_model == "Intel(R) Xeon(R) Platinum 8480+" and inv.cpu_cores == 8 and "avx512f" in inv.cpu_flags
    assert inv.memory_total_bytes == 2113642496 * 1024 and inv.memory_available_bytes > 0
    assert inv.disk_free_bytes > 0 and inv.weights_dir == str(tmp_path)
    assert inv.gpu_status == w.GPUS_PRESENT and len(inv.gpus) == 8
    assert inv.engine_eligibility == (
        w.EngineEligibility(
            engine="vllm",
            status=w.ELIGIBLE,
            reason="8 GPU(s) with compute capability 7.5 or newer, driver 550.54.15",
        ),
        w.EngineEligibility(
            engine="sglang",
            status=w.INELIGIBLE,
            reason="NVIDIA driver 550.54.15 is older than 580.65.06, the oldest SGLang's CUDA 13 runs on; "
            "upgrade the driver",
        ),
    )
    assert [a.name for a in inv.ib_adapters] == ["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3"]
    assert [(g.identity, g.adapters) for g in inv.fabric_groups] == [
        ("ib-sm:0x0002c90300a1b2c3", ("mlx5_0", "mlx5_1")),
        ("ib-sm:0x98039b0300c0ffee", ("mlx5_2", "mlx5_3")),
    ]
    assert inv.fabrics == (
        w.Fabric(name="ib-a", identity="ib-sm:0x0002c90300a1b2c3", adapters=("mlx5_0", "mlx5_1"), kind="infiniband"),
        w.Fabric(name="ib-b", identity="ib-sm:0x98039b0300c0ffee", adapters=("mlx5_2",), kind="infiniband"),
    )
    assert inv.fabric_problems == ()
    assert decode(encode(hello(inv)), w.AgentMessage).inventory == inv


def test_a_refused_declaration_is_not_sent_as_a_fabric_but_said(tmp_path: Path) -> None:
    snap = discover(sources(weights_dir=tmp_path, ib="one-fabric"))
    twice = [FabricDecl(name="ib-a", adapters=("mlx5_0", "mlx5_1")), FabricDecl(name="ib-b", adapters=("mlx5_1",))]
    inv = inventory.inventory_of(snap, twice)
    assert inv.fabrics == ()
    assert len(inv.fabric_problems) == 2
    assert inv.fabric_problems[0].startswith("adapter 'mlx5_1' is under fabrics 'ib-a' and 'ib-b'")
    assert "; fix: name mlx5_1 under one fabric only" in inv.fabric_problems[0]


def test_a_cpu_node(tmp_path: Path) -> None:
    inv = inventory.collect(sources=sources(weights_dir=tmp_path))
    assert inv.gpu_status == w.GPUS_NONE and inv.gpus == ()
    assert [(e.engine, e.status) for e in inv.engine_eligibility] == [
        ("vllm", w.NOT_APPLICABLE),
        ("sglang", w.NOT_APPLICABLE),
    ]
    assert inv.ib_adapters == () and inv.fabric_groups == () and inv.fabrics == ()


def test_collect_reads_the_agent_config(tmp_path: Path) -> None:
    config = AgentConfig(
        server="wss://127.0.0.1:7443",
        nvidia_smi=str(tmp_path / "nowhere" / "nvidia-smi"),
        ib_root=str(tmp_path / "no-ib"),
        state_dir=str(tmp_path / "state"),
    )
    inv = inventory.collect(config)
    assert inv.weights_dir == str(tmp_path / "state" / "weights")
    assert inv.gpu_detail.startswith(f"no NVIDIA GPU (no nvidia-smi at {tmp_path / 'nowhere' / 'nvidia-smi'}")
    assert inv.ib_adapters == ()


def test_an_older_agents_inventory_still_parses() -> None:
    old = '{"hostname":"h","os":"linux","arch":"x86_64","python":"3.11","cpu_model":"c","cpu_cores":1}'
    inv = decode(
        '{"type":"hello","protocol_version":%d,"node_id":"n","agent_version":"v","boot_id":"b","started_at":1,'
        '"inventory":%s}' % (w.PROTOCOL_VERSION, old),
        w.AgentMessage,
    ).inventory
    assert inv.gpu_status == w.GPUS_UNKNOWN and inv.engine_eligibility == () and inv.fabric_groups == ()


def test_vulkan_devices_cross_the_wire_with_the_software_one_marked(tmp_path: Path) -> None:
    inv = inventory.inventory_of(discover(sources(weights_dir=tmp_path, vulkan="radv")))
    assert inv.vulkan_status == w.VULKAN_PRESENT
    assert [(d.name, d.type, d.software) for d in inv.vulkan] == [
        ("AMD Radeon RX 7900 XTX (RADV NAVI31)", w.VULKAN_DISCRETE, False),
        ("llvmpipe (LLVM 15.0.6, 256 bits)", w.VULKAN_CPU, True),
    ]
    assert inv.vulkan_detail.startswith("AMD Radeon RX 7900 XTX (RADV NAVI31) (discrete, radv, Vulkan 1.3, 24.0 GiB)")
    assert decode(encode(hello(inv)), w.AgentMessage).inventory == inv


def test_vulkan_missing_is_said_with_its_fix_and_an_older_agent_says_nothing(tmp_path: Path) -> None:
    inv = inventory.inventory_of(discover(sources(weights_dir=tmp_path)))
    assert inv.vulkan_status == w.VULKAN_MISSING and inv.vulkan == ()
    assert "; fix: `apt-get install vulkan-tools mesa-vulkan-drivers`" in inv.vulkan_detail
    old = w.Inventory(hostname="h", os="linux", arch="x86_64", python="3.11", cpu_model="c", cpu_cores=1)
    assert (old.vulkan_status, old.vulkan) == (w.VULKAN_UNKNOWN, ())
